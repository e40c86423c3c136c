"""OpenAI chat completions on top of `/v1/sample`: messages → chat template → token ids, and back to text."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from metaclaw.thinking import say_no_answer
from metaclaw.training_server.errors import bad_request
from metaclaw.training_server.schemas import ChatCompletionRequest
from metaclaw.wire import RequestError
from metaclaw.wire.normalize import chat_template_messages
from metaclaw.wire.parsing import TextDecoder, assistant_message, tool_format_for
from metaclaw.wire.render import chat_prompt_ids
from metaclaw.wire.sampling import SequenceOutput


def prompt_ids(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation with the generation prompt appended, rendered exactly as the policy server
    renders them (`metaclaw.wire.render.chat_prompt_ids` over `chat_template_messages`: one renderer); 400 naming
    the field when the messages or the template refuse."""
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        return chat_prompt_ids(tokenizer, chat_template_messages(messages), req.tools, req.chat_template_kwargs)
    except RequestError as exc:
        raise bad_request(exc.message, exc.param) from exc
    except Exception as exc:  # jinja errors: roles out of order, a template that refuses tools, ...
        raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc


def completion(
    tokenizer: Any, model: str, n_prompt: int, outputs: list[SequenceOutput], want_logprobs: bool, tools: bool = False
) -> dict[str, Any]:
    """The non-streaming `chat.completion` object (with token ids, as the policy server returns them); reasoning
    and tool calls (`tools`: the request offered some) parsed as the policy server parses them
    (`metaclaw.wire.parsing.parse_completion`)."""
    choices, decoder = [], TextDecoder(tokenizer, [])  # the policy server's decode: end-of-turn tokens dropped
    for i, out in enumerate(outputs):
        text = decoder.text(out.token_ids)
        message, finish, cut = assistant_message(text, out.finish_reason, tools, tool_format_for(tokenizer))
        if cut:
            say_no_answer("training server chat", True, finish, None)  # cut inside <think>: said, not silent
        logprobs = None
        if want_logprobs:
            logprobs = {
                "content": [
                    {"token": tokenizer.decode([t]), "logprob": lp, "top_logprobs": []}
                    for t, lp in zip(out.token_ids, out.logprobs, strict=True)
                ]
            }
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": logprobs,
                "token_ids": out.token_ids,
            }
        )
    n_completion = sum(len(o.token_ids) for o in outputs)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion,
        },
    }


def stream_chunks(body: dict[str, Any]) -> Iterator[str]:
    """Server-sent events for a finished completion: role, content, finish reason + usage, `[DONE]`."""
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    for choice in body["choices"]:
        i, message = choice["index"], choice["message"]
        yield f"data: {json.dumps({**base, 'choices': [{'index': i, 'delta': {'role': 'assistant'}}]})}\n\n"
        delta = {k: v for k, v in message.items() if k != "role"}
        yield f"data: {json.dumps({**base, 'choices': [{'index': i, 'delta': delta}]})}\n\n"
        end = {"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}
        yield f"data: {json.dumps({**base, 'choices': [end], 'usage': body['usage']})}\n\n"
    yield "data: [DONE]\n\n"
