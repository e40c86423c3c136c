"""Tinker sampling sessions and `asample`: fixed adapter weights (or the base model) on the server's sampler."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from tinker import types as t

from metaclaw.training_server.engine import TrainingEngine
from metaclaw.training_server.errors import ApiError, bad_request
from metaclaw.training_server.storage import check_name
from metaclaw.training_server.tinker_api import wire
from metaclaw.training_server.tinker_api.common import dump, parse, untyped
from metaclaw.training_server.tinker_api.futures import FutureStore
from metaclaw.training_server.tinker_api.registry import Registry, Sampler, parse_path
from metaclaw.training_server.worker import ModelOwner
from metaclaw.wire.sampling import sampling_params

_UNSUPPORTED = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs",
                "prompt_logprobs_last_n", "record_stability_info")  # fmt: skip


def add_sampling_routes(
    router: APIRouter, engine: TrainingEngine, owner: ModelOwner, store: FutureStore, reg: Registry
) -> None:
    """`create_sampling_session`, `samplers/{id}` and `asample` on `router`."""
    max_n = int(engine.cfg.sampling.max_samples)

    def readable(namespace: str, client: str) -> None:
        """Another live session's weights are its own (as seed 000's checkpoints): 403."""
        if namespace in engine.sessions and not reg.owns(client, namespace):
            raise ApiError(403, "these weights belong to another live session", "model_path")

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        req = await parse(request, t.CreateSamplingSessionRequest)
        reg.client(req.session_id)
        sampler_id = f"ts-{uuid.uuid4().hex[:12]}"
        if req.model_path is None:
            if not req.base_model or not engine._matches(req.base_model):
                raise bad_request(f"base_model must be the served model {engine.spec.name!r}", "base_model")
            sampler = Sampler(sampler_id, req.base_model, None, None, None)
            return dump(t.CreateSamplingSessionResponse(sampling_session_id=reg.add_sampler(sampler)))
        area, namespace, name = parse_path(req.model_path, "model_path")
        check_name(namespace, "model_path")
        check_name(name, "model_path")
        readable(namespace, req.session_id)
        root = engine.adapters if area == "adapters" else engine.checkpoints
        directory = root.root.resolve() / namespace / name
        if area == "checkpoints":
            directory = directory / "adapter"
        live = engine.sessions.get(namespace)
        if live is not None and live.adapter_path == directory:
            weights = live.published
        else:
            if not directory.is_dir():
                raise ApiError(404, f"no weights at {req.model_path}", "model_path")
            weights = await owner.run(engine.read_adapter, directory)
        base = live.base_model if live is not None else engine.spec.path
        sampler = Sampler(sampler_id, base, req.model_path, weights, namespace if live is not None else None)
        return dump(t.CreateSamplingSessionResponse(sampling_session_id=reg.add_sampler(sampler)))

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict:
        s = reg.sampler(sampler_id)
        return dump(t.GetSamplerResponse(sampler_id=s.sampler_id, base_model=s.base_model, model_path=s.model_path))

    @router.post("/asample")
    async def asample(request: Request) -> dict:
        req = await parse(request, t.SampleRequest)
        for name in _UNSUPPORTED:
            if getattr(req, name):
                raise bad_request(f"{name} is not supported by this server", name)
        if req.sampling_session_id is None:
            message = "sampling_session_id is required (create a sampling session first)"
            raise bad_request(message, "sampling_session_id")
        sampler = reg.sampler(req.sampling_session_id)
        try:
            tokens = req.prompt.to_ints()
        except ValueError:
            raise bad_request("this server samples from text tokens only", "prompt") from None
        if not tokens:
            raise bad_request("prompt is empty", "prompt")
        sp = req.sampling_params
        max_tokens = sp.max_tokens or int(engine.cfg.sampling.chat_max_tokens)
        params = sampling_params(req.num_samples, sp.stop, max_n=max_n, n_field="num_samples", max_tokens=max_tokens,
                                 temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed)  # fmt: skip
        want_prompt = bool(req.prompt_logprobs)
        ids = [uuid.uuid4().hex for _ in range(req.num_samples)]

        async def job() -> bytes:
            dist = params.distribution()
            outputs, prompt = await owner.run(engine.sample, None, tokens, params, want_prompt, dist, sampler.weights)
            origin = engine.sessions.get(sampler.origin) if sampler.origin else None
            if origin is not None:  # the distribution rule: training scores these sequences as they were sampled
                for o in outputs:
                    origin.samples.record([*tokens, *o.token_ids], dist)
            return wire.sample_response(outputs, prompt)

        return untyped(store.start(job, proto=True).request_id, sample_sequence_ids=ids)
