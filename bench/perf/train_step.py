"""Training step: `OnlineRLModule` under a Lightning Trainer vs a hand-written PyTorch+PEFT loop, same batch.

Both run the identical objective (policy logprobs at the sampler's temperature, scalar-reward advantages,
token-mean importance-sampling loss, grad-norm clipping at 1.0, AdamW) on two copies of the same LoRA policy.
Rounds alternate between the two so machine noise hits both alike; the first step of each round is warm-up.

    python bench/perf/train_step.py [--model smollm2_135m|tiny] [--batch 4] [--seq 256] [--rounds 3] [--steps 4]

Prints JSON: median seconds per step for each loop, tokens/s, and the Lightning/hand ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from bench.harness.models import model_names, model_spec  # noqa: E402
from metaclaw.advantages import RLAdvantage  # noqa: E402
from metaclaw.datamodules.rollout import collate_samples  # noqa: E402
from metaclaw.losses import ImportanceSamplingLoss  # noqa: E402
from metaclaw.modules.online_rl import OnlineRLModule  # noqa: E402
from metaclaw.modules.policy import LoraPolicy  # noqa: E402
from metaclaw.store import Sample  # noqa: E402


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(batch):
        ids = torch.randint(5, vocab, (seq,), generator=g).tolist()
        prompt, response = ids[: seq // 2], ids[seq // 2 :]
        lp = (-torch.rand(len(response), generator=g) * 3).tolist()
        samples.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                behaviour_logprobs=lp,
                reward=float(i % 2 * 2 - 1),
                temperature=0.7,
                id=i + 1,
            )
        )
    return collate_samples(samples, pad_id=0)


def hand_steps(policy: LoraPolicy, batch: dict, steps: int, lr: float) -> list[float]:
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    mask = batch["mask"]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lp = policy.logprobs(batch["input_ids"], batch["target_ids"], batch["attention_mask"], batch["temperature"])
        adv = batch["reward"].view(-1, 1) * mask
        ratio = torch.exp(lp - batch["behaviour_logprobs"])
        loss = -(ratio * adv * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._t0)


def lightning_steps(policy: LoraPolicy, batch: dict, steps: int, lr: float) -> list[float]:
    module = OnlineRLModule(policy, ImportanceSamplingLoss(), RLAdvantage(), partial(torch.optim.AdamW, lr=lr))
    timer = StepTimer()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[timer],
    )
    trainer.fit(module, DataLoader([batch] * steps, batch_size=None))
    return timer.times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2_135m", choices=model_names())
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    add_results_argument(ap)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    spec = model_spec(args.model)
    base = spec.load_model()
    hand_policy = LoraPolicy(base, rank=16, alpha=32)
    lit_policy = copy.deepcopy(hand_policy)
    batch = make_batch(base.config.vocab_size, args.batch, args.seq)
    hand, lit = [], []
    for _ in range(args.rounds):
        hand += hand_steps(hand_policy, batch, args.steps, args.lr)[1:]
        lit += lightning_steps(lit_policy, batch, args.steps, args.lr)[1:]
    tokens = int(batch["attention_mask"].sum())
    h, m = statistics.median(hand), statistics.median(lit)
    publish(
        __file__,
        args,
        {
            "model": args.model,
            "batch": args.batch,
            "seq": args.seq,
            "tokens_per_step": tokens,
            "steps_measured_each": len(hand),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "hand_s_per_step_median": round(h, 4),
            "lightning_s_per_step_median": round(m, 4),
            "hand_tokens_per_s": round(tokens / h, 1),
            "lightning_tokens_per_s": round(tokens / m, 1),
            "lightning_over_hand": round(m / h, 4),
        },
    )


if __name__ == "__main__":
    main()
