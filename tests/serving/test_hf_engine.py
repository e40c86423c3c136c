"""HF engine: behaviour logprobs = training logprobs, streaming = generate, scoring, multi-LoRA hot swap."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from metaclaw import profiling
from metaclaw.modules.policy import LoraPolicy
from metaclaw.serving import sampling
from metaclaw.serving.engines import AdapterError, Engine, SamplingParams, UnknownAdapterError
from metaclaw.serving.engines.hf import HFEngine

from .conftest import FIXED_ANSWER, chat_ids, conversation_ids


@pytest.fixture
def fresh_engine(tiny_spec):
    return HFEngine.from_spec(tiny_spec)


@pytest.fixture(scope="module")
def policy(tiny_spec, fixed_adapter):
    pol = LoraPolicy(tiny_spec.load_model(), rank=8, alpha=16)
    pol.load_adapter(fixed_adapter)
    return pol.eval()


def recompute(policy, prompt, completion, temperature, reference=False, top_p=1.0, top_k=-1):
    ids = torch.tensor([prompt + completion])
    x, y = ids[:, :-1], ids[:, 1:]
    dist = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    with torch.no_grad():
        if reference:
            with policy.reference():
                lp = policy.logprobs(x, y, torch.ones_like(x), **dist)
        else:
            lp = policy.logprobs(x, y, torch.ones_like(x), **dist)
    return lp[0, len(prompt) - 1 :]


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, Engine)


def test_behaviour_logprobs_match_training_logprobs(engine, policy, fixed_adapter):
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "Tell me something")
    outs = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.7, n=2, seed=5), "fixed")
    for out in outs:
        assert out.adapter_version == 7
        mine = torch.tensor(out.logprobs)
        theirs = recompute(policy, prompt, out.token_ids, 0.7)
        assert (mine - theirs).abs().max().item() <= 1e-4
    base = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=5))[0]
    ref = recompute(policy, prompt, base.token_ids, 0.7, reference=True)
    assert (torch.tensor(base.logprobs) - ref).abs().max().item() <= 1e-4


def test_batched_requests_keep_their_own_logprobs(tiny_spec, policy, fixed_adapter):
    """Concurrent requests of different prompt lengths and max_tokens are sampled in one left-padded batch; each
    reply's behaviour logprobs are the training logprobs of its own unpadded sequence (ratio 1); a request with a
    different distribution runs on its own."""
    engine = HFEngine.from_spec(tiny_spec, max_batch_size=4)
    engine.load_adapter("fixed", str(fixed_adapter))
    dist = dict(temperature=0.7, top_p=0.9, top_k=20)
    jobs = [
        (chat_ids(engine.tokenizer, "hi"), SamplingParams(max_tokens=12, **dist), None),
        (chat_ids(engine.tokenizer, "Tell me a long story about a cat"), SamplingParams(max_tokens=20, **dist), None),
        (chat_ids(engine.tokenizer, "Name a colour."), SamplingParams(max_tokens=16, **dist), None),
        (chat_ids(engine.tokenizer, "Name a colour."), SamplingParams(max_tokens=8, temperature=0.0), None),  # alone
        (chat_ids(engine.tokenizer, "What is 2 + 2?"), SamplingParams(max_tokens=16, **dist), "fixed"),  # alone
    ]  # fmt: skip
    results = _concurrently(engine, engine.generate, engine._queue.pending, jobs)
    assert engine.batches == {3: 1, 1: 2}  # three compatible requests in one batch; the other two on their own
    for i, (prompt, params, adapter) in enumerate(jobs):
        (out,) = results[i]
        assert 1 <= len(out.token_ids) <= params.max_tokens
        assert out.finish_reason == ("stop" if out.token_ids[-1] == engine.tokenizer.eos_token_id else "length")
        d = params.distribution()
        theirs = recompute(policy, prompt, out.token_ids, d[0], adapter is None, top_p=d[1], top_k=d[2])
        assert (torch.tensor(out.logprobs) - theirs).abs().max().item() <= 1e-4
    assert len(results[1][0].token_ids) > 12 or results[1][0].finish_reason == "stop"  # rows keep their own budget


def _concurrently(engine: HFEngine, call, pending: list, jobs: list[tuple]) -> dict[int, list]:
    """`call(*job)` for every job from its own thread, all in `pending` (the engine's queue) before the first one
    gets the model."""
    results: dict[int, list] = {}
    with engine._lock:  # hold the model so that every request is pending when the first one gets it
        threads = [
            threading.Thread(target=lambda i=i, j=j: results.__setitem__(i, call(*j))) for i, j in enumerate(jobs)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(pending) < len(jobs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pending) == len(jobs)
    for t in threads:
        t.join(120)
    assert len(results) == len(jobs)
    return results


def _score_concurrently(engine: HFEngine, jobs: list[tuple]) -> dict[int, list]:
    """`engine.score_tokens(*job)` for every job from its own thread, all pending before the first one runs."""
    return _concurrently(engine, engine.score_tokens, engine._queue.scoring, jobs)


def _check_batched_scores(engine: HFEngine, policy) -> None:
    """Five concurrent score requests (prompts and targets of different lengths, three distributions, the base
    model and the adapter): the adapter's three in one left-padded forward, the base model's two in another;
    every row's logprobs are the trainer's of its own unpadded sequence within 1e-4 (ratio 1), ranks included."""
    tok = engine.tokenizer
    answer = tok(FIXED_ANSWER)["input_ids"]
    jobs = [
        (chat_ids(tok, "hi"), answer, "fixed", 1.0, 1.0, -1),
        (chat_ids(tok, "Tell me a long story about a cat and a dog"), answer[:3], "fixed", 0.7, 0.9, 20),
        (chat_ids(tok, "Name a colour."), tok("Blue, or maybe a deep green.")["input_ids"], "fixed", 0.6, 1.0, -1),
        (chat_ids(tok, "What is 2 + 2?"), tok("Four.")["input_ids"], None, 1.0, 1.0, -1),
        (chat_ids(tok, "Say something long and winding"), answer, None, 0.8, 1.0, 5),
    ]  # fmt: skip
    results = _score_concurrently(engine, jobs)
    assert engine.score_batches == {3: 1, 2: 1}
    for i, (prompt, target, adapter, temperature, top_p, top_k) in enumerate(jobs):
        theirs = recompute(policy, prompt, target, temperature, adapter is None, top_p=top_p, top_k=top_k)
        mine = torch.tensor([s.logprob for s in results[i]])
        assert (mine - theirs).abs().max().item() <= 1e-4
        alone = engine.score_tokens(prompt, target, adapter, temperature, top_p, top_k)  # one request, no padding
        assert [s.rank for s in results[i]] == [s.rank for s in alone]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(results[i], alone, strict=True)) <= 1e-4


def test_concurrent_score_requests_are_batched_with_their_own_logprobs(tiny_spec, policy, fixed_adapter):
    """Issue 24: the publish gate's score requests in flight share one forward per model (before, each took its
    own turn at the model lock behind the users' generations); one distribution still (ratio 1)."""
    engine = HFEngine.from_spec(tiny_spec, max_batch_size=4)
    engine.load_adapter("fixed", str(fixed_adapter))
    _check_batched_scores(engine, policy)


def test_merged_adapter_batched_scores_are_the_trainers(tiny_spec, policy, fixed_adapter):
    """The same on the merged-adapter path (`backend.merge_adapters`, the CPU default)."""
    engine = _merged_engine(tiny_spec, max_batch_size=4)
    engine.load_adapter("fixed", str(fixed_adapter))
    _check_batched_scores(engine, policy)


def test_score_batch_keeps_its_logits_bounded(tiny_spec):
    """A batch holds no more logit rows than one request of `max_seq_len` tokens: batch x (longest target + 1)
    <= max_seq_len; requests past that wait for the next forward."""
    engine = HFEngine.from_spec(tiny_spec, max_batch_size=8)
    engine.max_seq_len = 100
    prompt = chat_ids(engine.tokenizer, "hi")
    jobs = [(prompt, list(range(5, 5 + 30)))] * 3 + [(prompt, [5, 6])]  # 4 x 31 logit rows > 100; 3 x 31 fit
    results = _score_concurrently(engine, jobs)
    assert sum(size * count for size, count in engine.score_batches.items()) == 4
    assert max(engine.score_batches) == 3  # whoever leads, one of the four waits for the next forward
    for i, (_, target) in enumerate(jobs):
        assert len(results[i]) == len(target)


def test_stream_equals_generate(engine, fixed_adapter):
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "hi")
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=11)
    whole = engine.generate(prompt, params, "fixed")[0]
    stream = engine.stream(prompt, params, "fixed")
    deltas = list(stream)
    assert [d.token_id for d in deltas] == whole.token_ids
    assert torch.allclose(torch.tensor([d.logprob for d in deltas]), torch.tensor(whole.logprobs), atol=1e-5)
    assert stream.finish_reason == whole.finish_reason
    assert stream.adapter_version == engine.adapters()["fixed"]


def test_prompt_logprobs_match_policy(engine, policy, fixed_adapter):
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "What is the capital of France?")
    target = engine.tokenizer(FIXED_ANSWER)["input_ids"]
    got = torch.tensor(engine.prompt_logprobs(prompt, target, "fixed"))
    assert (got - recompute(policy, prompt, target, 1.0)).abs().max().item() <= 1e-4
    base = torch.tensor(engine.prompt_logprobs(prompt, target))
    assert (base - recompute(policy, prompt, target, 1.0, reference=True)).abs().max().item() <= 1e-4
    scores = engine.score_tokens(prompt, target, "fixed")
    assert [s.rank for s in scores] == [1] * len(target)  # the adapter's answer is its greedy answer
    assert [s.rank for s in engine.score_tokens(prompt, target)] != [1] * len(target)


def test_repoint_keeps_in_flight_version_and_frees_old(fresh_engine, fixed_adapter, tmp_path):
    second = tmp_path / "step-000009"
    shutil.copytree(fixed_adapter, second)
    assert fresh_engine.load_adapter("policy", str(fixed_adapter)) == 7
    prompt = chat_ids(fresh_engine.tokenizer, "hi")
    stream = fresh_engine.stream(prompt, SamplingParams(max_tokens=8, temperature=0), "policy")  # pins v7
    assert fresh_engine.load_adapter("policy", str(second)) == 9
    assert fresh_engine.adapters() == {"policy": 9}
    list(stream)
    assert stream.adapter_version == 7
    assert len(fresh_engine._peft.peft_config) == 1  # v7 freed by its last user
    assert fresh_engine.generate(prompt, SamplingParams(max_tokens=4), "policy")[0].adapter_version == 9
    assert fresh_engine.load_adapter("policy", str(second)) == 10  # same step again: still increases
    fresh_engine.unload_adapter("policy")
    assert fresh_engine.adapters() == {}
    with pytest.raises(UnknownAdapterError):
        fresh_engine.generate(prompt, SamplingParams(max_tokens=2), "policy")
    assert fresh_engine.generate(prompt, SamplingParams(max_tokens=2))[0].adapter_version is None


def test_bad_adapters_refused(fresh_engine, tmp_path, fixed_adapter):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(fixed_adapter / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(AdapterError, match="safetensors"):
        fresh_engine.load_adapter("x", str(pickled))
    with pytest.raises(AdapterError):
        fresh_engine.load_adapter("x", str(tmp_path / "missing"))
    with pytest.raises(ValueError):
        fresh_engine.load_adapter("bad name!", str(fixed_adapter))
    assert fresh_engine.adapters() == {}


def test_prompt_longer_than_context_refused(fresh_engine):
    with pytest.raises(ValueError, match="max_seq_len"):
        fresh_engine.generate([5] * fresh_engine.max_seq_len, SamplingParams(max_tokens=1))


def test_wraps_an_already_loaded_peft_model(tiny_spec, fixed_adapter):
    pol = LoraPolicy(tiny_spec.load_model(), rank=8, alpha=16)
    pol.load_adapter(fixed_adapter)
    tok = tiny_spec.load_tokenizer()
    engine = HFEngine(pol.model.eval(), tok, model_name="tiny", max_seq_len=1024)
    assert engine.adapters() == {"default": 0}
    prompt = chat_ids(tok, "hi")
    out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0), "default")[0]
    assert tok.decode(out.token_ids).startswith(FIXED_ANSWER)
    base = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert not tok.decode(base.token_ids).startswith(FIXED_ANSWER)


def _merged_engine(tiny_spec, max_batch_size: int = 1) -> HFEngine:
    return HFEngine.from_spec(tiny_spec, max_batch_size=max_batch_size, merge_adapters=True)


def test_merged_adapter_behaviour_logprobs_are_the_trainers(tiny_spec, policy, fixed_adapter):
    """Issue 29.3, the ratio-is-1 rule for `backend.merge_adapters`: the LoRA folded into a copy of the weights
    samples with the trainer's (unmerged PEFT) logprobs within 1e-4, generated, batched, streamed and scored; the
    base model's logprobs are untouched by the merge."""
    engine = _merged_engine(tiny_spec, max_batch_size=4)
    assert engine.load_adapter("fixed", str(fixed_adapter)) == 7
    assert engine._peft is None  # no PEFT layers: plain Linears with the adapter merged in
    dist = dict(temperature=0.7, top_p=0.9, top_k=20)
    prompts = [chat_ids(engine.tokenizer, p) for p in ("Tell me something", "hi", "Name a colour.")]
    rows = [(prompts[0], o) for o in engine.generate(prompts[0], SamplingParams(max_tokens=24, n=2, seed=5, **dist),
                                                     "fixed")]  # fmt: skip

    def batched(prompt: list[int]) -> None:
        rows.append((prompt, engine.generate(prompt, SamplingParams(max_tokens=16, **dist), "fixed")[0]))

    with engine._lock:  # three requests pending at once: one batched generate
        threads = [threading.Thread(target=batched, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(engine._queue.pending) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(120)
    assert engine.batches.get(3) == 1 and len(rows) == 5
    deltas = list(engine.stream(prompts[1], SamplingParams(max_tokens=12, seed=3, **dist), "fixed"))
    streamed = [d.token_id for d in deltas], [d.logprob for d in deltas]
    for prompt, (token_ids, logprobs) in [*((p, (o.token_ids, o.logprobs)) for p, o in rows), (prompts[1], streamed)]:
        theirs = recompute(policy, prompt, token_ids, 0.7, top_p=0.9, top_k=20)
        assert (torch.tensor(logprobs) - theirs).abs().max().item() <= 1e-4
    target = engine.tokenizer(FIXED_ANSWER)["input_ids"]
    got = torch.tensor(engine.prompt_logprobs(prompts[0], target, "fixed"))
    assert (got - recompute(policy, prompts[0], target, 1.0)).abs().max().item() <= 1e-4
    base = torch.tensor(engine.prompt_logprobs(prompts[0], target))
    assert (base - recompute(policy, prompts[0], target, 1.0, reference=True)).abs().max().item() <= 1e-4
    greedy = engine.generate(prompts[1], SamplingParams(max_tokens=12, temperature=0), "fixed")[0]
    assert engine.tokenizer.decode(greedy.token_ids).startswith(FIXED_ANSWER)


def test_merged_hot_load_never_waits_for_a_generation(tiny_spec, fixed_adapter, tmp_path):
    """Issue 29.4, the double-buffered slot: a new adapter version is built while the model lock is held (a
    generation running), then re-pointed; a request pinned to the old version keeps it; the copy it frees takes the
    version after next in place (no third copy), and every version answers with its own weights."""
    engine = _merged_engine(tiny_spec)
    prompt = chat_ids(engine.tokenizer, "hi")
    paths = []
    for step in (9, 11):
        paths.append(tmp_path / f"step-{step:06d}")
        shutil.copytree(fixed_adapter, paths[-1])
    assert engine.load_adapter("policy", str(fixed_adapter)) == 7
    stream = engine.stream(prompt, SamplingParams(max_tokens=8, temperature=0), "policy")  # pins v7
    with engine._lock:  # a generation holds the model: the load must not need it
        loader = threading.Thread(target=engine.load_adapter, args=("policy", str(paths[0])))
        loader.start()
        loader.join(60)
        assert not loader.is_alive() and engine.adapters() == {"policy": 9}
    assert engine.tokenizer.decode([d.token_id for d in stream]).startswith(FIXED_ANSWER[:4])
    assert stream.adapter_version == 7 and len(engine._merged) == 1  # v7 freed by its last user: a spare now
    spare = engine._slots._free[next(iter(engine._slots._free))][0]
    assert engine.load_adapter("policy", str(paths[1])) == 11
    assert engine._merged[engine._registry.current("policy").internal] is spare  # reused in place
    out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0), "policy")[0]
    assert out.adapter_version == 11 and engine.tokenizer.decode(out.token_ids).startswith(FIXED_ANSWER)
    base = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert not engine.tokenizer.decode(base.token_ids).startswith(FIXED_ANSWER)


def test_merge_adapters_auto_merges_on_cpu_only(tiny_spec):
    """`backend.merge_adapters: auto` (the default): merged on CPU; a bad value is a config error naming it."""
    assert HFEngine.from_backend(tiny_spec, [], merge_adapters="auto").merge_adapters is True
    assert HFEngine.from_backend(tiny_spec, [], merge_adapters=False).merge_adapters is False
    with pytest.raises(ValueError, match="backend.merge_adapters"):
        HFEngine.from_backend(tiny_spec, [], merge_adapters="yes")


def test_clients_at_machine_pace_share_batches_instead_of_taking_turns(tiny_spec, monkeypatch):
    """`backend.batch_linger_s`: client B's turn arrives while client A's batch runs; A comes back the moment it
    is answered. Without the linger B's turn runs alone as soon as A's batch ends and A's next turn waits for it,
    so the two take turns at batch 1 forever; with it, B's leader waits for the turn A's batch answered and both
    share one batch. A request arriving after the linger window never waits."""
    engine = HFEngine.from_spec(tiny_spec, max_batch_size=4, batch_linger_s=2.0)
    prompt = chat_ids(engine.tokenizer, "hi")
    params = SamplingParams(max_tokens=6, temperature=1.0)
    real = sampling.generate_batch
    calls: list[int] = []
    b_results: list = []

    def first_batch_lets_b_arrive(model, tokenizer, prompts, params_list, prefix=None):
        calls.append(len(prompts))
        if len(calls) == 1:  # A's first turn is running: B's turn arrives and waits
            b = threading.Thread(target=lambda: b_results.append(engine.generate(prompt, params)))
            b.start()
            deadline = time.monotonic() + 30
            while len(engine._queue.pending) < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(engine._queue.pending) == 1
            first_batch_lets_b_arrive.b = b
        return real(model, tokenizer, prompts, params_list, prefix)

    monkeypatch.setattr(sampling, "generate_batch", first_batch_lets_b_arrive)
    engine.generate(prompt, params)  # A's first turn
    time.sleep(0.1)  # A's client reads the reply and sends its next turn (an HTTP round trip, a proxy)
    engine.generate(prompt, params)  # ... and shares B's batch
    first_batch_lets_b_arrive.b.join(60)
    assert calls == [1, 2] and len(b_results) == 1 and engine.batches == {1: 1, 2: 1}

    engine.batch_linger_s = 0.05
    time.sleep(0.1)  # past the window: a lone request
    lingered = profiling.snapshot()["phases"].get("batch_linger", {}).get("n", 0)
    engine.generate(prompt, params)
    assert profiling.snapshot()["phases"].get("batch_linger", {}).get("n", 0) == lingered
    assert calls == [1, 2, 1]


def test_batch_linger_is_bounded(tiny_spec):
    with pytest.raises(ValueError, match="batch_linger_s"):
        HFEngine.from_spec(tiny_spec, max_batch_size=4, batch_linger_s=-1)


@pytest.mark.parametrize("merge", [False, True])
def test_prefix_reuse_across_turns_keeps_the_trainers_logprobs(tiny_spec, policy, fixed_adapter, merge):
    """Issue 29: each turn of two interleaved conversations reads only what follows the longest cached prefix (its
    previous turn) and the behaviour logprobs are still the trainer's of the whole sequence within 1e-4 (ratio 1),
    for the base model and an adapter, batched and alone; a freed adapter version's entries go with it."""
    engine = HFEngine.from_spec(tiny_spec, max_batch_size=4, merge_adapters=merge, prefix_cache_mb=64)
    engine.load_adapter("fixed", str(fixed_adapter))
    tok = engine.tokenizer
    dist = dict(temperature=0.8, top_p=0.95, top_k=30)
    history: dict[tuple[str | None, int], list[tuple[str, list[int]]]] = {}
    questions = ["Tell me about cats.", "And dogs?", "Which is older?"]
    for question in questions:
        jobs, texts = [], []
        for adapter in (None, "fixed"):
            for conv in range(2):
                texts.append(f"{question} ({conv})" + " Tell me more, please." * conv)  # rows of different lengths
                prompt = conversation_ids(tok, history.get((adapter, conv), []), texts[-1])
                jobs.append((prompt, SamplingParams(max_tokens=10 + 3 * conv, **dist), adapter))
        results = _concurrently(engine, engine.generate, engine._queue.pending, jobs)
        for i, (prompt, _params, adapter) in enumerate(jobs):
            (out,) = results[i]
            theirs = recompute(policy, prompt, out.token_ids, 0.8, adapter is None, top_p=0.95, top_k=30)
            assert (torch.tensor(out.logprobs) - theirs).abs().max().item() <= 1e-4
            history.setdefault((adapter, i % 2), []).append((texts[i], out.token_ids))
    stats = engine.prefix.stats
    # turns 2 and 3 of four conversations find their previous turn; the first turns share the template's header
    assert stats["hits"] >= 8 and stats["reused_tokens"] > stats["prompt_tokens"] / 3, stats
    assert 0 < engine.prefix.bytes <= 64 * 2**20
    held = len(engine.prefix)
    engine.load_adapter("fixed", str(fixed_adapter))  # a new version: the old one's entries are freed with it
    assert 0 < len(engine.prefix) < held
    hits = stats["hits"]
    one = engine.generate(jobs[0][0], SamplingParams(max_tokens=6, seed=3, **dist))[0]  # alone (a seed), a hit
    theirs = recompute(policy, jobs[0][0], one.token_ids, 0.8, True, top_p=0.95, top_k=30)
    assert (torch.tensor(one.logprobs) - theirs).abs().max().item() <= 1e-4
    stream = engine.stream(jobs[2][0], SamplingParams(max_tokens=6, **dist), "fixed")  # streamed: a miss (new version)
    deltas = list(stream)
    assert stream.output is not None and [d.token_id for d in deltas] == stream.output.token_ids
    theirs = recompute(policy, jobs[2][0], stream.output.token_ids, 0.8, False, top_p=0.95, top_k=30)
    assert (torch.tensor([d.logprob for d in deltas]) - theirs).abs().max().item() <= 1e-4
    again = engine.stream(jobs[2][0] + stream.output.token_ids, SamplingParams(max_tokens=4, **dist), "fixed")
    tokens = [d.token_id for d in again]
    theirs = recompute(policy, jobs[2][0] + stream.output.token_ids, tokens, 0.8, False, top_p=0.95, top_k=30)
    assert (torch.tensor(again.output.logprobs) - theirs).abs().max().item() <= 1e-4
    assert stats["hits"] >= hits + 2  # the seeded request and the stream that continues the streamed one


def test_prefix_cache_is_bounded_and_keeps_the_longest_turn():
    """The cache holds at most its byte budget (least recently used out) and one entry per conversation: a turn
    that extends a cached one replaces it; lookups return the longest common prefix, per model."""
    from metaclaw.serving.prefix_cache import PrefixCache, check_mb, from_mb

    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((2, n, 4), float(n)), torch.full((2, n, 4), -float(n))) for _ in range(3)]

    per_token = 3 * 2 * 2 * 4 * 4  # layers x (k, v) x heads x dim x bytes
    cache = PrefixCache(max_bytes=100 * per_token, min_tokens=4)
    cache.store("m", list(range(20)), kv(20))
    cache.store("m", list(range(30)), kv(30))  # the same conversation, one turn on: replaces the first
    assert len(cache) == 1 and cache.bytes == 30 * per_token
    cache.store("m", list(range(10)), kv(10))  # already covered by the longer entry
    assert len(cache) == 1
    n, layers = cache.lookup("m", list(range(25)) + [99, 98], limit=26)
    assert n == 25 and layers is not None and layers[0][0].shape == (2, 25, 4)
    assert cache.lookup("other", list(range(25)), limit=25) == (0, None)  # another model's keys never serve
    assert cache.lookup("m", [7, 7, 7, 7, 7], limit=5) == (0, None)
    assert cache.lookup("m", [0, 1, 2, 9], limit=4) == (0, None)  # 3 common tokens: under min_tokens
    cache.store("m", [50 + i for i in range(40)], kv(40))
    cache.store("m", [200 + i for i in range(40)], kv(40))  # 110 tokens > 100: the least recent goes
    assert cache.bytes <= 100 * per_token and cache.stats["evicted"] == 1
    assert cache.lookup("m", list(range(30)), limit=30) == (0, None)
    cache.forget("m")
    assert len(cache) == 0 and cache.bytes == 0
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        PrefixCache(-1)
    assert check_mb(1.5) == 3 * 2**19 and check_mb(0) == 0 and from_mb(0) is None
    for bad in (-1, 2**20 + 1):
        with pytest.raises(ValueError, match="prefix_cache_mb must be in"):
            check_mb(bad)
