"""The policy server's request bodies as pydantic models: the one schema that validates each request
(`validated`, a `RequestError` naming the field) and that `/openapi.json` publishes (`openapi_schema`), so the
document cannot drift from what the server accepts.

Unknown fields are ignored (OpenAI's and vLLM's clients send many); types are strict (`"5"` is not 5, `true` is
not 1). Rules that tie fields together (chat needs `max_tokens >= 1`, `stream` needs `n = 1`) stay with the
parser (`metaclaw.serving.protocol`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from metaclaw.messages import TEXT_PART_TYPES
from metaclaw.wire import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")

Name = Annotated[str, Field(min_length=1)]
Stop = Annotated[str, Field(min_length=1)]


class Body(BaseModel):
    """A JSON request body: strict types, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(Body):
    type: Literal[TEXT_PART_TYPES]  # type: ignore[valid-type]
    text: str


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, Any]


class ChatMessage(Body):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[str | TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class Sampling(Body):
    """The sampling fields of chat and completions requests (`metaclaw.wire.sampling.sampling_params` builds them)."""

    model: Name
    max_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(ge=1e-6, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=8)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    return_token_ids: bool | None = None


class StreamOptions(Body):
    include_usage: bool | None = None


class ChatCompletionBody(Sampling):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionBody(Sampling):
    """`POST /v1/completions`: one prompt, text or token ids (a batch of one is taken)."""

    prompt: str | list[int] | list[str | list[int]]
    stream: bool | None = None
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None
    # metaclaw's: the first k prompt tokens are context, read in one step as a generation reads its prompt (their
    # prompt logprobs null); the rest are scored along the path a reply sampled after them took. vLLM ignores it.
    prompt_logprobs_from: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None


class LoadAdapterBody(Body):
    """`POST /v1/load_lora_adapter`: vLLM's fields, and metaclaw's optional version of the adapter."""

    lora_name: Name
    lora_path: Name
    adapter_version: Annotated[int, Field(ge=0)] | None = None


class UnloadAdapterBody(Body):
    """`POST /v1/unload_lora_adapter`."""

    lora_name: Name


B = TypeVar("B", bound=Body)
_TAG = re.compile(r"[-\[]")  # a union member's tag in an error's location (`constrained-str`, `list[int]`)
_INSTANCE = re.compile(r" or instance of \w+")
_TYPES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _where(loc: tuple[Any, ...]) -> list[str]:
    """An error's location without the union tags pydantic adds (`str`, `list[...]`, `constrained-str`)."""
    return [str(part) for part in loc if not _TAG.search(str(part)) and str(part) not in _TYPES | _models(Body)]


def _models(cls: type[BaseModel]) -> set[str]:
    """The names of `cls`'s subclasses: a union of models tags an error's location with the branch's name."""
    return {name for sub in cls.__subclasses__() for name in (sub.__name__, *_models(sub))}


def validated(schema: type[B], body: Any) -> B:
    """`body` checked against `schema`; a `RequestError` (400) naming the first offending field otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        # the deepest error (a union's string branch fails at the field, its list branch inside the item at fault)
        err = max(errors, key=lambda e: len(_where(e["loc"])))
        where = ".".join(_where(err["loc"])) or "body"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        msg = _INSTANCE.sub("", err["msg"])  # "a valid dictionary or instance of ChatMessage": our class, not theirs
        raise RequestError(f"{where}: {msg}{more}", param=str(err["loc"][0]) if err["loc"] else None) from None


def _published(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with its `$ref`s inlined, `title`s and discriminator mappings dropped, and `X | None` (null: the
    field's default) written as X."""
    if isinstance(node, list):
        return [_published(v, defs) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _published(defs[ref.removeprefix("#/$defs/")], defs)
    # a discriminator's mapping names `$defs` entries, gone once inlined: each branch's `type` const tells them apart
    out = {k: _published(v, defs) for k, v in node.items() if k not in ("$defs", "title", "discriminator")}
    if out.get("default", 0) is None:
        del out["default"]
    branches = out.get("anyOf")
    if isinstance(branches, list) and {"type": "null"} in branches:
        rest = [b for b in branches if b != {"type": "null"}]
        out.pop("anyOf")
        out = {**(rest[0] if len(rest) == 1 else {"anyOf": rest}), **out}
    return out


def openapi_schema(schema: type[Body]) -> dict[str, Any]:
    """`schema`'s JSON Schema as an OpenAPI request body publishes it: definitions inlined (no `$defs`), an
    optional field as its type (null and absent both take the default)."""
    raw = schema.model_json_schema()
    return _published(raw, raw.get("$defs", {}))


POLICY_SERVER_SCHEMAS: dict[str, type[Body]] = {
    "/v1/chat/completions": ChatCompletionBody,
    "/v1/completions": CompletionBody,
    "/v1/load_lora_adapter": LoadAdapterBody,
    "/v1/unload_lora_adapter": UnloadAdapterBody,
}
"""The policy server's POST routes and the schema each validates with (and publishes)."""
