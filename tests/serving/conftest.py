"""Fixtures for the serving tests: the tiny model, an adapter trained to answer a fixed string, a live server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[2]
FIXED_ANSWER = "The answer is 42."
PROMPTS = ["hi", "What is the capital of France?", "Call the weather tool for Berlin.", "Hello, how are you today?"]
API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def tiny_spec():
    from metaclaw.modules.loading import ModelSpec, TinyQwen3

    return ModelSpec(name="tiny", path="tiny", dtype="float32", max_seq_len=1024, tiny=TinyQwen3())


@pytest.fixture(scope="session")
def engine(tiny_spec):
    from metaclaw.serving.engines.hf import HFEngine

    return HFEngine.from_spec(tiny_spec)


def chat_ids(tokenizer, content: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def train_fixed_answer_adapter(spec, directory: Path, steps: int = 25) -> Path:
    """SFT a LoRA on the tiny model until it answers FIXED_ANSWER to every prompt; save it with safetensors."""
    from metaclaw.modules.policy import LoraPolicy

    torch.manual_seed(0)
    tok = spec.load_tokenizer()
    policy = LoraPolicy(spec.load_model(), rank=8, alpha=16)
    target = tok(FIXED_ANSWER)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    rows = [chat_ids(tok, p) + target for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (p, row) in enumerate(zip(PROMPTS, rows, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        n_prompt = len(chat_ids(tok, p))
        labels[i, n_prompt - 1 : len(row) - 1] = torch.tensor(row[n_prompt:])
    mask = (ids != tok.pad_token_id).long()
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
    policy.train()
    for _ in range(steps):
        logits = policy(ids, mask)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return policy.save_adapter(directory)


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="session")
def fixed_adapter(tiny_spec, adapter_root) -> Path:
    """`adapter_root/step-000007`: a LoRA that makes the tiny model answer FIXED_ANSWER."""
    return train_fixed_answer_adapter(tiny_spec, adapter_root / "step-000007")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    api_key: str
    adapter_root: Path
    log: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@pytest.fixture(scope="session")
def server(tmp_path_factory, adapter_root) -> Iterator[LiveServer]:
    """`python serve.py model=tiny` on a free port with an API key; killed (process group) at the end."""
    port = free_port()
    run_dir = tmp_path_factory.mktemp("serve-run")
    log = run_dir / "server.log"
    env = {**os.environ, "METACLAW_API_KEY": API_KEY}
    cmd = [sys.executable, "serve.py", "model=tiny", f"serve.port={port}", f"hydra.run.dir={run_dir}",
           f"serve.adapter_root={adapter_root}", "serve.request_timeout_s=120"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not become healthy:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield LiveServer(url=url, api_key=API_KEY, adapter_root=adapter_root, log=log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
