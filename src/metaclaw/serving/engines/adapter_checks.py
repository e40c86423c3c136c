"""What vLLM would accept and then silently serve as the base model: checked before an adapter is loaded.

vLLM issue 34186: an adapter whose weight names do not match the model's module paths (a different prefix, e.g.
trained on a wrapper that nests the language model under `language_model.`) loads with 200 OK and changes
nothing. vLLM issue 55193: an adapter whose `target_modules` the server does not wrap (`--lora-target-modules`)
does the same. Both are refused here, with the names, before the server is asked; the HTTP engine also probes
after the load that the adapter changes a logprob (`metaclaw.serving.engines.vllm_http`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from safetensors import safe_open

from metaclaw.serving.engines.base import AdapterError
from metaclaw.wire import ADAPTER_CONFIG, ADAPTER_WEIGHTS

# PEFT's saved names: base_model.model.<module path>.lora_A.weight (or lora_B / lora_embedding_A ...)
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?:embedding_)?[AB](?:\.weight)?$")


def check_targets(directory: Path, wrapped: Iterable[str]) -> None:
    """Refuse an adapter that adapts modules the server does not wrap (vLLM would serve it without them)."""
    try:
        targets = json.loads((directory / ADAPTER_CONFIG).read_text()).get("target_modules")
    except (OSError, ValueError, AttributeError) as exc:
        raise AdapterError(f"cannot read {ADAPTER_CONFIG} in {str(directory)!r}: {exc}") from exc
    if isinstance(targets, str):  # a PEFT regex or "all-linear": vLLM matches it against what it wraps
        return
    wrapped = frozenset(wrapped)
    extra = sorted(set(targets or ()) - wrapped)
    if extra:
        raise AdapterError(
            f"the adapter in {str(directory)!r} adapts {extra}, which this server does not wrap "
            f"(backend.lora_target_modules: {sorted(wrapped)})"
        )


def model_weight_names(model_dir: str | Path) -> frozenset[str]:
    """Every weight name of a local Hugging Face model directory (its safetensors files' headers only)."""
    names: set[str] = set()
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


def check_module_names(directory: Path, weight_names: frozenset[str]) -> None:
    """Refuse an adapter whose LoRA weights name modules the model does not have (vLLM issue 34186).

    Each `base_model.model.<path>.lora_A.weight` must adapt a linear layer the model has (`<path>.weight`).
    `weight_names` empty (a model without safetensors, e.g. from a GGUF file): nothing to compare against."""
    if not weight_names:
        return
    with safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as f:
        keys = list(f.keys())
    modules = {m.group("module") for m in map(_LORA_KEY.match, keys) if m}
    unknown = sorted(m for m in modules if f"{m}.weight" not in weight_names)
    if not modules or unknown:
        sample = ", ".join(unknown[:3]) if unknown else "no PEFT LoRA weight (base_model.model.<module>.lora_A)"
        have = next((n for n in sorted(weight_names) if n.endswith("proj.weight")), next(iter(weight_names)))
        raise AdapterError(
            f"the adapter in {str(directory)!r} adapts modules the model does not have ({len(unknown)} of "
            f"{len(modules)}: {sample}; the model's names look like {have!r}): vLLM would load it and serve the "
            "base model unchanged (vLLM issue 34186). Save the adapter from the model it is served with."
        )
