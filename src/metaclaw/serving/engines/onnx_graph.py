"""The decoder as one exportable torch graph: explicit KV cache and LoRA factors as inputs (for the ONNX engine).

`DecoderGraph` re-expresses a Llama or Qwen3 causal LM (the architectures metaclaw ships: SmolLM2 is Llama, the
tiny test model is Qwen3) as a single forward with every piece of state an input, so that ONNX Runtime runs it
with quantised weights while the adapter stays a runtime input:

    logits [B, K, V], present [L, 2, B, Hkv, P+S, D] = graph(input_ids [B, S], attention_mask [B, P+S],
                                                             position_ids [B, S], past [L, 2, B, Hkv, P, D],
                                                             keep [K] (the positions whose logits are wanted),
                                                             lora_A_<m>_<i> [r, in_m], lora_B_<m>_<i> [out_m, r])

for each LoRA target module `m` (q/k/v/o/gate/up/down) of each layer `i`: one input per layer, since indexing a
stacked `[L, ...]` input became a Split copying all of it every step (18 MB for SmolLM2 at rank 16; Split and
Squeeze were 18% of a profiled decode step's kernel time). `lora_B` carries the adapter's scale (alpha / r): the
module's output is `W x + B (A x)`, which is PEFT's unmerged LoRA. No adapter: rank-1 zeros. Swapping an adapter is
therefore feeding other tensors: nothing is recompiled and the quantised base weights are never touched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

#: LoRA target modules the graph takes factors for, in input order: (name, PEFT module path inside a layer)
LORA_SLOTS: tuple[tuple[str, str], ...] = (
    ("q_proj", "self_attn.q_proj"),
    ("k_proj", "self_attn.k_proj"),
    ("v_proj", "self_attn.v_proj"),
    ("o_proj", "self_attn.o_proj"),
    ("gate_proj", "mlp.gate_proj"),
    ("up_proj", "mlp.up_proj"),
    ("down_proj", "mlp.down_proj"),
)

SUPPORTED = ("llama", "qwen3")
GRAPH_VERSION = 2  # bump when the graph changes: cached exports are keyed by it


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def _rotate(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderGraph(nn.Module):
    """The forward of a Hugging Face Llama/Qwen3 causal LM with the KV cache and LoRA factors as inputs.

    Args:
        model: the loaded `LlamaForCausalLM` / `Qwen3ForCausalLM` (fp32); its weights are shared, not copied.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        cfg: Any = model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"the ONNX engine supports {SUPPORTED} models, not {cfg.model_type!r}")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"the ONNX engine supports default RoPE only, not {rope.get('rope_type')!r}")
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.n_layers: int = int(cfg.num_hidden_layers)
        self.n_heads: int = int(cfg.num_attention_heads)
        self.n_kv: int = int(cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.qk_norm = cfg.model_type == "qwen3"
        inner: Any = model.model
        self.embed: Any = inner.embed_tokens
        self.layers: Any = inner.layers
        self.norm: Any = inner.norm
        # the output projection as its own weight (a tied embedding is shared in memory but exported as a separate
        # initializer, so the quantiser sees a plain MatMul)
        self.lm_head: Any = model.lm_head
        self.inv_freq: Tensor
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each LoRA slot."""
        layer = self.layers[0]
        out = {}
        for name, path in LORA_SLOTS:
            lin = layer.get_submodule(path)
            out[name] = (lin.in_features, lin.out_features)
        return out

    def _proj(self, x: Tensor, lin: nn.Linear, a: Tensor, b: Tensor) -> Tensor:
        return lin(x) + torch.matmul(torch.matmul(x, a.transpose(0, 1)), b.transpose(0, 1))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, past: Tensor, keep: Tensor, *lora: Tensor
    ) -> tuple[Tensor, Tensor]:
        per_slot = 2 * self.n_layers
        a = {n: lora[k * per_slot : (k + 1) * per_slot : 2] for k, (n, _) in enumerate(LORA_SLOTS)}
        b = {n: lora[k * per_slot + 1 : (k + 1) * per_slot : 2] for k, (n, _) in enumerate(LORA_SLOTS)}
        bsz, seq = input_ids.shape
        h = self.embed(input_ids)
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, S, D]
        total = attention_mask.shape[1]
        q_idx = torch.arange(seq, device=input_ids.device) + (total - seq)
        k_idx = torch.arange(total, device=input_ids.device)
        allowed = (k_idx[None, :] <= q_idx[:, None])[None, None] & (attention_mask[:, None, None, :] > 0)
        bias = torch.zeros(allowed.shape, dtype=h.dtype).masked_fill(~allowed, torch.finfo(h.dtype).min)
        rep = self.n_heads // self.n_kv
        scale = 1.0 / math.sqrt(self.head_dim)
        presents = []
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            x = _rms(h, layer.input_layernorm.weight, self.eps)
            q = self._proj(x, att.q_proj, a["q_proj"][i], b["q_proj"][i]).view(bsz, seq, -1, self.head_dim)
            k = self._proj(x, att.k_proj, a["k_proj"][i], b["k_proj"][i]).view(bsz, seq, -1, self.head_dim)
            v = self._proj(x, att.v_proj, a["v_proj"][i], b["v_proj"][i]).view(bsz, seq, -1, self.head_dim)
            if self.qk_norm:
                q = _rms(q, att.q_norm.weight, self.eps)
                k = _rms(k, att.k_norm.weight, self.eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate(q) * sin
            k = k * cos + _rotate(k) * sin
            k = torch.cat((past[i, 0], k), dim=2)
            v = torch.cat((past[i, 1], v), dim=2)
            presents.append(torch.stack((k, v)))
            kr = k[:, :, None].expand(bsz, self.n_kv, rep, total, self.head_dim).reshape(bsz, -1, total, self.head_dim)
            vr = v[:, :, None].expand(bsz, self.n_kv, rep, total, self.head_dim).reshape(bsz, -1, total, self.head_dim)
            scores = torch.matmul(q, kr.transpose(2, 3)) * scale + bias
            o = torch.matmul(torch.softmax(scores, dim=-1), vr).transpose(1, 2).reshape(bsz, seq, -1)
            h = h + self._proj(o, att.o_proj, a["o_proj"][i], b["o_proj"][i])
            mlp = layer.mlp
            x = _rms(h, layer.post_attention_layernorm.weight, self.eps)
            gate = self._proj(x, mlp.gate_proj, a["gate_proj"][i], b["gate_proj"][i])
            up = self._proj(x, mlp.up_proj, a["up_proj"][i], b["up_proj"][i])
            h = h + self._proj(nn.functional.silu(gate) * up, mlp.down_proj, a["down_proj"][i], b["down_proj"][i])
        logits = self.lm_head(_rms(h.index_select(1, keep), self.norm.weight, self.eps))
        return logits, torch.stack(presents)

    def example_inputs(self, bsz: int = 1, seq: int = 3, past_len: int = 2, rank: int = 2) -> tuple[Any, ...]:
        """Inputs of the right shapes (for tracing and tests)."""
        ids = torch.zeros((bsz, seq), dtype=torch.int64)
        mask = torch.ones((bsz, past_len + seq), dtype=torch.int64)
        pos = torch.arange(past_len, past_len + seq)[None].expand(bsz, seq).contiguous()
        past = torch.zeros((self.n_layers, 2, bsz, self.n_kv, past_len, self.head_dim))
        lora: list[Tensor] = []
        for fin, fout in self.lora_shapes().values():
            for _ in range(self.n_layers):
                lora += [torch.zeros((rank, fin)), torch.zeros((fout, rank))]
        return (ids, mask, pos, past, torch.arange(seq), *lora)


def input_names(layers: int) -> list[str]:
    names = ["input_ids", "attention_mask", "position_ids", "past", "keep"]
    for name, _ in LORA_SLOTS:
        for i in range(layers):
            names += [f"lora_A_{name}_{i}", f"lora_B_{name}_{i}"]
    return names


def export_onnx(graph: DecoderGraph, path: str) -> None:
    """Trace `graph` into an ONNX file at `path` (dynamic batch, sequence, past length and LoRA rank)."""
    dyn: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "seq"},
        "past": {2: "batch", 4: "past_len"},
        "keep": {0: "kept"},
        "logits": {0: "batch", 1: "kept"},
        "present": {2: "batch", 4: "total"},
    }
    for name, _ in LORA_SLOTS:
        for i in range(graph.n_layers):
            dyn[f"lora_A_{name}_{i}"] = {0: "rank"}
            dyn[f"lora_B_{name}_{i}"] = {1: "rank"}
    with torch.no_grad():
        torch.onnx.export(
            graph, graph.example_inputs(), path, input_names=input_names(graph.n_layers),
            output_names=["logits", "present"], dynamic_axes=dyn, opset_version=17, dynamo=False,
        )  # fmt: skip
