"""`python -m metaclaw import PEFT_DIR --agent ID --run-dir DIR`: an external PEFT LoRA becomes an agent's adapter.

What is accepted: a LoRA (`peft_type` LORA) for the run's base model, safetensors weights only (a pickled
`adapter_model.bin` is refused, never opened), rank at most the run's `policy.rank`, target modules among the run's
`policy.target_modules`, every tensor the shape the base model's module needs. It is rewritten into the run's own
LoRA shape without changing what it computes: rank padded (the new A rows get PEFT's usual random init, the new B
columns are zero), B rescaled from the adapter's `alpha/r` to the run's, modules it does not adapt start as PEFT
starts them (B zero). The rewrite is checked: per-token logprobs of the parity probes under the original adapter
(`PeftModel.from_pretrained`) and the rewritten one must agree within 1e-4.

The result is written as `<adapters>/imported-<UTC time>/` and pointed at by `latest.json` (a restarted policy
server serves it) and `import.json` (the next `train.py` start of this run loads it into the trainer's adapter,
with fresh optimizer moments, serves it, and trains on from it: `ApplyImport`).
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, set_peft_model_state_dict
from safetensors.torch import load as safetensors_load

from metaclaw.export import untrusted
from metaclaw.export.parity import compare, reply_logprobs, served_model
from metaclaw.export.runs import ExportError, RunAdapters, file_sha256, write_json_atomically
from metaclaw.runfiles.layout import IMPORT_RECORD
from metaclaw.wire import ADAPTER_CONFIG, ADAPTER_WEIGHTS

__all__ = ["IMPORT_FILE", "IMPORT_TOLERANCE", "import_adapter"]

IMPORT_FILE = IMPORT_RECORD
IMPORT_TOLERANCE = 1e-4
_KEY = re.compile(r"^base_model\.model\.(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<part>[AB])\.weight$")


def _read_config(peft_dir: Path) -> dict[str, Any]:
    if not peft_dir.is_dir():
        raise ExportError(f"{peft_dir} is not a directory")
    if not (peft_dir / ADAPTER_WEIGHTS).is_file():
        if (peft_dir / "adapter_model.bin").exists():
            raise ExportError(f"{peft_dir} holds only adapter_model.bin: pickled weights are never loaded; "
                              "save the adapter with safe_serialization=True")  # fmt: skip
        raise ExportError(f"{ADAPTER_WEIGHTS} is missing in {peft_dir}")
    if not (peft_dir / ADAPTER_CONFIG).exists():
        raise ExportError(f"{ADAPTER_CONFIG} is missing in {peft_dir}")
    return untrusted.read_config(peft_dir / ADAPTER_CONFIG)


def check_config(config: dict[str, Any], run: RunAdapters, any_base: bool) -> tuple[int, float]:
    """The adapter's rank and scale (alpha / r), once its config fits the run; else `ExportError` naming why."""
    lora = run.lora
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ExportError(f"peft_type is {config.get('peft_type')!r}: only LoRA adapters can be imported")
    untrusted.check_fields(config)
    if config.get("bias", "none") != "none":
        raise ExportError(f"bias={config.get('bias')!r}: only bias='none' adapters can be imported")
    if config.get("use_rslora") not in (None, False, True):
        raise ExportError(f"use_rslora={config.get('use_rslora')!r} must be true or false")
    r, alpha = config.get("r"), config.get("lora_alpha")
    scale = untrusted.check_numbers(r, alpha, bool(config.get("use_rslora")))
    if r > lora["rank"]:
        raise ExportError(f"rank {r} is above this run's policy.rank {lora['rank']} (the rank limit)")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ExportError(f"target_modules must be a list of module names, got {targets!r}")
    extra = sorted(set(targets) - set(lora["target_modules"]))
    if extra:
        raise ExportError(
            f"target modules {extra} are not among this run's policy.target_modules {lora['target_modules']}"
        )
    base = str(config.get("base_model_name_or_path") or "")
    spec = run.model_spec()
    known = {spec.name.lower(), Path(str(spec.local_dir())).name.lower(), Path(spec.path).name.lower()}
    if base and not any_base and Path(base).name.lower() not in known and base != str(spec.local_dir()):
        raise ExportError(f"the adapter was trained on {base!r}, this run's base model is {spec.name!r} "
                          "(pass --any-base if they are the same weights under another name)")  # fmt: skip
    return int(config["r"]), scale


def _read_tensors(peft_dir: Path, base: torch.nn.Module, r: int) -> dict[str, dict[str, torch.Tensor]]:
    """`{module path: {"A": [r, in], "B": [out, r]}}`, every key and shape checked against the base model."""
    modules = dict(base.named_modules())
    linear = [getattr(m, "base_layer", m) for m in modules.values()]
    limit = 8 * r * sum(m.in_features + m.out_features for m in linear if isinstance(m, torch.nn.Linear)) + (1 << 20)
    try:  # read whole (bounded by the largest LoRA of rank r this model can hold), never through a link
        tensors = safetensors_load(untrusted.read_capped(peft_dir / ADAPTER_WEIGHTS, limit))
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure is the file's fault
        raise ExportError(f"{ADAPTER_WEIGHTS} is not a valid safetensors file: {e}") from e
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if not m:
            raise ExportError(f"unexpected tensor {key!r} (a LoRA holds only ...lora_A/lora_B.weight)")
        module = getattr(modules.get(m["module"]), "base_layer", modules.get(m["module"]))  # PEFT wraps it
        if not isinstance(module, torch.nn.Linear):
            raise ExportError(f"{key}: the base model has no linear module {m['module']!r}")
        want = (r, module.in_features) if m["part"] == "A" else (module.out_features, r)
        if tuple(t.shape) != want:
            raise ExportError(f"{key}: shape {tuple(t.shape)}, the base model needs {want}")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise ExportError(f"{key}: weights must be finite floating-point numbers")
        if float(t.abs().max()) > untrusted.MAX_ABS_WEIGHT:
            raise ExportError(f"{key}: a weight of {float(t.abs().max()):.3g} is over {untrusted.MAX_ABS_WEIGHT:g}")
        pairs.setdefault(m["module"], {})[m["part"]] = t.float()
    half = [k for k, v in pairs.items() if len(v) != 2]
    if half:
        raise ExportError(f"modules with only one of lora_A / lora_B: {half[:3]}")
    if not pairs:
        raise ExportError("the adapter holds no LoRA tensors")
    return pairs


def _original(spec: Any, config: dict[str, Any], pairs: dict[str, dict[str, torch.Tensor]]) -> Any:
    """The adapter as its author trained it (its rank, alpha and weights) over the fp32 base, for the parity check;
    built from the fields `check_config` read, never from the file."""
    clean = LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], target_modules=list(config["target_modules"]),
                       use_rslora=bool(config.get("use_rslora")), bias="none", lora_dropout=0.0)  # fmt: skip
    model = PeftModel(spec.load_model("cpu").float(), clean)
    state = {f"base_model.model.{m}.lora_{p}.weight": t for m, parts in pairs.items() for p, t in parts.items()}
    result: Any = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise ExportError(f"the adapter has keys the base model lacks: {result.unexpected_keys[:3]}")
    return model.eval()


def import_adapter(peft_dir: str | Path, run_dir: str | Path, agent: str = "default", any_base: bool = False,
                   ) -> dict[str, Any]:  # fmt: skip
    """Check, rewrite, verify and install `peft_dir` as `agent`'s adapter in `run_dir`; returns the record."""
    from metaclaw.modules.policy import LoraPolicy

    peft_dir = Path(peft_dir).expanduser()
    run = RunAdapters.open(run_dir, agent)
    config = _read_config(peft_dir)
    r, scale = check_config(config, run, any_base)
    lora, spec = run.lora, run.model_spec()
    policy = LoraPolicy(spec.load_model("cpu").float(), rank=lora["rank"], alpha=lora["alpha"],
                        target_modules=lora["target_modules"])  # fmt: skip
    pairs = _read_tensors(peft_dir, policy.model.get_base_model(), r)
    run_scale = lora["alpha"] / lora["rank"]
    with torch.no_grad():
        for name, module in policy.model.get_base_model().named_modules():
            if name in pairs and hasattr(module, "lora_A"):
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a[:r].copy_(pairs[name]["A"])  # rows r..R keep PEFT's random init: B's zero columns cancel them
                b.zero_()
                b[:, :r].copy_(pairs[name]["B"] * (scale / run_scale))
    missing = sorted(set(pairs) - {n for n, m in policy.model.get_base_model().named_modules() if hasattr(m, "lora_A")})
    if missing:
        raise ExportError(f"modules {missing[:3]} are not adapted by this run's policy.target_modules")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run.folder.imported_dir(stamp)
    policy.save_adapter(target)
    tokenizer = spec.load_tokenizer()
    original = _original(spec, config, pairs)  # a clean config of the fields read: PEFT never sees the file's
    parity = compare(reply_logprobs(original, tokenizer), reply_logprobs(served_model(spec, target), tokenizer))
    if not math.isfinite(parity["max_abs_diff"]) or parity["max_abs_diff"] > IMPORT_TOLERANCE:
        import shutil

        shutil.rmtree(target, ignore_errors=True)
        raise ExportError(f"the rewritten adapter does not reproduce the original: max |logprob diff| "
                          f"{parity['max_abs_diff']:.2e} > {IMPORT_TOLERANCE}")  # fmt: skip
    record = {
        "path": str(target.resolve()),
        "agent": agent,
        "adapter": run.adapter,
        "name": run.served_name,
        "source": {"path": str(peft_dir.resolve()), "weights_sha256": file_sha256(peft_dir / ADAPTER_WEIGHTS),
                   "r": r, "lora_alpha": config.get("lora_alpha"), "target_modules": config.get("target_modules"),
                   "base_model_name_or_path": config.get("base_model_name_or_path")},
        "parity": {"check": "PeftModel.from_pretrained(original) vs the rewritten adapter as served",
                   "tolerance": IMPORT_TOLERANCE, **parity},
        "imported_at": time.time(),
        "applied_at_step": None,
    }  # fmt: skip
    write_json_atomically(target / "metaclaw-import.json", record)
    previous = run.latest() or {}
    write_json_atomically(run.folder.import_record, record)
    run.folder.write_latest(int(previous.get("version", 0) or 0), str(record["path"]), run.served_name, imported=True)
    return record
