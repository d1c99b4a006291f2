"""Normalisation modes map the stats' reference points where they should; inverses are exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla.data import Normalizer, NormMode, StatsError
from vla.data.stats import vector_stats

VALUES = np.random.default_rng(0).normal(loc=[1.0, -3.0, 10.0], scale=[0.5, 2.0, 0.1], size=(500, 3))
STATS = {"action": vector_stats(VALUES), "observation.state": vector_stats(VALUES[:, :2])}


def test_mean_std_standardises() -> None:
    normalizer = Normalizer(STATS, {"action": "MEAN_STD"})
    out = normalizer.normalize("action", torch.tensor(VALUES, dtype=torch.float32))
    np.testing.assert_allclose(out.mean(0).numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose(out.std(0, unbiased=False).numpy(), 1.0, atol=1e-4)


def test_min_max_maps_range_to_minus_one_one() -> None:
    normalizer = Normalizer(STATS, {"action": NormMode.MIN_MAX})
    out = normalizer.normalize("action", torch.tensor(VALUES, dtype=torch.float32))
    np.testing.assert_allclose(out.min(0).values.numpy(), -1.0, atol=1e-4)
    np.testing.assert_allclose(out.max(0).values.numpy(), 1.0, atol=1e-4)


def test_quantiles_map_q01_q99_to_minus_one_one() -> None:
    normalizer = Normalizer(STATS, {"action": "quantiles"})
    q01 = torch.tensor(STATS["action"]["q01"], dtype=torch.float32)
    q99 = torch.tensor(STATS["action"]["q99"], dtype=torch.float32)
    np.testing.assert_allclose(normalizer.normalize("action", q01).numpy(), -1.0, atol=1e-4)
    np.testing.assert_allclose(normalizer.normalize("action", q99).numpy(), 1.0, atol=1e-4)
    out = normalizer.normalize("action", torch.tensor(VALUES, dtype=torch.float32))
    inside = ((out >= -1) & (out <= 1)).float().mean().item()
    assert 0.95 < inside < 1.0  # ~2 % of samples lie outside the 1st..99th percentile


@pytest.mark.parametrize("mode", ["MEAN_STD", "MIN_MAX", "QUANTILES", "IDENTITY"])
def test_unnormalize_inverts_normalize_over_leading_dims(mode) -> None:
    normalizer = Normalizer(STATS, {"action": mode})
    chunk = torch.tensor(VALUES[:20].reshape(2, 10, 3), dtype=torch.float32)  # (B, H, A)
    restored = normalizer.unnormalize("action", normalizer.normalize("action", chunk))
    torch.testing.assert_close(restored, chunk, rtol=1e-5, atol=1e-4)


def test_features_without_mode_pass_through_and_dims_are_checked() -> None:
    normalizer = Normalizer(STATS, {"observation.state": "MEAN_STD"})
    images = torch.rand(2, 3, 4, 4)
    assert normalizer.normalize("observation.images.top", images) is images
    with pytest.raises(ValueError, match="has 3 values in its last dim but its stats"):
        normalizer.normalize("observation.state", torch.zeros(3))


def test_missing_or_non_finite_stats_raise_with_the_feature_name() -> None:
    with pytest.raises(StatsError, match="no stats for 'reward'"):
        Normalizer(STATS, {"reward": "MEAN_STD"})
    without_quantiles = {"action": {k: v for k, v in STATS["action"].items() if not k.startswith("q")}}
    with pytest.raises(StatsError, match=r"lack \['q01', 'q99'\]"):
        Normalizer(without_quantiles, {"action": "QUANTILES"})
    broken = {"action": {**STATS["action"], "std": np.array([1.0, np.nan, 1.0])}}
    with pytest.raises(StatsError, match=r"'action', entry 'std'.*nan"):
        Normalizer(broken, {"action": "MEAN_STD"})
    with pytest.raises(ValueError, match="unknown"):
        Normalizer(STATS, {"action": "ZSCORE"})


def test_serialised_normalizer_round_trips() -> None:
    normalizer = Normalizer(STATS, {"action": "QUANTILES", "observation.state": "MEAN_STD"})
    rebuilt = Normalizer.from_dict(normalizer.to_dict())
    x = torch.tensor(VALUES[:5], dtype=torch.float32)
    torch.testing.assert_close(rebuilt.normalize("action", x), normalizer.normalize("action", x))
    assert rebuilt.modes == normalizer.modes


def test_eps_is_lerobot_s_and_saved_normalisers_keep_theirs() -> None:
    """New normalisers use LeRobot's eps (1e-8), as their LeRobot processor files say; a processor.json
    written before (no "eps") keeps the 1e-6 it trained with."""
    import numpy as np
    import torch

    from vla.data.normalize import EPS, LEGACY_EPS, Normalizer

    stats = {"action": {"mean": np.array([0.5, -1.0]), "std": np.array([1e-4, 2.0])}}
    normalizer = Normalizer(stats, {"action": "MEAN_STD"})
    x = torch.tensor([[0.6, 1.0]])
    lerobot = (x - torch.tensor([0.5, -1.0])) / (torch.tensor([1e-4, 2.0]) + 1e-8)
    torch.testing.assert_close(normalizer.normalize("action", x), lerobot, rtol=1e-6, atol=0)
    assert EPS == 1e-8 and normalizer.to_dict()["eps"] == EPS
    saved = normalizer.to_dict()
    del saved["eps"]
    old = Normalizer.from_dict(saved)
    assert old.eps == LEGACY_EPS
    assert old.normalize("action", x)[0, 0].item() == pytest.approx(0.1 / (1e-4 + 1e-6), rel=1e-6)
