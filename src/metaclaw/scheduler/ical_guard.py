"""Recurrences that `icalendar` would expand while it parses, screened on the raw text before it does.

`icalendar` turns every VTIMEZONE into a timezone as soon as the component is parsed, walking its STANDARD /
DAYLIGHT RRULEs from DTSTART (to 2038 without UNTIL or COUNT): `RRULE:FREQ=SECONDLY` there costs a second-by-second
walk before any bound of `calendar.py` can look at it. So the raw calendar is read first:

- a VTIMEZONE whose rules are not what a real time zone has (FREQ=YEARLY, one value per BY part, a month for a
  day rule) or that has more than `MAX_ZONE_RULES` rules, or a calendar with more than `MAX_ZONE_RULES_TOTAL`
  such rules, loses the offending VTIMEZONE (times that name it are read in the scheduler's zone, if the name is not
  a known IANA zone);
- any component with an RRULE or EXRULE of FREQ=SECONDLY or MINUTELY anywhere inside it (a nested VALARM too) is
  left out whole.

What is left out is named, so `status` can show it; events are bounded further by `calendar.rule_cost`.
"""

from __future__ import annotations

import re

REFUSED_FREQS = ("SECONDLY", "MINUTELY")
MAX_ZONE_RULES = 16  # STANDARD/DAYLIGHT rules in one VTIMEZONE (real ones have one or two per era)
MAX_ZONE_RULES_TOTAL = 256  # across the calendar
_ZONE_PARTS = {"FREQ", "INTERVAL", "COUNT", "UNTIL", "BYMONTH", "BYDAY", "BYMONTHDAY", "BYHOUR", "BYMINUTE",
               "BYSECOND", "BYSETPOS", "WKST"}  # fmt: skip
_RULE = re.compile(r"^(RRULE|EXRULE)(?:;[^:]*)?:(.*)$", re.IGNORECASE)


def _parts(value: str) -> dict[str, str]:
    out = {}
    for part in value.split(";"):
        key, _, val = part.partition("=")
        out[key.strip().upper()] = val.strip()
    return out


def _zone_rule_problem(value: str) -> str | None:
    """Why a VTIMEZONE rule is not one a real time zone has (None when it is)."""
    parts = _parts(value)
    if parts.get("FREQ", "").upper() != "YEARLY":
        return f"FREQ={parts.get('FREQ', '?')}"
    unknown = sorted(set(parts) - _ZONE_PARTS)
    if unknown:
        return f"{', '.join(unknown)} in a time-zone rule"
    if any("," in v for k, v in parts.items() if k.startswith("BY")):
        return "several values in one BY part"
    if ("BYDAY" in parts or "BYMONTHDAY" in parts) and "BYMONTH" not in parts:
        return "a day rule without BYMONTH"
    return None


def _components(lines: list[str]) -> list[tuple[int, int, str]]:
    """`(first line, last line, name)` of each component directly inside VCALENDAR."""
    out, depth, start, name = [], 0, 0, ""
    for i, line in enumerate(lines):
        upper = line.upper()
        if upper.startswith("BEGIN:"):
            depth += 1
            if depth == 2:
                start, name = i, upper[6:].strip()
        elif upper.startswith("END:"):
            if depth == 2:
                out.append((start, i, name))
            depth = max(0, depth - 1)
    return out


def _problem(lines: list[str], name: str, zone_rules_left: int) -> tuple[str | None, int]:
    """Why one top-level component is left out (None: kept), and how many time-zone rules it uses."""
    rules = [m for m in (_RULE.match(line) for line in lines) if m]
    for m in rules:
        freq = _parts(m.group(2)).get("FREQ", "").upper()
        if freq in REFUSED_FREQS:
            return f"{m.group(1).upper()}:{m.group(2)[:80]}", 0
    if name != "VTIMEZONE":
        return None, 0
    if len(rules) > min(MAX_ZONE_RULES, zone_rules_left):
        return f"{len(rules)} time-zone rules (at most {MAX_ZONE_RULES}, {MAX_ZONE_RULES_TOTAL} in all)", 0
    for m in rules:
        problem = _zone_rule_problem(m.group(2))
        if problem:
            return f"RRULE:{m.group(2)[:80]} ({problem})", 0
    return None, len(rules)


def screen_recurrences(data: bytes) -> tuple[bytes, list[str]]:
    """`data` without the components whose recurrences are unbounded (see the module doc), and what was left out."""
    text = data.decode("utf-8", errors="replace")
    lines = re.sub(r"\r?\n[ \t]", "", text).splitlines()  # unfolded: one property per line
    dropped: list[tuple[int, int]] = []
    ignored: list[str] = []
    zone_rules_left = MAX_ZONE_RULES_TOTAL
    for start, end, name in _components(lines):
        problem, used = _problem(lines[start : end + 1], name, zone_rules_left)
        zone_rules_left -= used
        if problem:
            dropped.append((start, end))
            named = (ln for ln in lines[start:end] if ln.upper().startswith(("SUMMARY", "TZID")))
            label = next((ln.partition(":")[2][:60] for ln in named), "?")
            ignored.append(f"{'' if name == 'VEVENT' else name + ' '}{label!r} ({problem})")
    if not dropped:
        return data, []
    gone = bytearray(len(lines))
    for s, e in dropped:
        gone[s : e + 1] = b"\x01" * (e + 1 - s)
    keep = [line for line, g in zip(lines, gone, strict=True) if not g]
    return ("\r\n".join(keep) + "\r\n").encode(), ignored
