"""Prefix reuse across a conversation's turns (`backend.prefix_cache_mb`): generation time per turn with each CPU
engine's prefix cache off and on (HF fp32, ONNX int8), side by side; prints JSON.

    python bench/perf/prefix_reuse.py                      # SmolLM2-135M, 2 conversations at a time, 6 rounds, 3 turns
    python bench/perf/prefix_reuse.py --clients 1 --rounds 4 --engines onnx
    python bench/perf/prefix_reuse.py --system-tokens 1200 # an agent's long, stable system prompt before each one

Both engines run in this one process on the same conversations (the simulated user's held-out tasks, the user's
next message a thanks and the next question, as people and `rollout=simulated_user` talk), T = 1, the composed
config's `backend` settings (batch size, linger) except `prefix_cache_mb`, interleaved conversation round by round
(each round goes through the engine without the cache, then the one with it), so their ratio is fair on a loaded
machine. `--clients` conversations run at once from their own threads (the batched path); each turn sends the
whole conversation so far, as a chat client does; `--system-tokens N` puts the same N-token system prompt (text of
this repo's docs/serving.md, for its length only) first in every conversation, as an agent's instructions and tool
list are. Reported per engine: wall seconds per turn (median and total),
replies per minute, and for the cache the share of prompt tokens read from it instead of computed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.config import CONFIG_DIR, register_resolvers  # noqa: E402
from metaclaw.serving.engines.base import Engine  # noqa: E402
from metaclaw.serving.engines.hf import HFEngine  # noqa: E402
from metaclaw.serving.sampling import SamplingParams  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402
from metaclaw.simulate.user import feedback  # noqa: E402


def conversation(engine: Any, tasks: list[str], max_tokens: int, times: list[float], system: str) -> None:
    """One conversation: each task asked after the previous reply (thanks, then the next question)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": tasks[0]})
    for t in range(len(tasks)):
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)  # fmt: skip
        t0 = time.perf_counter()
        out = engine.generate(list(ids), SamplingParams(max_tokens=max_tokens, temperature=1.0))[0]
        times.append(time.perf_counter() - t0)
        reply = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": feedback([], tasks[t + 1] if t + 1 < len(tasks) else None)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--clients", type=int, default=2, help="conversations at once (the main job: 2)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (the main job: 2 tasks + closing)")
    p.add_argument("--max-tokens", type=int, default=24, help="the simulated user's rollout.max_tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads (train.py's server on 2 cores: 1)")
    p.add_argument("--engines", default="hf,onnx", help="the CPU engines compared, comma-separated: hf, onnx")
    p.add_argument("--system-tokens", type=int, default=0, help="a stable system prompt of about this many tokens")
    add_results_argument(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[f"model={args.model}", "backend=hf"])
    spec = instantiate(cfg.model)
    mib = float(cfg.backend.prefix_cache_mb) or 256.0
    engines: dict[str, Engine] = {}
    for kind in args.engines.split(","):
        for state, size in (("off", 0.0), ("on", mib)):
            engines[f"{kind}-{state}"] = build(kind, spec, cfg, size)
    tokenizer = spec.load_tokenizer()
    words = (REPO / "docs" / "serving.md").read_text().split()
    system = " ".join(words[: args.system_tokens])
    while len(tokenizer(system)["input_ids"]) > args.system_tokens:
        system = system.rsplit(" ", 8)[0]
    tasks = [t.prompt for t in load_tasks(None, "heldout")]
    times: dict[str, list[float]] = {name: [] for name in engines}
    wall = dict.fromkeys(engines, 0.0)
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        first = r * args.clients * args.turns  # each conversation its own tasks, in order, wrapping around
        starts = range(first, first + args.clients * args.turns, args.turns)
        convs = [[tasks[i % len(tasks)] for i in range(s, s + args.turns)] for s in starts]
        for name, engine in engines.items():
            t0 = time.perf_counter()
            threads = [threading.Thread(target=conversation, args=(engine, c, args.max_tokens, times[name], system))
                       for c in convs]  # fmt: skip
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall[name] += time.perf_counter() - t0
    load.append(os.getloadavg()[0])
    report: dict[str, Any] = {
        "model": spec.name,
        "torch_threads": torch.get_num_threads(),
        "clients": args.clients,
        "conversations": args.rounds * args.clients,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "prefix_cache_mb": mib,
        "system_tokens": len(tokenizer(system)["input_ids"]) if system else 0,
        "loadavg_1min": load,
        "engines": {
            name: {
                "turns": len(times[name]),
                "turn_s_median": round(statistics.median(times[name]), 3),
                "wall_s": round(wall[name], 1),
                "replies_per_min": round(60 * len(times[name]) / wall[name], 1),
                "batches": getattr(engines[name], "batches", {}),
                **cache_report(getattr(engines[name], "prefix", None)),
            }
            for name in engines
        },
    }  # fmt: skip
    kinds = args.engines.split(",")
    report["speedup_wall"] = {kind: round(wall[f"{kind}-off"] / wall[f"{kind}-on"], 3) for kind in kinds}
    if {"hf", "onnx"} <= set(kinds):
        report["onnx_on_over_hf_on_wall"] = round(wall["hf-on"] / wall["onnx-on"], 3)
    publish(__file__, args, report)


def build(kind: str, spec: Any, cfg: Any, prefix_cache_mb: float) -> Engine:
    """The `kind` engine with the composed config's settings (batch size; HF: linger) and this cache size."""
    if kind == "hf":
        linger = float(cfg.backend.batch_linger_s)
        return HFEngine.from_spec(spec, max_batch_size=int(cfg.backend.max_batch_size), batch_linger_s=linger,
                                  prefix_cache_mb=prefix_cache_mb)  # fmt: skip
    if kind == "onnx":
        from metaclaw.serving.engines.onnx import OnnxEngine

        return OnnxEngine.from_backend(spec, max_batch_size=int(cfg.backend.max_batch_size),
                                       prefix_cache_mb=prefix_cache_mb)  # fmt: skip
    raise SystemExit(f"--engines: unknown engine {kind!r} (hf, onnx)")


def cache_report(cache: Any) -> dict[str, Any]:
    """The cache's counters, bytes held, and the share of prompt tokens read from it."""
    if cache is None:
        return {}
    share = round(cache.stats["reused_tokens"] / max(1, cache.stats["prompt_tokens"]), 3)
    return {"cache": {**cache.stats, "bytes": cache.bytes, "entries": len(cache), "reused_share": share}}


if __name__ == "__main__":
    main()
