"""The official `tinker` SDK, unmodified, against `serve.py app=training_server`: a whole training cycle, numbers
equal to seed 000's API on the same batch, the distribution rule (ratio 1), and error paths that surface."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest
import tinker
import zstandard
from tinker import types as T
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response

from tests.tinker_api.conftest import TINKER_KEY
from tests.training_server.launch import Server

pytestmark = [pytest.mark.tinker, pytest.mark.usefixtures("fresh_sessions")]
WAIT = 120  # seconds: every future must resolve (or fail) well within this, never hang

TOKENS = [5, 17, 42, 99, 7, 250, 31, 8, 64]
PROMPT = 4  # the first PROMPT - 1 targets are the prompt's


def datum(loss_fn: str) -> tuple[T.Datum, dict]:
    """One datum in the SDK's types and the same one in seed 000's JSON."""
    n = len(TOKENS) - 1
    inputs, targets = TOKENS[:-1], TOKENS[1:]
    weights = [0.0] * (PROMPT - 1) + [1.0] * (n - PROMPT + 1)
    behaviour = [0.0] * (PROMPT - 1) + [-6.5, -6.0, -7.0, -6.2, -5.9, -6.4][: n - PROMPT + 1]
    adv = [0.0] * (PROMPT - 1) + [0.7] * (n - PROMPT + 1)
    if loss_fn == "cross_entropy":
        sdk = {"target_tokens": targets, "weights": weights}
        ours = {"logprobs": [0.0] * n, "advantages": [0.0] * n, "weights": weights}
    else:
        sdk = {"target_tokens": targets, "logprobs": behaviour, "advantages": adv}
        ours = {"logprobs": behaviour, "advantages": adv}
    sdk_datum = T.Datum(model_input=T.ModelInput.from_ints(inputs), loss_fn_inputs=sdk)
    return sdk_datum, {"model_input_tokens": inputs, "target_tokens": targets, **ours}


LOSSES = {
    "cross_entropy": None,
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5},
}
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def test_sdk_cycle_matches_seed_000_api(server: Server, service) -> None:
    # both APIs start from one checkpoint (shared by the operator's directory), so every number must agree
    sid = server.create(rank=4)
    server.ok("/v1/checkpoint/save", {"session_id": sid, "name": "start"})
    shared = server.checkpoint_dir / "checkpoints" / "shared" / "parity"
    shared.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(server.checkpoint_dir / "checkpoints" / sid / "start", shared)
    tc = service.create_training_client_from_state_with_optimizer("tinker://shared/weights/parity").result(WAIT)
    assert tc.get_info().lora_rank == 4

    futures = []
    for loss_fn, config in LOSSES.items():
        sdk_datum, ours = datum(loss_fn)
        futures.append(tc.forward_backward([sdk_datum], loss_fn, loss_fn_config=config))
        body = {"session_id": sid, "datums": [ours], "loss_fn": loss_fn, "loss_fn_config": config}
        if loss_fn == "cross_entropy":
            body["temperature"] = 1.0
        futures[-1] = (futures[-1], server.ok("/v1/train/forward_backward", body))
    optim = tc.optim_step(T.AdamParams(**ADAM))  # sent without waiting, as the SDK's users do
    for (fut, seed), loss_fn in zip(futures, LOSSES, strict=True):
        out = fut.result(WAIT)
        assert out.metrics["loss:sum"] == pytest.approx(seed["loss"], rel=1e-5, abs=1e-6), loss_fn
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(TOKENS) - 1
    ce = futures[0][0].result(WAIT)
    weights = datum("cross_entropy")[0].loss_fn_inputs["weights"].tolist()
    nll = -sum(w * lp for w, lp in zip(weights, ce.loss_fn_outputs[0]["logprobs"].tolist(), strict=True))
    assert ce.metrics["loss:sum"] == pytest.approx(nll, rel=1e-5)  # Tinker's cross_entropy: -Σ w·logp

    step = optim.result(WAIT).metrics
    seed_step = server.ok("/v1/train/optim_step", {"session_id": sid, **ADAM})
    assert step["grad_norm"] == pytest.approx(seed_step["grad_norm"], rel=1e-5)
    sdk_datum, ours = datum("importance_sampling")
    after = tc.forward([sdk_datum], "importance_sampling").result(WAIT)
    seed_after = server.ok("/v1/train/forward_backward", {"session_id": sid, "datums": [ours]})
    assert after.metrics["loss:sum"] == pytest.approx(seed_after["loss"], rel=1e-5, abs=1e-6)
    assert after.metrics["loss:sum"] != pytest.approx(futures[1][1]["loss"], rel=1e-3)  # the step moved it

    # sampler weights → sample at T=0.7 → train on the samples: the importance ratio is exactly 1
    path = tc.save_weights_for_sampler("s1").result(WAIT).path
    assert path.startswith("tinker://") and "/sampler_weights/s1" in path
    sampler = tc.create_sampling_client(path).result(WAIT)
    prompt = TOKENS[:PROMPT]
    params = T.SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=3)
    res = sampler.sample(T.ModelInput.from_ints(prompt), 2, params, include_prompt_logprobs=True).result(WAIT)
    assert len(res.sequences) == 2 and res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == PROMPT
    rl = []
    for seq in res.sequences:
        full = prompt + list(seq.tokens)
        n = len(full) - 1
        ob = PROMPT - 1
        inputs = {"target_tokens": full[1:], "logprobs": [0.0] * ob + list(seq.logprobs),
                  "advantages": [0.0] * ob + [1.0] * (n - ob)}  # fmt: skip
        rl.append(T.Datum(model_input=T.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs))
    out = tc.forward(rl, "importance_sampling").result(WAIT)
    for seq, lp in zip(res.sequences, out.loss_fn_outputs, strict=True):
        assert lp["logprobs"].tolist()[PROMPT - 1 :] == pytest.approx(list(seq.logprobs), abs=1e-4)
    assert out.metrics["ratio_max:max"] == pytest.approx(1.0, abs=1e-4)

    # save_state → a step → load_state → the same numbers as right after the save, and training goes on
    state = tc.save_state("mid").result(WAIT).path
    before = tc.forward([sdk_datum], "importance_sampling").result(WAIT).metrics["loss:sum"]
    ce_datum = datum("cross_entropy")[0]
    before_ce = tc.forward([ce_datum], "cross_entropy").result(WAIT).metrics["loss:sum"]
    tc.forward_backward([sdk_datum], "importance_sampling")
    tc.optim_step(T.AdamParams(**ADAM)).result(WAIT)
    moved = tc.forward([sdk_datum], "importance_sampling").result(WAIT).metrics["loss:sum"]
    assert moved != pytest.approx(before, rel=1e-4)
    tc.load_state_with_optimizer(state).result(WAIT)
    restored = tc.forward([sdk_datum], "importance_sampling").result(WAIT).metrics["loss:sum"]
    assert restored == pytest.approx(before, rel=1e-6)
    tc.forward_backward([sdk_datum], "ppo")
    assert tc.optim_step(T.AdamParams(**ADAM)).result(WAIT).metrics["step"] >= 1
    # weights only, into a new model (cross_entropy: T=1 on both, whatever the first model sampled at)
    resumed = service.create_training_client_from_state(state).result(WAIT)
    assert resumed.forward([ce_datum], "cross_entropy").result(WAIT).metrics["loss:sum"] == pytest.approx(
        before_ce, rel=1e-6
    )
    resumed.forward_backward([ce_datum], "cross_entropy")
    resumed.optim_step(T.AdamParams(**ADAM)).result(WAIT)
    resumed.load_state(state).result(WAIT)  # the same client's other model's checkpoint: allowed
    assert resumed.forward([ce_datum], "cross_entropy").result(WAIT).metrics["loss:sum"] == pytest.approx(
        before_ce, rel=1e-6
    )


def test_default_lora_flags_train_attention_mlp_and_unembedding(server: Server, service) -> None:
    tc = service.create_lora_training_client(base_model="tiny", rank=2).result(WAIT)
    sdk_datum, _ = datum("cross_entropy")
    first = tc.forward_backward([sdk_datum], "cross_entropy").result(WAIT).metrics["loss:sum"]
    tc.optim_step(T.AdamParams(learning_rate=2e-3)).result(WAIT)
    assert tc.forward([sdk_datum], "cross_entropy").result(WAIT).metrics["loss:sum"] < first
    adapters = server.checkpoint_dir / "adapters"
    tc.save_weights_for_sampler("flags").result(WAIT)
    config = next(adapters.glob("*/flags/adapter_config.json")).read_text()
    assert "lm_head" in config and "q_proj" in config and "down_proj" in config


def test_sdk_errors_surface_instead_of_hanging(server: Server, service) -> None:
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong-key").create_lora_training_client(
            base_model="tiny", rank=2
        ).result(WAIT)
    tc = service.create_lora_training_client(base_model="tiny", rank=2, train_unembed=False).result(WAIT)
    sdk_datum, _ = datum("importance_sampling")
    with pytest.raises(tinker.BadRequestError, match="unknown loss_fn 'dro'"):
        tc.forward_backward([sdk_datum], "dro").result(WAIT)
    with pytest.raises(tinker.BadRequestError, match="clip_low_threshold"):
        tc.forward_backward([sdk_datum], "ppo", loss_fn_config={"clip_low_threshold": 5.0}).result(WAIT)
    bad = T.Datum(model_input=T.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 999999],
                  "weights": [1.0, 1.0]})  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary") as info:
        tc.forward_backward([bad], "cross_entropy").result(WAIT)
    assert info.value.category == T.RequestErrorCategory.User
    with pytest.raises(tinker.NotFoundError):
        tc.create_sampling_client("tinker://deadbeef/sampler_weights/nope").result(WAIT)
    # a model whose engine session is gone (deleted through seed 000's API) is an unknown model id
    sid = next(iter(server.client.get("/v1/lora/sessions").json()["sessions"][-1:]))["session_id"]
    assert server.client.delete(f"/v1/lora/{sid}").status_code == 200
    with pytest.raises(tinker.NotFoundError, match="unknown model_id"):
        tc.forward_backward([sdk_datum], "importance_sampling").result(WAIT)
    # raw wire checks: unknown future, malformed protobuf, missing key; the server stays up
    headers = {"X-API-Key": TINKER_KEY}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as raw:
        assert raw.post("/api/v1/retrieve_future", json={"request_id": "nope"}).status_code == 404
        r = raw.post("/api/v1/forward_backward", content=b"\xff\x00garbage",
                     headers={"content-type": "application/x-protobuf"})  # fmt: skip
        assert r.status_code == 400 and "protobuf" in r.text
        assert raw.post("/api/v1/create_model", json={"session_id": "x"}).status_code in (400, 404)
        assert raw.post("/api/v1/copy_weights", json={}).status_code == 404
        assert httpx.post(f"{server.url}/api/v1/client/config", json={}).status_code == 401
    assert server.client.get("/v1/health").status_code == 200


def test_zstd_protobuf_body_and_raw_futures(server: Server, service) -> None:
    """The wire as the SDK speaks it with `proto_compress_fwdbwd`: a zstd body, then a protobuf result."""
    tc = service.create_lora_training_client(base_model="tiny", rank=2, train_unembed=False).result(WAIT)
    sdk_datum, _ = datum("cross_entropy")
    fb_input = T.ForwardBackwardInput(data=[sdk_datum], loss_fn="cross_entropy")
    msg = forward_backward_request_to_proto(T.ForwardBackwardRequest(fb_input, model_id=tc.model_id, seq_id=1))
    headers = {"X-API-Key": TINKER_KEY}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as raw:
        r = raw.post("/api/v1/forward_backward", content=zstandard.ZstdCompressor().compress(msg.SerializeToString()),
                     headers={"content-type": "application/x-protobuf", "content-encoding": "zstd"})  # fmt: skip
        assert r.status_code == 200, r.text
        request_id = r.json()["request_id"]
        again = raw.post("/api/v1/forward_backward", content=msg.SerializeToString(),
                         headers={"content-type": "application/x-protobuf"})  # fmt: skip
        assert again.json()["request_id"] == request_id  # the same seq_id resent: the same future
        for _ in range(WAIT // 5):  # each poll is held up to app.tinker.poll_wait_s (5 s here), then 408 try_again
            got = raw.post("/api/v1/retrieve_future", json={"request_id": request_id},
                           headers={"accept": "application/x-protobuf"})  # fmt: skip
            if got.status_code != 408:
                break
            assert got.json()["type"] == "try_again"
        assert got.headers["content-type"] == "application/x-protobuf", got.text
        out = deserialize_proto_response(got.content, T.ForwardBackwardOutput)
        assert out.metrics["loss:sum"] > 0 and len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(TOKENS) - 1
        bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 * 1024 * 1024 + 1))  # app.max_body_bytes + 1, decoded
        r = raw.post("/api/v1/forward_backward", content=bomb, headers={"content-encoding": "zstd"})
        assert r.status_code == 413, r.text


def test_heartbeats_keep_a_clients_models_and_close_frees_them(server: Server) -> None:
    client = tinker.ServiceClient(base_url=server.url, api_key=TINKER_KEY)
    client.create_lora_training_client(base_model="tiny", rank=2).result(WAIT)
    (live,) = server.client.get("/v1/lora/sessions").json()["sessions"]
    session_id = client.holder.get_session_id()
    with httpx.Client(base_url=server.url, headers={"X-API-Key": TINKER_KEY}, timeout=30) as raw:
        time.sleep(1.0)
        assert raw.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
    (after,) = server.client.get("/v1/lora/sessions").json()["sessions"]
    assert after["session_id"] == live["session_id"] and after["idle_s"] < 0.9  # the heartbeat touched it
    client.close("success").result(WAIT)
    assert server.sessions() == []  # the model's session is freed; its saved files would stay
