"""LoRA sessions sharing one base model: the policy's single adapter slot is time-shared between them.

Each session owns its adapter tensors, gradients, AdamW state and step. Binding a session points the slot's
`nn.Parameter`s at that session's tensors (`p.data = ...`, `p.grad = ...`): no copy, so switching agents costs
nothing, and every `LoraPolicy` method (`logprobs`, `save_adapter`, `load_adapter`) acts on the bound session.
Only the model-owner thread touches a slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft.tuners.lora.layer import LoraLayer
from torch import Tensor

from metaclaw.modules.policy import LoraPolicy
from metaclaw.training_server.sample_memory import SampleMemory

ADAPTER_NAME = "default"  # LoraPolicy's one PEFT adapter


@dataclass
class Session:
    """One client's training run (one MetaClaw agent).

    Attributes:
        session_id: the id returned by `/v1/lora/create`.
        base_model: the base model the client asked for.
        rank: LoRA rank.
        weights: the live adapter tensors (name → tensor), bound to the slot while this session trains.
        grads: gradients accumulated by `forward_backward` since the last `optim_step`.
        optimizer: this session's AdamW over the slot's parameters.
        published: a snapshot of `weights` taken by `/v1/weights/save`; what `/v1/sample` serves.
        step: optimizer steps taken.
        pending_losses: `forward_backward` losses since the last step (for `avg_loss`).
        adapter_path: the last adapter written by `/v1/weights/save`.
        samples: which distribution sampled each recent sequence (for `forward_backward`'s distribution rule).
        last_used: `time.monotonic()` of the last request naming this session (idle expiry).
    """

    session_id: str
    base_model: str
    rank: int
    weights: dict[str, Tensor]
    optimizer: torch.optim.Optimizer
    published: dict[str, Tensor]
    grads: dict[str, Tensor | None] = field(default_factory=dict)
    step: int = 0
    pending_losses: list[float] = field(default_factory=list)
    adapter_path: Path | None = None
    adapter_version: int = 0
    created_at: float = field(default_factory=time.time)
    samples: SampleMemory = field(default_factory=lambda: SampleMemory(0))
    last_used: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()


class AdapterSlot:
    """The trainable parameters of a `LoraPolicy`, rebound to whichever session is being served.

    Args:
        policy: the LoRA policy (its adapter's shape is shared by every session bound to it).
    """

    def __init__(self, policy: LoraPolicy) -> None:
        self.policy = policy
        self.params = {n: p for n, p in policy.named_parameters() if p.requires_grad}
        self.bound: Session | None = None

    def fresh_weights(self, seed: int) -> dict[str, Tensor]:
        """New adapter tensors with PEFT's own initialisation (A: Kaiming, B: zeros), reproducible from `seed`."""
        self.unbind()
        for p in self.params.values():
            p.data = torch.empty_like(p.data)
        device = next(iter(self.params.values())).device
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            for module in self.policy.modules():
                if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                    module.reset_lora_parameters(ADAPTER_NAME, True)
        return {n: p.data for n, p in self.params.items()}

    def bind(self, session: Session) -> None:
        """Point the slot at `session`'s weights and gradients (keeping the previous session's gradients)."""
        if self.bound is session:
            return
        self.unbind()
        for n, p in self.params.items():
            p.data = session.weights[n]
            p.grad = session.grads.get(n)
        self.bound = session

    def unbind(self) -> None:
        if self.bound is not None:
            self.bound.grads = {n: p.grad for n, p in self.params.items()}
            for p in self.params.values():
                p.grad = None
        self.bound = None

    def release(self, session: Session) -> None:
        """Drop every reference the slot holds to `session`'s tensors (before the session is deleted)."""
        if self.bound is not session:
            return
        for p in self.params.values():
            p.grad = None
            p.data = torch.zeros_like(p.data)
        self.bound = None

    @contextmanager
    def serving(self, weights: dict[str, Tensor]) -> Iterator[None]:
        """Within this block the adapter holds `weights` (e.g. a published snapshot); then it is put back."""
        live = {n: p.data for n, p in self.params.items()}
        try:
            for n, p in self.params.items():
                p.data = weights[n]
            yield
        finally:
            for n, p in self.params.items():
                p.data = live[n]

    def snapshot(self, session: Session) -> dict[str, Tensor]:
        return {n: t.detach().clone() for n, t in session.weights.items()}

    def new_session(
        self,
        session_id: str,
        base_model: str,
        seed: int,
        optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    ) -> Session:
        """A session with fresh adapter weights and its own optimizer, bound to the slot."""
        weights = self.fresh_weights(seed)
        session = Session(
            session_id=session_id,
            base_model=base_model,
            rank=self.rank,
            weights=weights,
            optimizer=optimizer_factory(list(self.params.values())),
            published={n: t.clone() for n, t in weights.items()},
        )
        self.bind(session)
        return session

    @property
    def rank(self) -> int:
        return int(self.policy.model.peft_config[ADAPTER_NAME].r)
