"""The trainable policy: a causal LM with a PEFT LoRA adapter, and the per-token logprobs every loss needs."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import Tensor, nn

from metaclaw.atomic import write_dir_atomically

log = logging.getLogger(__name__)

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def token_logprobs(logits: Tensor, target_ids: Tensor, temperature: Tensor | float = 1.0) -> Tensor:
    """Log-probability of each target token under `softmax(logits / temperature)`.

    Args:
        logits: `[B, T, V]` next-token logits.
        target_ids: `[B, T]` the token that follows each position.
        temperature: scalar or `[B]`; the sampler's temperature, so behaviour and training logprobs are over
            the same distribution.

    Returns:
        `[B, T]` float32 logprobs.
    """
    logits = logits.float()
    if isinstance(temperature, Tensor):
        logits = logits / temperature.to(logits).view(-1, 1, 1)
    elif temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, target_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


class LoraPolicy(nn.Module):
    """A base causal LM wrapped with a LoRA adapter; the reference policy is the same model, adapter disabled.

    Args:
        model: a Hugging Face causal LM (its weights are frozen by PEFT).
        rank: LoRA rank `r`.
        alpha: LoRA `alpha` (scaling = alpha / rank).
        dropout: LoRA dropout.
        target_modules: module names to adapt; default: every attention and MLP projection.
        gradient_checkpointing: trade compute for memory; works with PEFT (inputs require grad, embeddings frozen).
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int = 16,
        alpha: int = 32,
        dropout: float = 0.0,
        target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=dropout,
            target_modules=list(target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(model, config)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        self.model.config.use_cache = False

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """`[B, T]` ids → `[B, T, V]` logits."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def logprobs(
        self, input_ids: Tensor, target_ids: Tensor, attention_mask: Tensor, temperature: Tensor | float = 1.0
    ) -> Tensor:
        """`[B, T]` logprob of `target_ids[b, t]` after `input_ids[b, :t+1]`."""
        return token_logprobs(self(input_ids, attention_mask), target_ids, temperature)

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Within this block the policy is the base model (adapter disabled)."""
        with self.model.disable_adapter():
            yield

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}

    def num_parameters(self) -> tuple[int, int]:
        """(trainable, total) parameter counts."""
        total = sum(p.numel() for p in self.parameters())
        return sum(p.numel() for p in self.parameters() if p.requires_grad), total

    def save_adapter(self, directory: str | os.PathLike) -> Path:
        """Write the adapter (safetensors + adapter_config.json) atomically: temp dir, then rename."""
        return write_dir_atomically(
            Path(directory), lambda tmp: self.model.save_pretrained(tmp, safe_serialization=True)
        )

    def load_adapter(self, directory: str | os.PathLike) -> None:
        """Load adapter weights written by `save_adapter` (safetensors only: nothing is unpickled)."""
        state = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
        result = set_peft_model_state_dict(self.model, state)
        if result.unexpected_keys:
            raise ValueError(f"adapter at {directory} has unexpected keys: {result.unexpected_keys[:3]}")
