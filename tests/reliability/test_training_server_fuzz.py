"""Schemathesis against the training server's own published OpenAPI: no 5xx, documented statuses, alive after.

A real server (tiny model, context cut to 128 tokens so generation stays short) on a free port; every operation
gets a bounded number of generated requests, valid and invalid. Sessions are capped at 3, so `lora/create` runs
into its 429 too.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, status_code_conformance

from tests.training_server.launch import API_KEY, Server, training_server

MAX_EXAMPLES = 12
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    overrides = [
        "model.max_seq_len=128",
        "app.limits.max_sessions=3",
        "app.limits.adapter_quota_mb=5",
        "app.limits.checkpoint_quota_mb=5",
        "app.sampling.max_samples=2",
        "app.allow_base_model_switch=false",
    ]
    with training_server(tmp_path_factory.mktemp("fuzz"), overrides) as server:
        yield server
        # alive afterwards: health, and a full create → train → save → sample round trip
        assert httpx.get(f"{server.url}/v1/health", timeout=10).status_code == 200
        for sid in server.sessions():
            server.client.delete(f"/v1/lora/{sid}").raise_for_status()
        sid = server.create()
        datum = {"model_input_tokens": [1, 2, 3], "target_tokens": [2, 3, 4], "logprobs": [0.0, -1.0, -1.0],
                 "advantages": [0.0, 1.0, 1.0]}  # fmt: skip
        server.ok("/v1/train/forward_backward", {"session_id": sid, "datums": [datum]})
        server.ok("/v1/train/optim_step", {"session_id": sid})
        server.ok("/v1/weights/save", {"session_id": sid, "name": "after_fuzz"})
        assert server.ok("/v1/sample", {"session_id": sid, "tokens": [1, 2], "max_tokens": 2})["sequences"]


def _fuzz(operation, mode: GenerationMode, base_url: str) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def run(case) -> None:
        case.call_and_validate(
            base_url=base_url, headers=AUTH, checks=[not_a_server_error, status_code_conformance], timeout=60
        )

    run()


def test_training_server_fuzz_no_5xx(fuzz_server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12, [op.label for op in operations]
    failures = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(operation, mode, fuzz_server.url)
            except Unsatisfiable:  # no parameters to make invalid (health, sessions list)
                assert mode is GenerationMode.NEGATIVE
            except Exception as exc:  # collect every operation's failure, then report them together
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)
