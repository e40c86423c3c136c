"""Merged-adapter serving for the HF engine: each adapter version as a copy of the base with the LoRA folded in.

A generation then runs plain `nn.Linear`s (no extra low-rank matmuls per layer), and a hot-load builds the new
copy beside the running generations: serving it is a pointer flip in the adapter registry. Only the weights the
adapter targets are the copy's own; every other tensor (embeddings, norms, head) is shared with the base.

`MergedSlots` is the double buffer: a plain LoRA (`W + s·B·A` on `nn.Linear`s, `s = alpha / r` or `alpha / √r`
with rsLoRA) is written in place into a copy no request uses any more (one `addmm` per weight: no allocation, no
PEFT wrapping), so after the first two loads a swap costs two passes over the adapted weights. Any other LoRA
(DoRA, per-module rank or alpha patterns, LoRA biases, non-Linear targets) goes through PEFT's own
`merge_and_unload` on a fresh copy (`merged_copy`): slower, same result.
"""

from __future__ import annotations

import copy
import re
import threading
from typing import Any

import torch
from peft import LoraConfig, PeftModel, set_peft_model_state_dict
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

from metaclaw.serving.engines.base import AdapterError

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def _copy_with_own(base: nn.Module, own: set[int], fill: bool = True) -> nn.Module:
    """A copy of `base`'s module tree sharing every parameter and buffer except the Linear weights whose id is in
    `own`, which get tensors of their own (copies of the base's with `fill`, else uninitialised).

    Safe beside running generations: a forward or `generate` only reads the module tree of a plain model (merged
    serving never calls PEFT's `set_adapter` on it), and the copy takes no tensor but the ones it owns."""
    shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}
    tree = copy.deepcopy(base, memo=shared)
    for module in tree.modules():
        if isinstance(module, nn.Linear) and id(module.weight) in own:
            weight = module.weight.detach()
            module.weight = nn.Parameter(weight.clone() if fill else torch.empty_like(weight), requires_grad=False)
    return tree


def merged_copy(
    base: nn.Module,
    config: LoraConfig,
    state: dict[str, torch.Tensor],
    path: str = "",
) -> nn.Module:
    """A copy of `base` with the LoRA `(config, state)` merged into its weights by PEFT; `base` is left untouched."""
    targets = {
        id(module.weight)
        for name, module in base.named_modules()
        if isinstance(module, nn.Linear) and check_target_module_exists(config, name)
    }
    peft = PeftModel(_copy_with_own(base, targets), copy.deepcopy(config), adapter_name="merge")
    result: Any = set_peft_model_state_dict(peft, state, adapter_name="merge")  # load_state_dict's named tuple
    missing = [k for k in result.missing_keys if ".merge." in k and "lora_" in k]
    if result.unexpected_keys or missing:
        raise AdapterError(f"adapter {path!r} does not fit the base model: {(result.unexpected_keys or missing)[:3]}")
    return peft.merge_and_unload().eval()


def plain_lora(
    base: nn.Module, config: LoraConfig, state: dict[str, torch.Tensor], path: str = ""
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None:
    """`{module name: (A [r, in], B [out, r], scale)}` when the adapter is a plain LoRA on `nn.Linear`s that fits
    `base`; None when it needs PEFT's merge (DoRA, patterns, biases, other layer types)."""
    if config.use_dora or config.rank_pattern or config.alpha_pattern or getattr(config, "lora_bias", False):
        return None
    if config.fan_in_fan_out:
        return None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.match(key)
        if match is None:
            return None  # anything else (embeddings, magnitudes, modules_to_save): PEFT knows
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    modules = dict(base.named_modules())
    plan = {}
    for name, ab in pairs.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear) or set(ab) != {"A", "B"}:
            return None
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if b.shape[1] != rank or (b.shape[0], a.shape[1]) != tuple(module.weight.shape):
            raise AdapterError(f"adapter {path!r} does not fit the base model: {name} is {tuple(module.weight.shape)}")
        scale = config.lora_alpha / (rank**0.5 if config.use_rslora else rank)
        plan[name] = (a.to(module.weight.dtype), b.to(module.weight.dtype), float(scale))
    return plan or None


class MergedSlots:
    """Merged copies of `base`, recycled: a copy no request uses any more takes the next adapter in place.

    Args:
        base: the base model (never written to).
        spare: free copies kept for the next load (more are dropped: memory is one copy of the adapted weights).
    """

    def __init__(self, base: nn.Module, spare: int = 1) -> None:
        self.base, self.spare = base, spare
        self._free: dict[frozenset[str], list[nn.Module]] = {}
        self._kind: dict[int, frozenset[str]] = {}  # id(copy) -> the adapted modules, for copies made here
        self._lock = threading.Lock()

    def build(self, config: LoraConfig, state: dict[str, torch.Tensor], path: str = "") -> nn.Module:
        """The base with this adapter merged in, built without touching any copy a request may be using."""
        plan = plain_lora(self.base, config, state, path)
        if plan is None:
            return merged_copy(self.base, config, state, path)
        kind = frozenset(plan)
        with self._lock:
            free = self._free.get(kind) or []
            model = free.pop() if free else None
        modules = dict(self.base.named_modules())
        if model is None:
            model = _copy_with_own(self.base, {id(modules[name].weight) for name in plan}, fill=False).eval()
            with self._lock:
                self._kind[id(model)] = kind
        own = dict(model.named_modules())
        with torch.no_grad():
            for name, (a, b, scale) in plan.items():
                torch.addmm(modules[name].weight, b, a, alpha=scale, out=own[name].weight.data)
        return model

    def recycle(self, model: nn.Module) -> None:
        """`model` serves no request any more: keep it for the next load (up to `spare` copies)."""
        with self._lock:
            kind = self._kind.get(id(model))
            if kind is None:
                return
            free = self._free.setdefault(kind, [])
            if len(free) < self.spare:
                free.append(model)
            else:
                del self._kind[id(model)]
