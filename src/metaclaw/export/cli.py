"""`python -m metaclaw export STEP|latest ...` and `python -m metaclaw import PEFT_DIR ...` (docs/export.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from metaclaw.atomic import write_dir_atomically
from metaclaw.export.formats import export_gguf_lora, export_merged, export_ollama, export_peft
from metaclaw.export.runs import ExportError, RunAdapters, file_sha256

__all__ = ["PROVENANCE_FILE", "export", "main"]

FORMATS = ("peft", "merged", "gguf-lora", "ollama")
PROVENANCE_FILE = "metaclaw-export.json"


def base_model_hash(local_dir: Path) -> dict[str, str]:
    """sha256 of the base model's config and weight files (what an adapter is only valid on)."""
    files = sorted([local_dir / "config.json", *local_dir.glob("*.safetensors")])
    return {f.name: file_sha256(f) for f in files if f.is_file()}


def export(run_dir: str, step: str, agent: str, fmt: str, out: str, dtype: str = "float32",
           base_gguf: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Write `out` (a new directory, atomically) in `fmt`, with `metaclaw-export.json`; returns that record."""
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    run = RunAdapters.open(run_dir, agent)
    n, adapter_dir = run.resolve(step)
    spec = run.model_spec()
    target = Path(out).expanduser()
    if target.exists() and any(target.iterdir()) if target.is_dir() else target.exists():
        raise ExportError(f"--out {target} exists and is not empty: choose a new directory")
    record: dict[str, Any] = {}

    def fill(tmp: Path) -> None:
        started = time.perf_counter()
        if fmt == "peft":
            parity = export_peft(adapter_dir, tmp, spec)
        elif fmt == "merged":
            parity = export_merged(adapter_dir, tmp, spec, dtype)
        elif fmt == "gguf-lora":
            parity = export_gguf_lora(adapter_dir, tmp, spec)
        else:
            parity = export_ollama(adapter_dir, tmp, spec, base_gguf)
        measured = parity.get("tolerance_on", "max_abs_diff")
        if parity[measured] > parity["tolerance"]:
            raise ExportError(f"parity check failed: {measured} {parity[measured]:.3g} > {parity['tolerance']} "
                              f"({parity['check']}); nothing was written")  # fmt: skip
        record.update({
            "format": fmt + (f" ({dtype})" if fmt == "merged" else ""),
            "agent": agent,
            "step": n,
            "source": {"run_dir": str(run.run_dir.resolve()), "adapter_dir": str(adapter_dir.resolve()),
                       "adapter_sha256": file_sha256(adapter_dir / "adapter_model.safetensors")},
            "base_model": {"name": spec.name, "local_dir": str(spec.local_dir()),
                           "sha256": base_model_hash(spec.local_dir())},
            "lora": run.lora,
            "samples_trained": run.samples_trained_through(n),
            "eval": run.eval_at(n),
            "parity": parity,
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.perf_counter() - started, 2),
        })  # fmt: skip
        (tmp / PROVENANCE_FILE).write_text(json.dumps(record, indent=1))

    try:  # an empty --out is replaced by the finished export; one filled meanwhile is left as it is
        write_dir_atomically(target, fill, exclusive=True)
    except FileExistsError as e:
        raise ExportError(f"--out {target} was created or filled by something else during the export: {e}; "
                          "nothing of it was touched") from e  # fmt: skip
    return record


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m metaclaw", description="Export or import a LoRA adapter.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write an agent's adapter as peft | merged | gguf-lora | ollama")
    ex.add_argument("step", help="a published step number, or `latest` (what is served)")
    ex.add_argument("--run-dir", required=True, help="the run directory train.py wrote")
    ex.add_argument("--agent", default="default", help="the agent (X-Agent-Id) whose adapter (default: default)")
    ex.add_argument("--format", required=True, choices=FORMATS)
    ex.add_argument("--out", required=True, help="a new directory to write")
    ex.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="merged: saved dtype")
    ex.add_argument("--base-gguf", default=None, help="ollama: the base model's GGUF (default: the one it ships as)")
    im = sub.add_parser("import", help="make an external PEFT LoRA an agent's served adapter and training start")
    im.add_argument("peft_dir")
    im.add_argument("--run-dir", required=True)
    im.add_argument("--agent", default="default")
    im.add_argument("--any-base", action="store_true", help="accept an adapter whose config names another base")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            record = export(args.run_dir, args.step, args.agent, args.format, args.out, args.dtype, args.base_gguf)
            p = record["parity"]
            print(f"exported step {record['step']} of agent {args.agent} as {record['format']} to {args.out}\n"
                  f"parity ({p['check']}): max |diff| {p['max_abs_diff']:.3g}, "
                  f"mean {p.get('mean_abs_diff', 0.0):.3g}, tolerance {p['tolerance']}")  # fmt: skip
        else:
            from metaclaw.export.importer import import_adapter

            record = import_adapter(args.peft_dir, args.run_dir, args.agent, args.any_base)
            p = record["parity"]
            print(f"imported {args.peft_dir} as agent {args.agent}'s adapter ({record['path']}); parity: max |diff| "
                  f"{p['max_abs_diff']:.3g} over {p['tokens']} tokens. A restarted server serves it; the next "
                  "train.py start of this run trains on from it.")  # fmt: skip
    except ExportError as e:
        print(f"{args.command} refused: {e}", file=sys.stderr)
        return 2
    return 0
