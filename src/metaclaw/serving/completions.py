"""`/v1/chat/completions` on top of an `Engine`: render the prompt, sample, and shape OpenAI (+vLLM) responses.

Events are plain dicts so they cross the LitServe process boundary: a `head` (`status`, `headers`, and either a
JSON `body` or `stream: true`), then, when streaming, one `{"chunk": ...}` per SSE data line.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from metaclaw.serving.engines.base import Engine, SequenceOutput, TokenDelta
from metaclaw.serving.protocol import ChatRequest
from metaclaw.thinking import say_no_answer
from metaclaw.wire import RequestError, version_headers
from metaclaw.wire.parsing import StreamParser, TextDecoder, assistant_message
from metaclaw.wire.render import chat_prompt_ids


def render_prompt(engine: Engine, req: ChatRequest) -> list[int]:
    """The chat template applied to the messages (and tools) → prompt token ids; too long → 400."""
    try:
        ids = chat_prompt_ids(engine.tokenizer, req.messages, req.tools, req.template_kwargs)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation is the request's fault
        raise RequestError(f"cannot render the conversation with the chat template: {exc}", param="messages") from exc
    if len(ids) >= engine.max_seq_len:
        raise RequestError(
            f"the prompt is {len(ids)} tokens; this model's context (model.max_seq_len) is {engine.max_seq_len}",
            code="context_length_exceeded", param="messages",
        )  # fmt: skip
    return ids


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_choice(
    index: int, out: SequenceOutput, req: ChatRequest, decoder: TextDecoder, tool_format: str = "hermes"
) -> dict[str, Any]:
    message, finish, cut = assistant_message(decoder.text(out.token_ids), out.finish_reason, req.parse_tools,
                                             tool_format)  # fmt: skip
    if cut:
        say_no_answer("policy server", True, finish, req.params.max_tokens)  # cut inside <think>: said, not silent
    stop = decoder.matched_stop(out.token_ids) if finish == "stop" else None
    choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None, "finish_reason": finish,
                              "stop_reason": stop}  # fmt: skip
    if req.logprobs:
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        if req.top_logprobs and out.top_logprobs is None:  # never an empty list where alternatives were asked
            raise RuntimeError("the engine did not report the top_logprobs the request asked for")
        entries = [decoder.logprob_entry(t, lp, top)
                   for t, lp, top in zip(out.token_ids, out.logprobs, tops, strict=True)]  # fmt: skip
        choice["logprobs"] = {"content": entries}
    if req.return_token_ids:
        choice["token_ids"] = list(out.token_ids)
    return choice


def chat_completion(
    engine: Engine, req: ChatRequest, adapter: str | None, tool_format: str = "hermes"
) -> Iterator[dict[str, Any]]:
    """Non-streaming: one `head` event carrying the whole response body; tool calls in `tool_format`."""
    prompt_ids = render_prompt(engine, req)
    outputs = engine.generate(prompt_ids, req.params, adapter)
    decoder = TextDecoder(engine.tokenizer, req.params.stop)
    version = outputs[0].adapter_version if outputs else None
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [chat_choice(i, out, req, decoder, tool_format) for i, out in enumerate(outputs)],
        "usage": _usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    yield {"status": 200, "headers": version_headers(version), "body": body}


def chat_completion_stream(
    engine: Engine, req: ChatRequest, adapter: str | None, tool_format: str = "hermes"
) -> Iterator[dict[str, Any]]:
    """Streaming: a `head` event (status, version header), then one chunk per sampled token, then the finish."""
    prompt_ids = render_prompt(engine, req)
    stream = engine.stream(prompt_ids, req.params, adapter)
    decoder = TextDecoder(engine.tokenizer, req.params.stop)
    parser = StreamParser(parse_tools=req.parse_tools, fmt=tool_format)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": req.model}  # fmt: skip
    yield {"status": 200, "headers": version_headers(stream.adapter_version), "stream": True}
    first: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}  # fmt: skip
    if req.return_token_ids:
        first["prompt_token_ids"] = prompt_ids
    yield {"chunk": first}
    ids: list[int] = []
    sent = 0
    n_calls = 0
    try:
        for delta in stream:
            ids.append(delta.token_id)
            text = decoder.text(ids)
            cut = decoder.safe_prefix_len(text, final=False)
            events = parser.feed(text[sent:cut]) if cut > sent else []
            sent = max(sent, cut)
            chunk, n_calls = _delta_chunk(base, events, n_calls, req, decoder, delta)
            yield {"chunk": chunk}
    finally:
        stream.close()
    text = decoder.text(ids)
    events = (parser.feed(text[sent:]) if len(text) > sent else []) + parser.finish()
    finish = stream.finish_reason or "stop"
    if parser.saw_tool_call and finish == "stop":
        finish = "tool_calls"
    chunk, n_calls = _delta_chunk(base, events, n_calls, req, decoder, None)
    chunk["choices"][0]["finish_reason"] = finish
    chunk["choices"][0]["stop_reason"] = decoder.matched_stop(ids) if finish == "stop" else None
    yield {"chunk": chunk}
    if req.include_usage:
        yield {"chunk": {**base, "choices": [], "usage": _usage(len(prompt_ids), len(ids))}}


def _delta_chunk(
    base: dict[str, Any], events: list[tuple[str, Any]], n_calls: int, req: ChatRequest, decoder: TextDecoder,
    token: TokenDelta | None,
) -> tuple[dict[str, Any], int]:  # fmt: skip
    delta: dict[str, Any] = {}
    for kind, value in events:
        if kind == "tool_call":
            delta.setdefault("tool_calls", []).append({"index": n_calls, **value})
            n_calls += 1
        else:
            key = "content" if kind == "content" else "reasoning_content"
            delta[key] = delta.get(key, "") + value
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    if token is not None:
        if req.logprobs:
            choice["logprobs"] = {"content": [decoder.logprob_entry(token.token_id, token.logprob)]}
        if req.return_token_ids:
            choice["token_ids"] = [token.token_id]
    elif req.return_token_ids:
        choice["token_ids"] = []
    return {**base, "choices": [choice]}, n_calls
