"""Serving and training on one CPU: both paces under a heavy user, with and without the thread budget.

    python bench/perf/cpu_share.py [--model smollm2_135m|tiny] [--seconds 60] [--users 4] [--budgets auto,none]

For each budget (`auto`: `devices.cpu_threads` as `train.py` resolves it for this machine, e.g. 1 + 1 on 2 cores;
`none`: torch's default in both processes, the behaviour before), starts `python serve.py` with the server's
share, lets `--users` threads send chat completions back to back (a heavy user: never waiting), and trains LoRA
steps in this process with the trainer's share for `--seconds`. Prints JSON: replies/min and completion tokens/s
(serving), optimizer steps and samples/min (training), the CPU each process used, and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, free_port, publish, start, stop_group, wait_healthy  # noqa: E402
from bench.harness.models import model_names, model_spec  # noqa: E402
from metaclaw.datamodules.rollout import collate_samples  # noqa: E402
from metaclaw.devices import host_cpu_count, thread_budget, torch_threads  # noqa: E402
from metaclaw.modules.policy import LoraPolicy  # noqa: E402
from metaclaw.store import Sample  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its children that exited (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (serve.py runs its engine in worker processes)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo += [int(c) for c in children]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def heavy_user(url: str, model: str, stop: threading.Event, out: dict, lock: threading.Lock) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 24,
            "temperature": 1.0}  # fmt: skip
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            r = client.post(f"{url}/v1/chat/completions", json=body)
            with lock:
                if r.status_code == 200:
                    out["replies"] += 1
                    out["tokens"] += r.json()["usage"]["completion_tokens"]
                else:
                    out["errors"] += 1


def make_batch(vocab: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(batch):
        ids = torch.randint(5, vocab, (seq,), generator=g).tolist()
        lp = (-torch.rand(seq // 2, generator=g) * 3).tolist()
        samples.append(Sample(prompt_ids=ids[: seq // 2], response_ids=ids[seq // 2 :], behaviour_logprobs=lp,
                              reward=float(i % 2 * 2 - 1), id=i + 1))  # fmt: skip
    return collate_samples(samples, pad_id=0)


def run(model: str, budget: str, seconds: float, users: int, batch_size: int, seq: int) -> dict:
    cores = host_cpu_count()
    shared = budget == "auto"
    serve_threads, train_threads = thread_budget({"serve": "auto", "train": "auto"}, cores, shared_cpu=shared)
    port = free_port()
    spec = model_spec(model)
    tmp = Path(tempfile.mkdtemp(prefix="cpu_share_"))
    cmd = [sys.executable, "serve.py", f"model={model}", f"serve.port={port}", f"hydra.run.dir={tmp}",
           f"serve.adapter_root={tmp / 'adapters'}",
           f"devices.cpu_threads.serve={serve_threads if serve_threads else 'null'}"]  # fmt: skip
    proc = start(cmd, tmp / "server.log", env={"METACLAW_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, f"{url}/health", tmp / "server.log", timeout_s=600)
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        with torch_threads(train_threads):
            policy = LoraPolicy(spec.load_model(), rank=16, alpha=32)
            params = [p for p in policy.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-5)
            batch = make_batch(int(policy.model.config.vocab_size), batch_size, seq)

            def step() -> None:
                lp = policy.logprobs(batch["input_ids"], batch["target_ids"], batch["attention_mask"],
                                     batch["temperature"])  # fmt: skip
                adv = batch["reward"][:, None] * batch["mask"]
                loss = -(torch.exp(lp - batch["behaviour_logprobs"]) * adv).sum() / batch["mask"].sum()
                opt.zero_grad()
                loss.backward()
                opt.step()

            step()  # warm-up, before the user starts
            out, lock, stop = {"replies": 0, "tokens": 0, "errors": 0}, threading.Lock(), threading.Event()
            threads = [threading.Thread(target=heavy_user, args=(url, card["id"], stop, out, lock), daemon=True)
                       for _ in range(users)]  # fmt: skip
            for t in threads:
                t.start()
            time.sleep(5.0)  # the user is in full flow
            with lock:
                out.update(replies=0, tokens=0)
            cpu0, server0, t0, steps = cpu_seconds(os.getpid()), tree_cpu(proc.pid), time.monotonic(), 0
            while time.monotonic() - t0 < seconds:
                step()
                steps += 1
            wall = time.monotonic() - t0
            cpu1, server1 = cpu_seconds(os.getpid()), tree_cpu(proc.pid)
            with lock:
                served = dict(out)
            stop.set()
            for t in threads:
                t.join(timeout=300)
        return {
            "budget": budget,
            "serve_threads": serve_threads,
            "train_threads": train_threads,
            "server_torch_threads": card.get("metaclaw", {}).get("effective", {}).get("torch_threads"),
            "wall_s": round(wall, 1),
            "replies_per_min": round(served["replies"] * 60 / wall, 1),
            "reply_tokens_per_s": round(served["tokens"] / wall, 2),
            "request_errors": served["errors"],
            "train_steps": steps,
            "trained_samples_per_min": round(steps * batch_size * 60 / wall, 1),
            "trainer_cpu_cores": round((cpu1 - cpu0) / wall, 2),  # this process: the trainer and the user threads
            "server_cpu_cores": round((server1 - server0) / wall, 2),
            "load_avg_1m": os.getloadavg()[0],
        }
    finally:
        stop_group(proc, timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2_135m", choices=model_names())
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--users", type=int, default=4, help="request threads sending back to back")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=192, help="tokens per trained sample (half prompt, half response)")
    p.add_argument("--budgets", default="auto,none")
    add_results_argument(p)
    args = p.parse_args()
    results = []
    for budget in args.budgets.split(","):
        results.append(run(args.model, budget, args.seconds, args.users, args.batch, args.seq))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # each run as it ends: a long bench shows progress
    publish(__file__, args, {"cores": host_cpu_count(), "model": args.model, "users": args.users, "runs": results})


if __name__ == "__main__":
    main()
