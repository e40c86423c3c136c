"""Issue 31, finding 8: a store that cannot write (a full disk: SQLite's "database or disk is full") never fails
the user's request. Every route and mode still gets the upstream's reply; the loss is counted
(`rollout/capture_failures`) and logged loudly."""

from __future__ import annotations

import logging
import sqlite3

import anthropic
import openai

from metaclaw.modules.health import HealthMonitor
from tests.reliability.web_rig import proxy_rig


def test_a_full_disk_loses_turns_loudly_but_never_the_users_reply(tmp_path, monkeypatch, caplog):
    with proxy_rig(tmp_path) as rig:

        def disk_full(*args, **kwargs):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(rig.store, "write_batch", disk_full)  # the store boundary the writer commits through
        monkeypatch.setattr(rig.proxy.sessions.log, "touch", disk_full)
        caplog.set_level(logging.ERROR, logger="metaclaw.rollout.proxy")
        oa = openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0)
        history = [{"role": "user", "content": "hello"}]
        got = [oa.chat.completions.create(model="m", messages=history).choices[0].message.content]
        history += [{"role": "assistant", "content": got[0]}, {"role": "user", "content": "and?"}]  # a next state
        stream = oa.chat.completions.create(model="m", messages=history, stream=True,
                                            extra_headers={"X-Session-Done": "true"})  # fmt: skip
        got.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
        an = anthropic.Anthropic(base_url=rig.url, api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        got.append(an.messages.create(model="m", max_tokens=16, messages=msgs).content[0].text)
        with an.messages.stream(model="m", max_tokens=16, messages=msgs) as s:
            got.append(s.get_final_message().content[0].text)
        assert all(text.startswith("Reply number") for text in got), got
        assert rig.proxy.stats["capture_errors"] >= 4 and rig.proxy.stats["captured"] == 0
        health = HealthMonitor(str(rig.store.path))
        health.attach(proxy=rig.proxy)
        assert health.snapshot()["rollout/capture_failures"] >= 4
        assert "CAPTURE LOST" in caplog.text and "disk is full" in caplog.text
