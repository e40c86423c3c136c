"""`backend=vllm`: sampling on a separate inference engine, each session's saved adapter hot-swapped in by name.

The engine is the policy server's (`metaclaw.serving.engines.vllm.VLLMEngine`, built by `EngineFactory`). It
starts lazily, on first use, on the inference devices, and `/v1/weights/save` re-points the session's adapter name
at the new directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from metaclaw.training_server.sessions import Session
from metaclaw.wire.sampling import SamplingParams, SequenceOutput

log = logging.getLogger(__name__)


class EngineSampler:
    """`/v1/sample` through an inference engine with LoRA hot-swap.

    Args:
        build: returns the engine (called once, on first use, on the inference thread).
    """

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._engine: Any = None
        self._published: set[str] = set()

    def engine(self) -> Any:
        if self._engine is None:
            self._engine = self._build()
        return self._engine

    def publish(self, session: Session) -> None:
        """Hot-swap: point the adapter named after the session at its newly saved directory."""
        self.engine().load_adapter(session.session_id, str(session.adapter_path))
        self._published.add(session.session_id)
        log.info("inference engine: adapter %s → %s", session.session_id, session.adapter_path)

    def forget(self, session_id: str) -> None:
        """Unload a deleted session's adapter from the engine (nothing to do if it never published)."""
        if session_id in self._published:
            self._published.discard(session_id)
            self.engine().unload_adapter(session_id)

    def sample(
        self, session: Session | None, tokens: Sequence[int], params: SamplingParams, prompt_logprobs: bool
    ) -> tuple[list[SequenceOutput], list[float | None] | None]:
        """Sample with the session's last saved adapter (the base model before its first save, or for None)."""
        adapter = session.session_id if session is not None and session.session_id in self._published else None
        engine = self.engine()
        outputs = engine.generate(list(tokens), params, adapter)
        prompt = None
        if prompt_logprobs:
            prompt = [None, *engine.prompt_logprobs(list(tokens[:1]), list(tokens[1:]), adapter)] if tokens else []
        return outputs, prompt


def make_vllm_sampler(spec: Any, devices: Sequence[int], backend: dict[str, Any]) -> EngineSampler:
    """The policy server's vLLM engine; fails now if vLLM is not found or its settings are not selected."""
    from metaclaw.devices import VLLM_HOWTO, vllm_installed

    if not vllm_installed(backend):
        raise SystemExit(f"inference backend vllm needs vLLM, which is not found: {VLLM_HOWTO}")
    if backend.get("name") != "vllm":
        raise SystemExit(
            "inference backend vllm: select its settings too with `backend=vllm` "
            "(scripts/start_training_server.sh --inference-backend vllm does)"
        )
    from metaclaw.serving.engines import EngineFactory

    return EngineSampler(EngineFactory(model=spec, backend=dict(backend), infer_devices=list(devices)))
