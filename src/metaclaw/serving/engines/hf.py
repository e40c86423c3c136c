"""Hugging Face engine: KV-cached `generate` (via `metaclaw.serving.sampling`) with several named LoRA adapters.

One base model is wrapped (on the first adapter load) in a single `PeftModel` that holds every loaded adapter
version under an internal name; a request sets its adapter (or disables adapters for the base) under the model
lock and generates.

Batching (`max_batch_size` > 1, `backend.max_batch_size`): non-streaming requests wait in a pending list; the
one that gets the model lock takes up to `max_batch_size` pending requests with the same adapter version and
the same sampling distribution and stop rules (`sampling.batch_key`; `max_tokens` may differ) and runs one
left-padded `generate` for all of them. Requests with `n` > 1 or a `seed` and streams run alone.
A batch's leader lingers (`backend.batch_linger_s`) for the turns the previous batch answered: people and agents
that just got a reply send their next turn within milliseconds, but a static batch cannot take a request once it
runs, so two clients at machine pace fall into lockstep at batch 1 (each arrives while the other's batch runs).
The leader of a batch that starts within `batch_linger_s` of the previous one's end waits until as many requests
have arrived since that end as the previous batch answered, or until `batch_linger_s` after it, whichever is
first. A request that arrives later than that (a person reading, a lone client) never waits. Each row's
logprobs are its own, over the one distribution (`sampling.generate_batch`). Score requests (the teacher-logprob
route: the publish gate's 32 held-out turns, base NLLs) batch the same way, by model only (each row is scored
under its own distribution after one left-padded forward), so a gate's requests in flight take one turn at the
model lock instead of one each behind the users' generations.

Merged adapters (`merge_adapters`, `backend.merge_adapters`; `metaclaw.serving.engines.merged`): each loaded
adapter version is a copy of the base model with the LoRA folded into the weights (`W + s·B·A`; every other
tensor is shared with the base), written outside the model lock into a copy no request uses (a double buffer);
loading it is then a pointer flip (the registry re-points the name), so a hot-load never waits for a
generation, and a generation runs plain `nn.Linear`s instead of PEFT's extra low-rank matmuls. Its logprobs
differ from the trainer's unmerged ones only by float rounding (the ratio-is-1 tests hold them within 1e-4).
Costs one copy of the adapted weights per live version, plus one spare.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from metaclaw import profiling
from metaclaw.distribution import Dist
from metaclaw.distribution.logprobs import token_logprobs
from metaclaw.serving import sampling
from metaclaw.serving.engines.adapters import AdapterRegistry, LoadedAdapter, ServedAdapters, check_adapter_files
from metaclaw.serving.engines.base import (
    AdapterError,
    SamplingParams,
    SequenceOutput,
    TokenDelta,
    TokenScore,
    TokenStream,
    checked_params,
    scoring_ids,
)
from metaclaw.serving.engines.merged import MergedSlots
from metaclaw.serving.prefix_cache import PrefixCache, check_mb, from_mb
from metaclaw.wire import ADAPTER_WEIGHTS

log = logging.getLogger(__name__)


def read_adapter(path: str | Path, device: torch.device | str = "cpu") -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The LoRA config (JSON) and weights (safetensors) of a PEFT adapter directory; never unpickles anything."""
    directory = check_adapter_files(path)
    try:
        config = LoraConfig.from_pretrained(str(directory))
        state = load_file(str(directory / ADAPTER_WEIGHTS), device=str(device))
    except Exception as exc:  # noqa: BLE001 - any parse failure is the adapter's fault
        raise AdapterError(f"cannot read the adapter in {str(directory)!r}: {exc}") from exc
    config.inference_mode = True
    return config, state


#: options of `conf/backend/auto.yaml` only the vLLM engine reads
VLLM_ONLY_OPTIONS = frozenset(
    {
        "gpu_memory_utilization",
        "max_loras",
        "max_lora_rank",
        "enforce_eager",
        "lora_target_modules",
        "venv",
        "command",
        "extra_args",
        "log_file",
        "startup_timeout_s",
    }
)


@dataclass
class _Pending:
    """A generate request waiting for a batch; `done` is set when `result` or `error` is."""

    prompt_ids: list[int]
    params: SamplingParams
    key: tuple
    result: list[SequenceOutput] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _PendingScore:
    """A score request waiting for a batch: `ids` = prompt + target, the last `n_target` of them scored."""

    ids: list[int]
    n_target: int
    dist: Dist
    key: str | None  # the adapter's internal name (None: the base model): one forward serves one model
    result: list[TokenScore] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _settle(batch: Sequence[_Pending | _PendingScore], work: Callable[[], list[Any]]) -> None:
    """Run a batch's `work` (one result per request, in order); every request gets its result or the error, and
    is woken."""
    try:
        for p, result in zip(batch, work(), strict=True):
            p.result = result
    except BaseException as exc:  # noqa: BLE001 - every request of the batch gets the error
        for p in batch:
            p.error = exc
    finally:
        for p in batch:
            p.done.set()


def _outcome(mine: _Pending | _PendingScore) -> Any:
    """Wait for the batch that took `mine`; its result, or the batch's error raised here."""
    mine.done.wait()
    if mine.error is not None:
        raise mine.error
    assert mine.result is not None
    return mine.result


def _token_scores(logits: torch.Tensor, target_ids: Sequence[int], dist: Dist) -> list[TokenScore]:
    """`logits` [T, V]: row t predicts `target_ids[t]`; each target's logprob under `dist` and its rank."""
    logits = logits.float()
    targets = torch.tensor(list(target_ids), device=logits.device)
    logprobs = token_logprobs(logits, targets, *dist)
    ranks = ((logits > logits.gather(-1, targets[:, None])).sum(-1) + 1).tolist()
    return [TokenScore(lp, rank) for lp, rank in zip(logprobs.tolist(), ranks, strict=True)]


@dataclass
class _BatchQueue:
    """Requests waiting to be batched (bounded by the server's max_concurrency: each waiter is a caller), under
    one lock, and the batches run so far."""

    linger_s: float = 0.0  # `backend.batch_linger_s`
    pending: list[_Pending] = field(default_factory=list)
    scoring: list[_PendingScore] = field(default_factory=list)  # the same bound
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: threading.Condition = field(init=False)  # notified on every generate request queued
    arrivals: int = 0  # generate requests queued so far
    last_batch: tuple[float, int, int] | None = None  # (end, arrivals by then, size) of the last batch
    batches: dict[int, int] = field(default_factory=dict)  # batch size -> generate calls
    score_batches: dict[int, int] = field(default_factory=dict)  # batch size -> scoring forwards

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)


class HFEngine(ServedAdapters):
    """Serve a transformers causal LM (optionally already a `PeftModel`, e.g. the one being trained).

    Args:
        model: a causal LM, or a `PeftModel` whose adapters are then served under their own names.
        tokenizer: its tokenizer.
        model_name: the id that selects the base model.
        max_seq_len: longest prompt + completion accepted.
        max_batch_size: concurrent generate requests sampled together, and score requests scored together (1: one
            at a time).
        batch_linger_s: how long after a batch's end the next batch's leader may wait for the turns that batch
            answered (the module docstring; 0: never waits).
        merge_adapters: serve each adapter version merged into a copy of the weights (see the module docstring);
            not for a `model` that is already a `PeftModel` (its adapters are served as they are).
        prefix_cache_mb: keys and values of recent conversations kept for their next turn, per model (see the module
            docstring; 0: every prompt is read in full).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        model_name: str,
        max_seq_len: int = 2048,
        max_batch_size: int = 1,
        merge_adapters: bool = False,
        batch_linger_s: float = 0.0,
        prefix_cache_mb: float = 0.0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"backend.max_batch_size must be >= 1, got {max_batch_size}")
        if not 0 <= batch_linger_s <= 5:
            raise ValueError(f"backend.batch_linger_s must be in [0, 5] seconds, got {batch_linger_s}")
        if merge_adapters and isinstance(model, PeftModel):
            raise ValueError("backend.merge_adapters needs a plain base model, not a PeftModel")
        self.max_batch_size = max_batch_size
        self.merge_adapters = merge_adapters
        self.prefix = from_mb(prefix_cache_mb)
        self._merged: dict[str, nn.Module] = {}  # internal name -> merged copy (merge_adapters)
        self._slots = MergedSlots(model) if merge_adapters else None
        if merge_adapters:
            log.info("HF engine: adapters served merged into a copy of the weights (backend.merge_adapters)")
        self._queue = _BatchQueue(float(batch_linger_s))
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_seq_len = max_seq_len
        self._lock = threading.Lock()  # serialises every use of the model (forward, set_adapter, add/delete)
        self._registry = AdapterRegistry()
        self._ids = itertools.count()
        self._peft: PeftModel | None = model if isinstance(model, PeftModel) else None
        self._base = model
        if self._peft is not None:
            for name in list(self._peft.peft_config):
                self._registry.publish(LoadedAdapter(name=name, internal=name, version=0, path="<in-memory>"))

    @property
    def batch_linger_s(self) -> float:
        """How long a batch's leader may wait for the turns the last batch answered (`backend.batch_linger_s`)."""
        return self._queue.linger_s

    @batch_linger_s.setter
    def batch_linger_s(self, seconds: float) -> None:
        self._queue.linger_s = float(seconds)

    @property
    def batches(self) -> dict[int, int]:
        """Batch size -> generate calls (for benches and tests)."""
        return self._queue.batches

    @property
    def score_batches(self) -> dict[int, int]:
        """Batch size -> scoring forwards."""
        return self._queue.score_batches

    @classmethod
    def from_spec(
        cls,
        spec: Any,
        device: torch.device | str = "cpu",
        max_batch_size: int = 1,
        merge_adapters: bool = False,
        batch_linger_s: float = 0.0,
        prefix_cache_mb: float = 0.0,
    ) -> HFEngine:
        """Load `spec` (a `metaclaw.modules.loading.ModelSpec`) onto `device` for inference."""
        model = spec.load_model(device).eval()
        return cls(
            model, spec.load_tokenizer(), model_name=spec.name, max_seq_len=spec.max_seq_len,
            max_batch_size=max_batch_size, merge_adapters=merge_adapters, batch_linger_s=batch_linger_s,
            prefix_cache_mb=prefix_cache_mb,
        )  # fmt: skip

    @classmethod
    def from_backend(
        cls,
        spec: Any,
        infer_devices: Sequence[int] = (),
        max_batch_size: int = 4,
        merge_adapters: bool | str = "auto",
        batch_linger_s: float = 0.25,
        prefix_cache_mb: float = 1024,
        **vllm_only: Any,
    ) -> HFEngine:
        """The `backend` node's constructor: the first inference GPU, else CPU. The vLLM options `backend=auto`
        carries (for when it resolves to vLLM) are not used here; any other option is a config error.
        `merge_adapters`: true, false or `auto` (merged on CPU, where PEFT's unmerged layers cost the most and a
        copy of the adapted weights is cheap; through PEFT on a GPU). Its defaults are the product's (`backend=hf`:
        4 requests a batch, a 0.25 s linger, `auto` merging, a 1 GiB prefix cache; `HFEngine(...)` built by hand
        samples one request at a time)."""
        unknown = sorted(set(vllm_only) - VLLM_ONLY_OPTIONS)
        if unknown:
            raise ValueError(f"backend: options the HF engine does not know: {unknown}")
        device = f"cuda:{infer_devices[0]}" if infer_devices else "cpu"
        if merge_adapters not in (True, False, "auto"):
            raise ValueError(f"backend.merge_adapters must be true, false or auto, got {merge_adapters!r}")
        merge = device == "cpu" if merge_adapters == "auto" else bool(merge_adapters)
        check_mb(prefix_cache_mb)  # checked before the model loads
        return cls.from_spec(spec, device, int(max_batch_size), merge, float(batch_linger_s), float(prefix_cache_mb))

    @property
    def device(self) -> torch.device:
        return next(self._base.parameters()).device

    # ---------------------------------------------------------------- adapters

    def load_adapter(self, name: str, path: str, version: int | None = None) -> int:
        """Load the adapter under a fresh internal name, then re-point `name` to it atomically."""
        self._check_new_name(name)
        started = time.perf_counter()
        with profiling.phase("hot_load"):
            config, state = read_adapter(path, self.device)  # the slow part, outside the model lock
            version = self._registry.next_version(name, path, version)
            internal = f"adapter{next(self._ids)}"
            if self._slots is not None:  # built beside the running generations; serving it is the registry's flip
                self._merged[internal] = self._slots.build(config, state, path)
                return self._publish(name, internal, version, path, started)
            with profiling.phase("hot_load_lock_wait"):
                self._lock.acquire()
            try:
                self._add_weights(internal, config, state, path)
            finally:
                self._lock.release()
            return self._publish(name, internal, version, path, started)

    def _add_weights(self, internal: str, config: LoraConfig, state: dict[str, torch.Tensor], path: str) -> None:
        if self._peft is None:
            self._peft = PeftModel(self._base, config, adapter_name=internal)
        else:
            self._peft.add_adapter(internal, config)
        try:
            result = set_peft_model_state_dict(self._peft, state, adapter_name=internal)
            missing = [k for k in result.missing_keys if f".{internal}." in k and "lora_" in k]
            if result.unexpected_keys or missing:
                bad = (result.unexpected_keys or missing)[:3]
                raise AdapterError(f"adapter {path!r} does not fit the base model {self.model_name!r}: {bad}")
        except Exception:
            self._peft.delete_adapter(internal)
            raise
        self._peft.eval()

    def _free(self, slot: LoadedAdapter) -> None:
        if self.prefix is not None:
            self.prefix.forget(slot.internal)
        merged = self._merged.pop(slot.internal, None)
        if merged is not None:  # no request holds it (refs 0): the next load may overwrite it
            assert self._slots is not None
            self._slots.recycle(merged)
            return
        with self._lock:
            if self._peft is not None and slot.internal in self._peft.peft_config:
                self._peft.delete_adapter(slot.internal)

    # ---------------------------------------------------------------- model access

    @contextmanager
    def _model(self, slot: LoadedAdapter | None) -> Iterator[nn.Module]:
        """The model with `slot`'s adapter active (adapters disabled for None); hold only under `self._lock`."""
        if slot is None:
            if self._peft is None or not self._peft.peft_config:  # no adapter at all: the plain base model
                yield self._base
            else:
                with self._peft.disable_adapter():
                    yield self._peft
            return
        merged = self._merged.get(slot.internal)
        if merged is not None:
            yield merged
            return
        assert self._peft is not None
        self._peft.set_adapter(slot.internal)
        yield self._peft

    # ---------------------------------------------------------------- sampling

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> list[SequenceOutput]:
        params = checked_params(prompt_ids, params, self.max_seq_len)
        key = sampling.batch_key(params)
        with self._pinned_slot(adapter) as slot:
            if self.max_batch_size > 1 and key is not None:
                outputs = self._batched(list(prompt_ids), params, slot, key)
            else:
                tag = f"generate:{profiling.purpose()}"
                with self._lock, self._model(slot) as model, profiling.phase(tag) as ph:
                    prefix = self._prefix_of(slot)
                    outputs = sampling.generate(model, self.tokenizer, prompt_ids, params, prefix=prefix)
                    ph["tokens"] = sum(len(o.token_ids) for o in outputs)
                    self._count(1)
        for out in outputs:
            out.adapter_version = None if slot is None else slot.version
        return outputs

    def _prefix_of(self, slot: LoadedAdapter | None) -> tuple[PrefixCache, str | None] | None:
        """The prefix cache and this model's key in it (the adapter version's internal name; None: the base)."""
        return None if self.prefix is None else (self.prefix, None if slot is None else slot.internal)

    def _count(self, size: int) -> None:
        self._queue.batches[size] = self._queue.batches.get(size, 0) + 1

    def _batched(
        self, prompt_ids: list[int], params: SamplingParams, slot: LoadedAdapter | None, key: tuple
    ) -> list[SequenceOutput]:
        """Queue the request; whoever holds the model lock next samples it with the compatible ones waiting."""
        mine = _Pending(prompt_ids, params, (None if slot is None else slot.internal, key))
        with self._queue.arrived:
            self._queue.pending.append(mine)
            self._queue.arrivals += 1
            self._queue.arrived.notify_all()
        with self._lock:
            if not mine.done.is_set():  # nobody took it yet: lead a batch
                with self._queue.arrived:
                    self._linger(mine.key)
                    batch = [mine] + [p for p in self._queue.pending if p is not mine and p.key == mine.key]
                    batch = batch[: self.max_batch_size]
                    for p in batch:
                        self._queue.pending.remove(p)

                def work() -> list[list[SequenceOutput]]:
                    prefix = self._prefix_of(slot)
                    with self._model(slot) as model, profiling.phase(f"generate:{profiling.purpose()}") as ph:
                        outs = sampling.generate_batch(
                            model, self.tokenizer, [p.prompt_ids for p in batch], [p.params for p in batch], prefix
                        )
                        ph["tokens"] = sum(len(o.token_ids) for o in outs)
                    self._count(len(batch))
                    with self._queue.arrived:
                        self._queue.last_batch = (time.monotonic(), self._queue.arrivals, len(batch))
                    return [[out] for out in outs]

                _settle(batch, work)
        return _outcome(mine)

    def _linger(self, key: tuple) -> None:
        """Under `_arrived`: wait for the turns the last batch answered (the module docstring), at most until
        `batch_linger_s` after its end, and never once a batch of `key` is full."""
        if self._queue.linger_s <= 0 or self._queue.last_batch is None:
            return
        end, seen, size = self._queue.last_batch
        left = end + self._queue.linger_s - time.monotonic()
        if left <= 0:
            return
        with profiling.phase("batch_linger", cpu="thread"):
            self._queue.arrived.wait_for(
                lambda: (
                    self._queue.arrivals - seen >= size
                    or sum(p.key == key for p in self._queue.pending) >= self.max_batch_size
                ),
                timeout=left,
            )

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None) -> TokenStream:
        params = checked_params(prompt_ids, params, self.max_seq_len)
        if params.n != 1:
            raise ValueError("streaming samples one sequence at a time (n=1)")
        return _HFTokenStream(self, list(prompt_ids), params, adapter)

    # ---------------------------------------------------------------- scoring

    @torch.no_grad()
    def score_tokens(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        adapter: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[TokenScore]:
        ids = scoring_ids(prompt_ids, target_ids, self.max_seq_len)
        if not target_ids:
            return []
        dist = Dist.of(temperature, top_p, top_k)
        with self._pinned_slot(adapter) as slot:
            if self.max_batch_size > 1:
                key = None if slot is None else slot.internal
                return self._score_batched(_PendingScore(ids, len(target_ids), dist, key), slot)
            x = torch.tensor([ids], device=self.device)
            with self._lock, self._model(slot) as model, profiling.phase(f"score:{profiling.purpose()}") as ph:
                logits = model(input_ids=x, use_cache=False, logits_to_keep=len(target_ids) + 1).logits
                ph["tokens"] = len(ids)
                self._queue.score_batches[1] = self._queue.score_batches.get(1, 0) + 1
        return _token_scores(logits[0, :-1], target_ids, dist)

    def _score_batched(self, mine: _PendingScore, slot: LoadedAdapter | None) -> list[TokenScore]:
        """Queue the score request; whoever holds the model lock next scores it with the others waiting for the
        same model in one left-padded forward (padding masked, positions from the mask, as `generate_batch`).

        A batch takes up to `max_batch_size` requests, in arrival order, while it keeps no more logit rows than
        one request of `max_seq_len` tokens would (batch size x the longest target + 1 <= `max_seq_len`): the
        logits [B, longest target + 1, vocab] grow with the batch. Each row's logprobs are its own sequence's under
        its own distribution (the ratio-is-1 tests hold them to the unbatched score within 1e-4)."""
        with self._queue.lock:
            self._queue.scoring.append(mine)
        with self._lock:
            if not mine.done.is_set():  # nobody took it yet: lead a batch
                with self._queue.lock:
                    batch, keep = [mine], mine.n_target + 1
                    for p in self._queue.scoring:
                        if len(batch) >= self.max_batch_size:
                            break
                        wider = max(keep, p.n_target + 1)
                        if p is not mine and p.key == mine.key and (len(batch) + 1) * wider <= self.max_seq_len:
                            batch.append(p)
                            keep = wider
                    for p in batch:
                        self._queue.scoring.remove(p)

                def work() -> list[list[TokenScore]]:
                    with self._model(slot) as model, profiling.phase(f"score:{profiling.purpose()}") as ph:
                        logits = self._score_forward(model, [p.ids for p in batch], keep)
                        ph["tokens"] = sum(len(p.ids) for p in batch)
                    self._queue.score_batches[len(batch)] = self._queue.score_batches.get(len(batch), 0) + 1
                    return [_token_scores(row[keep - p.n_target - 1 : keep - 1], p.ids[-p.n_target :], p.dist)
                            for row, p in zip(logits, batch, strict=True)]  # fmt: skip

                _settle(batch, work)
        return _outcome(mine)

    def _score_forward(self, model: nn.Module, rows: list[list[int]], keep: int) -> torch.Tensor:
        """The last `keep` positions' logits [B, keep, V] of each row (one row: unpadded, as unbatched)."""
        if len(rows) == 1:
            x = torch.tensor(rows, device=self.device)
            return model(input_ids=x, use_cache=False, logits_to_keep=keep).logits
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        x, mask = sampling.left_pad(rows, pad or 0, self.device)
        return model(input_ids=x, attention_mask=mask, position_ids=sampling.mask_positions(mask), use_cache=False,
                     logits_to_keep=keep).logits  # fmt: skip

    def close(self) -> None:
        """Nothing to stop: the engine owns no threads between requests."""


class _HFTokenStream(TokenStream):
    """Runs `sampling.generate` in a thread with a `TokenLogprobStreamer`; iterating yields its tokens."""

    def __init__(self, engine: HFEngine, prompt_ids: list[int], params: SamplingParams, adapter: str | None) -> None:
        self._engine, self._prompt_ids, self._params = engine, prompt_ids, params
        self._pin = engine._pinned_slot(adapter)
        slot = self._pin.__enter__()  # raises UnknownAdapterError before any thread starts
        self._slot = slot
        self.adapter_version = None if slot is None else slot.version
        self._streamer = sampling.TokenLogprobStreamer(params)
        self._error: BaseException | None = None
        self._done = False
        self._thread = threading.Thread(target=self._run, name="hf-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            engine = self._engine
            with engine._lock, engine._model(self._slot) as model, profiling.phase("generate:stream") as ph:
                outputs = sampling.generate(
                    model, self._engine.tokenizer, self._prompt_ids, self._params, streamer=self._streamer,
                    prefix=engine._prefix_of(self._slot),
                )  # fmt: skip
                ph["tokens"] = len(outputs[0].token_ids)
            self.output = outputs[0]
            self.output.adapter_version = self.adapter_version
            self.finish_reason = self.output.finish_reason
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread
            self._error = exc
        finally:
            self._streamer.queue.put(None)
            self._pin.__exit__(None, None, None)

    def __next__(self) -> TokenDelta:
        if not self._done:
            item = self._streamer.queue.get()
            if item is not None:
                return TokenDelta(*item)
            self._done = True
            self._thread.join()
        if self._error is not None:
            raise self._error
        raise StopIteration

    def close(self) -> None:
        self._streamer.cancelled.set()
