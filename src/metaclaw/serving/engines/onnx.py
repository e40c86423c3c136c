"""ONNX Runtime engine: the base model's weights quantised to int8, the LoRA adapter applied at run time.

Why: on a CPU, decoding reads every weight once per token, so tokens/s is set by the bytes of the weights. int8
weights read a quarter of fp32's (`bench/perf/generation.py` measures it against the HF engine and the machine's limit).

How:
- The model is re-expressed as one graph (`metaclaw.serving.engines.onnx_graph.DecoderGraph`) with the KV cache (per
  layer) and the LoRA factors (grouped per layer) as inputs, exported once with the factors (`model.onnx`, every
  adapter) and once without (`base.onnx`, no adapter: no LoRA nodes), and its weights quantised by ONNX Runtime's
  `MatMulNBits` quantiser (`quantize: int8`, symmetric, blocks of 32 along the input; every MatMul with a constant
  weight, the output projection included; `fp32` skips it). Activations are quantised row by row and block by block
  (`accuracy_level` 4: integer dot products; the fp32-compute levels 0-1 decoded at 1.4-2 tokens/s on SmolLM2), so a
  position's logits do not depend on the other requests of a batch. (ONNX Runtime's dynamic int8 quantisation, one
  scale per activation tensor, moved SmolLM2's logprobs by up to 8 nats between a prefill and a decode step; int4
  weights in blocks of 32 were 2 nats from fp32 at worst.) The result is cached under `<METACLAW_CACHE>/onnx/` (one
  directory per model, graph and quantisation; the newest `CACHE_KEEP` are kept, older ones deleted); building it is
  logged with its time.
- Sampling is metaclaw's own (`metaclaw.distribution.logprobs.sample_tokens`): the engine draws each token from the
  request's distribution over the quantised model's logits and reports that token's logprob under the same
  distribution, so the behaviour logprobs are exactly μ, the distribution sampled from. The trainer recomputes
  them in fp32; the gap is the importance ratio the loss corrects for and logs (`loss/ratio_*`).
- Each step runs through an IO binding (`_Graph`): the cache a step returns stays an ONNX Runtime value and is the
  next step's input. ONNX Runtime's threads sleep rather than spin and torch samples on one thread
  (`session_options`, `SAMPLER_THREADS`: the engine shares its cores).
- An adapter is its LoRA factors as ONNX Runtime values (`lora_B` scaled by alpha / r), bound at every step. Loading
  one reads the safetensors into them in the caller's thread (the hot-load route's, never a generation's) without
  any lock the generations hold; publishing is the registry's pointer flip. A request keeps the version it pinned
  when it started, so a swap never fails or mixes versions, and the old version serves until the new one is ready.
- `score_tokens` runs the same quantised graph teacher-forced along a generation's path (the prompt in one step,
  then one step per target token: the integer kernels of a one-row step round differently from a many-row one, by
  up to 0.25 nats on SmolLM2), so rescoring a sampled reply gives back its behaviour logprobs (the μ test in
  tests/serving/test_onnx_engine.py). A score costs one decode step per target token.

Batching: non-streamed requests with the same adapter version and `sampling.batch_key` are sampled together (up to
`max_batch_size`, left-padded, padding masked), like the HF engine; streams and `n` > 1 / seeded requests alone.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any

import numpy as np
import torch

from metaclaw import profiling
from metaclaw.atomic import write_dir_atomically
from metaclaw.devices import torch_threads
from metaclaw.distribution import Dist
from metaclaw.distribution.logprobs import sample_tokens
from metaclaw.modules.loading import cache_root
from metaclaw.serving import sampling
from metaclaw.serving.engines.adapters import AdapterRegistry, LoadedAdapter, ServedAdapters
from metaclaw.serving.engines.base import (
    AdapterError,
    SamplingParams,
    SequenceOutput,
    TokenDelta,
    TokenScore,
    TokenStream,
    checked_params,
    scoring_ids,
)
from metaclaw.serving.engines.hf import VLLM_ONLY_OPTIONS, _outcome, _Pending, _settle, _token_scores, read_adapter
from metaclaw.serving.engines.onnx_graph import (
    GRAPH_VERSION,
    LORA_GROUPS,
    LORA_SLOTS,
    DecoderGraph,
    cache_names,
    export_onnx,
    input_names,
)
from metaclaw.serving.prefix_cache import LayerKV, check_mb, from_mb

log = logging.getLogger(__name__)

QUANTIZE = ("int8", "fp32")
#: torch threads while the engine samples or scores (set for the generation, under the graph's lock, then restored).
#: torch only draws tokens here, over one vocabulary row per request; with 2 threads on a loaded 2-core machine a
#: draw took 95-295 ms (a thread of the pair preempted), with 1 thread 3-10 ms (load 6.7, SmolLM2's 49,152 tokens).
SAMPLER_THREADS = 1
CACHE_KEEP = 4  # built models kept under <cache>/onnx (the newest by use; older ones are deleted)
#: HF-engine options `backend=auto` carries that this engine does not use
HF_ONLY_OPTIONS = frozenset({"merge_adapters", "batch_linger_s"})
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

Factors = dict[str, np.ndarray]
#: the graphs a build holds: file -> whether it takes LoRA factors (`base.onnx` serves when no adapter is)
GRAPHS = {"model.onnx": True, "base.onnx": False}


def _prune(root: Path, keep: int) -> None:
    """Keep the `keep` most recently used model directories under `root`; delete the rest."""
    dirs = sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")),
                  key=lambda d: d.stat().st_mtime, reverse=True)  # fmt: skip
    for old in dirs[keep:]:
        log.info("ONNX engine: deleting the cached model %s (more than %d cached)", old, keep)
        shutil.rmtree(old, ignore_errors=True)


def built_model(spec: Any, quantize: str = "int8") -> Path:
    """The exported (and quantised) model of `spec`: `<dir>/model.onnx`, built once and cached."""
    import onnxruntime

    if quantize not in QUANTIZE:
        raise ValueError(f"backend.quantize must be one of {QUANTIZE}, got {quantize!r}")
    source = spec.local_dir()
    stamp = f"{source}|{quantize}|{GRAPH_VERSION}|{onnxruntime.__version__}|{torch.__version__}"
    target = cache_root() / "onnx" / f"{spec.name}-{quantize}-{hashlib.sha1(stamp.encode()).hexdigest()[:10]}"
    if all((target / f).is_file() for f in GRAPHS):
        target.touch()
        return target

    def build(out: Path) -> None:
        started = time.perf_counter()
        log.warning("ONNX engine: exporting %s to ONNX (%s weights) into %s, once; this takes a minute on a "
                    "small CPU", spec.name, quantize, target)  # fmt: skip
        model = spec.load_model("cpu").float().eval()
        exported = quantised = 0.0
        for name, lora in GRAPHS.items():
            t0 = time.perf_counter()
            export_onnx(DecoderGraph(model, lora=lora), str(out / "fp32.onnx"))
            t1 = time.perf_counter()
            _quantise(out / "fp32.onnx", out / name, quantize)
            exported, quantised = exported + t1 - t0, quantised + time.perf_counter() - t1
        size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
        log.warning("ONNX engine: built %s in %.0f s (export %.0f s, quantise %.0f s): %.0f MiB", target.name,
                    time.perf_counter() - started, exported, quantised, size)  # fmt: skip

    write_dir_atomically(target, build, replace=False)
    _prune(target.parent, CACHE_KEEP)
    return target


def _quantise(source: Path, target: Path, quantize: str) -> None:
    """`source` (fp32 ONNX, deleted) → `target` with its MatMul weights quantised (`quantize` int8) or as is (fp32)."""
    if quantize == "fp32":
        source.rename(target)
        return
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # one line per node
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=8)
    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(str(target), use_external_data_format=False)
    source.unlink()


def adapter_factors(path: str, layers: int, shapes: dict[str, tuple[int, int]]) -> Factors:
    """The graph's LoRA inputs for the PEFT adapter in `path`: per layer `i` and group `g` (`LORA_GROUPS`),
    `lora_A_<g>_<i>` [in, r * modules] and `lora_B_<g>_<i>` [r * modules, out] (`group_factors`; B scaled by
    alpha / r, or alpha / sqrt(r) for rsLoRA); modules the adapter does not adapt get zeros.

    Raises:
        AdapterError: files missing or unreadable, or an adapter this engine cannot apply (DoRA, per-module ranks,
            adapted modules outside the attention and MLP projections, wrong shapes).
    """
    config, state = read_adapter(path)
    if getattr(config, "use_dora", False) or config.rank_pattern or config.alpha_pattern or config.modules_to_save:
        raise AdapterError(f"adapter {path!r}: the ONNX engine applies plain LoRA only (no DoRA, per-module ranks "
                           "or modules_to_save)")  # fmt: skip
    r = int(config.r)
    scale = float(config.lora_alpha) / (r**0.5 if config.use_rslora else r)
    out: Factors = {}
    for name, (fin, fout) in shapes.items():
        out[f"lora_A_{name}"] = np.zeros((layers, r, fin), np.float32)
        out[f"lora_B_{name}"] = np.zeros((layers, fout, r), np.float32)
    for key, tensor in state.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in shapes or int(m.group(1)) >= layers:
            raise AdapterError(f"adapter {path!r}: the ONNX engine cannot apply {key!r}")
        layer, name, part = int(m.group(1)), m.group(2), m.group(3)
        slot = out[f"lora_{part}_{name}"][layer]
        value = tensor.float().numpy() * (scale if part == "B" else 1.0)
        if value.shape != slot.shape:
            raise AdapterError(f"adapter {path!r}: {key} has shape {tuple(value.shape)}, the model needs {slot.shape}")
        slot[...] = value
    return group_factors(out)


def group_factors(stacked: Factors) -> Factors:
    """Per-module factors `lora_A_<m>` [L, r, in] and `lora_B_<m>` [L, out, r] (B scaled) → the graph's inputs per
    layer and group: `lora_A_<g>_<i>` = the group's A transposed side by side [in, r * n], `lora_B_<g>_<i>` = its B
    transposed on the block diagonal [r * n, out] (so `(x A) B` is each module's `B (A x)`, stacked along the output).
    """
    layers, r = next(iter(stacked.values())).shape[:2]
    out: Factors = {}
    for g, mods in LORA_GROUPS.items():
        a = np.concatenate([stacked[f"lora_A_{m}"] for m in mods], axis=1).transpose(0, 2, 1)  # [L, in, r * n]
        sizes = [stacked[f"lora_B_{m}"].shape[1] for m in mods]
        b = np.zeros((layers, r * len(mods), sum(sizes)), np.float32)
        for j, (m, start) in enumerate(zip(mods, np.cumsum([0, *sizes[:-1]]), strict=True)):
            b[:, j * r : (j + 1) * r, start : start + sizes[j]] = stacked[f"lora_B_{m}"].transpose(0, 2, 1)
        for i in range(layers):
            out[f"lora_A_{g}_{i}"] = np.ascontiguousarray(a[i])
            out[f"lora_B_{g}_{i}"] = b[i]
    return out


class _Graph:
    """One exported graph in an ONNX Runtime session, run through an IO binding: the KV cache a step returns stays
    in ONNX Runtime's values (no copy into numpy and back), and the LoRA factors are values made once per adapter."""

    def __init__(self, path: Path, options: Any, layers: int, lora: bool) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        missing = set(input_names(layers, lora)) - {i.name for i in self.session.get_inputs()}
        if missing:
            raise ValueError(f"{path} lacks the inputs {sorted(missing)}: rebuild it")
        self.past, self.outputs = cache_names(layers, "past"), ["logits", *cache_names(layers, "present")]

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, keep: np.ndarray, past: Sequence[Any],
            factors: dict[str, Any]) -> tuple[np.ndarray, list[Any]]:  # fmt: skip
        """Logits [B, K, V] and the present cache (ONNX Runtime values, the next step's `past`)."""
        binding = self.session.io_binding()
        for name, array in (("input_ids", ids), ("attention_mask", mask), ("position_ids", positions), ("keep", keep)):
            binding.bind_cpu_input(name, array)
        for name, value in zip(self.past, past, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name, value in factors.items():
            binding.bind_ortvalue_input(name, value)
        for name in self.outputs:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        return values[0].numpy(), values[1:]


@dataclass(frozen=True)
class _Feed:
    """What a request runs: the graph (with or without LoRA inputs), the adapter's factors as values, and the model's
    key in the prefix cache (the adapter version's internal name; None: the base model)."""

    graph: _Graph
    factors: dict[str, Any]
    key: str | None = None

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, keep: np.ndarray,
            past: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:  # fmt: skip
        return self.graph.run(ids, mask, positions, keep, past, self.factors)


def session_options(threads: int) -> Any:
    """ONNX Runtime's session options for decoding: `threads` compute threads (the physical cores), one graph run at
    a time, every graph optimisation, and threads that sleep rather than spin while they wait. The engine shares its
    cores with the trainer (and on a small machine with everything else): a spinning thread burns the time slice the
    thread it waits for needs. SmolLM2 int8 at batch 1, load 6 on 2 cores: 6.0 tokens/s spinning (1 thread: 9.7),
    19 without spinning, 23 without spinning and with `dynamic_block_base` 4 (smaller work blocks late in a parallel
    loop, so a preempted thread holds up less; docs/results/2026-11-28-quantised-engine.md, session 17)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.dynamic_block_base", "4")
    return options


def ort_values(factors: Factors) -> dict[str, Any]:
    """The factors as ONNX Runtime values (sharing the arrays' memory), made once per adapter."""
    import onnxruntime as ort

    return {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in factors.items()}


@dataclass(frozen=True)
class _Shape:
    layers: int
    kv_heads: int
    head_dim: int
    lora: dict[str, tuple[int, int]]


class OnnxEngine(ServedAdapters):
    """Serve an exported (quantised) causal LM with ONNX Runtime; see the module docstring.

    Args:
        model_dir: a directory holding `model.onnx` (`built_model`).
        shape: the model's layer count, KV heads, head size and LoRA slot shapes.
        tokenizer: its tokenizer.
        model_name: the id that selects the base model.
        eos_ids: end-of-sequence token ids (the tokenizer's and the generation config's).
        max_seq_len: longest prompt + completion accepted.
        max_batch_size: concurrent generate requests sampled together.
        threads: ONNX Runtime's compute threads (None: torch's thread count).
        prefix_cache_mb: keys and values of recent conversations kept for their next turn, per model version and
            tenant (`metaclaw.serving.prefix_cache`; 0: every prompt is read in full).
    """

    def __init__(
        self,
        model_dir: Path,
        shape: _Shape,
        tokenizer: Any,
        model_name: str,
        eos_ids: Sequence[int],
        max_seq_len: int = 2048,
        max_batch_size: int = 1,
        threads: int | None = None,
        prefix_cache_mb: float = 0.0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"backend.max_batch_size must be >= 1, got {max_batch_size}")
        threads = int(threads or torch.get_num_threads())
        started = time.perf_counter()
        options = session_options(threads)
        graphs = {lora: _Graph(Path(model_dir) / f, options, shape.layers, lora) for f, lora in GRAPHS.items()}
        log.info("ONNX engine: %s loaded from %s in %.1f s (%d threads)", model_name, model_dir,
                 time.perf_counter() - started, threads)  # fmt: skip
        self._graphs = graphs  # with LoRA inputs (an adapter's) and without (the base model's)
        self.shape = shape
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.eos_ids = sorted(set(eos_ids))
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0])
        self.batches: dict[int, int] = {}  # batch size -> sampling runs (for benches and tests)
        self._factors: dict[str, _Feed] = {}  # internal name -> its graph and LoRA inputs
        self._registry = AdapterRegistry()
        self._lock = threading.Lock()  # one run of the graph at a time (the CPU is the limit; no oversubscription)
        self._pending: list[_Pending] = []
        self._pending_lock = threading.Lock()
        self.prefix = from_mb(prefix_cache_mb)

    @classmethod
    def from_backend(
        cls, spec: Any, infer_devices: Sequence[int] = (), max_batch_size: int = 4, quantize: str = "int8",
        prefix_cache_mb: float = 1024, **other: Any,
    ) -> OnnxEngine:  # fmt: skip
        """The `backend` node's constructor (CPU only); its defaults are the product's (4 requests a batch, int8
        weights, a 1 GiB prefix cache). The HF and vLLM options `backend=auto` carries are not used here; any other
        option is a config error."""
        unknown = sorted(set(other) - VLLM_ONLY_OPTIONS - HF_ONLY_OPTIONS)
        if unknown:
            raise ValueError(f"backend: options the ONNX engine does not know: {unknown}")
        if infer_devices:
            raise ValueError("backend=onnx runs on the CPU; use backend=vllm or backend=hf for devices.infer GPUs")
        check_mb(prefix_cache_mb)  # checked before the model is built
        from transformers import AutoConfig, GenerationConfig

        model_dir = built_model(spec, str(quantize))
        source = spec.local_dir()
        cfg = AutoConfig.from_pretrained(source)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        lora = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
                "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                "down_proj": (inter, hidden)}  # fmt: skip
        assert set(lora) == {n for n, _ in LORA_SLOTS}
        tokenizer = spec.load_tokenizer()
        eos = [tokenizer.eos_token_id]
        try:
            gen = GenerationConfig.from_pretrained(source).eos_token_id
            eos += gen if isinstance(gen, list) else [gen]
        except OSError:  # no generation_config.json
            pass
        shape = _Shape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, lora)
        return cls(model_dir, shape, tokenizer, spec.name, [e for e in eos if e is not None], spec.max_seq_len,
                   int(max_batch_size), prefix_cache_mb=float(prefix_cache_mb))  # fmt: skip

    # ---------------------------------------------------------------- adapters

    def load_adapter(self, name: str, path: str, version: int | None = None) -> int:
        """Read the adapter's factors (no lock any generation holds), then re-point `name` to them atomically."""
        self._check_new_name(name)
        started = time.perf_counter()
        with profiling.phase("hot_load"):
            values = ort_values(adapter_factors(path, self.shape.layers, self.shape.lora))
            version = self._registry.next_version(name, path, version)
            internal = f"adapter-{uuid.uuid4().hex}"  # never reused (finds a version's factors and prefixes)
            self._factors[internal] = _Feed(self._graphs[True], values, internal)
            return self._publish(name, internal, version, path, started)

    def _free(self, slot: LoadedAdapter) -> None:
        if self.prefix is not None:
            self.prefix.forget(slot.internal)
        self._factors.pop(slot.internal, None)

    def _inputs(self, slot: LoadedAdapter | None) -> _Feed:
        """The adapter version's graph and factors; no adapter: the graph without LoRA nodes."""
        return _Feed(self._graphs[False], {}) if slot is None else self._factors[slot.internal]

    # ---------------------------------------------------------------- the graph

    def _empty_past(self, batch: int) -> list[Any]:
        import onnxruntime as ort

        s = self.shape
        empty = ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, s.kv_heads, 0, s.head_dim), np.float32))
        return [empty] * (2 * s.layers)

    def _sample(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        factors: _Feed,
        on_token: Callable[[int, float], None] | None = None,
        cancelled: threading.Event | None = None,
    ) -> list[SequenceOutput]:
        """Sample one continuation per prompt (left-padded together; all under `params[0]`'s distribution, each
        cut at its own `max_tokens`); `on_token` gets row 0's tokens as they come. Hold `self._lock`."""
        first = params[0]
        eos = sorted({*self.eos_ids, *first.stop_token_ids})
        generator = torch.Generator().manual_seed(first.seed) if first.seed is not None else None
        batch, width = len(prompts), max(len(p) for p in prompts)
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        widest = max(params, key=lambda p: p.top_logprobs)
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in prompts]  # filled when some request asks
        done = [False] * batch
        with profiling.phase(f"generate:{profiling.purpose()}") as ph, torch_threads(SAMPLER_THREADS):
            logits, past, mask = self._prefill(prompts, [p.cache_salt for p in params], factors)
            positions = mask.sum(-1, keepdims=True) - 1
            for _ in range(max(p.max_tokens for p in params)):
                settings = (first.temperature, first.top_p, first.top_k)
                picked, lps = sample_tokens(torch.from_numpy(logits), *settings, generator=generator)
                step_tops = sampling.top_rows(torch.from_numpy(logits[:, None]), widest)
                for b, (tok, lp) in enumerate(zip(picked.tolist(), lps.tolist(), strict=True)):
                    if done[b]:
                        continue
                    tokens[b].append(tok)
                    logprobs[b].append(lp)
                    if step_tops is not None:
                        tops[b].append(step_tops[b][0])
                    if b == 0 and on_token is not None:
                        on_token(tok, lp)
                    full = len(tokens[b]) >= params[b].max_tokens
                    done[b] = tok in eos or full or self._stopped(tokens[b], params[b])
                if all(done) or (cancelled is not None and cancelled.is_set()):
                    break
                ids = picked.numpy().astype(np.int64)[:, None]
                mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
                positions = positions + 1
                out, past = factors.run(ids, mask, positions, np.array([0], np.int64), past)
                logits = out[:, -1]
            ph["tokens"] = sum(len(t) for t in tokens)
        self.batches[batch] = self.batches.get(batch, 0) + 1
        rows = zip(tokens, logprobs, params, tops, strict=True)
        outputs = [sampling.finish(self.tokenizer, t, lp, eos, p, top if widest.top_logprobs else None)
                   for t, lp, p, top in rows]  # fmt: skip
        if self.prefix is not None:
            self._keep(prompts, [p.cache_salt for p in params], outputs, past, width, factors.key)
        return outputs

    def _prefill(self, prompts: Sequence[Sequence[int]], salts: Sequence[str | None], factors: _Feed,
                 ) -> tuple[np.ndarray, list[Any], np.ndarray]:  # fmt: skip
        """Read the prompts: the first token's logits [B, V], the cache, and the attention mask [B, width]
        (left-padded). Without a prefix cache, in one left-padded step; with one, each row alone on top of the
        longest prefix the cache holds for its model and tenant (only what follows it is read; a prompt repeated in
        the batch once), the rows' caches then left-padded into one."""
        batch, width = len(prompts), max(len(p) for p in prompts)
        mask = np.zeros((batch, width), np.int64)
        for b, p in enumerate(prompts):
            mask[b, width - len(p) :] = 1
        if self.prefix is None:
            ids = np.full((batch, width), self.pad_id, np.int64)
            for b, p in enumerate(prompts):
                ids[b, width - len(p) :] = p
            positions = np.clip(mask.cumsum(-1) - 1, 0, None)
            logits, past = factors.run(ids, mask, positions, np.array([width - 1], np.int64), self._empty_past(batch))
            return logits[:, -1], past, mask
        read: dict[tuple[tuple[int, ...], str | None], tuple[np.ndarray, list[Any]]] = {}
        for p, salt in zip(prompts, salts, strict=True):  # a prompt sampled n times is read once
            if (tuple(p), salt) not in read:
                read[tuple(p), salt] = self._read_row(list(p), salt, factors)
        rows = [read[tuple(p), salt] for p, salt in zip(prompts, salts, strict=True)]
        if batch == 1:
            return rows[0][0][None], rows[0][1], mask
        import onnxruntime as ort

        s, past = self.shape, []
        for n in range(2 * s.layers):
            padded = np.zeros((batch, s.kv_heads, width, s.head_dim), np.float32)
            for b, (_, kv) in enumerate(rows):
                part = kv[n].numpy()
                padded[b, :, width - part.shape[2] :] = part[0]
            past.append(ort.OrtValue.ortvalue_from_numpy(padded))
        return np.stack([logits for logits, _ in rows]), past, mask

    def _read_row(self, ids: list[int], salt: str | None, factors: _Feed) -> tuple[np.ndarray, list[Any]]:
        """One prompt read on top of its longest cached prefix (all of it but its last token at most): the first
        token's logits [V] and the cache of the whole prompt."""
        import onnxruntime as ort

        assert self.prefix is not None
        known, cached = self.prefix.lookup(factors.key, ids, len(ids) - 1, salt)
        past = self._empty_past(1)
        if cached is not None:
            past = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(t.numpy()[None]))
                    for layer in cached for t in layer]  # fmt: skip
        rest = np.array([ids[known:]], np.int64)
        logits, present = factors.run(rest, np.ones((1, len(ids)), np.int64), np.arange(known, len(ids))[None],
                                      np.array([rest.shape[1] - 1], np.int64), past)  # fmt: skip
        return logits[0, -1], present

    def _keep(self, prompts: Sequence[Sequence[int]], salts: Sequence[str | None], outputs: Sequence[SequenceOutput],
              past: Sequence[Any], width: int, key: str | None) -> None:  # fmt: skip
        """Store each row's prompt and reply but its last token (never read back) from the finished batch's cache
        (`width`: the prompts' padded width, where the replies start)."""
        assert self.prefix is not None
        arrays = [value.numpy() for value in past]  # [B, heads, width + steps - 1, head_dim] each
        for b, (ids, out) in enumerate(zip(prompts, outputs, strict=True)):
            start, end = width - len(ids), width + len(out.token_ids) - 1
            if end <= start or end > arrays[0].shape[2]:
                continue
            kv: list[LayerKV] = [(torch.from_numpy(arrays[n][b, :, start:end].copy()),
                                  torch.from_numpy(arrays[n + 1][b, :, start:end].copy()))
                                 for n in range(0, len(arrays), 2)]  # fmt: skip
            self.prefix.store(key, list(ids) + out.token_ids[:-1], kv, salts[b])

    def _stopped(self, row: list[int], params: SamplingParams) -> bool:
        """Whether a stop string ends the row's text so far (the final cut is `sampling.finish`'s)."""
        if not params.stop:
            return False
        tail = self.tokenizer.decode(row[-32:], skip_special_tokens=False)
        return any(s and s in tail for s in params.stop)

    # ---------------------------------------------------------------- sampling

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> list[SequenceOutput]:
        params = checked_params(prompt_ids, params, self.max_seq_len)
        key = sampling.batch_key(params)
        with self._pinned_slot(adapter) as slot:
            factors = self._inputs(slot)
            if self.max_batch_size > 1 and key is not None:
                outputs = self._batched(list(prompt_ids), params, (None if slot is None else slot.internal, key),
                                        factors)  # fmt: skip
            else:
                with self._lock:
                    outputs = self._sample([list(prompt_ids)] * params.n, [params] * params.n, factors)
        for out in outputs:
            out.adapter_version = None if slot is None else slot.version
        return outputs

    def _batched(
        self, prompt_ids: list[int], params: SamplingParams, key: tuple, factors: _Feed
    ) -> list[SequenceOutput]:
        """Queue the request; whoever gets the graph next samples it with the compatible ones waiting."""
        mine = _Pending(prompt_ids, params, key)
        with self._pending_lock:
            self._pending.append(mine)
        with self._lock:
            if not mine.done.is_set():  # nobody took it yet: lead a batch
                with self._pending_lock:
                    batch = [mine] + [p for p in self._pending if p is not mine and p.key == key]
                    batch = batch[: self.max_batch_size]
                    for p in batch:
                        self._pending.remove(p)

                def work() -> list[list[SequenceOutput]]:
                    outs = self._sample([p.prompt_ids for p in batch], [p.params for p in batch], factors)
                    return [[o] for o in outs]

                _settle(batch, work)
        return _outcome(mine)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None) -> TokenStream:
        params = checked_params(prompt_ids, params, self.max_seq_len)
        if params.n != 1:
            raise ValueError("streaming samples one sequence at a time (n=1)")
        return _OnnxTokenStream(self, list(prompt_ids), params, adapter)

    # ---------------------------------------------------------------- scoring

    def score_tokens(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        adapter: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[TokenScore]:
        """Teacher-forced along the path a generation takes: the prompt in one step, then each target token in a step
        of its own (the integer kernels of a one-row step round differently from a many-row one, so a one-shot
        forward would not give back the logprobs a reply was sampled with)."""
        ids = scoring_ids(prompt_ids, target_ids, self.max_seq_len)
        if not target_ids:
            return []
        n, width = len(ids), len(prompt_ids)
        rows = []
        with self._pinned_slot(adapter) as slot, self._lock, profiling.phase(f"score:{profiling.purpose()}") as ph:
            factors = self._inputs(slot)
            x = np.array([prompt_ids], np.int64)
            logits, past = factors.run(x, np.ones_like(x), np.arange(width, dtype=np.int64)[None],
                                       np.array([width - 1], np.int64), self._empty_past(1))  # fmt: skip
            rows.append(logits[0, -1])
            for t in range(width, n - 1):
                x = np.array([[ids[t]]], np.int64)
                logits, past = factors.run(x, np.ones((1, t + 1), np.int64), np.array([[t]], np.int64),
                                           np.array([0], np.int64), past)  # fmt: skip
                rows.append(logits[0, -1])
            ph["tokens"] = n
            with torch_threads(SAMPLER_THREADS):
                return _token_scores(torch.from_numpy(np.stack(rows)), target_ids, Dist.of(temperature, top_p, top_k))

    def close(self) -> None:
        """Nothing to stop: the engine owns no threads between requests."""


class _OnnxTokenStream(TokenStream):
    """Samples in a thread; iterating yields row 0's tokens as they are drawn."""

    def __init__(self, engine: OnnxEngine, prompt_ids: list[int], params: SamplingParams, adapter: str | None) -> None:
        self._pin = engine._pinned_slot(adapter)
        slot = self._pin.__enter__()  # raises UnknownAdapterError before any thread starts
        self.adapter_version = None if slot is None else slot.version
        self._queue: Queue[tuple[int, float] | None] = Queue()
        self._cancelled = threading.Event()
        self._error: BaseException | None = None
        self._done = False
        factors = engine._inputs(slot)

        def run() -> None:
            try:
                with engine._lock:
                    out = engine._sample([prompt_ids], [params], factors, lambda t, lp: self._queue.put((t, lp)),
                                         self._cancelled)[0]  # fmt: skip
                out.adapter_version = self.adapter_version
                self.output, self.finish_reason = out, out.finish_reason
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread
                self._error = exc
            finally:
                self._queue.put(None)
                self._pin.__exit__(None, None, None)

        self._thread = threading.Thread(target=run, name="onnx-stream", daemon=True)
        self._thread.start()

    def __next__(self) -> TokenDelta:
        if not self._done:
            item = self._queue.get()
            if item is not None:
                return TokenDelta(*item)
            self._done = True
            self._thread.join()
        if self._error is not None:
            raise self._error
        raise StopIteration

    def close(self) -> None:
        self._cancelled.set()
