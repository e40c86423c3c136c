"""The trainable policy: a causal LM with a PEFT LoRA adapter, and the per-token logprobs every loss needs."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from metaclaw.atomic import write_dir_atomically
from metaclaw.config import LORA_TARGET_MODULES
from metaclaw.distribution.logprobs import Param, token_logprobs, top_logprobs
from metaclaw.memory_plan import Shape
from metaclaw.runfiles.layout import write_adapter_info
from metaclaw.wire import ADAPTER_WEIGHTS

log = logging.getLogger(__name__)

# what FSDP and its activation checkpointing insert into parameter names (torch's FSDP_WRAPPED_MODULE, ...)
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _head_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: Tensor, top_p: Tensor,
                   top_k: Tensor) -> Tensor:  # fmt: skip
    """Logprobs of `targets` from `[N, H]` final hidden states: the LM head, then `token_logprobs`."""
    return token_logprobs(head(hidden), targets, temperature, top_p, top_k)


def _placed(where: Tensor, flat: Tensor) -> Tensor:
    """`flat` (`[N, ...]`, one entry per position of the `[B, T]` mask `where`, row-major) set into zeros
    `[B, T, ...]`; gradients flow to `flat`."""
    out = flat.new_zeros(*where.shape, *flat.shape[1:])
    out[where] = flat
    return out


PAD_SLACK = 0.1  # a length group's padded positions are at most this share of its real ones


def length_groups(lengths: list[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Row indices grouped by length (longest first): a row joins the current group while the group's padded
    size (rows x longest) stays within `1 + slack` of its real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            longest = lengths[g[0]]
            if (len(g) + 1) * longest <= (1 + slack) * (sum(lengths[j] for j in g) + lengths[i]):
                g.append(i)
                continue
        groups.append([i])
    return groups


class LoraPolicy(nn.Module):
    """A base causal LM wrapped with a LoRA adapter; the reference policy is the same model, adapter disabled.

    Args:
        model: a Hugging Face causal LM (its weights are frozen by PEFT).
        rank: LoRA rank `r`.
        alpha: LoRA `alpha` (scaling = alpha / rank).
        dropout: LoRA dropout.
        target_modules: module names to adapt; default: every attention and MLP projection.
        gradient_checkpointing: trade compute for memory; works with PEFT (inputs require grad, embeddings frozen).
        activation_budget_mib: with checkpointing off, a step whose batch would keep more activations than this
            (its positions × the model's bytes per position, `memory_plan.Shape`) is checkpointed, the others are
            not (`checkpoint_for`): the main job's short turns keep their speed, an agent's 7k-token turns fit.
            4096 MiB by default; None: never.
        logprob_chunk_size: response positions whose logits are computed at once (memory: this x vocabulary).
        adapters: more named adapters besides PEFT's `default`, with the same LoRA settings (many agents: one
            per agent, docs/agents.md). `use_adapter(name)` picks the one that is applied and trained. Every
            adapter's weights stay trainable (`requires_grad`): DDP registers the trainable parameters once,
            when it wraps the model, so each adapter must be trainable then. Only the applied adapter is in the
            graph, so the others get no gradient (`None`).
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int = 16,
        alpha: int = 32,
        dropout: float = 0.0,
        target_modules: Sequence[str] = LORA_TARGET_MODULES,
        gradient_checkpointing: bool = False,
        logprob_chunk_size: int = 512,
        adapters: Sequence[str] = (),
        activation_budget_mib: float | None = 4096,
    ) -> None:
        super().__init__()
        if logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1, got {logprob_chunk_size}")
        self.logprob_chunk_size = logprob_chunk_size
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=dropout,
            target_modules=list(target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(model, config)
        for name in adapters:
            self.model.add_adapter(name, config)
        self.adapter_names = ["default", *adapters]
        self._anchors: dict[str, dict[str, Tensor]] = {}  # `set_anchor`: per adapter, what `anchored()` applies
        self.use_adapter("default")
        self.set_gradient_checkpointing(gradient_checkpointing)
        self.always_checkpoint = gradient_checkpointing
        self.checkpoint_above: int | None = None  # positions; set from the budget and the model's shape
        if activation_budget_mib is not None and not gradient_checkpointing:
            shape = Shape.of(getattr(model, "config").to_dict())  # noqa: B009 - nn.Module has no typed config
            per = shape.activations_per_token(False, next(model.parameters()).element_size())
            self.checkpoint_above = max(1, int(activation_budget_mib * 2**20 // per))
        self.model.config.use_cache = False

    def checkpoint_for(self, positions: int) -> None:
        """Checkpointing on for a batch of more than `checkpoint_above` positions, off again below it."""
        if self.always_checkpoint or self.checkpoint_above is None:
            return
        on = positions > self.checkpoint_above
        if on != self.gradient_checkpointing:
            if on:
                log.info("A batch of %d positions: gradient checkpointing on (more than %d would keep over "
                         "policy.activation_budget_mib of activations)", positions, self.checkpoint_above)  # fmt: skip
            self.set_gradient_checkpointing(on)

    def set_gradient_checkpointing(self, on: bool) -> None:
        """Keep only each decoder layer's input for backward and recompute the layer (non-reentrant).

        The inputs are made to require grad (`enable_input_require_grads`) so the embeddings stay frozen.
        transformers >= 5.23 names this "activation checkpointing"; the vLLM venv's older transformers does not.
        """
        base = self.model.get_base_model()
        if on:
            if hasattr(base, "activation_checkpointing_enable"):
                base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        elif self.gradient_checkpointing:
            if hasattr(base, "activation_checkpointing_disable"):
                base.activation_checkpointing_disable()
            else:
                base.gradient_checkpointing_disable()
            base.disable_input_require_grads()

    @property
    def gradient_checkpointing(self) -> bool:
        base = self.model.get_base_model()
        if hasattr(base, "activation_checkpointing_enable"):
            return base.is_activation_checkpointing
        return base.is_gradient_checkpointing

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """`[B, T]` ids → `[B, T, V]` logits."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def logprobs(
        self,
        input_ids: Tensor,
        target_ids: Tensor,
        attention_mask: Tensor,
        temperature: Param = 1.0,
        top_p: Param = 1.0,
        top_k: Param = -1,
        mask: Tensor | None = None,
    ) -> Tensor:
        """`[B, T]` logprob of `target_ids[b, t]` after `input_ids[b, :t+1]` (see `token_logprobs`); `[B, T, K]`
        `target_ids` (K tokens per position: a teacher's top-k) give `[B, T, K]`.

        Only the positions in `mask` (default: `attention_mask`) get logits: the decoder's hidden states are
        taken there and the LM head is applied in chunks of `logprob_chunk_size` rows, each recomputed in the
        backward pass instead of kept, so memory grows with the response tokens, not prompt x vocabulary.
        Other positions are 0.
        """
        where = (attention_mask if mask is None else mask).bool()
        base = self.model.get_base_model()
        head = base.get_output_embeddings()
        if head is None or getattr(base.config, "final_logit_softcapping", None):  # logits are not lm_head(h)
            logits = self(input_ids, attention_mask)[where]
            flat = token_logprobs(logits, target_ids[where], *self._at(where, temperature, top_p, top_k))
            return _placed(where, flat)
        hidden = self._hidden_at(base.get_decoder(), input_ids, attention_mask, where)  # [N, H]
        targets, params = target_ids[where], self._at(where, temperature, top_p, top_k)
        pieces = []
        for i in range(0, hidden.shape[0], self.logprob_chunk_size):
            part = slice(i, i + self.logprob_chunk_size)
            args = (hidden[part], targets[part], *(x[part] for x in params))
            if torch.is_grad_enabled() and hidden.requires_grad:
                pieces.append(checkpoint(_head_logprobs, head, *args, use_reentrant=False))
            else:
                pieces.append(_head_logprobs(head, *args))
        flat = torch.cat(pieces) if pieces else hidden.new_zeros(0, *targets.shape[1:], dtype=torch.float32)
        return _placed(where, flat)

    @torch.no_grad()
    def top_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, where: Tensor, k: int, temperature: Param = 1.0,
        top_p: Param = 1.0, top_k: Param = -1,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """`(ids, logprobs)`, each `[N, k]`: the `k` most likely next tokens at the `N` positions of `where`
        (row-major) and their logprobs under the sampling distribution (`distribution.logprobs.top_logprobs`), as
        the policy is now (inside `reference()`: the base model's). No gradient; the LM head runs in chunks."""
        base = self.model.get_base_model()
        head = base.get_output_embeddings()
        params = self._at(where, temperature, top_p, top_k)
        if head is None or getattr(base.config, "final_logit_softcapping", None):  # logits are not lm_head(h)
            return top_logprobs(self(input_ids, attention_mask)[where], k, *params)
        hidden = self._hidden_at(base.get_decoder(), input_ids, attention_mask, where)
        parts = [slice(i, i + self.logprob_chunk_size) for i in range(0, hidden.shape[0], self.logprob_chunk_size)]
        pieces = [top_logprobs(head(hidden[s]), k, *(x[s] for x in params)) for s in parts]
        if not pieces:
            return hidden.new_zeros(0, k, dtype=torch.long), hidden.new_zeros(0, k, dtype=torch.float32)
        return torch.cat([ids for ids, _ in pieces]), torch.cat([lps for _, lps in pieces])

    @staticmethod
    def _hidden_at(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor, where: Tensor) -> Tensor:
        """The decoder's last hidden states at `where` (`[N, H]`, row-major), computed over length-grouped
        micro-batches: rows of similar length run together, each trimmed to its longest, so right padding costs
        at most `PAD_SLACK` of the real positions (one padded batch wasted a third on the CPU demo's turns)."""
        lengths = attention_mask.sum(dim=-1).tolist()
        groups = length_groups(lengths)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()  # FSDP: one call
        if distributed or (len(groups) == 1 and max(lengths) == attention_mask.shape[1]):
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return out.last_hidden_state[where]
        rows: list[Tensor | None] = [None] * len(lengths)
        for idx in groups:
            t = max(int(lengths[i]) for i in idx)
            sel = torch.tensor(idx, device=input_ids.device)
            out = decoder(input_ids=input_ids[sel, :t], attention_mask=attention_mask[sel, :t], use_cache=False)
            for j, i in enumerate(idx):
                rows[i] = out.last_hidden_state[j][where[i, :t]]
        return torch.cat(rows)  # type: ignore[arg-type]

    @staticmethod
    def _at(where: Tensor, *values: Param) -> list[Tensor]:
        """Each scalar / `[B]` / `[B, T]` parameter as one value per selected position."""
        out = []
        for v in values:
            t = torch.as_tensor(v, device=where.device)
            if t.dim() == 1:
                t = t.view(-1, 1)
            out.append(t.expand(where.shape)[where])
        return out

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Within this block the policy is the base model (adapter disabled)."""
        with self.model.disable_adapter():
            yield

    def set_anchor(self, adapter: str, directory: str | os.PathLike | None) -> None:
        """Adapter `adapter`'s anchor (what `anchored()` applies) becomes the published adapter in `directory` (its
        weights read once and kept here, one copy per adapter: the LoRA weights only), or the base model (None).
        The trainer's own weights are left exactly as they were."""
        if directory is None:
            self._anchors.pop(adapter, None)
            return
        params = dict(self._named_adapter_parameters(adapter))
        own = {n: p.detach().clone() for n, p in params.items()}
        try:
            self.load_adapter(directory, adapter)
            self._anchors[adapter] = {n: p.detach().clone() for n, p in params.items()}
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(own[n])

    def anchor_of(self, adapter: str) -> dict[str, Tensor] | None:
        """The weights `anchored()` applies for `adapter` (None: the base model)."""
        return self._anchors.get(adapter)

    @contextmanager
    def anchored(self) -> Iterator[None]:
        """Within this block the policy is the active adapter's anchor (`set_anchor`: the adapter the user is
        served), or the base model when it has none. Its weights are copied in place and copied back on exit:
        call it before any forward whose graph is kept for backward (an in-place change of a weight that graph
        saved fails the backward)."""
        anchor = self._anchors.get(str(self.model.active_adapter))
        if anchor is None:
            with self.reference():
                yield
            return
        params = dict(self._named_adapter_parameters(str(self.model.active_adapter)))
        own = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(anchor[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(own[n])

    def _named_adapter_parameters(self, adapter: str) -> list[tuple[str, nn.Parameter]]:
        """`adapter`'s weights by name; refused under FSDP, whose ranks each hold a shard of them."""
        named = [(n, p) for n, p in self.named_parameters() if self._adapter_of(n) == adapter]
        if any(n != _clean_name(n) for n, _ in named):
            raise NotImplementedError("an anchor of sharded (FSDP) adapter weights is not supported: "
                                      "set kl.reference=base")  # fmt: skip
        return named

    def use_adapter(self, name: str) -> None:
        """Apply and train adapter `name` from now on: the others are not in the graph and get no gradient.

        PEFT's `set_adapter` freezes the adapters it does not apply; with several adapters they are made
        trainable again, so the set of trainable parameters never changes (what DDP needs, see the class).
        """
        if name != self.model.active_adapter:
            self.model.set_adapter(name)
        if len(self.adapter_names) > 1:
            self.model.set_requires_grad(self.adapter_names, True)

    @staticmethod
    def _adapter_of(param_name: str) -> str | None:
        """The adapter a parameter belongs to (`...q_proj.lora_A.<adapter>.weight`), None for base weights."""
        parts = param_name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.startswith("lora_"):
                return parts[i + 1]
        return None

    def adapter_parameters(self, adapter: str | None = None) -> list[nn.Parameter]:
        """The weights of `adapter` (default: of every adapter), trainable or frozen right now."""
        wanted = self.adapter_names if adapter is None else [adapter]
        return [p for n, p in self.named_parameters() if self._adapter_of(n) in wanted]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """Every adapter's weights (what a checkpoint keeps), active or not."""
        return {n: p.detach() for n, p in self.named_parameters() if self._adapter_of(n) in self.adapter_names}

    def num_parameters(self) -> tuple[int, int]:
        """(trainable, total) parameter counts."""
        total = sum(p.numel() for p in self.parameters())
        return sum(p.numel() for p in self.parameters() if p.requires_grad), total

    def save_adapter(self, directory: str | os.PathLike, adapter: str = "default", version: int | None = None) -> Path:
        """Write one adapter (safetensors + adapter_config.json, and `version` as data when it is a published
        version: `metaclaw.runfiles.layout`) atomically: temp dir, then rename.

        Only the LoRA tensors: a LoRA on a tied lm_head must not drag the whole embedding matrix along. PEFT picks
        them from the parameters themselves, not `state_dict()`: under FSDP the publisher calls this inside
        `summon_full_params` (rank 0 holds the full LoRA weights there), where FSDP's state-dict hooks would gather
        the shards a second time (a crash, seen on CPU/gloo); the wrapper prefixes FSDP puts in parameter names are
        then taken out of the file's keys.
        """
        state = {n: p.detach() for n, p in self.model.named_parameters()}

        def fill(tmp: Path) -> None:
            self.model.save_pretrained(tmp, safe_serialization=True, selected_adapters=[adapter],
                                       save_embedding_layers=False, state_dict=state)  # fmt: skip
            if adapter != "default":  # PEFT writes a named adapter into `<dir>/<name>/`: lift it to `<dir>/`
                for f in list((tmp / adapter).iterdir()):
                    f.rename(tmp / f.name)
                (tmp / adapter).rmdir()
            weights = load_file(str(tmp / ADAPTER_WEIGHTS))
            if any(_clean_name(k) != k for k in weights):
                save_file({_clean_name(k): v for k, v in weights.items()}, str(tmp / ADAPTER_WEIGHTS), {"format": "pt"})
            if version is not None:
                write_adapter_info(tmp, version)

        return write_dir_atomically(Path(directory), fill)

    def restore_adapter(self, adapter: str, directory: str | os.PathLike | None) -> None:
        """Put adapter `adapter` back to the published one in `directory`, or (None) to fresh LoRA weights: A drawn
        anew, B = 0, so the policy is the base model again and can still learn (A = B = 0 would get no gradient)."""
        if directory is not None:
            self.load_adapter(directory, adapter)
            return
        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, LoraLayer) and adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, init_lora_weights=True)

    def load_adapter(self, directory: str | os.PathLike, adapter: str = "default") -> None:
        """Load adapter weights written by `save_adapter` (safetensors only: nothing is unpickled)."""
        state = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
        result = set_peft_model_state_dict(self.model, state, adapter_name=adapter)
        if result.unexpected_keys:
            raise ValueError(f"adapter at {directory} has unexpected keys: {result.unexpected_keys[:3]}")
