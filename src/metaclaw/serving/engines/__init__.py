"""Inference engines behind the policy server (and the training server): HF `generate` and vLLM.

`EngineFactory` is the picklable recipe the LitServe worker calls to build the engine in its own process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metaclaw.serving.engines.base import (
    AdapterError,
    Engine,
    SamplingParams,
    SequenceOutput,
    TokenDelta,
    TokenScore,
    TokenStream,
    UnknownAdapterError,
)

__all__ = [
    "AdapterError",
    "Engine",
    "EngineFactory",
    "SamplingParams",
    "SequenceOutput",
    "TokenDelta",
    "TokenScore",
    "TokenStream",
    "UnknownAdapterError",
]


#: keys of the `backend` node that describe it rather than configure the engine
_DESCRIPTIVE = ("name", "engines", "cpu_engine", "_target_")


@dataclass
class EngineFactory:
    """Build the engine the `backend` node names by its `_target_` (a `from_backend(spec, infer_devices, **options)`
    constructor), the one plug mechanism of the config; `backend=auto` gets its `_target_` from the device plan.

    Args:
        model: where the base model comes from.
        backend: the `backend` config group as a plain dict (`_target_`, `name`, engine options). It comes from
            the composed config only, never from a request.
        infer_devices: GPU ids for inference (`devices.infer`); CPU when empty.
        cpu_threads: torch compute threads of the worker process (`devices.cpu_threads.serve`, resolved by the
            device plan); None: torch's default.
    """

    model: Any
    backend: dict[str, Any] = field(
        default_factory=lambda: {"name": "hf", "_target_": "metaclaw.serving.engines.hf.HFEngine.from_backend"}
    )
    infer_devices: list[int] = field(default_factory=list)
    cpu_threads: int | None = None

    def device(self) -> str:
        return f"cuda:{self.infer_devices[0]}" if self.infer_devices else "cpu"

    def __call__(self, device: str | None = None) -> Engine:
        from hydra.utils import instantiate

        if self.cpu_threads:  # in the worker process, before any torch op: every engine thread inherits it
            import torch

            torch.set_num_threads(int(self.cpu_threads))
        target = self.backend.get("_target_")
        if not target:
            raise ValueError(
                f"backend {self.backend.get('name')!r} has no _target_ (backend=auto is resolved by the device plan)"
            )
        options = {k: v for k, v in self.backend.items() if k not in _DESCRIPTIVE}
        return instantiate({"_target_": target, **options}, self.model, list(self.infer_devices))
