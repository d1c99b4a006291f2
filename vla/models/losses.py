"""Loss reductions shared by the policies."""

from __future__ import annotations

from torch import Tensor


def per_sample_masked_mean(values: Tensor, weights: Tensor) -> Tensor:
    """Mean over samples of each sample's weighted mean: (B, ...) values and weights -> scalar.

    Each sample is normalised by its own count, so the loss of a batch split over data-parallel
    ranks, averaged over the ranks (as DDP / FSDP average gradients), equals the loss of the whole
    batch: a global masked mean would weigh samples by how many padded steps their rank's batch held.
    """
    per_sample = (values * weights).flatten(1).sum(1) / weights.flatten(1).sum(1).clamp_min(1.0)
    return per_sample.mean()
