"""What can go wrong with a checkpoint, as exceptions, and the finiteness check run before any write."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


class CheckpointError(RuntimeError):
    """A collective checkpoint operation failed on at least one rank; raised on every rank alike."""


class DamagedCheckpointError(FileNotFoundError):
    """A checkpoint directory is incomplete or one of its files is missing, truncated or unreadable.

    `path` is the checkpoint directory, `file` the first damaged file in it (or the directory itself).
    """

    def __init__(self, message: str, path: Path, file: Path) -> None:
        super().__init__(message)
        self.path = path
        self.file = file


class NonFiniteWeightsError(ValueError):
    """A tensor about to be saved (checkpoint or export) holds NaN or inf."""


def check_finite_tensors(tensors: Mapping[str, Any], what: str, prefix: str = "") -> None:
    """Raise NonFiniteWeightsError naming the first floating tensor (local shard) with NaN/inf.

    Nested mappings are walked (`ema.shadow.<name>`); non-tensor values are ignored.
    """
    for name, value in tensors.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            check_finite_tensors(value, what, f"{key}.")
            continue
        if not isinstance(value, Tensor) or not value.is_floating_point():
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.numel() and not bool(torch.isfinite(local).all()):
            bad = int((~torch.isfinite(local)).sum())
            raise NonFiniteWeightsError(
                f"{what}: {key} holds {bad} non-finite value(s) (NaN/inf) of {local.numel()}; refusing to "
                "write it. The training diverged or a setting is non-finite: resume from an earlier "
                "checkpoint with a lower optim.lr / trainer.clip_grad_norm, or check the data"
            )
