"""How an evaluation's replies decode by batch size: the HF engine's tokens/s for the same held-out prompts asked
with 32, 8 and 4 requests in flight (one process, base model, T = 1); prints JSON.

    python bench/perf/eval_batch.py                      # SmolLM2-135M, 32 held-out prompts, 24 tokens
    python bench/perf/eval_batch.py --sizes 32 4 --max-tokens 32 --rounds 2

Why `eval.concurrency` is 32 (docs/learning.md "What evaluation costs"): the engine samples the requests waiting
for one model in one left-padded generate, and on a CPU a decode step reads every weight once whatever the batch,
so a batch of 32 costs little more per step than a batch of 4.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from bench.perf.generation import PositionCounter, run_engine  # noqa: E402
from metaclaw.serving.engines.hf import HFEngine  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 8, 4], help="requests in flight")
    p.add_argument("--rounds", type=int, default=1, help="rounds over every size, interleaved (load drifts)")
    add_results_argument(p)
    args = p.parse_args()
    with initialize_config_dir(str(REPO / "src/metaclaw/conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={args.model}"])
    engine = HFEngine.from_spec(instantiate(cfg.model))
    tok = engine.tokenizer
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": t.prompt}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False))
        for t in load_tasks(None, "heldout")[: args.prompts]
    ]  # fmt: skip
    counter = PositionCounter()
    counter.watch(engine._base)
    runs: dict[int, list[dict]] = {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for size in args.sizes:
            engine.batches.clear()
            t0 = time.perf_counter()
            part = run_engine(engine, prompts, None, args.max_tokens, size, counter)
            part["batches"] = dict(engine.batches)
            part["wall_s"] = time.perf_counter() - t0
            runs.setdefault(size, []).append(part)
    out = {
        "model": args.model,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "torch_threads": torch.get_num_threads(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "tokens_per_s": {
            str(size): round(sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs), 1)
            for size, rs in runs.items()
        },  # fmt: skip
        "wall_s": {str(size): round(sum(r["wall_s"] for r in rs) / len(rs), 2) for size, rs in runs.items()},
        "batches": {str(size): rs[-1]["batches"] for size, rs in runs.items()},
    }
    smallest, largest = str(min(args.sizes)), str(max(args.sizes))
    out[f"b{largest}_over_b{smallest}"] = round(out["tokens_per_s"][largest] / out["tokens_per_s"][smallest], 2)
    publish(__file__, args, out)


if __name__ == "__main__":
    main()
