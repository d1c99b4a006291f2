"""Randomness of the flow-matching loss drawn per sample, not per rank.

pi0's loss draws a noise chunk and a flow time for every sample. Drawn from each rank's RNG, they
would depend on how the global batch is split: 2 ranks x 4 samples would not see the noise 1 rank x
8 samples sees. Drawn from a generator seeded by (run seed, step, dataset index) instead, every
sample gets the same noise at any world size, so DDP, FSDP2 and single-process runs follow one
trajectory, and a checkpoint resumes the same trajectory on a different number of ranks.
"""

from __future__ import annotations

import torch
from scipy.special import betaincinv
from torch import Tensor

from vla.types import Batch

_STREAMS = {"train": 0, "val": 1, "eval": 2}


def _generator(seed: int, stream: str, step: int, index: int) -> torch.Generator:
    # A fixed mixing of the four integers (Python's hash() of a tuple is salted per process).
    mixed = (seed * 1_000_003 + _STREAMS[stream]) * 1_000_033 + step
    return torch.Generator().manual_seed((mixed * 2_654_435_761 + index) % (2**63 - 1))


def flow_matching_inputs(
    batch: Batch, *, seed: int, step: int, stream: str, alpha: float, beta: float, time_min: float
) -> tuple[Tensor, Tensor]:
    """(noise (B, H, A), time (B,)) for `batch`, a deterministic function of each sample's index.

    time = Beta(alpha, beta) * (1 - time_min) + time_min, sampled by inverting the Beta CDF of a
    per-sample uniform, so the distribution is exactly the model's own.
    """
    indices = batch.meta.get("index")
    if indices is None:
        raise KeyError("batch.meta has no 'index': the data pipeline must pass each sample's dataset index")
    shape = tuple(batch.actions.shape[1:])
    noises, uniforms = [], []
    for index in torch.as_tensor(indices).reshape(-1).tolist():
        generator = _generator(seed, stream, step, int(index))
        noises.append(torch.randn(shape, generator=generator))
        uniforms.append(float(torch.rand((), generator=generator)))
    time = torch.tensor(betaincinv(alpha, beta, uniforms), dtype=torch.float32) * (1.0 - time_min) + time_min
    device = batch.actions.device
    return torch.stack(noises).to(device), time.to(device)
