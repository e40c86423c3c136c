"""Make any client's turn fit the served model: images for a text-only model, contexts longer than the model.

`ImagePolicy`: images pass through when the upstream accepts them, else each becomes a short text placeholder
the model can read; either way the turn is recorded as not trainable (`meta.dropped`), since the trainer is
text-only. `ContextPolicy`: when the rendered prompt would not fit the model's context (minus room for the
reply), the oldest tool results are elided first, then the oldest exchanges dropped, then the system prompt's
tail and finally the newest message's head trimmed; the system prompt and the newest messages stay. `mode: off`
forwards as is (the server answers 400 `context_length_exceeded`). The policy's action goes into `meta.context`;
the sample's `prompt_ids` are what the server rendered from the fitted messages, so training sees exactly what
the model saw.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from types import MappingProxyType
from typing import Any

from metaclaw.messages import content_text
from metaclaw.wire.render import chat_prompt_ids

log = logging.getLogger(__name__)


def card_modalities(card: dict[str, Any]) -> list[str] | None:
    """The input modalities a `/v1/models` card declares (`input_modalities` or `architecture.input_modalities`)."""
    mods = card.get("input_modalities")
    if mods is None and isinstance(card.get("architecture"), dict):
        mods = card["architecture"].get("input_modalities")
    return [str(m) for m in mods] if isinstance(mods, list) else None


@dataclass
class ImagePolicy:
    """What happens to image parts.

    Args:
        mode: `auto` (pass through only when the upstream model card declares image input), `placeholder`
            (always replace) or `passthrough` (always forward).
        placeholder: the text that replaces each image.
    """

    mode: str = "auto"
    placeholder: str = "[image omitted: this model reads text only]"

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "placeholder", "passthrough"):
            raise ValueError(f"images.mode must be auto|placeholder|passthrough, got {self.mode!r}")

    def passes(self, card: dict[str, Any] | None) -> bool:
        if self.mode != "auto":
            return self.mode == "passthrough"
        mods = card_modalities(card or {})
        return bool(mods) and "image" in mods

    def apply(self, messages: list[dict[str, Any]], card: dict[str, Any] | None) -> tuple[list[dict], dict]:
        """Messages for upstream, and the `meta` entries that record what happened to the images."""
        if self.passes(card):
            return messages, {"images": "passthrough", "dropped": "image: the trainer is text-only"}
        out, n = [], 0
        for m in messages:
            if isinstance(m.get("content"), list):
                texts = []
                for part in m["content"]:
                    if part.get("type") == "image_url":
                        n += 1
                        texts.append(self.placeholder)
                    else:
                        texts.append(content_text([part]))
                m = {**m, "content": "\n".join(t for t in texts if t)}
            out.append(m)
        reason = f"image: {n} image(s) replaced by a text placeholder (text-only model)"
        return out, {"images": "placeholder", "images_replaced": n, "dropped": reason}


def slim_tools(tools: list[dict[str, Any]], level: int) -> list[dict[str, Any]]:
    """Tool definitions with less prose and the same names and argument schemas (what a call needs).

    Level 1 drops every description inside the parameters' schemas and keeps each tool's first sentence
    (at most 200 characters); level 2 drops the tools' descriptions too.
    """

    def strip(schema: Any, names: bool = False) -> Any:  # names: the keys are property names, all kept
        if isinstance(schema, dict):
            return {
                k: strip(v, k in ("properties", "patternProperties", "$defs", "definitions") and not names)
                for k, v in schema.items()
                if names or k not in ("description", "examples", "title")
            }
        if isinstance(schema, list):
            return [strip(v) for v in schema]
        return schema

    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else None
        if fn is None:
            out.append(tool)
            continue
        fn = {**fn, "parameters": strip(fn.get("parameters"))} if "parameters" in fn else dict(fn)
        text = fn.pop("description", None)
        if level < 2 and isinstance(text, str) and text:
            fn["description"] = text.split(". ")[0].split("\n")[0][:200]
        out.append({**tool, "function": fn})
    return out


@dataclass
class ContextPolicy:
    """Fit the prompt into the model's context.

    Args:
        mode: `truncate` or `off`.
        max_context_tokens: the model's context; None: the upstream card's `max_model_len`.
        reserve_tokens: room kept for the reply: the request's `max_tokens`, at most the larger of this and an
            eighth of the context (an agent asking for 32,000 tokens of a 8,192-token model still gets its
            prompt in; the server stops the reply at the context's end, `finish_reason: length`). A request that
            sets no `max_tokens` is given this as its reply budget (the proxy sends it upstream).
        tool_result_placeholder: what an elided tool result says instead.
        trim_quantum_tokens: trims are rounded up to a multiple of this, so that the same system prompt is cut
            the same way on every turn of a conversation and the server reuses its cached prefix.
        tokenizer: the served model's tokenizer (its chat template counts the tokens); None disables the policy.
    """

    mode: str = "truncate"
    max_context_tokens: int | None = None
    reserve_tokens: int = 1024
    tool_result_placeholder: str = "[tool result omitted: context limit]"
    trim_quantum_tokens: int = 512
    tokenizer: Any = None

    def __post_init__(self) -> None:
        if self.mode not in ("truncate", "off"):
            raise ValueError(f"context.mode must be truncate|off, got {self.mode!r}")

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.tokenizer is not None

    def limit(self, card: dict[str, Any] | None) -> int | None:
        if self.max_context_tokens:
            return int(self.max_context_tokens)
        value = (card or {}).get("max_model_len")
        return int(value) if isinstance(value, int) and value > 0 else None

    def count(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        """Prompt tokens as the chat template renders them (the server renders the same way)."""
        return len(chat_prompt_ids(self.tokenizer, messages, tools))

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def fit(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, card: dict[str, Any] | None,
        max_tokens: int | None,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any] | None]:  # fmt: skip
        """The messages and tools to send and what the policy did (None when nothing was needed)."""
        limit = self.limit(card)
        if not self.active or limit is None:
            return messages, tools, None
        reserve = min(max_tokens or self.reserve_tokens, max(self.reserve_tokens, limit // 8), limit // 2)
        budget = limit - reserve
        # An upper bound without tokenising: a token is at least one byte (byte-level BPE, byte fallback) and ASCII
        # JSON escapes are at least as long as UTF-8; 64 tokens a message for the template's own markup.
        rough = sum(len(json.dumps(m)) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        if rough + 64 * (len(messages) + 1) + (512 if tools else 0) < budget:  # + the template's tools preamble
            return messages, tools, None
        try:
            before = self.count(messages, tools)
        except Exception as e:  # noqa: BLE001 - the server renders the same template and answers 400 itself
            log.warning("Context policy: cannot render the conversation (%s); forwarded as is", e)
            return messages, tools, None
        if before <= budget:
            return messages, tools, None
        action: dict[str, Any] = {"action": "truncated", "prompt_tokens_before": before, "limit": limit,
                                  "budget": budget}  # fmt: skip
        msgs = [dict(m) for m in messages]
        n = self._elide_tool_results(msgs, tools, before, budget, action)
        tools, n = self._slim_tools(msgs, tools, n, budget, action)
        n = self._drop_old_exchanges(msgs, tools, n, budget, action)
        n = self._trim_ends(msgs, tools, n, budget, action)
        action["prompt_tokens_after"] = n
        if n > budget:
            action["action"] = "unfit"  # forwarded: the server answers 400 context_length_exceeded
            log.warning("Context policy could not fit the prompt: %s", action)
        else:
            log.info("Context policy fitted a %d-token prompt into %d (of %d): %s", before, n, limit,
                     {k: v for k, v in action.items() if k not in ("action", "limit", "budget")})  # fmt: skip
        return msgs, tools, action

    @staticmethod
    def _first_turn(msgs: list[dict[str, Any]]) -> int:
        return next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))

    def _elide_tool_results(
        self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, n: int, budget: int,
        action: dict[str, Any],
    ) -> int:  # fmt: skip
        """1. The oldest tool results (never the newest message) become a placeholder, oldest first."""
        elided, estimate = 0, n
        placeholder_len = len(self._tokens(self.tool_result_placeholder))
        for i in range(self._first_turn(msgs), len(msgs) - 1):
            if estimate <= budget:
                break
            if msgs[i].get("role") == "tool" and msgs[i].get("content") != self.tool_result_placeholder:
                estimate -= len(self._tokens(content_text(msgs[i].get("content")))) - placeholder_len
                msgs[i]["content"] = self.tool_result_placeholder
                elided += 1
        action["tool_results_elided"] = elided
        return self.count(msgs, tools) if elided else n

    def _slim_tools(
        self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, n: int, budget: int,
        action: dict[str, Any],
    ) -> tuple[list[dict[str, Any]] | None, int]:  # fmt: skip
        """2. Tool definitions lose their prose (names and argument schemas stay: the tools stay usable)."""
        for level in (1, 2):
            if n <= budget or not tools:
                break
            tools = slim_tools(tools, level)
            n = self.count(msgs, tools)
            action["tools_slimmed"] = level
        return tools, n

    def _drop_old_exchanges(
        self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, n: int, budget: int,
        action: dict[str, Any],
    ) -> int:  # fmt: skip
        """3. The oldest exchanges dropped whole (up to the next user message), never the newest user message."""
        n_sys = self._first_turn(msgs)
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=len(msgs) - 1)
        dropped = 0
        while n > budget and n_sys < last_user:
            end = next((j for j in range(n_sys + 1, last_user + 1) if msgs[j].get("role") == "user"), last_user)
            dropped += end - n_sys
            del msgs[n_sys:end]
            last_user -= end - n_sys
            n = self.count(msgs, tools)
        action["messages_dropped"] = dropped
        return n

    def _trim_ends(
        self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, n: int, budget: int,
        action: dict[str, Any],
    ) -> int:  # fmt: skip
        """4. The longest system message's tail, then 5. the newest message's head (re-tokenising is not additive).

        Cuts are whole multiples of `trim_quantum_tokens`, so a long conversation's system prompt is cut the same
        way turn after turn (a stable prefix for the server's cache) until it needs the next quantum.
        """
        q = max(1, self.trim_quantum_tokens)
        leading = [i for i in range(self._first_turn(msgs)) if isinstance(msgs[i].get("content"), str)]
        longest = max(leading, key=lambda i: len(msgs[i]["content"]), default=-1)  # Codex sends two: trim the big one
        for idx, keep_head, key in ((longest, True, "system_trimmed_tokens"),
                                    (len(msgs) - 1, False, "last_trimmed_tokens")):  # fmt: skip
            if idx < 0 or not isinstance(msgs[idx].get("content"), str):
                continue
            text, original, cut = msgs[idx]["content"], self._tokens(msgs[idx]["content"]), 0
            for _ in range(6):
                if n <= budget or cut >= len(original):
                    break
                cut = min(len(original), -(-(cut + n - budget + 8) // q) * q)
                kept = self.tokenizer.decode(original[: len(original) - cut] if keep_head else original[cut:])
                note = f"[{cut} tokens omitted: context limit]"
                msgs[idx]["content"] = f"{kept}\n{note}" if keep_head else f"{note}\n{kept}"
                action[key] = cut
                n = self.count(msgs, tools)
            if cut and msgs[idx]["content"] == text:  # pragma: no cover - decode changed nothing
                break
        return n


@dataclass
class ClientFit:
    """The proxy's per-turn fitting: images, then the context (see the module docstring)."""

    images: ImagePolicy
    context: ContextPolicy

    def apply(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, has_image: bool,
        card: dict[str, Any] | None, max_tokens: int | None, meta: dict[str, Any],
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:  # fmt: skip
        """Fitted messages and tools; `meta` gains `images`/`dropped` and `context` entries when a policy acted."""
        if has_image:
            messages, image_meta = self.images.apply(messages, card)
            meta.update(image_meta)
        if any(isinstance(m.get("content"), list) for m in messages):
            # only image parts passed through to a multimodal model stay lists (wire/normalize.py flattens text
            # parts): their tokens are the server's to count, so the prompt goes as sent, and the turn says so
            if self.context.mode != "off":
                meta["context"] = {"action": "skipped", "reason": "image parts passed through: not counted here"}
        else:
            try:
                messages, tools, action = self.context.fit(messages, tools, card, max_tokens)
            except Exception as e:  # noqa: BLE001 - the policy must never fail a turn: forward it as is
                log.exception("Context policy failed; the turn is forwarded unchanged")
                action = {"action": "error", "error": f"{type(e).__name__}: {e}"}
            if action is not None:
                meta["context"] = action
        return messages, tools


def policy_settings(policy: type) -> Mapping[str, Any]:
    """A policy's settings and their defaults (read-only): the defaults of `rollout.proxy.images` / `.context`."""
    settings = {f.name: f.default for f in fields(policy) if f.name != "tokenizer" and f.default is not MISSING}
    return MappingProxyType(settings)


def build_fit(proxy_cfg: Any, tokenizer: Any) -> ClientFit:
    """`ClientFit` from `rollout.proxy.images` / `rollout.proxy.context` and the served model's tokenizer."""
    images = dict(proxy_cfg.get("images") or {})
    context = dict(proxy_cfg.get("context") or {})
    fit = ClientFit(ImagePolicy(**images), ContextPolicy(**context, tokenizer=tokenizer))
    if fit.context.mode != "off" and tokenizer is None:
        log.warning("Context policy %r is off: the proxy has no tokenizer of the served model", fit.context.mode)
    return fit
