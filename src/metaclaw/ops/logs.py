"""Logs a person can read (docs/operate.md, "Logs"): applied once, after Hydra configured the root logger.

- Lightning logs through the root handlers only (its own console handler printed each line a second time);
- Lightning's "💡 Tip: ... try installing litlogger/litmodels" adverts are dropped;
- `log.format=json`: every root handler (console and the run's `train.log`) writes one JSON object per line
  (`python-json-logger`);
- `log.level` is metaclaw's level; the loggers in `log.quiet` stay at WARNING.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pythonjsonlogger.json import JsonFormatter

LIGHTNING = ("lightning", "lightning.pytorch", "lightning.fabric")
ADVERTS = ("try installing [litlogger]", "try installing [litmodels]")
JSON_FIELDS = "{asctime}{levelname}{name}{message}"
DEFAULTS: Mapping[str, Any] = {"format": "text", "level": "INFO", "quiet": ("httpx", "httpcore", "urllib3")}


class DropAdverts(logging.Filter):
    """Drops the product adverts Lightning logs at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(advert in message for advert in ADVERTS)


def configure_logging(node: Mapping[str, Any] | None = None) -> None:
    """Apply the `log` config node (`conf/log/*.yaml`; None: text at INFO) to this process's loggers."""
    settings = {**DEFAULTS, **dict(node or {})}
    if settings["format"] not in ("text", "json"):
        raise ValueError(f"log.format must be text or json, got {settings['format']!r}")
    for name in LIGHTNING:  # Lightning's own console handler: its lines reach the root handlers anyway
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
    root = logging.getLogger()
    if not root.handlers:  # not started by Hydra (a library caller): a console handler of our own
        logging.basicConfig(format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    for handler in root.handlers:
        if not any(isinstance(f, DropAdverts) for f in handler.filters):
            handler.addFilter(DropAdverts())
        if settings["format"] == "json":
            handler.setFormatter(JsonFormatter(JSON_FIELDS, style="{"))
    logging.getLogger("metaclaw").setLevel(str(settings["level"]).upper())
    for name in settings["quiet"] or ():
        logging.getLogger(str(name)).setLevel(logging.WARNING)
