"""Training logprobs: full-vocabulary logits at every position (old) vs logits only at response positions (new).

One training step of the policy on SmolLM2-135M (CPU, float32): forward, the importance-sampling objective
(token-mean over the response), backward. `old` applies the LM head to every position, prompt included, and
takes `token_logprobs` of the `[B, T, V]` logits (what `LoraPolicy.logprobs` did before); `new` is
`LoraPolicy.logprobs(..., mask=)`: decoder hidden states, the LM head only at response positions, in chunks
recomputed in backward. Each path runs with decoder gradient checkpointing off and on (`policy.
gradient_checkpointing`), all four cases in ONE process on one model, interleaved round by round, so load from
other processes hits every case alike and step-time ratios compare like with like.

Peak memory is exact, not sampled: one step per case runs under `torch.profiler` with `profile_memory=True`,
which records every allocation and free of the CPU tensor allocator with its size; summed in time order they
give the live tensor bytes at every instant, and the peak above the step's start is the step's memory (the
weights, already there, are excluded). It does not depend on the machine's load or on malloc's caching (RSS
does: freed memory stays in the process). The same step attributes what autograd keeps for backward
(`saved_tensors_hooks`, weights excluded) to the module that saved it, and the CPU time of the ops that touch
the vocabulary dimension (LM head, softmax, their backward).

    python bench/perf/logprob_memory.py [--model smollm2_135m|tiny] [--prompt 1500] [--response 64] [--steps 3]

Prints JSON: per case the peak step memory (MiB, exact), the median step time (s) and the breakdown, and the
old/new ratios (checkpointing off and on, and the previous default vs the new default).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from bench.harness.models import model_names, model_spec  # noqa: E402

MODULES = ("Attention", "MLP", "RMSNorm", "lm_head")  # what saved tensors are attributed to (class name suffix)


def allocator_peak(prof: torch.profiler.profile) -> tuple[int, int]:
    """(peak, end) live bytes of the CPU allocator during a profiled region, relative to its start."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, live


def vocab_time_frac(prof: torch.profiler.profile, vocab: int) -> float:
    """Share of the step's self CPU time spent in ops with a vocabulary-sized input (LM head, softmax, backward)."""
    total = touched = 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        total += e.self_cpu_time_total
        if any(vocab in s for s in e.input_shapes if isinstance(s, list)):
            touched += e.self_cpu_time_total
    return touched / total if total else 0.0


class SavedByModule:
    """Bytes autograd keeps for backward, by the module whose forward saved them (weights excluded)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.stack, self.bytes, self.seen, self.handles = ["other"], collections.Counter(), set(), []
        for name, module in model.named_modules():
            label = next((m for m in MODULES if type(module).__name__.endswith(m) or name.endswith(m)), None)
            if label is not None:
                push = module.register_forward_pre_hook(lambda m, a, label=label: self.stack.append(label))
                self.handles.append(push)
                self.handles.append(module.register_forward_hook(lambda m, a, o: self._pop()))

    def _pop(self) -> None:
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.weights and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes[self.stack[-1]] += t.untyped_storage().nbytes()
        return t

    @contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield

    def mib(self) -> dict[str, float]:
        return {k: round(v / 2**20, 1) for k, v in self.bytes.most_common()}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def build(args: argparse.Namespace):
    from metaclaw.datamodules.rollout import collate_samples
    from metaclaw.modules.policy import LoraPolicy
    from metaclaw.store import Sample

    torch.manual_seed(0)
    spec = model_spec(args.model, max_seq_len=args.prompt + args.response + 8)
    policy = LoraPolicy(spec.load_model(), rank=16, alpha=32, logprob_chunk_size=args.chunk)
    policy.train()
    for name, p in policy.named_parameters():  # a trained adapter, so old and new compare non-trivial values
        if "lora_B" in name:
            p.data.normal_(0, 0.01, generator=torch.Generator().manual_seed(1))
    vocab = policy.model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(torch.randint(5, vocab, (args.prompt,), generator=g).tolist(),
               torch.randint(5, vocab, (args.response,), generator=g).tolist(),
               (-torch.rand(args.response, generator=g) * 3).tolist(), temperature=0.7, id=i + 1)
        for i in range(args.batch)
    ]  # fmt: skip
    return policy, vocab, collate_samples(samples, pad_id=0)


def step(policy, batch: dict, path: str) -> torch.Tensor:
    """One training step's compute (no optimizer: it is the same for both paths); returns the logprobs."""
    from metaclaw.distribution.logprobs import token_logprobs

    mask = batch["mask"]
    if path == "old":
        logits = policy(batch["input_ids"], batch["attention_mask"])
        lp = token_logprobs(logits, batch["target_ids"], batch["temperature"]) * mask
        del logits
    else:
        lp = policy.logprobs(batch["input_ids"], batch["target_ids"], batch["attention_mask"],
                             batch["temperature"], mask=mask)  # fmt: skip
    loss = -(torch.exp(lp - batch["behaviour_logprobs"]) * mask).sum() / mask.sum()
    loss.backward()
    return lp.detach()


def run(args: argparse.Namespace) -> dict:
    policy, vocab, batch = build(args)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    cases = [(path, ckpt) for ckpt in modes for path in args.paths.split(",")]
    name = {c: f"{c[0]}/checkpointing_{'on' if c[1] else 'off'}" for c in cases}
    out: dict[str, dict] = {name[c]: {"step_s": [], "step_cpu_s": []} for c in cases}
    values, grads = {}, {}
    for c in cases if args.profile else []:  # the profiled step (also the warm-up): exact memory, saved, vocab time
        policy.set_gradient_checkpointing(c[1])
        saved = SavedByModule(policy)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True) as prof, saved.recording():  # fmt: skip
            values[c] = step(policy, batch, c[0])
        saved.remove()
        grads[c] = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        policy.zero_grad(set_to_none=True)
        peak, end = allocator_peak(prof)
        out[name[c]].update(peak_step_mib=round(peak / 2**20, 1), retained_after_step_mib=round(end / 2**20, 1),
                            saved_for_backward_mib=saved.mib(),
                            vocab_ops_time_frac=round(vocab_time_frac(prof, vocab), 3))  # fmt: skip
        print(json.dumps({name[c]: out[name[c]]}), file=sys.stderr, flush=True)
        del prof
    for _ in range(args.steps):  # timed rounds, cases interleaved
        for c in cases:
            policy.set_gradient_checkpointing(c[1])
            t0, cpu0 = time.perf_counter(), time.process_time()
            values[c] = step(policy, batch, c[0])
            out[name[c]]["step_s"].append(round(time.perf_counter() - t0, 2))
            out[name[c]]["step_cpu_s"].append(round(time.process_time() - cpu0, 2))  # this process's CPU time
            grads[c] = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
            policy.zero_grad(set_to_none=True)
        print(json.dumps({name[c]: out[name[c]]["step_s"] for c in cases}), file=sys.stderr, flush=True)
    for c in cases:
        out[name[c]]["step_s_median"] = statistics.median(out[name[c]]["step_s"])
        out[name[c]]["step_cpu_s_median"] = statistics.median(out[name[c]]["step_cpu_s"])
    mask = batch["mask"].bool()
    ref = cases[0]
    agree = {
        name[c]: {"max_abs_logprob_diff": float((values[c] - values[ref])[mask].abs().max()),
                  "max_abs_grad_diff": float((grads[c] - grads[ref]).abs().max())}
        for c in cases[1:]
    }  # fmt: skip

    def ratio(old: str, new: str) -> dict:
        r = {
            "step_time_old_over_new": round(out[old]["step_s_median"] / out[new]["step_s_median"], 2),
            "step_cpu_time_old_over_new": round(out[old]["step_cpu_s_median"] / out[new]["step_cpu_s_median"], 2),
        }
        if args.profile:
            r["peak_memory_old_over_new"] = round(out[old]["peak_step_mib"] / max(out[new]["peak_step_mib"], 1e-9), 2)
        return r

    both = [m for m in ("off", "on") if f"old/checkpointing_{m}" in out and f"new/checkpointing_{m}" in out]
    ratios = {f"checkpointing_{m}": ratio(f"old/checkpointing_{m}", f"new/checkpointing_{m}") for m in both}
    if len(modes) == 2 and "old/checkpointing_off" in out and "new/checkpointing_on" in out:
        ratios["old_default_over_new_default"] = ratio("old/checkpointing_off", "new/checkpointing_on")
    return {"model": args.model, "prompt_tokens": args.prompt, "response_tokens": args.response,
            "batch": args.batch, "steps": args.steps, "chunk": args.chunk, "vocab": vocab, "device": "cpu",
            "threads": torch.get_num_threads(), "load_avg": os.getloadavg(), "cases": out,
            "agreement_with_" + name[ref]: agree, "ratios": ratios}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m", choices=model_names())
    parser.add_argument("--prompt", type=int, default=1500)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case (after one profiled step)")
    parser.add_argument("--chunk", type=int, default=512, help="policy.logprob_chunk_size")
    parser.add_argument("--checkpointing", choices=["off", "on", "both"], default="both")
    parser.add_argument(
        "--paths",
        default="old,new",
        choices=["old,new", "new", "old"],
        help="new only: an agent-sized batch whose full logits would not fit (four 7k-token turns)",
    )
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="timed steps only (no profiled step: no memory figures)")  # fmt: skip
    add_results_argument(parser)
    args = parser.parse_args(argv)
    result = run(args)
    publish(__file__, args, result)
    return result


if __name__ == "__main__":
    main()
