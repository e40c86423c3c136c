"""Learning curves: held-out compliance over wall time, per method, with and without skills (issue 13).

Each run is the main job (`train.py`, simulated user through the proxy, live evaluation) with one method and
skills on or off, for `--minutes` of training, in its own run directory under `--out`:

    python bench/runs/learning.py                                   # rl, opd, combine x skills off/on, 40 min each
    python bench/runs/learning.py --methods combine --skills off --minutes 15
    python bench/runs/learning.py --model tiny --minutes 1 --methods rl   # smoke

Prints JSON (also written to `<out>/learning.json`): per run the base and final held-out compliance and good
replies (complies and fluent) and the base model's NLL per token of the replies (quality: docs/learning.md),
the best compliance, the minutes until compliance first reached `--target` (null if never), optimizer steps,
trained samples, simulated-user replies, and throughput (trained samples and user replies per minute of
training, and the median seconds one evaluation took). Writes `<out>/learning.png` (every curve against wall
minutes) beside each run's own `compliance.png`.

Learning throughput with and without batched generation (issue 13, item 6), side by side in one invocation:

    python bench/runs/learning.py --methods rl --skills off --minutes 8 --batching both

runs each configuration twice, first with `backend.max_batch_size=1` (the HF engine one request at a time, the
"before"), then with the configured batching, and adds a `batching` block: both throughputs and their ratios.

Runs made by separate invocations (one 2-core machine runs one at a time) are put side by side with

    python bench/runs/learning.py --merge a/learning.json b/learning.json --at-minutes 18 --out six

which writes one `learning.json` (every run, and a `table`: per run the base, best and final compliance and
the last evaluation at or before `--at-minutes` wall minutes, so runs of different lengths compare over the same
window) and one `learning.png` with every curve.

The real path (issue 24, `bench/runs/real_path.py`): the live service `train.py rollout=proxy` with its own defaults,
people talking to it with the plain `openai` client (and the `anthropic` SDK) and no session headers, feedback
only in their next message, in their own words (`metaclaw.simulate.people`):

    python bench/runs/learning.py --real-path --people 2 --pace machine --preference summary_first --minutes 40
    python bench/runs/learning.py --real-path --preference number,summary_first,address_you --minutes 40
    python bench/runs/learning.py --real-path --preference identity --minutes 20 --eval-every-min 4 \
        --heldout-tasks bench/data/claas_identity_probes.jsonl --eval-prompts 10 --samples-per-prompt 7 \
        --also-verify no_emoji

One run per method and preference kind; the JSON has the held-out curve (measured from outside the proxy) and
the store's figures: sample age at training, staleness in adapter versions, the reward mix by rule and by the
person's reaction, corrections trained above 0, unreacted turns trained at 0, the backlog over time, drops by
reason; `learning.png` plots the curves and the backlog. With `--also-verify no_emoji` every curve point also has
`also`: the same replies' compliance with another kind's verifier (a preference kept while another is learnt).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402


def run_one(method: str, skills: bool, args: argparse.Namespace, out: Path, batching: bool = True) -> dict[str, Any]:
    """One `train.py` run; its summary, curve against wall minutes, and throughput. `batching=False`: the
    policy server samples one request at a time (`backend.max_batch_size=1`)."""
    run_dir = out / f"{method}-{'skills' if skills else 'noskills'}{'' if batching else '-nobatch'}"
    minutes = int(args.minutes)
    seconds = int(round((args.minutes - minutes) * 60))
    cmd = [
        sys.executable,
        "train.py",
        f"model={args.model}",
        f"method={method}",
        *([f"preference={args.preference}"] if args.preference else []),
        f"rollout.max_time=00:00:{minutes:02d}:{seconds:02d}",
        f"skills.enabled={str(skills).lower()}",
        f"skills.library_root={run_dir / 'skills'}",
        f"hydra.run.dir={run_dir}",
        *args.override,
        *([] if batching else ["backend.max_batch_size=1"]),
    ]
    t0 = time.time()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    with open(out / f"{run_dir.name}.log", "w") as logf:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    result: dict[str, Any] = {
        "method": method, "skills": skills, "batching": batching, "returncode": proc.returncode, "wall_s": wall,
    }  # fmt: skip
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        result["error"] = f"train.py failed (rc {proc.returncode}): see {out / f'{run_dir.name}.log'}"
        return result
    summary = json.loads(summary_path.read_text())
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    start = rows[0]["time"] - rows[0].get("seconds", 0.0) if rows else t0
    curve = [
        {"minutes": round((r["time"] - start) / 60, 2), "step": r["step"], "adapter": r["adapter"],
         "compliance": r["compliance"], "good": r.get("good"), "nll": r.get("nll")}
        for r in rows
    ]  # fmt: skip
    reached = next((p["minutes"] for p in curve if p["adapter"] != "base" and p["compliance"] >= args.target), None)
    train_min = max(args.minutes, 1e-6)
    result.update(
        base=summary.get("base_compliance"),
        final=summary.get("final_compliance"),
        base_good=summary.get("base_good"),
        final_good=summary.get("final_good"),
        base_nll=summary.get("base_nll"),
        final_nll=summary.get("final_nll"),
        best=max((p["compliance"] for p in curve if p["adapter"] != "base"), default=None),
        minutes_to_target=reached,
        steps=summary.get("steps"),
        samples_trained=summary.get("samples_trained"),
        user_replies=summary.get("user", {}).get("replies"),
        trained_samples_per_min=round(summary.get("samples_trained", 0) / train_min, 2),
        user_replies_per_min=round(summary.get("user", {}).get("replies", 0) / train_min, 2),
        eval_seconds_median=statistics.median(r["seconds"] for r in rows) if rows else None,
        unfinished_evaluations=summary.get("unfinished_evaluations", []),
        curve=curve,
        plot=summary.get("plot"),
    )
    return result


def compare_batching(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and skills setting run both ways: throughput without and with batching, and the ratios."""
    keys = ("trained_samples_per_min", "user_replies_per_min", "eval_seconds_median", "steps")
    rows = []
    for off in (r for r in results if not r.get("batching") and "error" not in r):
        on = next((r for r in results if r.get("batching") and "error" not in r
                   and (r["method"], r["skills"]) == (off["method"], off["skills"])), None)  # fmt: skip
        if on is None:
            continue
        row: dict[str, Any] = {"method": off["method"], "skills": off["skills"]}
        for key in keys:
            row[key] = {"before": off.get(key), "after": on.get(key)}
            if off.get(key) and on.get(key) is not None:
                row[key]["ratio"] = round(on[key] / off[key], 3)
        rows.append(row)
    return rows


def at_minutes(run: dict[str, Any], minutes: float) -> dict[str, Any] | None:
    """The run's last evaluation that finished at or before `minutes` wall minutes (None if none did)."""
    points = [p for p in run.get("curve") or [] if p["minutes"] <= minutes]
    return points[-1] if points else None


def merge(paths: list[Path], minutes: float | None) -> dict[str, Any]:
    """One report of the runs in several `learning.json` files, with a per-run table (see the module doc)."""
    reports = [json.loads(Path(path).read_text()) for path in paths]
    runs = [{**run, "source": str(path), "overrides": report.get("overrides", []),
             "minutes_per_run": report.get("minutes_per_run")}
            for path, report in zip(paths, reports, strict=True) for run in report["runs"]]  # fmt: skip
    table = []
    for run in runs:
        row = {k: run.get(k) for k in ("method", "skills", "minutes_per_run", "base", "best", "final",
                                       "final_good", "final_nll", "minutes_to_target", "steps",
                                       "trained_samples_per_min", "eval_seconds_median", "error")}  # fmt: skip
        if minutes is not None:
            point = at_minutes(run, minutes)
            keys = ("minutes", "step", "compliance", "good", "nll")
            row[f"at_{minutes:g}_min"] = point and {k: point[k] for k in keys}
        table.append(row)
    return {"merged_from": [str(p) for p in paths], "at_minutes": minutes, "table": table, "runs": runs}


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in results:
        if r.get("curve"):
            xs = [p["minutes"] for p in r["curve"]]
            ys = [100 * p["compliance"] for p in r["curve"]]
            label = r["method"] + (" + skills" if r["skills"] else "")
            label += "" if r.get("batching", True) else " (no batching)"
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("wall minutes since the run's first evaluation")
    ax.set_ylabel("held-out compliance (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def real_path(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """`--real-path`: one `train.py rollout=proxy` run per method and preference kind (`bench/runs/real_path.py`)."""
    from bench.runs import real_path as rp  # its imports (the people, the evaluator) only on this path

    methods = [m.strip() for m in (args.methods or "rl").split(",") if m.strip()]
    kinds = [k.strip() for k in (args.preference or "number").split(",") if k.strip()]
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop early, but stop the service and report what was measured
        signal.signal(sig, lambda *_: rp.STOP.set())
    results = []
    for method, kind in itertools.product(methods, kinds):
        if rp.STOP.is_set():
            break
        results.append(rp.run_real_path(kind, method, args, out))
        brief = {k: v for k, v in results[-1].items() if k not in ("curve", "backlog", "store", "people")}
        print(json.dumps(brief), file=sys.stderr, flush=True)
    report = {
        "mode": "real_path",
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]},
        "model": args.model,
        "minutes_per_run": args.minutes,
        "people": args.people,
        "pace": args.pace,
        "reactions": args.reactions,
        "phrasings": args.phrasings,
        "max_tokens": args.max_tokens,
        "heldout_tasks": args.heldout_tasks,
        "samples_per_prompt": args.samples_per_prompt,
        "also_verify": args.also_verify,
        "target": args.target,
        "overrides": args.override,
        "runs": results,
    }
    title = f"real path: {args.model}, {args.people} people at {args.pace} pace, {args.minutes:g} min per run"
    rp.plot_real_path(results, out / "learning.png", title)
    report["plot"] = str(out / "learning.png")
    (out / "learning.json").write_text(json.dumps(report, indent=1))
    publish(__file__, args, report)
    return report


def kind_list(text: str) -> list[str]:
    """`--also-verify`: people kinds, comma-separated; an unknown one is refused before any run starts."""
    from metaclaw.simulate.people import kinds

    names = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in names if k not in kinds()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown people kind(s) {unknown}: one of {', '.join(kinds())}")
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--methods", default=None, help="comma-separated: rl, opd, combine (default: all three; the real path: rl)"
    )
    p.add_argument("--skills", choices=["off", "on", "both"], default="both")
    p.add_argument(
        "--minutes", type=float, default=40.0, help="training time per run (rollout.max_time); real path: people's"
    )
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument(
        "--preference",
        default=None,
        help="a conf/preference name (default: the demo's); with "
        "--real-path: people's preference kinds, comma-separated (metaclaw/simulate/people.yaml)",
    )
    real = p.add_argument_group("the real path (--real-path)")
    real.add_argument("--real-path", action="store_true", help="drive `train.py rollout=proxy` with people")
    real.add_argument("--people", type=int, default=2, help="people talking at once")
    real.add_argument(
        "--pace",
        choices=["machine", "human", "mixed"],
        default="machine",
        help="machine: next message as soon as the reply arrives; human: reading/typing pauses",
    )
    real.add_argument(
        "--phrasings",
        choices=["train", "heldout", "all"],
        default="train",
        help="which share of the people's phrasings (every 5th is held out)",
    )
    real.add_argument(
        "--reactions",
        choices=["all", "human"],
        default="all",
        help="all: people react to every reply at once; human: to half of them, a quarter of those minutes late, "
        "the rest followed by no-verdict messages (simulate.people.human_mode)",
    )
    real.add_argument(
        "--substance",
        choices=["on", "off"],
        default="on",
        help="on: people also correct a reply that does not answer their question, whatever its form "
        "(simulate.substance; session 30); off: they react to the form alone (sessions 17-29)",
    )
    real.add_argument("--anthropic-share", type=float, default=0.25, help="conversations through /v1/messages")
    real.add_argument("--max-tokens", type=int, default=48, help="max_tokens the people's client sends")
    real.add_argument("--eval-every-min", type=float, default=4.0, help="evaluate the newest adapter this often")
    real.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per evaluation")
    real.add_argument("--heldout-tasks", default=None,
                      help="JSONL of held-out prompts (split heldout), e.g. bench/data/claas_identity_probes.jsonl; "
                      "default: the packaged tasks' held-out split")  # fmt: skip
    real.add_argument("--samples-per-prompt", type=int, default=1, help="replies per held-out prompt")
    real.add_argument("--also-verify", type=kind_list, default=[],
                      help="people kinds, comma-separated (e.g. no_emoji): every held-out evaluation also reports "
                      "the same replies' compliance with each one's verifier (each curve point's `also`)")  # fmt: skip
    real.add_argument("--eval-adapter", choices=["served", "newest"], default="served",
                      help="served: the adapter the gate let through; newest: the newest one trained")  # fmt: skip
    real.add_argument("--startup-timeout-s", type=float, default=900.0)
    real.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batching",
        choices=["on", "off", "both"],
        default="on",
        help="generation batching: on (the config's), off (backend.max_batch_size=1), both (off, then on)",
    )
    p.add_argument("--target", type=float, default=0.8, help="held-out compliance to reach")
    p.add_argument("--out", default=None, help="output dir (default: outputs/bench-learning/<time>)")
    p.add_argument("--merge", nargs="+", type=Path, default=None, help="learning.json files to put side by side")
    p.add_argument("--at-minutes", type=float, default=None, help="with --merge: compare runs at this wall minute")
    p.add_argument("override", nargs="*", help="more Hydra overrides for every run (e.g. optimizer.lr=2e-3)")
    add_results_argument(p)
    args = p.parse_args()
    out = Path(args.out or REPO / "outputs" / "bench-learning" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        report = merge(args.merge, args.at_minutes)
        plot(report["runs"], out / "learning.png", f"{len(report['runs'])} runs, held-out compliance")
        report["plot"] = str(out / "learning.png")
        (out / "learning.json").write_text(json.dumps(report, indent=1))
        publish(__file__, args, {k: v for k, v in report.items() if k != "runs"})
        return
    if args.real_path:
        real_path(args, out)
        return
    skills = {"off": [False], "on": [True], "both": [False, True]}[args.skills]
    batching = {"on": [True], "off": [False], "both": [False, True]}[args.batching]
    results = []
    methods = [m.strip() for m in (args.methods or "rl,opd,combine").split(",") if m.strip()]
    for method, sk, batched in itertools.product(methods, skills, batching):
        results.append(run_one(method, sk, args, out, batching=batched))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "curve"}), file=sys.stderr, flush=True)
    report = {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]},
        "model": args.model,
        "preference": args.preference or "(the demo's default)",
        "minutes_per_run": args.minutes,
        "target": args.target,
        "overrides": args.override,
        "runs": results,
    }
    if args.batching == "both":
        report["batching"] = compare_batching(results)
    title = f"{args.model}, preference={args.preference or 'default'}, {args.minutes:g} min per run"
    plot(results, out / "learning.png", title)
    report["plot"] = str(out / "learning.png")
    (out / "learning.json").write_text(json.dumps(report, indent=1))
    publish(__file__, args, report)


if __name__ == "__main__":
    main()
