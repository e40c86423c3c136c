"""The engine in-process: base-model switching, adapter hot-swap through an inference engine, exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.serving.sampling import SamplingParams
from metaclaw.training_server.engine import TrainingEngine
from metaclaw.training_server.errors import ApiError
from metaclaw.training_server.schemas import ForwardBackwardRequest, OptimStepRequest
from metaclaw.training_server.settings import ServerSettings
from metaclaw.training_server.vllm_sampler import EngineSampler

from .helpers import BATCH, CONTINUATION, PROMPT

CONF = CONFIG_DIR


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TrainingEngine:
    monkeypatch.setenv("METACLAW_CHECKPOINT_DIR", str(tmp_path))
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("serve", overrides=["app=training_server", "model=tiny"])
    eng = TrainingEngine(ServerSettings.from_config(cfg))
    eng.load_base()
    return eng


def train_step(engine: TrainingEngine, session, lr: float = 5e-2) -> None:
    engine.forward_backward(session, ForwardBackwardRequest(session_id=session.session_id, datums=BATCH))
    engine.optim_step(session, OptimStepRequest(session_id=session.session_id, learning_rate=lr))


def test_unloadable_base_model_is_400_and_the_served_model_stays(engine: TrainingEngine) -> None:
    engine.settings.allowed_base_models = ("/nonexistent/model/dir",)  # allow-listed, but not loadable
    with pytest.raises(ApiError) as err:
        engine.create_session("/nonexistent/model/dir", 4)
    assert err.value.status == 400 and err.value.param == "base_model"
    session, trainable = engine.create_session("tiny", 4)
    assert session.base_model == "tiny" and "M /" in trainable


def test_rank_change_rebuilds_the_adapter_only_without_sessions(engine: TrainingEngine) -> None:
    engine.create_session("tiny", 4)
    with pytest.raises(ApiError, match="rank"):
        engine.create_session("tiny", 8)
    engine.sessions.clear()
    assert engine.create_session("tiny", 8)[0].rank == 8


def test_training_changes_lora_weights_only(engine: TrainingEngine) -> None:
    session, _ = engine.create_session("tiny", 4)
    frozen = {n: p.detach().clone() for n, p in engine.policy.named_parameters() if not p.requires_grad}
    lora = {n: t.clone() for n, t in session.weights.items()}
    train_step(engine, session)
    assert all(torch.equal(p, frozen[n]) for n, p in engine.policy.named_parameters() if not p.requires_grad)
    assert any(not torch.equal(t, lora[n]) for n, t in session.weights.items())


def test_hot_swap_through_an_inference_engine(engine: TrainingEngine, tmp_path: Path) -> None:
    """`backend=vllm`'s path, with the policy server's HF engine standing in for vLLM (same interface)."""
    hf = pytest.importorskip("metaclaw.serving.engines.hf")
    sampler = EngineSampler(lambda: hf.HFEngine.from_spec(engine.spec, "cpu"))
    session, _ = engine.create_session("tiny", 4)
    tokens = PROMPT + CONTINUATION
    params = SamplingParams(max_tokens=1, temperature=0)
    _, base = sampler.sample(session, tokens, params, prompt_logprobs=True)  # nothing published: the base
    train_step(engine, session)
    engine.save_weights(session, "hot_swap")
    sampler.publish(session)
    _, swapped = sampler.sample(session, tokens, SamplingParams(max_tokens=1, temperature=0), prompt_logprobs=True)
    _, own = engine.sample(session, tokens, SamplingParams(max_tokens=1, temperature=0), prompt_logprobs=True)
    assert swapped[0] is None and len(swapped) == len(tokens)
    assert swapped != base
    assert swapped[1:] == pytest.approx(own[1:], abs=1e-4)  # the inference engine serves the trained adapter
