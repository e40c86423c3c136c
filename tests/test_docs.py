"""The README is the reference a newcomer reads: short, the agent quickstart early, every link alive."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_points_an_agent_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (history goes to docs/results/)"
    heading = next(i for i, line in enumerate(lines) if line.startswith("## Point your agent at it"))
    assert heading < 60
    assert sum("bash scripts/install.sh" in line for line in lines) and sum("make test" in line for line in lines)


def test_every_relative_link_in_the_readme_and_docs_exists():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to a missing {target}"
