"""One real training server (tiny model) for the Tinker API tests, driven by the official `tinker` SDK.

The tiny model answers to `Qwen/Qwen3-8B-Base` too (`model.name=`), so tinker-cookbook's recipes pick their
plain-text `role_colon` renderer for it; `tiny` still names it (its path).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.training_server.launch import API_KEY, Server, training_server

MODEL_NAME = "Qwen/Qwen3-8B-Base"
TINKER_KEY = f"tml-{API_KEY}"


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    overrides = [f"model.name={MODEL_NAME}", "app.limits.max_sessions=32", "app.tinker.poll_wait_s=5"]
    with training_server(tmp_path_factory.mktemp("tinker_server"), overrides) as srv:
        yield srv


@pytest.fixture(scope="package")
def service(server: Server) -> Iterator:
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=TINKER_KEY)
    yield client
    client.close("success").result(timeout=60)


@pytest.fixture
def fresh_sessions(server: Server) -> Iterator[None]:
    """Each test starts with no live session: all sessions share one adapter shape (rank, LoRA targets)."""
    yield
    for sid in server.sessions():
        server.client.delete(f"/v1/lora/{sid}")
