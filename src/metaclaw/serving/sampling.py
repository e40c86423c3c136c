"""Sampling with transformers `generate`, returning token ids, behaviour logprobs and the real finish reason.

One distribution (`metaclaw.distribution`): each sampled token's behaviour logprob is taken with
`token_logprobs` under the `Dist` of the request, as the trainer, the teacher and the vLLM engine take it, so the
on-policy ratio is 1.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable, Sequence
from typing import Any, cast

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from metaclaw.distribution.logprobs import token_logprobs, top_logprobs
from metaclaw.serving.prefix_cache import LayerKV, PrefixCache
from metaclaw.wire.sampling import SamplingParams, SequenceOutput  # noqa: F401 - re-exported for the engines


class _ScoreRecorder(LogitsProcessor):
    """Keeps the latest next-token scores of row 0 (custom processors run before the temperature warper)."""

    def __init__(self) -> None:
        self.latest: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.latest = scores[0].detach()
        return scores


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class TokenLogprobStreamer(BaseStreamer):
    """Streams `(token_id, logprob)` of the first sequence as it is sampled; `None` marks the end.

    The logprob is the sampled token's under the tempered, truncated distribution (`token_logprobs`, the same
    value `generate` reports afterwards). Setting `cancelled` stops generation at the next step (a client that
    went away).
    """

    def __init__(self, params: SamplingParams) -> None:
        self.queue: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self.dist = params.distribution()
        self.recorder = _ScoreRecorder()
        self.cancelled = threading.Event()
        self.stopper = _Cancelled(self.cancelled)
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first sends the prompt
            self._prompt_seen = True
            return
        tok = int(value.reshape(-1)[0])
        scores = self.recorder.latest
        if scores is None:
            lp = float("nan")
        else:  # the token's index where the scores are (a GPU's: a CPU index there raised, found on an H100)
            lp = float(token_logprobs(scores[None], torch.tensor([tok], device=scores.device), *self.dist)[0])
        self.queue.put((tok, lp))

    def end(self) -> None:
        self.queue.put(None)


def _truncate_at_stop(text_of, token_ids: list[int], stops: Sequence[str]) -> int | None:
    """Index just past the first token at which a stop string has appeared in the decoded text."""
    for i in range(1, len(token_ids) + 1):
        text = text_of(token_ids[:i])
        if any(s and s in text for s in stops):
            return i
    return None


def _eos_ids(model: nn.Module, tokenizer, params: SamplingParams) -> list[int]:
    eos = [tokenizer.eos_token_id, *params.stop_token_ids]
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and gen_cfg.eos_token_id is not None:
        eos += gen_cfg.eos_token_id if isinstance(gen_cfg.eos_token_id, list) else [gen_cfg.eos_token_id]
    return sorted({e for e in eos if e is not None})


def _generate_kwargs(tokenizer, params: SamplingParams, eos: list[int], max_new_tokens: int) -> dict:
    greedy = params.temperature == 0
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        num_return_sequences=params.n,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
        output_logits=True,
        return_dict_in_generate=True,
        use_cache=True,
    )
    if not greedy:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if params.stop:
        kwargs.update(stop_strings=list(params.stop), tokenizer=tokenizer)
    return kwargs


def top_rows(logits: torch.Tensor, params: SamplingParams) -> list[list[list[tuple[int, float]]]] | None:
    """Each row's `params.top_logprobs` most likely tokens `(id, logprob)` at each position of `[n, T, V]` raw
    logits, under the request's distribution (`top_logprobs`: the one the tokens were drawn from); None when not
    asked."""
    if not params.top_logprobs:
        return None
    ids, lps = top_logprobs(logits, params.top_logprobs, *params.distribution())
    return [[list(zip(i, lp, strict=True)) for i, lp in zip(ri, rl, strict=True)]
            for ri, rl in zip(ids.tolist(), lps.tolist(), strict=True)]  # fmt: skip


def finish(
    tokenizer, row: list[int], row_lp: list[float], eos: list[int], params: SamplingParams,
    row_top: list[list[tuple[int, float]]] | None = None,
) -> SequenceOutput:  # fmt: skip
    """Cut a generated row at its own `max_tokens`, its first end token or stop string; the finish reason.
    `row_top`: the row's top logprobs per position (`top_rows`), cut with it and kept to `params.top_logprobs`."""
    row, row_lp = row[: params.max_tokens], row_lp[: params.max_tokens]
    finish, end = "length", len(row)
    for i, tok in enumerate(row):
        if tok in eos:
            finish, end = "stop", i + 1
            break
    if params.stop:
        cut = _truncate_at_stop(lambda ids: tokenizer.decode(ids, skip_special_tokens=False), row[:end], params.stop)
        if cut is not None:
            finish, end = "stop", cut
    top = None if row_top is None or not params.top_logprobs else [t[: params.top_logprobs] for t in row_top[:end]]
    return SequenceOutput(token_ids=row[:end], logprobs=row_lp[:end], finish_reason=finish, top_logprobs=top)


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    streamer: BaseStreamer | None = None,
    prefix: tuple[PrefixCache, Hashable] | None = None,
) -> list[SequenceOutput]:
    """Sample `params.n` continuations of `prompt_ids` with the model as it is now (adapter included); `prefix`
    as in `generate_batch` (one continuation only: `n` > 1 reads the whole prompt)."""
    params.validate()
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids)], device=device)
    eos = _eos_ids(model, tokenizer, params)
    if params.seed is not None:
        torch.manual_seed(params.seed)
    kwargs = _generate_kwargs(tokenizer, params, eos, params.max_tokens)
    kwargs.update(attention_mask=torch.ones_like(input_ids), streamer=streamer)
    if isinstance(streamer, TokenLogprobStreamer):
        kwargs.update(
            logits_processor=LogitsProcessorList([streamer.recorder]),
            stopping_criteria=StoppingCriteriaList([streamer.stopper]),
        )
    salts = [params.cache_salt]
    reuse = prefix if params.n == 1 else None
    cache = _prefilled(model, [prompt_ids], len(prompt_ids), reuse, salts) if reuse is not None else None
    if cache is not None:
        kwargs["past_key_values"] = cache
    out = model.generate(input_ids, **kwargs)
    new = out.sequences[:, input_ids.shape[1] :]
    logits = torch.stack(out.logits, dim=1)  # raw logits [n, T_new, V]
    lps = token_logprobs(logits, new, *params.distribution())
    tops: list[Any] = top_rows(logits, params) or [None] * len(new)
    rows = zip(new.tolist(), lps.tolist(), tops, strict=True)
    outputs = [finish(tokenizer, row, lp, eos, params, top) for row, lp, top in rows]
    if cache is not None and prefix is not None:
        _keep(prefix, [prompt_ids], outputs, len(prompt_ids), out.past_key_values, salts)
    return outputs


def left_pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, mask)` [B, longest]: each row's tokens at the right end, `pad` before them, masked out (mask 0)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(list(r), device=device)
        mask[i, width - len(r) :] = 1
    return ids, mask


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that follow the attention mask: each row's first real token is position 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def batch_key(params: SamplingParams) -> tuple | None:
    """Requests with equal keys can share one `generate_batch` call (their `max_tokens` may differ); None: this
    request runs alone (`n` > 1, or a `seed`, whose draws must not depend on what else is in the batch)."""
    if params.n != 1 or params.seed is not None:
        return None
    return (params.temperature, params.top_p, params.top_k, tuple(params.stop), tuple(params.stop_token_ids))


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    prefix: tuple[PrefixCache, Hashable] | None = None,
) -> list[SequenceOutput]:
    """One left-padded `generate` for several requests with the same `batch_key`: one output per request.

    Padding is masked out (positions follow the attention mask), so each row's logits are its own prompt's, and
    each row's behaviour logprobs are taken with `token_logprobs` under the shared distribution exactly as
    `generate` does. Rows run to the longest `max_tokens` and are cut at their own.

    `prefix` = (cache, this model's key in it): each row's prompt but its last token is read on top of the longest
    prefix the cache holds for this model (a conversation's previous turn, the shared system prompt), on its own,
    without padding (rows that no entry helps: together, in one left-padded forward); the rows' keys and values
    are then left-padded into one cache and `generate` reads only the last prompt token of each row. Each row's
    prompt and reply go back into the cache (`metaclaw.serving.prefix_cache`).
    """
    keys = {batch_key(p) for p in params}
    if len(keys) != 1 or None in keys or len(prompts) != len(params) or not prompts:
        raise ValueError("generate_batch needs one or more requests with the same batch_key")
    for p in params:
        p.validate()
    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer, params[0])
    kwargs = _generate_kwargs(tokenizer, params[0], eos, max(p.max_tokens for p in params))
    input_ids, mask = left_pad(prompts, kwargs["pad_token_id"], device)
    width = input_ids.shape[1]
    salts = [p.cache_salt for p in params]
    cache = _prefilled(model, prompts, width, prefix, salts) if prefix is not None else None
    if cache is not None:
        kwargs["past_key_values"] = cache
    out = model.generate(input_ids, attention_mask=mask, **kwargs)
    new = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1)
    lps = token_logprobs(logits, new, *params[0].distribution())
    widest = max(params, key=lambda p: p.top_logprobs)  # the batch shares one distribution (`batch_key`)
    tops: list[Any] = top_rows(logits, widest) or [None] * len(new)
    rows = zip(new.tolist(), lps.tolist(), params, tops, strict=True)
    outputs = [finish(tokenizer, row, lp, eos, p, top) for row, lp, p, top in rows]
    if cache is not None and prefix is not None:
        _keep(prefix, prompts, outputs, width, out.past_key_values, salts)
    return outputs


def _full_attention(model: nn.Module) -> bool:
    """Whether every layer's cache keeps every position (sliding-window layers drop old ones: no reuse there)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config the cache cannot lay out: no reuse
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _prefilled(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    width: int,
    prefix: tuple[PrefixCache, Hashable],
    salts: Sequence[str | None],
) -> DynamicCache | None:
    """The batch's cache of every prompt token but each row's last, left-padded to `width - 1` positions (the
    layout of `generate_batch`'s input ids); None when the model's layers cannot reuse a prefix or a prompt has
    one token (nothing to read ahead)."""
    if min(len(ids) for ids in prompts) < 2 or not _full_attention(model):
        return None
    store, key = prefix
    device, config = next(model.parameters()).device, cast(Any, model).config
    found = [store.lookup(key, ids, len(ids) - 1, salt) for ids, salt in zip(prompts, salts, strict=True)]
    rows: list[list[LayerKV] | None] = [None] * len(prompts)
    cold = [i for i, (known, _) in enumerate(found) if known == 0]
    if len(cold) > 1:  # rows no entry helps: one left-padded forward, as `generate` would read them
        for i, kv in zip(cold, _read_together(model, [list(prompts[i][:-1]) for i in cold], device), strict=True):
            rows[i] = kv
    for i, ids in enumerate(prompts):
        if rows[i] is None:  # on top of its cached prefix, alone, unpadded
            known, cached = found[i]
            alone = DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in cached] if cached else None,
                                 config=config)  # fmt: skip
            if known < len(ids) - 1:
                model(input_ids=torch.tensor([list(ids[known:-1])], device=device), past_key_values=alone,
                      use_cache=True, logits_to_keep=1)  # fmt: skip
            rows[i] = [(k[0], v[0]) for k, v in _layers(alone)]
    read = [row for row in rows if row is not None]
    assert len(read) == len(rows)
    span = width - 1
    layers = []
    for n in range(len(read[0])):
        k0, v0 = read[0][n]
        keys = k0.new_zeros((len(read), k0.shape[0], span, k0.shape[2]))
        values = v0.new_zeros((len(read), v0.shape[0], span, v0.shape[2]))
        for i, row in enumerate(read):
            k, v = row[n]
            keys[i, :, span - k.shape[1] :] = k
            values[i, :, span - v.shape[1] :] = v
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers, config=config)


def _layers(cache: DynamicCache) -> list[LayerKV]:
    """Each layer's (keys, values) [batch, heads, tokens, head_dim] (`_full_attention` models: plain layers)."""
    return [(cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values))
            for layer in cast(list[DynamicLayer], cache.layers)]  # fmt: skip


def _read_together(model: nn.Module, seqs: list[list[int]], device: torch.device) -> list[list[LayerKV]]:
    """Each sequence's keys and values [heads, its length, head_dim] per layer, from one left-padded forward
    (padding masked, positions from the mask, as `generate_batch`)."""
    x, mask = left_pad(seqs, 0, device)
    width = x.shape[1]
    cache = DynamicCache(config=cast(Any, model).config)
    model(input_ids=x, attention_mask=mask, position_ids=mask_positions(mask), past_key_values=cache, use_cache=True,
          logits_to_keep=1)  # fmt: skip
    return [[(k[j, :, width - len(s) :], v[j, :, width - len(s) :]) for k, v in _layers(cache)]
            for j, s in enumerate(seqs)]  # fmt: skip


def _keep(
    prefix: tuple[PrefixCache, Hashable],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[SequenceOutput],
    width: int,
    cache: DynamicCache,
    salts: Sequence[str | None],
) -> None:
    """Store each row's prompt and reply but its last token (never read back) from the finished batch's cache."""
    store, key = prefix
    for i, (ids, out) in enumerate(zip(prompts, outputs, strict=True)):
        start, end = width - len(ids), width + len(out.token_ids) - 1
        kv = [(k[i, :, start:end].clone(), v[i, :, start:end].clone()) for k, v in _layers(cache)]
        store.store(key, list(ids) + out.token_ids[:-1], kv, salts[i])
