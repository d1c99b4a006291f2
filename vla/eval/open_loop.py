"""Open-loop evaluation: predicted action chunks against the recorded ones on held-out episodes.

For every batch the policy samples a chunk from the observation alone; chunk and ground truth are
mapped back to the dataset's units (the processor's inverse normalisation) and compared on real
steps (not past the episode end) and real action dims. Reported: MSE and L1 overall, by horizon
index and by action dim, and the same errors of two trivial predictors, so a number means something:
  zero:   the all-zeros action in dataset units;
  center: the normalisation center repeated (the dataset mean action under MEAN_STD).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from vla.types import Batch


@dataclass
class OpenLoopReport:
    """Errors in dataset units. *_by_horizon: (H,) lists; *_by_dim: (action_dim,) lists."""

    samples: int
    mse: float
    l1: float
    mse_by_horizon: list[float]
    l1_by_dim: list[float]
    baseline_zero_mse: float
    baseline_center_mse: float


def _masked_sums(error: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of squares, sum of |.|) over the batch, per (horizon, dim): (H, D) each."""
    m = mask.to(error.dtype)
    return (error.square() * m).sum(0), (error.abs() * m).sum(0)


@torch.no_grad()
def open_loop_sums(
    sample_actions: Callable[[Batch], Tensor],
    batches: Iterable[Batch],
    unnormalize_actions: Callable[[Tensor], Tensor],
    *,
    max_batches: int | None = None,
) -> dict[str, Tensor]:
    """Per-(horizon, dim) sums of the policy's and the baselines' errors, and the counts.

    Sums add up across ranks (all-reduce them, then `report_from_sums`), unlike means.
    """
    sums: dict[str, Tensor] = {}
    samples = 0
    for index, batch in enumerate(batches):
        if max_batches is not None and index >= max_batches:
            break
        truth = unnormalize_actions(batch.actions.float())  # (B, H, D)
        predicted = unnormalize_actions(sample_actions(batch).float())
        if predicted.shape != truth.shape:
            raise ValueError(
                f"sample_actions returned {tuple(predicted.shape)} after unnormalising; expected {tuple(truth.shape)}"
            )
        mask = (~batch.action_is_pad.bool())[:, :, None].expand_as(truth)
        center = unnormalize_actions(torch.zeros_like(batch.actions.float()))
        parts = {
            "count": mask.to(truth.dtype).sum(0),
            "zero_sq": _masked_sums(-truth, mask)[0],
            "center_sq": _masked_sums(center - truth, mask)[0],
        }
        parts["sq"], parts["abs"] = _masked_sums(predicted - truth, mask)
        for key, value in parts.items():
            sums[key] = sums[key] + value if key in sums else value
        samples += truth.shape[0]
    if not sums:
        raise ValueError("open-loop evaluation got no batches")
    sums["samples"] = torch.tensor(float(samples), device=sums["sq"].device)
    return sums


def report_from_sums(sums: dict[str, Tensor]) -> OpenLoopReport:
    count = sums["count"].clamp_min(1)
    total = sums["count"].sum().clamp_min(1)
    return OpenLoopReport(
        samples=int(sums["samples"]),
        mse=float(sums["sq"].sum() / total),
        l1=float(sums["abs"].sum() / total),
        mse_by_horizon=(sums["sq"].sum(1) / count.sum(1)).tolist(),
        l1_by_dim=(sums["abs"].sum(0) / count.sum(0)).tolist(),
        baseline_zero_mse=float(sums["zero_sq"].sum() / total),
        baseline_center_mse=float(sums["center_sq"].sum() / total),
    )


def evaluate_open_loop(
    sample_actions: Callable[[Batch], Tensor],
    batches: Iterable[Batch],
    unnormalize_actions: Callable[[Tensor], Tensor],
    *,
    max_batches: int | None = None,
) -> OpenLoopReport:
    """Compare `sample_actions(batch)` ((B, H, A) normalised, padded) with each batch's actions.

    sample_actions sees the whole batch so a caller can draw per-sample noise from batch.meta; it
    must not read batch.actions (use e.g. `lambda b: policy.sample_actions(b.observation)`).
    unnormalize_actions: (..., A) normalised padded -> (..., action_dim) dataset units
        (`BatchProcessor.unnormalize_actions`).
    """
    return report_from_sums(
        open_loop_sums(sample_actions, batches, unnormalize_actions, max_batches=max_batches)
    )
