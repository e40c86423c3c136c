"""Skills in the live loop on CPU: a real `serve.py model=tiny`, the proxy and scorer started by `live_loop` from
the composed config, the real `openai` client, and a scripted OpenAI-compatible endpoint as the skill evolver.

What the policy server received is read back from the sample: `prompt_ids` are the server's own
`prompt_token_ids`, decoded with the tiny model's tokenizer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from hydra.utils import instantiate

from metaclaw.loop.live import Live, live_loop
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.skills import SkillLibrary
from metaclaw.store import Sample, SampleStore
from tests.e2e.conftest import running_policy_server
from tests.e2e.test_online_loop import compose_live

NEW_SKILL = "unit-conversion-check"
PROPOSAL = {
    "skills": [
        {
            "action": "add",
            "name": NEW_SKILL,
            "description": "When converting units such as miles to kilometers, state the conversion factor and "
            "double-check the arithmetic.",
            "category": "reasoning",
            "body": "- Write the factor: 1 mile = 1.609 km.\n- Recompute the product before answering.",
        }
    ]
}
NOT_JSON_MARKER = "MALFORMED-REPLY"


def scripted_evolver() -> FastAPI:
    """`/v1/chat/completions` answering the canned proposal, or prose when the failed turns hold the marker."""
    app = FastAPI()
    app.state.requests = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        app.state.requests.append(body)
        prompt = body["messages"][-1]["content"]
        reply = "I would add a skill about reports." if NOT_JSON_MARKER in prompt else json.dumps(PROPOSAL)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}

    return app


@dataclass
class SkillsLoop:
    live: Live
    store: SampleStore
    tokenizer: Any
    root: Path
    evolver_requests: list[dict[str, Any]]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.live.proxy_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(self, messages: list[dict[str, Any]], **headers: str) -> str:
        hdr = {k.replace("_", "-"): v for k, v in headers.items()}
        r = self.client().chat.completions.create(model="metaclaw", messages=messages, max_tokens=6, extra_headers=hdr)
        return r.choices[0].message.content or ""

    def samples(self, agent_id: str, session_id: str) -> list[Sample]:
        return sorted(self.store.select(agent_id=agent_id, session_id=session_id), key=lambda s: s.turn_index)

    def prompt_text(self, sample: Sample) -> str:
        return self.tokenizer.decode(sample.prompt_ids)


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def loop(tmp_path_factory) -> Iterator[SkillsLoop]:
    tmp = tmp_path_factory.mktemp("skills-loop")
    root = tmp / "skills"
    evolver_app = scripted_evolver()
    with running_policy_server(tmp) as (server_url, run_dir), ThreadedServer(evolver_app) as evolver:
        cfg = compose_live(
            run_dir,
            "rollout=proxy",
            "method=rl",
            f"serving.url={server_url}",
            "rollout.proxy.port=0",
            "rollout.scoring.poll_s=0.1",
            "rollout.scoring.session_idle_s=600",  # sessions here end by X-Session-Done
            "skills.enabled=true",
            f"skills.library_root={root}",
            "skills.injector.top_k=2",
            "skills.injector.max_chars=500",  # the tiny model's context is 1024 tokens
            f"skills.evolver.base_url={evolver.url}/v1",
            "skills.evolver.model=scripted",
            "skills.evolver.approval=auto_safe",  # the owner's choice: evolved skills served at once
            "skills.evolve_every_n_turns=0",
        )
        store = SampleStore(cfg.store_path)
        tokenizer = instantiate(cfg.model).load_tokenizer()
        with live_loop(cfg, store, tokenizer) as live:
            yield SkillsLoop(live, store, tokenizer, root, evolver_app.state.requests)


def test_injected_skills_reach_the_policy_server_and_the_sample(loop):
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Please run the tests to verify the fix before you say the task is done."},
    ]
    loop.ask(messages, X_Agent_Id="ada", X_Session_Id="a1")
    [sample] = loop.samples("ada", "a1")
    prompt = loop.prompt_text(sample)  # the prompt exactly as the policy server tokenised it
    assert "## Active skills" in prompt and prompt.index("You are a coding agent.") < prompt.index("## Active skills")
    assert "verify-before-claiming-done" in sample.meta["skills"]
    assert all(f"### {name}" in prompt for name in sample.meta["skills"])
    assert sample.meta["skill_generation"] == 0
    assert "## Active skills" in sample.text.messages[0]["content"]  # the stored messages are the ones sent upstream
    loop.ask([{"role": "user", "content": "write a haiku"}], X_Agent_Id="ada", X_Turn_Type="side")
    assert len(loop.store.select(agent_id="ada")) == 1  # side turns: forwarded, neither injected nor stored


def test_failed_session_evolves_a_skill_that_later_turns_of_that_agent_only_get(loop):
    question = [{"role": "user", "content": "How many kilometers are 26.2 miles?"}]
    answer = loop.ask(question, X_Agent_Id="bea", X_Session_Id="b1")
    correction = "No, that's wrong: 26.2 miles is 42.2 km."
    followup = [*question, {"role": "assistant", "content": answer}, {"role": "user", "content": correction}]
    loop.ask(followup, X_Agent_Id="bea", X_Session_Id="b1", X_Session_Done="true")

    library = SkillLibrary(loop.root, "bea", seed_bank=False)
    # the skill directory lands first, then its history entry: wait for the entry (it names the generation)
    wait_until(lambda: any(e["accepted"] for e in library.history()), "the evolver to write and log the new skill")
    assert (loop.root / "bea" / NEW_SKILL / "SKILL.md").is_file()
    first, last = loop.samples("bea", "b1")
    assert first.meta["judge"]["rule"] in ("negative", "objection")  # the correction: -1
    assert first.reward == -1.0 and "at_least_one" not in first.meta  # a correction is never lifted
    assert (last.status, last.meta["dropped"]) == ("dropped", "no_next_state")  # nothing reacted to it
    assert first.meta["skill_generation"] == last.meta["skill_generation"] == 0
    [entry] = [e for e in library.history() if e["accepted"]]
    assert entry["name"] == NEW_SKILL and entry["action"] == "add" and first.id in entry["source_sample_ids"]
    assert library.generation == entry["generation"] == 1
    [request] = [r for r in loop.evolver_requests if f"### sample {first.id} " in r["messages"][-1]["content"]]
    assert correction in request["messages"][-1]["content"]  # the evolver sees what the user said next

    convert = [{"role": "user", "content": "Convert 10 miles to kilometers please."}]
    loop.ask(convert, X_Agent_Id="bea", X_Session_Id="b2")
    [after] = loop.samples("bea", "b2")
    assert after.meta["skill_generation"] == 1 and NEW_SKILL in after.meta["skills"]
    assert f"### {NEW_SKILL}" in loop.prompt_text(after)

    loop.ask(convert, X_Agent_Id="cy", X_Session_Id="c1")  # same query, another agent
    [other] = loop.samples("cy", "c1")
    assert NEW_SKILL not in other.meta["skills"] and NEW_SKILL not in loop.prompt_text(other)
    assert other.meta["skill_generation"] == 0 and not (loop.root / "cy" / NEW_SKILL).exists()


def test_malformed_skill_file_is_skipped_with_a_warning(loop, caplog):
    caplog.set_level(logging.WARNING)
    bad = loop.root / "dee" / "broken-skill" / "SKILL.md"
    bad.parent.mkdir(parents=True)
    bad.write_text("no front matter, just text\n")
    messages = [{"role": "user", "content": "Please run the tests to verify the fix before you say the task is done."}]
    loop.ask(messages, X_Agent_Id="dee", X_Session_Id="d1")
    assert any(str(bad) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    [sample] = loop.samples("dee", "d1")
    assert "verify-before-claiming-done" in sample.meta["skills"]  # the other skills still apply
    with pytest.raises(openai.BadRequestError, match="X-Agent-Id"):  # not a valid id: refused (docs/agents.md)
        loop.ask(messages, X_Agent_Id="../not-an-agent", X_Session_Id="d2")
    assert not loop.store.select(agent_id="../not-an-agent")


def test_evolver_reply_that_is_not_json_is_refused_and_logged(loop):
    question = [{"role": "user", "content": f"Summarise the quarterly report. {NOT_JSON_MARKER}"}]
    answer = loop.ask(question, X_Agent_Id="eve", X_Session_Id="e1")
    followup = [*question, {"role": "assistant", "content": answer}, {"role": "user", "content": "That is wrong."}]
    loop.ask(followup, X_Agent_Id="eve", X_Session_Id="e1", X_Session_Done="true")
    library = SkillLibrary(loop.root, "eve", seed_bank=False)
    wait_until(lambda: bool(library.history()), "the evolution history of agent eve")
    [entry] = library.history()
    assert entry["action"] == "parse" and entry["accepted"] is False and entry["source_sample_ids"]
    assert library.generation == 0
    assert loop.ask(question, X_Agent_Id="eve", X_Session_Id="e2") is not None  # the proxy keeps serving


def test_skills_only_mode_injects_into_any_upstream(tmp_path):
    with ThreadedServer(scripted_upstream()) as upstream:
        cfg = compose_live(
            tmp_path / "run",
            "mode=skills_only",
            "rollout=proxy",
            f"serving.url={upstream.url}",
            "rollout.proxy.port=0",
            f"skills.library_root={tmp_path / 'skills'}",
        )
        store = SampleStore(cfg.store_path)
        with live_loop(cfg, store, tokenizer=None) as live:
            client = openai.OpenAI(base_url=f"{live.proxy_url}/v1", api_key="unused", max_retries=0)
            text = "Please run the tests to verify the fix before you say the task is done."
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}])
            assert live.worker is None  # nothing is scored, so nothing evolves
        sent = upstream.server.config.app.state.scripted["requests"][-1]["messages"]
        assert sent[0]["role"] == "system" and "### verify-before-claiming-done" in sent[0]["content"]
        assert store.count() == 0
