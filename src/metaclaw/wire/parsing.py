"""Split generated text into reasoning (`<think>…</think>`), content and tool calls, in the tool-call format of
the served model's family, one parser per family:

- `hermes`: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call, text around
  (Qwen 2.5/3, Hermes, ChatML models);
- `llama3`: `{"name": …, "parameters": {…}}` as the whole reply (`;` between calls), or after `<|python_tag|>`
  (Llama 3.1/3.2/3.3);
- `mistral`: `[TOOL_CALLS][{"name": …, "arguments": {…}}]`, or `[TOOL_CALLS]name[ARGS]{…}` (tokenizer v11+).

`detect_tool_format` picks the format from the chat template's text (`serve.tool_call_format` overrides it);
`parse_completion` handles a whole completion; `StreamParser` does the same incrementally for SSE, holding back
only text that could still be the start of a tag (and a reply that is a call, until it is complete).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_TOOL_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)
TOOL_FORMATS = ("hermes", "llama3", "mistral")


def _call(name: str, args: Any, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}  # fmt: skip


def tool_call_from_json(text: str) -> dict[str, Any] | None:
    """An OpenAI `tool_calls` entry from `{"name": ..., "arguments": {...}}`; None if the JSON is not a call."""
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call(obj["name"], obj.get("arguments", obj.get("parameters", {})), f"call_{uuid.uuid4().hex[:24]}")


class HermesToolCalls:
    """Qwen / Hermes / ChatML: `<tool_call>{json}</tool_call>` blocks anywhere in the reply."""

    name = "hermes"
    open_tags: tuple[str, ...] = (TOOL_OPEN,)
    close_tag: str | None = TOOL_CLOSE
    bare_json = False

    def parse(self, body: str) -> list[dict[str, Any]] | None:
        call = tool_call_from_json(body)
        if call is not None:
            return [call]
        try:  # SmolLM2 was tuned to write a list of calls in one block: `<tool_call>[{...}, {...}]</tool_call>`
            items = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = [tool_call_from_json(json.dumps(item)) for item in items]
        found = [c for c in calls if c is not None]
        return found if len(found) == len(calls) else None

    def split(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, calls) of a whole reply (after its reasoning); malformed blocks stay in the content."""
        calls: list[dict[str, Any]] = []
        if TOOL_OPEN not in text:
            return text, calls

        def take(match: re.Match) -> str:
            got = self.parse(match.group(1))
            if got is None:
                return match.group(0)
            calls.extend(got)
            return ""

        return _TOOL_BLOCK.sub(take, text), calls


class _TailToolCalls:
    """Formats whose calls run from a marker to the end of the reply."""

    name = ""
    open_tags: tuple[str, ...] = ()
    close_tag: str | None = None
    bare_json = False  # a reply that starts with `{` is a call (no marker)

    def parse(self, body: str) -> list[dict[str, Any]] | None:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        hits = [(text.find(t), t) for t in self.open_tags if t in text]
        if hits:
            pos, tag = min(hits)
            calls = self.parse(text[pos + len(tag) :])
            if calls:
                return text[:pos], calls
        if self.bare_json and text.lstrip().startswith("{"):
            calls = self.parse(text)
            if calls:
                return "", calls
        return text, []


def _json_objects(text: str, separators: str = "; \n\t,") -> list[Any] | None:
    """The JSON values in `text`, one after another (separated by `separators`); None if anything else is there."""
    decoder, i = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)


class Llama3ToolCalls(_TailToolCalls):
    """Llama 3.1/3.2/3.3 JSON tool calling: the reply is `{"name": …, "parameters": {…}}` (calls separated by `;`),
    optionally after `<|python_tag|>`. Built-in tools' Python calls (`brave_search.call(...)`) stay content."""

    name = "llama3"
    open_tags = (PYTHON_TAG,)
    bare_json = True

    def parse(self, body: str) -> list[dict[str, Any]] | None:
        objs = _json_objects(body.strip())
        if not objs or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs):
            return None
        return [_call(o["name"], o.get("parameters", o.get("arguments", {})), f"call_{uuid.uuid4().hex[:24]}")
                for o in objs]  # fmt: skip


class MistralToolCalls(_TailToolCalls):
    """Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (tokenizer v3), or `[TOOL_CALLS]name[ARGS]{…}`
    repeated (v11+, `[CALL_ID]id` optional). Call ids are 9 alphanumerics: Mistral's templates refuse others."""

    name = "mistral"
    open_tags = (MISTRAL_CALLS,)

    @staticmethod
    def new_id() -> str:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def parse(self, body: str) -> list[dict[str, Any]] | None:
        body = body.strip()
        if body.startswith("["):
            objs = _json_objects(body)
            if not objs or not isinstance(objs[0], list):
                return None
            items = [o for group in objs for o in (group if isinstance(group, list) else [group])]
            if not items or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in items):
                return None
            return [_call(o["name"], o.get("arguments", o.get("parameters", {})), self._id(o.get("id")))
                    for o in items]  # fmt: skip
        calls = []
        for piece in body.split(MISTRAL_CALLS):
            if MISTRAL_ARGS not in piece:
                return None
            head, args = piece.split(MISTRAL_ARGS, 1)
            name, _, given = head.partition(MISTRAL_CALL_ID)
            objs = _json_objects(args.strip(), " \n\t")
            if not name.strip() or objs is None or len(objs) != 1 or not isinstance(objs[0], dict):
                return None
            calls.append(_call(name.strip(), objs[0], self._id(given.strip())))
        return calls or None

    def _id(self, given: Any) -> str:
        return given if isinstance(given, str) and len(given) == 9 and given.isalnum() else self.new_id()


ToolCallFormat = HermesToolCalls | Llama3ToolCalls | MistralToolCalls
PARSERS: dict[str, ToolCallFormat] = {"hermes": HermesToolCalls(), "llama3": Llama3ToolCalls(),
                                      "mistral": MistralToolCalls()}  # fmt: skip


def detect_tool_format(chat_template: Any) -> str:
    """The tool-call format a chat template teaches its model: `mistral` (`[TOOL_CALLS]`/`[AVAILABLE_TOOLS]`),
    `llama3` (`<|python_tag|>`, or Llama 3's headers with JSON `parameters`), else `hermes` (`<tool_call>`, and
    the fallback: what ChatML models without a tool format of their own are best prompted with)."""
    if isinstance(chat_template, dict):  # a tokenizer with named templates: the default, else the tool-use one
        chat_template = chat_template.get("tool_use") or chat_template.get("default") or ""
    if isinstance(chat_template, list):  # [{"name": ..., "template": ...}]
        chat_template = " ".join(t.get("template", "") for t in chat_template if isinstance(t, dict))
    text = chat_template if isinstance(chat_template, str) else ""
    if MISTRAL_CALLS in text or "[AVAILABLE_TOOLS]" in text:
        return "mistral"
    if TOOL_OPEN in text:
        return "hermes"
    if PYTHON_TAG in text or ("<|start_header_id|>" in text and '"parameters"' in text):
        return "llama3"
    return "hermes"


def tool_format_for(tokenizer: Any, override: str | None = None) -> str:
    """`override` when set (not `auto`; must be one of `TOOL_FORMATS`), else the one `tokenizer`'s template names."""
    if override and override != "auto":
        if override not in PARSERS:
            raise ValueError(f"serve.tool_call_format must be auto or one of {list(PARSERS)}, got {override!r}")
        return override
    return detect_tool_format(getattr(tokenizer, "chat_template", None))


@dataclass
class ParsedCompletion:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest). A lone `</think>` means the template opened the block in the prompt (Qwen3)."""
    if THINK_CLOSE in text:
        head, rest = text.split(THINK_CLOSE, 1)
        reasoning = head.split(THINK_OPEN, 1)[1] if THINK_OPEN in head else head
        before = head.split(THINK_OPEN, 1)[0] if THINK_OPEN in head else ""
        return reasoning.strip("\n") or None, (before + rest).lstrip("\n")
    if THINK_OPEN in text:  # unterminated (cut by max_tokens): everything after the tag is reasoning
        before, reasoning = text.split(THINK_OPEN, 1)
        return reasoning.strip("\n") or None, before
    return None, text


def parse_completion(text: str, parse_tools: bool = True, fmt: str = "hermes") -> ParsedCompletion:
    """Reasoning, content and tool calls (in format `fmt`) of a complete generation; malformed calls stay content."""
    reasoning, rest = split_reasoning(text)
    calls: list[dict[str, Any]] = []
    if parse_tools:
        rest, calls = PARSERS[fmt].split(rest)
    content = rest.strip() if calls else rest
    return ParsedCompletion(content=content or (None if calls else ""), reasoning_content=reasoning, tool_calls=calls)


def assistant_message(
    text: str, finish_reason: str, parse_tools: bool = True, fmt: str = "hermes"
) -> tuple[dict[str, Any], str, bool]:
    """`(message, finish reason, cut while thinking)` of a complete reply, as every server answers it: reasoning
    and tool calls parsed (`parse_completion`), `tool_calls` the finish reason of a reply that called one, and
    whether the length limit cut it inside `<think>` with no answer (the caller says so: `thinking.say_no_answer`)."""
    parsed = parse_completion(text, parse_tools=parse_tools, fmt=fmt)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content is not None:
        message["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    finish = "tool_calls" if parsed.tool_calls and finish_reason == "stop" else finish_reason
    cut = finish == "length" and bool(parsed.reasoning_content) and not (parsed.content or "").strip()
    return message, finish, cut


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                best = max(best, k)
                break
    return best


class StreamParser:
    """Incremental `parse_completion`: `feed(text)` / `finish()` return events for SSE deltas.

    Events are `("content", str)`, `("reasoning", str)` and `("tool_call", dict)`. Modes: `content`, `think`,
    `tool` (inside a `<tool_call>` block) and `tail` (a call that runs to the end: Llama 3, Mistral; parsed at
    `finish`, given back as content if it is not one).
    """

    def __init__(self, parse_tools: bool = True, fmt: str = "hermes") -> None:
        self.parse_tools = parse_tools
        self.fmt: ToolCallFormat = PARSERS[fmt]
        self._buf = ""
        self._mode = "content"  # content | think | tool | tail
        self._tail_tag = ""
        self._said = False  # whether any content went out (a bare JSON call must start the answer)
        self.saw_tool_call = False

    def _tags(self) -> tuple[str, ...]:
        if self._mode == "think":
            return (THINK_CLOSE,)
        if self._mode == "tool":
            return (self.fmt.close_tag or "",)
        return (THINK_OPEN, THINK_CLOSE, *self.fmt.open_tags) if self.parse_tools else (THINK_OPEN, THINK_CLOSE)

    def _bare(self) -> str | None:
        """For formats whose call may be the bare reply: `wait` while only blanks came, `call` once it opens."""
        if not (self.parse_tools and self.fmt.bare_json and self._mode == "content" and not self._said):
            return None
        head = self._buf.lstrip()
        if not head or THINK_OPEN.startswith(head) or head.startswith(THINK_OPEN):
            return "wait" if not head else None
        return "call" if head.startswith("{") else None

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        events: list[tuple[str, Any]] = []
        while self._mode != "tail":
            bare = self._bare()
            if bare == "call":
                self._mode, self._tail_tag, self._buf = "tail", "", self._buf.lstrip()
                break
            if bare == "wait":
                return events
            tags = self._tags()
            hits = [(self._buf.find(t), t) for t in tags if t in self._buf]
            if not hits:
                break
            pos, tag = min(hits)
            before, self._buf = self._buf[:pos], self._buf[pos + len(tag) :]
            self._emit(events, before)
            if tag == THINK_OPEN:
                self._mode = "think"
            elif tag == THINK_CLOSE:
                self._mode = "content"
            elif self._mode == "tool":
                self._close_tool(events, before)
            elif self.fmt.close_tag is not None:
                self._mode = "tool"
            else:
                self._mode, self._tail_tag = "tail", tag
        if self._mode not in ("tool", "tail"):
            keep = _partial_tag_len(self._buf, self._tags())
            ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            self._emit(events, ready)
        return events

    def _emit(self, events: list[tuple[str, Any]], text: str) -> None:
        if not text or self._mode in ("tool", "tail"):
            return
        kind = "reasoning" if self._mode == "think" else "content"
        self._said = self._said or (kind == "content" and bool(text.strip()))
        events.append((kind, text))

    def _close_tool(self, events: list[tuple[str, Any]], body: str) -> None:
        calls = self.fmt.parse(body)
        if calls is None:
            events.append(("content", f"{TOOL_OPEN}{body}{TOOL_CLOSE}"))
        else:
            self.saw_tool_call = True
            events.extend(("tool_call", c) for c in calls)
        self._mode = "content"

    def finish(self) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        if self._mode == "tool":  # unterminated call: give the raw text back as content
            events.append(("content", TOOL_OPEN + self._buf))
        elif self._mode == "tail":
            calls = self.fmt.parse(self._buf)
            if calls:
                self.saw_tool_call = True
                events.extend(("tool_call", c) for c in calls)
            else:
                events.append(("content", self._tail_tag + self._buf))
        elif self._buf:
            events.append(("reasoning" if self._mode == "think" else "content", self._buf))
        self._buf = ""
        return events


_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>")


def end_token_ids(tokenizer: Any) -> set[int]:
    """Ids that end a turn: their text never goes into `content` (the ids still go into `token_ids`)."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _END_TOKENS if t in vocab)
    return {i for i in ids if i is not None}


class TextDecoder:
    """Token ids → text, without end-of-turn tokens, cut before the first stop string."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.end_ids = end_token_ids(tokenizer)

    def text(self, token_ids: list[int]) -> str:
        ids = [t for t in token_ids if t not in self.end_ids]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def matched_stop(self, token_ids: list[int]) -> str | None:
        """The stop string that ended the text (the earliest found), as vLLM's `stop_reason` reports it."""
        if not self.stop:
            return None
        text = self.tokenizer.decode([t for t in token_ids if t not in self.end_ids], skip_special_tokens=False)
        found = [(text.find(s), s) for s in self.stop if s in text]
        return min(found)[1] if found else None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprob_entry(self, token_id: int, logprob: float, top: Sequence[tuple[int, float]] = ()) -> dict[str, Any]:
        """OpenAI's `choices[i].logprobs.content[j]`, with `top` (`(id, logprob)`, most likely first) as its
        `top_logprobs`."""
        token = self.token_text(token_id)
        alternatives = [{"token": (t := self.token_text(i)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                        for i, lp in top]  # fmt: skip
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": alternatives}

    def safe_prefix_len(self, text: str, final: bool) -> int:
        """How much of `text` can be sent now: hold back a trailing partial UTF-8 char or stop-string prefix."""
        if final:
            return len(text)
        end = len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[:end].endswith(s[:k]):
                    return end - k
        return end
