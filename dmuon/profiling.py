"""Wall-clock timing of small kernels: medians over repeats, synchronising CUDA when used.

Used by the planner's cost calibration and by the benchmark scripts, so both measure alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds of each repeat; `median` is what reports and cost models use."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the measurement was."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median > 0 else 0.0


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fn: Callable[[], object],
    *,
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | None = None,
    min_seconds: float = 0.0,
) -> Timing:
    """Time `fn()` `repeats` times after `warmup` calls; keep repeating until `min_seconds` passed."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    _sync(device)
    samples: list[float] = []
    start_all = time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - start_all < min_seconds:
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return Timing(tuple(samples))
