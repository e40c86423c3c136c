"""`/v1/responses` (OpenAI's Responses API, what Codex speaks) through the proxy, driven by the real `openai` SDK
(`client.responses.create`, streamed and not) against the scripted upstream: text, `instructions`, function tools
both ways, the captured turn trained on, and every refusal a 400 naming the problem."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FLAT_TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": CITY}


@pytest.fixture
def client(harness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{harness.url}/v1", api_key="unused", max_retries=0, timeout=30)


def trained_on(store, sample_id: int) -> bool:
    """Scored, then claimed by an optimizer step: the turn reaches training."""
    store.set_score(sample_id, reward=1.0)
    return sample_id in {s.id for s in store.claim_batch(step=0, max_samples=8)}


def test_text_reply_with_instructions_is_captured_and_trained_on(harness, client):
    r = client.responses.create(model="gpt-5-codex", instructions="Be brief.", input="What is 2+2?")
    assert isinstance(r, openai.types.responses.Response) and r.object == "response" and r.status == "completed"
    assert r.id.startswith("resp_") and r.model == "gpt-5-codex" and r.output_text == "Sure, here is the answer."
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    sent = harness.upstream_state["requests"][-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    [s] = harness.store.select()
    assert s.status == "pending" and s.meta["response_id"] == r.id and s.text.response_text == r.output_text
    assert len(s.behaviour_logprobs) == len(s.response_ids) == r.usage.output_tokens
    fb = httpx.post(f"{harness.url}/v1/feedback", json={"response_id": r.id, "score": 1.0})  # the resp_ id names it
    assert fb.status_code == 200 and harness.store.get(s.id).meta["feedback"]["score"] == 1.0
    assert trained_on(harness.store, s.id)


def test_streamed_events_follow_the_responses_sequence(harness, client):
    events = list(client.responses.create(model="codex", input=[{"role": "user", "content": "hi there"}],
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == "Sure, here is the answer." and final.status == "completed"
    assert final.usage.output_tokens > 0
    [s] = harness.store.select()
    assert s.meta["response_id"] == final.id == events[0].response.id and trained_on(harness.store, s.id)


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_both_ways(harness, client, stream):
    ask = [{"role": "user", "content": "use the tool for Berlin"}]
    if stream:
        events = list(client.responses.create(model="codex", input=ask, tools=[FLAT_TOOL], stream=True))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        r = events[-1].response
    else:
        r = client.responses.create(model="codex", input=ask, tools=[FLAT_TOOL])
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Berlin"} and call.call_id
    sent = harness.upstream_state["requests"][-1]
    assert sent["tools"][0]["function"]["name"] == "get_weather"  # flat Responses tool -> chat tool
    # the client runs the tool and sends the result back as Codex does: the whole history, as items
    history = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"}]  # fmt: skip
    r2 = client.responses.create(model="codex", input=history, tools=[FLAT_TOOL])
    assert r2.status == "completed"
    sent = harness.upstream_state["requests"][-1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call.call_id and sent[1]["tool_calls"][0]["function"]["name"] == call.name
    assert sent[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "18C and sunny"}
    samples = harness.store.select()
    assert len(samples) == 2 and samples[0].session_id == samples[1].session_id  # one derived session
    assert samples[1].turn_index == samples[0].turn_index + 1


BAD_REQUESTS = [
    ({"model": "m", "input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ({"model": "m", "input": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
    ({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": {}}]}, "arguments"),
    ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ({"model": "m", "input": "hi", "instructions": 5}, "instructions"),
    ({"model": "m", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "hi", "tools": [{"type": "function"}]}, "name"),
    ({"model": "m", "input": "hi", "tools": [FLAT_TOOL], "tool_choice": 3}, "tool_choice"),
]


@pytest.mark.parametrize("body,named", BAD_REQUESTS)
def test_bad_requests_are_400_naming_the_problem(harness, client, body, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.status_code == 400 and named in e.value.message
    assert set(e.value.body) == {"message", "type", "param", "code"} and e.value.body["code"] is None
    assert httpx.get(f"{harness.url}/health").json()["status"] == "ok" and harness.store.count() == 0


def test_hosted_tools_are_left_out_and_developer_becomes_system(harness, client):
    r = client.responses.create(model="codex", tools=[{"type": "web_search"}, FLAT_TOOL], input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}])  # fmt: skip
    assert r.status == "completed"
    sent = harness.upstream_state["requests"][-1]
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]
    assert sent["messages"] == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "hello"}]


def test_codex_freeform_and_shell_call_items_become_tool_calls(harness, client):
    r = client.responses.create(model="codex", input=[
        {"role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
        {"type": "local_shell_call", "call_id": "c2", "status": "completed",
         "action": {"type": "exec", "command": ["ls"]}},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "a.txt"}]},
    ])  # fmt: skip
    assert r.status == "completed"
    sent = harness.upstream_state["requests"][-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "assistant", "tool"]
    assert json.loads(sent[1]["tool_calls"][0]["function"]["arguments"]) == {"input": "*** Begin Patch"}
    assert sent[3]["tool_calls"][0]["function"]["name"] == "local_shell" and sent[4]["content"] == "a.txt"
