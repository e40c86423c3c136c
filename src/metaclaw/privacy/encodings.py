"""Secrets written so that a plain scan misses them: zero-width-joined or lookalike characters, keys spelt out
with spaces, hex, base64 (`data:` URLs, Kubernetes secrets of any length) and keys split across messages.

Each view is a text derived from the original (normalised, collapsed or decoded) that the plain detector
(`detect.find_secrets`) scans again; a finding in a view is reported over the original span it came from, so the
redaction covers what was actually written. Decoding is bounded (`MAX_DECODED`, `MAX_DEPTH`) and only keeps
decodings that are mostly printable text: an image or random bytes decode to nothing worth scanning.
"""

from __future__ import annotations

import base64
import binascii
import re
import unicodedata
from collections.abc import Callable, Iterator

from metaclaw.messages import ZERO_WIDTH  # noqa: E402,F401 - one definition, on the ground floor

_SPACED = re.compile(r"(?<!\S)(?:[A-Za-z0-9_\-+/=.][ \t]){15,}[A-Za-z0-9_\-+/=.](?!\S)")
_HEX = re.compile(r"(?<![0-9A-Za-z])(?:[0-9a-fA-F]{2}){12,}(?![0-9A-Za-z])")
_HEX_ESCAPED = re.compile(r"(?:\\x[0-9a-fA-F]{2}){12,}")
_HEX_SPACED = re.compile(r"(?<![0-9A-Za-z])[0-9a-fA-F]{2}(?:[ :][0-9a-fA-F]{2}){11,}(?![0-9A-Za-z])")
_BASE64 = re.compile(r"[A-Za-z0-9+/_\-]{16,}={0,2}")
MAX_DECODED = 1 << 20  # bytes of decoded text scanned per original text
MAX_DEPTH = 2  # base64 inside base64 (a Kubernetes secret's value that is itself a .dockerconfigjson) is read

Scan = Callable[[str], list[tuple[int, int, str]]]  # text -> (start, end, kind) of each secret found


def normalise(text: str) -> tuple[str, list[int]]:
    """`text` in NFKC form without zero-width and bidi characters, and for each output character its input index."""
    if text.isascii():
        return text, list(range(len(text)))
    out, where = [], []
    for i, ch in enumerate(text):
        if ZERO_WIDTH.match(ch):
            continue
        folded = unicodedata.normalize("NFKC", ch) if ord(ch) > 127 else ch
        out.append(folded)
        where += [i] * len(folded)
    return "".join(out), where


def _printable(data: bytes) -> str | None:
    """`data` as text when it is UTF-8 and at least 95% printable (letters, digits, punctuation, whitespace)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if len(text) < 8:
        return None
    good = sum(ch.isprintable() or ch in "\n\r\t" for ch in text)
    return text if good >= 0.95 * len(text) else None


def _b64(token: str) -> bytes | None:
    token = token.rstrip("=")
    if len(token) % 4 == 1:
        return None
    padded = token + "=" * (-len(token) % 4)
    try:
        if "-" in token or "_" in token:
            return base64.urlsafe_b64decode(padded)
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        return None


def _hex(token: str) -> bytes | None:
    try:
        return bytes.fromhex(re.sub(r"\\x|[ :]", "", token))
    except ValueError:
        return None


def decoded_views(text: str) -> Iterator[tuple[int, int, str]]:
    """`(start, end, decoded text)` for each hex or base64 run of `text` that decodes to printable text."""
    budget = MAX_DECODED
    for pattern, decode in ((_HEX, _hex), (_HEX_ESCAPED, _hex), (_HEX_SPACED, _hex), (_BASE64, _b64)):
        for m in pattern.finditer(text):
            if budget <= 0:
                return
            data = decode(m.group())
            decoded = _printable(data) if data else None
            if decoded is not None:
                budget -= len(decoded)
                yield m.start(), m.end(), decoded


def spaced_views(text: str) -> Iterator[tuple[int, int, str]]:
    """`(start, end, collapsed)` for each run of 16+ single characters separated by blanks (`s k - p r o j ...`)."""
    for m in _SPACED.finditer(text):
        yield m.start(), m.end(), re.sub(r"[ \t]", "", m.group())


def encoded_secrets(text: str, scan: Scan, depth: int = 0) -> list[tuple[int, int, str]]:
    """Secrets that only a derived view of `text` shows, as `(start, end, kind)` spans of `text` itself."""
    found: list[tuple[int, int, str]] = []
    norm, where = normalise(text)
    if norm != text:
        for start, end, kind in scan(norm):
            found.append((where[start], where[end - 1] + 1, kind))
    for start, end, view in spaced_views(norm):
        if scan(view):
            found.append((where[start], where[end - 1] + 1, "spaced_secret"))
    if depth < MAX_DEPTH:
        for start, end, view in decoded_views(norm):
            if scan(view) or encoded_secrets(view, scan, depth + 1):
                found.append((where[start], where[end - 1] + 1, "encoded_secret"))
    return found
