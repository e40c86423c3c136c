"""ONNX engine (int8/int4 weights, LoRA at run time): μ is exact, the swap is off the generation path, and the
importance ratio against the trainer's fp32 recomputation is what the loss sees."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

pytest.importorskip("onnxruntime", reason="the ONNX engine needs the onnx extra: pip install 'metaclaw[onnx]'")
pytest.importorskip("onnx", reason="the ONNX engine needs the onnx extra: pip install 'metaclaw[onnx]'")

from metaclaw.distribution import Dist  # noqa: E402
from metaclaw.modules.policy import LoraPolicy  # noqa: E402
from metaclaw.serving.engines import Engine, SamplingParams, UnknownAdapterError  # noqa: E402
from metaclaw.serving.engines.onnx import OnnxEngine  # noqa: E402
from metaclaw.wire.client import Endpoint, teacher_logprobs  # noqa: E402

from .conftest import FIXED_ANSWER, chat_ids, conversation_ids  # noqa: E402
from .test_hf_engine import recompute  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("onnx-cache")
    monkeypatch_module.setenv("METACLAW_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def engine(tiny_spec, cache):
    return OnnxEngine.from_backend(tiny_spec, max_batch_size=4, quantize="int8")


@pytest.fixture(scope="module")
def policy(tiny_spec, fixed_adapter):
    pol = LoraPolicy(tiny_spec.load_model(), rank=8, alpha=16)
    pol.load_adapter(fixed_adapter)
    return pol.eval()


@pytest.mark.parametrize("settings", [(0.7, 0.9, 20), (1.0, 1.0, -1), (1.3, 0.8, -1), (0.5, 1.0, 5)])
def test_the_sampler_draws_from_the_distribution_its_logprobs_report(settings):
    """μ by construction: `sample_tokens`'s draws follow exp(the logprob it reports) (20000 draws from fixed logits),
    and what it reports is `token_logprobs` of the drawn token under the request's distribution, which the trainer
    recomputes. Whatever the quantised kernels compute, the engine samples from those logits with this function."""
    from metaclaw.distribution.logprobs import sample_tokens, token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    draws = 20000
    tokens, lps = sample_tokens(logits.expand(draws, -1), *settings, generator=torch.Generator().manual_seed(1))
    assert torch.equal(lps, token_logprobs(logits.expand(draws, -1), tokens, *settings))
    counts = torch.bincount(tokens, minlength=40).float() / draws
    reported = torch.zeros(40).index_put_((tokens,), lps.exp())
    assert (counts - reported).abs().max().item() < 0.015  # ~4 standard errors at p = 0.5
    assert torch.isclose(reported[counts > 0].sum(), torch.tensor(1.0), atol=1e-5)  # the drawn support is all of it
    greedy, glp = sample_tokens(logits, 0.0)
    assert greedy.item() == logits.argmax().item() and glp.item() == token_logprobs(logits, greedy).item()


def test_engine_satisfies_protocol_and_caches_its_build(engine, cache):
    assert isinstance(engine, Engine)
    built = [d for d in (cache / "onnx").iterdir() if not d.name.startswith(".")]
    assert len(built) == 1 and (built[0] / "model.onnx").is_file()
    ops = {n.op_type for n in __import__("onnx").load(str(built[0] / "model.onnx")).graph.node}
    assert "MatMulNBits" in ops  # the weights are quantised, not fp32


@pytest.mark.parametrize("dist", [dict(temperature=0.7, top_p=0.9, top_k=20), dict(temperature=1.0),
                                  dict(temperature=0.0)])  # fmt: skip
def test_reported_logprobs_are_the_sampled_distribution(engine, fixed_adapter, dist):
    """μ correctness: each reported logprob is the sampled token's under the distribution it was drawn from. Rescoring
    the sampled tokens teacher-forced through the same quantised model, same temperature/top-p/top-k, gives them back
    (tight: only float summation order differs), for every row of a batched request and for a seeded n=2."""
    engine.load_adapter("fixed", str(fixed_adapter))
    prompts = [chat_ids(engine.tokenizer, p) for p in ("Tell me something", "hi", "What is the capital of France?")]
    params = SamplingParams(max_tokens=20, **dist)
    outs = _concurrently([lambda p=p: engine.generate(p, params, "fixed")[0] for p in prompts])
    outs += [(prompts[0], o) for o in engine.generate(prompts[0], SamplingParams(max_tokens=20, n=2, seed=3, **dist))]
    for i, out in enumerate(outs):
        prompt, out = (prompts[i], out) if i < len(prompts) else out
        adapter = "fixed" if i < len(prompts) else None
        scores = engine.score_tokens(prompt, out.token_ids, adapter, **dist)
        rescored = torch.tensor([s.logprob for s in scores])
        assert len(out.token_ids) > 0 and torch.isfinite(rescored).all()
        gap = (torch.tensor(out.logprobs) - rescored).abs()
        if Dist.of(**dist).truncated:  # a 1e-7 float difference can move a token across the top-p boundary of the
            assert gap.max().item() <= 1e-3  # rescore, which renormalises without it: rare, and bounded by its mass
            assert (gap <= 1e-5).float().mean().item() >= 0.9
        else:
            assert gap.max().item() <= 1e-5
    assert max(engine.batches) > 1  # the concurrent requests were sampled together


def test_top_logprobs_are_the_sampled_distributions_own(engine):
    """`top_logprobs`: at each sampled position the k most likely tokens of the distribution the token was drawn
    from, most likely first; the sampled token's reported logprob is its value there when it is among them."""
    prompt = chat_ids(engine.tokenizer, "What is the capital of France?")
    (out,) = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.7, top_logprobs=3, seed=2))
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        values = [v for _, v in top]
        assert len(top) == 3 and values == sorted(values, reverse=True) and lp <= values[0] + 1e-6
        assert all(abs(v - lp) < 1e-5 for t, v in top if t == tok)
    (plain,) = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.7))
    assert plain.top_logprobs is None  # not asked: not computed


def _concurrently(calls: list) -> list:
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_ratio_against_the_trainers_fp32_is_counted_not_assumed(engine, policy, fixed_adapter):
    """The trainer recomputes the behaviour's tokens in fp32; the gap to the engine's int8 μ is small but not zero
    (it is what `loss/ratio_*` counts), and the fixed adapter still answers its string through int8 weights."""
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "hi")
    out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.7, seed=1), "fixed")[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        theirs = policy.logprobs(ids[:, :-1], ids[:, 1:], torch.ones_like(ids[:, :-1]), temperature=0.7)
    log_ratio = theirs[0, len(prompt) - 1 :] - torch.tensor(out.logprobs)
    assert 0 < log_ratio.abs().max().item() < 0.1
    greedy = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0), "fixed")[0]
    assert engine.tokenizer.decode(greedy.token_ids).startswith(FIXED_ANSWER)


def test_stream_equals_generate(engine, fixed_adapter):
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "hi")
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=4)
    stream = engine.stream(prompt, params, "fixed")
    deltas = list(stream)
    out = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.8, seed=4), "fixed")[0]
    assert [d.token_id for d in deltas][: len(out.token_ids)] == out.token_ids
    assert stream.output is not None and stream.output.token_ids == out.token_ids
    # the second request reads the first's prompt from the prefix cache: only float summation order differs
    assert stream.output.logprobs == pytest.approx(out.logprobs, abs=1e-5)


def test_swap_while_generating_switches_to_the_new_adapter_and_fails_nothing(tiny_spec, cache, fixed_adapter,
                                                                             tmp_path):  # fmt: skip
    """Adapter A serves; B is loaded by another thread while generations keep running (and while one holds the
    graph): no request fails, each reports the version it started with, and the answers change to B's."""
    engine = OnnxEngine.from_backend(tiny_spec, max_batch_size=2, quantize="int8")
    second = tmp_path / "step-000009"  # B: A's LoRA with the opposite sign of its B factors
    shutil.copytree(fixed_adapter, second)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(second / "adapter_model.safetensors"))
    save_file({k: -v if "lora_B" in k else v for k, v in weights.items()}, str(second / "adapter_model.safetensors"))
    prompt = chat_ids(engine.tokenizer, "hi")
    greedy = SamplingParams(max_tokens=12, temperature=0)
    assert engine.load_adapter("policy", str(fixed_adapter)) == 7
    a = engine.generate(prompt, greedy, "policy")[0]
    assert engine.tokenizer.decode(a.token_ids).startswith(FIXED_ANSWER)
    results, errors, stop = [], [], threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                results.append(engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0), "policy")[0])
            except Exception as exc:  # noqa: BLE001 - the test counts them
                errors.append(exc)

    clients = [threading.Thread(target=client) for _ in range(2)]
    for t in clients:
        t.start()
    stream = engine.stream(prompt, greedy, "policy")  # pins A
    with engine._lock:  # a generation holds the graph: the load must not need it
        loader = threading.Thread(target=engine.load_adapter, args=("policy", str(second)))
        loader.start()
        loader.join(30)
        assert not loader.is_alive() and engine.adapters() == {"policy": 9}
    deadline = time.monotonic() + 60
    while not any(r.adapter_version == 9 for r in results) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in clients:
        t.join(60)
    assert not errors
    assert [d.token_id for d in stream] and stream.adapter_version == 7 and stream.output.token_ids == a.token_ids
    by_version = {r.adapter_version: r.token_ids for r in results}
    assert set(by_version) <= {7, 9} and 9 in by_version
    assert by_version.get(7, a.token_ids) == a.token_ids
    b = engine.generate(prompt, greedy, "policy")[0]
    assert b.adapter_version == 9 and b.token_ids == by_version[9] and b.token_ids != a.token_ids
    assert len(engine._factors) == 1  # A freed by its last user
    engine.unload_adapter("policy")
    with pytest.raises(UnknownAdapterError):
        engine.generate(prompt, greedy, "policy")


def test_adapters_it_cannot_apply_are_refused(engine, fixed_adapter, tmp_path):
    import json

    from metaclaw.serving.engines import AdapterError

    dora = tmp_path / "dora"
    shutil.copytree(fixed_adapter, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="plain LoRA"):
        engine.load_adapter("dora", str(dora))
    with pytest.raises(AdapterError):
        engine.load_adapter("missing", str(tmp_path / "nowhere"))
    assert "dora" not in engine.adapters()


def test_backend_auto_on_a_cpu_host_builds_the_cpu_engine_it_names(tmp_path, tiny_spec, cache, monkeypatch):
    """backend=auto on a CPU host serves with `backend.cpu_engine`; `onnx` falls back to HF, loudly, when
    onnxruntime is missing; backend=onnx refuses an inference GPU."""
    from omegaconf import OmegaConf

    from metaclaw import devices
    from metaclaw.serving.engines import EngineFactory
    from tests.test_configs import _compose

    cfg = _compose("train", ["model=tiny", "backend.cpu_engine=onnx"], tmp_path)
    plan = devices.resolve_devices(cfg, gpu_count=0, vllm_available=False)
    assert plan.backend == "onnx" and "ONNX Runtime" in plan.describe()
    assert cfg.backend._target_ == "metaclaw.serving.engines.onnx.OnnxEngine.from_backend"
    backend = OmegaConf.to_container(cfg.backend, resolve=True)
    engine = EngineFactory(model=tiny_spec, backend=backend, infer_devices=[])()
    assert isinstance(engine, OnnxEngine) and engine.max_batch_size == backend["max_batch_size"]
    monkeypatch.setattr(devices, "onnx_installed", lambda: False)
    fallback = devices.plan_devices({"train": [], "infer": []}, {"name": "auto", "cpu_engine": "onnx"}, 0, False)
    assert fallback.backend == "hf" and any("onnxruntime is not installed" in w for w in fallback.warnings)
    with pytest.raises(devices.DevicePlanError, match="backend=onnx needs onnxruntime"):
        devices.plan_devices({"train": [], "infer": []}, {"name": "onnx"}, 0, False)
    monkeypatch.undo()
    with pytest.raises(devices.DevicePlanError, match="backend=onnx serves on the CPU"):
        devices.plan_devices({"train": [], "infer": [0]}, {"name": "onnx"}, 1, False)


def test_the_policy_server_serves_with_backend_onnx(tmp_path, adapter_root, fixed_adapter, tiny_spec):
    """`serve.py backend=onnx` end to end over HTTP: hot-load, a chat answer with logprobs, a stream."""
    import httpx

    from .conftest import running_server

    with running_server(tmp_path, adapter_root, "backend=onnx") as live:
        h = live.headers()
        load = {"lora_name": "policy", "lora_path": str(fixed_adapter)}
        r = httpx.post(f"{live.url}/v1/load_lora_adapter", json=load, headers=h, timeout=60)
        assert r.status_code == 200 and r.json()["adapter_version"] == 7
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                "temperature": 0, "logprobs": True}  # fmt: skip
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=h, timeout=60)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["message"]["content"].startswith(FIXED_ANSWER)
        assert all(t["logprob"] <= 0 for t in choice["logprobs"]["content"])
        r = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "stream": True}, headers=h, timeout=60)
        assert r.status_code == 200 and "[DONE]" in r.text
        assert "ONNX engine: tiny loaded" in live.log.read_text()
        # μ through the teacher's route: a sampled reply scored by the real client gives back its behaviour
        # logprobs under its own distribution. (On the tiny model the whole-prompt stepping rounded alike, so this
        # passes without prompt_logprobs_from too; test_the_teachers_route_reads_the_context_in_one_step guards that.)
        sampled = {**body, "temperature": 0.8, "top_p": 0.9, "seed": 3, "return_token_ids": True}
        choice = httpx.post(f"{live.url}/v1/chat/completions", json=sampled, headers=h, timeout=60).json()["choices"][0]
        reply, mu = choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]
        prompt = chat_ids(tiny_spec.load_tokenizer(), "hi")
        got = teacher_logprobs(Endpoint(live.url, live.api_key), "policy", prompt, reply, 60, 0.8, 0.9)
        assert len(reply) == len(mu) and max(abs(a - b) for a, b in zip(got, mu, strict=True)) <= 1e-5


def test_the_graph_with_its_cache_and_grouped_lora_is_the_peft_model(tiny_spec, policy, fixed_adapter):
    """The exported forward in torch (before ONNX and quantisation): a prefill, then one token a step through the
    per-layer cache, with the adapter as grouped factors (q/k/v and gate/up as one MatMul each, their LoRA B on a
    block diagonal) gives PEFT's logits at every position; the graph without LoRA inputs gives the base model's, and
    equals the LoRA graph fed zero factors."""
    from metaclaw.serving.engines.onnx import adapter_factors
    from metaclaw.serving.engines.onnx_graph import DecoderGraph, rotation

    model = tiny_spec.load_model().float().eval()
    with_lora, base = DecoderGraph(model, lora=True).eval(), DecoderGraph(model, lora=False).eval()
    factors = adapter_factors(str(fixed_adapter), with_lora.n_layers, with_lora.lora_shapes())
    layers = with_lora.n_layers
    lora = [torch.from_numpy(factors[f"lora_{p}_{g}_{i}"]) for i in range(layers) for g in ("qkv", "o", "gu", "down")
            for p in "AB"]  # fmt: skip
    zeros = [torch.zeros_like(t) for t in lora]
    ids = torch.tensor([chat_ids(tiny_spec.load_tokenizer(), "What is the capital of France?")])
    n, prefill = ids.shape[1], ids.shape[1] - 4
    with torch.no_grad():
        want = policy(ids, torch.ones_like(ids))[0]
        with policy.reference():
            want_base = policy(ids, torch.ones_like(ids))[0]

        def decode(graph: DecoderGraph, extra: list[torch.Tensor]) -> torch.Tensor:
            past = [torch.zeros((1, graph.n_kv, 0, graph.head_dim))] * (2 * layers)
            rows, start = [], 0
            for end in [prefill, *range(prefill + 1, n + 1)]:
                out = graph(ids[:, start:end], torch.ones((1, end), dtype=torch.int64),
                            torch.arange(start, end)[None], torch.arange(end - start), *past, *extra)  # fmt: skip
                rows.append(out[0][0])
                past, start = list(out[1:]), end
            return torch.cat(rows)

        got, got_base, got_zero = decode(with_lora, lora), decode(base, []), decode(with_lora, zeros)
    assert (got - want).abs().max().item() < 1e-4
    assert (got_base - want_base).abs().max().item() < 1e-4
    assert (want - want_base).abs().max().item() > 0.1  # the adapter matters: the first check could not pass without it
    assert (got_zero - got_base).abs().max().item() < 1e-5
    x = torch.randn(2, 3, 8)
    assert torch.equal(x @ rotation(8), torch.cat((-x[..., 4:], x[..., :4]), dim=-1))  # RoPE's rotate-half, exactly


def test_no_adapter_runs_the_graph_without_lora_and_equals_a_zero_adapter(engine, cache, fixed_adapter, tmp_path):
    """The base model is served by its own graph (no LoRA inputs or nodes): it gives the logprobs the LoRA graph gives
    with an all-zero adapter, greedy replies included; both graphs have one quantised MatMul per projection group."""
    import onnx
    from safetensors.torch import load_file, save_file

    built = next(d for d in (cache / "onnx").iterdir() if not d.name.startswith("."))
    graphs = {f: onnx.load(str(built / f)) for f in ("model.onnx", "base.onnx")}
    layers = engine.shape.layers
    for g in graphs.values():
        assert sum(n.op_type == "MatMulNBits" for n in g.graph.node) == 4 * layers + 1  # qkv, o, gate-up, down, head
    assert not [i.name for i in graphs["base.onnx"].graph.input if i.name.startswith("lora_")]
    assert len(graphs["base.onnx"].graph.node) < len(graphs["model.onnx"].graph.node)
    zero = tmp_path / "zero"
    shutil.copytree(fixed_adapter, zero)
    weights = load_file(str(zero / "adapter_model.safetensors"))
    save_file({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in weights.items()},
              str(zero / "adapter_model.safetensors"))  # fmt: skip
    engine.load_adapter("zero", str(zero))
    assert engine._inputs(None).graph is not engine._graphs[True]
    prompt = chat_ids(engine.tokenizer, "What is the capital of France?")
    greedy = SamplingParams(max_tokens=16, temperature=0)
    threads = torch.get_num_threads()
    base, zeroed = engine.generate(prompt, greedy)[0], engine.generate(prompt, greedy, "zero")[0]
    assert base.token_ids == zeroed.token_ids and len(base.token_ids) > 1
    assert (torch.tensor(base.logprobs) - torch.tensor(zeroed.logprobs)).abs().max().item() <= 1e-5
    sampled = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=5))[0]
    a = [s.logprob for s in engine.score_tokens(prompt, sampled.token_ids)]
    b = [s.logprob for s in engine.score_tokens(prompt, sampled.token_ids, "zero")]
    assert (torch.tensor(a) - torch.tensor(b)).abs().max().item() <= 1e-5
    assert (torch.tensor(a) - torch.tensor(sampled.logprobs)).abs().max().item() <= 1e-5
    assert torch.get_num_threads() == threads  # the sampler's one thread is the engine's, for its generations only
    engine.unload_adapter("zero")


def test_the_cache_through_the_io_binding_equals_one_forward(tiny_spec, fixed_adapter, tmp_path, monkeypatch):
    """The ONNX graph (fp32 weights, so a one-row and a many-row step compute the same numbers): a reply sampled one
    token a step, the per-layer cache carried between steps as ONNX Runtime values, reports the logprobs one forward
    over the prompt and the reply gives; and the sessions' threads sleep rather than spin."""
    import numpy as np

    from metaclaw.distribution.logprobs import token_logprobs

    monkeypatch.setenv("METACLAW_CACHE", str(tmp_path))
    fp32 = OnnxEngine.from_backend(tiny_spec, quantize="fp32")
    fp32.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(fp32.tokenizer, "Tell me something")
    out = fp32.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=2), "fixed")[0]
    ids = np.array([prompt + out.token_ids], np.int64)
    n = ids.shape[1]
    with fp32._pinned_slot("fixed") as slot:
        logits, _ = fp32._inputs(slot).run(ids, np.ones_like(ids), np.arange(n)[None], np.arange(n),
                                           fp32._empty_past(1))  # fmt: skip
    rows = torch.from_numpy(logits[0, len(prompt) - 1 : n - 1])
    once = token_logprobs(rows, torch.tensor(out.token_ids), 1.0)
    assert len(out.token_ids) > 1
    assert (once - torch.tensor(out.logprobs)).abs().max().item() < 1e-4
    options = fp32._graphs[True].session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_the_teachers_route_reads_the_context_in_one_step(engine, fixed_adapter, monkeypatch):
    """`/v1/completions` with `prompt_logprobs_from` (what `teacher_logprobs` sends): the context is one graph step,
    then one step per scored token, as a generation after that prompt; without it every token after the first
    is a step of its own (an agent's 7k-token prompt: 7k steps for one score)."""
    from metaclaw.serving.engines import onnx as onnx_engine
    from metaclaw.serving.service import PolicyService

    prompt = chat_ids(engine.tokenizer, "What is the capital of France?")
    target = engine.tokenizer(FIXED_ANSWER)["input_ids"]
    service = PolicyService(engine, adapter_root=fixed_adapter.parent)
    steps = []
    run = onnx_engine._Graph.run
    monkeypatch.setattr(onnx_engine._Graph, "run", lambda self, *a: steps.append(1) or run(self, *a))
    body = {"model": "tiny", "prompt": prompt + target, "max_tokens": 0, "echo": True, "prompt_logprobs": 0}

    def score(extra: dict) -> list:
        steps.clear()
        (event,) = list(service.completions({**body, **extra}))
        assert event["status"] == 200, event
        return event["body"]["choices"][0]["prompt_logprobs"]

    split = score({"prompt_logprobs_from": len(prompt)})
    assert len(steps) == len(target)  # the prompt, then each target token but the last (its logits are not needed)
    assert split[: len(prompt)] == [None] * len(prompt) and all(split[len(prompt) :])
    whole = score({})
    assert len(steps) == len(prompt + target) - 1
    want = engine.score_tokens(prompt, target)
    got = [e[str(t)]["logprob"] for e, t in zip(split[len(prompt) :], target, strict=True)]
    assert got == pytest.approx([s.logprob for s in want], abs=1e-6) and len(whole) == len(split)


@pytest.mark.parametrize("quantize", ["fp32", "int8"])
def test_prefix_reuse_reads_only_the_new_tokens_and_keeps_the_logprobs(tiny_spec, fixed_adapter, policy, quantize,
                                                                       tmp_path, monkeypatch):  # fmt: skip
    """Issue 46: each turn of four conversations (base and adapter, batched together) reads only what follows its
    previous turn, which the prefix cache holds, and its behaviour logprobs are the cold ones: with fp32 weights
    (a one-row and a many-row step compute the same numbers) the engine's own full-prompt rescoring gives them back
    within 1e-4; with int8 weights the gap to the trainer's fp32 recomputation stays the cold one's size (< 0.1). A
    new adapter version frees its predecessor's entries; a stream continues from its own cached turn."""
    monkeypatch.setenv("METACLAW_CACHE", str(tmp_path))
    engine = OnnxEngine.from_backend(tiny_spec, max_batch_size=4, quantize=quantize, prefix_cache_mb=64)
    engine.load_adapter("fixed", str(fixed_adapter))
    tok = engine.tokenizer
    history: dict[tuple[str | None, int], list[tuple[str, list[int]]]] = {}
    for question in ["Tell me about cats.", "And dogs?", "Which is older?"]:
        jobs, texts = [], []
        for adapter in (None, "fixed"):
            for conv in range(2):
                texts.append(f"{question} ({conv})" + " Tell me more, please." * conv)  # rows of different lengths
                prompt = conversation_ids(tok, history.get((adapter, conv), []), texts[-1])
                jobs.append((prompt, SamplingParams(max_tokens=10 + 3 * conv, temperature=0.8), adapter))
        outs = _concurrently([lambda j=j: engine.generate(j[0], j[1], j[2])[0] for j in jobs])
        for i, ((prompt, _, adapter), out) in enumerate(zip(jobs, outs, strict=True)):
            got = torch.tensor(out.logprobs)
            if quantize == "fp32":
                cold = torch.tensor([s.logprob for s in engine.score_tokens(prompt, out.token_ids, adapter, 0.8)])
                assert (got - cold).abs().max().item() <= 1e-4
            else:
                theirs = recompute(policy, prompt, out.token_ids, 0.8, reference=adapter is None)
                assert (theirs - got).abs().max().item() < 0.1
            history.setdefault((adapter, i % 2), []).append((texts[i], out.token_ids))
    stats = engine.prefix.stats
    # turns 2 and 3 of four conversations find their previous turn; the first turns share the template's header
    assert stats["hits"] >= 8 and stats["reused_tokens"] > stats["prompt_tokens"] / 3, stats
    assert max(engine.batches) > 1 and 0 < engine.prefix.bytes <= 64 * 2**20
    held = len(engine.prefix)
    engine.load_adapter("fixed", str(fixed_adapter))  # a new version: the old one's entries are freed with it
    assert 0 < len(engine.prefix) < held
    params = SamplingParams(max_tokens=6, temperature=0.8)
    stream = engine.stream(jobs[2][0], params, "fixed")
    first = [d.token_id for d in stream]
    hits = stats["hits"]
    again = engine.stream(jobs[2][0] + first, params, "fixed")
    tokens = [d.token_id for d in again]
    assert stats["hits"] == hits + 1 and again.output is not None and again.output.token_ids == tokens
    if quantize == "fp32":
        cold = engine.score_tokens(jobs[2][0] + first, tokens, "fixed", 0.8)
        assert torch.tensor(again.output.logprobs) == pytest.approx(torch.tensor([s.logprob for s in cold]), abs=1e-4)


def test_a_prompt_sampled_n_times_is_read_once(engine, monkeypatch):
    """`n` > 1 with the prefix cache: the rows share one prompt, which goes through the graph once (then one step per
    further token for the whole batch), and each row still reports its own draws."""
    from metaclaw.serving.engines import onnx as onnx_engine

    steps = []
    run = onnx_engine._Graph.run
    monkeypatch.setattr(onnx_engine._Graph, "run", lambda self, *a: steps.append(a[0].shape) or run(self, *a))
    prompt = chat_ids(engine.tokenizer, "Name three rivers in Europe, please.")
    outs = engine.generate(prompt, SamplingParams(max_tokens=1, n=3, temperature=1.0, seed=5))
    assert len(outs) == 3 and all(len(o.token_ids) == 1 and len(o.logprobs) == 1 for o in outs)
    assert len(steps) == 1 and steps[0][0] == 1  # one row read; max_tokens 1: no decode step
