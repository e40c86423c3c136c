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
from dataclasses import dataclass
from typing import Any

from metaclaw.messages import content_text
from metaclaw.serving.render import chat_prompt_ids

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


@dataclass
class ContextPolicy:
    """Fit the prompt into the model's context.

    Args:
        mode: `truncate` or `off`.
        max_context_tokens: the model's context; None: the upstream card's `max_model_len`.
        reserve_tokens: room kept for the reply when the request sets no `max_tokens` (capped at half the context).
        tool_result_placeholder: what an elided tool result says instead.
        tokenizer: the served model's tokenizer (its chat template counts the tokens); None disables the policy.
    """

    mode: str = "truncate"
    max_context_tokens: int | None = None
    reserve_tokens: int = 256
    tool_result_placeholder: str = "[tool result omitted: context limit]"
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
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:  # fmt: skip
        """The messages to send and what the policy did (None when nothing was needed)."""
        limit = self.limit(card)
        if not self.active or limit is None:
            return messages, None
        reserve = min(max_tokens or self.reserve_tokens, limit // 2)
        budget = limit - reserve
        # An upper bound without tokenising: a token is at least one byte (byte-level BPE, byte fallback) and ASCII
        # JSON escapes are at least as long as UTF-8; 64 tokens a message for the template's own markup.
        rough = sum(len(json.dumps(m)) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        if rough + 64 * (len(messages) + 1) + (512 if tools else 0) < budget:  # + the template's tools preamble
            return messages, None
        try:
            before = self.count(messages, tools)
        except Exception as e:  # noqa: BLE001 - the server renders the same template and answers 400 itself
            log.warning("Context policy: cannot render the conversation (%s); forwarded as is", e)
            return messages, None
        if before <= budget:
            return messages, None
        action: dict[str, Any] = {"action": "truncated", "prompt_tokens_before": before, "limit": limit,
                                  "budget": budget}  # fmt: skip
        msgs = [dict(m) for m in messages]
        n_sys = next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=len(msgs) - 1)
        n = before
        # 1. the oldest tool results (never the newest message) become a placeholder, oldest first
        elided, estimate = 0, n
        placeholder_len = len(self._tokens(self.tool_result_placeholder))
        for i in range(n_sys, len(msgs) - 1):
            if estimate <= budget:
                break
            if msgs[i].get("role") == "tool" and msgs[i].get("content") != self.tool_result_placeholder:
                estimate -= len(self._tokens(content_text(msgs[i].get("content")))) - placeholder_len
                msgs[i]["content"] = self.tool_result_placeholder
                elided += 1
        if elided:
            n = self.count(msgs, tools)
        # 2. the oldest exchanges dropped whole (up to the next user message), never the newest user message
        dropped = 0
        while n > budget and n_sys < last_user:
            end = next((j for j in range(n_sys + 1, last_user + 1) if msgs[j].get("role") == "user"), last_user)
            dropped += end - n_sys
            del msgs[n_sys:end]
            last_user -= end - n_sys
            n = self.count(msgs, tools)
        # 3. the system prompt's tail, then 4. the newest message's head (re-tokenising is not additive: repeat)
        for idx, keep_head, key in ((n_sys - 1, True, "system_trimmed_tokens"),
                                    (len(msgs) - 1, False, "last_trimmed_tokens")):  # fmt: skip
            if idx < 0 or not isinstance(msgs[idx].get("content"), str):
                continue
            original, cut = self._tokens(msgs[idx]["content"]), 0
            for _ in range(4):
                if n <= budget or cut >= len(original):
                    break
                cut = min(len(original), cut + n - budget + 8)
                kept = self.tokenizer.decode(original[: len(original) - cut] if keep_head else original[cut:])
                note = f"[{cut} tokens omitted: context limit]"
                msgs[idx]["content"] = f"{kept}\n{note}" if keep_head else f"{note}\n{kept}"
                action[key] = cut
                n = self.count(msgs, tools)
        action.update(tool_results_elided=elided, messages_dropped=dropped, prompt_tokens_after=n)
        if n > budget:
            action["action"] = "unfit"  # forwarded: the server answers 400 context_length_exceeded
            log.warning("Context policy could not fit the prompt: %s", action)
        return msgs, action


@dataclass
class ClientFit:
    """The proxy's per-turn fitting: images, then the context (see the module docstring)."""

    images: ImagePolicy
    context: ContextPolicy

    def apply(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, has_image: bool,
        card: dict[str, Any] | None, max_tokens: int | None, meta: dict[str, Any],
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Fitted messages; `meta` gains `images`/`dropped` and `context` entries when a policy acted."""
        if has_image:
            messages, image_meta = self.images.apply(messages, card)
            meta.update(image_meta)
        if not any(isinstance(m.get("content"), list) for m in messages):
            try:
                messages, action = self.context.fit(messages, tools, card, max_tokens)
            except Exception as e:  # noqa: BLE001 - the policy must never fail a turn: forward it as is
                log.exception("Context policy failed; the turn is forwarded unchanged")
                action = {"action": "error", "error": f"{type(e).__name__}: {e}"}
            if action is not None:
                meta["context"] = action
        return messages


def build_fit(proxy_cfg: Any, tokenizer: Any) -> ClientFit:
    """`ClientFit` from `rollout.proxy.images` / `rollout.proxy.context` and the served model's tokenizer."""
    images = dict(proxy_cfg.get("images") or {})
    context = dict(proxy_cfg.get("context") or {})
    fit = ClientFit(ImagePolicy(**images), ContextPolicy(**context, tokenizer=tokenizer))
    if fit.context.mode != "off" and tokenizer is None:
        log.warning("Context policy %r is off: the proxy has no tokenizer of the served model", fit.context.mode)
    return fit
