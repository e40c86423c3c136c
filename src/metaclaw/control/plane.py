"""`ControlPlane`: what `python -m metaclaw status|pause|resume|train-now|rollback` acts on in the running service.

It reads the live state (scheduler window, sample counts, steps, the served adapter, recent eval figures)
and changes it (pause / resume / train-now through the scheduler; rollback re-points the policy server's
adapter to an earlier step's directory with `/v1/load_lora_adapter`, which swaps atomically under load).

Many agents (docs/agents.md): `status` lists every agent's served adapter; `rollback STEP --agent ID` re-points
that agent's own adapter (`policy:<id>`, from `adapters/agents/<id>/step-N`) and leaves the others as they are.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metaclaw.agents import DEFAULT_PROFILE, AgentProfile, AgentProfiles
from metaclaw.runfiles.layout import AdapterFolder, RunLayout
from metaclaw.store import SampleStore
from metaclaw.wire import ADAPTER_CONFIG
from metaclaw.wire.client import CallError, Endpoint, Refused, load_adapter, models

if TYPE_CHECKING:  # `status` of a finished run must not import torch (tests/control/test_finished.py)
    from metaclaw.modules.rewind import Rewind

log = logging.getLogger(__name__)
CONTROL_FILE = "control.json"


class ControlError(Exception):
    """A control request that cannot be done; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def tail_jsonl(path: Path, n: int, max_bytes: int = 65536) -> list[dict[str, Any]]:
    """The last `n` JSON objects of a JSONL file (reads at most its last `max_bytes`; bad lines skipped)."""
    if n <= 0 or not path.exists():
        return []
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - max_bytes))
        lines = fh.read().decode("utf-8", errors="replace").splitlines()
    if size > max_bytes:
        lines = lines[1:]  # the first line is probably cut
    out = []
    for line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out[-n:]


class ControlPlane:
    """The running service's control surface (mounted on the proxy under `/control/*`).

    Args:
        run_dir: the run directory (`adapters/`, `eval.jsonl`, `control.json`).
        store: the sample store (counts); None: not reported.
        scheduler: the `IdleScheduler` (pause / resume / train-now need one; mode=rl has none).
        lora_name: the adapter's served name.
        server_api_key: the policy server's key (for `/v1/load_lora_adapter`).
        eval_tail: how many recent `eval.jsonl` records `status` shows.
        timeout_s: how long an adapter load may take.
        agents: the run's agent profiles (None: the default agent only); agents with adapters of their own can
            be rolled back one by one and are listed by `status`.
    """

    def __init__(
        self,
        run_dir: str | Path,
        store: SampleStore | None = None,
        scheduler: Any = None,
        lora_name: str = "policy",
        server_api_key: str | None = None,
        eval_tail: int = 3,
        timeout_s: float = 60.0,
        api_key: str | None = None,
        agents: AgentProfiles | None = None,
        show_text: bool = False,
        skills_root: str | None = None,
    ) -> None:
        self.skills_root = skills_root  # evolved skills awaiting review are shown by `status`
        self.run_dir, self.store, self.scheduler, self.api_key = Path(run_dir), store, scheduler, api_key
        self.show_text = show_text  # privacy.show_text: eval records' example replies in `status`
        self.agents = agents or AgentProfiles(lora_name=lora_name)
        self.lora_name, self.server_api_key, self.eval_tail, self.timeout_s = (
            lora_name, server_api_key, eval_tail, timeout_s)  # fmt: skip
        self.dashboard: dict[str, Any] = {}  # DashboardData options (show_text, skills_root)
        self.server_url: str | None = None  # set once the policy server is up
        self.trainer: Any = None  # set by train(): steps done
        self.rewind: Rewind | None = None  # set by train(): the trainer's rewinds (forget --rollback)

    def attach(self, live: Any, trainer: Any = None) -> None:
        """Point at the running services (`metaclaw.loop.live.Live`) and trainer; announce the URL."""
        self.server_url = live.server_url.rstrip("/") if live.server_url else None
        self.server_api_key = getattr(live, "server_key", None) or self.server_api_key
        self.trainer = trainer
        if live.proxy_url:
            log.info("Control: python -m metaclaw status --run-dir %s (or --url %s)", self.run_dir, live.proxy_url)
            self.announce(live.proxy_url)

    @property
    def activity(self) -> Any:
        """The scheduler's proxy-activity tracker (None without a scheduler)."""
        return getattr(self.scheduler, "activity", None)

    def announce(self, url: str) -> Path:
        """Write `<run dir>/control.json` so `python -m metaclaw --run-dir DIR` finds the service (no key in it)."""
        path = self.run_dir / CONTROL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"url": url, "pid": os.getpid()}))
        return path

    # ---- reads --------------------------------------------------------------------------------------------
    def _latest(self, folder: AdapterFolder | None = None) -> dict[str, Any] | None:
        latest = (folder or RunLayout(self.run_dir).adapters()).read_latest()
        if latest is None:
            return None
        return {"version": latest.get("version"), "path": latest.get("path"),
                "rolled_back": bool(latest.get("rolled_back"))}  # fmt: skip

    def _own(self) -> list[AgentProfile]:
        """The profiles with an adapter of their own: the default one first."""
        return [self.agents.default, *(p for p in self.agents.listed.values() if p.trains)]

    def served_adapters(self) -> dict[str, dict[str, Any]]:
        """What the policy server serves for each agent with an adapter (asked live; else the last published)."""
        cards: dict[str, dict[str, Any]] | None = None
        if self.server_url:
            try:
                cards = {c.get("id"): c for c in models(self.server, timeout=5)}
            except (CallError, ValueError) as e:
                log.warning("Control: policy server did not list its adapters: %s", e)
        out = {}
        for p in self._own():
            name = p.lora_name
            if cards is None:
                latest = self._latest(RunLayout(self.run_dir).adapters(p.adapter))
                out[p.name] = {"name": name, **(latest or {"path": None}), "source": "last published"}
            elif name in cards:
                card = cards[name]
                out[p.name] = {"name": name, "path": card.get("root"), "adapter_version": card.get("adapter_version"),
                               "source": "policy server"}  # fmt: skip
            else:
                out[p.name] = {"name": name, "path": None, "source": "policy server (base model only)"}
        return out

    def served_adapter(self) -> dict[str, Any]:
        """What the policy server serves under `lora_name` (the default agent's adapter)."""
        return self.served_adapters()[DEFAULT_PROFILE]

    def steps_done(self) -> int | None:
        if self.trainer is not None:
            return int(self.trainer.global_step)
        latest = self._latest()
        return latest.get("version") if latest else None

    def status(self) -> dict[str, Any]:
        state = self.scheduler.state if self.scheduler is not None else None
        served = self.served_adapters()
        return {
            "window": self.scheduler.status() if self.scheduler is not None else {
                "open": True, "reasons": ["no scheduler in this mode: always open"], "next_window": None},
            "samples": self.store.counts() if self.store is not None else None,
            "samples_waiting": self.store.count("ready") if self.store is not None else None,
            "samples_dropped": self.store.dropped_reasons() if self.store is not None else None,  # stale, secret, ...
            # both paces (docs/online_loop.md "Training keeps its share"): replies/min served, samples/min trained
            "rates": self.store.rates() if self.store is not None else None,
            "steps_done": self.steps_done(),
            "trainer_lag": trainer_lag(self.steps_done(), served[DEFAULT_PROFILE]),
            "served_adapter": served.pop(DEFAULT_PROFILE),
            "agents": served,  # every other agent with an adapter of its own: {id: served adapter}
            "rollback_step": state and state.rollback_step,
            "rollback_agent": state and state.rollback_agent,
            "eval": [r if self.show_text else {k: v for k, v in r.items() if k != "examples"}
                     for r in tail_jsonl(self.run_dir / "eval.jsonl", self.eval_tail)],  # fmt: skip
            "gate": tail_jsonl(self.run_dir / "gate.jsonl", self.eval_tail),  # gate decisions, automatic rollbacks
            "skills_pending": self.skills_pending(),
        }  # fmt: skip

    def skills_pending(self, limit: int = 20) -> dict[str, Any] | None:
        """Evolved skills awaiting review (`python -m metaclaw skills pending`): count and the first `limit`."""
        if not self.skills_root:
            return None
        from metaclaw.skills.cli import pending_skills

        try:
            found = pending_skills(self.skills_root)
        except OSError as e:
            return {"count": None, "error": str(e)}
        return {"count": len(found), "skills": [{"agent": a, "name": s.name} for a, s in found[:limit]]}

    # ---- changes ------------------------------------------------------------------------------------------
    def _need_scheduler(self, what: str) -> Any:
        if self.scheduler is None:
            raise ControlError(409, f"{what} needs the scheduler: run with mode=auto (this mode has none)")
        return self.scheduler

    def pause(self) -> dict[str, Any]:
        self._need_scheduler("pause").pause()
        return {"paused": True, "message": "training paused (a step in progress finishes)"}

    def resume(self) -> dict[str, Any]:
        sched = self._need_scheduler("resume")
        sched.resume()
        return {"paused": False, "window": sched.status()}

    def train_now(self, minutes: float | None = None) -> dict[str, Any]:
        until = self._need_scheduler("train-now").train_now(minutes)
        return {"train_now_until": until.isoformat(), "message": f"training window open until {until:%H:%M %Z}"}

    def adapter_of(self, agent: str | None) -> tuple[AgentProfile, AdapterFolder]:
        """The profile and adapter folder `rollback --agent` acts on (None or `default`: the default adapter).

        Raises:
            ControlError: 404 naming the agent when it has no adapter of its own (not listed, or skills_only).
        """
        if agent is None or agent == DEFAULT_PROFILE:
            profile = self.agents.default
        else:
            profile = self.agents.listed.get(agent)
            if profile is None or not profile.trains:
                own = [p.name for p in self._own()]
                why = "is not listed under `agents`" if profile is None else f"is {profile.mode}"
                raise ControlError(404, f"agent {agent!r} has no adapter of its own (it {why}); agents with "
                                        f"adapters: {own}")  # fmt: skip
        return profile, RunLayout(self.run_dir).adapters(profile.adapter)

    def available_steps(self, folder: AdapterFolder | None = None) -> list[int]:
        return [version for version, _ in (folder or RunLayout(self.run_dir).adapters()).versions()]

    def rollback(self, step: int, agent: str | None = None, reset_trainer: bool = False) -> dict[str, Any]:
        """Serve the adapter of `step` again, the default one or `agent`'s own; step 0 is the base model (a zero
        adapter, `step-000000`).

        Without `reset_trainer` training pauses (with a scheduler) so the next publish does not replace it. With it
        (`forget --rollback`) the trainer goes back to that adapter too (`metaclaw.modules.rewind`: its weights, fresh
        optimizer moments, nothing published from the older weights served) and trains on from there.
        """
        profile, folder = self.adapter_of(agent)
        if reset_trainer and self.rewind is None:
            raise ControlError(409, "no trainer in this process to reset: roll back without reset_trainer")
        target = folder.find(step)
        if target is None and step == 0:
            from metaclaw.modules.adapter_writer import zero_adapter  # torch: only for this

            try:
                target = zero_adapter(folder)
            except FileNotFoundError as e:
                raise ControlError(404, str(e)) from e
        if target is None or not (target / ADAPTER_CONFIG).exists():
            kept = self.available_steps(folder)
            raise ControlError(404, f"no adapter for step {step} in {folder.path} (kept: {kept or 'none'})")
        if not self.server_url:
            raise ControlError(409, "no policy server to load the adapter into")
        with self.rewind.rewinding() if reset_trainer and self.rewind is not None else nullcontext():
            version = self._serve_again(profile, folder, step, target)
            if reset_trainer and self.rewind is not None:  # after the load: a failed one changes nothing
                self.rewind.request(profile.adapter, None if step == 0 else target)
        who = "" if profile is self.agents.default else f" for agent {profile.name} ({profile.lora_name})"
        message = f"serving {target.name}{who}" + (" (the base model)" if step == 0 else "")
        if reset_trainer:
            message += "; the trainer goes back to it before its next step and trains on from there"
        elif self.scheduler is not None:
            self.scheduler.record_rollback(step, None if profile is self.agents.default else profile.name)
            message += "; training paused (resume trains on from the latest weights and publishes them)"
            if profile.adapter in getattr(self.scheduler, "ungated", ()):
                message += f"; agent {profile.name} is `rl`: it steps outside windows, and its next step replaces it"
        else:
            message += "; the next published step will replace it (no scheduler to pause training)"
        log.info("Control: rolled back %s to %s%s", profile.lora_name, target, " (and the trainer)" * reset_trainer)
        return {"step": step, "agent": profile.name, "name": profile.lora_name, "path": str(target),
                "adapter_version": version, "reset_trainer": reset_trainer, "message": message}  # fmt: skip

    def _serve_again(self, profile: AgentProfile, folder: AdapterFolder, step: int, target: Path) -> Any:
        """Load `target` into the policy server as `profile`'s adapter and point the served pointer at it."""
        try:
            reply = load_adapter(self.server, profile.lora_name, str(target.resolve()), self.timeout_s, version=step)
        except Refused as e:
            why = e.response.text[:300]
            raise ControlError(502, f"policy server refused the adapter ({e.status_code}): {why}") from e
        except (CallError, ValueError) as e:
            raise ControlError(502, f"policy server unreachable: {e!r}") from e
        # The served pointer follows, so a restart of the policy server (or of the run) serves this one too.
        folder.write_latest(step, target, profile.lora_name, rank_fingerprints=None, rolled_back=True)
        return reply.get("adapter_version")

    @property
    def server(self) -> Endpoint:
        """The policy server (its URL once it is up, and its key)."""
        return Endpoint(self.server_url or "", self.server_api_key)


def build_control(cfg: Any, store: SampleStore, scheduler: Any) -> ControlPlane | None:
    """The control plane for a live run (`rollout=proxy|replay` with `control.enabled`), else None."""
    control = cfg.get("control")
    if not control or not control.enabled or not cfg.rollout.get("proxy"):
        return None
    plane = ControlPlane(
        cfg.run_dir,
        store,
        scheduler,
        lora_name=cfg.publish.lora_name,
        server_api_key=cfg.serving.get("api_key"),
        eval_tail=control.eval_tail,
        timeout_s=control.timeout_s,
        api_key=cfg.rollout.proxy.get("api_key"),
        agents=AgentProfiles.from_config(cfg),
        show_text=bool((cfg.get("privacy") or {}).get("show_text", False)),
        skills_root=cfg.skills.library_root if cfg.get("skills") and cfg.skills.get("enabled") else None,
    )
    skills = cfg.get("skills") or {}
    # one flag for status, eval records and the dashboard's turn text: privacy.show_text
    plane.dashboard = {"show_text": plane.show_text,
                       "skills_root": skills.get("library_root") if skills.get("enabled") else None}  # fmt: skip
    return plane


def trainer_lag(steps_done: int | None, served: dict[str, Any]) -> int | None:
    """Versions the trainer is ahead of the served adapter (its version is the step that wrote it; the base
    model is version 0). Shown, and bounded in the loss (`loss.max_ratio`); `data.max_staleness` counts against
    the served version (`RolloutDataModule.trainer_version`)."""
    if steps_done is None:
        return None
    return max(0, int(steps_done) - int(served.get("version") or 0))
