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


@dataclass
class EngineFactory:
    """Build an engine for `model` (a `ModelSpec`) with `backend` (`hf` | `vllm`) settings.

    Args:
        model: where the base model comes from.
        backend: the `backend` config group as a plain dict (`name` plus engine options).
        infer_devices: GPU ids for inference (`devices.infer`); CPU when empty.
    """

    model: Any
    backend: dict[str, Any] = field(default_factory=lambda: {"name": "hf"})
    infer_devices: list[int] = field(default_factory=list)

    def device(self) -> str:
        return f"cuda:{self.infer_devices[0]}" if self.infer_devices else "cpu"

    def __call__(self, device: str | None = None) -> Engine:
        name = self.backend.get("name", "hf")
        if name == "hf":
            from metaclaw.serving.engines.hf import HFEngine

            return HFEngine.from_spec(self.model, self.device(), int(self.backend.get("max_batch_size", 1)))
        if name == "vllm":
            from metaclaw.serving.engines.vllm import VLLMEngine

            options = {k: v for k, v in self.backend.items() if k != "name"}
            return VLLMEngine.from_spec(self.model, self.infer_devices, **options)
        raise ValueError(f"backend.name must be hf or vllm, got {name!r}")
