"""The study's interval maths (seed spread, two-level bootstrap) and the curves read from metrics.jsonl."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vla.eval.curves import steps_to_baseline_best, steps_to_reach, success_curve, validation_curve
from vla.eval.stats import arm_mean_interval, run_mean_success, seed_spread, success_difference


def _run(rates: dict[str, float], episodes: int = 50) -> dict[str, tuple[int, int]]:
    return {task: (round(rate * episodes), episodes) for task, rate in rates.items()}


def test_run_mean_weighs_every_task_alike_and_rejects_bad_counts() -> None:
    assert run_mean_success({"a": (10, 10), "b": (0, 40)}) == 0.5
    with pytest.raises(ValueError, match="successes <= episodes"):
        run_mean_success({"a": (11, 10)})


def test_seed_spread() -> None:
    spread = seed_spread([0.5, 0.6, 0.7])
    assert spread.mean == pytest.approx(0.6) and spread.std == pytest.approx(0.1)
    assert (spread.min, spread.max, spread.seeds) == (0.5, 0.7, 3)
    assert seed_spread([0.4]).std == 0.0


def test_identical_optimizers_give_an_interval_around_zero() -> None:
    runs = [_run({"a": 0.5, "b": 0.7}), _run({"a": 0.6, "b": 0.6}), _run({"a": 0.4, "b": 0.8})]
    result = success_difference(runs, runs, resamples=4000)
    assert result.difference == 0.0
    low, high = result.ci
    assert low < 0 < high and not result.excludes_zero
    assert low > -0.15 and high < 0.15


def test_a_large_gap_is_detected_and_its_interval_is_calibrated() -> None:
    worse = [_run({"a": 0.2, "b": 0.3}), _run({"a": 0.26, "b": 0.3}), _run({"a": 0.2, "b": 0.36})]
    better = [_run({"a": 0.8, "b": 0.9}), _run({"a": 0.86, "b": 0.86}), _run({"a": 0.8, "b": 0.9})]
    result = success_difference(worse, better, resamples=4000)
    assert result.difference == pytest.approx(np.mean([0.85, 0.86, 0.85]) - np.mean([0.25, 0.28, 0.28]))
    assert result.excludes_zero and result.ci[0] > 0.4 and result.ci[0] < result.difference < result.ci[1]
    # the interval's width follows the episode noise: a single seed of 50 episodes per task, two tasks at
    # p = 0.5 on each side, has a difference with sd sqrt(2 * 0.25 / 100) = 0.0707, so a 95% width ~0.277
    one = [_run({"a": 0.5, "b": 0.5})]
    width = np.diff(success_difference(one, one, resamples=20000).ci)[0]
    assert width == pytest.approx(2 * 1.96 * 0.0707, rel=0.08)


def test_seed_spread_widens_the_interval() -> None:
    steady = [_run({"a": 0.5}), _run({"a": 0.5}), _run({"a": 0.5})]
    noisy = [_run({"a": 0.2}), _run({"a": 0.5}), _run({"a": 0.8})]
    narrow = np.diff(success_difference(steady, steady, resamples=4000).ci)[0]
    wide = np.diff(success_difference(noisy, noisy, resamples=4000).ci)[0]
    assert wide > 1.5 * narrow


def test_the_bootstrap_is_seeded_and_checks_its_input() -> None:
    runs = [_run({"a": 0.5, "b": 0.7}), _run({"a": 0.6, "b": 0.6})]
    assert success_difference(runs, runs, seed=3).ci == success_difference(runs, runs, seed=3).ci
    with pytest.raises(ValueError, match="same tasks"):
        success_difference(runs, [_run({"a": 0.5})])
    with pytest.raises(ValueError, match="at least one run"):
        success_difference([], runs)


def test_an_arms_mean_over_seeds_and_its_interval() -> None:
    """The mean of the runs' means; one run: the episodes' interval (two tasks at p = 0.5, 50 episodes
    each: sd sqrt(0.25 / 50) / sqrt(2) = 0.05); runs that differ widen it; seeded; checked input."""
    one = arm_mean_interval([_run({"a": 0.5, "b": 0.5})], resamples=20000)
    assert one.mean == 0.5 and one.spread.seeds == 1 and one.spread.std == 0.0
    assert np.diff(one.ci)[0] == pytest.approx(2 * 1.96 * 0.05, rel=0.08)
    noisy = [_run({"a": 0.2, "b": 0.5}), _run({"a": 0.5, "b": 0.5}), _run({"a": 0.8, "b": 0.5})]
    result = arm_mean_interval(noisy, resamples=4000)
    assert result.mean == pytest.approx(0.5) and result.spread.std == pytest.approx(0.15)
    assert (result.spread.min, result.spread.max) == pytest.approx((0.35, 0.65))
    steady = arm_mean_interval([_run({"a": 0.5, "b": 0.5})] * 3, resamples=4000)
    # three steady runs: the episodes' width over sqrt(3); the seeds' spread more than doubles it
    assert np.diff(steady.ci)[0] == pytest.approx(np.diff(one.ci)[0] / 3**0.5, rel=0.1)
    assert result.ci[0] < 0.5 < result.ci[1] and np.diff(result.ci)[0] > 2 * np.diff(steady.ci)[0]
    assert arm_mean_interval(noisy, seed=3).ci == arm_mean_interval(noisy, seed=3).ci
    with pytest.raises(ValueError, match="same tasks"):
        arm_mean_interval([_run({"a": 0.5}), _run({"b": 0.5})])
    with pytest.raises(ValueError, match="at least one run"):
        arm_mean_interval([])


def test_curves_from_metrics_keep_the_last_record_of_a_step(tmp_path) -> None:
    records = [
        {"step": 1, "split": "train", "loss": 1.0},
        {"step": 2, "split": "val", "loss": 0.9},
        {"step": 2, "split": "eval", "success/reach-v3": 0.2, "success/push-v3": 0.0, "success/mean": 0.1, "train_s": 3.0, "episodes": 10.0},
        {"step": 4, "split": "val", "loss": 0.7},
        {"step": 4, "split": "eval", "success/reach-v3": 0.5, "success/push-v3": 0.1, "success/mean": 0.3, "train_s": 6.0, "episodes": 10.0},
        {"step": 4, "split": "eval", "mse": 0.1},  # an open-loop record: not a success point
        {"step": 4, "split": "val", "loss": 0.6},  # re-logged after a resume: this one counts
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n{torn")
    curve = success_curve(path)
    assert curve.steps == [2, 4] and curve.train_s == [3.0, 6.0] and curve.mean == [0.1, 0.3]
    assert curve.tasks == {"push-v3": [0.0, 0.1], "reach-v3": [0.2, 0.5]} and curve.episodes == [10, 10]
    steps, losses = validation_curve(path)
    assert steps == [2, 4] and losses == [0.9, 0.6]
    assert steps_to_reach(steps, losses, 0.8) == 4 and steps_to_reach(steps, losses, 0.5) is None


def test_steps_to_the_baselines_best_take_its_first_best_step_and_the_others_first_crossing() -> None:
    baseline = ([50, 100, 150, 200], [0.5, 0.3, 0.3, 0.4])  # best 0.3, first at 100
    assert steps_to_baseline_best(baseline, ([50, 100, 150], [0.4, 0.29, 0.1])) == (0.3, 100, 100)
    assert steps_to_baseline_best(baseline, ([50, 100], [0.31, 0.4])) == (0.3, 100, None)
    with pytest.raises(ValueError, match="no validation losses"):
        steps_to_baseline_best(([], []), baseline)
