"""`python -m metaclaw forget --agent ID | --session ID | --before DATE --run-dir DIR [--rollback]`.

See docs/privacy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

from metaclaw.privacy.forget import ForgetReport, forget, parse_before, remove_adapters


def add_forget_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    f = sub.add_parser("forget", parents=[common], help="delete an agent's / session's / old turns down to the "
                       "file bytes, and the skills evolved from them")  # fmt: skip
    f.add_argument("--agent", default=None, help="this agent's turns (X-Agent-Id)")
    f.add_argument("--session", default=None, help="this session's turns")
    f.add_argument("--before", default=None, help="turns captured before this ISO date or date-time (UTC)")
    f.add_argument("--store", default=None, help="the sample store (default: RUN_DIR/samples.sqlite)")
    f.add_argument("--skills-root", default=None, help="skills root (default: $METACLAW_SKILLS_ROOT or "
                   "~/.metaclaw/skills); 'none' leaves skills alone")  # fmt: skip
    f.add_argument("--rollback", action="store_true", help="roll each affected adapter back to the last one "
                   "trained before these turns (through the running service)")  # fmt: skip


def forget_main(args: argparse.Namespace, control_url: str | None, headers: dict[str, str]) -> int:
    """Run `forget`, print its report; with `--rollback`, ask the running service to serve the clean adapters."""
    if not (args.agent or args.session or args.before):
        print("forget needs --agent, --session or --before", file=sys.stderr)
        return 2
    if not args.run_dir and not args.store:
        print("forget needs --run-dir (or --store)", file=sys.stderr)
        return 2
    store = Path(args.store) if args.store else Path(args.run_dir) / "samples.sqlite"
    skills = args.skills_root or os.environ.get("METACLAW_SKILLS_ROOT") or "~/.metaclaw/skills"
    try:
        before = parse_before(args.before) if args.before else None
        report = forget(store, agent=args.agent, session=args.session, before=before, run_dir=args.run_dir,
                        skills_root=None if skills == "none" else Path(skills).expanduser())  # fmt: skip
    except (ValueError, FileNotFoundError) as e:
        print(f"forget failed: {e}", file=sys.stderr)
        return 1
    if args.rollback:
        _rollback(report, control_url, headers, args.timeout)
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report))
    return 0


def _rollback(report: ForgetReport, url: str | None, headers: dict[str, str], timeout: float) -> None:
    """Serve each affected adapter's clean state (its last adapter trained before the turns; the base model when
    there is none) and send the trainer back to it (`reset_trainer`), so the next step trains from it."""
    for adapter, clean in report.rollback_to.items():
        if not report.adapters_trained_on_them.get(adapter):
            continue
        step = clean if clean is not None else 0  # step 0: the base model (a zero adapter)
        what = f"step {step}" if step else "the base model"
        body = {"step": step, "reset_trainer": True} | ({"agent": adapter} if adapter != "default" else {})
        try:
            r = httpx.post(f"{url}/control/rollback", json=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as e:
            report.notes.append(f"{adapter}: the service is not reachable at {url} ({e}); when it runs again, roll "
                                f"back: python -m metaclaw rollback {step}" + (f" --agent {adapter}" if adapter !=
                                "default" else ""))  # fmt: skip
            continue
        if r.status_code != 200:
            report.notes.append(f"{adapter}: rollback to {what} refused ({r.status_code}): {r.text[:200]}")
            continue
        report.rolled_back[adapter] = step
        report.notes.append(f"{adapter}: serving {what}; the trainer goes back to it before its next step")
        report.adapters_removed += remove_adapters(report, adapter)


def format_report(r: ForgetReport) -> str:
    lines = [f"deleted:       {r.samples_deleted} samples, {r.session_rows_deleted} session rows (secure_delete, "
             f"WAL truncated, vacuumed)"]  # fmt: skip
    if r.skills_removed:
        lines.append(f"skills:        removed {', '.join(r.skills_removed)}")
    if r.trained_at_steps:
        lines.append(f"trained at:    optimizer steps {r.trained_at_steps}")
        for adapter, steps in r.adapters_trained_on_them.items():
            back = r.rollback_to.get(adapter)
            lines.append(
                f"  adapter {adapter}: steps {steps} hold what they learnt; last clean: "
                + (f"step {back}" if back is not None else "none (base model)")
            )
    else:
        lines.append("trained at:    none (no adapter learnt from these turns)")
    if r.adapters_removed:
        lines.append(f"removed:       {len(r.adapters_removed)} adapter folders trained on these turns")
    lines += [f"note:          {n}" for n in r.notes]
    return "\n".join(lines)
