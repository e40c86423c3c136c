"""Datums of different lengths → one right-padded `[B, T]` batch for a single forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from metaclaw.training_server.errors import bad_request
from metaclaw.training_server.schemas import Datum


@dataclass
class TrainBatch:
    """Tensors every policy loss takes, all `[B, T]` (padding: attention_mask 0, mask 0).

    Attributes:
        input_ids: `model_input_tokens`, padded.
        target_ids: `target_tokens` (the token after each input position), padded.
        attention_mask: 1 on real positions.
        behaviour_logprobs: the sampler's logprobs of `target_ids`.
        advantages: per-token advantages.
        mask: loss weights (1.0 on trained tokens).
    """

    input_ids: Tensor
    target_ids: Tensor
    attention_mask: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    mask: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{k: v.to(device) for k, v in self.__dict__.items()})


def check_tokens(tokens: Sequence[int], vocab_size: int, field: str) -> None:
    """400 naming `field` when a token id is outside `[0, vocab_size)`."""
    for i, tok in enumerate(tokens):
        if tok >= vocab_size:
            raise bad_request(f"{field}[{i}] = {tok} is outside the vocabulary (size {vocab_size})", field)


def collate(datums: Sequence[Datum], vocab_size: int, max_seq_len: int, pad_id: int = 0) -> TrainBatch:
    """Validate against the model (vocabulary, length) and pad to the longest datum."""
    for i, d in enumerate(datums):
        if len(d.model_input_tokens) > max_seq_len:
            raise bad_request(
                f"datums.{i}.model_input_tokens has {len(d.model_input_tokens)} tokens, above the model's "
                f"max_seq_len {max_seq_len}",
                f"datums.{i}.model_input_tokens",
            )
        check_tokens(d.model_input_tokens, vocab_size, f"datums.{i}.model_input_tokens")
        check_tokens(d.target_tokens, vocab_size, f"datums.{i}.target_tokens")
    width = max(len(d.model_input_tokens) for d in datums)
    rows = len(datums)

    def padded(values: Sequence[Sequence[float]], dtype: torch.dtype, fill: float) -> Tensor:
        out = torch.full((rows, width), fill, dtype=dtype)
        for i, row in enumerate(values):
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        return out

    inputs = padded([d.model_input_tokens for d in datums], torch.long, pad_id)
    return TrainBatch(
        input_ids=inputs,
        target_ids=padded([d.target_tokens for d in datums], torch.long, 0),
        attention_mask=padded([[1] * len(d.model_input_tokens) for d in datums], torch.long, 0),
        behaviour_logprobs=padded([d.logprobs for d in datums], torch.float32, 0.0),
        advantages=padded([d.advantages for d in datums], torch.float32, 0.0),
        mask=padded([d.loss_mask() for d in datums], torch.float32, 0.0),
    )
