"""The memory plan: what each GPU of the device plan must hold, computed at start from the model's shape.

Per training GPU: the base weights, the LoRA adapter with its gradients and AdamW state (fp32: 16 bytes a
parameter), the activations one `model.max_seq_len` sample keeps for backward (with and without gradient
checkpointing), the logits of one `policy.logprob_chunk_size` chunk, and `devices.memory.headroom_gib` (CUDA
context, allocator slack). Per serving GPU: vLLM's share (`backend.gpu_memory_utilization`, or
`devices.colocate_infer_memory` when it shares a training GPU) must hold the weights, `backend.max_loras` LoRA slots
at `backend.max_lora_rank`, the KV cache of one `model.max_seq_len` sequence and the headroom; the HF engine the
weights and that KV cache. `check_memory` turns `policy.gradient_checkpointing` on when the plan needs it and
refuses a plan that cannot fit, with its numbers. Estimates, not measurements: the activation count is the tensors
a Qwen3/Llama decoder layer keeps for backward (bf16, SDPA attention), per token:
4·hidden + 3·(heads·head_dim) + 3·(kv_heads·head_dim) + 4·intermediate.
The shape comes from the model's `config.json` when it is on this machine, else from `model.shape`
(conf/model/qwen3_8b.yaml), so nothing is downloaded to plan. Only the GPU memory query touches the device.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from metaclaw.devices import DevicePlan, DevicePlanError

log = logging.getLogger(__name__)

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}  # auto: bf16 on CUDA
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder-only model's `config.json` that its memory depends on."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Shape:
        fields = {k: config[k] for k in cls.__dataclass_fields__ if config.get(k) is not None}
        return cls(**fields)

    @property
    def attn(self) -> int:
        return self.num_attention_heads * (self.head_dim or self.hidden_size // self.num_attention_heads)

    @property
    def kv(self) -> int:
        return self.num_key_value_heads * (self.head_dim or self.hidden_size // self.num_attention_heads)

    def projections(self) -> dict[str, tuple[int, int]]:
        """`(in, out)` features of each projection of one layer."""
        h, i, a, k = self.hidden_size, self.intermediate_size, self.attn, self.kv
        return {"q_proj": (h, a), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (a, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def params(self) -> int:
        layer = sum(n * m for n, m in self.projections().values()) + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + self.hidden_size

    def lora_params(self, rank: int, targets: Sequence[str] | None) -> int:
        chosen = [p for p in PROJECTIONS if targets is None or p in targets]
        return self.num_hidden_layers * rank * sum(sum(self.projections()[p]) for p in chosen)

    def activations_per_token(self, checkpointing: bool, dtype_bytes: int) -> int:
        """Bytes kept for backward per token: every layer's tensors, or (checkpointing) each layer's input plus
        one layer's tensors while it is recomputed."""
        h, i = self.hidden_size, self.intermediate_size
        layer = (4 * h + 3 * self.attn + 3 * self.kv + 4 * i) * dtype_bytes
        if checkpointing:
            return self.num_hidden_layers * h * dtype_bytes + layer
        return self.num_hidden_layers * layer

    def kv_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.kv * dtype_bytes


@dataclass(frozen=True)
class GpuNeeds:
    """What one GPU holds (bytes) and what it has for it."""

    device: int
    role: str  # "train", "serve (vLLM)", "train + serve (vLLM)", ...
    budget: float  # bytes this role may use on this GPU
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.parts.items())
        need, have = self.total / GIB, self.budget / GIB
        return f"cuda:{self.device} {self.role}: needs {need:.1f} GiB ({parts}) of {have:.1f} GiB"


def model_shape(model: Mapping[str, Any]) -> Shape | None:
    """The model's shape: its `config.json` on this machine (a local path or the HF cache), else `model.shape`,
    else the tiny model's; None when none is known (nothing is downloaded)."""
    path = Path(str(model.get("path", ""))).expanduser()
    config = path / "config.json"
    if not config.is_file() and not path.exists() and "/" in str(model.get("path", "")):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(model["path"]), "config.json")
            config = Path(cached) if isinstance(cached, str) else config
        except Exception:  # noqa: BLE001 - not a valid repo id: no cached config
            pass
    if config.is_file():
        data = json.loads(config.read_text())
        return Shape.of(data.get("text_config", data))
    if model.get("shape"):
        return Shape.of(model["shape"])
    if model.get("path") == "tiny" and model.get("tiny"):
        return Shape.of({**model["tiny"], "tie_word_embeddings": False})
    return None


def gpu_total_memory(device: int) -> int:
    """Total memory of `device` in bytes (the only query that touches a GPU; tests replace it)."""
    import torch

    return int(torch.cuda.get_device_properties(device).total_memory)


def _training_parts(cfg: Mapping[str, Any], shape: Shape, plan: DevicePlan, checkpointing: bool) -> dict[str, float]:
    model, policy = cfg["model"], cfg.get("policy") or {}
    dtype = DTYPE_BYTES.get(str(model.get("dtype", "auto")), 2)
    shards = len(plan.train) if plan.strategy == "fsdp" else 1
    seq = int(model.get("max_seq_len", 2048))
    chunk = min(seq, int(policy.get("logprob_chunk_size") or seq))
    lora = shape.lora_params(int(policy.get("rank", 16)), policy.get("target_modules"))
    return {
        "weights": shape.params() * dtype / shards,
        "LoRA + AdamW": lora * 16 / shards,
        "activations": float(seq * shape.activations_per_token(checkpointing, dtype)),
        "logits": float(chunk * shape.vocab_size * 4 * 3),  # fp32 logits, log-softmax and their gradient
    }


def _serving_parts(cfg: Mapping[str, Any], shape: Shape, backend: str) -> dict[str, float]:
    model, engine = cfg["model"], cfg.get("backend") or {}
    dtype = DTYPE_BYTES.get(str(model.get("dtype", "auto")), 2)
    seq = int(model.get("max_seq_len", 2048))
    parts = {"weights": float(shape.params() * dtype), "KV cache (one max_seq_len sequence)": float(
        seq * shape.kv_per_token(dtype))}  # fmt: skip
    if backend == "vllm":
        slots = int(engine.get("max_loras", 4)) * shape.lora_params(int(engine.get("max_lora_rank", 64)), None)
        parts["LoRA slots"] = float(slots * dtype)
    return parts


def memory_needs(
    cfg: Mapping[str, Any], plan: DevicePlan, shape: Shape, total: Callable[[int], int], checkpointing: bool
) -> list[GpuNeeds]:
    """Every GPU's needs under `plan` (`total(i)`: GPU i's memory in bytes)."""
    headroom = float((cfg["devices"].get("memory") or {}).get("headroom_gib", 2.0)) * GIB
    serve = _serving_parts(cfg, shape, plan.backend) if plan.infer else {}
    engine = "vLLM" if plan.backend == "vllm" else "HF"
    share = plan.infer_memory_fraction or float((cfg.get("backend") or {}).get("gpu_memory_utilization", 0.9))
    out = []
    for gpu in sorted(set(plan.train) | set(plan.infer)):
        size = total(gpu)
        trains, serves = gpu in plan.train, gpu in plan.infer
        if serves and plan.backend == "vllm":  # vLLM takes its share whatever it needs; training gets the rest
            out.append(GpuNeeds(gpu, "serve (vLLM)", size * share, {**serve, "headroom": headroom}))
            size = int(size * (1 - share)) if trains else 0
        elif serves:  # HF: the engine's copy first, training beside it
            out.append(GpuNeeds(gpu, "serve (HF)", size, {**serve, "headroom": headroom}))
            size = int(size - sum(serve.values()) - headroom) if trains else 0
        if trains:
            parts = _training_parts(cfg, shape, plan, checkpointing)
            out.append(GpuNeeds(gpu, "train" + (f" (beside {engine})" if serves else ""), size,
                                {**parts, "headroom": headroom}))  # fmt: skip
    return out


def _refuse(needs: list[GpuNeeds], what: str) -> DevicePlanError:
    lines = "\n  ".join(n.line() for n in needs if n.total > n.budget)
    return DevicePlanError(f"the memory plan does not fit ({what}):\n  {lines}\nChange model.max_seq_len, "
                           "policy.rank, devices.train / devices.infer (a GPU of its own for serving), "
                           "devices.colocate_infer_memory / backend.gpu_memory_utilization, backend.max_loras / "
                           "backend.max_lora_rank, devices.strategy=fsdp, or a smaller model (devices.memory: the "
                           "plan's own settings)")  # fmt: skip


def check_memory(cfg: DictConfig, plan: DevicePlan, total: Callable[[int], int] | None = None) -> list[GpuNeeds]:
    """The memory plan for a resolved device plan on GPUs: logged; `policy.gradient_checkpointing` turned on when
    only checkpointing makes training fit; an impossible plan refused with its numbers. [] on the CPU.

    Raises:
        DevicePlanError: the plan cannot fit (the message has every GPU's needs and the fields to change).
    """
    if not plan.train and not plan.infer or not (cfg.devices.get("memory") or {}).get("check", True):
        return []
    conf: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    shape = model_shape(conf["model"])
    if shape is None:
        log.warning("Memory plan: the shape of %s is unknown (no config.json here, no model.shape): not checked",
                    conf["model"].get("path"))  # fmt: skip
        return []
    on = bool((conf.get("policy") or {}).get("gradient_checkpointing", False))
    total = total or gpu_total_memory
    needs = memory_needs(conf, plan, shape, total, on)
    serving = [n for n in needs if n.role.startswith("serve") and n.total > n.budget]
    if serving:
        raise _refuse(serving, "serving")
    if not on and any(n.total > n.budget for n in needs):
        with_ckpt = memory_needs(conf, plan, shape, total, True)
        if any(n.total > n.budget for n in with_ckpt):
            raise _refuse(with_ckpt, f"training, even with gradient checkpointing, at model.max_seq_len="
                                     f"{conf['model'].get('max_seq_len')}")  # fmt: skip
        before = next(n for n in needs if n.total > n.budget)
        with open_dict(cfg):
            cfg.policy.gradient_checkpointing = True
        log.warning("Memory plan: policy.gradient_checkpointing turned on: without it %s", before.line())
        needs = with_ckpt
    elif any(n.total > n.budget for n in needs):
        raise _refuse(needs, "training with gradient checkpointing")
    for n in needs:
        log.info("Memory plan: %s", n.line())
    return needs
