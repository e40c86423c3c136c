"""The dashboard in a real browser (headless Chromium over the DevTools protocol): a finished run's page, and the
page of a live tiny-model service (`train.py rollout=proxy mode=auto`, the gate on as by default): the curve gains
a point after a published adapter, a rollback click changes the adapter the policy server serves, a thumbs-down
reaches the store, no console errors; the key is needed by every data route and action, never read from a URL,
and a GET changes nothing.

Chromium is Debian's `chromium` (.ci/run installs it): absent outside CI the tests are skipped with a loud
reason; in CI (CI=true) its absence fails them."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import openai
from omegaconf import OmegaConf

from tests.control.test_service import KEY, start, stop, wait_for
from tests.dashboard.cdp import Browser
from tests.procs import free_port

SERVER_KEY = "policy-server-test-key"


def open_page(b: Browser, base: str, key: str) -> None:
    b.goto(f"{base}/dashboard")
    b.wait_for("!document.getElementById('key-form').hidden")  # no key yet: the page asks for it
    b.js(f"document.getElementById('key').value = {json.dumps(key)}; "
         "document.getElementById('key-form').requestSubmit(); true")  # fmt: skip
    b.wait_for("!document.getElementById('main').hidden")
    assert b.js("location.href").endswith("/dashboard")  # the key never went into the URL
    assert b.js(f"sessionStorage.getItem('metaclaw-dashboard-key') === {json.dumps(key)}")


def test_a_finished_runs_dashboard_in_the_browser(browser, read_only_dashboard, tmp_path):
    base, key, _ = read_only_dashboard
    open_page(browser, base, key)
    assert browser.wait_for("document.querySelectorAll('#curves circle.point').length") == 3
    assert browser.js("document.querySelectorAll('#curves line.ci').length") == 3  # an interval per point
    assert browser.js("document.getElementById('mode').textContent") == "finished run"
    assert browser.js("document.getElementById('actions').hidden")  # read-only: no buttons
    assert browser.js("document.querySelectorAll('#gate tr').length") == 4  # header + 3 decisions
    curves = browser.js("Array.from(document.querySelectorAll('#series svg')).map(s => s.id)")
    assert curves == [f"series-{n}" for n in ("loss", "reward", "samples_per_min", "replies_per_min", "sample_age_s",
                                              "trainer_lag", "lr", "grad_norm", "reward_positive",
                                              "reward_negative")]  # fmt: skip
    assert browser.js("document.querySelectorAll('#series-loss line.gate-mark').length") == 3  # the gate beside them
    assert browser.js("document.querySelectorAll('#series-loss polyline.line').length") == 1
    assert "privacy.show_text is off" in browser.js("document.getElementById('sessions').textContent")
    browser.screenshot(tmp_path / "finished.png")
    assert browser.console_errors() == []


def test_a_finished_runs_dashboard_opens_without_a_key(browser, keyless_dashboard):
    base, _, _ = keyless_dashboard
    browser.goto(f"{base}/dashboard")
    browser.wait_for("!document.getElementById('main').hidden")  # no key asked for: loopback, read-only
    assert browser.js("document.getElementById('key-form').hidden")
    assert browser.wait_for("document.querySelectorAll('#series svg').length") == 10
    assert browser.console_errors() == []


def cards(url: str) -> dict:
    return httpx.get(f"{url}/control/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()


def policy_server(run_dir: Path) -> str:
    """The policy server train.py started (its port is in the config it wrote for it)."""
    return f"http://127.0.0.1:{OmegaConf.load(run_dir / 'server' / 'serve_config.yaml').serve.port}"


def served_root(run_dir: Path) -> str | None:
    """What the policy server itself serves the agent (`policy`): the adapter's path, None for the base model."""
    cards = httpx.get(f"{policy_server(run_dir)}/v1/models", headers={"Authorization": f"Bearer {SERVER_KEY}"},
                      timeout=30).json()["data"]  # fmt: skip
    return next((c["root"] for c in cards if c["id"] == "policy"), None)


class User:
    """A person talking to their agent through the proxy: three-turn sessions, each reply thanked (the closing
    turn gets no reaction: never trained, rollout.scoring.no_next_state=drop)."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        self.sessions = 0

    def session(self) -> None:
        sid, i = f"b{self.sessions}", self.sessions
        self.sessions += 1
        messages = [{"role": "user", "content": f"What is 2+{i}?"}]
        for reaction in ("Thanks, that is perfect.", "Great, exactly what I needed.", None):
            headers = {"X-Session-Id": sid, **({} if reaction else {"X-Session-Done": "true"})}
            reply = self.client.chat.completions.create(model="metaclaw", max_tokens=4, messages=messages,
                                                        extra_headers=headers)  # fmt: skip
            if reaction:
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or "?"},
                             {"role": "user", "content": reaction}]  # fmt: skip

    def talk_until(self, condition, timeout_s: float = 240.0, pause_s: float = 1.0):
        """Sessions one after another, as a user keeps working (a pause between them), until `condition()`."""
        deadline = time.monotonic() + timeout_s
        while not (value := condition()):
            assert time.monotonic() < deadline, f"timed out after {self.sessions} sessions"
            self.session()
            time.sleep(pause_s)
        return value


# every data route and every action of the page: the key is needed, never taken from a URL, nothing on a GET
ROUTES = [("GET", "/dashboard/api/state"), ("GET", "/control/status"), ("POST", "/control/pause"),
          ("POST", "/control/resume"), ("POST", "/control/train-now"), ("POST", "/control/rollback"),
          ("POST", "/v1/feedback")]  # fmt: skip


def test_a_live_service_seen_and_steered_from_the_browser(browser, tmp_path):
    """`rollout=proxy` with its gate and held-out split as a user gets them (20% of sessions held out, 8 judged
    held-out turns before anything is served, every 4th candidate measured): the user talks until the gate serves
    an adapter; the curve gains the base model's point (the version that adapter replaced) without more talk."""
    run_dir, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(run_dir, port, f"serve.api_key={SERVER_KEY}", "publish.gate.rollback.every_s=2",
                 "trainer.max_steps=1000")  # fmt: skip  # a service: it trains as long as the user talks
    user = User(url)
    try:
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
        open_page(browser, url, KEY)
        assert browser.js("document.getElementById('mode').textContent") == "live"
        assert browser.js("document.querySelectorAll('#curves circle.point').length") == 0
        browser.js("document.getElementById('train-now').click(); true")
        wait_for(lambda: cards(url)["window"]["open"], timeout=60)
        user.talk_until(lambda: served_root(run_dir))  # an adapter passed the gate
        assert "accepted" in [r["decision"] for r in cards(url)["gate"] if r.get("kind") == "gate"]
        browser.wait_for("document.querySelectorAll('#curves circle.point').length >= 1", timeout_s=90)
        for curve in ("loss", "lr", "grad_norm", "samples_per_min"):  # the trainer's curves, live from metrics.csv
            browser.wait_for(f"document.querySelectorAll('#series-{curve} polyline.line').length === 1", timeout_s=60)
        steps = "Array.from(document.querySelectorAll('button.rollback')).map(b => b.dataset.step)"
        rows = browser.wait_for(f"{steps}.length >= 2 && {steps}", timeout_s=60)
        served = served_root(run_dir)
        # the newest other adapter on disk (the oldest may be pruned by publish.keep_last while the click is on its way)
        target = max((s for s in rows if not served.endswith(f"step-{int(s):06d}")), key=int)
        browser.js(f"document.querySelector('button.rollback[data-step=\"{target}\"]').click(); true")
        wait_for(lambda: served_root(run_dir).endswith(f"step-{int(target):06d}"), timeout=120)  # the server's own
        browser.wait_for(f"document.getElementById('served-default').textContent === 'step-{int(target):06d}'")
        chip = browser.js("(() => { const c = document.querySelector('.turn'); "
                          "return [c.dataset.session, Number(c.dataset.turn)]; })()")  # fmt: skip
        browser.js("document.querySelector('.turn button.thumb-down').click(); true")

        def feedback() -> dict | None:
            with sqlite3.connect(run_dir / "samples.sqlite") as db:
                row = db.execute("SELECT json_extract(meta, '$.feedback') FROM samples WHERE session_id=? AND "
                                 "turn_index=?", chip).fetchone()  # fmt: skip
            return json.loads(row[0]) if row and row[0] else None

        assert wait_for(feedback, timeout=60)["score"] == -1.0
        browser.wait_for("document.getElementById('message').textContent.length > 0")
        browser.js("window.scrollTo(0, 0); true")
        browser.screenshot(tmp_path / "live.png")  # the README's figure is taken during the main job instead
        errors = browser.console_errors()
        assert errors == [], errors
        assert not [u for u in browser.request_urls() if KEY in u]  # the key never went into a URL

        before = cards(url)
        auth = {"Authorization": f"Bearer {KEY}"}
        for method, path in ROUTES:
            assert httpx.request(method, f"{url}{path}", json={}).status_code == 401, path
            assert httpx.request(method, f"{url}{path}", params={"key": KEY, "api_key": KEY},
                                 json={}).status_code == 401, path  # fmt: skip
            if method == "POST":
                assert httpx.get(f"{url}{path}", headers=auth).status_code == 405, path
        after = cards(url)
        for key in ("served_adapter", "rollback_step"):
            assert after[key] == before[key], key
        assert after["window"]["paused"] == before["window"]["paused"] is True  # the rollback paused training
    finally:
        stop(proc)
    assert Path(tmp_path / "live.png").stat().st_size > 10_000
