"""One real training server (tiny model) for the whole package, started by `scripts/start_training_server.sh`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.training_server.launch import API_KEY, Server, training_server

__all__ = ["API_KEY", "Server"]


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # the package's tests share this server: room for all their sessions
    with training_server(tmp_path_factory.mktemp("training_server"), ["app.limits.max_sessions=64"]) as srv:
        yield srv


@pytest.fixture(scope="package")
def session_id(server: Server) -> str:
    """One session shared by the tests that only need a session to exist."""
    return server.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})["session_id"]
