"""Many agents: the memory of N adapters in one PEFT model vs one training run per agent.

`one_model`: one process holds the base model once and N named LoRA adapters (what `train.py` does with
`agents.<id>` listed), with AdamW's moments for each; every adapter takes one step (prompt + response tokens).
`per_agent_runs`: N separate training runs, each with its own copy of the base model and one adapter; measured
as one such process (they are identical), times N. Each case runs in its own subprocess; memory is the
process's peak RSS (and the peak CUDA allocation on a GPU), plus the exact bytes of base, adapter and moments.

    python bench/perf/agents_memory.py [--model smollm2_135m|tiny] [--agents 1 2 4 8] [--device cpu|cuda] [--rank 16]

Prints JSON: per N, `one_model` and `per_agent_runs` peak RSS (and CUDA) in MiB, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from bench.harness.models import model_names, model_spec  # noqa: E402

MIB = 2**20


def child(args: argparse.Namespace) -> dict:
    """One process: the base model, `args.n` adapters, one AdamW step per adapter; its memory."""
    import torch

    from metaclaw.modules.policy import LoraPolicy

    torch.manual_seed(0)
    device = torch.device(args.device)
    spec = model_spec(args.model, max_seq_len=args.prompt + args.response + 8)
    model = spec.load_model().to(device)
    names = [f"agent{i}" for i in range(1, args.n)]
    policy = LoraPolicy(model, rank=args.rank, alpha=2 * args.rank, adapters=names).to(device)
    groups = [{"params": policy.adapter_parameters(a)} for a in policy.adapter_names]
    opt = torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.01)
    vocab = model.config.vocab_size
    seq = args.prompt + args.response
    ids = torch.randint(0, vocab, (1, seq + 1), device=device)
    mask = torch.zeros(1, seq, device=device)
    mask[0, args.prompt - 1 :] = 1
    for adapter in policy.adapter_names:
        policy.use_adapter(adapter)
        lp = policy.logprobs(ids[:, :-1], ids[:, 1:], torch.ones_like(ids[:, :-1]), mask=mask)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    adapters = nbytes(policy.adapter_parameters())
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    base = nbytes(p for n, p in policy.named_parameters() if "lora_" not in n)
    out = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "base_mib": base / MIB,
        "adapters_mib": adapters / MIB,
        "adam_moments_mib": moments / MIB,
    }
    if device.type == "cuda":
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / MIB
    return out


def run_child(args: argparse.Namespace, n: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--n", str(n), "--model", args.model, "--device", args.device,
           "--rank", str(args.rank), "--prompt", str(args.prompt), "--response", str(args.response)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2_135m", choices=model_names())
    p.add_argument("--agents", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    add_results_argument(p)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    single = run_child(args, 1)
    results = {"model": args.model, "device": args.device, "lora_rank": args.rank,
               "tokens_per_step": args.prompt + args.response, "one_run_one_adapter": single, "agents": {}}  # fmt: skip
    for n in args.agents:
        one = single if n == 1 else run_child(args, n)
        row = {"one_model": one, "per_agent_runs_peak_rss_mib": n * single["peak_rss_mib"]}
        row["rss_ratio_per_agent_runs_over_one_model"] = row["per_agent_runs_peak_rss_mib"] / one["peak_rss_mib"]
        if "peak_cuda_mib" in one:
            row["per_agent_runs_peak_cuda_mib"] = n * single["peak_cuda_mib"]
            row["cuda_ratio_per_agent_runs_over_one_model"] = row["per_agent_runs_peak_cuda_mib"] / one["peak_cuda_mib"]
        results["agents"][str(n)] = row
    publish(__file__, args, results)


if __name__ == "__main__":
    main()
