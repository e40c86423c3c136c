"""Fixtures for the serving tests: the tiny model, an adapter trained to answer a fixed string, a live server."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.procs import free_port, serving

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
    return conversation_ids(tokenizer, [], content)


def conversation_ids(tokenizer, turns: list[tuple[str, list[int]]], question: str) -> list[int]:
    """The chat template's ids of `turns` (user text, the reply's token ids) and then `question`."""
    messages = []
    for text, reply in turns:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": tokenizer.decode(reply)}]
    messages.append({"role": "user", "content": question})
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
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


@dataclass
class LiveServer:
    url: str
    api_key: str
    adapter_root: Path
    log: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@contextmanager
def running_server(run_dir: Path, adapter_root: Path, *overrides: str, python: str = sys.executable):
    """`python serve.py model=tiny` on a free port with an API key, adapters under `adapter_root`."""
    port = free_port()
    log = run_dir / "server.log"
    cmd = [python, "serve.py", "model=tiny", f"serve.port={port}", f"hydra.run.dir={run_dir}",
           f"serve.adapter_root={adapter_root}", "serve.request_timeout_s=120", *overrides]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, f"{url}/health", log, env={"METACLAW_API_KEY": API_KEY}):
        yield LiveServer(url=url, api_key=API_KEY, adapter_root=adapter_root, log=log)


@pytest.fixture(scope="session")
def server(tmp_path_factory, adapter_root) -> Iterator[LiveServer]:
    """The policy server on the tiny model with the HF engine (the in-process `engine` these tests compare it with),
    shared by the session; its process group is killed at the end."""
    with running_server(tmp_path_factory.mktemp("serve-run"), adapter_root, "backend.cpu_engine=hf") as live:
        yield live


VLLM_VENV = REPO / ".venv-vllm"


def need_vllm_env() -> Path:
    """vLLM's own environment (scripts/setup_vllm_cpu.sh); the `vllm` tests skip without it, saying so."""
    if not (VLLM_VENV / "bin" / "python").is_file():
        pytest.skip(f"no vLLM environment at {VLLM_VENV}: bash scripts/setup_vllm_cpu.sh (make test-vllm does)")
    return VLLM_VENV


@pytest.fixture(scope="module")
def vllm_http(tiny_spec, tmp_path_factory):
    """A stock vLLM OpenAI server on the tiny model, from `.venv-vllm`, behind `VLLMServerEngine`."""
    from metaclaw.serving.engines.vllm_http import VLLMServerEngine

    venv = need_vllm_env()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    engine = VLLMServerEngine.from_spec(
        tiny_spec,
        venv=str(venv),
        log_file=str(log),
        max_loras=2,
        max_lora_rank=16,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
    )  # CPU: a share of RAM
    yield engine
    engine.close()
