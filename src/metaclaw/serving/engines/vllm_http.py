"""`backend=vllm`: the policy server's engine is a stock `vllm serve` in its own environment, driven over HTTP.

metaclaw never imports vLLM: `VLLMServerEngine` starts vLLM's OpenAI server (`metaclaw.serving.engines.vllm_server`)
and speaks only its public API, the one any `vllm serve` has:
- sampling: `POST /v1/completions` with the rendered prompt's token ids, `return_token_ids` and `logprobs: 0`
  (each sampled token's logprob over the distribution it was drawn from: `--logprobs-mode processed_logprobs`);
- teacher scores: the same route with `echo`, `max_tokens: 0` and `prompt_logprobs` (raw; under a temperature or
  truncation the top-k, or the whole vocabulary, is read and `token_logprobs` applies the distribution, exactly
  as for sampled tokens);
- adapters: `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Known vLLM hazards, handled here:
- a same-name adapter reload reuses prefix-cache blocks computed under the previous weights (vLLM issue 42125;
  30931 for a new id under the same name): every version is loaded under a name of its own (`policy@42#7`, never
  reused); the public name is a pointer (`AdapterRegistry`) and a replaced version is unloaded once no request
  uses it.
- an adapter whose modules do not match the model's is accepted and serves the base model (vLLM issues 34186,
  55193): its module names are checked against the model's weights and the wrapped modules before the load
  (`adapter_checks`), and after the load a probe must show its logprobs differ from the base model's.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from safetensors import safe_open

from metaclaw.config import LORA_TARGET_MODULES
from metaclaw.distribution import Dist
from metaclaw.lifecycle import free_port
from metaclaw.serving.engines.adapter_checks import check_module_names, check_targets, model_weight_names
from metaclaw.serving.engines.adapters import AdapterRegistry, LoadedAdapter, ServedAdapters, check_adapter_files
from metaclaw.serving.engines.base import (
    AdapterError,
    SamplingParams,
    SequenceOutput,
    TokenDelta,
    TokenScore,
    scores_from_rows,
    scoring_ids,
)
from metaclaw.serving.engines.base import TokenStream as _TokenStream
from metaclaw.serving.engines.salt import salted
from metaclaw.serving.engines.vllm_server import VLLMServer, server_flags, vllm_command
from metaclaw.wire import ADAPTER_WEIGHTS, bearer_headers
from metaclaw.wire.attach import probe_attach

log = logging.getLogger(__name__)

#: the backend options that configure the vLLM process, not the engine
_PROCESS_OPTIONS = ("command", "venv", "extra_args", "log_file", "startup_timeout_s")


class VLLMServerEngine(ServedAdapters):
    """The `Engine` protocol over a running vLLM OpenAI server (started by `from_spec`, or given by `url`).

    Args:
        url: the server's base URL.
        api_key: its key.
        tokenizer: the base model's tokenizer (chat templates are rendered by the caller).
        model_name: the name the server serves the base model under (`--served-model-name`).
        max_seq_len: `--max-model-len`.
        model_dir: the base model's local directory (adapter module names are checked against its weights).
        lora_target_modules: what the server wraps (`--lora-target-modules`).
        server: the process this engine started (stopped by `close`); None for a server started elsewhere.
        timeout_s: per request.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None,
        tokenizer: Any,
        model_name: str,
        max_seq_len: int,
        model_dir: str | Path | None = None,
        lora_target_modules: Sequence[str] | None = None,
        server: VLLMServer | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.url, self.tokenizer, self.model_name, self.server = url.rstrip("/"), tokenizer, model_name, server
        self.max_seq_len = max_seq_len
        self.lora_target_modules = frozenset(lora_target_modules or LORA_TARGET_MODULES)
        self._weights = model_weight_names(model_dir) if model_dir else frozenset()
        self._http = httpx.Client(base_url=self.url, headers=bearer_headers(api_key), timeout=timeout_s)
        self._registry = AdapterRegistry()
        self._load_ids = itertools.count(1)
        self._probe_base: list[float] | None = None

    @classmethod
    def from_spec(cls, spec: Any, infer_devices: Sequence[int] = (), **options: Any) -> VLLMServerEngine:
        """Start vLLM for `spec` with the `backend` options (docs/gpu.md, "vLLM in its own environment")."""
        process = {k: options.pop(k) for k in _PROCESS_OPTIONS if k in options}
        for hf_only in ("merge_adapters", "batch_linger_s", "prefix_cache_mb"):  # the HF engine's
            options.pop(hf_only, None)
        targets = list(options.get("lora_target_modules") or LORA_TARGET_MODULES)
        model_dir, port = str(spec.local_dir()), free_port()
        flags = server_flags(
            model_dir, spec.name, spec.max_seq_len, port, dtype=spec.dtype,
            max_lora_rank=int(options.pop("max_lora_rank", 64)), max_loras=int(options.pop("max_loras", 4)),
            lora_target_modules=targets, gpu_memory_utilization=options.pop("gpu_memory_utilization", None),
            max_num_seqs=options.pop("max_batch_size", None), enforce_eager=bool(options.pop("enforce_eager", False)),
            tensor_parallel_size=len(infer_devices) or None,
        )  # fmt: skip
        options.pop("lora_target_modules", None)
        if options:
            raise ValueError(f"backend=vllm: options it does not know: {sorted(options)}")
        server = VLLMServer(
            vllm_command(process.get("command"), process.get("venv")),
            flags,
            port,
            infer_devices,
            process.get("extra_args") or (),
            process.get("log_file"),
            float(process.get("startup_timeout_s", 900)),
        ).start()
        try:
            probe_attach(server.url, server.api_key, spec.name, spec.max_seq_len)  # the flags, checked and named
            return cls(server.url, server.api_key, spec.load_tokenizer(), spec.name, spec.max_seq_len, model_dir,
                       targets, server)  # fmt: skip
        except BaseException:
            server.stop()
            raise

    from_backend = from_spec  # the `backend` node's constructor (`_target_`)

    # ---------------------------------------------------------------- HTTP

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._http.post(route, json=body)
        if r.status_code == 400:
            raise ValueError(f"vLLM refused the request: {_message(r)}")
        if r.status_code >= 400:
            raise RuntimeError(f"vLLM answered {route} with {r.status_code}: {_message(r)}")
        return r.json()

    # ---------------------------------------------------------------- adapters

    def load_adapter(self, name: str, path: str, version: int | None = None) -> int:
        self._check_new_name(name)
        directory = check_adapter_files(path)
        check_targets(directory, self.lora_target_modules)
        check_module_names(directory, self._weights)
        started = time.perf_counter()
        version = self._registry.next_version(name, path, version)
        internal = f"{name}@{version}#{next(self._load_ids)}"  # never reused: vLLM issue 42125
        r = self._http.post("/v1/load_lora_adapter", json={"lora_name": internal, "lora_path": str(directory)})
        if r.status_code >= 400:
            raise AdapterError(f"vLLM cannot load the adapter in {path!r}: {_message(r)}")
        try:
            self._check_effect(internal, directory)
        except BaseException:
            self._unload(internal)
            raise
        return self._publish(name, internal, version, path, started)

    def _probe(self, model: str) -> list[float]:
        prompt = self.tokenizer("metaclaw adapter probe: does this adapter change the logprobs?")["input_ids"]
        body = {"model": model, "prompt": list(prompt), "max_tokens": 0, "echo": True, "prompt_logprobs": 0}
        entries = self._post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        return [float(entry[str(t)]["logprob"]) for entry, t in zip(entries[1:], prompt[1:], strict=True)]

    def _check_effect(self, internal: str, directory: Path) -> None:
        """vLLM issue 34186: refuse an adapter with non-zero weights whose probe logprobs equal the base model's."""
        with safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as f:
            trained = any(f.get_tensor(k).abs().max().item() > 0 for k in f.keys() if ".lora_B" in k)  # noqa: SIM118
        if not trained:  # a fresh LoRA (B = 0) is the base model by construction
            return
        if self._probe_base is None:
            self._probe_base = self._probe(self.model_name)
        if self._probe(internal) == self._probe_base:
            raise AdapterError(
                f"vLLM loaded the adapter in {str(directory)!r} but serves the base model's logprobs with it (its "
                "weights do not reach the model: vLLM issue 34186); refused"
            )

    def _unload(self, internal: str) -> None:
        r = self._http.post("/v1/unload_lora_adapter", json={"lora_name": internal})
        if r.status_code >= 400:
            log.error("vLLM did not unload adapter %s: %s", internal, _message(r))

    def _free(self, slot: LoadedAdapter) -> None:
        self._unload(slot.internal)

    @contextmanager
    def _pinned(self, adapter: str | None) -> Iterator[tuple[LoadedAdapter | None, str]]:
        if adapter is None or self._is_base(adapter):
            yield None, self.model_name
            return
        slot = self._registry.acquire(adapter)
        try:
            yield slot, slot.internal
        finally:
            if self._registry.release(slot) is not None:
                self._free(slot)

    # ---------------------------------------------------------------- sampling

    def _body(self, model: str, prompt_ids: Sequence[int], params: SamplingParams, stream: bool) -> dict[str, Any]:
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; model.max_seq_len is {self.max_seq_len}")
        params.validate()
        body: dict[str, Any] = {
            "model": model, "prompt": list(prompt_ids), "n": params.n, "stream": stream,
            "max_tokens": min(params.max_tokens, self.max_seq_len - len(prompt_ids)),
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "logprobs": params.top_logprobs, "return_token_ids": True,
        }  # fmt: skip
        if params.top_logprobs:  # keyed by id, not by text (which two tokens can share)
            body["return_tokens_as_token_ids"] = True
        optional = {"seed": params.seed, "stop": list(params.stop) or None,
                    "stop_token_ids": list(params.stop_token_ids) or None}  # fmt: skip
        body.update({k: v for k, v in optional.items() if v is not None})
        return salted(body, params.cache_salt)  # vLLM's prefix cache per tenant (salt.py)

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> list[SequenceOutput]:
        with self._pinned(adapter) as (slot, model):
            reply = self._post("/v1/completions", self._body(model, prompt_ids, params, stream=False))
        version = None if slot is None else slot.version
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        return [
            SequenceOutput(
                list(c["token_ids"]),
                [float(x) for x in c["logprobs"]["token_logprobs"]],
                "length" if c.get("finish_reason") == "length" else "stop",
                version,
                _tops(c["logprobs"].get("top_logprobs"), params.top_logprobs),
            )  # fmt: skip
            for c in choices
        ]

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None) -> _TokenStream:
        if params.n != 1:
            raise ValueError("streaming samples one sequence at a time (n=1)")
        return _SSEStream(self, prompt_ids, params, adapter)

    # ---------------------------------------------------------------- scoring

    def score_tokens(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        adapter: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[TokenScore]:
        """Teacher-forced logprobs from vLLM's raw prompt logprobs (see the module docstring)."""
        ids = scoring_ids(prompt_ids, target_ids, self.max_seq_len)
        if not target_ids:
            return []
        dist = Dist.of(temperature, top_p, top_k)
        raw = dist == Dist()
        width = 0 if raw else (dist.top_k if dist.top_k > 0 else -1)
        with self._pinned(adapter) as (_, model):
            body = {"model": model, "prompt": ids, "max_tokens": 0, "echo": True, "prompt_logprobs": width}
            entries = self._post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        targets = ids[len(prompt_ids) :]
        rows = [{int(k): v for k, v in entries[len(prompt_ids) + i].items()} for i in range(len(targets))]
        ranks = [int(row[t].get("rank") or 1) for row, t in zip(rows, targets, strict=True)]
        if raw:
            return [TokenScore(float(row[t]["logprob"]), r) for row, t, r in zip(rows, targets, ranks, strict=True)]
        return scores_from_rows([{k: float(v["logprob"]) for k, v in row.items()} for row in rows], targets, ranks,
                                dist)  # fmt: skip

    def close(self) -> None:
        self._http.close()
        if self.server is not None:
            self.server.stop()


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        return str(err.get("message", err) if isinstance(err, dict) else err)[:500]
    except ValueError:
        return r.text[:500]


class _SSEStream(_TokenStream):
    """One streamed completion: vLLM's server-sent events read as they come (closing it aborts the request)."""

    def __init__(self, engine: VLLMServerEngine, prompt_ids: Sequence[int], params: SamplingParams,
                 adapter: str | None) -> None:  # fmt: skip
        self._pin = engine._pinned(adapter)
        slot, model = self._pin.__enter__()
        self.adapter_version = None if slot is None else slot.version
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._pending: list[TokenDelta] = []
        self._done = False
        try:
            body = engine._body(model, prompt_ids, params, stream=True)
            self._response = engine._http.send(engine._http.build_request("POST", "/v1/completions", json=body),
                                               stream=True)  # fmt: skip
            if self._response.status_code >= 400:
                self._response.read()
                message = _message(self._response)
                raise (ValueError if self._response.status_code == 400 else RuntimeError)(f"vLLM refused: {message}")
        except BaseException:
            self._finish()
            raise
        self._lines = self._response.iter_lines()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            response = getattr(self, "_response", None)
            if response is not None:
                response.close()
            self._pin.__exit__(None, None, None)

    def __next__(self) -> TokenDelta:
        while not self._pending:
            line = None if self._done else next(self._lines, None)
            if line is None or line.strip() == "data: [DONE]":
                self._finish()
                self.finish_reason = self.finish_reason or "stop"
                self.output = SequenceOutput(self._ids, self._lps, self.finish_reason, self.adapter_version)
                raise StopIteration
            if not line.startswith("data: "):
                continue
            choice = json.loads(line[6:])["choices"][0]
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            self._pending = [TokenDelta(int(t), float(lp)) for t, lp in zip(choice.get("token_ids") or [], lps,
                                                                          strict=True)]  # fmt: skip
            if choice.get("finish_reason") is not None:
                self.finish_reason = "length" if choice["finish_reason"] == "length" else "stop"
        delta = self._pending.pop(0)
        self._ids.append(delta.token_id)
        self._lps.append(delta.logprob)
        return delta

    def close(self) -> None:
        self._finish()


def _tops(positions: Sequence[dict[str, float] | None] | None, k: int) -> list[list[tuple[int, float]]] | None:
    """The `k` most likely tokens `(id, logprob)` at each position from vLLM's legacy `top_logprobs`
    (`{"token_id:123": logprob}` with `return_tokens_as_token_ids`; the sampled token may be there as well);
    None when `k` is 0."""
    if not k:
        return None
    out = []
    for row in positions or []:
        pairs = [(int(tok.rsplit(":", 1)[1]), float(lp)) for tok, lp in (row or {}).items()]
        out.append(sorted(pairs, key=lambda e: -e[1])[:k])
    return out
