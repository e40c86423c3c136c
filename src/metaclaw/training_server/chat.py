"""OpenAI chat completions on top of `/v1/sample`: messages → chat template → token ids, and back to text."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

from metaclaw.serving.sampling import SequenceOutput
from metaclaw.thinking import say_no_answer
from metaclaw.training_server.errors import bad_request
from metaclaw.training_server.schemas import ChatCompletionRequest

_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*(.*)$", re.DOTALL)


def _text(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which the text parts are kept."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def prompt_ids(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation with the generation prompt appended (400 when the template refuses it)."""
    messages = []
    for m in req.messages:
        message = m.model_dump(exclude_none=True)
        message["content"] = _text(message.get("content"))
        messages.append(message)
    try:
        text = tokenizer.apply_chat_template(messages, tools=req.tools, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja errors: roles out of order, a template that refuses tools, ...
        raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def split_reasoning(text: str) -> tuple[str, str | None]:
    """`<think>…</think>answer` → (answer, reasoning); text without a think block → (text, None)."""
    match = _THINK.match(text)
    if match:
        return match.group(2), match.group(1).strip()
    if text.lstrip().startswith("<think>"):  # cut off while thinking: no answer, said in the log
        say_no_answer("training server chat", True, None, None)
        return "", text.lstrip()[len("<think>") :].strip()
    return text, None


def completion(
    tokenizer: Any, model: str, n_prompt: int, outputs: list[SequenceOutput], want_logprobs: bool
) -> dict[str, Any]:
    """The non-streaming `chat.completion` object (with token ids, as the policy server returns them)."""
    choices = []
    for i, out in enumerate(outputs):
        content, reasoning = split_reasoning(tokenizer.decode(out.token_ids, skip_special_tokens=True))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
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
                "finish_reason": out.finish_reason,
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
