"""Interval maths for closed-loop studies: spread over training seeds and a two-level bootstrap.

A run's result is its per-task outcomes: task -> (successes, episodes). An optimizer's mean success is
the mean over its training seeds of the mean over tasks of each task's success rate (every task weighs
the same, whatever its episode count).

The bootstrap resamples both levels of the experiment: training seeds with replacement, then, within
each drawn seed, every task's episodes with replacement. Resampling n episodes of which k succeeded
draws Binomial(n, k / n) successes, so the episode level is sampled exactly without materialising
episodes. The two optimizers are resampled independently (unpaired), which does not assume that seed i
of one optimizer is related to seed i of the other.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# task -> (successes, episodes) for one training run
RunOutcomes = Mapping[str, tuple[int, int]]


def run_mean_success(run: RunOutcomes) -> float:
    """Mean over tasks of the success rate."""
    if not run:
        raise ValueError("a run needs at least one task")
    for task, (successes, episodes) in run.items():
        if episodes < 1 or not 0 <= successes <= episodes:
            raise ValueError(
                f"{task}: need 0 <= successes <= episodes and episodes >= 1, got {successes}/{episodes}"
            )
    return statistics.fmean(s / n for s, n in run.values())


@dataclass
class SeedSpread:
    """Mean, sample standard deviation, min and max over seeds (std is 0 for a single seed)."""

    mean: float
    std: float
    min: float
    max: float
    seeds: int


def seed_spread(values: Sequence[float]) -> SeedSpread:
    if not values:
        raise ValueError("no seeds")
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return SeedSpread(statistics.fmean(values), std, min(values), max(values), len(values))


def _bootstrap_means(
    runs: Sequence[RunOutcomes], tasks: list[str], resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """(resamples,) optimizer mean success under the two-level bootstrap."""
    successes = np.array([[run[t][0] for t in tasks] for run in runs], dtype=np.int64)  # (S, T)
    episodes = np.array([[run[t][1] for t in tasks] for run in runs], dtype=np.int64)
    seeds = rng.integers(0, len(runs), size=(resamples, len(runs)))  # (R, S) drawn seeds
    n = episodes[seeds]  # (R, S, T)
    drawn = rng.binomial(n, successes[seeds] / n)
    return (drawn / n).mean(axis=2).mean(axis=1)


def _shared_tasks(runs: Sequence[RunOutcomes]) -> list[str]:
    """The tasks every run reports (sorted); a run with other tasks is an error."""
    tasks = sorted(runs[0])
    for run in runs:
        if sorted(run) != tasks:
            raise ValueError(f"every run must report the same tasks: {sorted(run)} vs {tasks}")
    return tasks


def _percentile_interval(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    tail = (1 - confidence) / 2
    low, high = (float(x) for x in np.quantile(draws, [tail, 1 - tail]))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError("the bootstrap produced a non-finite interval")
    return low, high


@dataclass
class Difference:
    """mean success of `b` minus that of `a`, with its bootstrap interval."""

    difference: float
    ci: tuple[float, float]
    confidence: float
    excludes_zero: bool
    resamples: int


def success_difference(
    a: Sequence[RunOutcomes],
    b: Sequence[RunOutcomes],
    *,
    resamples: int = 20000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Difference:
    """Mean success of b minus a (each a list of runs, one per training seed), percentile interval."""
    if not a or not b:
        raise ValueError("both sides need at least one run")
    tasks = _shared_tasks([*a, *b])
    rng = np.random.default_rng(seed)
    observed = statistics.fmean(map(run_mean_success, b)) - statistics.fmean(map(run_mean_success, a))
    draws = _bootstrap_means(b, tasks, resamples, rng) - _bootstrap_means(a, tasks, resamples, rng)
    low, high = _percentile_interval(draws, confidence)
    return Difference(observed, (low, high), confidence, not (low <= 0.0 <= high), resamples)


@dataclass
class ArmMean:
    """An arm's mean success over its runs (training seeds), with the two-level bootstrap interval and
    the spread of the runs' own mean successes."""

    mean: float
    ci: tuple[float, float]
    confidence: float
    spread: SeedSpread
    resamples: int


def arm_mean_interval(
    runs: Sequence[RunOutcomes], *, resamples: int = 20000, confidence: float = 0.95, seed: int = 0
) -> ArmMean:
    """Mean over runs of each run's mean success; percentile interval of the two-level bootstrap (runs
    with replacement, then each drawn run's episodes), so it carries the spread between training seeds.
    With one run it is the episodes' interval alone; with few runs the seed level is coarse (resampling n
    runs shrinks their variance by (n - 1) / n), so read the runs' spread beside it."""
    if not runs:
        raise ValueError("an arm needs at least one run")
    tasks = _shared_tasks(runs)
    means = [run_mean_success(run) for run in runs]
    draws = _bootstrap_means(runs, tasks, resamples, np.random.default_rng(seed))
    return ArmMean(
        statistics.fmean(means),
        _percentile_interval(draws, confidence),
        confidence,
        seed_spread(means),
        resamples,
    )


# task -> episode seed -> success in [0, 1] (one run's 0/1, or the mean over several runs' episodes).
# The same seed of the same task is the same layout in every run, which is what makes pairing valid.
EpisodeOutcomes = Mapping[str, Mapping[int, float]]


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


@dataclass
class MeanSuccess:
    """A run's mean success over tasks with its normal interval (tasks independent binomials)."""

    mean: float
    ci: tuple[float, float]
    confidence: float


def mean_success_interval(run: RunOutcomes, confidence: float = 0.95) -> MeanSuccess:
    """Mean over tasks of the success rate; its variance is the sum of the tasks' p (1 - p) / n over T^2."""
    mean = run_mean_success(run)
    variance = sum((s / n) * (1 - s / n) / n for s, n in run.values()) / len(run) ** 2
    half = _z(confidence) * math.sqrt(variance)
    return MeanSuccess(mean, (mean - half, mean + half), confidence)


@dataclass
class TaskPairing:
    """b - a on one task's shared episodes; won / lost: episodes where b did better / worse."""

    difference: float
    ci: tuple[float, float]
    episodes: int
    won: int
    lost: int


@dataclass
class PairedDifference:
    """Mean success of b minus a over the same episodes, with a normal interval, and per task."""

    difference: float
    ci: tuple[float, float]
    confidence: float
    excludes_zero: bool
    tasks: dict[str, TaskPairing]


def paired_difference(a: EpisodeOutcomes, b: EpisodeOutcomes, confidence: float = 0.95) -> PairedDifference:
    """b - a paired episode by episode (a layout both played), the mean over tasks as in `run_mean_success`.

    Per task: the mean of the per-episode differences, its variance the sample variance over n (0 for a
    single episode). Overall: the mean over tasks, its variance the tasks' variances summed over T^2.
    Pairing removes the layouts' own difficulty from the comparison, so the interval is narrower than
    the unpaired one of two independent samples. Both sides must hold the same tasks and, per task, the
    same episode seeds.
    """
    z = _z(confidence)
    if not a or sorted(a) != sorted(b):
        raise ValueError(f"both sides must hold the same tasks: {sorted(a)} vs {sorted(b)}")
    tasks: dict[str, TaskPairing] = {}
    variances = []
    for task in a:
        seeds = sorted(a[task])
        if seeds != sorted(b[task]):
            only = sorted(set(a[task]) ^ set(b[task]))
            raise ValueError(
                f"{task}: the two sides did not play the same episodes ({len(only)} seeds on one side only, "
                f"e.g. {only[:3]}); pair evaluations run with the same --seed and --episodes"
            )
        diffs = np.array([float(b[task][s]) - float(a[task][s]) for s in seeds])
        variance = float(diffs.var(ddof=1)) / len(diffs) if len(diffs) > 1 else 0.0
        half = z * math.sqrt(variance)
        mean = float(diffs.mean())
        tasks[task] = TaskPairing(
            mean, (mean - half, mean + half), len(diffs), int((diffs > 0).sum()), int((diffs < 0).sum())
        )
        variances.append(variance)
    difference = statistics.fmean(t.difference for t in tasks.values())
    half = z * math.sqrt(sum(variances)) / len(tasks)
    low, high = difference - half, difference + half
    return PairedDifference(difference, (low, high), confidence, not (low <= 0.0 <= high), tasks)
