"""The Tinker routes under `/api/v1/`: request bodies parsed with the SDK's own types, work run through the
training server's engine on its model-owner thread, results handed out through futures."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from tinker import types as t

from metaclaw.training_server.engine import TrainingEngine
from metaclaw.training_server.errors import ApiError, bad_request
from metaclaw.training_server.schemas import ForwardBackwardRequest, OptimStepRequest
from metaclaw.training_server.storage import check_name
from metaclaw.training_server.tinker_api import wire
from metaclaw.training_server.tinker_api.common import dump, parse, untyped
from metaclaw.training_server.tinker_api.futures import FutureStore, ModelQueue
from metaclaw.training_server.tinker_api.registry import (
    Model,
    Registry,
    Sampler,
    TinkerLimits,
    make_path,
    parse_path,
)
from metaclaw.training_server.tinker_api.sampling import add_sampling_routes
from metaclaw.training_server.worker import ModelOwner

PROTO = "application/x-protobuf"


@dataclass
class Tinker:
    """What the Tinker routes share: the engine and its owner thread, the limits, the LoRA flag groups (attn, mlp,
    unembed → module names), the futures and the registry of clients, models and samplers."""

    engine: TrainingEngine
    owner: ModelOwner
    limits: TinkerLimits
    groups: dict
    store: FutureStore = field(init=False)
    reg: Registry = field(init=False)

    def __post_init__(self) -> None:
        self.store = FutureStore(self.limits.max_futures, self.limits.result_ttl_s, self.limits.retrieved_grace_s)
        self.reg = Registry(self.limits)

    def queue(self, next_seq: int = 1) -> ModelQueue:
        return ModelQueue(self.store, self.limits.max_pending_per_model, self.limits.seq_gap_timeout_s, next_seq)

    def model(self, model_id: str) -> Model:
        return self.reg.model(model_id, self.engine.sessions)

    @staticmethod
    def seq(value: int | None) -> int:
        if value is None:
            raise bad_request("seq_id is required", "seq_id")
        return value

    @staticmethod
    @contextmanager
    def consumed(m: Model, seq_id: int | None) -> Iterator[None]:
        """A request refused at submission still used its seq_id (the SDK counted it): later ones must not wait."""
        try:
            yield
        except ApiError:
            if seq_id is not None:
                m.queue.skip(seq_id)
            raise

    def targets(self, lora: t.LoraConfig) -> list[str]:
        flags = [f for f in ("attn", "mlp", "unembed") if getattr(lora, f"train_{f}")]
        chosen = sorted(name for flag in flags for name in self.groups[flag])
        if not chosen:
            raise bad_request("at least one of train_attn, train_mlp, train_unembed must be true", "lora_config")
        return chosen

    @staticmethod
    def check_optimizer(config: Any) -> None:
        if getattr(config, "type", "adamw") != "adamw":
            raise bad_request(f"optimizer {config.type!r} is not supported (only adamw)", "optimizer_config")

    def register(self, model_id: str, session_id: str, base_model: str, rank: int) -> None:
        self.reg.models[model_id] = Model(model_id, session_id, base_model, rank, self.queue())

    @staticmethod
    def adam(m: Model, p: Any) -> OptimStepRequest:
        if not isinstance(p, t.AdamParams):
            raise bad_request(f"optimizer {getattr(p, 'type', '?')!r} is not supported (only adam)", "optim_params")
        try:
            return OptimStepRequest(session_id=m.session_id, learning_rate=p.learning_rate, beta1=p.beta1,
                                    beta2=p.beta2, eps=p.eps, weight_decay=p.weight_decay,
                                    grad_clip_norm=p.grad_clip_norm)  # fmt: skip
        except ValidationError as exc:
            where = f"adam_params.{exc.errors()[0]['loc'][0]}"
            raise bad_request(f"{where}: {exc.errors()[0]['msg']}", where) from None


def service_router(tk: Tinker) -> APIRouter:
    """The SDK's service calls: client config, health, capabilities, client sessions, telemetry."""
    router = APIRouter()
    engine, owner, reg = tk.engine, tk.owner, tk.reg

    @router.post("/client/config")
    async def client_config() -> dict:
        config = t.ClientConfigResponse(
            pjwt_auth_enabled=False, use_pyqwest_transport=False, proto_compress_fwdbwd=False, sample_no_retries=False
        )
        return config.model_dump(mode="json")

    @router.post("/client/dynamic_config")
    async def dynamic_config() -> dict:
        return t.ClientDynamicConfigResponse().model_dump(mode="json")

    @router.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities() -> dict:
        served = t.SupportedModel(
            model_name=engine.spec.path, max_context_length=engine.spec.max_seq_len, trainable=True, sampleable=True
        )
        return dump(t.GetServerCapabilitiesResponse(supported_models=[served]))

    @router.post("/create_session")
    async def create_session(request: Request) -> dict:
        await parse(request, t.CreateSessionRequest)
        return dump(t.CreateSessionResponse(session_id=reg.new_client()))

    @router.post("/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        req = await parse(request, t.SessionHeartbeatRequest)
        reg.client(req.session_id)
        for m in reg.owned(req.session_id):  # a live client keeps its models from idle expiry
            session = engine.sessions.get(m.session_id)
            if session is not None:
                session.touch()
        return dump(t.SessionHeartbeatResponse())

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict:
        """The client closed: its models' sessions are freed (their saved files stay on disk)."""
        reg.clients.pop(session_id, None)
        for m in reg.owned(session_id):
            session = engine.sessions.get(m.session_id)
            reg.drop_model(m.model_id)
            if session is not None:
                await owner.run(engine.delete_session, session)
        return {}

    @router.post("/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}  # the SDK's own telemetry: accepted and dropped

    @router.post("/cancel_future")
    async def cancel_future() -> dict:
        return {}

    return router


def model_router(tk: Tinker) -> APIRouter:
    """Training models: `create_model`, `get_info`."""
    router = APIRouter()
    engine, owner, reg = tk.engine, tk.owner, tk.reg
    store, model = tk.store, tk.model

    @router.post("/create_model")
    async def create_model(request: Request) -> dict:
        req = await parse(request, t.CreateModelRequest)
        reg.client(req.session_id)
        if req.lora_config is None:
            raise bad_request("full fine-tuning is not supported: pass lora_config", "lora_config")
        tk.check_optimizer(req.optimizer_config)
        lora, modules = req.lora_config, tk.targets(req.lora_config)
        if not 1 <= lora.rank <= 1024:
            raise bad_request(f"lora_config.rank must be in [1, 1024], got {lora.rank}", "lora_config.rank")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in reg.models:
            raise bad_request(f"model_seq_id {req.model_seq_id} was already used in this session", "model_seq_id")
        reg.prune(engine.sessions)

        async def job() -> dict:
            session, _ = await owner.run(engine.create_session, req.base_model, lora.rank, modules, lora.seed)
            tk.register(model_id, session.session_id, req.base_model, lora.rank)
            return dump(t.CreateModelResponse(model_id=model_id))

        return untyped(store.start(job).request_id, model_id)

    @router.post("/get_info")
    async def get_info(request: Request) -> dict:
        req = await parse(request, t.GetInfoRequest)
        m = model(req.model_id)
        data = t.ModelData(arch=engine.spec.name, model_name=m.base_model, tokenizer_id=m.base_model)
        info = t.GetInfoResponse(model_data=data, model_id=m.model_id, is_lora=True, lora_rank=m.rank,
                                 model_name=m.base_model)  # fmt: skip
        return dump(info)

    return router


def training_router(tk: Tinker) -> APIRouter:
    """`forward_backward` and `optim_step`, in each model's `seq_id` order."""
    router = APIRouter()
    engine, owner, model, seq, consumed = tk.engine, tk.owner, tk.model, tk.seq, tk.consumed

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> dict:
        body = wire.decompress(await request.body(), request.headers.get("content-encoding"),
                               engine.settings.max_body_bytes)  # fmt: skip
        msg = wire.parse_forward_backward(body)
        m = model(msg.model_id)
        with consumed(m, msg.seq_id):
            config = wire.loss_config(msg)
            engine.losses.validate(msg.loss_fn, config)
            # cross_entropy is supervised: always the model's plain distribution (T=1); RL losses follow the
            # distribution rule (each datum scored under the sampling settings that produced it).
            req = ForwardBackwardRequest(
                session_id=m.session_id,
                datums=wire.datums(msg, msg.loss_fn),
                loss_fn=msg.loss_fn,
                loss_fn_config=config,
                temperature=1.0 if msg.loss_fn == "cross_entropy" else None,
            )
        forward_only = msg.forward_only

        async def job() -> bytes:
            out = await owner.run(engine.forward_backward, engine.get(m.session_id), req, forward_only)
            metrics = out["metrics"]
            if msg.loss_fn == "cross_entropy":  # no behaviour policy: importance ratios mean nothing here
                metrics = {k: v for k, v in metrics.items() if not k.startswith(("ratio_", "datums_matched"))}
            return wire.forward_backward_output(out["token_logprobs"], out["loss"], metrics)

        return untyped(m.queue.submit(seq(msg.seq_id), job, proto=True), m.model_id)

    @router.post("/optim_step")
    async def optim_step(request: Request) -> dict:
        req = await parse(request, t.OptimStepRequest)
        m = model(req.model_id)
        with consumed(m, req.seq_id):
            ours = tk.adam(m, req.optim_params)

        async def job() -> dict:
            out = await owner.run(engine.optim_step, engine.get(m.session_id), ours)
            metrics = {"grad_norm": out["grad_norm"], "learning_rate": out["learning_rate"], "step": out["step"]}
            return dump(t.OptimStepResponse(metrics=metrics))

        return untyped(m.queue.submit(seq(req.seq_id), job), m.model_id)

    return router


def weights_router(tk: Tinker) -> APIRouter:
    """`save_weights` and `save_weights_for_sampler`."""
    router = APIRouter()
    engine, owner, reg, model, seq, consumed = tk.engine, tk.owner, tk.reg, tk.model, tk.seq, tk.consumed

    @router.post("/save_weights")
    async def save_weights(request: Request) -> dict:
        req = await parse(request, t.SaveWeightsRequest)
        m = model(req.model_id)
        with consumed(m, req.seq_id):
            name = check_name(req.path, "path") if req.path else ""

        async def job() -> dict:
            out = await owner.run(engine.save_checkpoint, engine.get(m.session_id), name)
            return dump(t.SaveWeightsResponse(path=make_path(m.session_id, "weights", Path(out["path"]).name)))

        return untyped(m.queue.submit(seq(req.seq_id), job), m.model_id)

    @router.post("/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        req = await parse(request, t.SaveWeightsForSamplerRequest)
        m = model(req.model_id)
        with consumed(m, req.seq_id):
            name = check_name(req.path, "path") if req.path else None

        async def job() -> dict:
            session = engine.get(m.session_id)
            if name is not None:
                out = await owner.run(engine.save_weights, session, name)
                path = make_path(m.session_id, "sampler_weights", Path(out["adapter_path"]).name)
                return dump(t.SaveWeightsForSamplerResponseInternal(path=path))
            weights = await owner.run(engine.slot.snapshot, session)
            sampler = Sampler(f"ts-{uuid.uuid4().hex[:12]}", m.base_model, None, weights, m.session_id)
            return dump(t.SaveWeightsForSamplerResponseInternal(sampling_session_id=reg.add_sampler(sampler)))

        return untyped(m.queue.submit(seq(req.seq_id), job), m.model_id)

    return router


def load_router(tk: Tinker) -> APIRouter:
    """`load_weights`: into an existing model, or a new one made from the checkpoint."""
    router = APIRouter()
    engine, owner, reg, store = tk.engine, tk.owner, tk.reg, tk.store
    model, seq, consumed = tk.model, tk.seq, tk.consumed

    @router.post("/load_weights")
    async def load_weights(request: Request) -> dict:
        req = await parse(request, t.LoadWeightsRequest)
        existing = model(req.model_id) if req.model_id is not None else None
        with consumed(existing, req.seq_id) if existing is not None else nullcontext():
            area, namespace, name = parse_path(req.path, "path")
            if area != "checkpoints":
                raise bad_request("load needs a training-state path (tinker://<run>/weights/<name>)", "path")
            if req.optimizer_config is not None:
                tk.check_optimizer(req.optimizer_config)
            rel = f"{check_name(namespace, 'path')}/{check_name(name, 'path')}"
        if existing is not None:  # load into an existing model, in its seq_id order
            m = existing

            client = m.model_id.split(":", 1)[0]
            also = namespace if reg.owns(client, namespace) else None  # another model of the same client

            async def load_into() -> dict:
                await owner.run(engine.load_checkpoint, engine.get(m.session_id), rel, req.optimizer, also)
                return dump(t.LoadWeightsResponse(path=req.path, model_id=m.model_id))

            return untyped(m.queue.submit(seq(req.seq_id), load_into), m.model_id)
        if req.session_id is None or req.model_seq_id is None:
            raise bad_request("give model_id and seq_id, or session_id and model_seq_id", "model_id")
        reg.client(req.session_id)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        own = namespace if reg.owns(req.session_id, namespace) else None  # this client's own checkpoints
        directory = engine.checkpoints.resolve_load(rel, own or "", set(engine.sessions) - {own}, "path")

        async def create_from() -> dict:
            rank, modules, base = await owner.run(checkpoint_shape, directory)
            session, _ = await owner.run(engine.create_session, req.base_model or base, rank, modules)
            try:
                await owner.run(engine.load_checkpoint, session, rel, req.optimizer, own)
            except Exception:
                await owner.run(engine.delete_session, session)
                raise
            tk.register(model_id, session.session_id, req.base_model or base, rank)
            return dump(t.LoadWeightsResponse(path=req.path, model_id=model_id))

        return untyped(store.start(create_from).request_id, model_id)

    return router


def future_router(tk: Tinker) -> APIRouter:
    """`retrieve_future`, and a 404 naming any route this server does not offer (keep it last)."""
    router = APIRouter()
    store, limits = tk.store, tk.limits

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req = await parse(request, t.FutureRetrieveRequest)
        fut = store.get(req.request_id)
        if fut is None:
            raise ApiError(404, f"unknown or expired request_id {req.request_id[:60]!r}", "request_id")
        try:
            await asyncio.wait_for(asyncio.shield(fut.done.wait()), limits.poll_wait_s)
        except asyncio.TimeoutError:
            body = t.TryAgainResponse(request_id=fut.request_id, queue_state="active")
            return JSONResponse(body.model_dump(mode="json"), status_code=408)
        fut.retrieved_at = fut.retrieved_at or time.monotonic()
        if fut.error is not None:
            return JSONResponse(dump(t.RequestFailedResponse(error=fut.error, category=fut.category)))
        if fut.proto:
            return Response(fut.result, media_type=PROTO)
        return JSONResponse(fut.result)

    @router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
    async def unsupported(rest: str) -> None:
        raise ApiError(404, f"/api/v1/{rest} is not supported by this server (docs/training_server.md)", "path")

    return router


def build_router(engine: TrainingEngine, owner: ModelOwner, limits: TinkerLimits, groups: dict) -> APIRouter:
    """All Tinker endpoints, one router per resource; `groups` maps the LoRA flags (attn, mlp, unembed) to module
    names."""
    router = APIRouter(prefix="/api/v1", include_in_schema=False)  # the SDK is its schema, not our OpenAPI
    tk = Tinker(engine, owner, limits, groups)
    for part in (service_router, model_router, training_router, weights_router, load_router):
        router.include_router(part(tk))
    sampling = APIRouter()
    add_sampling_routes(sampling, engine, owner, tk.store, tk.reg)
    router.include_router(sampling)
    router.include_router(future_router(tk))  # last: its catch-all answers what no route above took
    return router


def checkpoint_shape(directory: Path) -> tuple[int, list[str], str]:
    """(rank, LoRA target modules, base model) of a checkpoint, from its validated files."""
    from metaclaw.training_server import checkpoints

    try:
        info, _ = checkpoints.read_training_state(directory)
        config = json.loads((directory / checkpoints.ADAPTER_DIR / "adapter_config.json").read_text())
        modules = config["target_modules"]
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise ValueError("target_modules must be a list of names")
    except (OSError, ValueError, KeyError) as exc:
        raise bad_request(f"cannot load this checkpoint: {type(exc).__name__}: {exc}", "path") from None
    return int(info["rank"]), sorted(modules), str(info["base_model"])


def install(app: FastAPI, engine: TrainingEngine, owner: ModelOwner, limits: TinkerLimits, groups: dict) -> None:
    app.include_router(build_router(engine, owner, limits, groups))
