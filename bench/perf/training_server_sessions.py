"""Training server memory under session churn: RSS while clients create, train and delete sessions.

Issue 9 measured 3,000 `lora/create` calls taking the tiny-model server from 898 MB to 1.6 GB. This runs
N cycles of create → forward_backward → optim_step → delete against a real server, samples the server's RSS,
then creates sessions until the cap answers 429. Prints one JSON object.

    python bench/perf/training_server_sessions.py [--model tiny] [--cycles 300] [--max-sessions 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, free_port, publish, serving  # noqa: E402

DATUM = {"model_input_tokens": [5, 17, 42, 99, 7, 120, 33], "target_tokens": [17, 42, 99, 7, 120, 33, 250],
         "logprobs": [0.0] * 4 + [-2.0] * 3, "advantages": [0.0] * 4 + [1.0] * 3}  # fmt: skip


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--max-sessions", type=int, default=8)
    add_results_argument(parser)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {"METACLAW_PORT": str(port), "METACLAW_API_KEY": "bench", "METACLAW_CHECKPOINT_DIR": f"{tmp}/ckpt"}
        cmd = [sys.executable, "serve.py", "app=training_server", f"model={args.model}", "devices=cpu",
               "app.log_level=WARNING", f"app.limits.max_sessions={args.max_sessions}",
               f"hydra.run.dir={tmp}/hydra"]  # fmt: skip
        auth = {"Authorization": "Bearer bench"}
        url = f"http://127.0.0.1:{port}"
        with serving(cmd, f"{url}/v1/health", Path(tmp) / "server.log", env, timeout_s=300, headers=auth) as proc, \
                httpx.Client(base_url=url, headers=auth, timeout=600) as client:  # fmt: skip

            def cycle() -> None:
                sid = client.post("/v1/lora/create", json={"rank": 16}).raise_for_status().json()["session_id"]
                body = {"session_id": sid, "datums": [DATUM]}
                client.post("/v1/train/forward_backward", json=body).raise_for_status()
                client.post("/v1/train/optim_step", json={"session_id": sid}).raise_for_status()
                client.delete(f"/v1/lora/{sid}").raise_for_status()

            for _ in range(20):  # warm-up: allocator pools, lazily built PEFT wrapper
                cycle()
            start = rss_mb(proc.pid)
            samples = []
            t0 = time.perf_counter()
            for i in range(args.cycles):
                cycle()
                if (i + 1) % max(1, args.cycles // 5) == 0:
                    samples.append(rss_mb(proc.pid))
            elapsed = time.perf_counter() - t0
            created, refused = 0, None
            for _ in range(args.max_sessions + 5):
                r = client.post("/v1/lora/create", json={"rank": 16})
                if r.status_code == 429:
                    refused = r.json()["error"]["message"]
                    break
                r.raise_for_status()
                created += 1
            publish(__file__, args, {
                "model": args.model,
                "cycles": args.cycles,
                "rss_mb_after_warmup": start,
                "rss_mb_samples": samples,
                "rss_mb_growth": round(samples[-1] - start, 1),
                "cycles_per_s": round(args.cycles / elapsed, 2),
                "live_sessions_before_429": created,
                "max_sessions": args.max_sessions,
                "refusal": refused,
            })  # fmt: skip


if __name__ == "__main__":
    main()
