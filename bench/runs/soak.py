"""Soak: concurrent agent streams through the proxy while `train.py` trains and hot-swaps; prints JSON.

`python bench/runs/soak.py [--minutes 2] [--streams 4] [--max-tokens 16] [--run-dir DIR] [--out FILE] [override ...]`

Starts `train.py model=tiny rollout=proxy` (policy server, proxy, scorer, trainer, publisher: the real live loop)
in its own process group, waits for the proxy, then runs `--streams` concurrent multi-turn sessions (the real
`openai` client, streaming and not, corrections and thanks, `X-Session-Done` on the last turn) for `--minutes`.
Extra arguments are passed to `train.py` as Hydra overrides (e.g. `data.backlog_policy=pause_capture`).

Reported: requests and failed requests (with the first errors), latency percentiles (request start -> last
byte) per minute, the store's backlog (pending + ready) at the end of each minute, RSS per process of the
`train.py` tree at start and end, adapters published, samples captured and trained per second, the store's
counts and drop reasons, and how `train.py` exited after SIGINT (Lightning exits 1 after its graceful
KeyboardInterrupt shutdown) with the processes of its group still alive afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, free_port, publish, start, wait_healthy  # noqa: E402

REPLIES = ["No, that's wrong. Say it in one word.", "Thanks, that works.", "Hmm. Try again, shorter."]


def process_tree(root: int) -> list[int]:
    """`root` and its descendants (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (the group `train.py` was started in), zombies excluded."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def rss_mb(root: int) -> dict[str, float]:
    """RSS in MB of every process in `root`'s tree, keyed `pid:command`."""
    out = {}
    for pid in process_tree(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        name = " ".join(Path(c.decode(errors="replace")).name for c in cmd[:2] if c) or "?"
        out[f"{pid}:{name}"] = round(kb / 1024, 1)
    return out


def store_state(path: Path) -> dict:
    if not path.exists():
        return {}
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30) as db:
        counts = dict(db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
        reasons = dict(
            db.execute(
                "SELECT json_extract(meta, '$.dropped') AS d, COUNT(*) FROM samples WHERE status='dropped' GROUP BY d"
            ).fetchall()
        )
    reasons_by_prefix: dict[str, int] = {}
    for reason, n in reasons.items():
        key = str(reason).split(":", 1)[0]
        reasons_by_prefix[key] = reasons_by_prefix.get(key, 0) + n
    return {
        "counts": counts,
        "backlog": counts.get("pending", 0) + counts.get("ready", 0),
        "dropped": reasons_by_prefix,
    }


def total(state: dict) -> int:
    return sum(state.get("counts", {}).values())


def trained(state: dict) -> int:
    counts = state.get("counts", {})
    return counts.get("claimed", 0) + counts.get("consumed", 0)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    if len(values) == 1:
        return {k: round(values[0], 1) for k in ("p50_ms", "p90_ms", "p99_ms")}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 1), "p90_ms": round(q[89], 1), "p99_ms": round(q[98], 1)}


async def stream_sessions(
    client: openai.AsyncOpenAI, stream_id: int, deadline: float, max_tokens: int, log: list
) -> None:
    session = 0
    while time.monotonic() < deadline:
        session += 1
        msgs = [{"role": "user", "content": f"Stream {stream_id}, session {session}: what is the capital of France?"}]
        for turn in range(3):
            if time.monotonic() >= deadline:
                return
            headers = {"X-Session-Id": f"soak-{stream_id}-{session}", "X-Agent-Id": f"soak{stream_id % 2}"}
            if turn == 2:
                headers["X-Session-Done"] = "true"
            t0 = time.monotonic()
            try:
                if (stream_id + turn) % 2:
                    stream = await client.chat.completions.create(
                        model="metaclaw", messages=msgs, max_tokens=max_tokens, stream=True, extra_headers=headers
                    )
                    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
                else:
                    r = await client.chat.completions.create(
                        model="metaclaw", messages=msgs, max_tokens=max_tokens, extra_headers=headers
                    )
                    text = r.choices[0].message.content or ""
                log.append((t0, (time.monotonic() - t0) * 1000, None))
            except Exception as e:  # noqa: BLE001 - every failure is reported
                log.append((t0, (time.monotonic() - t0) * 1000, f"{type(e).__name__}: {e}"[:200]))
                break
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": REPLIES[turn % 3]}]


async def drive(base_url: str, streams: int, seconds: float, max_tokens: int, db: Path) -> tuple[list, list]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    log: list = []
    start = time.monotonic()
    deadline = start + seconds
    minutes: list[dict] = []

    async def sample_backlog() -> None:
        minute = 0
        while time.monotonic() < deadline:
            await asyncio.sleep(min(60.0, max(0.0, deadline - time.monotonic())))
            minute += 1
            minutes.append({"minute": minute, **(await asyncio.to_thread(store_state, db))})

    await asyncio.gather(
        sample_backlog(), *(stream_sessions(client, i, deadline, max_tokens, log) for i in range(streams))
    )
    await client.close()
    last = max(0, len(minutes) - 1)
    return [(*entry, min(int((entry[0] - start) // 60), last)) for entry in log], minutes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for train.py")
    add_results_argument(ap)
    args = ap.parse_args()

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="metaclaw-soak-"))
    port = free_port()
    cmd = [
        sys.executable,
        "train.py",
        "model=tiny",
        "rollout=proxy",
        "logger=csv",
        f"rollout.proxy.port={port}",
        "rollout.scoring.session_idle_s=10",
        "rollout.wait_timeout_s=600",
        "trainer.max_steps=1000000",
        "publish.keep_last=5",
        f"hydra.run.dir={run_dir}",
        *args.overrides,
    ]
    log_path = run_dir / "soak-train.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    train = start(cmd, log_path)
    base_url = f"http://127.0.0.1:{port}"
    result: dict = {"command": " ".join(cmd[1:]), "run_dir": str(run_dir)}
    try:
        t0 = time.monotonic()
        wait_healthy(train, f"{base_url}/health", log_path, args.startup_timeout)
        result["startup_s"] = round(time.monotonic() - t0, 1)
        rss_start = rss_mb(train.pid)
        db = run_dir / "samples.sqlite"
        before, t_start = store_state(db), time.monotonic()
        log, minutes = asyncio.run(drive(base_url, args.streams, args.minutes * 60, args.max_tokens, db))
        after, elapsed = store_state(db), time.monotonic() - t_start
        rss_end = rss_mb(train.pid)
        failed = [e for e in log if e[2] is not None]
        per_minute = []
        for m in minutes:
            entries = [e for e in log if e[3] == m["minute"] - 1]
            ok = [e[1] for e in entries if e[2] is None]
            per_minute.append(
                {
                    "minute": m["minute"],
                    "requests": len(entries),
                    "failed": len(entries) - len(ok),
                    **percentiles(ok),
                    "backlog": m.get("backlog"),
                }
            )
        text = log_path.read_text()
        result.update(
            {
                "minutes": args.minutes,
                "streams": args.streams,
                "requests": len(log),
                "failed_requests": len(failed),
                "first_errors": sorted({e[2] for e in failed})[:5],
                "latency_per_minute": per_minute,
                "rss_mb": {"start": rss_start, "end": rss_end},
                "adapters_published": text.count("Published adapter v"),
                "store": after,
                "samples_per_s": {
                    "captured": round((total(after) - total(before)) / elapsed, 2),
                    "trained": round((trained(after) - trained(before)) / elapsed, 2),
                },
            }
        )
    finally:
        if train.poll() is None:
            train.send_signal(signal.SIGINT)
            try:
                train.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(train.pid, signal.SIGKILL)  # the process group this bench created
                train.wait(30)
        result["train_exit"] = train.returncode
        time.sleep(2.0)
        leftover = group_members(train.pid)
        result["processes_left_after_exit"] = len(leftover)
        if leftover:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(train.pid, signal.SIGKILL)  # orphans of the group this bench created
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    publish(__file__, args, result)


if __name__ == "__main__":
    main()
