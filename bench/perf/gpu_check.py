"""GPU check anyone can run (no network): Qwen3-4B's shape with random weights, LoRA training, serving, hot-swap.

Builds the model from a transformers `Qwen3Config` with Qwen3-4B's real dimensions (no download), trains LoRA
steps in bf16 through `OnlineRLModule` under a Lightning Trainer, then serves it on the HF engine and hot-swaps
the freshly saved adapter in, and prints JSON:

- `train.tokens_per_s`: trained tokens (prompt + response) per second, steady state (first steps are warm-up);
- `train.mfu_6n_dense`: model FLOPs utilisation counting 6·N FLOPs per token (N = matmul parameters of the base),
  the usual dense-training accounting;
- `train.mfu_4n_frozen_base`: counting 4·N: with a frozen base, backward needs activation gradients (2·N) but no
  weight gradients, so 4·N is the work LoRA training really asks for (the LoRA matrices add < 1%);
- (model FLOPs: recomputation under `--grad-ckpt` is not counted, so MFU stays comparable across settings);
- `peak_memory_gib` for the training phase and for serving; `serve.swap_latency_ms` (median and max over swaps)
  and `serve.decode_tokens_per_s` with the adapter active.

On a GPU host (bf16, the full 36 layers):

    python bench/perf/gpu_check.py                      # Qwen3-4B shape on cuda:0, batch 2 × 2048 tokens
    python bench/perf/gpu_check.py --batch 8 --seq 2048 --grad-ckpt --peak-tflops 989

`--layers N` shrinks the depth (a quick run); `--smoke` is a tiny CPU configuration for CI (checks the JSON, not
the figures). `--peak-tflops` overrides the dense bf16 peak used for MFU (H100/H200 SXM: 989).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from bench.perf.train_step import StepTimer, make_batch  # noqa: E402
from metaclaw.advantages import RLAdvantage  # noqa: E402
from metaclaw.losses import ImportanceSamplingLoss  # noqa: E402
from metaclaw.modules.loading import ModelSpec  # noqa: E402
from metaclaw.modules.online_rl import OnlineRLModule  # noqa: E402
from metaclaw.modules.policy import LoraPolicy  # noqa: E402
from metaclaw.serving.engines.hf import HFEngine  # noqa: E402
from metaclaw.serving.sampling import SamplingParams  # noqa: E402

# Qwen/Qwen3-4B config.json (the dimensions only; weights are random)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)  # fmt: skip
SMOKE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}


def build_model(dims: dict, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**dims, dtype=dtype)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval()


def matmul_params(model: torch.nn.Module) -> int:
    """N for the FLOPs count: weights of every Linear (the LM head included, tied or not); embeddings excluded."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def peak_tflops(device: str, override: float | None) -> float | None:
    if override:
        return override
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        # The allocator's stats exist once the device has been used; a reset before that raises "Invalid device
        # argument" (found on the first H100 run).
        torch.empty(0, device=device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: str) -> float:
    if device.startswith("cuda"):
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # process peak RSS (KiB → GiB)


def train_phase(args, dims: dict, device: str) -> tuple[dict, LoraPolicy, int]:
    reset_peak(device)
    base = build_model(dims, device, torch.bfloat16)
    n = matmul_params(base)
    policy = LoraPolicy(base, rank=args.rank, alpha=2 * args.rank, gradient_checkpointing=args.grad_ckpt)
    batch = {k: v.to(device) for k, v in make_batch(dims["vocab_size"], args.batch, args.seq).items()}
    module = OnlineRLModule(policy, ImportanceSamplingLoss(), RLAdvantage(), partial(torch.optim.AdamW, lr=1e-5))
    timer = StepTimer()
    accelerator = "gpu" if device.startswith("cuda") else "cpu"
    devices = [int(device.split(":")[1])] if accelerator == "gpu" else 1
    trainer = L.Trainer(max_steps=args.steps, accelerator=accelerator, devices=devices, precision="bf16-true",
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, gradient_clip_val=1.0, callbacks=[timer])  # fmt: skip
    trainer.fit(module, DataLoader([batch] * args.steps, batch_size=None))
    steady = timer.times[args.warmup :] or timer.times
    step_s = statistics.median(steady)
    tokens = int(batch["attention_mask"].sum())
    tok_s = tokens / step_s
    peak = peak_tflops(device, args.peak_tflops)
    trainable, total = policy.num_parameters()
    result = {
        "steps_measured": len(steady), "tokens_per_step": tokens, "s_per_step_median": round(step_s, 4),
        "tokens_per_s": round(tok_s, 1), "params_total": total, "params_trainable": trainable,
        "params_matmul_N": n, "peak_bf16_tflops": peak,
        "achieved_tflops_6n": round(6 * n * tok_s / 1e12, 3), "achieved_tflops_4n": round(4 * n * tok_s / 1e12, 3),
        "mfu_6n_dense": round(6 * n * tok_s / (peak * 1e12), 4) if peak else None,
        "mfu_4n_frozen_base": round(4 * n * tok_s / (peak * 1e12), 4) if peak else None,
        "gradient_checkpointing": args.grad_ckpt, "peak_memory_gib": peak_gib(device),
    }  # fmt: skip
    return result, policy, tokens


def serve_phase(args, dims: dict, device: str, policy: LoraPolicy) -> dict:
    reset_peak(device)
    tokenizer = ModelSpec(name="tiny", path="tiny", dtype="float32").load_tokenizer()  # ids only: any tokenizer
    engine = HFEngine(build_model(dims, device, torch.bfloat16, seed=1), tokenizer, "qwen3-4b-shape",
                      max_seq_len=args.seq + args.decode_tokens + 8)  # fmt: skip
    swaps = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.swaps):
            path = policy.save_adapter(Path(tmp) / f"step-{i:06d}")
            t0 = time.perf_counter()
            engine.load_adapter("policy", str(path))
            swaps.append((time.perf_counter() - t0) * 1000)
    prompt = list(range(10, 10 + min(args.seq // 2, 512)))
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=1.0, seed=0)
    engine.generate(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=0), "policy")  # warm-up
    t0 = time.perf_counter()
    out = engine.generate(prompt, params, "policy")
    decode_s = time.perf_counter() - t0
    return {
        "engine": "hf", "swaps": len(swaps), "swap_latency_ms_median": round(statistics.median(swaps), 1),
        "swap_latency_ms_max": round(max(swaps), 1), "decode_tokens": len(out[0].token_ids),
        "decode_tokens_per_s": round(len(out[0].token_ids) / decode_s, 1), "peak_memory_gib": peak_gib(device),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (Qwen3-4B: 36)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--swaps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny dims on CPU: checks the pipeline, not the figures")
    add_results_argument(ap)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dims = dict(SMOKE if args.smoke else QWEN3_4B)
    if args.smoke:
        args.device = "cpu"
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 3, 1
        args.rank, args.swaps, args.decode_tokens = 4, 2, 4
    if args.layers:
        dims["num_hidden_layers"] = args.layers
    train, policy, _ = train_phase(args, dims, args.device)
    serve = serve_phase(args, dims, args.device, policy)
    result = {
        "model": "qwen3-4b-shape (random weights)" if not args.smoke else "smoke (tiny qwen3 dims)",
        "dims": dims, "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "dtype": "bfloat16", "batch": args.batch, "seq": args.seq, "lora_rank": args.rank,
        "torch": torch.__version__, "train": train, "serve": serve,
    }  # fmt: skip
    publish(__file__, args, result)
    return result


if __name__ == "__main__":
    main()
