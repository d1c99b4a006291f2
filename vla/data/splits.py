"""Train/validation split by whole episodes (frames of one episode never straddle the split)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.errors import DatasetTooSmallError
from vla.data.metadata import DatasetMetadata
from vla.data.reader import LeRobotDataset


def split_episodes(
    episodes: int | Sequence[int], val_fraction: float = 0.1, seed: int = 0, min_val_episodes: int = 1
) -> tuple[list[int], list[int]]:
    """(train, val) episode indices, each sorted; deterministic for a seed.

    episodes: a count N (meaning 0..N-1) or explicit indices. val gets round(N * val_fraction)
    episodes, at least `min_val_episodes` when val_fraction > 0; train keeps at least one.
    """
    pool = list(range(episodes)) if isinstance(episodes, int) else sorted({int(e) for e in episodes})
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not pool:
        raise DatasetTooSmallError(
            "there are no episodes to train on: the dataset holds none, or data.episodes selects none; "
            "point data.root at a dataset with episodes or fix data.episodes"
        )
    num_val = 0 if val_fraction == 0 else max(min_val_episodes, round(len(pool) * val_fraction))
    if num_val >= len(pool):
        raise ValueError(
            f"cannot hold out {num_val} of {len(pool)} episodes for validation and keep any for training; "
            "lower val_fraction or use a larger dataset."
        )
    order = np.random.default_rng(seed).permutation(len(pool))
    val = sorted(pool[i] for i in order[:num_val])
    train = sorted(pool[i] for i in order[num_val:])
    return train, val


def train_val_datasets(
    root: Path | str, val_fraction: float = 0.1, seed: int = 0, **dataset_kwargs: Any
) -> tuple[LeRobotDataset, LeRobotDataset | None]:
    """Two LeRobotDatasets over disjoint episodes of `root` (val is None when val_fraction == 0)."""
    meta = DatasetMetadata(root)
    train, val = split_episodes(sorted(meta.episodes), val_fraction, seed)
    train_set = LeRobotDataset(root, episodes=train, **dataset_kwargs)
    val_set = LeRobotDataset(root, episodes=val, **dataset_kwargs) if val else None
    return train_set, val_set
