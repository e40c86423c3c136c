"""Fewer bytes per decoded token on the CPU: bf16 and int8 weights against fp32, speed and logprob gap; prints JSON.

    python bench/perf/decode_precision.py                  # SmolLM2-135M (the embedded model), batches 1, 2, 4
    python bench/perf/decode_precision.py --batches 1 2 --tokens 16

Decoding SmolLM2 fp32 at batch 1 reads 538 MB of weights per token; bf16 halves that, int8 quarters it. Whether
that makes the decode faster depends on the CPU's kernels, and serving a different numeric model than the one
training scores breaks the ratio-is-1 rule unless the gap is measured and corrected. This bench measures both,
in one process, on the same prompts (the simulated user's held-out tasks in the chat template), interleaved by
batch size so a drifting load hits every variant alike:

- `fp32`: what the HF engine serves on a CPU today (`model.dtype: auto`);
- `bf16`: the same weights cast to bfloat16 (oneDNN kernels where the CPU has AVX-512 BF16);
- `int8_dynamic`: `torch.ao.quantization.quantize_dynamic`, per-channel int8 weights of every decoder Linear (the
  tied LM head stays fp32), activations quantised per batch at run time.

`tokens_per_s`: `generate` (sampling, T = 1, `min_new_tokens = max_new_tokens`, KV cache) on `--threads` torch
threads. `logprob_gap`: teacher-forced on replies fp32 sampled, |log p_variant(token) - log p_fp32(token)| per reply
token (mean, p99, max): what the importance ratio would carry if the server sampled from the variant and the
trainer scored with fp32.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.config import CONFIG_DIR, register_resolvers  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402


def variants(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """fp32 (as loaded), bf16, and per-channel dynamic int8 of every Linear but the LM head."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    int8 = copy.deepcopy(model)
    linears = {name: per_channel_dynamic_qconfig for name, m in int8.named_modules()
               if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")}  # fmt: skip
    return {"fp32": model, "bf16": copy.deepcopy(model).to(torch.bfloat16),
            "int8_dynamic": quantize_dynamic(int8, linears, dtype=torch.qint8)}  # fmt: skip


def tokens_per_s(model: torch.nn.Module, batch: dict[str, torch.Tensor], tokens: int, pad_id: int) -> float:
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=pad_id)  # warm-up
        t0 = time.perf_counter()
        model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=1.0,
                       top_k=0, pad_token_id=pad_id)  # fmt: skip
    return tokens * batch["input_ids"].shape[0] / (time.perf_counter() - t0)


def reply_logprobs(model: torch.nn.Module, ids: torch.Tensor, start: int) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(ids).logits.float()
    lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[start - 1 :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per row")
    p.add_argument("--replies", type=int, default=8, help="fp32 replies scored for the logprob gap")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the server's budget on 2 cores: 1)")
    add_results_argument(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[f"model={args.model}"])
    spec = instantiate(cfg.model)
    tok = spec.load_tokenizer()
    tok.padding_side = "left"
    models = variants(spec.load_model().eval())
    prompts = [tok.apply_chat_template([{"role": "user", "content": t.prompt}], add_generation_prompt=True,
                                       tokenize=False) for t in load_tasks(None, "heldout")]  # fmt: skip
    speed: dict[str, dict[str, float]] = {name: {} for name in models}
    for b in args.batches:  # interleaved: every variant at this batch size before the next
        batch = tok(prompts[:b], return_tensors="pt", padding=True)
        for name, model in models.items():
            speed[name][f"b{b}"] = round(tokens_per_s(model, batch, args.tokens, tok.pad_token_id), 2)
    gaps: dict[str, list[torch.Tensor]] = {name: [] for name in models if name != "fp32"}
    for text in prompts[: args.replies]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = models["fp32"].generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=True,
                                          top_k=0, pad_token_id=tok.pad_token_id)  # fmt: skip
        ref = reply_logprobs(models["fp32"], out, ids.shape[1])
        for name in gaps:
            gaps[name].append((reply_logprobs(models[name], out, ids.shape[1]) - ref).abs())
    gap = {}
    for name, parts in gaps.items():
        d = torch.cat(parts)
        gap[name] = {"tokens": d.numel(), "mean": round(float(d.mean()), 4),
                     "p99": round(float(torch.quantile(d, 0.99)), 4), "max": round(float(d.max()), 4)}  # fmt: skip
    report = {
        "model": spec.name,
        "threads": args.threads,
        "tokens_per_row": args.tokens,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "tokens_per_s": speed,
        "speedup_vs_fp32": {
            name: {k: round(v / speed["fp32"][k], 2) for k, v in s.items()}
            for name, s in speed.items()
            if name != "fp32"
        },  # fmt: skip
        "logprob_gap": gap,
    }
    publish(__file__, args, report)


if __name__ == "__main__":
    main()
