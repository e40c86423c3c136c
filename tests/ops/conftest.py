"""The scripted upstream of the proxy tests."""

from tests.rollout.conftest import upstream  # noqa: F401 - a fixture
