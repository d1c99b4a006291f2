"""Open-loop evaluation: exact errors for known predictors, baselines, masking of padded steps."""

from __future__ import annotations

import pytest
import torch

from vla.eval.open_loop import evaluate_open_loop
from vla.types import Batch, Observation

H, A, D = 4, 6, 2  # horizon, padded action dim, real action dim


def _batch(seed: int, pad_last: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    actions = torch.zeros(3, H, A)
    actions[:, :, :D] = torch.randn(3, H, D, generator=gen)
    is_pad = torch.zeros(3, H, dtype=torch.bool)
    if pad_last:
        is_pad[0, -pad_last:] = True
    observation = Observation(
        images={}, image_masks={}, state=torch.zeros(3, 1), tokenized_prompt=torch.zeros(3, 1, dtype=torch.long),
        tokenized_prompt_mask=torch.ones(3, 1, dtype=torch.bool),
    )  # fmt: skip
    dim_mask = torch.zeros(3, A, dtype=torch.bool)
    dim_mask[:, :D] = True
    return Batch(observation=observation, actions=actions, action_is_pad=is_pad, action_dim_mask=dim_mask)


def _unnormalize(x: torch.Tensor) -> torch.Tensor:  # MEAN_STD with mean 1, std 2 on the real dims
    return x[..., :D] * 2.0 + 1.0


def test_a_perfect_predictor_scores_zero_and_baselines_are_exact() -> None:
    batches = [_batch(0), _batch(1, pad_last=2)]
    report = evaluate_open_loop(lambda b: b.actions, batches, _unnormalize)
    assert report.samples == 6 and report.mse == 0.0 and report.l1 == 0.0
    # zero baseline: mean of truth^2 in dataset units over real (non-pad) entries.
    values = torch.cat(
        [_unnormalize(b.actions)[~b.action_is_pad].reshape(-1) for b in batches]
    )  # padded steps dropped
    assert report.baseline_zero_mse == pytest.approx(float(values.square().mean()), rel=1e-6)
    assert report.baseline_center_mse == pytest.approx(float((values - 1.0).square().mean()), rel=1e-6)
    assert len(report.mse_by_horizon) == H and len(report.l1_by_dim) == D


def test_errors_are_measured_in_dataset_units_and_by_horizon() -> None:
    batch = _batch(2)
    shifted = batch.actions.clone()
    shifted[:, 1, :D] += 0.5  # +0.5 normalised = +1.0 in dataset units at horizon index 1 only
    report = evaluate_open_loop(lambda b: shifted, [batch], _unnormalize)
    assert report.mse_by_horizon == pytest.approx([0.0, 1.0, 0.0, 0.0])
    assert report.mse == pytest.approx(1.0 / H)
    assert report.l1_by_dim == pytest.approx([1.0 / H, 1.0 / H])


def test_shape_mismatch_and_no_batches_raise() -> None:
    batch = _batch(3)
    with pytest.raises(ValueError, match="expected"):
        evaluate_open_loop(lambda b: batch.actions[:, :2], [batch], _unnormalize)
    with pytest.raises(ValueError, match="no batches"):
        evaluate_open_loop(lambda b: batch.actions, [], _unnormalize)
