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


_FINITE_CHUNK = 1 << 22  # elements per isfinite() call: its temporaries stay at ~30 MB


def _all_finite(tensor: Tensor) -> bool:
    """torch.isfinite(tensor).all() without its full-size temporaries (isfinite takes abs() first: a
    copy of the tensor), which at pi0's full size (a 2 GiB embedding) cost 3.4 GiB at export."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(_FINITE_CHUNK))


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
        if local.numel() and not _all_finite(local):
            bad = int((~torch.isfinite(local)).sum())
            raise NonFiniteWeightsError(
                f"{what}: {key} holds {bad} non-finite value(s) (NaN/inf) of {local.numel()}; refusing to "
                "write it. The training diverged or a setting is non-finite: resume from an earlier "
                "checkpoint with a lower optim.lr / trainer.clip_grad_norm, or check the data"
            )
