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

Outbound: judge, teacher and evolver calls get a redacted copy of the turn, every personal-data category included,
`keep` ones too, unless the destination is this run's own policy server, known by its address AND its per-run key
(`outbound: redact_untrusted`, the default; `bind_own_server`), or a base URL the owner listed in `trusted_outbound`.
A loopback address alone proves nothing: any local process can listen on one.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from metaclaw.privacy.detect import PII_CATEGORIES, Finding, find_pii, find_secrets, redact, split_secrets
from metaclaw.store import Sample, SampleMeta, SampleText
from metaclaw.wire.client import Endpoint

log = logging.getLogger(__name__)

ACTIONS = ("drop", "redact_text", "keep")
OUTBOUND = ("redact_untrusted", "redact_all", "off")
DEFAULT_PII = {"email": "redact_text", "phone": "redact_text", "card": "drop", "iban": "drop", "ip": "keep"}
_NOT_TEXT = frozenset({"role", "type", "id", "tool_call_id", "name"})  # message fields that hold no user text
_LABELS = _NOT_TEXT | {"call_id"}  # screened for secret formats only (`PrivacyPolicy._found`)
_CACHE_SIZE = 4096


class PrivacyPolicy:
    """Screens samples and next states before they are stored; gives redacted views for outbound calls.

    Args:
        pii: action per personal-data category (`drop | redact_text | keep`); missing ones take `DEFAULT_PII`.
        outbound: `redact_untrusted` (every call gets redacted text but those to this run's own policy server, by
            address and key, and to `trusted_outbound`), `redact_all` or `off`.
        trusted_outbound: base URLs the owner trusts with the stored text (e.g. their own judge server).
        entropy: also flag high-entropy tokens as secrets (`metaclaw.privacy.detect`).
        phone_region: region for numbers written without a country code.
        retention_days: trained (`consumed`) and `dropped` samples older than this are deleted (null: kept).
        retention_check_s: how often the running service applies `retention_days`.
        show_text: whether `status` and the live service's evaluation records may carry example replies (read by
            the control plane and the evaluation wiring).
    """

    def __init__(
        self,
        pii: Mapping[str, str] | None = MappingProxyType(DEFAULT_PII),
        outbound: str = "redact_untrusted",
        trusted_outbound: Sequence[str] = (),
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
        if outbound == "redact_external":  # trusted any loopback URL: a local process is not the run's own server
            raise ValueError("privacy.outbound: redact_external was replaced by redact_untrusted (this run's own "
                             "policy server is recognised by address and key); list destinations you trust with the "
                             "stored text in privacy.trusted_outbound")  # fmt: skip
        if outbound not in OUTBOUND:
            raise ValueError(f"privacy.outbound must be one of {OUTBOUND}, got {outbound!r}")
        if retention_days is not None and retention_days <= 0:
            raise ValueError(f"privacy.retention_days must be > 0 or null, got {retention_days}")
        self.pii, self.outbound, self.entropy, self.phone_region = actions, outbound, entropy, phone_region
        self.retention_days, self.retention_check_s, self.show_text = retention_days, retention_check_s, show_text
        self.trusted_outbound = frozenset(_endpoint(u) for u in trusted_outbound)
        self._own: tuple[str, str] | None = None  # this run's policy server: (endpoint, key)
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
        carried = {"messages": sample.text.messages, "tools": sample.meta.tools,
                   "chat_template_kwargs": sample.meta.chat_template_kwargs}  # fmt: skip
        pieces = [*_strings(carried), (sample.text.response_text or "", False)]
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

        text = sample.text
        sample.text = SampleText(
            messages=_map_strings(text.messages, redact_one),
            response_text=redact_one(text.response_text, False) if text.response_text else text.response_text,
            next_state=self.redact_text(text.next_state),
        )
        sample.meta.tools = _map_strings(sample.meta.tools, redact_one)
        sample.meta.chat_template_kwargs = _map_strings(sample.meta.chat_template_kwargs, redact_one)
        sample.meta.privacy = info
        return sample

    def screen_next_state(self, text: str) -> str:
        """A next state as stored: secrets and non-kept personal data redacted."""
        return self.redact_text(text) or text

    # ---- outbound -----------------------------------------------------------------------------------------
    def bind_own_server(self, server: Endpoint) -> None:
        """This run's policy server (the live loop's): calls to its address with its key get the stored text."""
        self._own = (_endpoint(server.url), server.api_key or "")

    def redacts_for(self, destination: Endpoint | None) -> bool:
        """Whether a call to `destination` (its address and key) gets redacted text (`outbound`). None: the
        component sends nothing (a rule judge runs here)."""
        if self.outbound == "off" or (destination is None and self.outbound != "redact_all"):
            return False
        if self.outbound == "redact_all" or destination is None:
            return True
        endpoint, api_key = _endpoint(destination.url), destination.api_key
        if endpoint in self.trusted_outbound:
            return False
        own = self._own
        return not (own is not None and endpoint == own[0] and hmac.compare_digest(own[1], api_key or ""))

    def view(self, sample: Sample) -> Sample:
        """A copy of `sample` whose text has every secret and every personal-data item redacted."""
        out = copy.copy(sample)
        out.text = SampleText(
            messages=_map_texts(sample.text.messages, lambda t: self.redact_text(t, everything=True)),
            response_text=self.redact_text(sample.text.response_text, everything=True),
            next_state=self.redact_text(sample.text.next_state, everything=True),
        )
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


def _endpoint(url: str) -> str:
    """`scheme://host:port/path` of a base URL, the OpenAI `/v1` suffix and trailing slashes left out: the judge
    (`<server>`) and the evolver (`<server>/v1`) of one server are one destination."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    port = parts.port or {"https": 443, "http": 80}.get(parts.scheme or "http")
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{parts.scheme or 'http'}://{(parts.hostname or '').lower()}:{port}{path}"


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
