"""`python -m metaclaw status|pause|resume|train-now|rollback STEP [--agent ID]`: control the running service over
loopback.

The service is found by `--url`, `$METACLAW_CONTROL_URL` or `--run-dir DIR` (the `control.json` the service wrote
there, with its URL and pid); without any of them the command refuses rather than send a key to whatever happens
to listen on a default port. The key comes from `$METACLAW_PROXY_API_KEY` (or `--key`), else the run's own
control key, `DIR/control.key` (0600; never in a URL or an argument).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from metaclaw.control.finished import check_run_dir, finished_status
from metaclaw.control.finished import pid_alive as _alive
from metaclaw.control.keys import read_control_key
from metaclaw.control.plane import CONTROL_FILE
from metaclaw.privacy.cli import add_forget_parser, forget_main
from metaclaw.wire import bearer_headers


def resolve_url(url: str | None, run_dir: str | None) -> str:
    """The service's URL: `--url`, `$METACLAW_CONTROL_URL`, or the run dir's `control.json`; else refuse."""
    if url:
        return url.rstrip("/")
    if os.environ.get("METACLAW_CONTROL_URL"):
        return os.environ["METACLAW_CONTROL_URL"].rstrip("/")
    if not run_dir:
        raise SystemExit("which service? Give --run-dir DIR (the run directory the service logged at start) or --url "
                         "URL; there is no default, so no key goes to whatever listens on a port")  # fmt: skip
    path = check_run_dir(run_dir) / CONTROL_FILE
    try:
        announced = json.loads(path.read_text())
        found = str(announced["url"]).rstrip("/")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"no running service found in {run_dir} ({path}: {e})") from e
    if not _alive(announced.get("pid")):
        raise SystemExit(f"the service that wrote {path} (pid {announced['pid']}) is not running any more")
    return found


def resolve_key(key: str | None, run_dir: str | None) -> str | None:
    """`--key` / `$METACLAW_PROXY_API_KEY`, else the run's control key (`DIR/control.key`)."""
    key = key or os.environ.get("METACLAW_PROXY_API_KEY")
    if key or not run_dir:
        return key
    return read_control_key(run_dir)


def _running(run_dir: str | None) -> str | None:
    """The running service of `run_dir`, or None (forget works on the files; a rollback is then printed)."""
    try:
        return resolve_url(None, run_dir)
    except SystemExit:
        return None


def format_eval(record: dict[str, Any]) -> str:
    """One `eval.jsonl` record on a line: step, adapter, its scalar figures, the gate's decision."""
    head = f"step {record.get('step', '?')}" + (f" ({record['adapter']})" if record.get("adapter") else "")
    if record.get("agent_id") not in (None, "default"):  # another agent's own adapter (docs/agents.md)
        head = f"agent {record['agent_id']} {head}"
    scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    figures = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in scalars.items()
               if k not in ("step", "time")]  # fmt: skip
    gate = record.get("gate")
    if isinstance(gate, dict) and gate.get("decision"):
        figures.append(f"gate={gate['decision']}")
    return f"{head}: {' '.join(figures)}"[:200]


def format_status(s: dict[str, Any]) -> str:
    w = s.get("window") or {}
    since = f" since {w['since']}" if w.get("since") else ""
    lines = [f"window:        {'OPEN' if w.get('open') else 'closed'}{since} - {'; '.join(w.get('reasons', []))}"]
    nxt = w.get("next_window")
    if not w.get("open") and w.get("paused"):
        lines.append("next window:   after resume")
    elif not w.get("open"):
        lines.append(f"next window:   {nxt['start']} ({nxt['reason']})" if nxt else "next window:   not predictable")
    if w.get("paused"):
        lines.append("paused:        yes (python -m metaclaw resume)")
    if w.get("train_now_until"):
        lines.append(f"train-now:     until {w['train_now_until']}")
    counts = s.get("samples") or {}
    by_status = ", ".join(f"{k} {v}" for k, v in counts.items())
    lines.append(f"samples:       {s.get('samples_waiting')} waiting ({by_status})")
    if s.get("samples_dropped"):  # why: secret / pii (docs/privacy.md), stale, backlog, ...
        lines.append("dropped:       " + ", ".join(f"{k} {v}" for k, v in sorted(s["samples_dropped"].items())))
    lines.append(f"steps done:    {s.get('steps_done')}")
    if s.get("trainer_lag") is not None:  # the trainer ahead of what is served (docs/online_loop.md "Freshness")
        lines.append(f"trainer lag:   {s['trainer_lag']} versions ahead of the served adapter")
    if r := s.get("rates"):  # the two paces over the last few minutes, and how fresh the trained samples were
        age = f", median age {r['trained_age_s']:.0f}s" if r.get("trained_age_s") is not None else ""
        lag = f", lag {r['trained_lag']} versions" if r.get("trained_lag") is not None else ""
        lines.append(f"pace:          {r['replies_per_min']:.1f} replies/min served, {r['trained_per_min']:.1f} "
                     f"samples/min trained{age}{lag} (last {r['window_s']:.0f}s)")  # fmt: skip
    lines.append(f"serving:       {_served(s.get('served_adapter') or {})}")
    for agent, a in (s.get("agents") or {}).items():  # agents with adapters of their own (docs/agents.md)
        lines.append(f"  agent {agent}: {_served(a)}")
    if s.get("rollback_step") is not None:
        whose = f" (agent {s['rollback_agent']})" if s.get("rollback_agent") else ""
        lines.append(f"rolled back:   to step {s['rollback_step']}{whose}")
    pending = s.get("skills_pending") or {}  # -- skills review (helper `truststate`, issue 31)
    if pending.get("count"):
        names = ", ".join(f"{p['name']} ({p['agent']})" for p in pending.get("skills", []))
        lines.append(f"skills:        {pending['count']} awaiting review, not injected: {names} "
                     "(python -m metaclaw skills pending --all-agents)")  # fmt: skip
    evals = s.get("eval") or []
    if evals:
        lines.append("recent eval:")
        lines += [f"  {format_eval(e)}" for e in evals]
    else:
        lines.append("recent eval:   none (no eval.jsonl yet)")
    for g in s.get("gate") or []:  # gate decisions and automatic rollbacks (gate.jsonl)
        what = g.get("adapter") or f"served v{(g.get('served') or {}).get('version')}"
        lines.append(f"gate:          {g.get('agent_id', 'default')} {what}: {g.get('decision')}"
                     + (f" ({'; '.join(g['reasons'])})" if g.get("reasons") else ""))  # fmt: skip
    return "\n".join(lines)


def _served(a: dict[str, Any]) -> str:
    """One served adapter: its folder, version, served name and where the figure comes from."""
    served = Path(a["path"]).name if a.get("path") else "base model (no adapter yet)"
    version = f", version {a['adapter_version']}" if a.get("adapter_version") is not None else ""
    name = f" as {a['name']}" if a.get("name") and a["name"] != "policy" else ""
    return f"{served}{version}{name} [{a.get('source')}]"


def _common(parser: argparse.ArgumentParser, default: Any) -> None:
    """The connection options, accepted before or after the command."""
    parser.add_argument("--url", default=default, help="the service's proxy URL (else $METACLAW_CONTROL_URL or "
                        "--run-dir)")  # fmt: skip
    parser.add_argument("--run-dir", default=default, help="the service's run directory (its control.json and "
                        "control.key)")  # fmt: skip
    parser.add_argument("--key", default=default, help="the proxy's API key (prefer $METACLAW_PROXY_API_KEY or "
                        "--run-dir: an argument is visible to every user in `ps`)")  # fmt: skip
    parser.add_argument("--json", action="store_true", default=default, help="print the raw JSON answer")
    parser.add_argument("--timeout", type=float, default=default, help="seconds (default 90)")


def main(argv: list[str] | None = None) -> int:
    # -- skills review (helper `truststate`, issue 31): `python -m metaclaw skills list|pending|approve|reject ...`
    # acts on the skills files (docs/skills.md); it needs no running service.
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["skills"]:
        from metaclaw.skills.cli import main as skills_main

        return skills_main(argv[1:])
    # -- end of the skills block
    args = _parser().parse_args(argv)
    args.timeout = args.timeout or 90.0

    if args.command == "forget":
        run_dir, args.run_dir = args.run_dir, None  # no control.json needed: the service may not be running
        url = resolve_url(args.url, None) if args.url else _running(run_dir)
        args.run_dir = run_dir
        return forget_main(args, url, bearer_headers(resolve_key(args.key, run_dir)))
    if args.command == "status" and args.run_dir and not (args.url or os.environ.get("METACLAW_CONTROL_URL")):
        text = finished_status(args.run_dir)  # a stopped service: its run directory's summary (control.finished)
        if text is not None:
            print(text)
            return 0
    if args.command == "dashboard" or (args.command == "status" and args.watch):  # docs/dashboard.md
        return _dashboard(args)
    return _call(args)


def _parser() -> argparse.ArgumentParser:
    """`python -m metaclaw`'s arguments: the common ones, then one subcommand each."""
    parser = argparse.ArgumentParser(prog="python -m metaclaw", description=__doc__.splitlines()[0])
    _common(parser, None)
    common = argparse.ArgumentParser(add_help=False)
    _common(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", parents=[common], help="window, next window, samples waiting, steps, adapter, eval")
    st.add_argument("--watch", action="store_true", help="redraw the dashboard's figures every --interval seconds")
    st.add_argument("--interval", type=float, default=2.0)
    db = sub.add_parser("dashboard", parents=[common], help="serve a finished run's dashboard (read-only, loopback)")
    db.add_argument("--port", type=int, default=0, help="0: a free port")
    db.add_argument("--show-text", action="store_true", help="show the turns' text (off by default)")
    sub.add_parser("pause", parents=[common], help="stop training (a step in progress finishes); survives restarts")
    sub.add_parser("resume", parents=[common], help="let the scheduler's windows decide again")
    tn = sub.add_parser("train-now", parents=[common], help="open a training window now")
    tn.add_argument("--minutes", type=float, default=None, help="how long (default: scheduler.train_now_minutes)")
    rb = sub.add_parser("rollback", parents=[common], help="serve an earlier step's adapter again (pauses training)")
    rb.add_argument("step", type=int)
    rb.add_argument("--agent", default=None, help="roll back this agent's own adapter (default: the default one)")
    add_forget_parser(sub, common)  # privacy (docs/privacy.md): works on the run dir's files
    return parser


def _dashboard(args: argparse.Namespace) -> int:
    """`dashboard` (a finished run's, served read-only) and `status --watch` (the dashboard's figures, redrawn)."""
    from metaclaw.control.dashboard import cli as dash

    if args.command == "dashboard":
        if not args.run_dir:
            raise SystemExit("dashboard needs --run-dir DIR (a live service serves /dashboard on its proxy port)")
        return dash.serve(args.run_dir, args.port, args.show_text, args.key)
    running = args.url or os.environ.get("METACLAW_CONTROL_URL") or not args.run_dir
    running = running or (Path(args.run_dir) / CONTROL_FILE).exists()
    headers = bearer_headers(resolve_key(args.key, args.run_dir))
    remote = dash.remote_state(resolve_url(args.url, args.run_dir), headers, args.timeout)
    fetch = dash.with_fallback(remote if running else None, args.run_dir)  # a finished run: its directory
    return dash.watch(fetch, args.interval)


def _call(args: argparse.Namespace) -> int:
    """Send the subcommand to the running service's control routes and print its answer."""
    url = resolve_url(args.url, args.run_dir)
    args.key = resolve_key(args.key, args.run_dir)
    headers = bearer_headers(args.key)
    method, body = "POST", {}  # a JSON body on every POST: the service refuses other content types
    if args.command == "status":
        method, body = "GET", None
    elif args.command == "train-now":
        body = {"minutes": args.minutes} if args.minutes is not None else {}
    elif args.command == "rollback":
        body = {"step": args.step} | ({"agent": args.agent} if args.agent is not None else {})
    try:
        r = httpx.request(method, f"{url}/control/{args.command}", json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as e:
        print(f"cannot reach the metaclaw service at {url}: {e}", file=sys.stderr)
        return 2
    try:
        data = r.json()
    except ValueError:
        data = {"error": {"message": r.text[:500]}}
    if r.status_code != 200:
        message = (data.get("error") or {}).get("message", r.text[:500]) if isinstance(data, dict) else r.text[:500]
        print(f"{args.command} failed ({r.status_code}): {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=1))
    elif args.command == "status":
        print(format_status(data))
    else:
        print(data.get("message") or json.dumps(data))
    return 0
