"""Command line: `python -m metaclaw.skills list|show NAME|history|remove NAME [--agent A] [--root DIR]`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from metaclaw.skills.library import DEFAULT_AGENT_ID, SkillLibrary, default_root


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser (global `--agent`/`--root` also accepted after the subcommand)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--agent", default=argparse.SUPPRESS, help=f"agent id (default: {DEFAULT_AGENT_ID})")
    common.add_argument("--root", default=argparse.SUPPRESS, help="skills root (default: $METACLAW_SKILLS_ROOT "
                        "or ~/.metaclaw/skills)")
    parser = argparse.ArgumentParser(prog="python -m metaclaw.skills", description="Inspect and manage skills.",
                                     parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", parents=[common], help="list the skills the agent sees")
    show = sub.add_parser("show", parents=[common], help="print one skill's SKILL.md")
    show.add_argument("name")
    hist = sub.add_parser("history", parents=[common], help="print the agent's evolution history")
    hist.add_argument("--limit", type=int, default=50, help="show the last N entries (default: 50)")
    hist.add_argument("--json", action="store_true", help="print raw JSON lines")
    remove = sub.add_parser("remove", parents=[common], help="remove a skill from the agent's view")
    remove.add_argument("name")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 not found, 2 bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    agent = getattr(args, "agent", DEFAULT_AGENT_ID)
    root = getattr(args, "root", None) or default_root()
    try:
        library = SkillLibrary(root, agent)
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "list":
        skills = library.skills()
        width = max((len(s.name) for s in skills), default=4)
        print(f"{len(skills)} skills for agent {agent!r} (generation {library.generation}) in {library.root}")
        for s in skills:
            desc = s.description if len(s.description) <= 90 else s.description[:89] + "…"
            print(f"  {s.name:<{width}}  {s.source:<6}  {s.category:<14} {desc}")
        return 0
    if args.command == "show":
        skill = library.get(args.name)
        if skill is None:
            print(f"no skill {args.name!r} for agent {agent!r}", file=sys.stderr)
            return 1
        print(f"# {skill.path} ({skill.source})")
        print(skill.to_markdown(), end="")
        return 0
    if args.command == "history":
        entries = library.history()[-args.limit :] if args.limit > 0 else library.history()
        if not entries:
            print(f"no evolution history for agent {agent!r}")
        for e in entries:
            if args.json:
                print(json.dumps(e, ensure_ascii=False))
                continue
            status = "accepted" if e.get("accepted") else "rejected"
            sources = ",".join(map(str, e.get("source_sample_ids") or [])) or "-"
            print(f"{e.get('ts', '?')}  {e.get('action', '?'):<7} {e.get('name') or '-':<32} {status:<8} "
                  f"sources={sources}  {e.get('reason', '')}")
        return 0
    # remove
    try:
        library.remove(args.name)
    except (KeyError, ValueError) as exc:
        print(exc.args[0] if exc.args else str(exc), file=sys.stderr)
        return 1
    library.append_history({"action": "remove", "name": args.name, "source_sample_ids": [], "accepted": True,
                            "reason": "removed via CLI", "generation": library.generation})
    print(f"removed {args.name!r} for agent {agent!r} (generation {library.generation})")
    return 0
