"""The PEFT policy wrapper, model sources, the online LightningModule and the adapter publisher."""

from metaclaw.modules.loading import ModelSpec
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.modules.policy import LoraPolicy
from metaclaw.modules.publisher import AdapterPublisher

__all__ = ["AdapterPublisher", "LoraPolicy", "ModelSpec", "OnlineRLModule"]
