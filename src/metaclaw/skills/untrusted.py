"""Evolved skills are untrusted: the evolver writes them from conversation text that anyone who can reach the
proxy wrote, and a skill is injected into every later relevant prompt of its agent.

The rule every proposal's description and body must pass before anything is written (`check_untrusted`):

1. **Nothing copied**: no run of `COPY_WORDS` (8) consecutive words that also occurs in the failed turns the
   evolver was shown (what people, tools and the assistant wrote). A lesson is said in the evolver's own words.
2. **No links or addresses**: no URL (`scheme://`, `www.`), bare domain (`evil.example`, `x.com/a`), e-mail
   address or IP address.
3. **No command that fetches or runs code**: `curl`, `wget`, `nc`, a pipe into a shell or interpreter
   (`| sh`, `| bash`, `| python`, `| iex`), `eval(`/`exec(`, `base64 -d`, PowerShell `iex` / `iwr` / `irm` /
   `-enc`, `Invoke-WebRequest`, `certutil`, a package install (`pip install`, `npm i`, `go get`, ...).
   (Naming a dangerous command is allowed: "confirm before rm -rf" is a lesson, not a payload.)
4. **No code from the conversation**: a `code span` or fenced block whose text occurs in the failed turns.

The text is normalised first (`normalise`: NFKC, zero-width characters removed, Cyrillic/Greek lookalikes read as
Latin), so fullwidth `ｃｕｒｌ`, `c\u200burl` or a Cyrillic `сurl` are `curl`. A proposal that breaks one is
refused with the rule's name in the agent's evolution history. What passes is
still only a candidate: `approval` (docs/skills.md, "Review and approval") decides whether it is injected.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from metaclaw.messages import ZERO_WIDTH, content_text

COPY_WORDS = 8

_WORD_RE = re.compile(r"\w+")
# a bare domain: a dotted name ending in a TLD people register (file names such as `setup.py` or `run.sh` are not)
_TLDS = ("com|net|org|io|dev|app|ai|co|xyz|info|biz|me|ly|gg|tk|top|site|online|club|link|click|zip|mov|ru|cn|su|de"
         "|uk|fr|nl|pw|cc|ws|to|in|us|eu|example|test|invalid|onion|local|lan|internal")  # fmt: skip
_LINK_RE = re.compile(
    r"[a-z][a-z0-9+.-]*://|\bwww\.|[\w.+-]+@[\w-]+\.[\w.-]+|\b\d{1,3}(?:\.\d{1,3}){3}\b|\[[0-9a-f:]+\]"
    rf"|\b[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9-]+)*\.(?:{_TLDS})\b(?![.\w-]*\()",
    re.I,
)
_COMMAND_RE = re.compile(
    r"\b(?:curl|wget|nc|ncat|netcat|scp|ftp|iwr|irm|certutil|bitsadmin|mshta|regsvr32)\b"
    r"|\|\s*(?:sudo\s+)?(?:ba|z|k|da)?sh\b|\|\s*(?:python\d?|perl|ruby|node|iex|pwsh|powershell)\b"
    r"|\b(?:eval|exec)\s*\(|\bbase64\s+(?:-d|--decode)\b"
    r"|\biex\b|\binvoke-(?:webrequest|expression|restmethod)\b|-enc(?:odedcommand)?\b"
    r"|\b(?:pip[0-9.]*|pipx|uv\s+pip|npm|pnpm|yarn|npx|gem|cargo|go|apt(?:-get)?|brew|choco|winget)\s+(?:install|add|i|get|dlx)\b",
    re.I,
)
# Cyrillic and Greek letters drawn like Latin ones (NFKC leaves them be): `сurl` with a Cyrillic `с` is `curl`
_LOOKALIKES = str.maketrans(
    "\u0430\u0432\u0435\u0433\u0456\u0458\u043a\u043c\u043d\u043e\u0440\u0441\u0442\u0443\u0445\u0455\u04bb\u0501"
    "\u0410\u0412\u0415\u041a\u041c\u041d\u041e\u0420\u0421\u0422\u0425\u0405\u0406\u0408"
    "\u03b1\u03bf\u03c1\u03c4\u03c5\u03b9\u03ba\u03bd\u0391\u0392\u0395\u0397\u0399\u039a\u039c\u039d\u039f\u03a1\u03a4\u03a7",
    "aberijkmhopctyxshdABEKMHOPCTXSIJaoptuikvABEHIKMNOPTX",
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
        parts = [content_text(m.get("content"), "\n") for m in prompt if isinstance(m, Mapping)]
    parts += [str(get("response", "") or ""), str(get("feedback", None) or get("next_state", None) or "")]
    return "\n".join(p for p in parts if p)


def normalise(text: str) -> str:
    """`text` as the rule reads it: NFKC (fullwidth and other compatibility forms folded), zero-width and bidi
    characters removed, Cyrillic and Greek lookalikes read as the Latin letters they imitate."""
    return ZERO_WIDTH.sub("", unicodedata.normalize("NFKC", text)).translate(_LOOKALIKES)


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
    source = normalise(source)
    source_shingles = _shingles(_words(source), copy_words)
    squashed_source = _squash(source)
    for text in map(normalise, texts):
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
