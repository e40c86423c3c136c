"""Sampling with transformers `generate`, returning token ids, behaviour logprobs and the real finish reason.

Behaviour logprobs are `log softmax(logits / temperature)` of each sampled token, the distribution the trainer
recomputes (`metaclaw.modules.policy.token_logprobs` with the sample's temperature). top-k/top-p truncation
is applied when sampling but not folded into the reported logprobs (as with vLLM's default logprobs mode).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer


@dataclass
class SamplingParams:
    """What a request may set; validated by `validate()` (raises ValueError naming the field)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 16:
            raise ValueError(f"n must be an integer in [1, 16], got {self.n!r}")


@dataclass
class SequenceOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos or stop string) | "length"
    adapter_version: int | None = None  # set by engines: which adapter version sampled it (None: base)


class TokenQueueStreamer(BaseStreamer):
    """Pushes each newly generated token id (first sequence) into a queue; `None` marks the end."""

    def __init__(self) -> None:
        self.queue: queue.Queue[int | None] = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first sends the prompt
            self._prompt_seen = True
            return
        for tok in value.reshape(-1).tolist()[:1]:
            self.queue.put(int(tok))

    def end(self) -> None:
        self.queue.put(None)


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

    The logprob is `log softmax(logits / temperature)` of the sampled token (the same value `generate` reports
    afterwards). Setting `cancelled` stops generation at the next step (a client that went away).
    """

    def __init__(self, temperature: float) -> None:
        self.queue: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self.scale = temperature if temperature > 0 else 1.0
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
        lp = float("nan") if scores is None else float(torch.log_softmax(scores.float() / self.scale, -1)[tok])
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


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    streamer: BaseStreamer | None = None,
) -> list[SequenceOutput]:
    """Sample `params.n` continuations of `prompt_ids` with the model as it is now (adapter included)."""
    params.validate()
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids)], device=device)
    eos = [tokenizer.eos_token_id, *params.stop_token_ids]
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and gen_cfg.eos_token_id is not None:
        eos += gen_cfg.eos_token_id if isinstance(gen_cfg.eos_token_id, list) else [gen_cfg.eos_token_id]
    eos = sorted({e for e in eos if e is not None})
    greedy = params.temperature == 0
    if params.seed is not None:
        torch.manual_seed(params.seed)
    kwargs = dict(
        max_new_tokens=params.max_tokens,
        do_sample=not greedy,
        num_return_sequences=params.n,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=torch.ones_like(input_ids),
        streamer=streamer,
        use_cache=True,
    )
    if not greedy:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if params.stop:
        kwargs.update(stop_strings=list(params.stop), tokenizer=tokenizer)
    if isinstance(streamer, TokenLogprobStreamer):
        kwargs.update(
            logits_processor=LogitsProcessorList([streamer.recorder]),
            stopping_criteria=StoppingCriteriaList([streamer.stopper]),
        )
    out = model.generate(input_ids, **kwargs)
    scale = 1.0 if greedy else params.temperature
    new = out.sequences[:, input_ids.shape[1] :]
    logits = torch.stack(out.logits, dim=1).float() / scale  # [n, T_new, V]
    lps = torch.gather(logits.log_softmax(-1), -1, new.unsqueeze(-1)).squeeze(-1)
    results = []
    for row, row_lp in zip(new.tolist(), lps.tolist(), strict=True):
        finish, end = "length", len(row)
        for i, tok in enumerate(row):
            if tok in eos:
                finish, end = "stop", i + 1
                break
        if params.stop:
            cut = _truncate_at_stop(
                lambda ids: tokenizer.decode(ids, skip_special_tokens=False), row[:end], params.stop
            )
            if cut is not None:
                finish, end = "stop", cut
        results.append(SequenceOutput(token_ids=row[:end], logprobs=row_lp[:end], finish_reason=finish))
    return results
