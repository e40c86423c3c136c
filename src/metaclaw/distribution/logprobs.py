"""The truncated-logprob maths of the sampling distribution (`metaclaw.distribution`), written once.

`token_logprobs` is what the HF engine reports while sampling, what the vLLM engine applies to raw logprobs
(vLLM's `processed_logprobs`), what the trainer and the training server recompute and what a teacher scores under.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from metaclaw.distribution import GREEDY_BELOW, Dist

Param = Tensor | float | int

MASK_ROWS = 256  # positions whose truncation mask is built at once (bounds the [rows, V] sort buffers)


def _rows(value: Param, lead: torch.Size, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A scalar, a per-sample `[B]` or a per-position `lead`-shaped value as one entry per flattened row."""
    t = torch.as_tensor(value, device=device, dtype=dtype)
    if t.dim() == 1 and len(lead) == 2 and t.shape[0] == lead[0]:
        t = t.view(-1, 1)
    return t.expand(lead).reshape(-1)


@torch.no_grad()
def truncation_mask(scaled: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """`[N, V]` bool: the tokens top-k then top-p keep, over temperature-scaled logits (vLLM's and HF's rule).

    top-k keeps the logits >= the k-th largest (ties kept); top-p sorts ascending, removes the tokens whose
    cumulative probability is <= 1 - p and always keeps the most likely one. `top_k <= 0` or `>= V` and
    `top_p >= 1` are off for their row.
    """
    vocab = scaled.shape[-1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    k_on = (top_k > 0) & (top_k < vocab)
    if k_on.any():
        k = torch.where(k_on, top_k, torch.ones_like(top_k)).long()
        kth = scaled.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
        keep &= (scaled >= kth) | ~k_on.unsqueeze(-1)
    p_on = top_p < 1
    if p_on.any():
        rows = p_on.nonzero().squeeze(-1)
        sub = scaled[rows].masked_fill(~keep[rows], float("-inf"))
        ordered, index = sub.sort(dim=-1)
        drop = ordered.softmax(-1).cumsum(-1) <= (1 - top_p[rows]).unsqueeze(-1)
        drop[:, -1] = False
        keep[rows] &= ~torch.zeros_like(drop).scatter(-1, index, drop)
    return keep


def _processed(logits: Tensor, lead: torch.Size, temperature: Param, top_p: Param, top_k: Param,
               always: Tensor | None = None) -> Tensor:  # fmt: skip
    """`[N, V]` float32 logits of the sampling distribution: `logits` (`[..., V]`, `lead` = its leading shape) over
    `temperature`, -inf outside what top-k then top-p keep; the ids in `always` (`[N, K]`) always count as kept."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab).float()
    temp = _rows(temperature, lead, flat.device, flat.dtype)
    scaled = flat / temp.unsqueeze(-1) if bool((temp != 1).any()) else flat
    p = _rows(top_p, lead, flat.device, flat.dtype)
    k = _rows(top_k, lead, flat.device, torch.long)
    if bool((p < 1).any()) or bool(((k > 0) & (k < vocab)).any()):
        detached = scaled.detach()
        parts = [slice(i, i + MASK_ROWS) for i in range(0, detached.shape[0], MASK_ROWS)]
        keep = torch.cat([truncation_mask(detached[s], p[s], k[s]) for s in parts])
        if always is not None:
            keep = keep.scatter_(-1, always, True)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return scaled


def token_logprobs(
    logits: Tensor, target_ids: Tensor, temperature: Param = 1.0, top_p: Param = 1.0, top_k: Param = -1
) -> Tensor:
    """Log-probability of each target token under the distribution the sampler drew it from.

    That is `softmax(logits / temperature)` restricted to the tokens top-k then top-p keep and renormalised
    (vLLM's `processed_logprobs`, and what the HF engine reports). The target token always counts as kept: a
    sampled token was in the kept set, so on-policy nothing changes, and a token that an updated adapter has
    pushed out of the set gets a finite logprob instead of -inf. Gradients flow through `logits`.

    Args:
        logits: `[..., V]` next-token logits (`[B, T, V]` or `[N, V]`).
        target_ids: `[...]` the token that follows each position, or `[..., K]`: K tokens per position (a
            teacher's top-k, `top_logprobs`), each scored under that position's distribution.
        temperature, top_p, top_k: scalars, per-sample `[B]` (for `[B, T, V]` logits) or per-position values,
            as `Dist.of` gives them (greedy is passed as temperature 1 with top-p/top-k off).

    Returns:
        float32 logprobs shaped like `target_ids`.
    """
    lead = logits.shape[:-1]
    targets = target_ids.reshape(lead.numel(), -1)
    scaled = _processed(logits, lead, temperature, top_p, top_k, always=targets)
    picked = scaled.gather(-1, targets)
    return (picked - torch.logsumexp(scaled, dim=-1, keepdim=True)).view(target_ids.shape)


@torch.no_grad()
def top_logprobs(
    logits: Tensor, k: int, temperature: Param = 1.0, top_p: Param = 1.0, top_k: Param = -1
) -> tuple[Tensor, Tensor]:
    """`(ids, logprobs)`, each `[..., k]`: the `k` most likely tokens of each position under the sampling
    distribution (`token_logprobs`'s: tempered, truncated, renormalised over the whole kept set) and their
    logprobs, most likely first. A position that keeps fewer than `k` tokens pads with -inf logprobs."""
    lead = logits.shape[:-1]
    scaled = _processed(logits, lead, temperature, top_p, top_k)
    values, ids = scaled.topk(min(k, scaled.shape[-1]), dim=-1)
    logprobs = values - torch.logsumexp(scaled, dim=-1, keepdim=True)
    return ids.view(*lead, -1), logprobs.view(*lead, -1)


def dist_logprobs(logits: Tensor, target_ids: Tensor, dists: Sequence[Dist]) -> Tensor:
    """`token_logprobs` of `[B, T, V]` logits and `[B, T]` targets with one `Dist` per row (`[B, T]` float32)."""
    temperature, top_p, top_k = (torch.tensor(v) for v in zip(*dists, strict=True))
    return token_logprobs(logits, target_ids, temperature, top_p, top_k)


@torch.no_grad()
def sample_tokens(
    logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Draw one token per row of `[B, V]` next-token logits with a request's sampling settings, and its logprob
    under the distribution it was drawn from (`Dist.of` of the settings).

    The draw is from exactly the distribution `token_logprobs` scores (tempered, top-k then top-p, renormalised);
    temperature 0 is greedy (the argmax), scored as `Dist()` (T = 1, untruncated) like everywhere else. For an
    engine that owns its sampling loop (the ONNX engine): its behaviour logprobs are then μ by construction.

    Returns:
        `(tokens [B] int64, logprobs [B] float32)`.
    """
    flat = logits.float()
    dist = Dist.of(temperature, top_p, top_k)
    if temperature < GREEDY_BELOW:
        tokens = flat.argmax(-1)
        return tokens, token_logprobs(flat, tokens)
    scaled = flat / dist.temperature
    rows = flat.shape[0]
    keep = truncation_mask(scaled, torch.full((rows,), dist.top_p), torch.full((rows,), dist.top_k, dtype=torch.long))
    probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, token_logprobs(flat, tokens, *dist)
