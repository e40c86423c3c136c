"""The policy server's operations over one `Engine`, independent of the HTTP framework.

`PolicyService.handle(op, body)` yields events (see `metaclaw.serving.completions`); every client mistake becomes an
OpenAI-style error event with a 4xx status, so the server never answers 500 for bad input.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from metaclaw import profiling
from metaclaw.serving.completions import chat_completion, chat_completion_stream
from metaclaw.serving.engines.base import AdapterError, Engine, TokenScore, UnknownAdapterError
from metaclaw.serving.protocol import (
    model_not_found,
    parse_chat_request,
    parse_completion_request,
    parse_load_request,
    parse_unload_request,
)
from metaclaw.wire import RequestError, version_headers
from metaclaw.wire.parsing import TextDecoder, tool_format_for
from metaclaw.wire.security import confine_path

log = logging.getLogger(__name__)

Events = Iterator[dict[str, Any]]


def error_event(err: RequestError) -> dict[str, Any]:
    return {"status": err.status, "headers": {}, "body": err.body()}


class PolicyService:
    """Chat/completions/models/adapter operations on an engine.

    Args:
        engine: the inference engine.
        adapter_root: `/v1/load_lora_adapter` paths must resolve inside it.
        default_max_tokens: completion budget when a chat request sets none (None: the rest of the context).
        model_root: shown as the base model's `root` in `/v1/models`.
        info: the server's effective config, shown as the base model's `metaclaw` field in `/v1/models`.
        tool_call_format: how the model writes tool calls (`metaclaw.wire.parsing`): `auto` (from its chat
            template), `hermes`, `llama3` or `mistral`.
    """

    def __init__(
        self,
        engine: Engine,
        adapter_root: str | Path,
        default_max_tokens: int | None = None,
        model_root: str = "",
        info: dict[str, Any] | None = None,
        tool_call_format: str = "auto",
    ) -> None:
        self.info = info
        self.engine = engine
        self.tool_format = tool_format_for(engine.tokenizer, tool_call_format)
        log.info("Tool calls parsed in the %s format (serve.tool_call_format=%s)", self.tool_format, tool_call_format)
        if info is not None:
            info.setdefault("effective", {})["tool_call_format"] = self.tool_format
        self.adapter_root = Path(adapter_root)
        self.default_max_tokens = default_max_tokens
        self.model_root = model_root or engine.model_name
        self.created = int(time.time())
        self._paths: dict[str, str] = {}
        self._ops: dict[str, Callable[[Any], Events]] = {
            "chat": self.chat,
            "completions": self.completions,
            "models": self.models,
            "load_adapter": self.load_adapter,
            "unload_adapter": self.unload_adapter,
        }

    def handle(self, op: str, body: Any) -> Events:
        """Run `op`; errors become error events (4xx for the client's mistakes, 500 with a log line otherwise)."""
        try:
            with profiling.for_purpose(body.get("user") if isinstance(body, dict) else None):
                yield from self._ops[op](body)
        except RequestError as err:
            yield error_event(err)
        except UnknownAdapterError as err:
            yield error_event(model_not_found(err.name))
        except (ValueError, AdapterError) as err:
            yield error_event(RequestError(str(err)))
        except Exception:
            log.exception("%s failed", op)
            yield error_event(RequestError("internal error (see the server log)", 500, type_="internal_server_error"))

    def _adapter_for(self, model: str) -> str | None:
        """The OpenAI `model` field → None (base) or an adapter name; unknown → 404 `model_not_found`."""
        if model in (self.engine.model_name, self.model_root):
            return None
        if model in self.engine.adapters():
            return model
        raise model_not_found(model)

    def _default_max_tokens(self) -> int:
        return self.default_max_tokens or self.engine.max_seq_len

    # ---------------------------------------------------------------- generation

    def chat(self, body: Any) -> Events:
        req = parse_chat_request(body, self._default_max_tokens())
        adapter = self._adapter_for(req.model)
        handler = chat_completion_stream if req.stream else chat_completion
        yield from handler(self.engine, req, adapter, self.tool_format)

    def completions(self, body: Any) -> Events:
        """Legacy completions, with vLLM's `prompt_logprobs` and `echo` scoring (the teacher-logprobs route)."""
        req = parse_completion_request(body)
        adapter = self._adapter_for(req.model)
        tok = self.engine.tokenizer
        ids = tok(req.prompt)["input_ids"] if isinstance(req.prompt, str) else list(req.prompt)
        if not ids:
            raise RequestError("the prompt is empty after tokenisation", param="prompt")
        if max(ids) >= len(tok):
            raise RequestError(f"prompt token id {max(ids)} is outside the vocabulary ({len(tok)})", param="prompt")
        if len(ids) >= self.engine.max_seq_len + (req.params.max_tokens == 0):
            raise RequestError(f"the prompt is {len(ids)} tokens; model.max_seq_len is {self.engine.max_seq_len}",
                               code="context_length_exceeded", param="prompt")  # fmt: skip
        version = self.engine.adapter_version(adapter)
        outputs = self.engine.generate(ids, req.params, adapter) if req.params.max_tokens > 0 else []
        if outputs:
            version = outputs[0].adapter_version
        scores: list[TokenScore | None] | None = None
        if req.prompt_logprobs is not None or (req.echo and req.logprobs is not None):
            # vLLM's prompt logprobs are raw; `logprobs_mode: processed_logprobs` (our extension, echoed in the
            # choice) scores them under the request's temperature/top-p/top-k, as sampled tokens are.
            p = req.params
            dist = (p.temperature, p.top_p, p.top_k) if req.logprobs_mode == "processed_logprobs" else (1.0, 1.0, -1)
            k = req.prompt_logprobs_from  # the context: read in one step, as a generation reads its prompt
            if k >= len(ids):
                raise RequestError(f"prompt_logprobs_from ({k}) must be less than the prompt's {len(ids)} tokens",
                                   param="prompt_logprobs_from")  # fmt: skip
            scores = [None] * (k - 1) + self.engine.score_tokens(ids[:k], ids[k:], adapter, *dist)
        decoder = TextDecoder(tok, req.params.stop)
        prompt_text = tok.decode(ids, skip_special_tokens=False)
        choices = []
        for i, out in enumerate(outputs or [None]):
            gen_ids = out.token_ids if out else []
            choice: dict[str, Any] = {
                "index": i,
                "text": (prompt_text if req.echo else "") + (decoder.text(gen_ids) if out else ""),
                "logprobs": None,
                "finish_reason": out.finish_reason if out else "length",
                "prompt_logprobs": None,
            }
            if req.prompt_logprobs is not None and scores is not None:
                choice["logprobs_mode"] = req.logprobs_mode
                choice["prompt_logprobs"] = [None] + [
                    None if s is None else
                    {str(t): {"logprob": s.logprob, "rank": s.rank, "decoded_token": decoder.token_text(t)}}
                    for t, s in zip(ids[1:], scores, strict=True)
                ]  # fmt: skip
            if req.logprobs is not None:
                choice["logprobs"] = self._legacy_logprobs(ids if req.echo else [], scores, out, decoder)
            if req.return_token_ids:
                choice["token_ids"] = list(gen_ids)
                choice["prompt_token_ids"] = ids
            choices.append(choice)
        completion = sum(len(o.token_ids) for o in outputs)
        body = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": completion,
                "total_tokens": len(ids) + completion,
            },  # fmt: skip
        }
        yield {"status": 200, "headers": version_headers(version), "body": body}

    @staticmethod
    def _legacy_logprobs(echo_ids: list[int], scores, out, decoder: TextDecoder) -> dict[str, Any]:
        """OpenAI's legacy shape: `tokens`, `token_logprobs` (first prompt token: null), `top_logprobs`."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        if echo_ids:
            tokens = [decoder.token_text(t) for t in echo_ids]
            token_logprobs = [None, *(None if s is None else s.logprob for s in scores)]
        if out is not None:
            tokens += [decoder.token_text(t) for t in out.token_ids]
            token_logprobs += list(out.logprobs)
        top = [None if lp is None else {tok: lp} for tok, lp in zip(tokens, token_logprobs, strict=True)]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    # ---------------------------------------------------------------- models and adapters

    def models(self, body: Any = None) -> Events:
        def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": model_id, "object": "model", "created": self.created, "owned_by": "metaclaw",
                    "root": root, "parent": parent, "max_model_len": self.engine.max_seq_len,
                    "input_modalities": ["text"], "permission": []}  # fmt: skip

        data = [card(self.engine.model_name, self.model_root, None)]
        if self.info is not None:
            data[0]["metaclaw"] = self.info
        for name, version in sorted(self.engine.adapters().items()):
            data.append({**card(name, self._paths.get(name, name), self.engine.model_name), "adapter_version": version})
        yield {"status": 200, "headers": {}, "body": {"object": "list", "data": data}}

    def load_adapter(self, body: Any) -> Events:
        name, raw_path, wanted = parse_load_request(body)
        try:
            path = confine_path(self.adapter_root, raw_path, field="lora_path")
        except ValueError as err:
            raise RequestError(str(err), param="lora_path") from err
        if name == self.engine.model_name:
            raise RequestError(f"lora_name {name!r} is the base model's name", param="lora_name")
        version = self.engine.load_adapter(name, str(path), wanted)
        self._paths[name] = str(path)
        message = f"Success: LoRA adapter '{name}' added successfully."
        body = {"object": "lora_adapter", "lora_name": name, "lora_path": str(path), "adapter_version": version,
                "message": message}  # fmt: skip
        yield {"status": 200, "headers": version_headers(version), "body": body}

    def unload_adapter(self, body: Any) -> Events:
        name = parse_unload_request(body)
        try:
            self.engine.unload_adapter(name)
        except UnknownAdapterError as err:
            raise RequestError(f"The lora adapter '{name}' cannot be found.", 404, "model_not_found",
                               "lora_name", "NotFoundError") from err  # fmt: skip
        self._paths.pop(name, None)
        message = f"Success: LoRA adapter '{name}' removed successfully."
        yield {"status": 200, "headers": {}, "body": {"object": "lora_adapter", "lora_name": name, "message": message}}
