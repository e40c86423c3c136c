import pytest
import torch

from metaclaw.losses import aggregate

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
RAGGED = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # 2 tokens, 1 token, none


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("sum", 7.0),  # 1 + 2 + 4
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3 masked tokens
        ("seq-mean", 2.75),  # mean((1 + 2) / 2, 4 / 1); the empty third row is skipped
    ],
)
def test_ragged_mask(mode: str, expected: float) -> None:
    assert aggregate(PER_TOKEN, RAGGED, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["sum", "token-mean", "seq-mean"])
def test_off_mask_nan_and_empty_mask(mode: str) -> None:
    poisoned = PER_TOKEN.clone()
    poisoned[RAGGED == 0] = float("nan")
    assert aggregate(poisoned, RAGGED, mode).item() == pytest.approx(aggregate(PER_TOKEN, RAGGED, mode).item())
    x = torch.ones(2, 3, requires_grad=True)
    empty = aggregate(x, torch.zeros(2, 3), mode)
    assert empty.item() == 0.0
    empty.backward()  # still in the graph, no 0/0
    assert torch.equal(x.grad, torch.zeros(2, 3))


def test_unknown_mode_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="token-mean, seq-mean, sum"):
        aggregate(PER_TOKEN, RAGGED, "mean")


def test_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="mask"):
        aggregate(PER_TOKEN, RAGGED[:, :2], "sum")
