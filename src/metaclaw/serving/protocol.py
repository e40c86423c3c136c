"""Request validation for the OpenAI-compatible routes: raw JSON → typed requests, or a `RequestError` (4xx).

Everything a client can get wrong is checked here, before any model work, with a message that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from metaclaw.wire import RequestError
from metaclaw.wire.normalize import chat_template_messages
from metaclaw.wire.sampling import SamplingParams, sampling_params


def model_not_found(name: str) -> RequestError:
    return RequestError(f"The model `{name}` does not exist.", 404, "model_not_found", "model", "NotFoundError")


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{key} must be a number, got {value!r}", param=key)
    if not lo <= value <= hi:
        raise RequestError(f"{key} must be in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def _int(body: dict, key: str, default: int | None, lo: int, hi: int = 2**31 - 1) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{key} must be an integer, got {value!r}", param=key)
    if not lo <= value <= hi:
        raise RequestError(f"{key} must be in [{lo}, {hi}], got {value!r}", param=key)
    return value


def _bool(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be a boolean, got {value!r}", param=key)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 8 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a non-empty string or a list of up to 8 of them", param="stop")
    return stop


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model must be a non-empty string", param="model")
    return model


def read_sampling(body: dict, default_max_tokens: int, allow_zero: bool = False) -> SamplingParams:
    """The sampling fields shared by chat and completions requests, read from the raw body (OpenAI's ranges) and
    built by the one `metaclaw.wire.sampling.sampling_params`."""
    max_tokens = _int(body, "max_completion_tokens", None, 0)
    max_tokens = _int(body, "max_tokens", max_tokens, 0)
    if max_tokens == 0 and not allow_zero:
        raise RequestError("max_tokens must be at least 1", param="max_tokens")
    return sampling_params(
        _int(body, "n", 1, 1, 16),
        _stop(body),
        allow_zero=allow_zero,
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        top_k=_int(body, "top_k", -1, -1),  # 0 is off as well (SamplingParams)
        seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
        cache_salt=_salt(body),
    )


def _salt(body: dict) -> str | None:
    """vLLM's `cache_salt`: the tenant whose cached prefixes a request may reuse (the proxy sets one per agent and
    client key; docs/security.md)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= 256):
        raise RequestError("cache_salt must be a string of 1 to 256 characters", param="cache_salt")
    return salt


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
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of objects", param="tools")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    req = ChatRequest(
        model=_model(body),
        messages=chat_template_messages(body.get("messages")),
        params=read_sampling(body, default_max_tokens),
        tools=tools or None,
        parse_tools=bool(tools) and body.get("tool_choice") != "none",
        stream=_bool(body, "stream"),
        include_usage=_bool(stream_options, "include_usage"),
        logprobs=_bool(body, "logprobs"),
        top_logprobs=_int(body, "top_logprobs", 0, 0, 20),
        return_token_ids=_bool(body, "return_token_ids"),
        template_kwargs=template_kwargs,
    )
    if req.stream and req.params.n != 1:
        raise RequestError("stream=true supports n=1 only", param="n")
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


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) < 0:
            raise RequestError("prompt token ids must be non-negative", param="prompt")
        return value
    raise RequestError("prompt must be a non-empty string or a list of token ids (one prompt)", param="prompt")


def parse_completion_request(body: Any, default_max_tokens: int = 16) -> CompletionRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if _bool(body, "stream"):
        raise RequestError("stream=true is not supported on /v1/completions", param="stream")
    req = CompletionRequest(
        model=_model(body),
        prompt=_prompt(body.get("prompt")),
        params=read_sampling(body, default_max_tokens, allow_zero=True),
        echo=_bool(body, "echo"),
        logprobs=_int(body, "logprobs", None, 0, 20),
        prompt_logprobs=_int(body, "prompt_logprobs", None, 0, 20),
        return_token_ids=_bool(body, "return_token_ids"),
        logprobs_mode=body.get("logprobs_mode") or "raw_logprobs",
    )
    if req.logprobs_mode not in LOGPROBS_MODES:
        raise RequestError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}", param="logprobs_mode")
    if req.params.max_tokens == 0 and not (req.echo or req.prompt_logprobs is not None):
        raise RequestError("max_tokens=0 needs echo=true or prompt_logprobs", param="max_tokens")
    return req


def parse_load_request(body: Any) -> tuple[str, str, int | None]:
    """`(lora_name, lora_path, adapter_version)`: vLLM's fields, and metaclaw's optional version of the adapter
    (the trainer sends the version it published; without it the adapter folder's own record is used)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise RequestError("lora_name must be a non-empty string", param="lora_name")
    if not isinstance(path, str) or not path:
        raise RequestError("lora_path must be a non-empty string", param="lora_path")
    version = body.get("adapter_version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise RequestError("adapter_version must be a non-negative integer", param="adapter_version")
    return name, path, version


def parse_unload_request(body: Any) -> str:
    if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
        raise RequestError("lora_name must be a non-empty string", param="lora_name")
    return body["lora_name"]
