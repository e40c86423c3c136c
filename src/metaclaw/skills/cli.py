"""Command line: `python -m metaclaw.skills list|show NAME|history|remove NAME|pending|approve NAME|reject NAME
[--agent A] [--root DIR]` (also `python -m metaclaw skills ...`).

`pending`, `approve` and `reject` review evolved skills (docs/skills.md, "Review and approval"): they act on the
files, and the running service picks the change up on its next request (the library reloads when files change).
`pending --all-agents` lists what waits for every agent.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from metaclaw.skills.library import DEFAULT_AGENT_ID, SHARED_POOL, SkillLibrary, default_root


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser (global `--agent`/`--root` also accepted after the subcommand)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--agent", default=argparse.SUPPRESS, help=f"agent id (default: {DEFAULT_AGENT_ID})")
    common.add_argument(
        "--root", default=argparse.SUPPRESS, help="skills root (default: $METACLAW_SKILLS_ROOT or ~/.metaclaw/skills)"
    )
    parser = argparse.ArgumentParser(
        prog="python -m metaclaw.skills", description="Inspect and manage skills.", parents=[common]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", parents=[common], help="list the skills the agent sees")
    show = sub.add_parser("show", parents=[common], help="print one skill's SKILL.md")
    show.add_argument("name")
    hist = sub.add_parser("history", parents=[common], help="print the agent's evolution history")
    hist.add_argument("--limit", type=int, default=50, help="show the last N entries (default: 50)")
    hist.add_argument("--json", action="store_true", help="print raw JSON lines")
    remove = sub.add_parser("remove", parents=[common], help="remove a skill from the agent's view")
    remove.add_argument("name")
    pending = sub.add_parser("pending", parents=[common], help="list evolved skills awaiting review")
    pending.add_argument("--all-agents", action="store_true", help="every agent under the root")
    for verb, what in (("approve", "serve a quarantined skill from now on"), ("reject", "drop a quarantined skill")):
        sub.add_parser(verb, parents=[common], help=what).add_argument("name")
    return parser


def pending_skills(root: str, agent: str | None = None) -> list[tuple[str, object]]:
    """(agent, skill) for every skill awaiting review under `root` (only `agent`'s when given)."""
    from pathlib import Path

    base = Path(root).expanduser()
    agents = [agent] if agent else sorted(p.name for p in base.iterdir() if p.is_dir() and p.name != SHARED_POOL
                                          and not p.name.startswith(".")) if base.is_dir() else []  # fmt: skip
    out = []
    for a in agents:
        try:
            out += [(a, s) for s in SkillLibrary(base, a, seed_bank=False).pending()]
        except ValueError:  # not an agent folder
            continue
    return out


def _review(library: SkillLibrary, agent: str, verb: str, name: str) -> int:
    try:
        pending = library.get_pending(name)
        if pending is None:
            raise KeyError(f"no quarantined skill {name!r} for agent {agent!r} (see: pending --agent {agent})")
        if verb == "approve":
            library.approve(name)
        else:
            library.reject(name)
    except (KeyError, ValueError) as exc:
        print(exc.args[0] if exc.args else str(exc), file=sys.stderr)
        return 1
    provenance = pending.extra.get("provenance") or {}
    library.append_history({"action": verb, "name": name, "source_sample_ids": provenance.get("source_sample_ids", []),
                            "accepted": verb == "approve", "reason": f"{verb}d via CLI",
                            "generation": library.generation})  # fmt: skip
    done = f"now served (generation {library.generation})" if verb == "approve" else "dropped"
    print(f"{verb}d {name!r} for agent {agent!r}: {done}")
    return 0


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
        waiting = library.pending()
        if waiting:
            print(f"{len(waiting)} awaiting review (not injected): {', '.join(s.name for s in waiting)} "
                  f"(python -m metaclaw skills pending --agent {agent})")  # fmt: skip
        return 0
    if args.command == "show":
        skill = library.get(args.name)
        if skill is None:
            print(f"no skill {args.name!r} for agent {agent!r}", file=sys.stderr)
            return 1
        print(f"# {skill.path} ({skill.source})")
        print(skill.to_markdown(), end="")
        return 0
    if args.command == "pending":
        found = pending_skills(root, None if args.all_agents else agent)
        print(f"{len(found)} evolved skill(s) awaiting review in {library.root}")
        for a, sk in found:
            sources = ",".join(map(str, (sk.extra.get("provenance") or {}).get("source_sample_ids") or [])) or "-"
            print(f"  --agent {a:<12} {sk.name:<32} samples={sources}  {sk.description[:80]}\n    {sk.body[:300]}")
        return 0
    if args.command in ("approve", "reject"):
        return _review(library, agent, args.command, args.name)
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
            print(
                f"{e.get('ts', '?')}  {e.get('action', '?'):<7} {e.get('name') or '-':<32} {status:<8} "
                f"sources={sources}  {e.get('reason', '')}"
            )
        return 0
    # remove
    try:
        library.remove(args.name)
    except (KeyError, ValueError) as exc:
        print(exc.args[0] if exc.args else str(exc), file=sys.stderr)
        return 1
    library.append_history(
        {
            "action": "remove",
            "name": args.name,
            "source_sample_ids": [],
            "accepted": True,
            "reason": "removed via CLI",
            "generation": library.generation,
        }
    )
    print(f"removed {args.name!r} for agent {agent!r} (generation {library.generation})")
    return 0
