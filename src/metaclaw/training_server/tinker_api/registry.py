"""What the Tinker API keeps beside the engine: client sessions, training models, sampling sessions, paths.

A Tinker *training model* is one engine `Session` (same limits, same idle expiry, same checkpoint namespace);
its model id is `<client session>:train:<model_seq_id>` as the SDK derives it. Paths are
`tinker://<engine session id>/weights/<name>` (a checkpoint: `checkpoints/<id>/<name>`) and
`tinker://<engine session id>/sampler_weights/<name>` (an adapter: `adapters/<id>/<name>`), so they resolve
through the same confinement and ownership rules as seed 000's paths, also after a restart.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from metaclaw.training_server.errors import ApiError, bad_request
from metaclaw.training_server.tinker_api.futures import ModelQueue

KINDS = {"weights": "checkpoints", "sampler_weights": "adapters"}


@dataclass(frozen=True)
class TinkerLimits:
    """`app.tinker` (conf/app/training_server.yaml); see docs/training_server.md for each bound."""

    enabled: bool = True
    max_client_sessions: int = 64
    max_pending_per_model: int = 64
    max_futures: int = 4096
    result_ttl_s: float = 3600.0
    retrieved_grace_s: float = 60.0
    poll_wait_s: float = 20.0
    seq_gap_timeout_s: float = 300.0
    max_samplers: int = 16

    @classmethod
    def from_config(cls, cfg: Any) -> TinkerLimits:
        if cfg is None:
            return cls()
        return cls(**{k: type(getattr(cls, k))(v) for k, v in dict(cfg).items() if k in cls.__dataclass_fields__})


@dataclass
class Model:
    """A Tinker training model: the engine session behind it and its ordered request queue."""

    model_id: str
    session_id: str
    base_model: str
    rank: int
    queue: ModelQueue


@dataclass
class Sampler:
    """A sampling session: fixed adapter weights (None: the base model), and the session that made them."""

    sampler_id: str
    base_model: str
    model_path: str | None
    weights: dict[str, Tensor] | None
    origin: str | None
    last_used: float = field(default_factory=time.monotonic)


def parse_path(path: str, field_name: str) -> tuple[str, str, str]:
    """`tinker://<id>/<weights|sampler_weights>/<name>` → (area label, id, name); 400 naming `field_name`."""
    if not path.startswith("tinker://"):
        raise bad_request(f"{field_name} must be a tinker:// path, got {path[:60]!r}", field_name)
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise bad_request(f"{field_name} must look like tinker://<run>/weights/<name> or .../sampler_weights/<name>",
                          field_name)  # fmt: skip
    return KINDS[parts[1]], parts[0], parts[2]


def make_path(session_id: str, kind: str, name: str) -> str:
    return f"tinker://{session_id}/{kind}/{name}"


class Registry:
    """Client sessions (bounded, idlest dropped), models by id, samplers (bounded, idlest dropped)."""

    def __init__(self, limits: TinkerLimits) -> None:
        self.limits = limits
        self.clients: OrderedDict[str, float] = OrderedDict()
        self.models: dict[str, Model] = {}
        self.samplers: OrderedDict[str, Sampler] = OrderedDict()

    def new_client(self) -> str:
        while len(self.clients) >= self.limits.max_client_sessions:
            self.clients.popitem(last=False)
        client_id = f"tc-{uuid.uuid4().hex[:12]}"
        self.clients[client_id] = time.monotonic()
        return client_id

    def touch_client(self, client_id: str) -> bool:
        if client_id not in self.clients:
            return False
        self.clients[client_id] = time.monotonic()
        self.clients.move_to_end(client_id)
        return True

    def client(self, client_id: str, field_name: str = "session_id") -> str:
        if not self.touch_client(client_id):
            message = f"unknown or expired Tinker session {client_id[:40]!r}; create a new client"
            raise ApiError(404, message, field_name)
        return client_id

    def model(self, model_id: str, live: dict) -> Model:
        model = self.models.get(model_id)
        if model is None or model.session_id not in live:
            if model is not None:
                self.drop_model(model_id)
            raise ApiError(404, f"unknown model_id {model_id[:80]!r} (never created, deleted or expired)", "model_id")
        return model

    def owned(self, client_id: str) -> list[Model]:
        """The models a client session created (their ids start with `<client>:`)."""
        return [m for m in self.models.values() if m.model_id.startswith(f"{client_id}:")]

    def owns(self, client_id: str, session_id: str) -> bool:
        """Whether engine session `session_id` is a model this client created."""
        return any(m.session_id == session_id for m in self.owned(client_id))

    def drop_model(self, model_id: str) -> None:
        model = self.models.pop(model_id, None)
        if model is not None:
            model.queue.close()

    def prune(self, live: dict) -> None:
        """Forget models whose engine session is gone (deleted through seed 000's API, or idle-expired)."""
        for model_id in [m for m, x in self.models.items() if x.session_id not in live]:
            self.drop_model(model_id)

    def add_sampler(self, sampler: Sampler) -> str:
        while len(self.samplers) >= self.limits.max_samplers:
            self.samplers.popitem(last=False)
        self.samplers[sampler.sampler_id] = sampler
        return sampler.sampler_id

    def sampler(self, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise ApiError(
                404,
                f"unknown sampling session {sampler_id[:60]!r}: it expired (app.tinker.max_samplers are kept) or "
                "never existed; create a new sampling client",
                "sampling_session_id",
            )
        sampler.last_used = time.monotonic()
        self.samplers.move_to_end(sampler_id)
        return sampler
