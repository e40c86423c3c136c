"""The KL penalty's reference (the base model, adapter off) computed beside the policy's forward, on a core the
trainer's thread budget leaves idle.

On a CPU host the trainer runs on `devices.cpu_threads.train` torch threads (one on the 2-core demo) while the policy
server generates on the others; the server is idle part of the time (the main job: 60% of its wall clock), and the
reference's forward was a third of the trainer's time (`bench/perf/cycle_profile.py`, phase `kl_reference`). The
reference never depends on the adapter, so it can run while the policy's forward does: a plain copy of the base
model that shares the policy's frozen weights (no memory of its own) answers it on a thread of its own, at a lower
CPU priority (nice +10 on Linux, so the user's generation keeps its core). Work is split by row: when the policy's
forward is done first, the trainer's thread takes the rows not started yet, so a busy machine costs at most one
row's wait over computing the reference in line.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor, nn

from metaclaw import profiling
from metaclaw.devices import host_cpu_count
from metaclaw.modules.policy import causal_logprobs

log = logging.getLogger(__name__)

NICE = 10  # the reference thread's niceness (Linux threads carry their own)
_LORA_KEY = re.compile(r"\.lora_[A-Za-z_]+\.")


def shared_base(base: nn.Module) -> nn.Module:
    """A plain copy of the PEFT-wrapped causal LM `base` with its adapter layers taken out: the same classes and
    config, every parameter and buffer the very tensor of `base` (frozen: LoRA trains only its own weights), in
    eval mode."""
    with torch.device("meta"):
        plain: nn.Module = type(base)(base.config)
    state = {k.replace(".base_layer.", "."): v for k, v in base.state_dict(keep_vars=True).items()
             if not _LORA_KEY.search(k)}  # fmt: skip
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"the reference copy has no place for {unexpected[:3]}")
    plain.tie_weights()  # type: ignore[operator]
    buffers = dict(base.named_buffers())
    for name, buf in list(plain.named_buffers()):  # non-persistent ones (RoPE's inv_freq) are not in state_dict
        owner, _, leaf = name.rpartition(".")
        source = buffers.get(name)
        if buf.is_meta and source is not None:
            plain.get_submodule(owner).register_buffer(leaf, source, persistent=False)
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left or [m for m in missing if m not in dict(plain.named_parameters())]:
        raise ValueError(f"the reference copy misses {left[:3] or missing[:3]}")
    return plain.eval()


def _lower_priority() -> None:
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except OSError as e:  # a sandbox may refuse: the thread then runs at the trainer's priority
            log.warning("The KL reference thread keeps the trainer's CPU priority: %s", e)


class ReferenceWork:
    """One batch's reference logprobs `[B, T]`, computed row by row by whoever takes a row first: the reference
    thread from the start, the trainer's thread once it calls `result()`."""

    def __init__(self, model: nn.Module, batch: dict[str, Tensor], chunk: int) -> None:
        self.model, self.batch, self.chunk = model, batch, chunk
        self.out = torch.zeros(batch["mask"].shape, dtype=torch.float32, device=batch["mask"].device)
        self._rows = [b for b in range(batch["mask"].shape[0]) if bool(batch["mask"][b].any())]
        self._next, self._left = 0, len(self._rows)
        self._lock, self._done = threading.Lock(), threading.Event()
        self._error: BaseException | None = None
        if not self._rows:
            self._done.set()

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= len(self._rows) or self._error is not None:
                return None
            self._next += 1
            return self._rows[self._next - 1]

    def work(self) -> None:
        """Compute rows until none is left to start."""
        with torch.no_grad(), profiling.phase("kl_reference", cpu="thread"):
            while (b := self._take()) is not None:
                try:
                    self._row(b)
                except BaseException as e:  # noqa: BLE001 - raised again by result(), in the trainer's thread
                    with self._lock:
                        self._error = e
                    self._done.set()
                    return
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self._done.set()

    def _row(self, b: int) -> None:
        batch, n = self.batch, int(self.batch["attention_mask"][b].sum())
        one = [batch[k][b : b + 1, :n] for k in ("input_ids", "target_ids", "attention_mask", "mask")]
        defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
        params = [batch[k][b : b + 1] if k in batch else v for k, v in defaults.items()]
        lp = causal_logprobs(self.model, one[0], one[1], one[2], params[0], params[1], params[2], one[3], self.chunk)
        self.out[b, :n] = lp[0]

    def result(self) -> Tensor:
        """The batch's reference logprobs; the calling thread computes the rows nobody has started."""
        self.work()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self.out


class ConcurrentReference:
    """Starts each batch's reference on its own thread (`start`) over `shared_base` of the policy's model."""

    def __init__(self, base: nn.Module, chunk: int) -> None:
        self.model, self.chunk = shared_base(base), chunk
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kl-reference", initializer=_lower_priority)

    def start(self, batch: dict[str, Tensor]) -> ReferenceWork:
        work = ReferenceWork(self.model, batch, self.chunk)
        self._pool.submit(work.work)
        return work

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def wanted(setting: bool | str, device: torch.device, world_size: int) -> bool:
    """`kl.reference_thread`: true, false, or auto (on for one training process on the CPU whose torch threads
    leave a core of the host's idle; on a GPU the reference's kernels queue behind the policy's anyway)."""
    if isinstance(setting, bool):
        return setting
    return device.type == "cpu" and world_size == 1 and torch.get_num_threads() < host_cpu_count()
