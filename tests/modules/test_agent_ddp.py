"""Several agents' adapters under CPU DDP (gloo, 2 processes) through `train.py`.

Each step trains one adapter on both ranks: the adapters published at each step are the batch's, AdamW counted
only each adapter's own steps, every adapter that did not train since its last publish is bit-identical to that
publish in the final checkpoint (AdamW with weight decay and non-zero Adam moments would move it), and both ranks
hold the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from metaclaw.store import Sample, SampleStore

REPO = Path(__file__).resolve().parents[2]


def _fill(path: Path, agents: list[str], zero_reward: int = 0) -> None:
    """Ready samples in this order, rewards +1/-1 in turn (one of each per step), the last `zero_reward` 0."""
    store = SampleStore(path)
    for i, agent in enumerate(agents):
        reward = 0.0 if i >= len(agents) - zero_reward else 1.0 if i % 2 == 0 else -1.0
        prompt = [(7 * i + k) % 1000 + 3 for k in range(8)]
        store.insert(Sample(prompt_ids=prompt, response_ids=[11 + i, 12, 13 + i, 14], behaviour_logprobs=[-3.0] * 4,
                            agent_id=agent, reward=reward, status="ready"))  # fmt: skip
    store.close()


def _ckpt_adapter(state: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights of `adapter`, keyed as in its published safetensors file."""
    marker = f".{adapter}.weight"
    mine = {k: v for k, v in state.items() if k.endswith(marker)}
    return {k.removeprefix("policy.model.").replace(marker, ".weight"): v for k, v in mine.items()}


@pytest.mark.slow
def test_agent_adapters_under_cpu_ddp_one_adapter_per_step_on_both_ranks(tmp_path):
    # carol is not listed: she trains the default adapter. Steps (oldest first): default, alice, alice, bob, and
    # a default step with rewards 0, skipped on both ranks (no backward, no optimizer step) with DDP still in step
    agents = ["carol", "carol", "alice", "alice", "alice", "alice", "bob", "bob", "carol", "carol"]
    _fill(tmp_path / "samples.sqlite", agents, zero_reward=2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    out = subprocess.run(
        [sys.executable, "train.py", "model=tiny", "rollout=store", "method=rl", "logger=none",
         "devices.cpu_processes=2", "data.batch_size=2", "trainer.max_steps=5", "optimizer.lr=0.01",
         "optimizer.weight_decay=0.1", "publish.keep_last=null", "+agents.alice.mode=rl", "+agents.bob.mode=rl",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    adapters = tmp_path / "adapters"
    published = {
        "default": sorted(p.name for p in adapters.glob("step-*")),
        **{a: sorted(p.name for p in (adapters / "agents" / a).glob("step-*")) for a in ("alice", "bob")},
    }
    assert published == {"default": ["step-000001"], "alice": ["step-000002", "step-000003"], "bob": ["step-000004"]}
    store = SampleStore(tmp_path / "samples.sqlite")
    consumed = {s.id: s.claimed_step for s in store.select("consumed")}
    store.close()
    assert consumed == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2, 7: 3, 8: 3, 9: 4, 10: 4}  # one per rank, each once

    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    optimizer = ckpt["optimizer_states"][0]  # AdamW counts each parameter's own steps: only its adapter's steps
    steps = {g["adapter"]: {int(optimizer["state"][i]["step"]) for i in g["params"]} for g in optimizer["param_groups"]}
    assert steps == {"default": {1}, "alice": {2}, "bob": {1}}
    state = ckpt["state_dict"]
    for adapter, last in (("default", adapters / "step-000001"), ("alice", adapters / "agents/alice/step-000003")):
        saved, final = load_file(str(last / "adapter_model.safetensors")), _ckpt_adapter(state, adapter)
        assert saved.keys() == final.keys() and saved
        assert all(torch.equal(saved[k], final[k]) for k in saved), f"{adapter} moved after its last step"

    for latest in (adapters / "latest.json", *adapters.glob("agents/*/latest.json")):
        fingerprints = json.loads(latest.read_text())["rank_fingerprints"]
        assert len(fingerprints) == 2 and fingerprints[0] == fingerprints[1], latest
