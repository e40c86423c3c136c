"""`train.py` with FSDP over CPU processes (gloo): the test's launcher for `test_fsdp_on_cpu_processes...`.

Lightning runs `FSDPStrategy` on CUDA only, for three reasons, all lifted here and nothing else:
1. its accelerator check refuses `FSDPStrategy` with `accelerator="cpu"` ("The strategy `fsdp` requires a GPU
   accelerator", checked on the exact class, so a subclass passes);
2. it wraps with `device_id=root_device.index`, which is None on CPU, and torch's FSDP then refuses ("FSDP needs a
   non-CPU accelerator device"); torch's FSDP runs on CPU with gloo given `device_id=torch.device("cpu")`.
3. its full state dict (checkpoints) asks FSDP to offload to CPU, which segfaults when the parameters already are
   on CPU (torch 2.13, `FullStateDictConfig(offload_to_cpu=True)`); here it is asked without offloading.
Everything else is the product's path: the composed config, `metaclaw.devices.fsdp_options` (LoRA wrap policy,
original parameters, full state dict), `OnlineRLModule`, the publisher gathering the shards. Lightning's
launcher re-runs this file for rank 1, so every rank gets the same substitution.

    python tests/entrypoints/fsdp_on_cpu.py <train.py overrides> devices.cpu_processes=2
"""

from __future__ import annotations

import hydra
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies import fsdp as lightning_fsdp
from omegaconf import DictConfig
from torch.distributed.fsdp import FullyShardedDataParallel

from metaclaw import config, devices
from metaclaw.cli import train_main
from metaclaw.config import CONFIG_DIR


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, wrapping on the CPU device (Lightning then sees the model already wrapped)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                         sharding_strategy=self.sharding_strategy,
                                         mixed_precision=self.mixed_precision_config, device_id=torch.device("cpu"),
                                         **self.kwargs)  # fmt: skip
        self.kwargs.pop("auto_wrap_policy", None)  # applied above
        return super()._setup_model(model)


def full_state_dict_on_cpu(module: torch.nn.Module, world_size: int, rank0_only: bool = True):
    """Lightning's `_get_full_state_dict_context`, without `offload_to_cpu` (the parameters are on CPU)."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

    return FullyShardedDataParallel.state_dict_type(
        module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )  # fmt: skip


def trainer_kwargs(devs) -> dict:
    kwargs = devices.trainer_kwargs(devs)
    kwargs["strategy"] = CPUFSDPStrategy(process_group_backend="gloo", **devices.fsdp_options(devs.get("fsdp")))
    return kwargs


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """train.py's main; this file stays `sys.argv[0]`, which Lightning's launcher re-runs for rank 1."""
    return train_main.__wrapped__(cfg)


if __name__ == "__main__":
    config.trainer_kwargs = trainer_kwargs
    lightning_fsdp._get_full_state_dict_context = full_state_dict_on_cpu
    main()
