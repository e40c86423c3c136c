"""Seed 000's routes, one `APIRouter` per resource: health, LoRA sessions, training, weights and checkpoints, and
sampling (`/v1/sample`, `/v1/chat/completions`). Each takes the `Served` state the app builds once."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from metaclaw.training_server import chat
from metaclaw.training_server import schemas as s
from metaclaw.training_server.engine import TrainingEngine
from metaclaw.training_server.errors import error_responses
from metaclaw.training_server.sessions import Session
from metaclaw.training_server.vllm_sampler import EngineSampler
from metaclaw.training_server.worker import ModelOwner
from metaclaw.wire.sampling import SamplingParams, sampling_params

log = logging.getLogger(__name__)

COMMON = (400, 401, 413)  # the errors of every JSON route: bad input, no key, body over the limit
SESSION_ERRORS = error_responses(*COMMON, 404)


@dataclass
class Served:
    """What the routes share: the engine, the model's owner thread, vLLM's (the same thread without vLLM)."""

    engine: TrainingEngine
    owner: ModelOwner
    infer: ModelOwner
    vllm: EngineSampler | None
    version: str

    @property
    def max_n(self) -> int:
        return int(self.engine.cfg.sampling.max_samples)

    async def forget(self, session_ids: list[str]) -> None:
        """Drop deleted or expired sessions' adapters from vLLM."""
        if self.vllm is not None:
            for session_id in session_ids:
                await self.infer.run(self.vllm.forget, session_id)

    async def sweep(self) -> None:
        """Expire idle sessions, forever (never dies: a failed round is logged and the next retries)."""
        while True:
            await asyncio.sleep(self.engine.limits.sweep_interval_s)
            try:
                await self.forget(await self.owner.run(self.engine.expire_idle))
            except Exception:  # noqa: BLE001 - the next round retries
                log.exception("idle-session sweep failed")

    async def sample(
        self, session: Session | None, tokens: list[int], params: SamplingParams, prompt_logprobs: bool
    ) -> tuple[list, list | None]:
        """Sample, then report logprobs under the distribution forward_backward will recompute."""
        dist, engine = params.distribution(), self.engine
        if self.vllm is not None:
            checked = engine.check_prompt(tokens, params)  # vocabulary and context limits of the base model
            outputs, prompt = await self.infer.run(self.vllm.sample, session, tokens, checked, prompt_logprobs)
            outputs = await self.owner.run(engine.rescore, session, tokens, outputs, dist)
        else:
            outputs, prompt = await self.owner.run(engine.sample, session, tokens, params, prompt_logprobs, dist)
        return outputs, prompt

    @staticmethod
    def remember(session: Session | None, tokens: list[int], outputs: list, params: SamplingParams) -> None:
        """Record what a session sampled under which distribution (its training must use the same)."""
        if session is not None:
            dist = params.distribution()
            for o in outputs:
                session.samples.record([*tokens, *o.token_ids], dist)


def health_router(served: Served) -> APIRouter:
    router, engine = APIRouter(), served.engine

    @router.get("/v1/health", response_model=s.HealthResponse)
    @router.get("/health", response_model=s.HealthResponse, include_in_schema=False)
    async def health() -> s.HealthResponse:
        latest = engine.latest
        return s.HealthResponse(
            status="healthy",
            gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            model=latest.base_model if latest is not None else "",
            step=latest.step if latest is not None else 0,
            inference_backend=engine.settings.inference_backend,
            version=served.version,
        )

    return router


def lora_router(served: Served) -> APIRouter:
    router, engine, owner = APIRouter(), served.engine, served.owner

    @router.post("/v1/lora/create", response_model=s.LoraCreateResponse, responses=error_responses(*COMMON, 409, 429))
    async def lora_create(req: s.LoraCreateRequest) -> s.LoraCreateResponse:
        session, trainable = await owner.run(engine.create_session, req.base_model, req.rank)
        return s.LoraCreateResponse(session_id=session.session_id, status="ready", model=session.base_model,
                                    rank=session.rank, trainable_params=trainable)  # fmt: skip

    async def delete(session_id: str) -> dict:
        result = await owner.run(engine.delete_session, engine.get(session_id))
        await served.forget([session_id])
        return result

    @router.delete("/v1/lora/{session_id}", response_model=s.LoraDeleteResponse, responses=error_responses(401, 404))
    async def lora_delete(session_id: str) -> dict:
        """Delete a session: its adapter, gradients and AdamW state are freed; saved files stay on disk."""
        return await delete(session_id)

    @router.post("/v1/lora/delete", response_model=s.LoraDeleteResponse, responses=error_responses(*COMMON, 404))
    async def lora_delete_post(req: s.LoraDeleteRequest) -> dict:
        """The same as `DELETE /v1/lora/{session_id}`, for clients that only POST."""
        return await delete(req.session_id)

    @router.get("/v1/lora/sessions", response_model=s.SessionsResponse, responses=error_responses(401))
    async def lora_sessions() -> s.SessionsResponse:
        now = time.monotonic()
        infos = [s.SessionInfo(session_id=x.session_id, model=x.base_model, rank=x.rank, step=x.step,
                               idle_s=now - x.last_used) for x in list(engine.sessions.values())]  # fmt: skip
        return s.SessionsResponse(sessions=infos, max_sessions=engine.limits.max_sessions)

    return router


def train_router(served: Served) -> APIRouter:
    router, engine, owner = APIRouter(), served.engine, served.owner

    @router.post("/v1/train/forward_backward", response_model=s.ForwardBackwardResponse, responses=SESSION_ERRORS)
    async def forward_backward(req: s.ForwardBackwardRequest) -> dict:
        engine.losses.validate(req.loss_fn, req.loss_fn_config)  # 400 before the session is even looked up
        return await owner.run(engine.forward_backward, engine.get(req.session_id), req)

    @router.post("/v1/train/optim_step", response_model=s.OptimStepResponse, responses=SESSION_ERRORS)
    async def optim_step(req: s.OptimStepRequest) -> dict:
        return await owner.run(engine.optim_step, engine.get(req.session_id), req)

    return router


def weights_router(served: Served) -> APIRouter:
    router, engine, owner = APIRouter(), served.engine, served.owner

    @router.post("/v1/weights/save", response_model=s.WeightsSaveResponse,
                 responses=error_responses(*COMMON, 404, 507))  # fmt: skip
    async def weights_save(req: s.SaveRequest) -> dict:
        session = engine.get(req.session_id)
        result = await owner.run(engine.save_weights, session, req.name)
        if served.vllm is not None:
            await served.infer.run(served.vllm.publish, session)
        return result

    @router.post("/v1/checkpoint/save", response_model=s.CheckpointSaveResponse,
                 responses=error_responses(*COMMON, 404, 507))  # fmt: skip
    async def checkpoint_save(req: s.SaveRequest) -> dict:
        return await owner.run(engine.save_checkpoint, engine.get(req.session_id), req.name)

    @router.post("/v1/checkpoint/load", response_model=s.CheckpointLoadResponse,
                 responses=error_responses(*COMMON, 403, 404))  # fmt: skip
    async def checkpoint_load(req: s.CheckpointLoadRequest) -> dict:
        return await owner.run(engine.load_checkpoint, engine.get(req.session_id), req.path)

    return router


def sampling_router(served: Served) -> APIRouter:
    router, engine = APIRouter(), served.engine

    @router.post("/v1/sample", responses=SESSION_ERRORS)
    async def sample_tokens(req: s.SampleRequest) -> dict:
        base = req.base_model or not req.use_adapter
        if base:  # the base model: no session needed (one named still records the distribution)
            session = engine.get(req.session_id) if req.session_id is not None else None
        else:
            session = engine.resolve(req.session_id)
        params = sampling_params(req.num_samples, req.stop, max_n=served.max_n, n_field="num_samples",
                                 max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                 top_k=req.top_k, seed=req.seed)  # fmt: skip
        want_prompt = req.prompt_logprobs or req.include_prompt_logprobs
        outputs, prompt = await served.sample(None if base else session, req.tokens, params, want_prompt)
        served.remember(session, req.tokens, outputs, params)
        body: dict = {"sequences": [{"tokens": o.token_ids, "logprobs": o.logprobs, "stop_reason": o.finish_reason}
                                    for o in outputs]}  # fmt: skip
        if want_prompt:
            body["prompt_logprobs"] = prompt
        return body

    @router.post("/v1/chat/completions", response_model=None, responses=SESSION_ERRORS)
    async def chat_completions(req: s.ChatCompletionRequest) -> dict | StreamingResponse:
        base = req.model == "base" or not req.use_adapter
        named = req.session_id or (req.model if req.model in engine.sessions else None)
        session = None if base else engine.resolve(named)
        ids = chat.prompt_ids(engine.tokenizer, req)
        max_tokens = req.max_completion_tokens or req.max_tokens or int(engine.cfg.sampling.chat_max_tokens)
        params = sampling_params(req.n, req.stop, max_n=served.max_n, max_tokens=max_tokens,
                                 temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                 seed=req.seed)  # fmt: skip
        outputs, _ = await served.sample(session, ids, params, False)
        served.remember(session, ids, outputs, params)
        model = req.model or (session.base_model if session is not None else engine.spec.name)
        tools = bool(req.tools) and req.tool_choice != "none"
        body = chat.completion(engine.tokenizer, model, len(ids), outputs, req.logprobs, tools)
        if req.stream:
            return StreamingResponse(chat.stream_chunks(body), media_type="text/event-stream")
        return body

    return router


ROUTERS = (health_router, lora_router, train_router, weights_router, sampling_router)
"""Every resource's router, in the order the OpenAPI document lists them."""
