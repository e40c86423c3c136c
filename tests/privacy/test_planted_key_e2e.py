"""A conversation holding a planted key, through the real proxy, into training (tiny model, method=combine,
skills on): the key never reaches the store (the SQLite file and its WAL), the judge, the teacher, a training
batch or the skill evolver. Judge, teacher and evolver are recording stand-ins on 127.0.0.1 (the teacher one
forwards to the policy server)."""

from __future__ import annotations

import json
import random
import threading

import openai
from hydra.utils import instantiate
from omegaconf import open_dict

from metaclaw.privacy.corpus import SECRET_VALUES
from metaclaw.rollout.server import ThreadedServer
from metaclaw.training import train
from tests.e2e.conftest import running_policy_server
from tests.e2e.test_online_loop import compose_live
from tests.e2e.test_skills_loop import scripted_evolver
from tests.privacy import recorders
from tests.procs import free_port, wait_for_health

RNG = random.Random(30)
OPENAI_KEY = SECRET_VALUES["openai_key"](RNG)
GITHUB_KEY = SECRET_VALUES["github_token"](RNG)
KEYS = (OPENAI_KEY, GITHUB_KEY)


def drive(base_url: str, errors: list) -> None:
    try:
        wait_for_health(base_url)
        c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(msgs, session, **extra):
            hdr = {"X-Session-Id": session, "X-Agent-Id": "priv", **extra}
            r = c.chat.completions.create(model="metaclaw", messages=msgs, max_tokens=6, extra_headers=hdr)
            return msgs + [{"role": "assistant", "content": r.choices[0].message.content or ""}]

        # the key in a tool output the agent shows the model, then one more turn of the same conversation
        msgs = ask([{"role": "user", "content": f"$ cat .env\nOPENAI_API_KEY={OPENAI_KEY}\nWhy does it fail?"}], "k")
        ask([*msgs, {"role": "user", "content": "Still failing."}], "k", **{"X-Session-Done": "true"})
        # a clean turn whose next state (the user's reply, read by the judge) holds a key
        msgs = ask([{"role": "user", "content": "What is 2+2?"}], "n")
        ask([*msgs, {"role": "user", "content": f"Wrong. Fetch it with token {GITHUB_KEY}"}], "n",
            **{"X-Session-Done": "true"})  # fmt: skip
        for cycle in range(30):  # clean sessions until training stops
            msgs = ask([{"role": "user", "content": f"What is the capital of France? ({cycle})"}], f"c{cycle}")
            ask([*msgs, {"role": "user", "content": "No, that's wrong."}], f"c{cycle}", **{"X-Session-Done": "true"})
    except openai.APIConnectionError:
        pass  # training finished and the proxy went away
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_planted_keys_never_reach_store_judge_teacher_batch_or_evolver(tmp_path):
    with running_policy_server(tmp_path) as (server_url, run_dir):
        _planted_keys(server_url, run_dir, tmp_path)


def _planted_keys(server_url, run_dir, tmp_path) -> None:
    judge, teacher, evolver = recorders.recording_judge(), recorders.recording_forwarder(server_url), scripted_evolver()
    recorders.BATCHES.clear()
    port = free_port()
    with ThreadedServer(judge) as j, ThreadedServer(teacher) as t, ThreadedServer(evolver) as e:
        cfg = compose_live(
            run_dir,
            "rollout=proxy",
            "method=combine",
            "judge=llm",
            f"judge.base_url={j.url}",
            "judge.votes=1",
            f"teacher.base_url={t.url}",
            f"serving.url={server_url}",
            f"rollout.proxy.port={port}",
            "trainer.max_steps=2",
            "data.batch_size=2",
            "rollout.min_batch_size=1",
            "rollout.scoring.session_idle_s=2",
            "rollout.scoring.poll_s=0.1",
            "rollout.wait_timeout_s=120",
            "skills.enabled=true",
            f"skills.library_root={tmp_path / 'skills'}",
            "skills.injector.max_chars=300",
            f"skills.evolver.base_url={e.url}/v1",
            "skills.evolver.model=scripted",
            "skills.evolve_every_n_turns=0",
        )
        with open_dict(cfg):
            cfg.callbacks = {"rec": {"_target_": "tests.privacy.recorders.BatchRecorder"}}
        errors: list = []
        driver = threading.Thread(target=drive, args=(f"http://127.0.0.1:{port}", errors), daemon=True)
        driver.start()
        metrics, objects = train(cfg)
        driver.join(timeout=60)
    assert not errors, errors
    assert metrics["train/global_step"] == 2 and recorders.BATCHES
    store = objects["store"]
    dropped = [s for s in store.select("dropped") if s.meta.get("dropped") == "secret"]
    assert {s.session_id for s in dropped} == {"k", "n"} and all(s.prompt_ids == [] for s in dropped)
    assert metrics["rollout/dropped_secret"] >= 3  # both turns of session k, the second of n
    [first_n] = [s for s in store.select(session_id="n") if s.turn_index == 0]
    assert "[REDACTED:" in first_n.text.next_state  # the judge reads no key
    # not dropped for the key (trainable), unless an evolved skill made its skill generation old meanwhile
    assert first_n.status != "dropped" or first_n.meta["dropped"].startswith("old_skill_generation"), first_n.meta
    tokenizer = instantiate(cfg.model).load_tokenizer()

    # the store: the database file and its WAL, byte for byte
    path = store.path
    data = path.read_bytes() + (
        path.with_name(path.name + "-wal").read_bytes() if path.with_name(path.name + "-wal").exists() else b""
    )
    judged = json.dumps(judge.state.requests)
    evolved = json.dumps(evolver.state.requests)
    taught = " ".join(
        tokenizer.decode(r["prompt"]) for r in teacher.state.requests if isinstance(r.get("prompt"), list)
    )
    trained = " ".join(tokenizer.decode([t for row in b["input_ids"] for t in row]) for b in recorders.BATCHES)
    assert judge.state.requests and teacher.state.requests and evolver.state.requests  # each was called
    for key in KEYS:
        for part in (key, key[8:28]):
            assert part.encode() not in data
            assert part not in judged and part not in evolved and part not in taught and part not in trained
