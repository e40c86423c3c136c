"""The typed schema of the settings people change on the command line (pydantic): a wrong type fails at start.

Only these fields are typed here; every other key of the config tree is left as the YAML has it (`extra="allow"`).
Rules that tie several fields together stay in `metaclaw.config.validate_train_config`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt

Port = Annotated[int, Field(ge=0, le=65535)]  # 0: a free port


class Node(BaseModel):
    model_config = ConfigDict(extra="allow")


class Data(Node):
    batch_size: PositiveInt
    min_batch_size: PositiveInt | None = None
    max_tokens: PositiveInt
    max_backlog: PositiveInt | None = None
    epochs_per_batch: PositiveInt = 1
    backlog_policy: Literal["drop_oldest", "pause_capture"] = "drop_oldest"


class Trainer(Node):
    max_steps: Annotated[int, Field(ge=-1)]
    max_time: str | None = None
    gradient_clip_val: NonNegativeFloat | None = None


class Optimizer(Node):
    lr: PositiveFloat


class Policy(Node):
    rank: PositiveInt
    alpha: PositiveFloat
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0


class Publish(Node):
    every_n_steps: PositiveInt
    keep_last: PositiveInt | None = None
    checkpoint_every_n_steps: PositiveInt


class Server(Node):
    host: str
    port: Port
    metrics_open: bool = False


class Rollout(Node):
    proxy: Server | None = None
    max_backlog: PositiveInt | None = None


class Log(Node):
    format: Literal["text", "json"] = "text"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "debug", "info", "warning", "error"] = "INFO"


class TrainSettings(Node):
    seed: int = 0
    data: Data | None = None
    trainer: Trainer | None = None
    optimizer: Optimizer | None = None
    policy: Policy | None = None
    publish: Publish | None = None
    serve: Server | None = None
    rollout: Rollout | None = None
    log: Log | None = None


class ServeSettings(Node):
    serve: Server | None = None
    log: Log | None = None


SCHEMAS: dict[str, type[Node]] = {"train": TrainSettings, "serve": ServeSettings}
