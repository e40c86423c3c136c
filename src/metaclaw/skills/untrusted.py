"""Evolved skills are untrusted: the evolver writes them from conversation text that anyone who can reach the
proxy wrote, and a skill is injected into every later relevant prompt of its agent.

The rule every proposal's description and body must pass before anything is written (`check_untrusted`):

1. **Nothing copied**: no run of `COPY_WORDS` (8) consecutive words that also occurs in the failed turns the
   evolver was shown (what people, tools and the assistant wrote). A lesson is said in the evolver's own words.
2. **No links or addresses**: no URL (`scheme://`, `www.`), e-mail address or IP address.
3. **No command that fetches or runs code**: `curl`, `wget`, `nc`, a pipe into a shell or interpreter
   (`| sh`, `| bash`, `| python`), `eval(`/`exec(`, `base64 -d`, PowerShell `iex` / `-enc`, `Invoke-WebRequest`.
   (Naming a dangerous command is allowed: "confirm before rm -rf" is a lesson, not a payload.)
4. **No code from the conversation**: a `code span` or fenced block whose text occurs in the failed turns.

A proposal that breaks one is refused with the rule's name in the agent's evolution history. What passes is
still only a candidate: `approval` (docs/skills.md, "Review and approval") decides whether it is injected.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from metaclaw.skills.query import content_text

COPY_WORDS = 8

_WORD_RE = re.compile(r"\w+")
_LINK_RE = re.compile(
    r"[a-z][a-z0-9+.-]*://|\bwww\.|[\w.+-]+@[\w-]+\.[\w.-]+|\b\d{1,3}(?:\.\d{1,3}){3}\b|\[[0-9a-f:]+\]", re.I
)
_COMMAND_RE = re.compile(
    r"\b(?:curl|wget|nc|ncat|netcat|scp|ftp)\b|\|\s*(?:sudo\s+)?(?:ba|z|k|da)?sh\b|\|\s*(?:python\d?|perl|ruby|node)\b"
    r"|\b(?:eval|exec)\s*\(|\bbase64\s+(?:-d|--decode)\b"
    r"|\biex\b|\binvoke-(?:webrequest|expression)\b|-enc(?:odedcommand)?\b",
    re.I,
)
_CODE_RE = re.compile(r"```[^\n]*\n?(.*?)```|`([^`\n]+)`", re.S)


class UntrustedContentError(ValueError):
    """A proposal that carries conversation text or an imperative artifact; the message names the rule."""


def turn_text(turn: Any) -> str:
    """All the text of one failed turn (a `FailedTurn` or its dict): prompt messages, reply and what came next."""
    get = turn.get if isinstance(turn, Mapping) else (lambda k, d=None: getattr(turn, k, d))
    prompt = get("prompt", None) or get("messages", None) or get("prompt_text", None) or ""
    if isinstance(prompt, str):
        parts = [prompt]
    else:
        parts = [content_text(m.get("content")) for m in prompt if isinstance(m, Mapping)]
    parts += [str(get("response", "") or ""), str(get("feedback", None) or get("next_state", None) or "")]
    return "\n".join(p for p in parts if p)


def _words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


def _shingles(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _squash(text: str) -> str:
    return " ".join(text.split()).lower()


def check_untrusted(texts: Iterable[str], source: str, copy_words: int = COPY_WORDS) -> None:
    """Refuse `texts` (a proposal's description and body) that break the rule above, given the failed turns'
    text `source`.

    Raises:
        UntrustedContentError: naming the rule and the offending fragment (cut to 80 characters).
    """
    source_shingles = _shingles(_words(source), copy_words)
    squashed_source = _squash(source)
    for text in texts:
        match = _LINK_RE.search(text)
        if match:
            raise UntrustedContentError(f"untrusted: holds a link or address ({match.group(0)[:80]!r})")
        match = _COMMAND_RE.search(text)
        if match:
            raise UntrustedContentError(f"untrusted: holds a command that fetches or runs code ({match.group(0)!r})")
        for m in _CODE_RE.finditer(text):
            code = _squash(m.group(1) or m.group(2) or "")
            if len(code) >= 3 and code in squashed_source:
                raise UntrustedContentError(f"untrusted: code copied from the conversation ({code[:80]!r})")
        words = _words(text)
        for i in range(len(words) - copy_words + 1):
            if tuple(words[i : i + copy_words]) in source_shingles:
                copied = " ".join(words[i : i + copy_words])
                raise UntrustedContentError(
                    f"untrusted: repeats {copy_words}+ words of the conversation ({copied[:80]!r})"
                )
