"""Attaching to a policy server that runs elsewhere (a `vllm serve` metaclaw did not start, or the one it started in
vLLM's own environment): what a training run needs of it, asked over HTTP (`probe_attach`). Plumbing on the
vocabulary floor, so that the serving engines and the rollout proxy both use it."""

from __future__ import annotations

import logging

from metaclaw.wire.client import CallError, Endpoint, Refused, call, models

log = logging.getLogger(__name__)


class UpstreamCannotTrain(RuntimeError):
    """The upstream cannot supply what training needs; the message says why and what to do."""


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
    server = Endpoint(url, api_key)
    try:
        cards = models(server, timeout_s)
    except (CallError, ValueError) as e:
        raise UpstreamCannotTrain(f"the policy server at {url} did not answer /v1/models ({e!r}). {ATTACH}") from e
    try:
        call(server, "/load_lora_adapter", {}, timeout=timeout_s, max_retries=0)
        route = 200
    except Refused as e:
        route = e.status_code
    except (CallError, ValueError) as e:
        raise UpstreamCannotTrain(f"the policy server at {url} did not answer /v1/load_lora_adapter ({e!r}). "
                                  f"{ATTACH}") from e  # fmt: skip
    names = [c.get("id") for c in cards]
    card = next((c for c in cards if c.get("id") == model), None)
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
