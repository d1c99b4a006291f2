"""Per-task sampling weights for training (data.task_weights): which frames an epoch draws.

Without weights an epoch is a permutation of the training frames, so each task gets draws in
proportion to its frames. With weights, a frame of task t is drawn w_t times as often as it would
be (1: as now, 2: twice as often, 0: never), then the shares are renormalised:

    share_t = w_t * frames_t / sum_u(w_u * frames_u)

An epoch keeps its length (one draw per training frame) and is stratified: task t gets exactly
round(share_t * N) draws (largest remainders), taken from permutations of its frames, so within a
task every frame comes once before any comes twice; the draws are then shuffled together. The order
depends on (seed, epoch) alone, so a resumed or re-sharded run draws what the uninterrupted run did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vla.data.errors import TaskWeightsError


@dataclass(frozen=True)
class TaskMixture:
    """frames[t]: dataset indices of task t's training frames (int64); counts[t]: its draws per epoch."""

    tasks: tuple[str, ...]
    frames: tuple[torch.Tensor, ...]
    counts: tuple[int, ...]

    @property
    def num_samples(self) -> int:
        return sum(self.counts)

    def order(self, generator: torch.Generator) -> list[int]:
        """One epoch's dataset indices, (num_samples,), drawn with `generator`."""
        draws = []
        for frames, count in zip(self.frames, self.counts, strict=True):
            if count == 0:
                continue
            rounds = -(-count // len(frames))
            draws.append(
                torch.cat([frames[torch.randperm(len(frames), generator=generator)] for _ in range(rounds)])[
                    :count
                ]
            )
        together = torch.cat(draws)
        return together[torch.randperm(len(together), generator=generator)].tolist()

    def describe(self) -> str:
        """One log line: each task's share of the draws, against its share of the frames."""
        total_frames = sum(len(f) for f in self.frames)
        parts = [
            f"{task!r} {100 * len(frames) / total_frames:.1f}% -> {100 * count / self.num_samples:.1f}%"
            for task, frames, count in zip(self.tasks, self.frames, self.counts, strict=True)
        ]
        return "data.task_weights: share of the training draws by task (frames -> draws): " + ", ".join(parts)


def check_task_weights(weights: Mapping[str, float]) -> None:
    """Raise TaskWeightsError unless every weight is a finite number >= 0."""
    for name, weight in weights.items():
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise TaskWeightsError(
                f"data.task_weights[{name!r}] is {weight!r}: a weight is a finite number >= 0 (1: drawn as "
                "often as now, 2: twice as often, 0: never)."
            )


def _largest_remainder(shares: Sequence[float], total: int) -> list[int]:
    exact = [share * total for share in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def task_mixture(
    task_index: np.ndarray, tasks: Sequence[str], weights: Mapping[str, float], where: str
) -> TaskMixture | None:
    """The epoch mixture for frames whose task is `tasks[task_index[i]]`; None when it changes nothing.

    task_index: (N,) ints, the training split's task of each frame; tasks: the dataset's task table
    (meta/tasks); weights: task text -> weight, tasks not named weigh 1; where: the dataset, for errors.
    Raises TaskWeightsError for a name not in `tasks`, a weight that is negative or not finite, or
    weights that leave no training frame to draw.
    """
    unknown = [name for name in weights if name not in tasks]
    if unknown:
        raise TaskWeightsError(
            f"data.task_weights names {unknown}, not a task of {where}; its tasks are {list(tasks)}. "
            'Name tasks by their text in meta/tasks (e.g. data.task_weights={"' + str(tasks[0]) + '": 2}).'
        )
    check_task_weights(weights)
    present = sorted({int(t) for t in np.unique(task_index)})
    if all(float(weights.get(tasks[t], 1.0)) == 1.0 for t in present):
        return None
    frames = tuple(torch.from_numpy(np.flatnonzero(task_index == t).astype(np.int64)) for t in present)
    mass = [float(weights.get(tasks[t], 1.0)) * len(f) for t, f in zip(present, frames, strict=True)]
    if sum(mass) == 0:
        raise TaskWeightsError(
            f"data.task_weights gives weight 0 to every task of the training split of {where} "
            f"({[tasks[t] for t in present]}): nothing is left to train on. Give one of them a weight > 0."
        )
    counts = _largest_remainder([m / sum(mass) for m in mass], len(task_index))
    return TaskMixture(tuple(tasks[t] for t in present), frames, tuple(counts))
