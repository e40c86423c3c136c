"""The one outbound client: every call metaclaw makes to an OpenAI-compatible server goes through `call`.

The judge, the evolver, the distillation teacher, the evaluator, the publish gate, the probe, the control plane and
the hot-loader reach a server the same way, and the simulated user, the simulated people and the replay driver
(which drive the proxy as an agent's SDK would) get their OpenAI SDK client from `openai_client`:

- one address type, `Endpoint` (a base URL and its key), with one URL rule: a base URL with or without `/v1` both
  work (`Endpoint("http://h:8000/v1").v1 == Endpoint("http://h:8000").v1 == "http://h:8000/v1"`, never `/v1/v1`);
- one transport, the `openai` SDK (a core dependency), so one retry policy: the SDK's `max_retries` (connection
  errors, read timeouts, 408, 409, 429 and 5xx are retried with its backoff and `Retry-After`; other 4xx are not);
- one error type, `CallError` (`openai.APIError`): `APIStatusError` (the server refused: `.status_code`,
  `.response`), `APIConnectionError` / `APITimeoutError` (no answer);
- one model-list call, `models` (the `data` of `GET /v1/models`), also the health check of a policy server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from metaclaw.distribution import Dist

CallError = openai.APIError
"""What every outbound call raises when the server refuses (`openai.APIStatusError`) or does not answer
(`openai.APIConnectionError`, `openai.APITimeoutError`)."""

Refused = openai.APIStatusError
"""The server answered with an error status (`.status_code`, `.response`): a `CallError`."""

NO_KEY = "no-key"
"""The SDK's key for an endpoint without one (the SDK refuses none, and would read `OPENAI_API_KEY` instead)."""

RETRIES = 2
"""The SDK's default `max_retries`: a call is tried at most three times."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: its base URL (with or without `/v1`) and its bearer key (None: no key).

    The key is kept out of `repr`, so an endpoint can be logged.
    """

    url: str
    api_key: str | None = field(default=None, repr=False)

    @classmethod
    def of(cls, url: str | Endpoint, api_key: str | None = None) -> Endpoint:
        """An endpoint from a URL (and key), or the endpoint itself."""
        return url if isinstance(url, Endpoint) else cls(url, api_key)

    @property
    def root(self) -> str:
        """The server's root, without `/v1` and without a trailing slash (`/health` hangs off it)."""
        base = self.url.strip().rstrip("/")
        return base.removesuffix("/v1")

    @property
    def v1(self) -> str:
        """The OpenAI API's base: the root and `/v1`, whatever form the URL was given in."""
        return f"{self.root}/v1"

    def headers(self) -> dict[str, str]:
        """`Authorization: Bearer <key>` when a key is set, else no header (for the proxy's own pools)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def openai_client(
    endpoint: Endpoint, timeout: float = 60.0, max_retries: int = RETRIES, http_client: Any = None
) -> openai.OpenAI:
    """The SDK client for `endpoint`: its `/v1` base, its key (a placeholder when it has none, never the
    environment's `OPENAI_API_KEY`), the SDK's retries; `http_client` an `httpx.Client` of the caller's (event
    hooks). Close it (or use it in a `with`)."""
    return openai.OpenAI(base_url=endpoint.v1, api_key=endpoint.api_key or NO_KEY, timeout=timeout,
                         max_retries=max_retries, http_client=http_client)  # fmt: skip


def call(
    endpoint: Endpoint, path: str, body: Mapping[str, Any] | None = None, *, method: str = "post",
    timeout: float = 60.0, max_retries: int = RETRIES,
) -> Any:  # fmt: skip
    """The one outbound request: `method` `path` (under `/v1`) with the JSON `body`; the reply's JSON object.

    An endpoint without a key sends no `Authorization` header.

    Raises:
        CallError: refused after the SDK's retries (`APIStatusError`, with `.status_code`), or no answer.
        ValueError: the reply is not a JSON object.
    """
    options: Any = {} if endpoint.api_key else {"headers": {"Authorization": openai.omit}}
    with openai_client(endpoint, timeout, max_retries) as client:
        if method == "get":
            out = client.get(path, cast_to=object, options=options)
        else:
            out = client.post(path, body=dict(body or {}), cast_to=object, options=options)
    if isinstance(out, str):  # JSON sent without its content type: the SDK hands back the text
        with contextlib.suppress(ValueError):
            out = json.loads(out)
    if not isinstance(out, dict):
        raise ValueError(f"{endpoint.v1}{path} answered {str(out)[:200]!r}, not a JSON object")
    return out


def chat(endpoint: Endpoint, body: Mapping[str, Any], timeout: float = 60.0, max_retries: int = RETRIES) -> dict:
    """`POST /v1/chat/completions` with `body` (OpenAI's chat request, extra fields kept); the reply's JSON."""
    return call(endpoint, "/chat/completions", body, timeout=timeout, max_retries=max_retries)


def models(endpoint: Endpoint, timeout: float = 10.0, max_retries: int = 0) -> list[dict[str, Any]]:
    """The model cards of `GET /v1/models` (each a dict with its `id`): the one model-list and health call.

    Raises:
        CallError: no answer, or not 2xx.
        ValueError: the reply has no list of cards.
    """
    data = call(endpoint, "/models", method="get", timeout=timeout, max_retries=max_retries).get("data")
    if not isinstance(data, list):
        raise ValueError(f"{endpoint.v1}/models holds no `data` list")
    return [c for c in data if isinstance(c, dict)]


def load_adapter(
    endpoint: Endpoint,
    lora_name: str,
    lora_path: str,
    timeout: float = 60.0,
    version: int | None = None,
) -> dict[str, Any]:
    """vLLM's `POST /v1/load_lora_adapter` `{lora_name, lora_path}` (with metaclaw's `adapter_version` when the
    caller knows the version it publishes); the server's JSON reply. Not retried: the caller judges a failure.

    Raises:
        CallError: the server refused the adapter (`APIStatusError`) or did not answer.
    """
    body: dict[str, object] = {"lora_name": lora_name, "lora_path": lora_path}
    if version is not None:
        body["adapter_version"] = int(version)
    return call(endpoint, "/load_lora_adapter", body, timeout=timeout, max_retries=0)


def teacher_logprobs(
    endpoint: Endpoint,
    model: str,
    prompt_ids: Sequence[int],
    target_ids: Sequence[int],
    timeout: float = 120.0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    user: str | None = None,
) -> list[float]:
    """Logprob of each `target_ids[t]` after `prompt_ids + target_ids[:t]` under `model` (base or adapter name),
    over the distribution `(temperature, top_p, top_k)` the student's tokens were sampled from.

    Sends the request form both servers accept: `POST /v1/completions` with the token ids as `prompt`,
    `max_tokens: 0` (OpenAI's and vLLM's echo without generation: the server samples nothing, so a score is one
    forward, not a forward plus a one-token generation over the same tokens), `echo: true`, `logprobs: 0` and
    vLLM's `prompt_logprobs: 0`; reads `choices[0].prompt_logprobs` (vLLM's shape: one `{token_id: {logprob,
    rank, decoded_token}}` per prompt token, the first null), falling back to `choices[0].logprobs.
    token_logprobs` (OpenAI's echo shape). Prompt logprobs are raw on vLLM; for any other distribution the
    request adds `logprobs_mode: processed_logprobs` with the sampling fields, which the metaclaw policy server
    honours and echoes in the choice.

    Raises:
        CallError: the server refused the request (unknown model, too long, ...) or did not answer.
        ValueError: the response holds neither field, or the server cannot score under that distribution.
    """
    prompt, target = [int(t) for t in prompt_ids], [int(t) for t in target_ids]
    if not prompt:
        raise ValueError("prompt_ids must hold at least one token")
    if not target:
        return []
    dist = Dist.of(temperature, top_p, top_k)
    raw = dist == Dist()
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt + target,
        "max_tokens": 0,
        "temperature": dist.temperature,
        "echo": True,
        "logprobs": 0,
        "prompt_logprobs": 0,
        "prompt_logprobs_from": len(prompt),  # metaclaw's: the prompt read as a generation reads it (vLLM ignores it)
    }
    if user is not None:  # OpenAI's end-user field: the policy server tags its work with it (metaclaw.profiling)
        body["user"] = user
    if not raw:
        body.update(top_p=dist.top_p, top_k=dist.top_k, logprobs_mode="processed_logprobs")
    choice = call(endpoint, "/completions", body, timeout=timeout)["choices"][0]
    if not raw and choice.get("logprobs_mode") != "processed_logprobs":
        raise ValueError(
            f"the teacher server at {endpoint.root} returns raw prompt logprobs only; it cannot score the response "
            "under "
            f"temperature={dist.temperature}, top_p={dist.top_p}, top_k={dist.top_k} (the sampling distribution). "
            "Point the teacher at a metaclaw policy server, or sample at temperature 1 without top-p/top-k."
        )
    entries = choice.get("prompt_logprobs")
    if entries:
        return [float(entry[str(tok)]["logprob"]) for entry, tok in zip(entries[len(prompt) :], target, strict=True)]
    legacy = (choice.get("logprobs") or {}).get("token_logprobs")
    if legacy and raw:
        return [float(x) for x in legacy[len(prompt) : len(prompt) + len(target)]]
    raise ValueError("the response has neither choices[0].prompt_logprobs nor choices[0].logprobs.token_logprobs")
