"""A fresh sample store per test, and a factory for valid samples."""

from __future__ import annotations

import pytest

from metaclaw.store import Sample, SampleStore


def make(n_resp: int = 3, **kw) -> Sample:
    """A valid sample with `n_resp` response tokens; `kw` overrides any field."""
    return Sample(
        prompt_ids=[1, 2, 3], response_ids=list(range(10, 10 + n_resp)), behaviour_logprobs=[-0.5] * n_resp, **kw
    )


@pytest.fixture
def store(tmp_path):
    s = SampleStore(tmp_path / "samples.sqlite")
    yield s
    s.close()
