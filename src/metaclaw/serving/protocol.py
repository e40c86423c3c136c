"""Request validation for the OpenAI-compatible routes: raw JSON → typed requests, or a `RequestError` (4xx).

Everything a client can get wrong is checked here, before any model work, with a message that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metaclaw.wire import RequestError
from metaclaw.wire.normalize import chat_template_messages
from metaclaw.wire.sampling import SamplingParams, sampling_params
from metaclaw.wire.schemas import (
    ChatCompletionBody,
    CompletionBody,
    LoadAdapterBody,
    Sampling,
    UnloadAdapterBody,
    validated,
)


def model_not_found(name: str) -> RequestError:
    return RequestError(f"The model `{name}` does not exist.", 404, "model_not_found", "model", "NotFoundError")


def read_sampling(body: Sampling, default_max_tokens: int, allow_zero: bool = False) -> SamplingParams:
    """The sampling fields shared by chat and completions requests (validated by the schema), built by the one
    `metaclaw.wire.sampling.sampling_params`."""
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    if max_tokens == 0 and not allow_zero:
        raise RequestError("max_tokens must be at least 1", param="max_tokens")
    return sampling_params(
        body.n or 1,
        body.stop,
        allow_zero=allow_zero,
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,  # 0 is off as well (SamplingParams)
        seed=body.seed,
        cache_salt=body.cache_salt,
    )


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_chat_request(body: Any, default_max_tokens: int) -> ChatRequest:
    """A chat request checked against the one schema (`metaclaw.wire.schemas.ChatCompletionBody`)."""
    v = validated(ChatCompletionBody, body)
    req = ChatRequest(
        model=v.model,
        messages=chat_template_messages(body["messages"]),
        params=read_sampling(v, default_max_tokens),
        tools=v.tools or None,
        parse_tools=bool(v.tools) and v.tool_choice != "none",
        stream=bool(v.stream),
        include_usage=bool(v.stream_options and v.stream_options.include_usage),
        logprobs=bool(v.logprobs),
        top_logprobs=v.top_logprobs or 0,
        return_token_ids=bool(v.return_token_ids),
        template_kwargs=v.chat_template_kwargs or {},
    )
    if req.stream and req.params.n != 1:
        raise RequestError("stream=true supports n=1 only", param="n")
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    if req.top_logprobs and req.stream:
        raise RequestError("top_logprobs is answered without streaming (stream=false)", param="top_logprobs")
    req.params.top_logprobs = req.top_logprobs
    return req


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    params: SamplingParams
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    logprobs_mode: str = "raw_logprobs"
    prompt_logprobs_from: int = 1  # the context's length: the first token always is (`CompletionBody`)


def _prompt(value: str | list[Any]) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        if min(value) < 0:
            raise RequestError("prompt token ids must be non-negative", param="prompt")
        return value
    raise RequestError("prompt must be a non-empty string or a list of token ids (one prompt)", param="prompt")


def parse_completion_request(body: Any, default_max_tokens: int = 16) -> CompletionRequest:
    """A completions request checked against the one schema (`metaclaw.wire.schemas.CompletionBody`)."""
    v = validated(CompletionBody, body)
    if v.stream:
        raise RequestError("stream=true is not supported on /v1/completions", param="stream")
    req = CompletionRequest(
        model=v.model,
        prompt=_prompt(v.prompt),
        params=read_sampling(v, default_max_tokens, allow_zero=True),
        echo=bool(v.echo),
        logprobs=v.logprobs,
        prompt_logprobs=v.prompt_logprobs,
        return_token_ids=bool(v.return_token_ids),
        logprobs_mode=v.logprobs_mode or "raw_logprobs",
        prompt_logprobs_from=v.prompt_logprobs_from or 1,
    )
    if req.params.max_tokens == 0 and not (req.echo or req.prompt_logprobs is not None):
        raise RequestError("max_tokens=0 needs echo=true or prompt_logprobs", param="max_tokens")
    return req


def parse_load_request(body: Any) -> tuple[str, str, int | None]:
    """`(lora_name, lora_path, adapter_version)`: vLLM's fields, and metaclaw's optional version of the adapter
    (the trainer sends the version it published; without it the adapter folder's own record is used)."""
    v = validated(LoadAdapterBody, body)
    return v.lora_name, v.lora_path, v.adapter_version


def parse_unload_request(body: Any) -> str:
    return validated(UnloadAdapterBody, body).lora_name
