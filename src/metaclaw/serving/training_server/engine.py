"""`TrainingEngine`: one base model, one LoRA session per client, externally driven training steps.

Every method here runs on the model-owner thread (see `worker.ModelOwner`), so training and sampling never
interleave on the model. Fabric places the model and runs backward under the configured precision; the maths is
`LoraPolicy.logprobs` + a loss from `metaclaw.losses`, as in `train.py`.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate

from metaclaw.modules.loading import ModelSpec
from metaclaw.modules.policy import LoraPolicy, token_logprobs
from metaclaw.serving.sampling import SamplingParams, SequenceOutput, generate
from metaclaw.serving.security import confine_path
from metaclaw.serving.training_server import checkpoints
from metaclaw.serving.training_server.batching import check_tokens, collate
from metaclaw.serving.training_server.errors import ApiError, bad_request
from metaclaw.serving.training_server.loss_registry import LossRegistry
from metaclaw.serving.training_server.schemas import ForwardBackwardRequest, OptimStepRequest
from metaclaw.serving.training_server.sessions import AdapterSlot, Session
from metaclaw.serving.training_server.settings import ServerSettings

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
        self.cfg = settings.app
        self.fabric = _fabric(settings)
        self.losses = LossRegistry(self.cfg.losses)
        self.optimizer_factory = instantiate(self.cfg.optimizer)
        self.spec: ModelSpec = settings.model
        self.sessions: dict[str, Session] = {}
        self.latest: Session | None = None
        self.policy: LoraPolicy | None = None
        self.slot: AdapterSlot | None = None
        self.base_model: Any = None
        self.tokenizer: Any = None
        self.created = 0
        self.adapter_root = settings.checkpoint_dir / "adapters"
        self.checkpoint_root = settings.checkpoint_dir / "checkpoints"

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

    def _ensure_policy(self, base_model: str, rank: int) -> None:
        if not self._matches(base_model):
            if self.sessions or not self.cfg.allow_base_model_switch:
                raise ApiError(
                    409, f"base_model {base_model!r} is not the served model {self.spec.path!r}", "base_model"
                )
            wanted = ModelSpec(
                name=base_model, path=base_model, dtype=self.spec.dtype, max_seq_len=self.spec.max_seq_len
            )
            try:
                self.load_base(wanted)
            except Exception as exc:  # not a local directory nor a cached hub id; the served model stays
                raise bad_request(f"cannot load base_model {base_model!r}: {exc}", "base_model") from exc
        if self.slot is not None and self.slot.rank != rank:
            if self.sessions:
                raise ApiError(409, f"rank {rank} differs from the live sessions' rank {self.slot.rank}", "rank")
            self.base_model = self.policy.model.unload()
            self.policy, self.slot = None, None
        if self.policy is None:
            lora = self.cfg.lora
            self.policy = LoraPolicy(
                self.base_model,
                rank=rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                gradient_checkpointing=lora.gradient_checkpointing,
            )
            self.slot = AdapterSlot(self.policy)

    # ---- sessions ------------------------------------------------------------------------------------------
    def create_session(self, base_model: str, rank: int) -> tuple[Session, str]:
        """A new session with a freshly initialised adapter; returns it and the "trainable / total" string."""
        self._ensure_policy(base_model, rank)
        session_id = uuid.uuid4().hex[:8]
        session = self.slot.new_session(
            session_id, base_model or self.spec.path, self.cfg.seed + self.created, self.optimizer_factory
        )
        self.created += 1
        self.sessions[session_id] = session
        self.latest = session
        trainable, total = self.policy.num_parameters()
        log.info("session %s: %s rank %d, %d trainable parameters", session_id, session.base_model, rank, trainable)
        return session, f"{trainable / 1e6:.2f}M / {total / 1e6:.2f}M"

    def get(self, session_id: str | None) -> Session | None:
        """The named session (404 when unknown), or the most recent one when `session_id` is None."""
        if session_id is None:
            return self.latest
        session = self.sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"unknown session_id {session_id!r}; create one with /v1/lora/create", "session_id")
        return session

    # ---- training ------------------------------------------------------------------------------------------
    def forward_backward(self, session: Session, req: ForwardBackwardRequest) -> dict[str, Any]:
        """One padded forward over all datums, the loss, backward; gradients accumulate until `optim_step`."""
        loss_fn = self.losses.build(req.loss_fn, req.loss_fn_config)
        batch = collate(req.datums, self.vocab_size, self.spec.max_seq_len, self.tokenizer.pad_token_id or 0)
        batch = batch.to(self.fabric.device)
        self.slot.bind(session)
        self.policy.train()
        with self.fabric.autocast():
            logprobs = self.policy.logprobs(batch.input_ids, batch.target_ids, batch.attention_mask, req.temperature)
        out = loss_fn(logprobs.float(), batch.behaviour_logprobs, batch.advantages, batch.mask)
        loss = float(out.loss.detach())
        if not math.isfinite(loss):
            raise bad_request(
                f"the {req.loss_fn} loss is {loss} (check datums[].logprobs); nothing was applied", "datums"
            )
        self.fabric.backward(out.loss)
        session.pending_losses.append(loss)
        return {"status": "ok", "loss": loss, "total_tokens": batch.num_tokens, "num_datums": len(req.datums)}

    def optim_step(self, session: Session, req: OptimStepRequest) -> dict[str, Any]:
        """Clip gradients, AdamW step at the request's learning rate, zero gradients."""
        self.slot.bind(session)
        params = list(self.slot.params.values())
        optimizer = session.optimizer
        max_norm = self.cfg.grad_clip_norm or float("inf")
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
    def _target(self, root: Path, name: str, field: str) -> Path:
        try:
            path = confine_path(root, name, field)
        except ValueError as exc:
            raise bad_request(str(exc), field) from exc
        if path == root.resolve():
            raise bad_request(f"{field} {name!r} names the root directory itself", field)
        return path

    def save_weights(self, session: Session, name: str) -> dict[str, Any]:
        """Write the adapter to `adapters/<name>` and publish it to `/v1/sample` (returns the path)."""
        target = self._target(self.adapter_root, name or f"{session.session_id}_step_{session.step:06d}", "name")
        self.slot.bind(session)
        self.policy.save_adapter(target)
        session.published = self.slot.snapshot(session)
        session.adapter_path = target
        session.adapter_version += 1
        log.info("session %s: adapter (step %d) saved to %s", session.session_id, session.step, target)
        return {"status": "ok", "adapter_path": str(target), "step": session.step}

    def save_checkpoint(self, session: Session, name: str) -> dict[str, Any]:
        """Adapter + optimizer + step under `checkpoints/<name>` (atomic, no pickle)."""
        target = self._target(self.checkpoint_root, name or f"{session.session_id}_step_{session.step:06d}", "name")
        self.slot.bind(session)
        info = {
            "step": session.step,
            "rank": session.rank,
            "base_model": session.base_model,
            "param_names": list(self.slot.params),
        }
        checkpoints.save_training_state(target, self.policy.save_adapter, session.optimizer, info)
        log.info("session %s: checkpoint (step %d) saved to %s", session.session_id, session.step, target)
        return {"status": "ok", "path": str(target)}

    def load_checkpoint(self, session: Session, path: str) -> dict[str, Any]:
        """Restore adapter, optimizer state and step exactly; pending gradients and losses are dropped."""
        directory = self._target(self.checkpoint_root, path, "path")
        try:
            info, tensors = checkpoints.read_training_state(directory)
        except (OSError, ValueError) as exc:
            raise bad_request(f"cannot load checkpoint {path!r}: {exc}", "path") from exc
        if info.get("rank") != session.rank or info.get("param_names") != list(self.slot.params):
            raise bad_request(f"checkpoint {path!r} was written for another adapter (rank {info.get('rank')})", "path")
        self.slot.bind(session)
        self.policy.load_adapter(directory / checkpoints.ADAPTER_DIR)
        session.optimizer.load_state_dict(checkpoints.optimizer_from_flat(tensors, info["optimizer"]))
        session.optimizer.zero_grad(set_to_none=True)
        session.pending_losses.clear()
        session.step = int(info["step"])
        log.info("session %s: checkpoint %s loaded (step %d)", session.session_id, directory, session.step)
        return {"status": "ok", "step": session.step}

    # ---- sampling (HF: the training model itself) -----------------------------------------------------------
    def check_prompt(self, tokens: Sequence[int], params: SamplingParams) -> SamplingParams:
        """400 for token ids outside the vocabulary or a prompt that fills the context; clamp `max_tokens`."""
        check_tokens(tokens, self.vocab_size, "tokens")
        limit = self.spec.max_seq_len
        if len(tokens) >= limit:
            raise bad_request(f"tokens has {len(tokens)} entries; the model's max_seq_len is {limit}", "tokens")
        params.max_tokens = min(params.max_tokens, limit - len(tokens))
        return params

    @torch.no_grad()
    def sample(
        self, session: Session | None, tokens: Sequence[int], params: SamplingParams, prompt_logprobs: bool
    ) -> tuple[list[SequenceOutput], list[float | None] | None]:
        """Sample with `session`'s published adapter (None: the base model); optionally score the prompt."""
        params = self.check_prompt(tokens, params)
        if self.policy is None:  # no session yet: the bare base model
            self.base_model.eval()
            return self._generate(self.base_model, tokens, params, prompt_logprobs)
        self.policy.eval()
        ctx = self.slot.serving(session.published) if session is not None else self.policy.reference()
        with ctx:
            return self._generate(self.policy.model, tokens, params, prompt_logprobs)

    def _generate(
        self, model: torch.nn.Module, tokens: Sequence[int], params: SamplingParams, want_prompt: bool
    ) -> tuple[list[SequenceOutput], list[float | None] | None]:
        outputs = generate(model, self.tokenizer, tokens, params)
        if not want_prompt:
            return outputs, None
        if len(tokens) < 2:
            return outputs, [None]
        ids = torch.tensor([list(tokens)], device=self.fabric.device)
        logits = model(input_ids=ids[:, :-1], attention_mask=torch.ones_like(ids[:, :-1]), use_cache=False).logits
        return outputs, [None, *token_logprobs(logits, ids[:, 1:])[0].tolist()]
