"""HF engine batching: replies per minute with concurrent requests, one at a time vs batched; prints JSON.

    python bench/perf/hf_batching.py                                  # SmolLM2-135M on CPU, 16 requests, 4 at once
    python bench/perf/hf_batching.py --model tiny --requests 8        # smoke
    python bench/perf/hf_batching.py --clients 2 --requests 24        # clients at machine pace: linger off vs on

The simulated user's requests (held-out task prompts in the chat template, `max_tokens` 24, T = 1) are sent from
`--concurrency` threads to one in-process `HFEngine` (the engine the policy server runs), first with
`max_batch_size=1` (one request at a time: the engine before batching), then with `--batch-size`, on the same
prompts, one after the other in the same process. Reports wall time, replies per minute, generated tokens per
second and the batch sizes the engine ran (`engine.batches`).

`--clients N` measures `backend.batch_linger_s` instead: N clients in a closed loop, each sending its next request
`--think-ms` after its reply (an HTTP round trip and a proxy; a person at machine pace), with the linger off and
at the composed config's value, alternating rounds in the same process (ratios survive a loaded machine).
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

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
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


def closed_loop(engine: HFEngine, prompts: list[list[int]], params: SamplingParams, clients: int, think_s: float,
                linger_s: float) -> dict[str, Any]:  # fmt: skip
    """`clients` threads, each sending its share of `prompts` one after the other, `think_s` after each reply."""
    engine.batches.clear()
    engine.batch_linger_s = linger_s
    engine._queue.last_batch = None

    def client(mine: list[list[int]]) -> int:
        tokens = 0
        for ids in mine:
            tokens += len(engine.generate(ids, SamplingParams(**params.__dict__))[0].token_ids)
            time.sleep(think_s)
        return tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client, [prompts[i::clients] for i in range(clients)]))
    wall = time.perf_counter() - t0
    return {
        "batch_linger_s": linger_s,
        "wall_s": round(wall, 2),
        "replies_per_min": round(60 * len(prompts) / wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
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
    p.add_argument("--clients", type=int, default=0, help="closed-loop clients: measure the batch linger instead")
    p.add_argument("--think-ms", type=float, default=30.0, help="a client's gap between a reply and its next request")
    p.add_argument("--rounds", type=int, default=2, help="alternating off/on rounds (--clients)")
    add_results_argument(p)
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
    machine = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0]}
    if args.clients:
        engine.max_batch_size = int(cfg.backend.max_batch_size)
        linger = float(cfg.backend.batch_linger_s)
        rows = []
        for _ in range(args.rounds):
            for value in (0.0, linger):
                rows.append(closed_loop(engine, prompts, params, args.clients, args.think_ms / 1000, value))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        off = sorted(r["replies_per_min"] for r in rows if r["batch_linger_s"] == 0)
        on = sorted(r["replies_per_min"] for r in rows if r["batch_linger_s"] == linger)
        publish(__file__, args, {
            "model": args.model, "machine": machine, "clients": args.clients, "think_ms": args.think_ms,
            "requests": args.requests, "max_tokens": args.max_tokens, "runs": rows,
            "replies_per_min_median": {"off": off[len(off) // 2], "on": on[len(on) // 2]},
            "speedup": round(on[len(on) // 2] / off[len(off) // 2], 2),
            "load_avg_1m_after": os.getloadavg()[0],
        })  # fmt: skip
        return
    runs = []
    for size in (1, args.batch_size):
        engine.max_batch_size = size
        runs.append(measure(engine, prompts, params, args.concurrency))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    report = {
        "model": args.model,
        "machine": machine,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "speedup": round(runs[0]["wall_s"] / runs[1]["wall_s"], 2),
    }
    report["machine"]["load_avg_1m_after"] = os.getloadavg()[0]
    publish(__file__, args, report)


if __name__ == "__main__":
    main()
