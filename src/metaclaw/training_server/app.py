"""The FastAPI app: seed 000's endpoints, path for path; bearer auth on all but `/v1/health`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from metaclaw.serving.sampling import SamplingParams
from metaclaw.training_server import chat
from metaclaw.training_server import schemas as s
from metaclaw.training_server.engine import TrainingEngine
from metaclaw.training_server.errors import drop_422, error_responses, install_error_handlers
from metaclaw.training_server.sessions import Session
from metaclaw.training_server.vllm_sampler import EngineSampler
from metaclaw.training_server.worker import ModelOwner
from metaclaw.wire.security import (
    BearerAuthMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuard,
    BrowserGuardMiddleware,
)

OPEN_PATHS = ("/v1/health", "/health")
log = logging.getLogger(__name__)

try:  # the Tinker-compatible API needs the tinker extra (tinker, zstandard, protobuf)
    from metaclaw.training_server.tinker_api import mount as mount_tinker

    TINKER_MISSING: ModuleNotFoundError | None = None
except ModuleNotFoundError as e:
    if e.name not in ("tinker", "zstandard", "google") and not str(e.name).startswith(("tinker.", "google.")):
        raise
    mount_tinker, TINKER_MISSING = None, e  # type: ignore[assignment]

try:
    VERSION = version("metaclaw")
except PackageNotFoundError:  # running from a source tree without installing
    VERSION = "0.1.0"


def create_app(engine: TrainingEngine, vllm: EngineSampler | None = None) -> FastAPI:
    """Wire the engine into HTTP routes; model work runs on one owner thread, vLLM work on another."""
    settings = engine.settings
    limits = engine.limits
    owner = ModelOwner("metaclaw-model")
    infer = ModelOwner("metaclaw-infer") if vllm is not None else owner
    max_n = int(engine.cfg.sampling.max_samples)

    async def forget(session_ids: list[str]) -> None:
        if vllm is not None:
            for session_id in session_ids:
                await infer.run(vllm.forget, session_id)

    async def sweep() -> None:
        while True:
            await asyncio.sleep(limits.sweep_interval_s)
            try:
                await forget(await owner.run(engine.expire_idle))
            except Exception:  # never let the sweeper die; the next round retries
                log.exception("idle-session sweep failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(sweep()) if limits.session_idle_s else None
        yield
        if sweeper is not None:
            sweeper.cancel()
        owner.shutdown()
        infer.shutdown()

    app = FastAPI(title="MetaClaw training server", version=VERSION, lifespan=lifespan, docs_url=None,
                  redoc_url=None)  # no CDN-scripted pages; /openapi.json stays  # fmt: skip
    install_error_handlers(app)
    drop_422(app)
    tinker_key = f"tml-{settings.api_key}" if settings.api_key and not settings.api_key.startswith("tml-") else ""
    # The last middleware added runs first: the key is checked before a byte of the body is read, so a keyless
    # client cannot make the server buffer up to max_body_bytes (issue 31).
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        BearerAuthMiddleware, api_key=settings.api_key, open_paths=OPEN_PATHS, extra_keys=(tinker_key,)
    )
    # outermost: a web page in the user's browser is refused by Host (DNS rebinding) and Origin before anything else
    app.add_middleware(BrowserGuardMiddleware, guard=BrowserGuard(settings.host), checks="origin")
    common = (400, 401, 413)

    async def sample(
        session: Session | None, tokens: list[int], params: SamplingParams, prompt_logprobs: bool
    ) -> tuple[list, list | None]:
        """Sample, then report logprobs under the distribution forward_backward will recompute."""
        dist = params.distribution()
        if vllm is not None:
            checked = engine.check_prompt(tokens, params)  # vocabulary and context limits of the base model
            outputs, prompt = await infer.run(vllm.sample, session, tokens, checked, prompt_logprobs)
            outputs = await owner.run(engine.rescore, session, tokens, outputs, dist)
        else:
            outputs, prompt = await owner.run(engine.sample, session, tokens, params, prompt_logprobs, dist)
        return outputs, prompt

    def remember(session: Session | None, tokens: list[int], outputs: list, params: SamplingParams) -> None:
        if session is not None:
            dist = params.distribution()
            for o in outputs:
                session.samples.record([*tokens, *o.token_ids], dist)

    @app.get("/v1/health", response_model=s.HealthResponse)
    @app.get("/health", response_model=s.HealthResponse, include_in_schema=False)
    async def health() -> s.HealthResponse:
        latest = engine.latest
        return s.HealthResponse(
            status="healthy",
            gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            model=latest.base_model if latest is not None else "",
            step=latest.step if latest is not None else 0,
            inference_backend=settings.inference_backend,
            version=VERSION,
        )

    @app.post("/v1/lora/create", response_model=s.LoraCreateResponse, responses=error_responses(*common, 409, 429))
    async def lora_create(req: s.LoraCreateRequest) -> s.LoraCreateResponse:
        session, trainable = await owner.run(engine.create_session, req.base_model, req.rank)
        return s.LoraCreateResponse(
            session_id=session.session_id,
            status="ready",
            model=session.base_model,
            rank=session.rank,
            trainable_params=trainable,
        )

    async def delete(session_id: str) -> dict:
        result = await owner.run(engine.delete_session, engine.get(session_id))
        await forget([session_id])
        return result

    @app.delete("/v1/lora/{session_id}", response_model=s.LoraDeleteResponse, responses=error_responses(401, 404))
    async def lora_delete(session_id: str) -> dict:
        """Delete a session: its adapter, gradients and AdamW state are freed; saved files stay on disk."""
        return await delete(session_id)

    @app.post("/v1/lora/delete", response_model=s.LoraDeleteResponse, responses=error_responses(*common, 404))
    async def lora_delete_post(req: s.LoraDeleteRequest) -> dict:
        """The same as `DELETE /v1/lora/{session_id}`, for clients that only POST."""
        return await delete(req.session_id)

    @app.get("/v1/lora/sessions", response_model=s.SessionsResponse, responses=error_responses(401))
    async def lora_sessions() -> s.SessionsResponse:
        now = time.monotonic()
        return s.SessionsResponse(
            sessions=[
                s.SessionInfo(
                    session_id=x.session_id, model=x.base_model, rank=x.rank, step=x.step, idle_s=now - x.last_used
                )
                for x in list(engine.sessions.values())
            ],
            max_sessions=limits.max_sessions,
        )

    session_errors = error_responses(*common, 404)

    @app.post("/v1/train/forward_backward", response_model=s.ForwardBackwardResponse, responses=session_errors)
    async def forward_backward(req: s.ForwardBackwardRequest) -> dict:
        engine.losses.validate(req.loss_fn, req.loss_fn_config)  # 400 before the session is even looked up
        return await owner.run(engine.forward_backward, engine.get(req.session_id), req)

    @app.post("/v1/train/optim_step", response_model=s.OptimStepResponse, responses=session_errors)
    async def optim_step(req: s.OptimStepRequest) -> dict:
        return await owner.run(engine.optim_step, engine.get(req.session_id), req)

    @app.post("/v1/weights/save", response_model=s.WeightsSaveResponse, responses=error_responses(*common, 404, 507))
    async def weights_save(req: s.SaveRequest) -> dict:
        session = engine.get(req.session_id)
        result = await owner.run(engine.save_weights, session, req.name)
        if vllm is not None:
            await infer.run(vllm.publish, session)
        return result

    @app.post(
        "/v1/checkpoint/save", response_model=s.CheckpointSaveResponse, responses=error_responses(*common, 404, 507)
    )
    async def checkpoint_save(req: s.SaveRequest) -> dict:
        return await owner.run(engine.save_checkpoint, engine.get(req.session_id), req.name)

    @app.post(
        "/v1/checkpoint/load", response_model=s.CheckpointLoadResponse, responses=error_responses(*common, 403, 404)
    )
    async def checkpoint_load(req: s.CheckpointLoadRequest) -> dict:
        return await owner.run(engine.load_checkpoint, engine.get(req.session_id), req.path)

    @app.post("/v1/sample", responses=session_errors)
    async def sample_tokens(req: s.SampleRequest) -> dict:
        base = req.base_model or not req.use_adapter
        if base:  # the base model: no session needed (one named still records the distribution)
            session = engine.get(req.session_id) if req.session_id is not None else None
        else:
            session = engine.resolve(req.session_id)
        params = s.sampling_params(
            req.num_samples,
            max_n,
            req.stop,
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
        )
        want_prompt = req.prompt_logprobs or req.include_prompt_logprobs
        outputs, prompt = await sample(None if base else session, req.tokens, params, want_prompt)
        remember(session, req.tokens, outputs, params)
        body: dict = {
            "sequences": [
                {"tokens": o.token_ids, "logprobs": o.logprobs, "stop_reason": o.finish_reason} for o in outputs
            ]
        }
        if want_prompt:
            body["prompt_logprobs"] = prompt
        return body

    @app.post("/v1/chat/completions", response_model=None, responses=session_errors)
    async def chat_completions(req: s.ChatCompletionRequest) -> dict | StreamingResponse:
        base = req.model == "base" or not req.use_adapter
        named = req.session_id or (req.model if req.model in engine.sessions else None)
        session = None if base else engine.resolve(named)
        ids = chat.prompt_ids(engine.tokenizer, req)
        max_tokens = req.max_completion_tokens or req.max_tokens or int(engine.cfg.sampling.chat_max_tokens)
        params = s.sampling_params(
            req.n,
            max_n,
            req.stop,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
        )
        outputs, _ = await sample(session, ids, params, False)
        remember(session, ids, outputs, params)
        model = req.model or (session.base_model if session is not None else engine.spec.name)
        body = chat.completion(engine.tokenizer, model, len(ids), outputs, req.logprobs)
        if req.stream:
            return StreamingResponse(chat.stream_chunks(body), media_type="text/event-stream")
        return body

    if mount_tinker is None:  # the tinker extra; seed 000's API above works without it
        log.warning("The Tinker-compatible API (/api/v1) is off: %s. pip install 'metaclaw[tinker]'", TINKER_MISSING)
        return app
    mount_tinker(app, engine, owner)
    return app
