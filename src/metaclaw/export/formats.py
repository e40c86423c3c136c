"""The export formats: a PEFT adapter, a merged model, a GGUF LoRA for llama.cpp, an Ollama Modelfile.

Each writer fills a fresh directory (atomically, `write_dir_atomically`) and returns the parity it measured against
the served adapter (`metaclaw.export.parity`), which the caller records in the export's provenance JSON.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from metaclaw.export.parity import compare, reply_logprobs, served_model
from metaclaw.export.runs import ExportError
from metaclaw.modules.loading import ModelSpec
from metaclaw.wire import ADAPTER_CONFIG, ADAPTER_WEIGHTS

__all__ = ["GGUF_LORA_FILE", "LORA_ARCHES", "MERGED_TOLERANCE", "GgufLoraLayout", "export_gguf_lora",
           "export_merged", "export_ollama", "export_peft", "read_gguf_lora"]  # fmt: skip

GGUF_LORA_FILE = "adapter.gguf"
#: the agreement a merged export must reach with the served (unmerged) adapter, by saved dtype
MERGED_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
#: HF architecture → (llama.cpp architecture, whether llama.cpp's converter permutes q/k rows for its RoPE layout)
LORA_ARCHES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
}


def export_peft(adapter_dir: Path, out: Path, spec: ModelSpec) -> dict[str, Any]:
    """A standard PEFT adapter directory: `PeftModel.from_pretrained(base, out)` and vLLM's `load_lora_adapter`."""
    from peft import PeftModel

    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(adapter_dir / ADAPTER_WEIGHTS, out / ADAPTER_WEIGHTS)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(spec.local_dir())  # where this adapter's base model lives here
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    tokenizer = spec.load_tokenizer()
    reference = reply_logprobs(served_model(spec, adapter_dir), tokenizer)
    loaded = PeftModel.from_pretrained(spec.load_model("cpu").float(), str(out)).eval()
    return {"check": "PeftModel.from_pretrained vs served", "tolerance": 1e-6, **compare(reference,
            reply_logprobs(loaded, tokenizer))}  # fmt: skip


def export_merged(adapter_dir: Path, out: Path, spec: ModelSpec, dtype: str = "float32") -> dict[str, Any]:
    """Base + adapter merged into one safetensors model, with the tokenizer and its chat template.

    The reference is the adapter as served here (fp32 base, unmerged); a bf16 export is held to bf16's own noise
    floor (below).
    """
    from transformers import AutoModelForCausalLM

    if dtype not in MERGED_TOLERANCE:
        raise ExportError(f"--dtype must be one of {sorted(MERGED_TOLERANCE)}, got {dtype!r}")
    tokenizer = spec.load_tokenizer()
    model = served_model(spec, adapter_dir)
    fp32 = reply_logprobs(model, tokenizer)
    merged = model.merge_and_unload().to(getattr(torch, dtype))  # merged in fp32, then cast
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype)).eval()
    got = reply_logprobs(loaded, tokenizer)
    if dtype == "float32":
        return {"check": "AutoModelForCausalLM.from_pretrained (float32) vs served (float32)",
                "tolerance": MERGED_TOLERANCE[dtype], **compare(fp32, got)}  # fmt: skip
    # bf16 rounds every weight (8-bit mantissa): the base model alone, cast to bf16, moves the replies' logprobs by
    # ~0.035 nats per token on average on SmolLM2 (30 layers), above 1e-2. So a bf16 export is held, on the mean
    # against the fp32 served adapter, to 1e-2 or 1.5x that noise floor, whichever is larger: merging may not add
    # more error than bf16 itself. The max, and the gap to the adapter served in bf16 (unmerged), are reported.
    base = spec.load_model("cpu").float().eval()
    floor = compare(reply_logprobs(base, tokenizer), reply_logprobs(base.to(getattr(torch, dtype)), tokenizer))
    served_low = reply_logprobs(served_model(spec, adapter_dir).to(getattr(torch, dtype)), tokenizer)
    return {"check": f"AutoModelForCausalLM.from_pretrained ({dtype}) vs served (float32), mean over tokens",
            "tolerance": max(MERGED_TOLERANCE[dtype], 1.5 * floor["mean_abs_diff"]), "tolerance_on": "mean_abs_diff",
            **compare(fp32, got), f"vs_served_{dtype}": compare(served_low, got),
            f"{dtype}_noise_floor_base_model": floor}  # fmt: skip


# ---------------------------------------------------------------------------------------------- GGUF LoRA


@dataclass
class GgufLoraLayout:
    """How a PEFT LoRA maps onto llama.cpp's tensors for one base model."""

    arch: str
    permute_qk: bool
    n_head: int
    n_head_kv: int
    n_layers: int

    @classmethod
    def of(cls, spec: ModelSpec) -> GgufLoraLayout:
        config = json.loads((spec.local_dir() / "config.json").read_text())
        hf_arch = (config.get("architectures") or ["?"])[0]
        if hf_arch not in LORA_ARCHES:
            raise ExportError(f"gguf-lora: architecture {hf_arch} is not supported (supported: {sorted(LORA_ARCHES)})")
        arch, permute = LORA_ARCHES[hf_arch]
        heads = int(config["num_attention_heads"])
        return cls(arch, permute, heads, int(config.get("num_key_value_heads") or heads),
                   int(config["num_hidden_layers"]))  # fmt: skip

    def heads_of(self, module: str) -> int | None:
        """The head count whose RoPE layout llama.cpp's converter rewrites this projection's rows for."""
        if not self.permute_qk:
            return None
        return {"q_proj": self.n_head, "k_proj": self.n_head_kv}.get(module)

    @staticmethod
    def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
        """llama.cpp's q/k row order (interleaved RoPE pairs → halves): applied to the LoRA B rows."""
        return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    @staticmethod
    def unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
        return rows.reshape(n_head, rows.shape[0] // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _gguf_tensors(adapter_dir: Path, layout: GgufLoraLayout) -> dict[str, np.ndarray]:
    """The adapter's A/B tensors under llama.cpp's names (`blk.N.attn_q.weight.lora_a`), in its row order."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[layout.arch.upper()], layout.n_layers)
    out: dict[str, np.ndarray] = {}
    for key, tensor in load_file(str(adapter_dir / ADAPTER_WEIGHTS)).items():
        hf = key.removeprefix("base_model.model.")
        part = "lora_a" if ".lora_A." in hf else "lora_b" if ".lora_B." in hf else None
        if part is None:
            raise ExportError(f"gguf-lora: {key} is neither a LoRA A nor B tensor")
        module_path = hf.replace(".lora_A.weight", ".weight").replace(".lora_B.weight", ".weight")
        target = names.get_name(module_path, try_suffixes=(".weight",))
        if target is None:
            raise ExportError(f"gguf-lora: llama.cpp has no tensor for {module_path} ({layout.arch})")
        data = tensor.float().numpy()
        heads = layout.heads_of(module_path.split(".")[-2])
        if part == "lora_b" and heads:
            data = layout.permute(data, heads)
        out[f"{target}.{part}"] = np.ascontiguousarray(data)
    return out


def export_gguf_lora(adapter_dir: Path, out: Path, spec: ModelSpec) -> dict[str, Any]:
    """`adapter.gguf`: a llama.cpp LoRA adapter (`general.type` adapter, `adapter.lora.alpha`), fp32 tensors."""
    import gguf

    layout = GgufLoraLayout.of(spec)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("use_rslora") or config.get("use_dora"):
        raise ExportError("gguf-lora: rsLoRA / DoRA adapters are not supported by llama.cpp's LoRA loader")
    tensors = _gguf_tensors(adapter_dir, layout)
    out.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out / GGUF_LORA_FILE), layout.arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return check_gguf_lora(out / GGUF_LORA_FILE, adapter_dir, spec)


def read_gguf_lora(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A GGUF LoRA's metadata and tensors (numpy, in the HF shape `[rows, cols]`) read back with `gguf`'s reader."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {}
    for field in reader.fields.values():
        if field.types and field.types[0] == gguf.GGUFValueType.STRING:
            meta[field.name] = bytes(field.parts[field.data[0]]).decode()
        elif field.types and len(field.data) == 1 and field.types[0] != gguf.GGUFValueType.ARRAY:
            meta[field.name] = field.parts[field.data[0]].tolist()[0]
    tensors = {t.name: np.array(t.data).reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}
    return meta, tensors


def check_gguf_lora(path: Path, adapter_dir: Path, spec: ModelSpec) -> dict[str, Any]:
    """Read the file back: metadata as llama.cpp needs it, every tensor equal to the served adapter's."""
    layout = GgufLoraLayout.of(spec)
    meta, tensors = read_gguf_lora(path)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    expected = {"general.architecture": layout.arch, "general.type": "adapter", "adapter.type": "lora"}
    wrong = {k: meta.get(k) for k, v in expected.items() if meta.get(k) != v}
    if wrong or abs(float(meta.get("adapter.lora.alpha", -1)) - float(config["lora_alpha"])) > 1e-6:
        shown = wrong or meta.get("adapter.lora.alpha")
        raise ExportError(f"gguf-lora: {path} reads back with wrong metadata: {shown}")
    want = _gguf_tensors(adapter_dir, layout)
    if set(want) != set(tensors):
        raise ExportError(f"gguf-lora: {path} tensors differ: {sorted(set(want) ^ set(tensors))[:4]}")
    diffs = [float(np.abs(tensors[k].astype(np.float64) - want[k]).max()) if want[k].size else 0.0 for k in want]
    return {"check": "gguf reader: metadata and every tensor vs the served adapter (llama.cpp layout)",
            "tolerance": 0.0, "tensors": len(want), "max_abs_diff": max(diffs, default=0.0)}  # fmt: skip


# ---------------------------------------------------------------------------------------------- Ollama

CHATML_OLLAMA_TEMPLATE = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)


def base_gguf(spec: ModelSpec, given: str | None) -> Path:
    """The base model as GGUF: `--base-gguf`, else the GGUF the model ships as (the embedded SmolLM2)."""
    if given:
        path = Path(given).expanduser().resolve()
    elif spec.gguf_file:
        import importlib.util

        origin = importlib.util.find_spec(spec.package).origin if spec.package else None
        path = (Path(origin).parent if origin else Path(spec.path).expanduser()) / spec.gguf_file
    else:
        raise ExportError(f"ollama: model {spec.name!r} is not a GGUF: pass --base-gguf PATH (convert it with "
                          "llama.cpp's convert_hf_to_gguf.py)")  # fmt: skip
    if not path.is_file():
        raise ExportError(f"ollama: base GGUF {path} does not exist")
    return path


def export_ollama(adapter_dir: Path, out: Path, spec: ModelSpec, base: str | None = None) -> dict[str, Any]:
    """`Modelfile` + `adapter.gguf`: `ollama create NAME -f Modelfile` serves the base GGUF with the adapter."""
    parity = export_gguf_lora(adapter_dir, out, spec)
    tokenizer = spec.load_tokenizer()
    lines = [f"FROM {base_gguf(spec, base)}", f"ADAPTER ./{GGUF_LORA_FILE}"]
    template = getattr(tokenizer, "chat_template", None) or ""
    stops = {tokenizer.eos_token} if tokenizer.eos_token else set()
    if "<|im_start|>" in template:  # ChatML (Qwen, SmolLM2, the tiny model): Ollama's Go template of it
        lines.append(f'TEMPLATE """{CHATML_OLLAMA_TEMPLATE}"""')
        stops |= {"<|im_end|>", "<|im_start|>"}
    else:  # Ollama then uses the chat template stored in the base GGUF
        lines.append("# TEMPLATE: not written; Ollama uses the chat template inside the base GGUF")
    lines += [f'PARAMETER stop "{s}"' for s in sorted(stops)]
    (out / "Modelfile").write_text("\n".join(lines) + "\n")
    return parity | {"modelfile": "Modelfile"}
