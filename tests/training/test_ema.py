"""The EMA's warm-up: the decay rule, the recursion it implies, and that the initial weights vanish."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vla.training.ema import EMA


def test_decay_follows_the_warm_up_rule_and_caps_at_decay() -> None:
    ema = EMA(nn.Linear(2, 2), 0.999)
    assert ema.decay_at(0) == pytest.approx(0.1)
    assert ema.decay_at(1) == pytest.approx(2 / 11)
    assert ema.decay_at(1000) == pytest.approx(1001 / 1010)
    assert ema.decay_at(8990) == pytest.approx(0.999)  # (1 + n) / (10 + n) reaches 0.999 at n = 8990
    assert ema.decay_at(10**6) == 0.999
    with pytest.raises(ValueError, match="step must be >= 0"):
        ema.decay_at(-1)
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\)"):
        EMA(nn.Linear(2, 2), 1.0)


def test_updates_follow_the_recursion_and_forget_the_initial_weights() -> None:
    """Weights start at 5 and then sit at 1: a plain 0.999 average would still be 1 + 4 * 0.999^60 = 4.8
    after 60 steps; the warmed-up one is 1 within 1e-9, and every update matches the scalar recursion."""
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(5.0)
    ema = EMA(model, 0.999)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    expected = 5.0
    for step in range(60):
        ema.update(model, step)
        d = ema.decay_at(step)
        expected = d * expected + (1 - d) * 1.0
        for shadow in ema.state_dict().values():
            torch.testing.assert_close(shadow, torch.full_like(shadow, expected), rtol=1e-6, atol=1e-7)
    assert abs(expected - 1.0) < 1e-9 and 1 + 4 * 0.999**60 > 4.7
    assert math.isclose(expected - 1.0, 4 * math.prod((1 + n) / (10 + n) for n in range(60)), rel_tol=1e-4)
