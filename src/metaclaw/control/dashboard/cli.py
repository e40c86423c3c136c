"""`python -m metaclaw dashboard --run-dir DIR` (a finished run's dashboard, read-only, on 127.0.0.1) and
`python -m metaclaw status --watch` (the same figures, redrawn in the terminal)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from metaclaw.control.dashboard.data import DashboardData

SPARK = " ▁▂▃▄▅▆▇█"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * float(x):.0f}%"


def _num(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(float(x), spec)


def _age(s: Any) -> str:
    return "-" if s is None else (f"{s:.0f}s" if s < 120 else f"{s / 60:.1f}min")


def format_state(s: dict[str, Any], width: int = 120) -> str:
    """The dashboard's figures as text (what `status --watch` redraws)."""
    when = time.strftime("%H:%M:%S", time.localtime(s.get("time", time.time())))
    lines = [f"metaclaw  {'live' if s.get('live') else 'finished run'}  {s.get('run_dir', '')}  {when}"]
    w = s.get("window")
    if w:
        lines.append(f"window     {'OPEN' if w.get('open') else 'closed'}{' (paused)' if w.get('paused') else ''} - "
                     f"{'; '.join(w.get('reasons') or [])}; steps done {s.get('steps_done')}")  # fmt: skip
    lines.append("held-out compliance (95% interval):")
    for agent, points in (s.get("curves") or {}).items():
        spark = "".join(SPARK[min(8, int(p["compliance"] * 8 + 0.5))] for p in points[-40:])
        lines.append(f"  {agent:<12} {spark}")
        for p in points[-4:]:
            gate = f" gate {p['gate']}" if p.get("gate") else ""
            lines.append(f"    step {p['step']:>4} {str(p['adapter']):<12} {_pct(p['compliance']):>4} "
                         f"[{_pct(p['ci_low'])}, {_pct(p['ci_high'])}] n={p['n']}  good {_pct(p.get('good'))} "
                         f"NLL {_num(p.get('nll'))}{gate}")  # fmt: skip
    if not s.get("curves"):
        lines.append("  none yet")
    sm = s.get("samples")
    if sm:
        dropped = ", ".join(f"{k} {v}" for k, v in sm["dropped"].items()) or "none"
        lines.append(f"samples    captured {sm['captured']}  scored {sm['scored']}  trained {sm['trained']}  backlog "
                     f"{sm['backlog']}  oldest waiting {_age(sm['oldest_waiting_s'])}  median age trained "
                     f"{_age(sm['median_trained_age_s'])}")  # fmt: skip
        lines.append(f"dropped    {dropped}")
    for agent, info in (s.get("adapters") or {}).items():
        served = info.get("served") or {}
        name = Path(served["path"]).name if served.get("path") else "base model"
        recent = ", ".join(f"{a['step']}:{a['gate'] or '-'}{'*' if a['served'] else ''}"
                           for a in info["adapters"][-8:])  # fmt: skip
        lines.append(f"adapters   {agent}: serving {name} [{served.get('source', '')}]; recent (step:gate, * served) "
                     f"{recent or 'none'}")  # fmt: skip
    for g in (s.get("gate") or [])[-4:]:
        if g.get("kind") == "regression":
            what = (f"regression v{g['served']['version']} {_pct(g['served']['share'])} vs "
                    f"{_pct(g['previous']['share'])} p={g['p_value']:.3g}")  # fmt: skip
        else:
            what = f"{g.get('adapter')} {_pct(g.get('candidate'))} vs served {_pct(g.get('served'))} n={g.get('n')}"
        lines.append(f"gate       {g.get('agent_id')} {what}: {g.get('decision')}")
    for sess in (s.get("sessions") or [])[:5]:
        turns = " ".join(f"#{t['turn_index']}:{_num(t['reward'], '+.0f')}({t['source'] or '?'})" for t in sess["turns"])
        lines.append(f"session    {sess['agent_id']}/{sess['session_id'][:16]}: {turns}")
    for agent, sk in (s.get("skills") or {}).items():
        lines.append(f"skills     {agent} gen {sk['generation']}: {', '.join(sk['skills']) or 'none'}")
    return "\n".join(line[:width] for line in lines)


def watch(fetch: Callable[[], dict[str, Any]], interval_s: float = 2.0, once: bool = False) -> int:
    """Redraw `fetch()`'s state every `interval_s` until Ctrl-C (or once)."""
    try:
        while True:
            try:
                text = format_state(fetch(), shutil.get_terminal_size((120, 40)).columns)
            except (httpx.HTTPError, OSError, ValueError) as e:
                text = f"cannot read the state: {e}"
            sys.stdout.write(("" if once else "\x1b[H\x1b[2J") + text + "\n")
            sys.stdout.flush()
            if once:
                return 0
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0


def remote_state(url: str, headers: dict[str, str], timeout: float) -> Callable[[], dict[str, Any]]:
    def fetch() -> dict[str, Any]:
        r = httpx.get(f"{url}/dashboard/api/state", headers=headers, timeout=timeout)
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    return fetch


def with_fallback(remote: Callable[[], dict[str, Any]] | None, run_dir: str | None) -> Callable[[], dict]:
    """The service's state; when it cannot be reached and `run_dir` is given, the run directory's."""
    local = local_data(run_dir) if run_dir else None

    def fetch() -> dict[str, Any]:
        if remote is not None:
            try:
                return remote()
            except httpx.TransportError:
                if local is None:
                    raise
        assert local is not None
        return local.state()

    return fetch


def local_data(run_dir: str, show_text: bool = False) -> DashboardData:
    """A finished run's figures from its directory (skills from its saved config, when it had them on)."""
    skills_root = None
    try:
        import yaml

        cfg = yaml.safe_load((Path(run_dir) / ".hydra" / "config.yaml").read_text()) or {}
        skills = cfg.get("skills") or {}
        root = skills.get("library_root")
        if skills.get("enabled") and isinstance(root, str) and "${" not in root:
            skills_root = root
    except (OSError, ValueError, ImportError):
        pass
    return DashboardData(run_dir, show_text=show_text, skills_root=skills_root)


def serve(run_dir: str, port: int = 0, show_text: bool = False, key: str | None = None) -> int:
    """Serve a finished run's dashboard read-only on 127.0.0.1: no key (loopback clients only, nothing to change),
    unless `key` asks for one."""
    import socket

    import uvicorn

    from metaclaw.control.dashboard.app import mount_dashboard

    if not (Path(run_dir) / "eval.jsonl").exists() and not (Path(run_dir) / "samples.sqlite").exists():
        print(f"{run_dir} holds no run (no eval.jsonl, no samples.sqlite)", file=sys.stderr)
        return 2
    app = mount_dashboard(None, local_data(run_dir, show_text), key or "")
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/dashboard"
    print(json.dumps({"url": url, "key": key or None}), flush=True)
    how = "paste the key above" if key else "no key needed: loopback only"
    print(f"Open {url} ({how}; read-only: a finished run). Ctrl-C stops.", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0
