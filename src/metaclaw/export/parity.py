"""Logprob parity: an export must give the tokens the served adapter's logprobs.

The reference is the adapter as the HF engine serves it (`serving.engines.hf.read_adapter`, then a `PeftModel`
over the fp32 base, unmerged), scored at temperature 1 on a fixed set of chat prompts and replies. An export is
scored the same way through the library a user would load it with, and the per-token differences are reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, set_peft_model_state_dict

from metaclaw.modules.loading import ModelSpec

__all__ = ["PROBES", "compare", "llama_cpp_parity", "reply_logprobs", "served_model"]

#: (messages, reply) pairs scored by every parity check: short chat turns of the kinds an agent sees.
PROBES: list[tuple[list[dict[str, str]], str]] = [
    ([{"role": "user", "content": "What is the capital of France?"}], "Paris is the capital of France."),
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "Write a haiku about the sea."}],
     "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ([{"role": "user", "content": "How many grams are in a kilogram?"}], "There are 1000 grams in a kilogram."),
    ([{"role": "user", "content": "Give me three tips for debugging."},
      {"role": "assistant", "content": "Sure."},
      {"role": "user", "content": "Shorter please."}], "Reproduce it, read the error, bisect."),
    ([{"role": "user", "content": "def add(a, b): what does this do?"}], "It returns the sum of a and b."),
]  # fmt: skip


def encode(tokenizer: Any, messages: list[dict[str, str]], reply: str) -> tuple[list[int], int]:
    """Prompt + reply token ids and where the reply starts (the chat template's generation prompt first)."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    return prompt_ids + reply_ids, len(prompt_ids)


@torch.no_grad()
def reply_logprobs(model: torch.nn.Module, tokenizer: Any,
                   probes: Sequence[tuple[list[dict[str, str]], str]] = PROBES) -> list[torch.Tensor]:  # fmt: skip
    """Per-token logprobs (fp32, temperature 1) of each probe's reply tokens under `model`."""
    out = []
    device = next(model.parameters()).device
    for messages, reply in probes:
        ids, start = encode(tokenizer, messages, reply)
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()
        logp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
        out.append(logp.gather(-1, x[0, start:].unsqueeze(-1)).squeeze(-1).cpu())
    return out


def compare(reference: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> dict[str, float | int]:
    """Max and mean absolute per-token difference over every probe's reply tokens."""
    diffs = torch.cat([(a.double() - b.double()).abs() for a, b in zip(reference, other, strict=True)])
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()), "tokens": int(diffs.numel())}


def served_model(spec: ModelSpec, adapter_dir: str | Path) -> PeftModel:
    """The adapter as the HF engine serves it: read (JSON + safetensors), then a `PeftModel` over the fp32 base."""
    from metaclaw.serving.engines.hf import read_adapter

    config, state = read_adapter(adapter_dir)
    base = spec.load_model("cpu").float().eval()
    model = PeftModel(base, config, adapter_name="served")
    result = set_peft_model_state_dict(model, state, adapter_name="served")
    if result.unexpected_keys:
        raise ValueError(f"adapter {adapter_dir} has keys the base model lacks: {result.unexpected_keys[:3]}")
    return model.eval()


def llama_cpp_parity(spec: ModelSpec, adapter_dir: str | Path, base_gguf: Path, lora_gguf: Path,
                     probes: Sequence[tuple[list[dict[str, str]], str]] = PROBES) -> dict[str, Any]:  # fmt: skip
    """The LoRA's effect in llama.cpp against its effect here: per-token (with − without adapter) logprob deltas.

    The base GGUF is usually quantised (SmolLM2 ships Q4_1) while the served base is its fp32 de-quantisation, so
    absolute logprobs differ by the quantisation; what the adapter changes is compared instead. Needs
    `llama-cpp-python` (an optional install: it compiles llama.cpp).
    """
    import numpy as np
    from llama_cpp import Llama

    tokenizer = spec.load_tokenizer()
    base = reply_logprobs(spec.load_model("cpu").float().eval(), tokenizer, probes)
    served = reply_logprobs(served_model(spec, adapter_dir), tokenizer, probes)

    def run(lora: Path | None) -> list[torch.Tensor]:
        llm = Llama(model_path=str(base_gguf), lora_path=str(lora) if lora else None, logits_all=True, n_ctx=512,
                    n_threads=2, verbose=False, seed=0)  # fmt: skip
        out = []
        for messages, reply in probes:
            ids, start = encode(tokenizer, messages, reply)
            llm.reset()
            llm.eval(ids)
            logits = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
            logp = torch.log_softmax(logits[start - 1 : -1].double(), dim=-1).float()
            out.append(logp.gather(-1, torch.tensor(ids[start:]).unsqueeze(-1)).squeeze(-1))
        del llm
        return out

    cpp_base, cpp_lora = run(None), run(lora_gguf)
    ours = [s - b for s, b in zip(served, base, strict=True)]
    theirs = [s - b for s, b in zip(cpp_lora, cpp_base, strict=True)]
    effect = torch.cat([d.abs() for d in ours])
    corr = torch.corrcoef(torch.stack([torch.cat(ours).double(), torch.cat(theirs).double()]))[0, 1]
    return {"check": "llama.cpp (base GGUF + GGUF LoRA) vs served: the adapter's per-token logprob change",
            **compare(ours, theirs), "adapter_effect_mean_abs": float(effect.mean()),
            "delta_correlation": float(corr),
            "base_gap_mean_abs": compare(base, cpp_base)["mean_abs_diff"]}  # fmt: skip
