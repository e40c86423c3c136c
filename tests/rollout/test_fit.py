"""The context policy against the tiny model's real tokenizer and chat template (no server)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaclaw.rollout.fit import ClientFit, ContextPolicy, ImagePolicy

CARD = {"id": "tiny", "max_model_len": 512}


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_short_prompts_are_untouched(tiny_tokenizer):
    policy = ContextPolicy(tokenizer=tiny_tokenizer)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert policy.fit(msgs, None, CARD, None) == (msgs, None, None)
    assert ContextPolicy(tokenizer=None).fit(msgs, None, CARD, None) == (msgs, None, None)  # no tokenizer: off


def test_tool_results_go_first_then_old_exchanges_system_and_newest_stay(tiny_tokenizer):
    policy = ContextPolicy(tokenizer=tiny_tokenizer, reserve_tokens=64)
    msgs = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "first " + words(150, "a")},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "exec", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": words(300, "t")},
        {"role": "user", "content": "and now?"},
    ]  # fmt: skip
    out, _, action = policy.fit(msgs, None, CARD, None)
    assert action["action"] == "truncated" and action["tool_results_elided"] == 1
    assert out[0] == msgs[0] and out[-1] == msgs[-1]
    assert policy.count(out, None) == action["prompt_tokens_after"] <= action["budget"] == 512 - 64
    tool = next(m for m in out if m["role"] == "tool")
    assert tool["content"] == policy.tool_result_placeholder
    if action["messages_dropped"]:
        assert out[1]["role"] == "user"  # whole exchanges go, never half of one


def test_a_system_prompt_alone_over_the_limit_is_trimmed_at_its_tail(tiny_tokenizer):
    policy = ContextPolicy(tokenizer=tiny_tokenizer)
    msgs = [{"role": "system", "content": "RULES " + words(2000)}, {"role": "user", "content": "hello there"}]
    out, _, action = policy.fit(msgs, None, CARD, 16)
    assert action["action"] == "truncated" and action["system_trimmed_tokens"] > 0
    assert out[0]["content"].startswith("RULES") and "tokens omitted: context limit]" in out[0]["content"]
    assert out[1] == msgs[1] and policy.count(out, None) <= 512 - 16


def tool(name: str, prose: int) -> dict:
    params = {"type": "object", "required": ["path"],
              "properties": {"path": {"type": "string", "description": words(prose, "p")},
                             "description": {"type": "string", "description": words(prose, "d")}}}  # fmt: skip
    return {"type": "function", "function": {"name": name, "description": "Reads a file. " + words(prose, "f"),
                                             "parameters": params}}  # fmt: skip


def test_tool_definitions_lose_prose_before_any_message_and_stay_callable(tiny_tokenizer):
    """An agent's long tool list (Claude Code sends 12-21 tools, 30-60 KB): names and argument schemas stay,
    even a property named `description`; the conversation is untouched when slimming is enough."""
    policy = ContextPolicy(tokenizer=tiny_tokenizer)
    tools, card = [tool(f"t{i}", 60) for i in range(2)], {"max_model_len": 1024}
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "hi"}]
    assert policy.count(msgs, tools) > 1024 - 64
    out, slim, action = policy.fit(msgs, tools, card, 64)
    assert action["action"] == "truncated" and action["tools_slimmed"] >= 1 and out == msgs
    assert [t["function"]["name"] for t in slim] == ["t0", "t1"]
    for t in slim:
        props = t["function"]["parameters"]["properties"]
        assert set(props) == {"path", "description"} and props["path"] == {"type": "string"}
        assert t["function"]["parameters"]["required"] == ["path"]
    assert policy.count(out, slim) == action["prompt_tokens_after"] <= 1024 - 64
    assert tools[0]["function"]["description"].startswith("Reads a file. f0")  # the caller's copy is untouched


def test_system_cuts_are_stable_across_a_growing_conversation(tiny_tokenizer):
    """Cuts are whole quanta: turn after turn the same system text is kept, so the server's prefix cache holds."""
    policy = ContextPolicy(tokenizer=tiny_tokenizer, trim_quantum_tokens=128)
    system = {"role": "system", "content": "RULES " + words(600)}
    kept = set()
    convo = [system, {"role": "user", "content": "q0"}]
    for turn in range(1, 6):
        out, _, action = policy.fit(convo, None, CARD, 16)
        assert action["system_trimmed_tokens"] % 128 == 0 and policy.count(out, None) <= 512 - 16
        kept.add(out[0]["content"])
        convo = [*convo, {"role": "assistant", "content": "a"}, {"role": "user", "content": f"q{turn}"}]
    assert len(kept) == 1


def test_an_agents_huge_max_tokens_leaves_its_prompt_room(tiny_tokenizer):
    """Claude Code asks for max_tokens 32000: the prompt keeps at least 7/8 of the context (then the reply stops
    at the context's end), not half of it."""
    policy = ContextPolicy(tokenizer=tiny_tokenizer, reserve_tokens=32)
    msgs = [{"role": "system", "content": "RULES " + words(2000)}, {"role": "user", "content": "hello"}]
    _, _, action = policy.fit(msgs, None, CARD, 32000)
    assert action["budget"] == 512 - 512 // 8


def test_off_and_images_are_left_to_the_server(tiny_tokenizer):
    msgs = [{"role": "user", "content": words(2000)}]
    assert ContextPolicy(mode="off", tokenizer=tiny_tokenizer).fit(msgs, None, CARD, None) == (msgs, None, None)
    fit = ClientFit(ImagePolicy(mode="passthrough"), ContextPolicy(tokenizer=tiny_tokenizer))
    parts = [{"type": "text", "text": words(2000)}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    meta: dict = {}
    assert fit.apply([{"role": "user", "content": parts}], None, True, CARD, None, meta)[0][0]["content"] == parts
    assert meta["images"] == "passthrough" and meta["context"]["action"] == "skipped"  # said, never silent


ROLE = st.sampled_from(["system", "user", "assistant", "tool"])
MESSAGE = st.builds(lambda role, n: {"role": role, "content": words(n)}, ROLE, st.integers(0, 400))


@given(msgs=st.lists(MESSAGE, min_size=1, max_size=8), max_tokens=st.none() | st.integers(1, 600))
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_policy_never_raises_and_fits_or_says_unfit(tiny_tokenizer, msgs, max_tokens):
    fit = ClientFit(ImagePolicy(), ContextPolicy(tokenizer=tiny_tokenizer))
    meta: dict = {}
    out, _ = fit.apply(msgs, None, False, CARD, max_tokens, meta)
    action = meta.get("context")
    if action is None:
        assert out == msgs
    elif action["action"] == "truncated":
        assert action["prompt_tokens_after"] <= action["budget"] and out[-1]["role"] == msgs[-1]["role"]
    else:
        assert action["action"] == "unfit", action  # "error" would be a bug in the policy


def test_of_several_system_messages_the_longest_is_trimmed(tiny_tokenizer):
    """Codex sends its instructions and its skills as two developer items: the long one is cut, the short kept."""
    policy = ContextPolicy(tokenizer=tiny_tokenizer)
    msgs = [{"role": "system", "content": "BASE " + words(1500)}, {"role": "system", "content": "Skills: none."},
            {"role": "user", "content": "hello"}]  # fmt: skip
    out, _, action = policy.fit(msgs, None, CARD, 16)
    assert action["action"] == "truncated" and out[1] == msgs[1] and out[0]["content"].startswith("BASE")
    assert "tokens omitted: context limit]" in out[0]["content"] and policy.count(out, None) <= 512 - 16
