"""Refuse, at start, a training run whose upstream cannot feed it.

Capture needs the server to report the prompt as it rendered it (`prompt_token_ids`), the sampled `token_ids`
and one logprob per token. An OpenAI-compatible server that returns none of these would make every turn fail
capture while training waits on nothing; a strict one refuses the extra fields with 400 on every turn. One
tiny completion asking for exactly what capture needs tells which, before any agent is pointed at the proxy.
"""

from __future__ import annotations

import logging

import httpx

from metaclaw.rollout.capture import TurnCapture
from metaclaw.wire import bearer_headers

log = logging.getLogger(__name__)

FIX = (
    "Training needs the sampled token ids and per-token logprobs of every turn: use metaclaw's own policy "
    "server (leave serving.url unset so train.py starts it, or run `metaclaw serve` and set serving.url to it), "
    "or a vLLM server that honours `return_token_ids` and `logprobs`; to only proxy and inject skills without "
    "training, run with mode=skills_only."
)


class UpstreamCannotTrain(RuntimeError):
    """The upstream cannot supply what training needs; the message says why and what to do."""


def _first_model(client: httpx.Client) -> str | None:
    try:
        data = client.get("/v1/models").json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


def probe_capture(url: str, api_key: str | None = None, model: str | None = None, timeout_s: float = 120.0) -> None:
    """Ask `url` for a 1-token completion with `logprobs` and `return_token_ids`; raise if capture would fail.

    Raises:
        UpstreamCannotTrain: unreachable, refused the request, or answered without token ids / logprobs.
    """
    headers = bearer_headers(api_key)
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s) as client:
        model = model or _first_model(client) or "default"
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Say OK."}],
            "max_tokens": 1,
            "temperature": 1.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        try:
            r = client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise UpstreamCannotTrain(f"the policy server at {url} cannot be reached ({e!r}). {FIX}") from e
    if r.status_code >= 400:
        why = r.text[:300]
        if r.status_code in (400, 422):
            raise UpstreamCannotTrain(
                f"the policy server at {url} refused a completion asking for logprobs and return_token_ids "
                f"({r.status_code}: {why}). {FIX}"
            )
        raise UpstreamCannotTrain(f"the policy server at {url} answered the probe with {r.status_code}: {why}. {FIX}")
    capture = TurnCapture()
    try:
        capture.feed_response(r.json())
    except (ValueError, TypeError, AttributeError) as e:
        raise UpstreamCannotTrain(
            f"the policy server at {url} answered the probe with no chat completion. {FIX}"
        ) from e
    problem = capture.problems()
    if problem is not None:
        raise UpstreamCannotTrain(f"the policy server at {url} cannot be trained from: {problem}. {FIX}")
    log.info("Upstream %s returns token ids and logprobs (model %s): capture will work", url, model)


ATTACH = (
    "A vLLM server needs: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve MODEL --served-model-name <model.name> "
    "--enable-lora --max-lora-rank <policy.rank or more> --logprobs-mode processed_logprobs --max-model-len "
    "<model.max_seq_len> (docs/gpu.md, 'Attaching to a vllm serve you already run')."
)


def probe_attach(url: str, api_key: str | None, model: str, max_seq_len: int, timeout_s: float = 30.0) -> None:
    """What a training run needs of a server it attaches to (`serving.url`), asked over HTTP: the base model served
    under `model` (`--served-model-name`), a context of at least `max_seq_len` (`--max-model-len`), and the runtime
    LoRA route adapters are published through (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; an empty load request is
    refused as invalid by a server that has it, 404 where it is off). `--enable-lora`, `--max-lora-rank` and
    `--logprobs-mode` cannot be read over HTTP: the first publish and the capture probe show them.

    Raises:
        UpstreamCannotTrain: naming the missing flag.
    """
    with httpx.Client(base_url=url.rstrip("/"), headers=bearer_headers(api_key), timeout=timeout_s) as client:
        try:
            cards = client.get("/v1/models").json().get("data") or []
            route = client.post("/v1/load_lora_adapter", json={}).status_code
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise UpstreamCannotTrain(f"the policy server at {url} did not answer /v1/models ({e!r}). {ATTACH}") from e
    names = [c.get("id") for c in cards if isinstance(c, dict)]
    card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), None)
    if card is None:
        raise UpstreamCannotTrain(
            f"the policy server at {url} serves {names}, not model.name={model!r}: start it with "
            f"--served-model-name {model} (or set model.name to its name). {ATTACH}"
        )
    served_len = card.get("max_model_len")
    if isinstance(served_len, int) and served_len < max_seq_len:
        raise UpstreamCannotTrain(
            f"the policy server at {url} serves {model} with max_model_len={served_len} < model.max_seq_len="
            f"{max_seq_len}: start it with --max-model-len {max_seq_len} (or lower model.max_seq_len). {ATTACH}"
        )
    if route in (404, 405):
        raise UpstreamCannotTrain(
            f"the policy server at {url} has no /v1/load_lora_adapter ({route}), so no adapter can be published: "
            f"start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (and --enable-lora). {ATTACH}"
        )
    log.info("Upstream %s serves %s (max_model_len %s) and loads LoRA adapters at run time", url, model, served_len)
