"""End to end on CPU (issue 42): with `distill.enabled=true`, a correction that states a preference, sent through
the proxy by the real `openai` client, becomes rows for the trainer: the teacher's hinted replies and the corrected
reply itself, each naming the prompt the teacher read, and a step trains them toward the teacher's top-k tokens."""

from __future__ import annotations

import csv
import sqlite3
import time
from pathlib import Path

import openai

from metaclaw.rollout.server import free_port
from tests.e2e.live import train_driven
from tests.e2e.test_online_loop import compose_live

PREFERENCE = "No. Your name is Kuro, always introduce yourself as Kuro."


def own_rows(store_path: Path) -> int:
    """How many corrected replies the distiller has written so far (read-only, beside the trainer's writers)."""
    if not store_path.exists():
        return 0
    with sqlite3.connect(f"file:{store_path}?mode=ro", uri=True, timeout=30) as c:
        query = "SELECT COUNT(*) FROM samples WHERE json_extract(meta, '$.distilled.kind') = 'own'"
        return int(c.execute(query).fetchone()[0])


def driver(store_path: Path):
    """Sessions of two turns: a question, then a correction stating a preference with the next question. Each
    session waits for the previous one's corrected reply to reach the store, so a step (which claims the newest
    ready rows) meets one however slow the machine is."""

    def drive(c: openai.OpenAI) -> None:
        for cycle in range(40):
            deadline = time.monotonic() + 60
            while own_rows(store_path) < cycle and time.monotonic() < deadline:
                time.sleep(0.2)
            hdr = {"X-Session-Id": f"d{cycle}"}
            msgs = [{"role": "user", "content": f"Who are you? ({cycle})"}]
            for reply in [f"{PREFERENCE}\n\nWhat can you do?", "Thanks, perfect."]:
                r = c.chat.completions.create(model="metaclaw", messages=msgs, max_tokens=8, extra_headers=hdr)
                msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": reply}]  # fmt: skip

    return drive


def test_a_stated_correction_is_trained_toward_the_hinted_teachers_tokens(policy_server):
    server_url, run_dir = policy_server
    port = free_port()
    cfg = compose_live(
        run_dir, "rollout=proxy", "method=rl", f"serving.url={server_url}", f"rollout.proxy.port={port}",
        "trainer.max_steps=4", "data.batch_size=4", "rollout.min_batch_size=1", "rollout.scoring.session_idle_s=2",
        "rollout.wait_timeout_s=180", "publish.gate.enabled=false", "distill.enabled=true",
        "distill.distiller.samples=1", "distill.distiller.max_tokens=8", "distill.distiller.own_reply=true",
    )  # fmt: skip
    _, objects = train_driven(cfg, port, driver(Path(cfg.store_path)))
    rows = [s for s in objects["store"].select() if s.meta.distilled is not None]
    own = [s for s in rows if s.meta.distilled.get("kind") == "own"]
    assert own, "no corrected reply became a row"
    assert all(s.meta.distilled["teacher_prompt_ids"] for s in own)  # each names what its teacher read
    source = objects["store"].get(own[0].meta.distilled["from"])
    assert source.reward == -1.0 and own[0].response_ids == source.response_ids  # the correction stays a -1
    logged = [r for p in run_dir.rglob("metrics.csv") for r in csv.DictReader(p.open())]
    kls = [float(r["loss/distill_topk_kl"]) for r in logged if r.get("loss/distill_topk_kl")]
    assert kls and all(k >= 0 for k in kls), "no step trained a row toward the teacher's top-k"
