"""Resuming when the set of agents changed: each adapter's optimizer state follows its name, not its position.

The optimizer has one parameter group per adapter (`OnlineRLModule.configure_optimizers`, many agents), and a
checkpoint records the adapter names in group order (`metaclaw_adapters`). When a run resumes with agents added,
removed or reordered in `agents`, `torch.optim.Optimizer.load_state_dict` would refuse the old state (or worse,
give one agent's Adam moments to another); `remap_optimizer_state` rewrites it for the new layout: a kept
adapter keeps its moments, a new one starts fresh, a removed one's state is dropped.

Under DDP every rank must train the same adapter in a step (docs/agents.md, "Several training processes"):
`same_adapter` checks what every rank is about to train and stops the run, naming each rank's adapter, if not.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

ADAPTERS_KEY = "metaclaw_adapters"


def remap_optimizer_state(
    state: dict[str, Any], old: list[str], new: list[tuple[str, int]], grouped: bool
) -> dict[str, Any]:
    """`state` (an optimizer `state_dict()` laid out as `old`, one group per name) laid out as `new`.

    Args:
        state: the checkpoint's optimizer state dict.
        old: adapter names of its parameter groups, in order (a one-adapter run: `["default"]`).
        new: `(adapter, number of parameters)` of the groups the optimizer has now, in order.
        grouped: whether the new optimizer has per-adapter groups (False: one group, as a one-adapter run).
    """
    groups = state["param_groups"]
    if len(groups) != len(old):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups for adapters {old}")
    by_name = dict(zip(old, groups, strict=True))
    template = {k: v for k, v in groups[0].items() if k not in ("params", "adapter")}
    out_groups, out_state, index = [], {}, 0
    for adapter, count in new:
        source = by_name.get(adapter)
        params = list(range(index, index + count))
        if source is not None and len(source["params"]) == count:
            for new_i, old_i in zip(params, source["params"], strict=True):
                if old_i in state["state"]:
                    out_state[new_i] = copy.deepcopy(state["state"][old_i])
            group = {k: v for k, v in source.items() if k != "params"}
        else:
            group = dict(template)
        group["params"] = params
        if grouped:
            group["adapter"] = adapter
        else:
            group.pop("adapter", None)
        out_groups.append(group)
        index += count
    return {"state": out_state, "param_groups": out_groups}


def same_adapter(names: Sequence[str], gathered: Sequence[int]) -> str:
    """The adapter every rank trains this step, from each rank's index into `names` (-1: not one of them).

    Raises:
        RuntimeError: naming each rank's adapter, when the ranks do not all train the same one of `names`.
    """
    first = gathered[0]
    if all(i == first for i in gathered) and 0 <= first < len(names):
        return names[first]
    each = ", ".join(f"rank {r}: {names[i] if 0 <= i < len(names) else 'unknown'}" for r, i in enumerate(gathered))
    raise RuntimeError(f"the training processes must all train one adapter in a step, got {each} (of {list(names)})")


def drop_moments(optimizers: Sequence[Any], params: Sequence[Any]) -> None:
    """Forget the optimizer state (AdamW's moments and step count) of `params`: their weights were replaced (an
    import, a rewind), and the old moments belong to the weights that are gone. They start fresh at the next step."""
    ids = {id(p) for p in params}
    for optimizer in optimizers:
        for p in [p for p in optimizer.state if id(p) in ids]:
            del optimizer.state[p]
