"""Finding secrets and personal data in turn text: where they are (character spans) and what they are.

Secrets come from three sources, merged:
- `detect-secrets`' own format plugins (its `RegexBasedDetector`s: AWS, Azure storage, GitHub, GitLab, Slack, Stripe,
  Twilio, SendGrid, PyPI, npm, Discord, Telegram, private-key headers, basic-auth URLs, ...), run on the text with
  their default patterns; its IP plugin is personal data here, its entropy plugins are replaced (below);
- patterns of our own where it has gaps (OpenAI / Anthropic / Hugging Face / GCP / newer GitHub and Stripe formats,
  whole PEM blocks, `KEY=value` assignments in `.env` files and JSON/YAML, `Authorization:` headers, passwords in
  connection strings);
- high-entropy tokens: a run of at least `ENTROPY_MIN_LENGTH` token characters, with upper- and lower-case letters
  and digits, whose Shannon entropy is at least `ENTROPY_BITS` per character. Spared by construction: UUIDs and
  hex digests (hex only, one case), version strings (dots split them), `data:` URIs and base64 images, integrity
  hashes (`sha512-...`), blobs longer than `ENTROPY_MAX_LENGTH` (data, not a key).

Personal data: e-mail addresses, phone numbers (`phonenumbers`, numbers valid for their region), card numbers
(13-19 digits with an issuer prefix and a valid Luhn check), IBANs (`stdnum.iban`: country format and checksum),
and public IP addresses (private, loopback and documentation ranges are not personal). Names are not detected:
the maintained detector (`presidio-analyzer`) needs a spaCy language model downloaded at install time, which an
offline CPU box cannot fetch.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import phonenumbers
from stdnum import iban as stdnum_iban
from stdnum import luhn

from metaclaw.privacy.encodings import encoded_secrets

SECRET = "secret"
PII_CATEGORIES = ("email", "phone", "card", "iban", "ip")
ENTROPY_BITS = 4.0
ENTROPY_MIN_LENGTH = 24
ENTROPY_MAX_LENGTH = 512
PLACEHOLDER = "[REDACTED:{}]"


@dataclass(frozen=True, order=True)
class Finding:
    """One detected item: `text[start:end]` is a `kind` (e.g. `github_token`) of `category` (`secret` or a PII one)."""

    start: int
    end: int
    category: str
    kind: str


# ---- secrets: our own patterns -------------------------------------------------------------------------------
_VALUE = r"[\"']?(?P<v>[^\s\"'`,;#]{6,})"
_SECRET_WORDS = (
    r"pass(?:word|wd|phrase)?|pwd|secret|token|api[_-]?key|apikey|access[_-]?key|private[_-]?key|client[_-]?secret"
    r"|auth[_-]?token|credentials?|signing[_-]?key|encryption[_-]?key|session[_-]?key|webhook[_-]?secret"
)
_OWN: list[tuple[str, re.Pattern[str]]] = [
    ("anthropic_key", re.compile(r"\bsk-ant-(?:api|admin|oat)\d{2}-[A-Za-z0-9_\-]{40,}")),
    ("openai_key", re.compile(r"\bsk-(?:proj-|svcacct-|admin-|None-)?[A-Za-z0-9_\-]{32,}")),
    ("huggingface_token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("aws_access_key", re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|ABIA|ACCA)[A-Z0-9]{16}\b")),
    ("gcp_api_key", re.compile(r"\bAIza[0-9A-Za-z_\-]{35}")),
    ("gcp_oauth_token", re.compile(r"\bya29\.[0-9A-Za-z_\-]{20,}")),
    ("azure_client_secret", re.compile(r"(?<![A-Za-z0-9])[A-Za-z0-9_~.\-]{3}\dQ~[A-Za-z0-9_~.\-]{31,34}")),
    ("azure_sas_signature", re.compile(r"[?&]sig=(?P<v>[A-Za-z0-9%/+=]{30,})")),
    ("azure_connection_string", re.compile(r"(?:AccountKey|SharedAccessKey)=(?P<v>[A-Za-z0-9+/=]{30,})")),
    ("github_token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{60,255})")),
    ("gitlab_token", re.compile(r"\bgl(?:pat|dt|ft|soat|rt|cbt|ptt|oas)-[A-Za-z0-9_\-]{20,}")),
    ("slack_token", re.compile(r"\bxox[abposre]-[A-Za-z0-9\-]{10,}")),
    ("slack_webhook", re.compile(r"https://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9_/]{20,}")),
    ("stripe_key", re.compile(r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}|\bwhsec_[A-Za-z0-9]{24,}")),
    ("jwt", re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}")),
    (
        "private_key",
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|[\s\S]{0,4000})"
        ),
    ),
    ("url_password", re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.\-]{1,20}://[^\s:/@'\"]{1,64}:(?P<v>[^\s@/'\"]{3,})@")),
    ("cli_password", re.compile(r"\b(?:mysql|mysqldump|mysqladmin|sshpass)\b[^\n]*?\s-p[\"']?(?P<v>[^\s\"']{4,})")),
    ("cli_password", re.compile(r"(?<![\w-])--password[= ][\"']?(?P<v>[^\s\"']{4,})")),
    ("connection_string_password", re.compile(r"(?i)(?:^|[;\s\"'])(?:password|pwd)\s*=\s*(?P<v>[^;'\"\s]{4,})")),
    (
        "authorization_header",
        re.compile(
            r"(?i)\b(?:authorization|proxy-authorization)\s*[:=]\s*[\"']?(?:bearer|basic|token|bot)\s+"
            r"(?P<v>[A-Za-z0-9._~+/=\-]{12,})"
        ),  # fmt: skip
    ),
    (
        "api_key_header",
        re.compile(
            r"(?i)\b(?:x-api-key|api-key|x-auth-token|x-access-token|private-token|x-goog-api-key)"
            r"\s*[:=]\s*[\"']?(?P<v>[A-Za-z0-9._~+/=\-]{12,})"
        ),  # fmt: skip
    ),
    (
        "assigned_secret",  # KEY=value (.env, shell), "key": "value" (JSON), key: value (YAML)
        re.compile(
            rf"(?i)(?<![A-Za-z0-9])[\"']?[A-Za-z0-9_.\-]*(?:{_SECRET_WORDS})[A-Za-z0-9_\-]*[\"']?\s*(?::=|=|:)\s*{_VALUE}"
        ),
    ),
]
# a value that is a reference or a placeholder, not a secret
_NOT_A_VALUE = re.compile(
    r"(?i)^(?:\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|\$\(.*|<[^>]*>?|\{\{.*|%\(.*|[*xX•.\-_]+|\[REDACTED.*|null|none|true|false|"
    r"undefined|changeme|password|passwd|secret|string|str|bytes|optional\[?.*|example\w*|your[_-].*|placeholder|"
    r"redacted|required|os\.environ.*|os\.getenv.*|env\(.*|process\.env.*|getpass.*|input\(.*|self\.\w+|"
    r"settings\.\w+|config\.\w+|cfg\.\w+|args\.\w+|[\w.]+\(.*|[\w.]+\[.*|[a-z_]+\.[a-z_.]+|[A-Z_]+|[a-z_]+|[0-9]+)$"
)


def _own_secrets(text: str) -> Iterator[Finding]:
    for kind, pattern in _OWN:
        for m in pattern.finditer(text):
            value = m.group("v") if "v" in pattern.groupindex else None
            if value is not None:
                if _NOT_A_VALUE.match(value) or (kind == "assigned_secret" and not _looks_secret(value)):
                    continue
                yield Finding(m.start("v"), m.end("v"), SECRET, kind)
            else:
                yield Finding(m.start(), m.end(), SECRET, kind)


_SLUG = re.compile(r"^(?:[a-z]+(?:[-_.][a-z0-9]+)*|[A-Z]+(?:[-_][A-Z0-9]+)*)$")


def _looks_secret(value: str) -> bool:
    """A value assigned to a secret-sounding name that is a secret: 8+ characters mixing letters with digits or
    symbols; a slug (`prod-tls-1`, `app_db_secret`) or a plain word (`required`) is a name, not a secret."""
    if len(value) < 8 or _SLUG.match(value):
        return False
    has_alpha = any(c.isalpha() for c in value)
    has_other = any(c.isdigit() or not c.isalnum() and c not in "_.-" for c in value)
    return has_alpha and has_other


# ---- secrets: detect-secrets --------------------------------------------------------------------------------
_SKIPPED_PLUGINS = ("IPPublicDetector", "ArtifactoryDetector")  # IPs are PII here; Artifactory's fires on words
_TRIM = " \t\r\n\"'=:`"


@lru_cache(maxsize=1)
def _detect_secrets_patterns() -> tuple[tuple[str, re.Pattern[str]], ...]:
    """The default plugins' patterns (`detect-secrets`' `RegexBasedDetector` subclasses), read once."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
    from detect_secrets.plugins.base import RegexBasedDetector

    out = []
    for cls in get_mapping_from_secret_type_to_class().values():
        if issubclass(cls, RegexBasedDetector) and cls.__name__ not in _SKIPPED_PLUGINS:
            kind = "ds_" + re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Detector")).lower()
            out += [(kind, p) for p in cls().denylist]
    return tuple(out)


def _jwt_valid(token: str) -> bool:
    from detect_secrets.plugins.jwt import JwtTokenDetector

    return JwtTokenDetector.is_formally_valid(token)


def _detect_secrets(text: str) -> Iterator[Finding]:
    for kind, pattern in _detect_secrets_patterns():
        for m in pattern.finditer(text):
            start, end = m.span(1) if pattern.groups and m.group(1) else m.span()
            while start < end and text[start] in _TRIM:
                start += 1
            while end > start and text[end - 1] in _TRIM:
                end -= 1
            value = text[start:end]
            if end - start < 8 or (kind == "ds_jwt_token" and not _jwt_valid(value)):
                continue
            if kind == "ds_basic_auth" and _NOT_A_VALUE.match(value):
                continue
            yield Finding(start, end, SECRET, kind)


# ---- secrets: entropy ---------------------------------------------------------------------------------------
_TOKEN = re.compile(rf"[A-Za-z0-9+/_\-=]{{{ENTROPY_MIN_LENGTH},}}")
_SPARED_CONTEXT = re.compile(r"(?:data:[\w/+.\-]+;base64,|sha(?:1|256|384|512)[-:]|integrity=|b64_json\"?:\s*\"?)$")
_IMAGE_B64 = ("iVBORw0KGgo", "/9j/", "R0lGOD", "UklGR", "PHN2Zy")


def shannon_bits(s: str) -> float:
    """Shannon entropy of the characters of `s`, bits per character."""
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def _mixed_classes(s: str) -> bool:
    return any(c.isupper() for c in s) and any(c.islower() for c in s) and any(c.isdigit() for c in s)


_PATH_PART = re.compile(r"^[a-z0-9_\-]{2,}$")


def _path_like(token: str) -> bool:
    """A path (`dist/assets/index-2NPujHMG`): at least half of its parts are lower-case words, which random
    base64 keys' slash-separated pieces almost never are, and no other part is long enough to be a key itself."""
    parts = [p for p in token.split("/") if p]
    words = [bool(_PATH_PART.match(p)) for p in parts]
    long_other = any(len(p) >= ENTROPY_MIN_LENGTH for p, w in zip(parts, words, strict=True) if not w)
    return sum(words) * 2 >= len(parts) and not long_other


def _entropy_secrets(text: str) -> Iterator[Finding]:
    for m in _TOKEN.finditer(text):
        token = m.group().strip("=-_/+")
        if token.startswith(("sha1-", "sha256-", "sha384-", "sha512-")):
            continue  # subresource / npm integrity hashes
        if not ENTROPY_MIN_LENGTH <= len(token) <= ENTROPY_MAX_LENGTH:
            continue
        if not _mixed_classes(token):
            continue  # hex digests, UUIDs, slugs, words
        if token.startswith(_IMAGE_B64) or _SPARED_CONTEXT.search(text, max(0, m.start() - 40), m.start()):
            continue
        if "/" in token and _path_like(token):
            continue
        if shannon_bits(token) >= ENTROPY_BITS:
            yield Finding(m.start(), m.end(), SECRET, "high_entropy")


# ---- personal data ------------------------------------------------------------------------------------------
_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+\-]{1,64}@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,24}\b")
_NOT_EMAIL_LOCAL = ("git@", "noreply@", "no-reply@")
_CARD = re.compile(r"(?<![\w\-.])(?:\d[ \-]?){12,18}\d(?![\w\-.])")
_CARD_PREFIX = re.compile(r"^(?:4|5[1-5]|2[2-7]|3[47]|6(?:011|5|4[4-9])|35|30[0-5]|36|38)")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{1,4}:){2,7}[0-9a-fA-F]{1,4}(?![\w:])")
_VERSION_BEFORE = re.compile(r"(?i)(?:\bv|version|ver|build|==|>=|<=|~=|@|release)\s*$")


def _emails(text: str) -> Iterator[Finding]:
    for m in _EMAIL.finditer(text):
        if not m.group().lower().startswith(_NOT_EMAIL_LOCAL):
            yield Finding(m.start(), m.end(), "email", "email")


def _phones(text: str, region: str) -> Iterator[Finding]:
    if sum(c.isdigit() for c in text) < 7:
        return
    for m in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID):
        yield Finding(m.start, m.end, "phone", "phone")


def _cards(text: str) -> Iterator[Finding]:
    for m in _CARD.finditer(text):
        digits = re.sub(r"\D", "", m.group())
        if 13 <= len(digits) <= 19 and _CARD_PREFIX.match(digits) and luhn.is_valid(digits):
            yield Finding(m.start(), m.end(), "card", "card")


def _ibans(text: str) -> Iterator[Finding]:
    for m in _IBAN.finditer(text):
        if stdnum_iban.is_valid(m.group()):
            yield Finding(m.start(), m.end(), "iban", "iban")


def _ips(text: str) -> Iterator[Finding]:
    for pattern in (_IPV4, _IPV6):
        for m in pattern.finditer(text):
            try:
                ip = ipaddress.ip_address(m.group())
            except ValueError:
                continue
            if not ip.is_global or _VERSION_BEFORE.search(text, max(0, m.start() - 12), m.start()):
                continue  # private, loopback, documentation ranges; `v1.2.3.4`, `pkg==1.2.3.4`
            yield Finding(m.start(), m.end(), "ip", "ip")


_PII = {"email": _emails, "card": _cards, "iban": _ibans, "ip": _ips}


# ---- the detector -------------------------------------------------------------------------------------------
def _plain_secrets(text: str, entropy: bool) -> list[Finding]:
    found = [*_own_secrets(text), *_detect_secrets(text)]
    if entropy:
        found += _entropy_secrets(text)
    return found


def find_secrets(text: str, entropy: bool = True) -> list[Finding]:
    """The secrets in `text`, as written or encoded (`metaclaw.privacy.encodings`: zero-width-joined, spaced, hex,
    base64); spans may overlap (`redact` merges them)."""
    if not text:
        return []
    found = _plain_secrets(text, entropy)

    def scan(view: str) -> list[tuple[int, int, str]]:
        return [(f.start, f.end, f.kind) for f in _plain_secrets(view, entropy)]

    found += [Finding(start, end, SECRET, kind) for start, end, kind in encoded_secrets(text, scan)]
    return sorted(set(found))


SPLIT_WINDOW = 96  # characters each side of a boundary between two texts that a split key may span
_CONTEXT_KINDS = frozenset({"assigned_secret", "connection_string_password", "ds_keyword"})


def split_secrets(texts: Sequence[str]) -> dict[str, list[Finding]]:
    """Secrets split across consecutive texts (a key whose halves are sent in two messages): the pair's end and
    start joined are scanned for the known key formats, and a key that spans the joint is reported in both texts
    (text -> findings). Entropy and `KEY=value` rules are not applied at a joint: two ordinary texts joined without
    a space read as one long token too often."""
    out: dict[str, list[Finding]] = {}
    for a, b in itertools.pairwise(texts):
        head, tail = a[-SPLIT_WINDOW:].rstrip(), b[:SPLIT_WINDOW].lstrip()
        joint = head + tail
        for f in find_secrets(joint, entropy=False):
            if f.start < len(head) < f.end and f.kind not in _CONTEXT_KINDS:
                cut_a, cut_b = len(a.rstrip()) - (len(head) - f.start), len(b) - len(b.lstrip()) + f.end - len(head)
                out.setdefault(a, []).append(Finding(cut_a, len(a.rstrip()), SECRET, f.kind))
                out.setdefault(b, []).append(Finding(len(b) - len(b.lstrip()), cut_b, SECRET, f.kind))
    return out


def find_pii(text: str, categories: Iterable[str] = PII_CATEGORIES, phone_region: str = "US") -> list[Finding]:
    """The personal data of `categories` in `text`."""
    if not text:
        return []
    found: list[Finding] = []
    for category in categories:
        if category == "phone":
            found += _phones(text, phone_region)
        elif category in _PII:
            found += _PII[category](text)
        else:
            raise ValueError(f"unknown PII category {category!r} (known: {', '.join(PII_CATEGORIES)})")
    if "card" in categories:  # a card number is not also a phone number
        cards = [f for f in found if f.category == "card"]
        found = [f for f in found if f.category != "phone" or not any(_overlap(f, c) for c in cards)]
    return sorted(set(found))


def _overlap(a: Finding, b: Finding) -> bool:
    return a.start < b.end and b.start < a.end


def redact(text: str, findings: Iterable[Finding]) -> str:
    """`text` with every finding's span replaced by `[REDACTED:<kind>]` (overlapping spans merged: the first kind)."""
    spans: list[list] = []
    for f in sorted(findings):
        if spans and f.start < spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], f.end)
        else:
            spans.append([f.start, f.end, f.kind if f.category == SECRET else f.category])
    out, pos = [], 0
    for start, end, kind in spans:
        out += [text[pos:start], PLACEHOLDER.format(kind)]
        pos = end
    return "".join(out) + text[pos:]
