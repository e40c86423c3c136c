"""Export an adapter in every format and print the measured parity as JSON (docs/export.md).

    python bench/studies/export_parity.py                       # SmolLM2-135M (the embedded default), a seeded adapter
    python bench/studies/export_parity.py --run-dir outputs/... # a real run's served adapter instead

Without `--run-dir` it builds a run directory of its own: the embedded model's config and one adapter with
seeded random LoRA weights (B ~ N(0, 0.02): a change to the replies' logprobs of the size a trained adapter makes).
Each format is written with `metaclaw.export.cli.export`, which refuses to write an export whose parity check
fails; the JSON gives every check's max/mean |diff|, its tolerance and the seconds. Where `llama-cpp-python` is
installed, the GGUF LoRA also runs in llama.cpp on the base GGUF and the adapter's effect is compared.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def synthetic_run(root: Path, model: str = "smollm2_135m", seed: int = 0, std: float = 0.02) -> Path:
    """A run directory holding the `model` config group's node and one seeded adapter at step 1."""
    import torch
    import yaml

    from metaclaw.config import LORA_TARGET_MODULES
    from metaclaw.modules.loading import ModelSpec
    from metaclaw.modules.policy import LoraPolicy

    repo = Path(__file__).resolve().parents[2]
    node = yaml.safe_load((repo / "src" / "metaclaw" / "conf" / "model" / f"{model}.yaml").read_text())
    config = {"model": node, "policy": {"rank": 16, "alpha": 32,
              "target_modules": list(LORA_TARGET_MODULES)},
              "publish": {"lora_name": "policy"}, "agents": {}}  # fmt: skip
    (root / ".hydra").mkdir(parents=True, exist_ok=True)
    (root / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    spec = ModelSpec(**{k: v for k, v in node.items() if k in ModelSpec.__dataclass_fields__})
    policy = LoraPolicy(spec.load_model("cpu").float(), **{k: config["policy"][k] for k in ("rank", "alpha")},
                        target_modules=config["policy"]["target_modules"])  # fmt: skip
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)
    policy.save_adapter(root / "adapters" / "step-000001")
    return root


def main() -> None:
    from metaclaw.export.cli import export
    from metaclaw.export.formats import GGUF_LORA_FILE, base_gguf
    from metaclaw.export.runs import RunAdapters

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default=None, help="a run directory (default: a synthetic SmolLM2 one)")
    ap.add_argument("--model", default="smollm2_135m", help="the synthetic run's conf/model (tiny: a smoke run)")
    ap.add_argument("--step", default="latest")
    ap.add_argument("--formats", default="peft,merged,merged-bf16,gguf-lora,ollama")
    ap.add_argument("--out", default=None, help="where to write the exports (default: a temp dir)")
    add_results_argument(ap)
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="metaclaw-export-"))
    run_dir = Path(args.run_dir) if args.run_dir else synthetic_run(work / "run", args.model)
    results: dict[str, object] = {}
    for fmt in args.formats.split(","):
        started = time.perf_counter()
        kind, dtype = ("merged", "bfloat16") if fmt == "merged-bf16" else (fmt, "float32")
        record = export(str(run_dir), args.step, "default", kind, str(work / fmt), dtype=dtype)
        results[fmt] = record["parity"] | {"seconds": round(time.perf_counter() - started, 1)}
    run = RunAdapters.open(run_dir)
    spec = run.model_spec()
    try:
        from metaclaw.export.parity import llama_cpp_parity

        _, adapter_dir = run.resolve(args.step)
        if (work / "gguf-lora").is_dir():
            results["llama.cpp"] = llama_cpp_parity(spec, adapter_dir, base_gguf(spec, None),
                                                    work / "gguf-lora" / GGUF_LORA_FILE)  # fmt: skip
    except ImportError as e:
        results["llama.cpp"] = f"not measured: {e} (pip install llama-cpp-python)"
    machine = {"cpus": os.cpu_count(), "load": os.getloadavg(), "python": platform.python_version()}
    out = {"model": spec.name, "run_dir": str(run_dir), "exports": str(work), "results": results, "machine": machine}
    publish(__file__, args, out)


if __name__ == "__main__":
    main()
