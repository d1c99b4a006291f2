"""How far evaluation episodes are from the demonstrations: each seed's layout and its nearest neighbour.

A MetaWorld episode's layout is the vector its reset draws (object and goal positions, metres; some
tasks also a second object): MetaWorldEnv.reset(seed) makes it a function of the seed. Tasks randomise
different numbers of dimensions (drawer-open: the drawer's x only; button-press-topdown: x and y;
reach, push and pick-place: 5-6), so a success rate on layouts within a millimetre of a demonstration
measures recall, one on layouts centimetres away measures generalisation. `nearest_distances` gives,
for every evaluation seed, the Euclidean distance to the closest training layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from vla.sim.metaworld_env import MetaWorldEnv


def layouts(task: str, seeds: Iterable[int]) -> np.ndarray:
    """(N, D) float64: the layout vector of each seed's episode (a reset each, no rendering)."""
    with MetaWorldEnv(task, ("corner2",), 8) as env:
        return np.stack([env.layout(seed) for seed in seeds])


def randomised_dims(layout_vectors: np.ndarray) -> int:
    """How many dimensions vary across the given layouts."""
    return int((np.ptp(layout_vectors, axis=0) > 1e-9).sum())


def nearest_distances(eval_layouts: np.ndarray, train_layouts: np.ndarray) -> np.ndarray:
    """(N,) metres from each evaluation layout to its nearest training layout."""
    if len(train_layouts) == 0:
        raise ValueError("no training layouts to compare with")
    diff = eval_layouts[:, None, :] - train_layouts[None, :, :]
    return np.sqrt((diff**2).sum(axis=2)).min(axis=1)


def layout_report(task: str, eval_seeds: Iterable[int], train_seeds: Iterable[int]) -> dict[str, Any]:
    """Per task: randomised dims and the median / max / min distance (m) of evaluation layouts to the
    nearest training layout."""
    train = layouts(task, sorted(train_seeds))
    evaluated = layouts(task, list(eval_seeds))
    distances = nearest_distances(evaluated, train)
    return {
        "randomised_dims": randomised_dims(np.concatenate([train, evaluated])),
        "nearest_training_layout_m": {
            "median": float(np.median(distances)),
            "max": float(distances.max()),
            "min": float(distances.min()),
        },
        "training_layouts": len(train),
    }
