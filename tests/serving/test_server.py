"""The real server (`python serve.py model=tiny`) through the real `openai` client and raw HTTP."""

from __future__ import annotations

import shutil
import threading

import httpx
import openai
import pytest

from metaclaw.wire.client import Endpoint, teacher_logprobs

from .conftest import FIXED_ANSWER

USER = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


def post(server, path: str, body=None, content=None, headers=None) -> httpx.Response:
    headers = headers or server.headers()
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=headers, timeout=60)


def load(server, name: str, path: str) -> httpx.Response:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def test_health_is_open_and_everything_else_needs_the_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401


def test_models_lists_the_base(server):
    data = httpx.get(f"{server.url}/v1/models", headers=server.headers()).json()["data"]
    assert data[0]["id"] == "tiny" and data[0]["object"] == "model" and data[0]["parent"] is None


def test_chat_plain_with_logprobs_and_token_ids(client):
    resp = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=6, temperature=0.7, seed=1, logprobs=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = resp.choices[0]
    extra = resp.model_dump()
    token_ids = extra["choices"][0]["token_ids"]
    assert len(token_ids) == len(choice.logprobs.content) == resp.usage.completion_tokens
    assert choice.finish_reason in ("length", "stop")
    assert all(entry.logprob <= 0 and entry.top_logprobs == [] for entry in choice.logprobs.content)
    assert len(extra["prompt_token_ids"]) == resp.usage.prompt_tokens


def test_chat_top_logprobs_are_the_sampling_distributions_most_likely_tokens(client, server, tiny_spec):
    """`top_logprobs` (OpenAI's field) is answered, never an empty list: at each position the k most likely tokens
    of the distribution the reply was drawn from, most likely first; the sampled token's logprob is the one
    reported for it there, and the first position's alternatives are the engine's own top-k."""
    import torch

    from metaclaw.distribution.logprobs import top_logprobs
    from metaclaw.serving.sampling import SamplingParams, generate

    from .conftest import chat_ids

    resp = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=5, temperature=0.7, seed=3, logprobs=True, top_logprobs=4,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    dumped = resp.model_dump()
    for entry in resp.choices[0].logprobs.content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
        same = [t.logprob for t in entry.top_logprobs if t.token == entry.token and "\ufffd" not in t.token]
        assert not same or abs(same[0] - entry.logprob) < 1e-4
    assert len(dumped["choices"][0]["token_ids"]) == len(resp.choices[0].logprobs.content)
    # in process, the same engine code: the first position's alternatives are the model's own top-k
    model, tok = tiny_spec.load_model(), tiny_spec.load_tokenizer()
    prompt = chat_ids(tok, "What is the capital of France?")
    (out,) = generate(model, tok, prompt, SamplingParams(max_tokens=2, temperature=0.7, top_logprobs=4, seed=3))
    with torch.no_grad():
        ids, lps = top_logprobs(model(input_ids=torch.tensor([prompt])).logits[0, -1], 4, 0.7)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert all(abs(v - lp) < 1e-4 for (_, v), lp in zip(out.top_logprobs[0], lps.tolist(), strict=True))
    bad = [{"top_logprobs": 3}, {"top_logprobs": 3, "logprobs": True, "stream": True},
           {"top_logprobs": 21, "logprobs": True}]  # fmt: skip
    for extra in bad:  # asked where it cannot be answered: 400 naming the field
        r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 2, **extra})
        assert r.status_code == 400 and "top_logprobs" in r.text, (extra, r.text)


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model="tiny", messages=USER, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**kwargs).model_dump()
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, logprobs=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    dumped = [c.model_dump() for c in chunks]
    assert dumped[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed_ids = [t for c in dumped for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    assert streamed_ids == whole["choices"][0]["token_ids"]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert text == whole["choices"][0]["message"]["content"]
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == [whole["choices"][0]["finish_reason"]]
    n_logprobs = sum(len(ch.logprobs.content) for c in chunks for ch in c.choices if ch.logprobs)
    assert n_logprobs == len(streamed_ids)
    assert chunks[-1].usage.completion_tokens == len(streamed_ids)


def test_sse_ends_with_done(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers()) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"


def test_tool_round_trip_renders_and_answers(server, client, tiny_spec):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Berlin?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]  # fmt: skip
    resp = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=4, extra_body={"return_token_ids": True}
    )
    prompt = tiny_spec.load_tokenizer().decode(resp.model_dump()["prompt_token_ids"])
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_hot_reload_changes_adapter_answers_not_base(server, client, fixed_adapter):
    def greedy(model: str) -> str:
        r = client.chat.completions.create(model=model, messages=USER, max_tokens=12, temperature=0)
        return r.choices[0].message.content

    base_before = greedy("tiny")
    with pytest.raises(openai.NotFoundError):
        greedy("policy")
    r = load(server, "policy", "step-000007")  # relative to serve.adapter_root
    assert r.status_code == 200, r.text
    assert r.headers["x-metaclaw-adapter-version"] == "7" and r.json()["adapter_version"] == 7
    assert greedy("policy") == FIXED_ANSWER
    assert greedy("tiny") == base_before != FIXED_ANSWER
    raw = post(server, "/v1/chat/completions", {"model": "policy", "messages": USER, "max_tokens": 2})
    assert raw.headers["x-metaclaw-adapter-version"] == "7" and "adapter_version" not in raw.json()  # header only
    models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", headers=server.headers()).json()["data"]}
    assert models["policy"]["parent"] == "tiny" and models["policy"]["root"] == str(fixed_adapter)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "policy"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        greedy("policy")


def test_teacher_logprobs_helper(server, engine, fixed_adapter):
    assert load(server, "teacher", str(fixed_adapter)).status_code == 200
    engine.load_adapter("teacher", str(fixed_adapter))
    tok = engine.tokenizer
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True)["input_ids"]
    target = tok(FIXED_ANSWER)["input_ids"]
    for model, adapter in (("teacher", "teacher"), ("tiny", None)):
        got = teacher_logprobs(Endpoint(server.url, server.api_key), model, prompt, target)
        want = engine.prompt_logprobs(prompt, target, adapter)
        assert len(got) == len(target) and max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
    body = {"model": "teacher", "prompt": prompt + target, "max_tokens": 0, "echo": True, "logprobs": 0,
            "prompt_logprobs": 0}  # fmt: skip
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt + target)
    entry = choice["prompt_logprobs"][-1][str(target[-1])]
    assert set(entry) == {"logprob", "rank", "decoded_token"} and entry["rank"] == 1
    assert choice["logprobs"]["token_logprobs"][0] is None
    # metaclaw's prompt_logprobs_from: the context unscored (null), the rest as before
    k = len(prompt)
    split = post(server, "/v1/completions", {**body, "prompt_logprobs_from": k}).json()["choices"][0]
    assert split["prompt_logprobs"][:k] == [None] * k and split["logprobs"]["token_logprobs"][:k] == [None] * k
    for a, b in zip(split["prompt_logprobs"][k:], choice["prompt_logprobs"][k:], strict=True):
        assert a.keys() == b.keys() and abs(a[next(iter(a))]["logprob"] - b[next(iter(b))]["logprob"]) <= 1e-4
    too_far = post(server, "/v1/completions", {**body, "prompt_logprobs_from": len(prompt + target)})
    assert too_far.status_code == 400 and "prompt_logprobs_from" in too_far.json()["error"]["message"]


@pytest.mark.parametrize(
    "body,status,code",
    [({"model": "nope", "messages": USER}, 404, "model_not_found"),
     ({"model": "tiny", "messages": USER, "max_tokens": -3}, 400, 400),
     ({"model": "tiny", "messages": "hi"}, 400, 400),
     ({"model": "tiny", "messages": USER, "temperature": "warm"}, 400, 400),
     ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "context_length_exceeded"),
     ([1, 2, 3], 400, 400)],
)  # fmt: skip
def test_bad_requests_are_4xx(server, body, status, code):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]


def test_invalid_json_and_bad_adapter_paths(server, fixed_adapter):
    r = post(server, "/v1/chat/completions", content=b"{not json", headers={**server.headers(),
             "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for path in ("/etc", "../outside", str(fixed_adapter.parent.parent)):
        r = load(server, "evil", path)
        assert r.status_code == 400 and "outside" in r.json()["error"]["message"]
    assert load(server, "evil", "does-not-exist").status_code == 400
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}).status_code == 404
    assert post(server, "/v1/load_lora_adapter", {"lora_name": 5}).status_code == 400
    assert httpx.get(f"{server.url}/health").status_code == 200  # still serving


def test_concurrent_requests_during_swaps_all_succeed(server, fixed_adapter):
    for step in (11, 12, 13, 14):
        shutil.copytree(fixed_adapter, server.adapter_root / f"step-{step:06d}", dirs_exist_ok=True)
    assert load(server, "swap", "step-000011").status_code == 200
    results: list[tuple[int, int | None]] = []
    stop = threading.Event()

    def hammer(model: str, stream: bool) -> None:
        with httpx.Client(headers=server.headers(), timeout=60) as http:
            while not stop.is_set():
                body = {"model": model, "messages": USER, "max_tokens": 4, "stream": stream}
                r = http.post(f"{server.url}/v1/chat/completions", json=body)
                version = r.headers.get("x-metaclaw-adapter-version")
                results.append((r.status_code, int(version) if version else None))

    threads = [threading.Thread(target=hammer, args=(m, s)) for m in ("swap", "tiny") for s in (False, True)]
    for t in threads:
        t.start()
    try:
        for step in (12, 13, 14):
            r = load(server, "swap", f"step-{step:06d}")
            assert r.status_code == 200 and r.json()["adapter_version"] == step
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert results and all(status == 200 for status, _ in results), results
    assert {v for _, v in results} <= {None, 11, 12, 13, 14}
    after = post(server, "/v1/chat/completions", {"model": "swap", "messages": USER, "max_tokens": 2})
    assert after.headers["x-metaclaw-adapter-version"] == "14"


@pytest.mark.slow  # a server of its own; the session's server already serves merged (the CPU default: auto)
def test_merged_adapters_through_the_real_server(tmp_path, adapter_root, fixed_adapter):
    """`serve.py backend.merge_adapters=true`: the adapter loads over HTTP, answers with its weights, swaps to a
    new version and unloads; the base model's answers never change."""
    from .conftest import running_server

    with running_server(tmp_path, adapter_root, "backend.merge_adapters=true") as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.api_key, max_retries=0, timeout=60)

        def greedy(model: str) -> str:
            r = client.chat.completions.create(model=model, messages=USER, max_tokens=12, temperature=0)
            return r.choices[0].message.content

        base = greedy("tiny")
        assert load(live, "policy", "step-000007").json()["adapter_version"] == 7
        assert greedy("policy") == FIXED_ANSWER != base
        shutil.copytree(fixed_adapter, adapter_root / "step-000008", dirs_exist_ok=True)
        assert load(live, "policy", "step-000008").json()["adapter_version"] == 8
        assert greedy("policy") == FIXED_ANSWER and greedy("tiny") == base
        assert post(live, "/v1/unload_lora_adapter", {"lora_name": "policy"}).status_code == 200
    assert "adapters served merged" in live.log.read_text()


def test_metrics_behind_the_key_parse_and_count_requests_and_tokens(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, tuple], float]:
        r = httpx.get(f"{server.url}/metrics", headers=server.headers())
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(r.text) for s in f.samples}  # fmt: skip

    assert httpx.get(f"{server.url}/metrics").status_code == 401  # behind the key (serve.metrics_open=false)
    before = scrape()
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    after = scrape()
    chat = (("agent", "all"), ("code", "200"), ("route", "/v1/chat/completions"), ("server", "policy"))
    assert after[("metaclaw_requests_total", chat)] == before.get(("metaclaw_requests_total", chat), 0) + 1
    completion = ("metaclaw_tokens_total", (("agent", "tiny"), ("kind", "completion"), ("server", "policy")))
    assert after[completion] >= before.get(completion, 0) + 1
    assert any(name == "process_resident_memory_bytes" for name, _ in after)
