"""Issue 10.2/10.3: the teacher is scored under the student's distribution and prompt rendering.

A real policy server (`serve.py model=tiny`), the real rollout proxy in front of it and the `openai` SDK: the
captured sample is scored by the teacher (= the same base model) with an empty hint, so the OPD advantage
`teacher - behaviour` must be 0 on every token.
"""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import openai
import pytest

from metaclaw.advantages.opd import OPDAdvantage
from metaclaw.datamodules.rollout import collate_samples
from metaclaw.distribution import sample_distribution
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.scoring.teacher import TeacherClient, hinted_prompt_ids
from metaclaw.serving.completions import render_prompt
from metaclaw.serving.protocol import parse_chat_request
from metaclaw.store import Sample, SampleStore, SampleText
from tests.serving.conftest import running_server

# Reacts to a template kwarg the way Qwen3's reacts to enable_thinking=false (an empty think block).
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    with running_server(tmp_path_factory.mktemp("serve-run"), root) as live:
        yield live


def _capture(server, tmp_path, **sampling) -> Sample:
    """One main turn through the proxy to the policy server; the stored sample."""
    store = SampleStore(tmp_path / "samples.sqlite")
    proxy = RolloutProxy(store, server.url, upstream_api_key=server.api_key, policy_model=None, base_model="tiny")
    with ThreadedServer(create_app(proxy)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        top_k = sampling.pop("top_k", None)
        extra = {"chat_template_kwargs": {"enable_thinking": False}, **({"top_k": top_k} if top_k else {})}
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            extra_body=extra,
            **sampling,
        )
    (sample,) = store.select("pending")
    store.close()
    return sample


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.6}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8, "top_k": 20}],
    ids=["T0.6", "T1", "T0.7-p0.8-k20"],
)
def test_teacher_equal_to_student_with_no_hint_gives_zero_advantage(policy_server, tmp_path, tiny_tokenizer, sampling):
    sample = _capture(policy_server, tmp_path, **copy.deepcopy(sampling))
    assert sample.meta["sampling"] == {
        "temperature": sampling["temperature"], "top_p": sampling.get("top_p", 1.0), "top_k": sampling.get("top_k", -1)
    }  # fmt: skip
    assert sample.meta["chat_template_kwargs"] == {"enable_thinking": False}
    prompt = hinted_prompt_ids(tiny_tokenizer, sample, "")
    assert prompt == sample.prompt_ids
    teacher = TeacherClient(policy_server.url, "tiny", policy_server.api_key)
    dist = sample_distribution(sample.temperature, sample.meta)
    sample.teacher_logprobs = asyncio.run(teacher.logprobs(prompt, sample.response_ids, **dist))
    sample.id = 1
    batch = collate_samples([sample], tiny_tokenizer.pad_token_id)
    advantages, _ = OPDAdvantage()(batch)
    gap = advantages[batch["mask"].bool()]
    assert gap.numel() == len(sample.response_ids)
    assert gap.abs().max().item() <= 1e-4, gap


def test_teacher_prompt_is_rendered_with_the_requests_template_kwargs(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = THINK_TEMPLATE
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    served = render_prompt(SimpleNamespace(tokenizer=tok, max_seq_len=4096), parse_chat_request(body, 16))
    meta = {"chat_template_kwargs": {"enable_thinking": False}}
    sample = Sample(served, [5], [-1.0], text=SampleText(messages=body["messages"]), meta=meta)
    assert hinted_prompt_ids(tok, sample, "") == served
    assert "<think>" in tok.decode(served)
    hinted = tok.decode(hinted_prompt_ids(tok, sample, "say Paris"))
    assert "[Hint from hindsight: say Paris]" in hinted and hinted.endswith("<think>\n\n</think>\n\n")
    plain = Sample(
        served, [5], [-1.0], text=SampleText(messages=body["messages"])
    )  # what main did: the kwargs were lost
    assert hinted_prompt_ids(tok, plain, "") != served


def test_a_raw_only_teacher_server_is_refused_loudly(tiny_tokenizer):
    from metaclaw.rollout.testing import scripted_upstream

    with ThreadedServer(scripted_upstream()) as upstream:
        teacher = TeacherClient(upstream.url, "tiny")
        assert len(asyncio.run(teacher.logprobs([1, 2], [3, 4]))) == 2  # raw distribution: fine
        with pytest.raises(ValueError, match="raw prompt logprobs only"):
            asyncio.run(teacher.logprobs([1, 2], [3, 4], temperature=0.6))


def test_teacher_logprobs_ask_for_no_generation(tiny_tokenizer):
    """Issue 24: a score is echo without generation (`max_tokens: 0`, which vLLM and OpenAI accept): before, each
    request also sampled one token, a second forward over the same prompt on the HF engine."""
    from metaclaw.rollout.testing import scripted_upstream
    from metaclaw.wire.client import Endpoint, teacher_logprobs

    app = scripted_upstream()
    with ThreadedServer(app) as upstream:
        assert teacher_logprobs(Endpoint(upstream.url), "tiny", [1, 2], [3, 4]) == [-0.5, -0.5]
    (body,) = app.state.scripted["completions"]
    assert body["max_tokens"] == 0 and body["echo"] is True and body["prompt"] == [1, 2, 3, 4]
