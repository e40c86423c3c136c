"""Policy server throughput, time-to-first-token and adapter swap latency; prints JSON.

    python bench/perf/serve_throughput.py                         # model=tiny
    python bench/perf/serve_throughput.py --model smollm2_135m --requests 16

Starts `python serve.py` on a free port, publishes random LoRA adapters into its adapter root the way the trainer
does (`adapters/step-NNNNNN`, then `POST /v1/load_lora_adapter` under the name `policy`), and measures:
- requests/s and TTFT (median, p90) of streamed chat completions for the base model vs the adapter;
- swap latency: publish (save adapter + load request) → first response served by the new version (median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, free_port, publish, serving  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stream_once(url: str, model: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft, total seconds, tokens) of one streamed chat completion."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
            "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") if '"token_ids"' in line else None
            if ids:
                tokens += len(ids)
                ttft = ttft if ttft is not None else time.perf_counter() - t0
    return ttft or float("nan"), time.perf_counter() - t0, tokens


def load_phase(url: str, model: str, requests: int, concurrency: int, max_tokens: int) -> dict:
    stream_once(url, model, 2)  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda _: stream_once(url, model, max_tokens), range(requests)))
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in runs]
    return {
        "requests_per_s": round(requests / wall, 3),
        "tokens_per_s": round(sum(r[2] for r in runs) / wall, 1),
        "ttft_ms_median": round(1e3 * statistics.median(ttfts), 1),
        "ttft_ms_p90": round(1e3 * quantile(ttfts, 0.9), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--swaps", type=int, default=5)
    add_results_argument(parser)
    args = parser.parse_args()

    from metaclaw.config import CONFIG_DIR, register_resolvers
    from metaclaw.modules.policy import LoraPolicy

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        spec = instantiate(compose("serve", overrides=[f"model={args.model}"]).model)
    torch.manual_seed(0)
    policy = LoraPolicy(spec.load_model(), rank=16, alpha=32)

    def publish_adapter(root: Path, step: int) -> Path:
        for p in policy.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.02)
        return policy.save_adapter(root / f"step-{step:06d}")

    with tempfile.TemporaryDirectory() as tmp:
        run_dir, root = Path(tmp) / "run", Path(tmp) / "adapters"
        run_dir.mkdir()
        root.mkdir()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "serve.py", f"model={args.model}", f"serve.port={port}", f"hydra.run.dir={run_dir}",
               f"serve.adapter_root={root}"]  # fmt: skip
        with serving(cmd, f"{url}/health", run_dir / "server.log", {"METACLAW_API_KEY": ""}, timeout_s=300):
            publish_adapter(root, 1)
            first = {"lora_name": "policy", "lora_path": str(root / "step-000001")}
            httpx.post(f"{url}/v1/load_lora_adapter", json=first, timeout=60).raise_for_status()
            phases = {m: load_phase(url, m, args.requests, args.concurrency, args.max_tokens)
                      for m in (spec.name, "policy")}  # fmt: skip
            swaps, loads = [], []
            for step in range(2, 2 + args.swaps):
                t0 = time.perf_counter()
                path = publish_adapter(root, step)
                t_load = time.perf_counter()
                httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(path)},
                           timeout=60).raise_for_status()  # fmt: skip
                loads.append(time.perf_counter() - t_load)
                while True:
                    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                                   json={"model": "policy", "messages": MESSAGES, "max_tokens": 1})  # fmt: skip
                    if r.headers.get("x-metaclaw-adapter-version") == str(step):
                        break
                swaps.append(time.perf_counter() - t0)
    publish(__file__, args, {
        "model": args.model, "backend": "hf", "requests": args.requests, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "base": phases[spec.name], "adapter": phases["policy"],
        "swap_publish_to_first_response_ms_median": round(1e3 * statistics.median(swaps), 1),
        "swap_load_request_ms_median": round(1e3 * statistics.median(loads), 1), "swaps": args.swaps,
    })  # fmt: skip


if __name__ == "__main__":
    main()
