"""Refuse, at start, a training run whose upstream cannot feed it.

Capture needs the server to report the prompt as it rendered it (`prompt_token_ids`), the sampled `token_ids`
and one logprob per token. An OpenAI-compatible server that returns none of these would make every turn fail
capture while training waits on nothing; a strict one refuses the extra fields with 400 on every turn. One
tiny completion asking for exactly what capture needs tells which, before any agent is pointed at the proxy.
"""

from __future__ import annotations

import logging

from metaclaw.rollout.capture import TurnCapture
from metaclaw.wire.attach import ATTACH, UpstreamCannotTrain, probe_attach  # noqa: F401 - re-exported
from metaclaw.wire.client import CallError, Endpoint, Refused, chat, models

log = logging.getLogger(__name__)

FIX = (
    "Training needs the sampled token ids and per-token logprobs of every turn: use metaclaw's own policy "
    "server (leave serving.url unset so train.py starts it, or run `metaclaw serve` and set serving.url to it), "
    "or a vLLM server that honours `return_token_ids` and `logprobs`; to only proxy and inject skills without "
    "training, run with mode=skills_only."
)


def _first_model(server: Endpoint) -> str | None:
    try:
        cards = models(server)
        return str(cards[0]["id"]) if cards else None
    except (CallError, ValueError, KeyError):
        return None


def probe_capture(server: Endpoint | str, model: str | None = None, timeout_s: float = 120.0) -> None:
    """Ask `server` for a 1-token completion with `logprobs` and `return_token_ids`; raise if capture would fail.

    Raises:
        UpstreamCannotTrain: unreachable, refused the request, or answered without token ids / logprobs.
    """
    server = Endpoint.of(server)
    url = server.root
    model = model or _first_model(server) or "default"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": 1,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
    }
    try:
        reply = chat(server, body, timeout_s, max_retries=0)
    except Refused as e:
        why = e.response.text[:300]
        if e.status_code in (400, 422):
            raise UpstreamCannotTrain(
                f"the policy server at {url} refused a completion asking for logprobs and return_token_ids "
                f"({e.status_code}: {why}). {FIX}"
            ) from e
        raise UpstreamCannotTrain(
            f"the policy server at {url} answered the probe with {e.status_code}: {why}. {FIX}"
        ) from e
    except CallError as e:
        raise UpstreamCannotTrain(f"the policy server at {url} cannot be reached ({e!r}). {FIX}") from e
    except ValueError as e:
        raise UpstreamCannotTrain(f"the policy server at {url} answered the probe with no JSON object. {FIX}") from e
    capture = TurnCapture()
    try:
        capture.feed_response(reply)
    except (ValueError, TypeError, AttributeError) as e:
        raise UpstreamCannotTrain(
            f"the policy server at {url} answered the probe with no chat completion. {FIX}"
        ) from e
    problem = capture.problems()
    if problem is not None:
        raise UpstreamCannotTrain(f"the policy server at {url} cannot be trained from: {problem}. {FIX}")
    log.info("Upstream %s returns token ids and logprobs (model %s): capture will work", url, model)
