"""Proxy overhead vs calling the upstream directly, side by side in one run; prints JSON.

`python bench/perf/proxy_overhead.py [--concurrency 1 32] [--requests 1000] [--rounds 10] [--no-stream]
[--placement shared pinned] [--store-dir DIR] [--out FILE]`

The upstream is the scripted fast server (`metaclaw.rollout.testing`), so the model does not dominate; upstream
and proxy each run in their own process (uvicorn), the proxy writes every main turn to a SQLite store (WAL,
fsync) in `--store-dir` (default: a temp dir on the real disk). Latency = request start -> last byte.

Direct and proxied requests run in interleaved rounds (direct first in even rounds, proxied first in odd ones)
with the same request bodies, so drift in machine load hits both sides alike. Reported per configuration:
p50/p90/p99 of both, the overhead as the difference of percentiles and as percentiles of the paired per-request
differences (request k direct vs request k proxied), and the CPU each process spent per request. On a CPU-bound
machine the proxy's CPU per request sets a floor on its overhead at c concurrent streams: about
`proxy_cpu_ms × c / cores` (every request waits for the proxy work of the others), reported as `cpu_floor_ms`.

Placements: `shared` lets the OS schedule everything on all cores; `pinned` (needs `os.sched_setaffinity` and
2+ cores) puts the proxy alone on the last core and the upstream and the load generator on the others, which
removes most cross-talk and shows the proxy's own added latency.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, free_port, publish, start, stop_group, wait_healthy  # noqa: E402

REPLY = "one two three four five six seven eight nine ten"
TARGET_MS = {"p50": 2.0, "p99": 10.0}


def serve(kind: str, port: int, upstream: str | None, store_path: str | None, cpus: str | None) -> None:
    if cpus:  # pin before any thread exists, so every thread of this process inherits it
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    import uvicorn

    from metaclaw.rollout.testing import scripted_upstream

    if kind == "upstream":
        app = scripted_upstream(reply=REPLY)
    else:
        from metaclaw.rollout.proxy import RolloutProxy
        from metaclaw.rollout.proxy_app import create_app
        from metaclaw.store import SampleStore

        app = create_app(RolloutProxy(SampleStore(store_path), upstream, base_model="tiny"))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of `pid` (ns-resolution schedstat; clock-tick stat as a fallback)."""
    try:
        return (
            sum(
                int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
                for t in os.listdir(f"/proc/{pid}/task")
            )
            / 1e9
        )
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)


def spawn(kind: str, cpus: set[int] | None, **kw: str) -> Server:
    port = free_port()
    args = ["--serve", kind, "--port", str(port)]
    for k, v in kw.items():
        args += [f"--{k}", v]
    if cpus:
        args += ["--cpus", ",".join(map(str, sorted(cpus)))]
    srv = Server(start([sys.executable, __file__, *args], log=None), f"http://127.0.0.1:{port}")
    try:
        wait_healthy(srv.proc, f"{srv.url}/health", timeout_s=60)
    except RuntimeError:
        stop_group(srv.proc)
        raise
    return srv


def stop(srv: Server) -> None:
    stop_group(srv.proc)


class Clients:
    """Small httpx pools used round-robin: one big pool costs the load generator ~2 ms CPU per request at 32
    streams (httpcore scans all its connections on every request), which would swamp what is measured."""

    def __init__(self, url: str, concurrency: int, shards: int = 16) -> None:
        n = max(1, min(shards, concurrency))
        per = -(-concurrency // n)
        limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        self.pools = [httpx.AsyncClient(base_url=url, timeout=120, limits=limits) for _ in range(n)]
        self.next = itertools.cycle(self.pools).__next__

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


async def load(clients: Clients, keys: list[str], concurrency: int, stream: bool) -> dict[str, float]:
    """Send one request per key, `concurrency` at a time; latency in ms per key."""
    lat: dict[str, float] = {}
    sem = asyncio.Semaphore(concurrency)

    async def one(key: str) -> None:
        body = {"model": "tiny", "stream": stream, "messages": [{"role": "user", "content": f"hello {key}"}]}
        body["max_tokens"] = 16
        headers = {"X-Session-Id": key}
        async with sem:
            client = clients.next()
            t0 = time.perf_counter()
            if stream:
                async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                    r.raise_for_status()
                    async for _ in r.aiter_raw():
                        pass
            else:
                (await client.post("/v1/chat/completions", json=body, headers=headers)).raise_for_status()
            lat[key] = (time.perf_counter() - t0) * 1000

    await asyncio.gather(*(one(k) for k in keys))
    return lat


def pcts(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "p50": round(q[49], 3),
        "p90": round(q[89], 3),
        "p99": round(q[98], 3),
        "mean": round(statistics.fmean(values), 3),
    }


async def measure(
    direct: Server, proxy: Server, concurrency: int, requests: int, rounds: int, stream: bool, tag: str
) -> dict:
    """Interleaved rounds of direct and proxied load with the same bodies; percentiles, pairs and CPU per request."""
    per_round = max(1, requests // rounds)
    d_lat: dict[str, float] = {}
    p_lat: dict[str, float] = {}
    cpu = {"proxy": 0.0, "upstream_direct": 0.0, "upstream_proxied": 0.0, "client_direct": 0.0, "client_proxied": 0.0}
    wall = {"direct": 0.0, "proxied": 0.0}
    dc, pc = Clients(direct.url, concurrency), Clients(proxy.url, concurrency)
    try:
        warm = [f"{tag}-warm-{i}" for i in range(2 * concurrency)]
        await load(dc, warm, concurrency, stream)
        await load(pc, warm, concurrency, stream)
        for r in range(rounds):
            keys = [f"{tag}-{r}-{i}" for i in range(per_round)]
            order = [("direct", dc, d_lat), ("proxied", pc, p_lat)]
            for side, client, out in order if r % 2 == 0 else order[::-1]:
                c0, u0, x0, t0 = os.times(), direct.cpu(), proxy.cpu(), time.perf_counter()
                out.update(await load(client, keys, concurrency, stream))
                c1, u1, x1, t1 = os.times(), direct.cpu(), proxy.cpu(), time.perf_counter()
                wall[side] += t1 - t0
                cpu[f"upstream_{side}"] += u1 - u0
                cpu[f"client_{side}"] += (c1.user + c1.system) - (c0.user + c0.system)
                if side == "proxied":
                    cpu["proxy"] += x1 - x0
    finally:
        await dc.aclose()
        await pc.aclose()
    n = len(p_lat)
    diffs = [p_lat[k] - d_lat[k] for k in p_lat]
    d, p = pcts(list(d_lat.values())), pcts(list(p_lat.values()))
    per_req = {k: round(v / n * 1000, 3) for k, v in cpu.items()}
    return {
        "concurrency": concurrency,
        "stream": stream,
        "requests_per_side": n,
        "direct_ms": d,
        "proxied_ms": p,
        "overhead_ms": {k: round(p[k] - d[k], 3) for k in ("p50", "p90", "p99", "mean")},
        "paired_overhead_ms": pcts(diffs),
        "throughput_rps": {"direct": round(n / wall["direct"], 1), "proxied": round(n / wall["proxied"], 1)},
        "cpu_ms_per_request": per_req,
    }


def run_placement(placement: str, args: argparse.Namespace, store_dir: str) -> list[dict]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    proxy_cpus = upstream_cpus = None
    if placement == "pinned":
        proxy_cpus, upstream_cpus = {cores[-1]}, set(cores[:-1])
    store = tempfile.mkdtemp(prefix=f"proxy-bench-{placement}-", dir=store_dir)
    upstream = spawn("upstream", upstream_cpus)
    proxy = None
    try:
        proxy = spawn("proxy", proxy_cpus, upstream=upstream.url, store=os.path.join(store, "bench.sqlite"))
        if upstream_cpus:
            os.sched_setaffinity(0, upstream_cpus)  # the load generator shares the upstream's cores
        results = []
        for concurrency in args.concurrency:
            for stream in args.modes:
                tag = f"{placement}-c{concurrency}-{'s' if stream else 'j'}"
                res = asyncio.run(measure(upstream, proxy, concurrency, args.requests, args.rounds, stream, tag))
                proxy_cores = 1 if proxy_cpus else len(cores)
                floor = res["cpu_ms_per_request"]["proxy"] * concurrency / proxy_cores
                res = {"placement": placement, **res, "cpu_floor_ms": round(floor, 3)}
                print(json.dumps(res), file=sys.stderr, flush=True)
                results.append(res)
        return results
    finally:
        if upstream_cpus:
            os.sched_setaffinity(0, set(cores))
        for srv in (proxy, upstream):
            if srv is not None:
                stop(srv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--requests", type=int, default=1000, help="per side and configuration")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-stream", dest="modes", action="store_const", const=[False], default=[True, False])
    ap.add_argument("--stream-only", dest="modes", action="store_const", const=[True])
    ap.add_argument("--placement", nargs="+", choices=["shared", "pinned"], default=["shared", "pinned"])
    ap.add_argument("--store-dir", default=tempfile.gettempdir(), help="where the proxy's SQLite store lives")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--serve", choices=["upstream", "proxy"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--cpus", help=argparse.SUPPRESS)
    add_results_argument(ap)
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve, a.port, a.upstream, a.store, a.cpus)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    placements = [p for p in a.placement if p == "shared" or (hasattr(os, "sched_setaffinity") and cores >= 2)]
    results = [r for p in placements for r in run_placement(p, a, a.store_dir)]
    at_target = [r for r in results if r["concurrency"] == 32]
    out = {
        "cpus": os.cpu_count(),
        "cpus_usable": cores,
        "python": platform.python_version(),
        "store_dir": a.store_dir,
        "target_ms": TARGET_MS,
        "meets_target_at_32": all(
            r["overhead_ms"]["p50"] <= TARGET_MS["p50"] and r["overhead_ms"]["p99"] <= TARGET_MS["p99"]
            for r in at_target
        )
        if at_target
        else None,
        "results": results,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    publish(__file__, a, out)


if __name__ == "__main__":
    main()
