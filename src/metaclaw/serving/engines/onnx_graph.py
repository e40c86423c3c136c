"""The decoder as one exportable torch graph: explicit KV cache and LoRA factors as inputs (for the ONNX engine).

`DecoderGraph` re-expresses a Llama or Qwen3 causal LM (the architectures metaclaw ships: SmolLM2 is Llama, the
tiny test model is Qwen3) as a single forward with every piece of state an input, so that ONNX Runtime runs it
with quantised weights while the adapter stays a runtime input:

    logits [B, K, V], present_key_<i>, present_value_<i> [B, Hkv, P+S, D]
        = graph(input_ids [B, S], attention_mask [B, P+S], position_ids [B, S], keep [K] (the positions whose logits
                are wanted), past_key_<i>, past_value_<i> [B, Hkv, P, D], lora_A_<g>_<i> [in_g, R_g],
                lora_B_<g>_<i> [R_g, out_g])

Per layer `i`, the cache is one input and one output per key and value: a stacked `[L, 2, ...]` cache was split and
re-stacked (copied whole) on every step. The projections that share an input are one weight each: q/k/v (`qkv`) and
gate/up (`gu`), beside `o` and `down` (`LORA_GROUPS`): four quantised MatMuls per layer instead of seven. Their LoRA
factors come the same way, ready to multiply (no Transpose in the graph): `lora_A_<g>` is the group's A matrices
transposed and side by side, `[in, R]` (R = r times the group's modules), and `lora_B_<g>` their B matrices
transposed, block diagonal, `[R, out]` (scaled by alpha / r): the group's output is `W x + (x A) B`, PEFT's unmerged
LoRA of each module. With `lora=False` the graph has no factor inputs at all (the base model: what the engine runs
when no adapter is served). Swapping an adapter is feeding other tensors: nothing is recompiled and the quantised
base weights are never touched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

#: LoRA target modules the graph takes factors for: (name, PEFT module path inside a layer)
LORA_SLOTS: tuple[tuple[str, str], ...] = (
    ("q_proj", "self_attn.q_proj"),
    ("k_proj", "self_attn.k_proj"),
    ("v_proj", "self_attn.v_proj"),
    ("o_proj", "self_attn.o_proj"),
    ("gate_proj", "mlp.gate_proj"),
    ("up_proj", "mlp.up_proj"),
    ("down_proj", "mlp.down_proj"),
)
#: the graph's projections: modules sharing an input are one MatMul (and one pair of LoRA inputs), in input order
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gu": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}

SUPPORTED = ("llama", "qwen3")
GRAPH_VERSION = 4  # bump when the graph changes: cached exports are keyed by it


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def rotation(dim: int) -> Tensor:
    """`R` with `x @ R == cat(-x[..., dim/2:], x[..., :dim/2])` (RoPE's rotate-half): one MatMul in the graph instead
    of two Slices, a Neg, a Concat and their shape arithmetic; exact (each output is one input times ±1)."""
    half = dim // 2
    r = torch.zeros(dim, dim)
    r[torch.arange(half) + half, torch.arange(half)] = -1.0
    r[torch.arange(half), torch.arange(half) + half] = 1.0
    return r


class _Fused(nn.Module):
    """The modules of a group as one linear map (their weights, and biases if any, stacked along the output)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.sizes = [lin.out_features for lin in linears]
        self.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
        biases = [lin.bias for lin in linears]
        self.bias = None
        if any(b is not None for b in biases):
            parts = [torch.zeros(n) if b is None else b.detach() for n, b in zip(self.sizes, biases, strict=True)]
            self.bias = nn.Parameter(torch.cat(parts), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class DecoderGraph(nn.Module):
    """The forward of a Hugging Face Llama/Qwen3 causal LM with the KV cache (and LoRA factors) as inputs.

    Args:
        model: the loaded `LlamaForCausalLM` / `Qwen3ForCausalLM` (fp32); its weights are read, the fused groups copied.
        lora: whether the graph takes LoRA factors (False: the base model alone, fewer nodes).
    """

    def __init__(self, model: Any, lora: bool = True) -> None:
        super().__init__()
        cfg: Any = model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"the ONNX engine supports {SUPPORTED} models, not {cfg.model_type!r}")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"the ONNX engine supports default RoPE only, not {rope.get('rope_type')!r}")
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.lora = lora
        self.n_layers: int = int(cfg.num_hidden_layers)
        self.n_heads: int = int(cfg.num_attention_heads)
        self.n_kv: int = int(cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.qk_norm = cfg.model_type == "qwen3"
        inner: Any = model.model
        self.embed: Any = inner.embed_tokens
        self.layers: Any = inner.layers
        self.fused = nn.ModuleList(
            nn.ModuleDict({g: _Fused([layer.get_submodule(dict(LORA_SLOTS)[m]) for m in mods])
                           for g, mods in LORA_GROUPS.items()})
            for layer in self.layers
        )  # fmt: skip
        self.norm: Any = inner.norm
        # the output projection as its own weight (a tied embedding is shared in memory but exported as a separate
        # initializer, so the quantiser sees a plain MatMul)
        self.lm_head: Any = model.lm_head
        self.inv_freq: Tensor
        self.rot: Tensor
        self.register_buffer("rot", rotation(self.head_dim), persistent=False)
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each LoRA slot (module)."""
        layer = self.layers[0]
        out = {}
        for name, path in LORA_SLOTS:
            lin = layer.get_submodule(path)
            out[name] = (lin.in_features, lin.out_features)
        return out

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: Tensor,
                *state: Tensor) -> tuple[Tensor, ...]:  # fmt: skip
        past, lora = state[: 2 * self.n_layers], state[2 * self.n_layers :]
        bsz, seq = input_ids.shape
        h = self.embed(input_ids)
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, S, D]
        total = attention_mask.shape[1]
        q_idx = torch.arange(seq, device=input_ids.device) + (total - seq)
        k_idx = torch.arange(total, device=input_ids.device)
        allowed = (k_idx[None, :] <= q_idx[:, None])[None, None] & (attention_mask[:, None, None, :] > 0)
        rep = self.n_heads // self.n_kv
        # the mask for the `rep` query heads of a KV head side by side (rows r * S + s), made once for every layer
        bias = torch.zeros(allowed.shape, dtype=h.dtype).masked_fill(~allowed, torch.finfo(h.dtype).min)
        bias = bias.repeat(1, 1, rep, 1)  # [B, 1, rep * S, P + S]
        scale = 1.0 / math.sqrt(self.head_dim)
        groups = len(LORA_GROUPS)
        presents: list[Tensor] = []
        fused_layers: Any = self.fused
        for i, (layer, fused) in enumerate(zip(self.layers, fused_layers, strict=True)):
            factors = lora[2 * groups * i : 2 * groups * (i + 1)]

            def proj(x: Tensor, g: int, name: str, fused: Any = fused, factors: Any = factors) -> Tensor:
                out = fused[name](x)
                if self.lora:
                    out = out + torch.matmul(torch.matmul(x, factors[2 * g]), factors[2 * g + 1])
                return out

            att = layer.self_attn
            x = _rms(h, layer.input_layernorm.weight, self.eps)
            q, k, v = proj(x, 0, "qkv").split(fused["qkv"].sizes, dim=-1)
            q, k, v = (t.reshape(bsz, seq, -1, self.head_dim) for t in (q, k, v))
            if self.qk_norm:
                q = _rms(q, att.q_norm.weight, self.eps)
                k = _rms(k, att.k_norm.weight, self.eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + torch.matmul(q, self.rot) * sin
            k = k * cos + torch.matmul(k, self.rot) * sin
            k = torch.cat((past[2 * i], k), dim=2)
            v = torch.cat((past[2 * i + 1], v), dim=2)
            presents += [k, v]
            # grouped-query attention without repeating the cache: the `rep` query heads of a KV head side by side
            qg = q.reshape(bsz, self.n_kv, rep * seq, self.head_dim)
            probs = torch.softmax(torch.matmul(qg, k.transpose(2, 3)) * scale + bias, dim=-1)
            o = torch.matmul(probs, v).reshape(bsz, self.n_heads, seq, self.head_dim).transpose(1, 2)
            h = h + proj(o.reshape(bsz, seq, -1), 1, "o")
            x = _rms(h, layer.post_attention_layernorm.weight, self.eps)
            gate, up = proj(x, 2, "gu").split(fused["gu"].sizes, dim=-1)
            h = h + proj(nn.functional.silu(gate) * up, 3, "down")
        logits = self.lm_head(_rms(h.index_select(1, keep), self.norm.weight, self.eps))
        return (logits, *presents)

    def lora_input_shapes(self, rank: int) -> dict[str, tuple[int, int]]:
        """`{lora_A_<g>: (in, R), lora_B_<g>: (R, out)}` for rank `rank` (per layer)."""
        slots = self.lora_shapes()
        out = {}
        for g, mods in LORA_GROUPS.items():
            out[f"lora_A_{g}"] = (slots[mods[0]][0], rank * len(mods))
            out[f"lora_B_{g}"] = (rank * len(mods), sum(slots[m][1] for m in mods))
        return out

    def example_inputs(self, bsz: int = 1, seq: int = 3, past_len: int = 2, rank: int = 2) -> tuple[Any, ...]:
        """Inputs of the right shapes (for tracing and tests)."""
        ids = torch.zeros((bsz, seq), dtype=torch.int64)
        mask = torch.ones((bsz, past_len + seq), dtype=torch.int64)
        pos = torch.arange(past_len, past_len + seq)[None].expand(bsz, seq).contiguous()
        past = [torch.zeros((bsz, self.n_kv, past_len, self.head_dim)) for _ in range(2 * self.n_layers)]
        lora: list[Tensor] = []
        if self.lora:
            shapes = self.lora_input_shapes(rank)
            for _ in range(self.n_layers):
                lora += [torch.zeros(shapes[f"lora_{p}_{g}"]) for g in LORA_GROUPS for p in "AB"]
        return (ids, mask, pos, torch.arange(seq), *past, *lora)


def cache_names(layers: int, prefix: str) -> list[str]:
    """`<prefix>_key_<i>`, `<prefix>_value_<i>` per layer (prefix `past` for the inputs, `present` for the outputs)."""
    return [f"{prefix}_{kv}_{i}" for i in range(layers) for kv in ("key", "value")]


def lora_names(layers: int) -> list[str]:
    return [f"lora_{p}_{g}_{i}" for i in range(layers) for g in LORA_GROUPS for p in "AB"]


def input_names(layers: int, lora: bool = True) -> list[str]:
    names = ["input_ids", "attention_mask", "position_ids", "keep", *cache_names(layers, "past")]
    return names + (lora_names(layers) if lora else [])


def export_onnx(graph: DecoderGraph, path: str) -> None:
    """Trace `graph` into an ONNX file at `path` (dynamic batch, sequence, past length and LoRA rank)."""
    dyn: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "seq"},
        "keep": {0: "kept"},
        "logits": {0: "batch", 1: "kept"},
    }
    for name in cache_names(graph.n_layers, "past"):
        dyn[name] = {0: "batch", 2: "past_len"}
    for name in cache_names(graph.n_layers, "present"):
        dyn[name] = {0: "batch", 2: "total"}
    if graph.lora:
        for name in lora_names(graph.n_layers):
            group = name.split("_")[2]  # each group's own rank axis (R is r times its modules)
            dyn[name] = {1: f"rank_{group}"} if name.startswith("lora_A") else {0: f"rank_{group}"}
    outputs = ["logits", *cache_names(graph.n_layers, "present")]
    with torch.no_grad():
        torch.onnx.export(
            graph, graph.example_inputs(), path, input_names=input_names(graph.n_layers, graph.lora),
            output_names=outputs, dynamic_axes=dyn, opset_version=17, dynamo=False,
        )  # fmt: skip
