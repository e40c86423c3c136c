"""`TrainingEngine`: one base model, one LoRA session per client, externally driven training steps.

Every method here runs on the model-owner thread (see `worker.ModelOwner`), so training and sampling never
interleave on the model. Fabric places the model and runs backward under the configured precision; the maths is
`LoraPolicy.logprobs` + a loss from `metaclaw.losses`, as in `train.py`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from metaclaw.distribution import Dist
from metaclaw.distribution.logprobs import dist_logprobs, token_logprobs
from metaclaw.modules.loading import ModelSpec
from metaclaw.modules.policy import LoraPolicy
from metaclaw.serving.sampling import generate
from metaclaw.training_server import checkpoints
from metaclaw.training_server.batching import check_tokens, collate
from metaclaw.training_server.errors import ApiError, bad_request
from metaclaw.training_server.loss_registry import LossRegistry
from metaclaw.training_server.sample_memory import SampleMemory
from metaclaw.training_server.schemas import Datum, ForwardBackwardRequest, OptimStepRequest
from metaclaw.training_server.sessions import AdapterSlot, Session
from metaclaw.training_server.settings import Limits, ServerSettings
from metaclaw.training_server.storage import Area
from metaclaw.wire.sampling import SamplingParams, SequenceOutput

log = logging.getLogger(__name__)


def _fabric(settings: ServerSettings) -> L.Fabric:
    if settings.training_devices:
        if len(settings.training_devices) > 1:
            log.warning(
                "training on GPU %d only (devices %s given)", *settings.training_devices[:1], settings.training_devices
            )
        return L.Fabric(accelerator="cuda", devices=settings.training_devices[:1], precision=settings.precision)
    return L.Fabric(accelerator="cpu", devices=1, precision=settings.precision)


class TrainingEngine:
    """Owns the base model, the LoRA policy and the sessions.

    Args:
        settings: parsed server settings (model, devices, checkpoint root, `app` config).
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.fabric = _fabric(settings)
        self.losses = LossRegistry(self.cfg.losses)
        self.optimizer_factory = instantiate(self.cfg.optimizer)
        self.spec: ModelSpec = settings.model
        self.sessions: dict[str, Session] = {}
        self.latest: Session | None = None
        self.policy: LoraPolicy | None = None
        self.slot: AdapterSlot | None = None
        self.policy_targets: list[str] = []
        self.base_model: Any = None
        self.tokenizer: Any = None
        self.created = 0
        self.adapters = Area(settings.checkpoint_dir / "adapters", self.limits.adapter_quota_bytes, "adapters")
        self.checkpoints = Area(
            settings.checkpoint_dir / "checkpoints", self.limits.checkpoint_quota_bytes, "checkpoints"
        )

    @property
    def cfg(self) -> DictConfig:
        """The server's `app` config (`settings.app`)."""
        return self.settings.app

    @property
    def limits(self) -> Limits:
        """The server's bounds (`settings.limits`): quotas, sessions, request sizes."""
        return self.settings.limits

    # ---- model ---------------------------------------------------------------------------------------------
    def load_base(self, spec: ModelSpec | None = None) -> None:
        """Load (or replace) the base model; the LoRA wrapper is built by the first session."""
        spec = spec or self.spec
        log.info("Loading base model %s (%s) onto %s", spec.name, spec.path, self.fabric.device)
        tokenizer = spec.load_tokenizer()
        model = spec.load_model(self.fabric.device)
        self.spec, self.tokenizer, self.base_model = spec, tokenizer, model
        self.policy, self.slot = None, None

    @property
    def vocab_size(self) -> int:
        return int(self.base_model.get_input_embeddings().num_embeddings)

    def _matches(self, base_model: str) -> bool:
        wanted = base_model.strip().rstrip("/")
        return not wanted or wanted in {self.spec.name, self.spec.path, str(self.spec.local_dir())}

    def _ensure_policy(self, base_model: str, rank: int, targets: list[str] | None = None) -> None:
        if not self._matches(base_model):
            wanted = base_model.strip().rstrip("/")
            if wanted not in self.settings.allowed_base_models:
                raise ApiError(
                    409,
                    f"base_model {base_model!r} is not the served model {self.spec.name!r} nor one of "
                    "app.allowed_base_models",
                    "base_model",
                )
            if self.sessions:
                raise ApiError(409, f"base_model {base_model!r}: another base model has live sessions", "base_model")
            spec = ModelSpec(name=wanted, path=wanted, dtype=self.spec.dtype, max_seq_len=self.spec.max_seq_len)
            try:
                self.load_base(spec)
            except Exception:  # the served model stays; the cause goes to the log, not to the client
                log.exception("cannot load the allow-listed base model %s", wanted)
                raise bad_request(
                    f"cannot load base_model {base_model!r}; the server log says why", "base_model"
                ) from None
        lora = self.cfg.lora
        targets = sorted(targets if targets is not None else lora.target_modules)
        if self.slot is not None and (self.slot.rank != rank or self.policy_targets != targets):
            if self.sessions:
                if self.slot.rank != rank:
                    raise ApiError(409, f"rank {rank} differs from the live sessions' rank {self.slot.rank}", "rank")
                raise ApiError(
                    409,
                    f"LoRA target modules {targets} differ from the live sessions' {self.policy_targets}",
                    "target_modules",
                )
            self.base_model = self.policy.model.unload()
            self.policy, self.slot = None, None
        if self.policy is None:
            self.policy = LoraPolicy(
                self.base_model,
                rank=rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                target_modules=targets,
                gradient_checkpointing=lora.gradient_checkpointing,
                activation_budget_mib=None,  # the client sizes its batches; checkpointing is its `lora` setting
            )
            self.slot = AdapterSlot(self.policy)
            self.policy_targets = targets

    # ---- sessions ------------------------------------------------------------------------------------------
    def _new_id(self) -> str:
        """A fresh id that names no live session and no directory left by an earlier run."""
        while True:
            session_id = uuid.uuid4().hex[:8]
            if session_id not in self.sessions and not any(
                (area.root / session_id).exists() for area in (self.adapters, self.checkpoints)
            ):
                return session_id

    def create_session(
        self, base_model: str, rank: int, target_modules: list[str] | None = None, seed: int | None = None
    ) -> tuple[Session, str]:
        """A new session with a freshly initialised adapter; returns it and the "trainable / total" string.

        `target_modules` (default `app.lora.target_modules`) and `rank` are shared by all live sessions; `seed`
        (default `app.seed` + the session's index) seeds the adapter's initialisation.
        """
        self.expire_idle()
        if len(self.sessions) >= self.limits.max_sessions:
            raise ApiError(
                429,
                f"the server holds {len(self.sessions)} sessions, its limit (app.limits.max_sessions); delete one "
                f"with DELETE /v1/lora/<session_id> or wait for idle ones to expire "
                f"(after {self.limits.session_idle_s:g} s)",
                "session_id",
            )
        self._ensure_policy(base_model, rank, target_modules)
        session_id = self._new_id()
        init_seed = seed if seed is not None else self.cfg.seed + self.created
        session = self.slot.new_session(session_id, base_model or self.spec.path, init_seed, self.optimizer_factory)
        session.samples = SampleMemory(self.limits.sample_memory)
        self.created += 1
        self.sessions[session_id] = session
        self.latest = session
        trainable, total = self.policy.num_parameters()
        log.info("session %s: %s rank %d, %d trainable parameters", session_id, session.base_model, rank, trainable)
        return session, f"{trainable / 1e6:.2f}M / {total / 1e6:.2f}M"

    def get(self, session_id: str) -> Session:
        """The named session (404 when unknown); marks it used."""
        session = self.sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"unknown session_id {session_id!r}; create one with /v1/lora/create", "session_id")
        session.touch()
        return session

    def resolve(self, session_id: str | None) -> Session | None:
        """The named session; without a name: the only session, None (base model) when there is none.

        With several sessions a request without `session_id` is ambiguous: 400 naming the field.
        """
        if session_id is not None:
            return self.get(session_id)
        live = list(self.sessions.values())  # one atomic copy: the owner thread may add or delete meanwhile
        if not live:
            return None
        if len(live) > 1:
            raise bad_request(
                f"session_id is required: {len(live)} sessions are live, so a request without one is ambiguous",
                "session_id",
            )
        live[0].touch()
        return live[0]

    def _live(self, session: Session | None) -> None:
        """404 when `session` was deleted (or expired) after the request looked it up."""
        if session is not None and self.sessions.get(session.session_id) is not session:
            raise ApiError(404, f"session_id {session.session_id!r} was deleted", "session_id")

    def delete_session(self, session: Session) -> dict[str, Any]:
        """Forget the session: adapter tensors, gradients, AdamW state; its saved files stay on disk."""
        if self.sessions.pop(session.session_id, None) is None:
            return {"status": "ok", "session_id": session.session_id, "deleted": False}
        if self.slot is not None:
            self.slot.release(session)
        session.optimizer.state.clear()
        session.weights, session.published, session.grads = {}, {}, {}
        if self.latest is session:
            self.latest = max(self.sessions.values(), key=lambda x: x.created_at, default=None)
        log.info("session %s deleted (%d live)", session.session_id, len(self.sessions))
        return {"status": "ok", "session_id": session.session_id, "deleted": True}

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Delete the sessions untouched for `app.limits.session_idle_s` (0: never)."""
        idle = self.limits.session_idle_s
        if not idle:
            return []
        now = time.monotonic() if now is None else now
        expired = [s for s in self.sessions.values() if now - s.last_used >= idle]
        for session in expired:
            log.info("session %s idle for %.0f s: expired", session.session_id, now - session.last_used)
            self.delete_session(session)
        return [s.session_id for s in expired]

    # ---- training ------------------------------------------------------------------------------------------
    def datum_dists(self, session: Session, req: ForwardBackwardRequest) -> tuple[list[Dist], int]:
        """The distribution each datum's logprobs were computed under (see docs: the distribution rule).

        An explicit `temperature` (and optional `top_p`/`top_k`) applies to every datum. Otherwise each datum
        that is a sequence this session sampled gets the distribution that sampled it; the others get the
        session's latest sampling distribution, or T=1 untruncated when it never sampled. Returns the dists and
        how many datums matched a remembered sample.
        """
        if req.temperature is not None or req.top_p is not None or req.top_k is not None:
            explicit = Dist.of(1.0 if req.temperature is None else req.temperature, req.top_p, req.top_k)
            return [explicit] * len(req.datums), 0
        fallback = session.samples.last or Dist()
        dists, matched = [], 0
        for d in req.datums:
            found = session.samples.lookup(_full_sequence(d))
            matched += found is not None
            dists.append(found or fallback)
        return dists, matched

    def forward_backward(
        self, session: Session, req: ForwardBackwardRequest, forward_only: bool = False
    ) -> dict[str, Any]:
        """One padded forward over all datums, the loss, backward; gradients accumulate until `optim_step`.

        `forward_only` computes the loss and logprobs without backward (Tinker's `forward`). The reply's
        `token_logprobs` holds each datum's per-token logprobs of its targets (the Tinker API returns them).
        """
        self._live(session)
        loss_fn = self.losses.build(req.loss_fn, req.loss_fn_config)
        batch = collate(req.datums, self.vocab_size, self.spec.max_seq_len, self.tokenizer.pad_token_id or 0)
        batch = batch.to(self.fabric.device)
        dists, matched = self.datum_dists(session, req)
        self.slot.bind(session)
        self.policy.train()
        with self.fabric.autocast():
            logits = self.policy(batch.input_ids, batch.attention_mask)
        logprobs = dist_logprobs(logits, batch.target_ids, dists)
        out = loss_fn(logprobs, batch.behaviour_logprobs, batch.advantages, batch.mask)
        loss = float(out.loss.detach())
        if not math.isfinite(loss):
            raise bad_request(
                f"the {req.loss_fn} loss is {loss} (check datums[].logprobs); nothing was applied", "datums"
            )
        if not forward_only:
            self.fabric.backward(out.loss)
            session.pending_losses.append(loss)
        with torch.no_grad():
            on = batch.mask > 0
            ratio = torch.exp(logprobs.detach() - batch.behaviour_logprobs)[on]
        metrics = {k: float(v) for k, v in out.metrics.items()}
        if ratio.numel():
            metrics.update(ratio_mean=float(ratio.mean()), ratio_min=float(ratio.min()), ratio_max=float(ratio.max()))
        metrics["datums_matched_to_samples"] = float(matched)
        rows = logprobs.detach().float().cpu().tolist()
        return {
            "token_logprobs": [row[: len(d.target_tokens)] for row, d in zip(rows, req.datums, strict=True)],
            "status": "ok",
            "loss": loss,
            "total_tokens": batch.num_tokens,
            "num_datums": len(req.datums),
            "metrics": metrics,
        }

    def optim_step(self, session: Session, req: OptimStepRequest) -> dict[str, Any]:
        """Clip gradients, AdamW step at the request's learning rate, zero gradients."""
        self._live(session)
        self.slot.bind(session)
        params = list(self.slot.params.values())
        optimizer = session.optimizer
        clip = req.grad_clip_norm if req.grad_clip_norm is not None else self.cfg.grad_clip_norm
        max_norm = clip or float("inf")  # 0 or null: no clipping
        grad_norm = (
            float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if any(p.grad is not None for p in params) else 0.0
        )
        avg_loss = sum(session.pending_losses) / len(session.pending_losses) if session.pending_losses else 0.0
        session.pending_losses.clear()
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise bad_request(f"gradient norm is {grad_norm}; the step was skipped and gradients cleared", "datums")
        for group in optimizer.param_groups:
            group["lr"] = req.learning_rate
            if req.beta1 is not None or req.beta2 is not None:
                b1, b2 = group["betas"]
                group["betas"] = (
                    req.beta1 if req.beta1 is not None else b1,
                    req.beta2 if req.beta2 is not None else b2,
                )
            if req.eps is not None:
                group["eps"] = req.eps
            if req.weight_decay is not None:
                group["weight_decay"] = req.weight_decay
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        session.step += 1
        return {
            "status": "ok",
            "step": session.step,
            "grad_norm": grad_norm,
            "avg_loss": avg_loss,
            "learning_rate": req.learning_rate,
        }

    # ---- persistence ---------------------------------------------------------------------------------------
    def _adapter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.slot.params.values()) + 16 * 1024

    def save_weights(self, session: Session, name: str) -> dict[str, Any]:
        """Write the adapter to `adapters/<session_id>/<name>` and publish it to `/v1/sample`."""
        self._live(session)
        target = self.adapters.target(session.session_id, name or f"step_{session.step:06d}", "name")
        self.slot.bind(session)
        self.adapters.write(target, self._adapter_bytes(), self.policy.save_adapter, "name")
        session.published = self.slot.snapshot(session)
        session.adapter_path = target
        session.adapter_version += 1
        log.info("session %s: adapter (step %d) saved to %s", session.session_id, session.step, target)
        return {"status": "ok", "adapter_path": str(target), "step": session.step}

    def save_checkpoint(self, session: Session, name: str) -> dict[str, Any]:
        """Adapter + optimizer + step under `checkpoints/<session_id>/<name>` (atomic, no pickle)."""
        self._live(session)
        target = self.checkpoints.target(session.session_id, name or f"step_{session.step:06d}", "name")
        self.slot.bind(session)
        info = {
            "step": session.step,
            "rank": session.rank,
            "base_model": session.base_model,
            "param_names": list(self.slot.params),
        }

        def write(path):
            return checkpoints.save_training_state(path, self.policy.save_adapter, session.optimizer, info)

        self.checkpoints.write(target, 3 * self._adapter_bytes(), write, "name")
        log.info("session %s: checkpoint (step %d) saved to %s", session.session_id, session.step, target)
        return {"status": "ok", "path": str(target)}

    def load_checkpoint(
        self, session: Session, path: str, with_optimizer: bool = True, also_own: str | None = None
    ) -> dict[str, Any]:
        """Restore adapter, optimizer state and step exactly; pending gradients and losses are dropped.

        With `with_optimizer=False` only the adapter is loaded: AdamW starts afresh and the step count is kept.
        `also_own` names another live session whose checkpoints the caller may load (the same Tinker client's).
        """
        self._live(session)
        live = set(self.sessions) - {also_own}
        directory = self.checkpoints.resolve_load(path, session.session_id, live, "path")
        shown = self.checkpoints.relative(directory)
        try:
            info, tensors = checkpoints.read_training_state(directory)
        except (OSError, ValueError) as exc:
            reason = "it does not exist or is not a checkpoint" if isinstance(exc, OSError) else exc
            raise bad_request(f"cannot load checkpoint {shown}: {reason}", "path") from None
        if info["rank"] != session.rank or info["param_names"] != list(self.slot.params):
            raise bad_request(f"checkpoint {shown} was written for another adapter (rank {info['rank']})", "path")
        self.slot.bind(session)
        try:
            self.policy.load_adapter(directory / checkpoints.ADAPTER_DIR)
            if with_optimizer:
                session.optimizer.load_state_dict(checkpoints.optimizer_from_flat(tensors, info["optimizer"]))
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise bad_request(f"checkpoint {shown} is damaged: {type(exc).__name__}", "path") from None
        if not with_optimizer:
            session.optimizer.state.clear()
        session.optimizer.zero_grad(set_to_none=True)
        session.pending_losses.clear()
        if with_optimizer:
            session.step = int(info["step"])
        log.info("session %s: checkpoint %s loaded (step %d)", session.session_id, directory, session.step)
        return {"status": "ok", "step": session.step}

    # ---- sampling (HF: the training model itself) -----------------------------------------------------------
    def check_prompt(self, tokens: Sequence[int], params: SamplingParams) -> SamplingParams:
        """400 for token ids outside the vocabulary or a prompt that fills the context; clamp `max_tokens`."""
        check_tokens(tokens, self.vocab_size, "tokens")
        check_tokens(params.stop_token_ids, self.vocab_size, "stop")
        limit = self.spec.max_seq_len
        if len(tokens) >= limit:
            raise bad_request(f"tokens has {len(tokens)} entries; the model's max_seq_len is {limit}", "tokens")
        params.max_tokens = min(params.max_tokens, limit - len(tokens))
        return params

    @torch.no_grad()
    def sample(
        self,
        session: Session | None,
        tokens: Sequence[int],
        params: SamplingParams,
        prompt_logprobs: bool,
        dist: Dist | None = None,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> tuple[list[SequenceOutput], list[float | None] | None]:
        """Sample with `session`'s published adapter (None: the base model); optionally score the prompt.

        With `dist`, the returned logprobs are recomputed under it (`rescore`), as training will compute them.
        `weights` (adapter tensors, e.g. a Tinker sampler's snapshot) replace the session's published ones.
        """
        self._live(session)
        params = self.check_prompt(tokens, params)
        with self._serving(session, weights) as model:
            model.eval()
            outputs = generate(model, self.tokenizer, tokens, params)
            prompt = self._prompt_logprobs(model, tokens) if prompt_logprobs else None
        if dist is not None:
            outputs = self.rescore(session, tokens, outputs, dist, weights)
        return outputs, prompt

    @torch.no_grad()
    def rescore(
        self,
        session: Session | None,
        tokens: Sequence[int],
        outputs: list[SequenceOutput],
        dist: Dist,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> list[SequenceOutput]:
        """Replace each output's logprobs with `dist_logprobs` under `dist` (the function training uses)."""
        self._live(session)
        rows = [list(tokens) + o.token_ids for o in outputs if o.token_ids]
        if not rows:
            return outputs
        width = max(len(r) for r in rows) - 1
        ids = torch.zeros((len(rows), width + 1), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r) - 1] = 1
        ids, mask = ids.to(self.fabric.device), mask.to(self.fabric.device)
        with self._serving(session, weights) as model:
            model.eval()
            with self.fabric.autocast():
                logits = model(input_ids=ids[:, :-1], attention_mask=mask, use_cache=False).logits
            lps = dist_logprobs(logits, ids[:, 1:], [dist] * len(rows))
        start = len(tokens) - 1
        it = iter(lps.tolist())
        for o in outputs:
            if o.token_ids:
                o.logprobs = next(it)[start : start + len(o.token_ids)]
        return outputs

    @contextmanager
    def _serving(
        self, session: Session | None, weights: dict[str, torch.Tensor] | None = None
    ) -> Iterator[torch.nn.Module]:
        """The model as `session` serves it (its published adapter, or `weights`), or the base model for None."""
        if self.policy is None:  # no session yet: the bare base model
            yield self.base_model
            return
        if weights is not None:
            inner = self.slot.serving(weights)
        elif session is not None:
            inner = self.slot.serving(session.published)
        else:
            inner = self.policy.reference()
        with inner:
            yield self.policy.model

    def read_adapter(self, directory: Path) -> dict[str, torch.Tensor]:
        """Adapter tensors from a saved adapter directory, without touching any session (400 when unfit)."""
        if self.slot is None:
            raise bad_request("no adapter shape yet: create a training model first", "model_path")
        scratch = {n: torch.zeros_like(p.data) for n, p in self.slot.params.items()}
        try:
            with self.slot.serving(scratch):
                self.policy.load_adapter(directory)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise bad_request(f"cannot load these weights: {type(exc).__name__}", "model_path") from None
        return scratch

    def _prompt_logprobs(self, model: torch.nn.Module, tokens: Sequence[int]) -> list[float | None]:
        if len(tokens) < 2:
            return [None]
        ids = torch.tensor([list(tokens)], device=self.fabric.device)
        logits = model(input_ids=ids[:, :-1], attention_mask=torch.ones_like(ids[:, :-1]), use_cache=False).logits
        return [None, *token_logprobs(logits, ids[:, 1:])[0].tolist()]


def _full_sequence(datum: Datum) -> list[int]:
    """The whole token sequence of a Tinker-layout datum (inputs plus the last target)."""
    return [*datum.model_input_tokens, datum.target_tokens[-1]]
