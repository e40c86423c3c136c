"""Where the main job's CPU goes: run `python train.py` (its defaults, a short training budget) and break it down.

    python bench/perf/cycle_profile.py [--minutes 5] [--out DIR] [--repo DIR] [-- extra train.py overrides ...]

Side by side with an older checkout (issue 29: trained samples per minute against the main job before the
changes), one after the other on the same machine: `git worktree add /tmp/old 714a863`, then
`python bench/perf/cycle_profile.py --repo /tmp/old --out A` and `python bench/perf/cycle_profile.py --out B`.
A checkout without `metaclaw.profiling` has no phases; its run, steps and trained samples per minute (from its
`summary.json`) are still reported.

The components record their own phases (`metaclaw.profiling`, written by every process into `<out>/profile/`);
this script also samples the CPU of the whole process tree (psutil) and the machine's load. It prints JSON:

- `phases`: CPU and wall seconds of user simulation, generation (the agent's replies), capture (the proxy),
  scoring, the training step (forward/backward/optimizer, the KL reference forward apart), publish (adapter
  files, checkpoint, hot-load wait) and evaluation (generation and base-NLL scoring of held-out replies, and
  the evaluator's client), each with its share of the run's CPU;
- `throughput`: generated tokens/s (rollouts and evaluation), trained tokens/s, trained samples per minute of
  the training budget, padding (positions computed per real token);
- `run`: wall time, steps, samples trained, held-out compliance points, load average before and after.

CPU of a torch phase is the process's CPU while it ran (torch's intra-op threads work for the caller); pure-Python
phases (user, eval client, scoring, capture) are their threads' own CPU. What no phase claims is `other`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402


def sample_tree(root: psutil.Process, cpu: dict[int, float], stop: threading.Event) -> None:
    """Keep the latest CPU seconds of every process under `root` (a process that ended keeps its last value)."""
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            try:
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        stop.wait(1.0)


def load_profiles(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def phase(profiles: list[dict], role: str, name: str) -> dict[str, float]:
    out = {"n": 0, "wall_s": 0.0, "cpu_s": 0.0, "tokens": 0.0}
    for prof in profiles:
        if prof["role"] != role:
            continue
        row = prof["phases"].get(name)
        if row:
            for k in out:
                out[k] += row[k]
    return out


def threads(profiles: list[dict], role: str, family: str) -> float:
    return sum(p["threads"].get(family, 0.0) for p in profiles if p["role"] == role)


def breakdown(profiles: list[dict], total_cpu: float) -> dict[str, dict[str, float]]:
    """CPU and wall seconds per phase of the loop, and the share of the run's CPU."""
    srv = lambda name: phase(profiles, "server-worker", name)  # noqa: E731
    trn = lambda name: phase(profiles, "train", name)  # noqa: E731
    gen_serve, gen_stream = srv("generate:serve"), srv("generate:stream")
    gen_eval, score_eval = srv("generate:metaclaw-eval"), srv("score:metaclaw-eval")
    step, kl = trn("train_step"), trn("kl_reference")
    publish, ckpt, wait = trn("publish"), trn("checkpoint"), trn("hot_load_wait")
    user, eval_client = trn("user_simulation"), trn("eval_client")
    rows = {
        "user_simulation": {"cpu_s": user["cpu_s"], "wall_s": user["wall_s"]},
        "generation": {
            "cpu_s": gen_serve["cpu_s"] + gen_stream["cpu_s"],
            "wall_s": gen_serve["wall_s"] + gen_stream["wall_s"],
            "tokens": gen_serve["tokens"] + gen_stream["tokens"],
        },
        "capture": {"cpu_s": threads(profiles, "train", "uvicorn"), "wall_s": None},
        "scoring": {
            "cpu_s": threads(profiles, "train", "scoring-worker") + srv("score:serve")["cpu_s"],
            "wall_s": srv("score:serve")["wall_s"] or None,
        },  # fmt: skip
        "train_forward_backward": {"cpu_s": step["cpu_s"] - kl["cpu_s"], "wall_s": step["wall_s"] - kl["wall_s"]},
        "kl_reference": {"cpu_s": kl["cpu_s"], "wall_s": kl["wall_s"]},
        "publish_hot_load": {
            "cpu_s": publish["cpu_s"] + srv("hot_load")["cpu_s"],
            "wall_s": publish["wall_s"],
            "checkpoint_wall_s": ckpt["wall_s"],
            "hot_load_wait_wall_s": wait["wall_s"],
            "server_lock_wait_wall_s": srv("hot_load_lock_wait")["wall_s"],
        },
        "evaluation": {
            "cpu_s": gen_eval["cpu_s"] + score_eval["cpu_s"] + eval_client["cpu_s"],
            "wall_s": gen_eval["wall_s"] + score_eval["wall_s"],
            "tokens": gen_eval["tokens"],
            "replies": eval_client["n"],
        },
    }
    claimed = sum(r["cpu_s"] for r in rows.values())
    rows["other"] = {"cpu_s": max(total_cpu - claimed, 0.0), "wall_s": None}
    for r in rows.values():
        r["share"] = round(r["cpu_s"] / total_cpu, 3) if total_cpu else None
        for k, v in list(r.items()):
            if isinstance(v, float):
                r[k] = round(v, 1) if k != "share" else v
    return rows


def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    files = sorted(run_dir.rglob("metrics.csv"))
    if not files:
        return []
    with files[-1].open() as f:
        return list(csv.DictReader(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="training budget (rollout.max_time)")
    ap.add_argument("--out", type=Path, default=None, help="where the run and the profiles go")
    ap.add_argument("--report", type=Path, default=None, help="only report on an earlier run's --out DIR")
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose train.py runs (default: this one)")
    ap.add_argument("overrides", nargs="*", help="more train.py overrides")
    add_results_argument(ap)
    args = ap.parse_args()
    out = (args.report or args.out or ROOT / "outputs" / f"cycle_profile-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir, prof_dir = out / "run", out / "profile"
    seconds = int(args.minutes * 60)
    max_time = f"00:{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    repo = args.repo.resolve()
    cmd = [sys.executable, str(repo / "train.py"), f"rollout.max_time={max_time}", f"hydra.run.dir={run_dir}",
           *args.overrides]  # fmt: skip
    env = {
        **os.environ,
        "METACLAW_PROFILE_DIR": str(prof_dir),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "PYTHONPATH": os.pathsep.join([str(repo / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    if args.report is None:
        load_before = os.getloadavg()
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(out / "train.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
            cpu: dict[int, float] = {}
            stop = threading.Event()
            sampler = threading.Thread(target=sample_tree, args=(psutil.Process(proc.pid), cpu, stop), daemon=True)
            sampler.start()
            rc = proc.wait()
            stop.set()
            sampler.join(5)
        wall = time.monotonic() - t0
        (out / "tree.json").write_text(json.dumps({"rc": rc, "wall_s": wall, "cpu": cpu, "load_before": load_before}))
    tree = json.loads((out / "tree.json").read_text())
    rc, wall, cpu, load_before = tree["rc"], tree["wall_s"], tree["cpu"], tree["load_before"]
    profiles = load_profiles(prof_dir)
    total_cpu = max(sum(cpu.values()), sum(p["process_cpu_s"] for p in profiles))
    rows = breakdown(profiles, total_cpu)
    trn = lambda name: phase(profiles, "train", name)  # noqa: E731
    step = trn("train_step")
    tokens, positions, samples = trn("train_tokens")["tokens"], trn("train_positions")["tokens"], trn("train_samples")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()] if (
        run_dir / "eval.jsonl").exists() else []  # fmt: skip
    gen = rows["generation"]
    looked, reused = (phase(profiles, "server-worker", n) for n in ("prefix_lookup", "prefix_reused"))
    trained = samples["tokens"] if samples["n"] else summary.get("samples_trained")  # a checkout without profiling
    result = {
        "command": " ".join(cmd[1:]),
        "repo": str(repo),
        "rc": rc,
        "run": {
            "wall_s": round(wall, 1),
            "cpu_s": round(total_cpu, 1),
            "cpu_per_wall": round(total_cpu / wall, 2),
            "cores": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "steps": summary.get("steps", len([r for r in metrics_rows(run_dir) if r.get("loss/total")])),
            "samples_trained": summary.get("samples_trained"),
            "evaluations": [
                {k: e.get(k) for k in ("adapter", "compliance", "n", "good", "ci_low", "ci_high", "seconds", "cached")}
                for e in evals
            ],
        },
        "phases": rows,
        "throughput": {
            "generation_tokens_per_s": round(gen["tokens"] / gen["wall_s"], 2) if gen.get("wall_s") else None,
            "eval_generation_tokens_per_s": round(rows["evaluation"]["tokens"] / rows["evaluation"]["wall_s"], 2)
            if rows["evaluation"]["wall_s"]
            else None,
            "train_tokens_per_s": round(tokens / step["wall_s"], 1) if step["wall_s"] else None,
            "trained_samples_per_min": round(trained / args.minutes, 2) if trained is not None else None,
            "train_positions_per_token": round(positions / tokens, 3) if tokens else None,
            "train_step_wall_s_mean": round(step["wall_s"] / step["n"], 2) if step["n"] else None,
            # prompt tokens the servers read from their prefix caches (backend.prefix_cache_mb), of those looked up
            "prefix_reused_share": round(reused["tokens"] / looked["tokens"], 3) if looked["tokens"] else None,
        },
        "profiles": str(prof_dir),
    }
    publish(__file__, args, result)


if __name__ == "__main__":
    main()
