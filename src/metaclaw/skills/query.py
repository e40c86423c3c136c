"""Build the retrieval query from OpenAI-format messages: the latest user message minus client boilerplate.

Agents such as OpenClaw wrap every user message in the same metadata (timestamps, channel envelopes,
`<system-reminder>` blocks, "Conversation info (untrusted metadata)" JSON). Left in, that text dominates the
query and every turn retrieves the same skills, so it is stripped with a configurable list of regexes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from metaclaw.messages import content_text

_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*"
_DATE = r"\d{4}-\d{2}-\d{2}"
_TIME = r"\d{1,2}:\d{2}(?::\d{2})?(?:\.\d+)?"
_ZONE = r"(?:Z|[+-]\d{2}:?\d{2}|[ \t]*[A-Z]{2,5})?"

#: Default stripping patterns (compiled with re.MULTILINE; use inline `(?s)` to let `.` cross lines).
DEFAULT_STRIP_PATTERNS: tuple[str, ...] = (
    r"(?s)<system-reminder>.*?</system-reminder>",
    r"(?s)<(environment_details|env|context|metadata)>.*?</\1>",
    # "Conversation info (untrusted metadata):", "Sender (untrusted metadata):", ... then a fenced or bare JSON block
    r"(?s)^[^\n]{0,80}\(untrusted[^)\n]*\):?[ \t]*\n?```[a-z]*\n.*?```",
    r"(?s)^[^\n]{0,80}\(untrusted[^)\n]*\):?[ \t]*\{.*?\}[ \t]*$",
    r"^[^\n]{0,80}\(untrusted[^)\n]*\):?[ \t]*$",
    r"\[message_id:[^\]\n]*\]",
    r"\[(?:media attached|image|audio|file)[^\]\n]*\]",
    r"<media:[a-z]+>",
    r"^System:[ \t]*\[[^\]\n]*\][^\n]*$",
    # leading envelopes that carry a date or clock time: "[Mon 2026-01-05 10:00 UTC]", "[Telegram Ada +2m 2026-...]"
    rf"^[ \t]*\[[^\]\n]{{0,120}}?(?:{_DATE}|\b\d{{1,2}}:\d{{2}}\b)[^\]\n]{{0,80}}\][ \t]*",
    rf"^[ \t]*\[?{_DAY},?[ \t]+{_DATE}[ T]{_TIME}{_ZONE}\]?[ \t]*",
    rf"^[ \t]*{_DATE}[ T]{_TIME}{_ZONE}[ \t]*[-|:]?[ \t]*",
    # channel tags: "[Telegram]", "[#general]", "[discord:1234]"
    r"^[ \t]*\[(?:#[\w-]+|(?:telegram|whatsapp|discord|slack|signal|imessage|webchat|matrix|teams|wechat|sms|email)"
    r"\b[^\]\n]*)\][ \t]*",
)


@lru_cache(maxsize=32)
def _compile(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(p, re.MULTILINE | re.IGNORECASE) for p in patterns)


def strip_boilerplate(text: str, patterns: Iterable[str] | None = None) -> str:
    """Remove client metadata matched by `patterns` (default `DEFAULT_STRIP_PATTERNS`) and squeeze whitespace."""
    for pattern in _compile(tuple(DEFAULT_STRIP_PATTERNS if patterns is None else patterns)):
        text = pattern.sub(" ", text)
    text = re.sub(r"[ \t]+", " ", text)
    return re.sub(r"\s*\n\s*", "\n", text).strip()


def extract_query(
    messages: Sequence[Mapping[str, Any]], patterns: Iterable[str] | None = None, max_chars: int = 2000
) -> str:
    """The retrieval query: the latest user message with boilerplate stripped.

    A user message that is nothing but boilerplate is skipped in favour of the one before it.

    Args:
        messages: OpenAI-format chat messages (`content` a string or a list of parts).
        patterns: regexes to strip; None means `DEFAULT_STRIP_PATTERNS`, an empty list strips nothing.
        max_chars: keep at most this many characters (the head of the message, where the ask usually is).

    Returns:
        The query text, or "" when no user message has any content left.
    """
    pats = tuple(DEFAULT_STRIP_PATTERNS if patterns is None else patterns)
    for message in reversed(messages):
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        text = strip_boilerplate(content_text(message.get("content"), "\n"), pats)  # parts: lines
        if text:
            return text[:max_chars]
    return ""
