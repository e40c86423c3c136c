"""A finished run's held-out points again, with more replies: the base model and the run's last adapters, each
asked `--samples-per-prompt` times per held-out prompt (issue 42: a claim rests on 64 or more replies a point).

    python bench/tools/reeval.py RUN_DIR [RUN_DIR ...] [--samples-per-prompt 2] [--engine onnx|hf]

RUN_DIR is a `train.py` run directory with a verifier (`rollout=simulated_user`, the main job; cycle_profile's
`--out DIR/run`). From its composed config (`.hydra/config.yaml`) the tool takes what the run's own evaluator used:
the preference's rules and system prompt, the held-out tasks, `eval.n_prompts`, `eval.seed`, `eval.max_tokens` and
`eval.temperature`. Only the replies per prompt change. One `python serve.py` (the product's server, its default
engine unless `--engine`) answers every run; each adapter is hot-loaded under its own name. The base model is
measured once per distinct evaluation setting and shared by the runs that have it.

Measured per run: `base`, `final` (the newest `adapters/step-*`, what the run's summary calls final) and `served`
(`adapters/latest.json`, what the user was served at the end, when it differs from the final one). Each point has
its compliance, Wilson interval, quality (`good`, `nll`) and collapse figures (the most common opening and its
share), beside what the run itself measured with its own replies (`run_compliance`). `--replies FILE` keeps every
reply, to be read. The verifier is today's code (`metaclaw.simulate.preferences`), which may be stricter than the
run's own.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

import httpx  # noqa: E402
import yaml  # noqa: E402

from bench.harness import add_results_argument, publish  # noqa: E402
from bench.harness.procs import serving  # noqa: E402
from metaclaw.evaluation.evaluator import ComplianceEvaluator  # noqa: E402
from metaclaw.lifecycle import free_port  # noqa: E402
from metaclaw.runfiles.layout import RunLayout  # noqa: E402
from metaclaw.wire.client import Endpoint, load_adapter  # noqa: E402

KEEP = ("compliance", "n", "errors", "ci_low", "ci_high", "good", "nll", "top_opening", "top_opening_share",
        "opening_entropy", "seconds")  # fmt: skip


def _value(node: Any, default: Any) -> Any:
    """A config value as the run resolved it: the evaluator's `${oc.select:rollout.simulated_user.x,d}` and
    `${seed}` are the only interpolations read here, and the caller passes what they resolve to."""
    return default if node is None or (isinstance(node, str) and node.startswith("${")) else node


def eval_settings(run: Path) -> dict[str, Any]:
    """What the run's own ComplianceEvaluator was built with (`metaclaw.loop.eval_wiring`), from its config dump."""
    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    ev, user, pref = cfg["eval"], cfg["rollout"].get("simulated_user") or {}, cfg["preference"]
    if not pref.get("rules"):
        raise SystemExit(f"{run}: no preference rules (a run without a verifier cannot be re-evaluated here)")
    return {
        "rules": pref["rules"],
        "system": pref.get("system"),
        "tasks_file": user.get("tasks_file"),
        "n_prompts": int(ev["n_prompts"]),
        "seed": int(_value(ev.get("seed"), cfg.get("seed", 0))),
        "max_tokens": int(_value(ev.get("max_tokens"), user.get("max_tokens", 32))),
        "temperature": float(_value(ev.get("temperature"), user.get("temperature", 1.0))),
    }


def adapters_of(run: Path) -> dict[str, Path]:
    """`final`: the newest adapter the trainer published (`adapters/step-*`, what the run's summary calls final);
    `served`: what the run served at its end (`adapters/latest.json`, the gate's last accepted or a rollback's pin),
    when it differs from the final one."""
    folder = RunLayout(run).adapters()
    versions = folder.versions()
    out: dict[str, Path] = {"final": versions[-1][1]} if versions else {}
    latest = folder.read_latest()
    if latest and Path(latest["path"]) != out.get("final"):
        out["served"] = Path(latest["path"])
    return {k: p for k, p in out.items() if p.is_dir()}


def run_compliance(run: Path) -> dict[str, Any]:
    """What the run measured itself: its eval.jsonl records by adapter name (32 replies a point by default)."""
    path = run / "eval.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["adapter"]: {"compliance": r["compliance"], "n": r["n"]} for r in records if "adapter" in r}


def labels_of(runs: list[Path]) -> list[str]:
    """The runs' names in the report: their paths below the folder they share (`s21/onnx-1/run`), or for one run
    its folder (with the parent's name for cycle_profile's `<out>/run`); names that collide are refused."""
    if len(runs) == 1:
        run = runs[0]
        return [f"{run.parent.name}/{run.name}" if run.name == "run" else run.name]
    root = Path(os.path.commonpath([str(r) for r in runs]))
    labels = [str(r.relative_to(root)) for r in runs]
    if len(set(labels)) < len(labels):
        raise SystemExit(f"the same run twice: {sorted(labels)}")
    return labels


class Measure:
    """One evaluator per distinct evaluation setting; the base model is measured once per setting and that point
    is every such run's `base` (it does not depend on the run)."""

    def __init__(self, url: str, key: str, base: str, per_prompt: int) -> None:
        self.url, self.key, self.base, self.per_prompt = url, key, base, per_prompt
        self._evaluators: dict[str, tuple[ComplianceEvaluator, dict[str, Any]]] = {}

    def evaluator(self, settings: dict[str, Any]) -> tuple[ComplianceEvaluator, dict[str, Any]]:
        """The evaluator for these settings and its base point, built and measured on first use."""
        key = json.dumps(settings, sort_keys=True)
        if key not in self._evaluators:
            n = settings["n_prompts"] * self.per_prompt
            evaluator = ComplianceEvaluator(
                self.url, settings["rules"], tasks_file=settings["tasks_file"], n_prompts=settings["n_prompts"],
                samples_per_prompt=self.per_prompt, max_tokens=settings["max_tokens"],
                temperature=settings["temperature"], system=settings["system"], api_key=self.key, concurrency=n,
                seed=settings["seed"], base_model=self.base, keep_examples=n,
            )  # fmt: skip
            self._evaluators[key] = (evaluator, evaluator.score(self.base).as_dict())
        return self._evaluators[key]

    def run(self, run: Path, replies: dict[str, Any]) -> dict[str, Any]:
        """The run's base, final and served points, beside what the run measured itself."""
        settings = eval_settings(run)
        evaluator, base = self.evaluator(settings)
        own = run_compliance(run)
        points: dict[str, Any] = {}
        for label, path in {"base": None, **adapters_of(run)}.items():
            if path is None:
                r = base
            else:
                name = f"reeval-{label}-{path.name}"
                load_adapter(Endpoint(self.url, self.key), name, str(path), 120.0)
                r = evaluator.score(name).as_dict()
            replies[label] = r.get("examples")
            adapter = "base" if path is None else path.name
            points[label] = {"adapter": adapter, **{k: r.get(k) for k in KEEP}, "run_compliance": own.get(adapter)}
        gain = None
        if "final" in points:
            gain = round(100 * (points["final"]["compliance"] - points["base"]["compliance"]), 1)
        return {"settings": {k: v for k, v in settings.items() if k != "rules"}, "points": points, "gain_points": gain}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="train.py run directories")
    p.add_argument("--samples-per-prompt", type=int, default=2, help="replies per held-out prompt (2: 64 a point)")
    p.add_argument("--engine", default=None, help="backend.cpu_engine for the server (default: the product's)")
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--replies", type=Path, default=None, help="write every reply here (JSON: run -> point -> texts)")
    add_results_argument(p)
    args = p.parse_args()
    runs = [r.resolve() for r in args.runs]
    for run in runs:
        if not (run / ".hydra" / "config.yaml").exists():
            p.error(f"{run} is not a train.py run directory (no .hydra/config.yaml)")
    labels, root = labels_of(runs), Path(os.path.commonpath([str(r) for r in runs]))
    key, port = secrets.token_urlsafe(16), free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="reeval-") as tmp:
        engine = [f"backend.cpu_engine={args.engine}"] if args.engine else []
        cmd = [sys.executable, "serve.py", f"model={args.model}", f"serve.port={port}", f"serve.adapter_root={root}",
               f"hydra.run.dir={tmp}/server", *engine]  # fmt: skip
        with serving(cmd, f"{url}/health", Path(tmp) / "server.log", {"METACLAW_API_KEY": key}, timeout_s=600):
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
            base = next(m["id"] for m in models["data"] if not m.get("parent"))
            texts: dict[str, Any] = {}
            measure = Measure(url, key, base, args.samples_per_prompt)
            measured = {name: measure.run(r, texts.setdefault(name, {})) for name, r in zip(labels, runs, strict=True)}
    report = {"engine": args.engine or "default", "runs": measured}
    if args.replies:
        args.replies.write_text(json.dumps(texts, indent=1))
    publish(__file__, args, report)


if __name__ == "__main__":
    main()
