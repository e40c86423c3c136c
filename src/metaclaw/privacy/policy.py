"""`PrivacyPolicy`: what happens to a captured turn that holds a secret or personal data (docs/privacy.md).

It screens every sample as the store writes it (`SampleStore(screen=...)`: every capture path, proxy or replay,
goes through the store's `write_batch`), so nothing reaches the file, the scorer, the judge, the teacher, the
evolver or a training batch unscreened:
- a secret in the prompt or the reply: the sample is stored `dropped` (reason `secret`), its text redacted, its
  token ids and logprobs not stored at all (they spell the secret: decoding them gives it back, and a turn that is
  never trained on needs none); only their counts are kept (`meta.privacy.tokens_discarded`);
- personal data, per category: `drop` (as a secret, reason `pii:<category>`), `redact_text` (stored text redacted;
  the token ids are kept and trained on: rewriting them would break the behaviour distribution) or `keep`;
- next states (the user's reply that the judge reads) are redacted the same way.

Outbound: judge, teacher and evolver calls to a `base_url` off this machine get a redacted copy of the turn
(`outbound: redact_external`, the default), every personal-data category included, `keep` ones too.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from metaclaw.privacy.detect import PII_CATEGORIES, Finding, find_pii, find_secrets, redact, split_secrets
from metaclaw.store import Sample, SampleMeta

log = logging.getLogger(__name__)

ACTIONS = ("drop", "redact_text", "keep")
OUTBOUND = ("redact_external", "redact_all", "off")
DEFAULT_PII = {"email": "redact_text", "phone": "redact_text", "card": "drop", "iban": "drop", "ip": "keep"}
_NOT_TEXT = frozenset({"role", "type", "id", "tool_call_id", "name"})  # message fields that hold no user text
_LABELS = _NOT_TEXT | {"call_id"}  # screened for secret formats only (`PrivacyPolicy._found`)
_CACHE_SIZE = 4096


class PrivacyPolicy:
    """Screens samples and next states before they are stored; gives redacted views for outbound calls.

    Args:
        pii: action per personal-data category (`drop | redact_text | keep`); missing ones take `DEFAULT_PII`.
        outbound: `redact_external` (calls to a non-loopback `base_url` get redacted text), `redact_all` or `off`.
        entropy: also flag high-entropy tokens as secrets (`metaclaw.privacy.detect`).
        phone_region: region for numbers written without a country code.
        retention_days: trained (`consumed`) and `dropped` samples older than this are deleted (null: kept).
        retention_check_s: how often the running service applies `retention_days`.
        show_text: whether `status` and the live service's evaluation records may carry example replies (read by
            the control plane and the evaluation wiring).
    """

    def __init__(
        self,
        pii: Mapping[str, str] | None = None,
        outbound: str = "redact_external",
        entropy: bool = True,
        phone_region: str = "US",
        retention_days: float | None = 30.0,
        retention_check_s: float = 3600.0,
        show_text: bool = False,
    ) -> None:
        actions = {**DEFAULT_PII, **dict(pii or {})}
        for category, action in actions.items():
            if category not in PII_CATEGORIES:
                raise ValueError(f"privacy.pii.{category}: unknown category (known: {', '.join(PII_CATEGORIES)})")
            if action not in ACTIONS:
                raise ValueError(f"privacy.pii.{category} must be one of {ACTIONS}, got {action!r}")
        if outbound not in OUTBOUND:
            raise ValueError(f"privacy.outbound must be one of {OUTBOUND}, got {outbound!r}")
        if retention_days is not None and retention_days <= 0:
            raise ValueError(f"privacy.retention_days must be > 0 or null, got {retention_days}")
        self.pii, self.outbound, self.entropy, self.phone_region = actions, outbound, entropy, phone_region
        self.retention_days, self.retention_check_s, self.show_text = retention_days, retention_check_s, show_text
        self._screened = [c for c, a in actions.items() if a != "keep"]
        self._cache: OrderedDict[bytes, tuple[Finding, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"screened": 0, "dropped_secret": 0, "dropped_pii": 0, "redacted_pii": 0}

    # ---- finding ------------------------------------------------------------------------------------------
    def findings(self, text: str, label: bool = False) -> tuple[Finding, ...]:
        """Secrets and personal data (every category) in `text`; cached by content (a conversation's earlier
        messages and its tools come back with every turn).

        A `label` (an id, a name, a role, an object key) is matched against the secret formats only: random ids
        such as `call_Xk3j...` are high-entropy by nature and carry no personal data."""
        if not text:
            return ()
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16, person=b"L" if label else b"T")
        digest = key.digest()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
                return hit
        if label:
            found = tuple(find_secrets(text, entropy=False))
        else:
            found = tuple(find_secrets(text, self.entropy) + find_pii(text, PII_CATEGORIES, self.phone_region))
        with self._lock:
            self._cache[digest] = found
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return found

    def redact_text(self, text: str | None, everything: bool = False) -> str | None:
        """`text` with its secrets and the personal data the policy does not keep (all of it: `everything`)
        replaced by `[REDACTED:<kind>]`."""
        if not text:
            return text
        found = [f for f in self.findings(text) if everything or self._redacts(f)]
        return redact(text, found) if found else text

    def _redacts(self, f: Finding) -> bool:
        return f.category == "secret" or self.pii.get(f.category, "keep") != "keep"

    # ---- screening samples (the store calls this before writing) -----------------------------------------
    def screen(self, sample: Sample) -> Sample:
        """Apply the policy to `sample` in place (see the module doc); returns it."""
        self.stats["screened"] += 1
        carried = {"messages": sample.messages, "tools": sample.meta.tools,
                   "chat_template_kwargs": sample.meta.chat_template_kwargs}  # fmt: skip
        pieces = [*_strings(carried), (sample.response_text or "", False)]
        found = [f for text, label in pieces for f in self.findings(text, label)]
        across = split_secrets([t for t, label in pieces if not label and t])
        found += [f for fs in across.values() for f in fs]
        if not found:
            return sample
        secrets = sorted({f.kind for f in found if f.category == "secret"})
        categories = sorted({f.category for f in found if f.category != "secret"})
        dropped = [c for c in categories if self.pii[c] == "drop"]
        info: dict[str, Any] = {}
        if secrets:
            sample.meta.dropped, info["secret_kinds"] = "secret", secrets
            self.stats["dropped_secret"] += 1
        elif dropped:
            sample.meta.dropped = f"pii:{dropped[0]}"
            self.stats["dropped_pii"] += 1
        redacted = [c for c in categories if self.pii[c] != "keep"]
        if redacted:
            info["pii_redacted"] = redacted
            self.stats["redacted_pii"] += 1
        if secrets or dropped:
            sample.status = "dropped"
            info["tokens_discarded"] = {"prompt": len(sample.prompt_ids), "response": len(sample.response_ids)}
            sample.prompt_ids, sample.response_ids, sample.behaviour_logprobs = [], [], []
            sample.teacher_logprobs = None
            log.warning("Turn %s/%d dropped (%s): never stored verbatim, scored or trained on",
                        sample.session_id, sample.turn_index, sample.meta.dropped)  # fmt: skip
        def redact_one(text: str, label: bool) -> str:
            found = [f for f in (*self.findings(text, label), *across.get(text, ())) if self._redacts(f)]
            return redact(text, found) if found else text

        sample.messages = _map_strings(sample.messages, redact_one)
        sample.meta.tools = _map_strings(sample.meta.tools, redact_one)
        sample.meta.chat_template_kwargs = _map_strings(sample.meta.chat_template_kwargs, redact_one)
        sample.response_text = redact_one(sample.response_text, False) if sample.response_text else sample.response_text
        sample.next_state = self.redact_text(sample.next_state)
        sample.meta.privacy = info
        return sample

    def screen_next_state(self, text: str) -> str:
        """A next state as stored: secrets and non-kept personal data redacted."""
        return self.redact_text(text) or text

    # ---- outbound -----------------------------------------------------------------------------------------
    def redacts_for(self, base_url: str | None) -> bool:
        """Whether calls to `base_url` get redacted text (`outbound`; None: our own policy server)."""
        if self.outbound == "off":
            return False
        return self.outbound == "redact_all" or (base_url is not None and not is_loopback_url(base_url))

    def view(self, sample: Sample) -> Sample:
        """A copy of `sample` whose text has every secret and every personal-data item redacted."""
        out = copy.copy(sample)
        out.messages = _map_texts(sample.messages, lambda t: self.redact_text(t, everything=True))
        out.response_text = self.redact_text(sample.response_text, everything=True)
        out.next_state = self.redact_text(sample.next_state, everything=True)
        out.meta = SampleMeta.of(sample.meta)
        out.meta.tools = _map_texts(out.meta.tools, lambda t: self.redact_text(t, everything=True))
        if isinstance(out.meta.feedback, dict):
            fb = out.meta.feedback = dict(out.meta.feedback)
            fb["text"] = self.redact_text(fb.get("text"), everything=True)
        return out

    def view_turns(self, turns: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Redacted copies of the evolver's failed turns (`messages`, `response`, `next_state`, `prompt`)."""
        out = []
        for t in turns:
            t = dict(t)
            if "messages" in t:
                t["messages"] = _map_texts(t["messages"], lambda s: self.redact_text(s, everything=True))
            for key in ("response", "next_state", "prompt", "feedback"):
                if isinstance(t.get(key), str):
                    t[key] = self.redact_text(t[key], everything=True)
            out.append(t)
        return out


def is_loopback_url(url: str) -> bool:
    """Whether `url`'s host is this machine (localhost, 127.0.0.0/8, ::1)."""
    host = (urlsplit(url if "//" in url else f"//{url}").hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _strings(value: Any, key: str | None = None) -> list[tuple[str, bool]]:
    """Every string a request carries (message contents, parts, tool-call arguments, tool definitions, template
    arguments), each with whether it is a label (an id, name, role or object key: `_LABELS`)."""
    if isinstance(value, str):
        return [(value, key in _LABELS)]
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in [(str(k), True), *_strings(v, k)]]
    if isinstance(value, list | tuple):
        return [p for v in value for p in _strings(v, key)]
    return []


def _map_strings(value: Any, fn: Callable[[str, bool], str], key: str | None = None) -> Any:
    """`value` with every string (object keys included) replaced by `fn(string, is_label)`."""
    if isinstance(value, str):
        return fn(value, key in _LABELS)
    if isinstance(value, Mapping):
        return {fn(str(k), True): _map_strings(v, fn, k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, fn, key) for v in value]
    return value


def _map_texts(value: Any, fn: Callable[[str], str | None], key: str | None = None) -> Any:
    if isinstance(value, str):
        return value if key in _NOT_TEXT else fn(value)
    if isinstance(value, Mapping):
        return {k: _map_texts(v, fn, k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_texts(v, fn, key) for v in value]
    return value
