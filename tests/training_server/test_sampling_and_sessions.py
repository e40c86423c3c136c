"""`/v1/sample`, `/v1/chat/completions` and several sessions side by side."""

from __future__ import annotations

import json

import httpx

from .helpers import BATCH, PROMPT, adapter, continuation_logprobs, step


def test_sample_shape_num_samples_and_stop(server, session_id) -> None:
    body = {"tokens": PROMPT, "num_samples": 3, "temperature": 1.0, "max_tokens": 8, "top_k": 50, "top_p": 0.95}
    out = server.ok("/v1/sample", {**body, "stop": ["\n"], "seed": 1})
    assert set(out) == {"sequences"} and len(out["sequences"]) == 3
    for seq in out["sequences"]:
        assert set(seq) == {"tokens", "logprobs", "stop_reason"}
        assert len(seq["tokens"]) == len(seq["logprobs"]) <= 8
        assert seq["stop_reason"] in ("stop", "length") and all(lp <= 0 for lp in seq["logprobs"])


def test_stop_strings_cut_the_text(server, session_id) -> None:
    free = server.ok("/v1/sample", {"tokens": PROMPT, "temperature": 0, "max_tokens": 12})["sequences"][0]
    assert len(free["tokens"]) >= 3
    from transformers import AutoTokenizer

    from metaclaw.modules.loading import ModelSpec

    tok = AutoTokenizer.from_pretrained(ModelSpec(name="tiny", path="tiny").local_dir())
    stop = tok.decode(free["tokens"][2:3])
    if not stop.strip():
        return  # a whitespace token: nothing meaningful to stop on with this random model
    cut = server.ok("/v1/sample", {"tokens": PROMPT, "temperature": 0, "max_tokens": 12, "stop": [stop]})["sequences"][
        0
    ]
    assert cut["stop_reason"] == "stop" and len(cut["tokens"]) <= 3 and stop in tok.decode(cut["tokens"])


def test_two_sessions_have_independent_adapters(server) -> None:
    a = server.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})["session_id"]
    b = server.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})["session_id"]
    b_initial = adapter(server.ok("/v1/weights/save", {"session_id": b, "name": "indep_b0"})["adapter_path"])
    base = server.ok(
        "/v1/sample", {"tokens": PROMPT + [1, 2], "max_tokens": 1, "prompt_logprobs": True, "base_model": True}
    )

    # interleave: gradients of A accumulate while B is used, and B's step never sees them
    server.ok("/v1/train/forward_backward", {"session_id": a, "datums": BATCH})
    server.ok("/v1/train/forward_backward", {"session_id": b, "datums": BATCH[:1]})
    server.ok("/v1/train/optim_step", {"session_id": a, "learning_rate": 5e-2})
    assert server.ok("/v1/train/optim_step", {"session_id": b, "learning_rate": 5e-2})["step"] == 1
    assert step(server, a)["step"] == 2

    a_saved = adapter(server.ok("/v1/weights/save", {"session_id": a, "name": "indep_a"})["adapter_path"])
    b_saved = adapter(server.ok("/v1/weights/save", {"session_id": b, "name": "indep_b1"})["adapter_path"])
    assert any(not (a_saved[n] == b_saved[n]).all() for n in a_saved)
    assert any(not (b_saved[n] == b_initial[n]).all() for n in b_saved)
    assert continuation_logprobs(server, a) != continuation_logprobs(server, b)

    # the base model (adapter off) is unchanged by either session's training
    again = server.ok(
        "/v1/sample", {"tokens": PROMPT + [1, 2], "max_tokens": 1, "prompt_logprobs": True, "use_adapter": False}
    )
    assert again["prompt_logprobs"] == base["prompt_logprobs"]


def test_sample_without_session_id_is_ambiguous_with_several_sessions(server) -> None:
    server.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})
    server.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})
    r = server.post("/v1/sample", {"tokens": PROMPT, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    # the base model needs no session
    assert server.ok("/v1/sample", {"tokens": PROMPT, "max_tokens": 1, "base_model": True})["sequences"]


def test_chat_completions(server, session_id) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello, how are you?"}], "max_tokens": 6}
    out = server.ok("/v1/chat/completions", {**body, "session_id": session_id, "logprobs": True})
    assert out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) == out["usage"]["completion_tokens"]
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]


def test_chat_completions_stream(server, session_id) -> None:
    body = {
        "session_id": session_id,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 4,
        "stream": True,
    }
    with server.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" in chunks[-1]


def test_health_is_open_and_exact(server) -> None:
    r = httpx.get(f"{server.url}/v1/health")
    assert r.status_code == 200
    assert set(r.json()) == {"status", "gpu_count", "model", "step", "inference_backend", "version"}
    assert r.json()["inference_backend"] == "hf"
