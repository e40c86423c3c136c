"""Request and response bodies of seed 000's API, field for field; validation errors name the field.

Requests ignore unknown keys (a newer client may send more); numbers must be finite; token ids are
non-negative integers (the vocabulary bound is checked against the loaded model by the engine).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TokenId = Annotated[int, Field(strict=True, ge=0)]
Seed = Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Tokens = Annotated[list[TokenId], Field(min_length=1)]


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class HealthResponse(BaseModel):
    status: str
    gpu_count: int
    model: str
    step: int
    inference_backend: str
    version: str


class LoraCreateRequest(Request):
    base_model: str = ""
    rank: Annotated[int, Field(strict=True, ge=1, le=1024)] = 32


class LoraCreateResponse(BaseModel):
    session_id: str
    status: str
    model: str
    rank: int
    trainable_params: str


class Datum(Request):
    """One training sequence in Tinker's layout: `target_tokens[t]` follows `model_input_tokens[:t+1]`.

    `logprobs` are the behaviour (sampler) logprobs of `target_tokens` (0.0 on prompt positions). The loss
    mask is `mask`, else `weights` (Tinker), else where `advantages` is non-zero.
    """

    model_input_tokens: Tokens
    target_tokens: Tokens
    logprobs: list[Finite]
    advantages: list[Finite]
    mask: list[Finite] | None = None
    weights: list[Finite] | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> Datum:
        n = len(self.model_input_tokens)
        for name in ("target_tokens", "logprobs", "advantages", "mask", "weights"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but model_input_tokens has {n}")
        return self

    def loss_mask(self) -> list[float]:
        if self.mask is not None:
            return self.mask
        if self.weights is not None:
            return self.weights
        return [1.0 if a != 0.0 else 0.0 for a in self.advantages]


class ForwardBackwardRequest(Request):
    session_id: str
    datums: Annotated[list[Datum], Field(min_length=1)]
    loss_fn: str = "importance_sampling"
    loss_fn_config: dict[str, Any] | None = Field(
        default=None,
        description="Settings the chosen loss declares (validated per loss; anything else is a 400): "
        "`aggregation` (token-mean | seq-mean | sum) for every loss; `clip_low`, `clip_high` or Tinker's "
        "`clip_low_threshold`, `clip_high_threshold` for ppo and cispo.",
    )
    temperature: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)] | None = Field(
        default=None,
        description="Omitted: each datum is scored under the distribution that sampled it on this server "
        "(see the distribution rule). Given: this temperature (and top_p/top_k) for every datum.",
    )
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None


class ForwardBackwardResponse(BaseModel):
    status: str
    loss: float
    total_tokens: int
    num_datums: int
    metrics: dict[str, float] = {}


class LoraDeleteRequest(Request):
    session_id: str


class LoraDeleteResponse(BaseModel):
    status: str
    session_id: str
    deleted: bool


class SessionInfo(BaseModel):
    session_id: str
    model: str
    rank: int
    step: int
    idle_s: float


class SessionsResponse(BaseModel):
    sessions: list[SessionInfo]
    max_sessions: int


class OptimStepRequest(Request):
    session_id: str
    learning_rate: Annotated[float, Field(ge=0, le=1.0, allow_inf_nan=False)] = 1e-4
    beta1: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] | None = None
    beta2: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] | None = None
    eps: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    weight_decay: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    grad_clip_norm: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=None, description="Clip the global gradient norm to this (0: no clipping); omitted: app.grad_clip_norm."
    )


class OptimStepResponse(BaseModel):
    status: str
    step: int
    grad_norm: float
    avg_loss: float
    learning_rate: float


class SaveRequest(Request):
    session_id: str
    name: str = ""


class WeightsSaveResponse(BaseModel):
    status: str
    adapter_path: str
    step: int


class CheckpointSaveResponse(BaseModel):
    status: str
    path: str


class CheckpointLoadRequest(Request):
    session_id: str
    path: Annotated[str, Field(min_length=1)]


class CheckpointLoadResponse(BaseModel):
    status: str
    step: int


class SampleRequest(Request):
    """`/v1/sample`; `stop` may hold strings (matched on text) or token ids (Tinker allows both)."""

    tokens: Tokens
    num_samples: Annotated[int, Field(strict=True, ge=1)] = 1
    temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] = 1.0
    max_tokens: Annotated[int, Field(strict=True, ge=1)] = 256
    top_k: Annotated[int, Field(strict=True, ge=-1)] = -1
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    stop: str | list[str] | list[TokenId] | None = None
    seed: Seed | None = None
    session_id: str | None = None
    prompt_logprobs: bool = False
    include_prompt_logprobs: bool = False
    base_model: bool = False
    use_adapter: bool = True


class TextPart(Request):
    """The one content part this text-only server reads."""

    type: Literal["text"]
    text: str


class FunctionCall(Request):
    name: str
    arguments: str


class ToolCall(Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatSampling(Request):
    """The sampling fields of an OpenAI chat request (built by `metaclaw.wire.sampling.sampling_params`)."""

    temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=-1)] = -1
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    n: Annotated[int, Field(strict=True, ge=1)] = 1
    stop: str | list[str] | None = None
    seed: Seed | None = None


class ChatCompletionRequest(ChatSampling):
    """OpenAI chat completions; `session_id` (or `model` naming a session) picks the adapter."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str | None = None
    session_id: str | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    use_adapter: bool = True


FinishReason = Literal["stop", "length"]
