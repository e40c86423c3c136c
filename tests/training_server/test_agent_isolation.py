"""Two seed-000 clients (two agents) driving one training server concurrently never see each other's weights,
samples or files: saves are namespaced per session, a request without `session_id` is refused while two
sessions live, and each session's sample memory is its own."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .helpers import PROMPT, datum
from .launch import Server, training_server


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with training_server(tmp_path_factory.mktemp("isolation")) as server:
        yield server


def _digest(directory: str) -> str:
    return hashlib.sha256((Path(directory) / "adapter_model.safetensors").read_bytes()).hexdigest()


def _client(srv: Server, sid: str, continuation: list[int], steps: int, barrier: threading.Barrier) -> dict:
    """What one MetaClaw instance does: train its own data, save under the shared default names, sample, resume."""
    batch = [datum(PROMPT, continuation, 1.0), datum(PROMPT[:3], continuation[::-1], -0.5)]
    for _ in range(steps):
        srv.ok("/v1/train/forward_backward", {"session_id": sid, "datums": batch})
        srv.ok("/v1/train/optim_step", {"session_id": sid, "learning_rate": 5e-2})
    saved = srv.ok("/v1/weights/save", {"session_id": sid, "name": "openclaw_lora"})
    digest = _digest(saved["adapter_path"])
    ckpt = srv.ok("/v1/checkpoint/save", {"session_id": sid, "name": "latest"})
    barrier.wait(timeout=120)  # both have saved under the same names before anyone reads back
    body = {"session_id": sid, "tokens": PROMPT + continuation, "max_tokens": 1, "prompt_logprobs": True}
    scored = srv.ok("/v1/sample", body)["prompt_logprobs"]
    sampled = srv.ok("/v1/sample", {"session_id": sid, "tokens": PROMPT, "max_tokens": 6, "temperature": 0.7})
    implicit = srv.post("/v1/sample", {"tokens": PROMPT, "max_tokens": 1})  # the seed client sends no session_id
    loaded = srv.ok("/v1/checkpoint/load", {"session_id": sid, "path": "latest"})
    return {
        "saved": saved,
        "digest": digest,
        "ckpt": ckpt,
        "scored": scored,
        "sampled": sampled["sequences"][0],
        "implicit": implicit,
        "loaded": loaded,
    }


def test_two_agents_concurrently_never_see_each_others_weights_samples_or_files(srv: Server) -> None:
    a, b = srv.create(), srv.create()
    barrier = threading.Barrier(2)
    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(_client, srv, a, [120, 33, 250, 61], 2, barrier)
        fb = pool.submit(_client, srv, b, [7, 8, 9, 10], 3, barrier)
        ra, rb = fa.result(timeout=300), fb.result(timeout=300)

    # files: the same name lands in two namespaces; neither save overwrote the other
    assert ra["saved"]["adapter_path"] != rb["saved"]["adapter_path"]
    assert Path(ra["saved"]["adapter_path"]).parent.name == a and Path(rb["saved"]["adapter_path"]).parent.name == b
    assert _digest(ra["saved"]["adapter_path"]) == ra["digest"] != rb["digest"] == _digest(rb["saved"]["adapter_path"])
    assert ra["ckpt"]["path"] != rb["ckpt"]["path"]
    # resume by bare name: each loads its own checkpoint (2 vs 3 steps)
    assert ra["loaded"]["step"] == 2 and rb["loaded"]["step"] == 3
    # another live session's checkpoint is not loadable, by namespace or by absolute path
    for path in (f"{b}/latest", rb["ckpt"]["path"]):
        r = srv.post("/v1/checkpoint/load", {"session_id": a, "path": path})
        assert r.status_code == 403 and r.json()["error"]["param"] == "path", r.text

    # samples: each session is scored with its own adapter; without session_id nobody gets the other's
    assert ra["scored"] != rb["scored"]
    for r in (ra["implicit"], rb["implicit"]):
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"

    # the sample memory is per session: B training on A's sample does not pick up A's distribution
    seq = ra["sampled"]
    tokens = PROMPT + seq["tokens"]
    d = {"model_input_tokens": tokens[:-1], "target_tokens": tokens[1:],
         "logprobs": [0.0] * (len(PROMPT) - 1) + seq["logprobs"],
         "advantages": [0.0] * (len(PROMPT) - 1) + [1.0] * len(seq["tokens"])}  # fmt: skip
    own = srv.ok("/v1/train/forward_backward", {"session_id": a, "datums": [d]})["metrics"]
    other = srv.ok("/v1/train/forward_backward", {"session_id": b, "datums": [d]})["metrics"]
    assert own["datums_matched_to_samples"] == 1 and other["datums_matched_to_samples"] == 0

    # once B is gone, A alone is served without session_id, with A's own adapter
    srv.client.delete(f"/v1/lora/{b}").raise_for_status()
    body = {"tokens": PROMPT + [120, 33, 250, 61], "max_tokens": 1, "prompt_logprobs": True}
    assert srv.ok("/v1/sample", body)["prompt_logprobs"] == ra["scored"]
    # B's files outlive B and, with B gone, its checkpoint may be adopted (resume after a restart)
    assert srv.ok("/v1/checkpoint/load", {"session_id": a, "path": rb["ckpt"]["path"]})["step"] == 3
