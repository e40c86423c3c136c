"""`SampleMeta`: what the proxy, the scorer and the privacy screen record about a sample, as named fields.

Stored as one JSON object per sample (`samples.meta`); a field that is None is not written, so the store's JSON
indexes (`$.response_id`, `$.conv_tail`, `$.skill_generation`) and its SQL (`$.dropped`) read the same keys.
Keys this version does not know (a store written by another version) are kept in `extra` and written back.
The record also reads and writes like the dict it replaced (`meta["dropped"]`, `meta.get("feedback")`), so old
callers keep working; new code uses the fields.

The sampling temperature is stored once per sample: the `temperature` column. `sampling` holds top-p and top-k
(the store adds the column's temperature when it reads a sample, so `meta.sampling` is the whole distribution).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class FitMeta:
    """What `rollout.fit` did to the request to fit the model (images, context)."""

    has_image: bool | None = None  # the request had image parts (the trainer is text-only)
    images: str | None = None  # what `rollout.fit` did with them: `passthrough` | `placeholder`
    images_replaced: int | None = None  # how many image parts the placeholder replaced
    context: dict[str, Any] | None = None  # what `rollout.fit` elided to fit the model's context


@dataclass
class OriginMeta:
    """Where the sample came from: the server's finish, the session it was found in, when, which seed file."""

    finish_reason: str | None = None  # the server's finish reason
    session_source: str | None = None  # how the session was found: a header or derived from the conversation
    conv_tail: str | None = None  # the conversation's fingerprint after the reply (a restarted proxy finds it)
    captured_at: float | None = None  # wall time of capture
    source: str | None = None  # the seed file a shipped sample came from


@dataclass
class JudgedMeta:
    """What the judge said (written by scoring/ when the sample is settled)."""

    judge: Any = None  # the judge's detail
    judge_reward: float | None = None  # the judge's reward before feedback changed it
    judge_error: str | None = None  # why the judge failed
    at_least_one: dict[str, Any] | None = None  # seed 002's +1 for a session that scored nothing above 0
    hint: str | None = None  # the OPD hint the teacher read


@dataclass(eq=False)
class SampleMeta(MutableMapping[str, Any]):
    """One sample's record; every field is optional (None: not recorded). The rarer fields are grouped by concern
    (`fit`, `origin`, `judged`); the stored JSON object stays flat (one key per field, as before)."""

    # written by rollout/ when the turn is captured
    sampling: dict[str, Any] | None = None  # {"top_p", "top_k"} (+ "temperature", the column's, when read)
    chat_template_kwargs: dict[str, Any] | None = None  # how the prompt was rendered (the teacher renders alike)
    tools: list[Any] | None = None  # the request's tools (the teacher's prompt renders them too)
    skills: list[str] | None = None  # skills injected into the prompt
    skill_generation: int | None = None  # the agent's skill generation then (older ones may be dropped)
    response_id: str | None = None  # the reply id the client got (`/v1/feedback` names it)
    fit: FitMeta = field(default_factory=FitMeta)
    origin: OriginMeta = field(default_factory=OriginMeta)
    # written by scoring/ and the privacy screen when the sample is settled
    judged: JudgedMeta = field(default_factory=JudgedMeta)
    distilled: dict[str, Any] | None = None  # a reply sampled with a stated preference in context (scoring.distill)
    feedback: dict[str, Any] | None = None  # the user's explicit score (`/v1/feedback`)
    privacy: dict[str, Any] | None = None  # what the privacy screen found and did
    dropped: str | None = None  # why the sample is never trained on (`reason[: detail]`)
    deferred: int | None = None  # steps that claimed it and took no gradient (all advantages 0): `SampleStore.defer`
    extra: dict[str, Any] = field(default_factory=dict)  # keys of another version, kept as they were

    @classmethod
    def of(cls, data: Mapping[str, Any] | SampleMeta | None) -> SampleMeta:
        """The record of `data` (a stored JSON object, a dict of a caller, or a record: copied)."""
        meta = cls()
        for key, value in (data or {}).items():
            meta[key] = value
        return meta

    def to_dict(self) -> dict[str, Any]:
        """The JSON object as stored: recorded fields, then the kept unknown keys."""
        return dict(self.items())

    # ---- the dict it replaced ------------------------------------------------------------------------------
    def _home(self, key: str) -> Any:
        """The record that holds stored key `key` (this one or a group); None: not a named field."""
        group = _HOME.get(key)
        return None if group is None else getattr(self, group) if group else self

    def __getitem__(self, key: str) -> Any:
        home = self._home(key)
        if home is not None:
            value = getattr(home, key)
            if value is None:
                raise KeyError(key)
            return value
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        home = self._home(key)
        if home is not None:
            setattr(home, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        home = self._home(key)
        if home is not None:
            if getattr(home, key) is None:
                raise KeyError(key)
            setattr(home, key, None)
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from (key for key in _NAMED if getattr(self._home(key), key) is not None)
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"SampleMeta({self.to_dict()!r})"


_GROUPS = {"fit": FitMeta, "origin": OriginMeta, "judged": JudgedMeta}
# The stored keys in the order they are written (the order of the flat record this one replaced).
_NAMED = ("finish_reason", "sampling", "chat_template_kwargs", "tools", "has_image", "images", "images_replaced",
          "context", "skills", "skill_generation", "session_source", "response_id", "conv_tail", "captured_at",
          "source", "judge", "judge_reward", "judge_error", "at_least_one", "hint", "distilled", "feedback",
          "privacy", "dropped", "deferred")  # fmt: skip
_HOME: dict[str, str] = {  # stored key -> the group that holds it ("": the record itself)
    **{f.name: "" for f in fields(SampleMeta) if f.name not in _GROUPS and f.name != "extra"},
    **{f.name: group for group, cls in _GROUPS.items() for f in fields(cls)},
}
assert set(_NAMED) == set(_HOME), "every stored key has one home"
