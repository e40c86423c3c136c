"""The rollout proxy's request bodies as pydantic models: each route validates its JSON body against its model at
the route's entry (`metaclaw.wire.schemas.validated`: a 400 naming the field, in the route's error shape), and
`/openapi.json` publishes the same models (`PROXY_BODIES`), so the document cannot drift from what is accepted.

Lenient where the proxy is: unknown fields are kept (agents send many; the proxy passes them on to the upstream,
which checks its own), content is a string or a list of parts, and every role and part type the normalisers take
(`metaclaw.wire.normalize`, `metaclaw.rollout.anthropic`, `metaclaw.rollout.responses`) is allowed: OpenClaw's
`toolResult` role and `toolCall`/`toolResult`/`thinking` parts, Anthropic's `system` turn inside `messages`
(Claude Code 2.x), Codex's tool-call and reasoning items. Strict where the proxy refuses: types are strict (`"5"`
is not 5, `true` is not 1) and the ranges are the ones the proxy answers 400 for. The normalisers still run after
the gate and check what a schema cannot (an image part's URL, an item's arguments as JSON).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from metaclaw.wire.schemas import Body, openapi_schema

Count = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1)]
TemplateValue = str | int | float | bool | None
TemplateKwargs = Annotated[dict[str, TemplateValue], Field(max_length=16)]


class Lenient(Body):
    """A JSON object the proxy passes on: strict types for the fields it reads, every other field kept."""

    model_config = ConfigDict(extra="allow", strict=True)


class Part(Lenient):
    """A content part: text (`text`, `input_text`, `output_text`, any other string type read as text), an image
    (`image_url`, `image`, `input_image`: the image policy decides), OpenClaw's `toolCall`/`toolResult`, or
    reasoning (`thinking`, `reasoning`: dropped)."""

    type: str | None = None


class ChatMessage(Lenient):
    """An OpenAI chat message, or OpenClaw's (`toolResult` role, parts that carry tool calls and results)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "toolResult"]
    content: str | list[str | Part] | None = None
    tool_calls: list[Lenient] | None = None


class Sampling(Lenient):
    """The sampling fields the proxy reads itself (the rest pass on to the upstream, which checks them)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    chat_template_kwargs: TemplateKwargs | None = None


class ChatBody(Sampling):
    """`POST /v1/chat/completions`: OpenAI's chat request, as OpenClaw, hermes and the SDKs send it."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Lenient] | None = Field(None, description="OpenAI function tools, or Anthropic-shaped tools")


class CompletionsBody(Lenient):
    """`POST /v1/completions`: passed through to the upstream (not captured), which validates the rest."""

    model: str | None = None
    prompt: str | list[Any] = Field(description="text, or a list of strings or token ids")


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class SystemBlock(Lenient):
    """A block of `system` (its text is what counts)."""

    type: str | None = None
    text: str


class ImageBlock(Lenient):
    type: Literal["image"]
    source: dict[str, Any] = Field(description="base64 `data` (+ `media_type`) or a `url`")


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: Any = None
    name: str
    input: dict[str, Any] = {}


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: Any = None
    content: str | list[Any] | None = None


class ThinkingBlock(Lenient):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(Lenient):
    """A turn in `messages`: `user` and `assistant`, and `system` (Claude Code 2.x sends its environment notes as a
    system turn mid-conversation; its content is text only)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class AnthropicCommon(Lenient):
    model: str | None = None
    system: str | list[SystemBlock] | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    tools: list[Lenient] | None = Field(None, description="Anthropic tools (`name`, `input_schema`) or OpenAI's")


class ToolChoice(Lenient):
    type: str | None = None
    name: Any = None


class MessagesBody(AnthropicCommon):
    """`POST /v1/messages`: Anthropic's Messages request (Claude Code)."""

    max_tokens: Count
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: TemplateKwargs | None = None


class CountTokensBody(AnthropicCommon):
    """`POST /v1/messages/count_tokens`."""


class ResponsesMessage(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Any = Field(None, description="a string or a list of content parts (input_text, output_text, ...)")


class ResponsesCall(Lenient):
    type: Literal["function_call", "custom_tool_call", "local_shell_call"]


class ResponsesCallOutput(Lenient):
    type: Literal["function_call_output", "custom_tool_call_output", "local_shell_call_output"]
    call_id: Annotated[str, Field(min_length=1)]


class ResponsesReasoning(Lenient):
    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    """An input item's kind; an item without `type` is a message (as OpenAI's API reads it)."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type", "message")
    return {"custom_tool_call": "function_call", "local_shell_call": "function_call",
            "custom_tool_call_output": "function_call_output",
            "local_shell_call_output": "function_call_output"}.get(kind, kind)  # fmt: skip


Item = Annotated[
    Annotated[ResponsesMessage, Tag("message")]
    | Annotated[ResponsesCall, Tag("function_call")]
    | Annotated[ResponsesCallOutput, Tag("function_call_output")]
    | Annotated[ResponsesReasoning, Tag("reasoning")],
    Discriminator(_item_type),
]


class ResponsesBody(Lenient):
    """`POST /v1/responses`: OpenAI's Responses request (Codex). Stateless: the whole conversation in `input`."""

    model: str | None = None
    instructions: str | None = None
    input: str | Annotated[list[Item], Field(min_length=1)]
    tools: list[Lenient] | None = Field(None, description="function tools (hosted tools are left out, logged)")
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    previous_response_id: None = Field(None, description="refused: send the whole conversation in `input`")
    conversation: None = Field(None, description="refused (a stored server-side object): send `input`")
    prompt: None = Field(None, description="refused (a stored server-side prompt): send `input`")


class SessionDoneBody(Lenient):
    """`POST /v1/sessions/done`: the session to end (the body's `session_id`, else the `X-Session-Id` header)."""

    session_id: str | None = None


PROXY_SCHEMAS: dict[str, type[Body]] = {
    "/v1/chat/completions": ChatBody,
    "/v1/responses": ResponsesBody,
    "/v1/completions": CompletionsBody,
    "/v1/messages": MessagesBody,
    "/v1/messages/count_tokens": CountTokensBody,
    "/v1/sessions/done": SessionDoneBody,
}
"""The proxy's POST routes and the schema each validates with (and publishes)."""
PROXY_BODIES = {path: openapi_schema(schema) for path, schema in PROXY_SCHEMAS.items()}
"""Generated from the schemas the proxy validates with: no second copy."""
