"""Run an ASGI app with uvicorn on a background thread (the proxy inside `train.py`, tests, the bench)."""

from __future__ import annotations

import threading
import time

import uvicorn

from metaclaw.lifecycle import free_port  # noqa: F401 - re-exported


class ThreadedServer:
    """`with ThreadedServer(app, port=...) as srv:` serves `app` on `srv.url` until the block ends.

    Args:
        app: the ASGI app.
        host: bind address (127.0.0.1 by default, as every metaclaw surface).
        port: 0 picks a free port.
        startup_timeout_s: how long to wait for the server to accept connections.
        drain_timeout_s: on stop, the listening socket closes at once and requests in flight get this long.
    """

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 30.0,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=drain_timeout_s,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn:{self.port}", daemon=True)
        self.startup_timeout_s, self.drain_timeout_s = startup_timeout_s, drain_timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.drain_timeout_s + 10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
