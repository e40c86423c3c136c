"""HF engine batching: replies per minute with concurrent requests, one at a time vs batched; prints JSON.

    python bench/hf_batching.py                                  # SmolLM2-135M on CPU, 16 requests, 4 at once
    python bench/hf_batching.py --model tiny --requests 8        # smoke

The simulated user's requests (held-out task prompts in the chat template, `max_tokens` 24, T = 1) are sent from
`--concurrency` threads to one in-process `HFEngine` (the engine the policy server runs), first with
`max_batch_size=1` (one request at a time: the engine before batching), then with `--batch-size`, on the same
prompts, one after the other in the same process. Reports wall time, replies per minute, generated tokens per
second and the batch sizes the engine ran (`engine.batches`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from metaclaw.config import CONFIG_DIR  # noqa: E402
from metaclaw.serving.engines.hf import HFEngine  # noqa: E402
from metaclaw.serving.sampling import SamplingParams  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402


def measure(engine: HFEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict[str, Any]:
    engine.batches.clear()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda ids: engine.generate(ids, SamplingParams(**params.__dict__))[0], prompts))
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "max_batch_size": engine.max_batch_size,
        "wall_s": round(wall, 2),
        "replies_per_min": round(60 * len(outs) / wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
        "tokens": tokens,
        "batches": dict(sorted(engine.batches.items())),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[f"model={args.model}"])
    spec = instantiate(cfg.model)
    engine = HFEngine.from_spec(spec)
    tasks = load_tasks(None, "heldout") + load_tasks(None, "train")
    prompts = [
        list(engine.tokenizer.apply_chat_template([{"role": "user", "content": t.prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
        for t in tasks[: args.requests]
    ]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    engine.generate(prompts[0], SamplingParams(max_tokens=2))  # warm-up
    runs = []
    for size in (1, args.batch_size):
        engine.max_batch_size = size
        runs.append(measure(engine, prompts, params, args.concurrency))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    machine = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0]}
    report = {
        "model": args.model,
        "machine": machine,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "speedup": round(runs[0]["wall_s"] / runs[1]["wall_s"], 2),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
