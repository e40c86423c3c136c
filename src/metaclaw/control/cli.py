"""`python -m metaclaw status|pause|resume|train-now|rollback STEP [--agent ID]`: control the running service over
loopback.

The service is found by `--url`, `$METACLAW_CONTROL_URL`, `--run-dir DIR` (its `control.json`), or the proxy's
default `http://127.0.0.1:30000`; the key comes from `--key` or `$METACLAW_PROXY_API_KEY`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from metaclaw.control.plane import CONTROL_FILE
from metaclaw.wire import bearer_headers

DEFAULT_URL = "http://127.0.0.1:30000"


def resolve_url(url: str | None, run_dir: str | None) -> str:
    if url:
        return url.rstrip("/")
    if os.environ.get("METACLAW_CONTROL_URL"):
        return os.environ["METACLAW_CONTROL_URL"].rstrip("/")
    if run_dir:
        path = Path(run_dir) / CONTROL_FILE
        try:
            return str(json.loads(path.read_text())["url"]).rstrip("/")
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"no running service found in {run_dir} ({path}: {e})") from e
    return DEFAULT_URL


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
    lines.append(f"steps done:    {s.get('steps_done')}")
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
    return "\n".join(lines)


def _served(a: dict[str, Any]) -> str:
    """One served adapter: its folder, version, served name and where the figure comes from."""
    served = Path(a["path"]).name if a.get("path") else "base model (no adapter yet)"
    version = f", version {a['adapter_version']}" if a.get("adapter_version") is not None else ""
    name = f" as {a['name']}" if a.get("name") and a["name"] != "policy" else ""
    return f"{served}{version}{name} [{a.get('source')}]"


def _common(parser: argparse.ArgumentParser, default: Any) -> None:
    """The connection options, accepted before or after the command."""
    parser.add_argument("--url", default=default, help="the service's proxy URL (else $METACLAW_CONTROL_URL, "
                        "--run-dir, http://127.0.0.1:30000)")  # fmt: skip
    parser.add_argument("--run-dir", default=default, help="the service's run directory (reads its control.json)")
    parser.add_argument("--key", default=default, help="the proxy's API key (else $METACLAW_PROXY_API_KEY)")
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
    parser = argparse.ArgumentParser(prog="python -m metaclaw", description=__doc__.splitlines()[0])
    _common(parser, None)
    common = argparse.ArgumentParser(add_help=False)
    _common(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", parents=[common], help="window, next window, samples waiting, steps, adapter, eval")
    sub.add_parser("pause", parents=[common], help="stop training (a step in progress finishes); survives restarts")
    sub.add_parser("resume", parents=[common], help="let the scheduler's windows decide again")
    tn = sub.add_parser("train-now", parents=[common], help="open a training window now")
    tn.add_argument("--minutes", type=float, default=None, help="how long (default: scheduler.train_now_minutes)")
    rb = sub.add_parser("rollback", parents=[common], help="serve an earlier step's adapter again (pauses training)")
    rb.add_argument("step", type=int)
    rb.add_argument("--agent", default=None, help="roll back this agent's own adapter (default: the default one)")
    args = parser.parse_args(argv)
    args.key = args.key or os.environ.get("METACLAW_PROXY_API_KEY")
    args.timeout = args.timeout or 90.0

    url = resolve_url(args.url, args.run_dir)
    headers = bearer_headers(args.key)
    method, body = "POST", None
    if args.command == "status":
        method = "GET"
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
