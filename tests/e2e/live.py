"""`train(cfg)` while a thread talks to its proxy through the real `openai` client (the e2e tests' driver)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import openai
from omegaconf import DictConfig

from metaclaw.training import train
from tests.procs import wait_for_health


def train_driven(cfg: DictConfig, port: int, drive: Callable[[openai.OpenAI], None]) -> tuple[dict, dict[str, Any]]:
    """`train(cfg)`'s `(metrics, objects)` while `drive(client)` talks to the proxy on `port` (from its health);
    the proxy going away ends the driver; anything else it hits fails the test."""
    errors: list[BaseException] = []
    base_url = f"http://127.0.0.1:{port}"

    def run() -> None:
        try:
            wait_for_health(base_url)
            drive(openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60))
        except openai.APIConnectionError:
            pass  # training finished and the proxy went away
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    driver = threading.Thread(target=run, daemon=True)
    driver.start()
    metrics, objects = train(cfg)
    driver.join(timeout=60)
    assert not errors, errors
    return metrics, objects
