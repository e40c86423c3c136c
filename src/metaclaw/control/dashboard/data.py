"""`DashboardData`: every figure the dashboard and `status --watch` show, as one JSON-ready dict.

It reads only files of the run directory (eval.jsonl, gate.jsonl, adapters/, the SQLite store through a
read-only connection) and, in a live service, asks the control plane (scheduler window, served adapters). Turn
text is included only when `show_text` (a local flag, off by default: the page may be left open on a screen).
Bounded: the newest `max_points` eval records, `max_gate` gate records, `max_sessions` sessions.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import time
from pathlib import Path
from typing import Any

from metaclaw.control.dashboard.series import metric_series, reward_mix
from metaclaw.control.plane import tail_jsonl
from metaclaw.evaluation.stats import wilson
from metaclaw.runfiles.layout import RunLayout

QUALITY = ("good", "fluent", "nll", "reward", "junk")


def curve_point(record: dict[str, Any]) -> dict[str, Any]:
    """One eval.jsonl record as a curve point: compliance with its 95% interval (the record's `ci_low`/`ci_high`
    when it has them, else Wilson's over its `n`)."""
    compliance, n = float(record.get("compliance", 0.0)), int(record.get("n") or 0)
    low, high = record.get("ci_low"), record.get("ci_high")
    if low is None or high is None:
        low, high = wilson(compliance * n, n)
    point = {"step": record.get("step"), "adapter": record.get("adapter"), "compliance": compliance, "n": n,
             "ci_low": low, "ci_high": high, "time": record.get("time")}  # fmt: skip
    point.update({k: record.get(k) for k in QUALITY})
    if isinstance(record.get("gate"), dict):
        point["gate"] = record["gate"].get("decision")
    return point


class DashboardData:
    """The dashboard's figures for one run.

    Args:
        run_dir: the run directory.
        plane: the live service's `ControlPlane` (None: a finished run, read from its files alone).
        show_text: include prompts' last user message, replies and reactions in `sessions`.
        skills_root: the skills library root (None: no skills panel).
        max_points / max_gate / max_sessions: bounds of what one state carries.
    """

    def __init__(
        self,
        run_dir: str | Path,
        plane: Any = None,
        show_text: bool = False,
        skills_root: str | Path | None = None,
        max_points: int = 500,
        max_gate: int = 100,
        max_sessions: int = 12,
    ) -> None:
        self.run_dir, self.plane, self.show_text = Path(run_dir), plane, show_text
        self.skills_root = Path(skills_root).expanduser() if skills_root else None
        self.max_points, self.max_gate, self.max_sessions = max_points, max_gate, max_sessions

    @property
    def live(self) -> bool:
        return self.plane is not None

    def _db(self) -> sqlite3.Connection | None:
        path = self.run_dir / "samples.sqlite"
        if self.plane is not None and getattr(self.plane, "store", None) is not None:
            path = Path(self.plane.store.path)
        if not path.exists():
            return None
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)

    # ---- the parts ----------------------------------------------------------------------------------------
    def curves(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for r in tail_jsonl(self.run_dir / "eval.jsonl", self.max_points, max_bytes=4 << 20):
            out.setdefault(str(r.get("agent_id") or "default"), []).append(curve_point(r))
        for points in out.values():
            points.sort(key=lambda p: (p["step"] if isinstance(p["step"], int) else -1, p["time"] or 0))
        return out

    def gate(self) -> list[dict[str, Any]]:
        return tail_jsonl(self.run_dir / "gate.jsonl", self.max_gate, max_bytes=4 << 20)

    def samples(self) -> dict[str, Any] | None:
        db = self._db()
        if db is None:
            return None
        now = time.time()
        with db:
            by_status = dict(db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
            dropped = dict(db.execute("SELECT COALESCE(json_extract(meta, '$.dropped'), 'other'), COUNT(*) FROM "
                                      "samples WHERE status='dropped' GROUP BY 1").fetchall())  # fmt: skip
            scored = db.execute("SELECT COUNT(*) FROM samples WHERE reward IS NOT NULL").fetchone()[0]
            waiting = [now - t for (t,) in db.execute("SELECT created_at FROM samples WHERE status='ready'")]
            trained = [t for (t,) in db.execute("SELECT updated_at - created_at FROM samples WHERE status='consumed' "
                                                "ORDER BY id DESC LIMIT 200")]  # fmt: skip
        db.close()
        return {
            "captured": sum(by_status.values()), "scored": scored, "trained": by_status.get("consumed", 0),
            "by_status": by_status, "dropped": dropped, "backlog": by_status.get("ready", 0),
            "oldest_waiting_s": max(waiting, default=None),
            "median_trained_age_s": statistics.median(trained) if trained else None,
        }  # fmt: skip

    def adapters(self, gate: list[dict[str, Any]]) -> dict[str, Any]:
        """Every kept adapter (per agent) with its gate decision, and which one each agent is served."""
        decisions = {(g.get("agent_id", "default"), g.get("adapter")): g for g in gate if g.get("kind") == "gate"}
        served = self.served()
        out: dict[str, Any] = {}
        for agent, folder in RunLayout(self.run_dir).all_adapters().items():
            serving = (served.get(agent) or {}).get("path") or ""
            rows = []
            for version, d in folder.versions():
                g = decisions.get((agent, d.name)) or {}
                rows.append({"step": version, "name": d.name, "gate": g.get("decision"),
                             "candidate": g.get("candidate"), "served_score": g.get("served"),
                             "reasons": g.get("reasons") or ([g["note"]] if g.get("note") else None),
                             "served": bool(serving) and Path(serving).name == d.name})  # fmt: skip
            out[agent] = {"served": served.get(agent), "adapters": rows}
        return out

    def served(self) -> dict[str, Any]:
        if self.plane is not None:
            try:
                return self.plane.served_adapters()
            except Exception as e:  # noqa: BLE001 - the page still shows the rest
                return {"default": {"path": None, "source": f"unavailable: {e}"}}
        latest = RunLayout(self.run_dir).adapters().read_latest()
        if latest is None:
            return {}
        return {"default": {"path": latest.get("path"), "version": latest.get("version"), "source": "last published"}}

    def window(self) -> dict[str, Any] | None:
        if self.plane is None:
            return None
        sched = getattr(self.plane, "scheduler", None)
        if sched is None:
            return {"open": True, "reasons": ["no scheduler in this mode: always open"], "paused": False}
        return sched.status()

    def sessions(self) -> list[dict[str, Any]]:
        db = self._db()
        if db is None:
            return []
        with db:
            rows = db.execute(
                "SELECT id, agent_id, session_id, turn_index, adapter_version, reward, status, meta, response_text, "
                "next_state, messages, created_at FROM samples ORDER BY id DESC LIMIT ?", (self.max_sessions * 8,)
            ).fetchall()  # fmt: skip
        db.close()
        sessions: dict[tuple[str, str], dict[str, Any]] = {}
        for sid, agent, session, turn, version, reward, status, meta, reply, nxt, messages, created in rows:
            key = (agent, session)
            if key not in sessions:
                if len(sessions) >= self.max_sessions:
                    continue
                sessions[key] = {"agent_id": agent, "session_id": session, "turns": [], "time": created}
            meta = json.loads(meta or "{}")
            turn_row = {"id": sid, "turn_index": turn, "adapter_version": version, "reward": reward,
                        "status": status, "dropped": meta.get("dropped"), "source": reward_source(meta)}  # fmt: skip
            if self.show_text:
                turn_row.update(reply=(reply or "")[:2000], reaction=(nxt or "")[:2000], user=last_user(messages))
            sessions[key]["turns"].append(turn_row)
        for s in sessions.values():
            s["turns"].sort(key=lambda t: t["turn_index"])
        return list(sessions.values())

    def skills(self) -> dict[str, Any]:
        root = self.skills_root
        if root is None or not root.is_dir():
            return {}
        out = {}
        for d in sorted(root.iterdir()):
            if not d.is_dir() or d.name.startswith((".", "_")):
                continue
            names = sorted(p.parent.name for p in d.glob("*/SKILL.md"))
            history = tail_jsonl(d / ".metaclaw" / "history.jsonl", 10)
            try:
                generation = json.loads((d / ".metaclaw" / "generation.json").read_text()).get("generation")
            except (OSError, ValueError):
                generation = 0
            out[d.name] = {"skills": names, "generation": generation,
                           "history": [{k: h.get(k) for k in ("ts", "action", "name", "reason") if k in h}
                                       for h in history]}  # fmt: skip
        return out

    def training(self) -> dict[str, Any]:
        """The curves over steps (`series`): loss, reward, paces, sample age, trainer lag, lr, grad norm; reward mix."""
        db = self._db()
        mix = []
        if db is not None:
            with db:
                mix = reward_mix(db)
            db.close()
        return {"series": metric_series(self.run_dir), "reward_mix": mix}

    def state(self) -> dict[str, Any]:
        """Everything, at once (the page polls it)."""
        gate = self.gate()
        out = {
            "time": time.time(), "live": self.live, "run_dir": str(self.run_dir), "show_text": self.show_text,
            "curves": self.curves(), "gate": gate, "adapters": self.adapters(gate), "samples": self.samples(),
            "window": self.window(), "sessions": self.sessions(), "skills": self.skills(),
            "training": self.training(),
        }  # fmt: skip
        if self.plane is not None:
            out["steps_done"] = self.plane.steps_done()
            sched = getattr(self.plane, "scheduler", None)
            state = getattr(sched, "state", None)
            out["rollback_step"] = getattr(state, "rollback_step", None)
        return out


def reward_source(meta: dict[str, Any]) -> str | None:
    """Which rule or judge gave a turn its reward: feedback, the judge's rule or votes, at-least-one."""
    if meta.get("feedback"):
        return "feedback"
    if meta.get("at_least_one"):
        return "at_least_one"
    judge = meta.get("judge")
    if isinstance(judge, dict):
        if judge.get("rule"):
            return f"rule:{judge['rule']}"
        if "votes" in judge:
            return f"llm votes {judge['votes']}"
        if judge.get("label") or judge.get("classifier"):
            return f"classifier:{judge.get('label') or judge.get('classifier')}"
        return "judge"
    return None


def last_user(messages: str | None) -> str:
    try:
        msgs = json.loads(messages or "[]")
    except ValueError:
        return ""
    for m in reversed(msgs if isinstance(msgs, list) else []):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            return (content if isinstance(content, str) else json.dumps(content))[:2000]
    return ""
