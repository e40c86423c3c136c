"""The issue's command for each method: `python train.py model=tiny rollout=replay method=M trainer.max_steps=2 ...`
runs the whole live loop (own policy server, proxy, scorer, replay) and leaves the store and the adapters."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metaclaw.store import SampleStore
from tests.e2e.conftest import ENV, REPO
from tests.e2e.lifecycle import ONE_SERVER


# opd and combine are `slow` (`make test-slow`): the fast suite runs them in process (tests/entrypoints/test_train.py)
# and combine through the real proxy (tests/privacy/test_planted_key_e2e.py); rl runs the whole command here.
@pytest.mark.parametrize(
    "method", ["rl", pytest.param("opd", marks=pytest.mark.slow), pytest.param("combine", marks=pytest.mark.slow)]
)
def test_train_cli_live_loop_per_method(tmp_path, method):
    cmd = [sys.executable, "train.py", "model=tiny", "rollout=replay", f"method={method}", "trainer.max_steps=2",
           ONE_SERVER, f"hydra.run.dir={tmp_path}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for step in ("step-000001", "step-000002"):
        assert (tmp_path / "adapters" / step / "adapter_model.safetensors").exists()
    store = SampleStore(tmp_path / "samples.sqlite")
    consumed = store.select("consumed")
    assert consumed and len({s.id for s in consumed}) == len(consumed)
    if method in ("opd", "combine"):
        assert any(s.teacher_logprobs is not None for s in consumed)  # hint → teacher logprobs reached training
    if method in ("rl", "combine"):
        assert any(s.reward is not None for s in consumed)
    assert "Published adapter v2" in (tmp_path / "train.log").read_text()
