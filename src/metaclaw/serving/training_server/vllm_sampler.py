"""`backend=vllm`: sampling on a separate inference engine, each session's saved adapter hot-swapped in by name.

The engine is the policy server's (`metaclaw.serving.engines.vllm.VLLMEngine`, built by `EngineFactory`) when that
module exists; otherwise `ThinVLLMEngine` below, a minimal adapter over `vllm.LLM` with the same three methods
(`generate`, `prompt_logprobs`, `load_adapter`). Either way the engine starts lazily, on first use, on the
inference devices, and `/v1/weights/save` re-points the session's adapter name at the new directory.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from metaclaw.serving.sampling import SamplingParams, SequenceOutput
from metaclaw.serving.training_server.sessions import Session

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


class ThinVLLMEngine:
    """Minimal `vllm.LLM` wrapper with the engine interface's `generate`, `prompt_logprobs` and `load_adapter`.

    Args:
        model_dir: the base model as a local Hugging Face directory.
        devices: inference GPU ids (their count sets tensor parallelism).
        options: `backend` config (gpu_memory_utilization, max_loras, max_lora_rank, enforce_eager).
    """

    def __init__(self, model_dir: Path, devices: Sequence[int], options: dict[str, Any]) -> None:
        from vllm import LLM

        kwargs = dict(
            model=str(model_dir),
            enable_lora=True,
            max_loras=int(options["max_loras"]),
            max_lora_rank=int(options["max_lora_rank"]),
            gpu_memory_utilization=float(options["gpu_memory_utilization"]),
            enforce_eager=bool(options["enforce_eager"]),
            tensor_parallel_size=max(1, len(devices)),
        )
        log.info("Starting vLLM on %s (devices %s)", model_dir, list(devices) or "default")
        try:  # behaviour logprobs after temperature scaling, as the trainer recomputes them
            self.llm = LLM(logprobs_mode="processed_logprobs", **kwargs)
        except TypeError:
            self.llm = LLM(**kwargs)
        self._ids = itertools.count(1)
        self._loras: dict[str, Any] = {}

    def load_adapter(self, name: str, path: str) -> int:
        from vllm.lora.request import LoRARequest

        version = next(self._ids)  # a fresh id makes vLLM load the new weights
        self._loras[name] = LoRARequest(f"{name}-{version}", version, path)
        return version

    def _params(self, params: SamplingParams, **extra: Any) -> Any:
        from vllm import SamplingParams as VllmParams

        return VllmParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            seed=params.seed,
            **extra,
        )

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> list[SequenceOutput]:
        params.validate()
        request = {"prompt_token_ids": prompt_ids}
        lora = self._loras.get(adapter) if adapter else None
        result = self.llm.generate([request], self._params(params, logprobs=0), lora_request=lora, use_tqdm=False)[0]
        return [
            SequenceOutput(
                token_ids=list(o.token_ids),
                logprobs=[float(step[t].logprob) for step, t in zip(o.logprobs or [], o.token_ids, strict=False)],
                finish_reason="length" if o.finish_reason == "length" else "stop",
            )
            for o in result.outputs
        ]

    def prompt_logprobs(self, prompt_ids: list[int], target_ids: list[int], adapter: str | None = None) -> list[float]:
        ids = prompt_ids + target_ids
        lora = self._loras.get(adapter) if adapter else None
        one = self._params(SamplingParams(max_tokens=1, temperature=1.0), prompt_logprobs=0)
        result = self.llm.generate([{"prompt_token_ids": ids}], one, lora_request=lora, use_tqdm=False)[0]
        steps = result.prompt_logprobs[len(prompt_ids) :]
        return [float(step[t].logprob) for step, t in zip(steps, target_ids, strict=True)]


def make_vllm_sampler(spec: Any, devices: Sequence[int], backend: dict[str, Any]) -> EngineSampler:
    """The policy server's vLLM engine when it exists, else the thin one; fails now if vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("inference backend vllm needs the vllm package (pip install 'metaclaw[vllm]')")
    # conf/backend/vllm.yaml's values, for METACLAW_INFERENCE_BACKEND=vllm under the `backend=hf` config group
    options: dict[str, Any] = {
        "max_loras": 4,
        "max_lora_rank": 64,
        "gpu_memory_utilization": 0.85,
        "enforce_eager": False,
    }
    if backend.get("name") == "vllm":
        options.update({k: v for k, v in backend.items() if k != "name"})
    if importlib.util.find_spec("metaclaw.serving.engines.vllm") is not None:
        from metaclaw.serving.engines import EngineFactory

        factory = EngineFactory(model=spec, backend={"name": "vllm", **options}, infer_devices=list(devices))
        return EngineSampler(factory)
    return EngineSampler(lambda: ThinVLLMEngine(spec.local_dir(), devices, options))
