"""Proxy overhead vs calling the upstream directly, at N concurrent streams; prints JSON.

`python bench/proxy_overhead.py [--concurrency 32] [--requests 1000] [--stream/--no-stream]`

The upstream is the scripted fast server (`metaclaw.rollout.testing`), so the model does not dominate; upstream
and proxy each run in their own process (uvicorn), the proxy writes every turn to a real SQLite store (WAL,
fsync). Latency = request start → last byte. Overhead = proxied − direct percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from metaclaw.rollout.server import free_port


def serve(kind: str, port: int, upstream: str | None, store_path: str | None) -> None:
    import uvicorn

    from metaclaw.rollout.testing import scripted_upstream

    if kind == "upstream":
        app = scripted_upstream(reply="one two three four five six seven eight nine ten")
    else:
        from metaclaw.datamodules.store import SampleStore
        from metaclaw.rollout.app import create_app
        from metaclaw.rollout.proxy import RolloutProxy

        app = create_app(RolloutProxy(SampleStore(store_path), upstream, base_model="tiny"))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], start_new_session=True)


def wait_healthy(url: str) -> None:
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


async def run_load(url: str, concurrency: int, requests: int, stream: bool) -> list[float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one(i: int) -> None:
            body = {
                "model": "tiny",
                "stream": stream,
                "messages": [{"role": "user", "content": f"hello {i}"}],
                "max_tokens": 16,
            }
            headers = {"X-Session-Id": f"bench-{i}"}
            async with sem:
                t0 = time.perf_counter()
                if stream:
                    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                        async for _ in r.aiter_bytes():
                            pass
                else:
                    (await client.post("/v1/chat/completions", json=body, headers=headers)).raise_for_status()
                lat.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(one(i) for i in range(min(concurrency * 2, requests))))  # warm-up
        lat.clear()
        await asyncio.gather(*(one(i) for i in range(requests)))
    return lat


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    ap.add_argument("--serve", choices=["upstream", "proxy"])
    ap.add_argument("--port", type=int)
    ap.add_argument("--upstream")
    ap.add_argument("--store")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve, a.port, a.upstream, a.store)
    up_port, px_port = free_port(), free_port()
    store = os.path.join(tempfile.mkdtemp(), "bench.sqlite")
    up_url, px_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{px_port}"
    procs = [spawn("--serve", "upstream", "--port", str(up_port))]
    try:
        wait_healthy(up_url)
        procs.append(spawn("--serve", "proxy", "--port", str(px_port), "--upstream", up_url, "--store", store))
        wait_healthy(px_url)
        direct = asyncio.run(run_load(up_url, a.concurrency, a.requests, a.stream))
        proxied = asyncio.run(run_load(px_url, a.concurrency, a.requests, a.stream))
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)
    out = {
        "concurrency": a.concurrency,
        "requests": a.requests,
        "stream": a.stream,
        "cpus": os.cpu_count(),
        "direct_ms": {"p50": round(pct(direct, 50), 3), "p99": round(pct(direct, 99), 3)},
        "proxied_ms": {"p50": round(pct(proxied, 50), 3), "p99": round(pct(proxied, 99), 3)},
    }
    out["overhead_ms"] = {k: round(out["proxied_ms"][k] - out["direct_ms"][k], 3) for k in ("p50", "p99")}
    out["target_ms"] = {"p50": 2.0, "p99": 10.0}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
