"""Logs a person can read: Lightning's lines once and without adverts, JSON on request, one line per step."""

from __future__ import annotations

import io
import json
import logging

import lightning  # noqa: F401 - installs Lightning's own console handler, the cause of the duplicated lines
import pytest

from metaclaw.modules.health import step_line
from metaclaw.ops.logs import configure_logging


@pytest.fixture
def root_stream():
    """The root logger with one handler writing to a buffer (as Hydra's console handler), restored after."""
    root, stream = logging.getLogger(), io.StringIO()
    saved = (root.handlers[:], {n: logging.getLogger(n).handlers[:] for n in ("lightning", "lightning.pytorch")})
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s|%(message)s"))
    root.handlers[:] = [handler]
    yield stream
    root.handlers[:] = saved[0]
    for name, handlers in saved[1].items():
        logging.getLogger(name).handlers[:] = handlers


def test_lightning_lines_once_and_no_adverts(root_stream, capsys):
    assert logging.getLogger("lightning").handlers  # what Lightning does on import
    configure_logging({"format": "text", "level": "INFO"})
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero.info("GPU available: False, used: False")
    rank_zero.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](https://x)")
    lines = root_stream.getvalue().splitlines()
    assert lines == ["lightning.pytorch.utilities.rank_zero|GPU available: False, used: False"]
    assert "GPU available" not in capsys.readouterr().err  # Lightning's own handler no longer prints it again


def test_json_logs_one_object_per_line(root_stream):
    configure_logging({"format": "json", "level": "DEBUG"})
    logging.getLogger("metaclaw.test").info("Published adapter v%d", 3)
    record = json.loads(root_stream.getvalue().splitlines()[-1])
    assert record["message"] == "Published adapter v3" and record["levelname"] == "INFO"
    assert record["name"] == "metaclaw.test" and "asctime" in record
    configure_logging({"format": "text"})


def test_a_typo_in_the_format_is_refused():
    with pytest.raises(ValueError, match="log.format must be text or json"):
        configure_logging({"format": "jsno"})


def test_step_line_names_what_an_operator_reads():
    line = step_line(12, {"loss/total": 0.1234, "rollout/reward_mean": 0.5, "train/lr": 3e-4,
                          "train/grad_norm": 0.81, "rollout/backlog": 7.0})  # fmt: skip
    assert line == "Step 12: loss 0.1234, reward +0.50, lr 0.0003, grad norm 0.81, backlog 7"


def test_step_line_counts_the_behaviour_gap():
    """The importance ratio of behaviour (a quantised engine's μ) vs the trainer's recomputation, and the share of
    tokens whose weight the loss bounded, are in the step line (issue 46)."""
    line = step_line(3, {"loss/total": 0.5, "loss/ratio_mean": 1.0021, "loss/ratio_min": 0.8712,
                         "loss/ratio_max": 1.1934, "loss/ratio_truncated_frac": 0.0125})  # fmt: skip
    assert line == "Step 3: loss 0.5000, ratio 1.002 [0.871, 1.193], truncated 1.2%"
    assert "clipped 3.0%" in step_line(4, {"loss/ratio_mean": 1.0, "loss/clip_frac": 0.03})
