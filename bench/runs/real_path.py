"""The real path (issue 24): `python train.py rollout=proxy` with its own defaults, driven by people.

`run_real_path` starts the live service as a user would (model and method; a port of its choosing, the run
directory, and keys for the proxy and for the policy server it starts, so the bench can reach both), reads
the proxy's base_url from its log, and lets `metaclaw.simulate.people.People` talk to it for `--minutes`.
Held-out compliance is measured from outside, never through the proxy (so nothing is captured): the base model
first, then the newest published adapter every `--eval-every-min` minutes and at the end, loaded into the
policy server under its own name (`bench-eval`) and asked the held-out prompts with the preference's verifier
(`ComplianceEvaluator`, what `eval=heldout` does for the demo; under `rollout=proxy` `eval=heldout` has no
verifier and offers only the judge fallback). Then SIGTERM, and the store's figures (`store_figures`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from metaclaw.control.dashboard.data import reward_source
from metaclaw.evaluation.evaluator import ComplianceEvaluator
from metaclaw.lifecycle import set_pdeathsig
from metaclaw.runfiles.layout import AdapterFolder
from metaclaw.simulate.people import People, PreferenceKind, human_mode, phrasings
from metaclaw.skills.embedding import EmbeddingRanker
from metaclaw.wire.client import Endpoint, load_adapter

COLLAPSE = ("top_opening", "top_opening_share", "opening_entropy", "self_rouge_l")  # eval.jsonl's collapse figures

REPO = Path(__file__).resolve().parents[2]
SERVER_KEY_ENV = "METACLAW_BENCH_SERVER_KEY"
EVAL_NAME = "bench-eval"
STOP = threading.Event()  # SIGTERM / SIGINT to the bench: the run in progress ends early, its figures are kept
PROXY_READY = re.compile(r"point your agent at base_url=(\S+)")
SERVER_READY = re.compile(r"Policy server ready on (http://\S+)")


# ---- the service ------------------------------------------------------------------------------------------


def sessions_to_stable(turns: list[dict[str, Any]], run: int = 3) -> int | None:
    """OpenClaw-RL's "sessions to a stable effect": how many conversations the people had begun when `run`
    consecutive ones (in the order they began) first complied at their first reply, which no correction of that
    conversation can have shaped (the weights did), and that reply answered the question (a reply the people
    read as off-topic is not an effect, whatever its form); None if that never happened."""
    firsts = sorted((t["sent_at"], t["complied"] and t.get("answered", True)) for t in turns if t["index"] == 0)
    streak = 0
    for n, (_, good) in enumerate(firsts, start=1):
        streak = streak + 1 if good else 0
        if streak >= run:
            return n
    return None


def service_command(model: str, method: str, run_dir: Path, overrides: list[str]) -> list[str]:
    """`train.py rollout=proxy` with what a user passes (model, method) and where to find it; no demo setting."""
    return [sys.executable, "train.py", f"model={model}", f"method={method}", "rollout=proxy",
            "rollout.proxy.port=0", f"hydra.run.dir={run_dir}", f"serve.api_key=${{oc.env:{SERVER_KEY_ENV}}}",
            *overrides]  # fmt: skip


def wait_for_urls(log_path: Path, proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """(proxy base_url, policy server url) from the service's log, as a user reads them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        proxy, server = PROXY_READY.search(text), SERVER_READY.search(text)
        if proxy and server:
            return proxy.group(1), server.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"train.py exited with {proc.returncode} before serving; see {log_path}")
        if STOP.is_set():
            raise RuntimeError("the bench was stopped before the service was ready")
        time.sleep(0.5)
    raise TimeoutError(f"train.py did not print its base_url within {timeout_s}s; see {log_path}")


def stop_service(proc: subprocess.Popen, timeout_s: float = 180.0) -> int:
    """SIGTERM (the service finishes its step and stops), SIGKILL to its group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


# ---- watching the run -------------------------------------------------------------------------------------
class Watch:
    """Polls the store's status counts and `adapters/latest.json` every `poll_s` (read-only)."""

    def __init__(self, run_dir: Path, t0: float, poll_s: float = 5.0, newest: bool = False) -> None:
        self.run_dir, self.t0, self.poll_s, self.newest = run_dir, t0, poll_s, newest
        self.timeline: list[dict[str, Any]] = []
        self.published: dict[int, float] = {}  # version -> first seen (wall time)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-watch", daemon=True)

    def latest(self) -> tuple[int, str] | None:
        """The adapter the evaluations follow: the served one (`latest.json`), or with `newest` the newest one
        training published, served or not (what training learnt, whatever the gate decided)."""
        if self.newest:
            versions = AdapterFolder(self.run_dir / "adapters").versions()
            return (versions[-1][0], str(versions[-1][1])) if versions else None
        try:
            info = json.loads((self.run_dir / "adapters" / "latest.json").read_text())
            return int(info["version"]), str(info["path"])
        except (OSError, ValueError, KeyError):
            return None

    def _run(self) -> None:
        db = self.run_dir / "samples.sqlite"
        while not self._stop.wait(self.poll_s):
            latest = self.latest()
            if latest is not None:
                self.published.setdefault(latest[0], time.time())
            if not db.exists():
                continue
            try:
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
                    counts = dict(c.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
            except sqlite3.Error:
                continue
            self.timeline.append({"minutes": round((time.time() - self.t0) / 60, 2),
                                  "backlog": counts.get("pending", 0) + counts.get("ready", 0),
                                  "adapter": latest[0] if latest else 0, **counts})  # fmt: skip

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


class Evaluations:
    """Held-out compliance from outside the proxy: base first, then the newest adapter every `every_s`."""

    def __init__(self, server_url: str, key: str, kind: PreferenceKind, watch: Watch, args: Any) -> None:
        models = httpx.get(f"{server_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        models.raise_for_status()
        self.base = next(m["id"] for m in models.json()["data"] if not m.get("parent"))
        self.server_url, self.key, self.watch, self.every_s = server_url, key, watch, args.eval_every_min * 60
        # the people's client sends no temperature: the proxy's default (1.0) is what they meet
        per_prompt = getattr(args, "samples_per_prompt", 1)
        self.evaluator = ComplianceEvaluator(
            server_url,
            kind.rules,
            tasks_file=getattr(args, "heldout_tasks", None),
            n_prompts=args.eval_prompts,
            samples_per_prompt=per_prompt,
            max_tokens=args.max_tokens,
            temperature=1.0,
            api_key=key,
            concurrency=min(args.eval_prompts * per_prompt, 64),
            base_model=self.base,
            also={name: PreferenceKind.load(name).rules for name in getattr(args, "also_verify", [])},
        )  # fmt: skip  (every prompt at once: one batched generate, like eval.concurrency)
        self.curve: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-eval", daemon=True)
        self._last_version, self._last_start = 0, 0.0

    def evaluate(self, version: int, path: str | None) -> None:
        start = time.time()
        try:
            if path is not None:
                load_adapter(Endpoint(self.server_url, self.key), EVAL_NAME, path, 120.0)
            r = self.evaluator.score(self.base if path is None else EVAL_NAME)
        except Exception as e:  # noqa: BLE001 - an evaluation that failed is reported, never a made-up point
            self.errors.append(f"v{version}: {e!r}"[:300])
            return
        self.curve.append({"minutes": round((time.time() - self.watch.t0) / 60, 2),
                           "started_minutes": round((start - self.watch.t0) / 60, 2), "adapter": version,
                           "compliance": r.compliance, "good": r.quality.good, "nll": r.quality.nll, "n": r.n,
                           "errors": r.errors, "seconds": round(r.seconds, 1), "ci": [r.ci_low, r.ci_high],
                           **{k: v for k, v in r.as_dict().items() if k in COLLAPSE},
                           "distinct_replies": r.quality.distinct_replies, "also": r.also,
                           "also_failing": r.also_failing, "examples": r.examples})  # fmt: skip
        self._last_version, self._last_start = version, start

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            latest = self.watch.latest()
            if latest and latest[0] != self._last_version and time.time() - self._last_start >= self.every_s:
                self.evaluate(*latest)

    def start(self) -> Evaluations:
        self._thread.start()
        return self

    def finish(self) -> None:
        """Stop the cadence, then evaluate the newest adapter unless it was the last one measured."""
        self._stop.set()
        self._thread.join()
        latest = self.watch.latest()
        if latest and latest[0] != self._last_version:
            self.evaluate(*latest)


# ---- the store's figures ----------------------------------------------------------------------------------
def _label(next_state: str | None, prefixes: list[tuple[str, str]]) -> str:
    """What the person's next message said about the turn: praise | correction | unreacted | unknown."""
    if next_state is None:
        return "unreacted"
    text = " ".join(next_state.split()).lower()
    return next((label for phrase, label in prefixes if text.startswith(phrase)), "unknown")


def reaction_prefixes() -> list[tuple[str, str]]:
    """Every phrasing of `people.yaml` with its label, longest first (so no phrase shadows a longer one)."""
    out = [(p, label) for label, phrases in phrasings().items() for p in phrases]
    return sorted({(" ".join(p.split()).lower(), label) for p, label in out}, key=lambda x: -len(x[0]))


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None, "max": None, "mean": None}
    q = sorted(values)
    return {"median": round(statistics.median(q), 2), "p90": round(q[min(len(q) - 1, int(0.9 * len(q)))], 2),
            "max": round(q[-1], 2), "mean": round(statistics.fmean(q), 2)}  # fmt: skip


def _reward_counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    return {"n": len(rows), "positive": sum(x > 0 for x in rewards), "zero": sum(x == 0 for x in rewards),
            "negative": sum(x < 0 for x in rewards),
            "mean": round(statistics.fmean(rewards), 3) if rewards else None}  # fmt: skip


def store_figures(db_path: str | Path) -> dict[str, Any]:
    """The run's learning figures from its sample store. The one place the bench reads the store.

    Columns read: `status`, `reward`, `adapter_version` (the adapter that produced the sample), `claimed_step`
    (the optimizer step that trained it: it started from adapter version `claimed_step`), `created_at`
    (capture), `updated_at` (for a `consumed` sample: when its step's checkpoint was written, i.e. trained),
    `next_state` (the person's next message), `meta` (`judge.rule`, `at_least_one`, `feedback`, `dropped`,
    `session_source`). A column `trained_at` or `trained_version`, where the store has one, is used instead.
    """
    c = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    c.row_factory = sqlite3.Row
    cols = {r[1] for r in c.execute("PRAGMA table_info(samples)")}
    trained_at = "trained_at" if "trained_at" in cols else "CASE WHEN status='consumed' THEN updated_at END"
    version_at = "trained_version" if "trained_version" in cols else "claimed_step"
    sql = (f"SELECT id, session_id, status, reward, adapter_version, claimed_step, next_state, meta, created_at,"
           f" {trained_at} AS trained_at, {version_at} AS trained_version FROM samples ORDER BY id")  # fmt: skip
    rows = [dict(r) for r in c.execute(sql)]
    c.close()
    prefixes = reaction_prefixes()
    for r in rows:
        r["meta"] = json.loads(r["meta"] or "{}")
        r["label"] = "distilled" if r["meta"].get("distilled") else _label(r["next_state"], prefixes)
    trained = [r for r in rows if r["status"] in ("claimed", "consumed") and r["claimed_step"] is not None]
    distill = [r["meta"]["distill"] for r in rows if isinstance(r["meta"].get("distill"), dict)]
    ages = [r["trained_at"] - r["created_at"] for r in trained if r["trained_at"] is not None]
    stale = [r["trained_version"] - r["adapter_version"] for r in trained if r["trained_version"] is not None]
    status: dict[str, int] = {}
    dropped: dict[str, int] = {}
    sources: dict[str, int] = {}
    for r in rows:
        status[r["status"]] = status.get(r["status"], 0) + 1
        src = r["meta"].get("session_source", "unknown")
        sources[src] = sources.get(src, 0) + 1
        if r["status"] == "dropped":
            reason = str(r["meta"].get("dropped", "unknown")).split(":")[0]
            dropped[reason] = dropped.get(reason, 0) + 1
    by_rule: dict[str, list] = {}
    by_label: dict[str, list] = {}
    for r in trained:
        by_rule.setdefault(reward_source(r["meta"]) or "none", []).append(r)
        by_label.setdefault(r["label"], []).append(r)
    return {
        "captured": len(rows),
        "sessions": len({r["session_id"] for r in rows}),
        "session_source": sources,
        "status": status,
        "trained": len(trained),
        "steps": len({r["claimed_step"] for r in trained}),
        "age_at_training_s": _stats(ages),
        "staleness_versions": _stats(stale),
        "reward_by_rule": {k: _reward_counts(v) for k, v in sorted(by_rule.items())},
        "reward_by_reaction": {k: _reward_counts(v) for k, v in sorted(by_label.items())},
        "corrections_trained_positive": sum(r["label"] == "correction" and (r["reward"] or 0) > 0 for r in trained),
        "praise_trained_negative": sum(r["label"] == "praise" and (r["reward"] or 0) < 0 for r in trained),
        "unreacted_trained_zero": sum(r["label"] == "unreacted" and r["reward"] == 0 for r in trained),
        "lifted_from_negative": sum(((r["meta"].get("at_least_one") or {}).get("from") or 0) < 0 for r in trained),
        "dropped_by_reason": dropped,
        "distilled": {  # learning from the words (scoring.distill): corrections that stated a preference
            "asked": sum("gains" in d for d in distill),
            "hinted_replies": sum(len(d.get("gains", [])) for d in distill),
            "accepted": sum(d.get("accepted", 0) for d in distill),
            "no_stated_preference": sum(d.get("skipped") == "no stated preference" for d in distill),
            "failed": sum("error" in d for d in distill),
            "stored": sum(r["label"] == "distilled" for r in rows),
            "trained": sum(r["label"] == "distilled" for r in trained),
            "gain": _stats([g for d in distill for g in d.get("gains", [])]),
        },
    }


# ---- one run ----------------------------------------------------------------------------------------------
def run_real_path(kind_name: str, method: str, args: Any, out: Path) -> dict[str, Any]:
    """One service run with people holding `kind_name`; its curve, people's figures and the store's."""
    kind = PreferenceKind.load(kind_name, args.phrasings)
    run_dir = out / f"real-{method}-{kind_name}"
    log_path = out / f"{run_dir.name}.log"
    proxy_key, server_key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           "METACLAW_PROXY_API_KEY": proxy_key, SERVER_KEY_ENV: server_key}  # fmt: skip
    cmd = service_command(args.model, method, run_dir, args.override)
    result: dict[str, Any] = {"method": method, "preference": kind_name, "want": kind.want, "rules": kind.rules,
                              "command": " ".join(cmd[1:])}  # fmt: skip
    paces = {"machine": ["machine"] * args.people, "human": ["human"] * args.people,
             "mixed": [("machine", "human")[i % 2] for i in range(args.people)]}[args.pace]  # fmt: skip
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=set_pdeathsig)  # the service gets SIGTERM when the bench dies  # fmt: skip
    people = evals = watch = None
    try:
        proxy_url, server_url = wait_for_urls(log_path, proc, args.startup_timeout_s)
        watch = Watch(run_dir, time.time(), newest=getattr(args, "eval_adapter", "served") == "newest")
        evals = Evaluations(server_url, server_key, kind, watch, args)
        evals.evaluate(0, None)  # the base model, before anyone talks: minute 0
        watch.t0 = time.time()  # minutes count from the people's first message
        for point in evals.curve:
            point.update(minutes=0.0, started_minutes=0.0)
        watch.start()
        people = People(
            proxy_url,
            kind,
            people=args.people,
            pace=paces,
            api_key=proxy_key,
            anthropic_share=args.anthropic_share,
            max_tokens=args.max_tokens,
            seed=args.seed,
            substance=EmbeddingRanker() if getattr(args, "substance", "on") == "on" else None,
            **(human_mode() if getattr(args, "reactions", "all") == "human" else {}),
        ).start()
        evals.start()
        deadline = watch.t0 + args.minutes * 60
        while time.time() < deadline and proc.poll() is None and not STOP.is_set():
            time.sleep(1.0)
        people.stop()
        evals.finish()
    except Exception as e:  # noqa: BLE001 - the run's figures so far are still reported
        result["error"] = f"{e!r}"[:500]
    finally:
        if people is not None:
            people.stop(timeout=5.0)
        if watch is not None:
            watch.stop()
        result["returncode"] = stop_service(proc)
    result["wall_minutes"] = round((time.time() - watch.t0) / 60, 2) if watch else None
    result["stopped_early"] = STOP.is_set()
    if evals is not None:
        curve = evals.curve
        result.update(base=curve[0]["compliance"] if curve else None,
                      final=curve[-1]["compliance"] if len(curve) > 1 else None,
                      best=max((p["compliance"] for p in curve[1:]), default=None),
                      minutes_to_target=next((p["minutes"] for p in curve[1:] if p["compliance"] >= args.target), None),
                      curve=curve, eval_errors=evals.errors)  # fmt: skip
    if people is not None:
        result["people"] = people.summary()
        result["people"]["sessions_to_stable"] = sessions_to_stable(people.turn_records())
        (run_dir / "people_turns.jsonl").write_text("".join(json.dumps(t) + "\n" for t in people.turn_records()))
    if watch is not None:
        result["backlog"] = watch.timeline
        result["published"] = len(watch.published)
    if (run_dir / "samples.sqlite").exists():
        result["store"] = store_figures(run_dir / "samples.sqlite")
    result["gate"] = gate_figures(run_dir / "gate.jsonl", watch.t0 if watch else None)
    return result


def gate_figures(path: Path, t0: float | None) -> dict[str, Any]:
    """The publish gate's decisions (`<run dir>/gate.jsonl`): counts by decision, the minute the first adapter
    was served, and each measured decision's step, minute and estimates (the curve shows only served adapters)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    gates = [r for r in rows if r.get("kind") == "gate"]
    minute = (lambda r: round((r["time"] - t0) / 60, 2)) if t0 else (lambda r: None)
    accepted = [r for r in gates if r.get("decision") == "accepted"]
    return {
        "decisions": dict(Counter(str(r.get("decision")) for r in gates)),
        "findings": dict(Counter(str(r["finding"]) for r in gates if r.get("finding"))),  # docs/online_loop.md "Gate"
        "first_served_minute": minute(accepted[0]) if accepted else None,
        "rollbacks": sum(r.get("kind") == "regression" for r in rows),
        "measured": [
            {
                "step": r.get("step"),
                "minute": minute(r),
                "decision": r.get("decision"),
                "n": r.get("n"),
                "served": r.get("served"),
                "candidate": r.get("candidate"),
                "finding": r.get("finding"),
            }
            for r in gates
            if r.get("decision") in ("accepted", "rejected")
        ],  # fmt: skip
    }


def plot_real_path(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """Held-out compliance (left) and the store's backlog (right) against minutes since the people started."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for r in results:
        label = f"{r['method']} / {r['preference']}"
        if r.get("curve"):
            xs, ys = [p["minutes"] for p in r["curve"]], [100 * p["compliance"] for p in r["curve"]]
            ax.plot(xs, ys, marker="o", label=label)
        if r.get("backlog"):
            bx.plot([p["minutes"] for p in r["backlog"]], [p["backlog"] for p in r["backlog"]], label=label)
    ax.set_xlabel("minutes since the people started")
    ax.set_ylabel("held-out compliance (%)")
    ax.set_ylim(-3, 103)
    bx.set_xlabel("minutes since the people started")
    bx.set_ylabel("backlog (pending + ready samples)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
