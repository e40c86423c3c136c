"""Headless Chromium driven over the Chrome DevTools Protocol (websockets; no driver binary needed)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--remote-debugging-port=0",
         "--window-size=1400,1000"]  # fmt: skip


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with a fresh profile; `events` keeps every CDP event (console, exceptions)."""

    def __init__(self, binary: str, timeout_s: float = 60.0) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="metaclaw-chromium-"))
        cmd = [binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(p for p in pages if p.get("type") == "page")
        # events pile up while a test does other work: an unbounded queue (a bounded one stops reading, and then
        # the keepalive pong is never seen) and no keepalive (a local pipe; a loaded machine answers late)
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=timeout_s, max_queue=None,
                          ping_interval=None)  # fmt: skip
        self.events: list[dict[str, Any]] = []
        self._id = 0
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")

    def call(self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'")

    def js(self, expression: str) -> Any:
        out = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expression}")
            time.sleep(0.3)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def console_errors(self) -> list[dict[str, Any]]:
        """Console errors, uncaught exceptions and failed loads the page logged."""
        out = []
        for e in self.events:
            m, p = e["method"], e.get("params", {})
            thrown = m == "Runtime.exceptionThrown"
            logged = m == "Runtime.consoleAPICalled" and p.get("type") == "error"
            if thrown or logged or (m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error"):
                out.append(e)
        return out

    def request_urls(self) -> list[str]:
        """Every URL the page requested so far (the events read while the calls waited)."""
        self.js("true")  # read what arrived since the last call
        return [e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
        shutil.rmtree(self.profile, ignore_errors=True)
