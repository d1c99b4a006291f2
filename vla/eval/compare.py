"""Compare two policies from their closed-loop evaluation reports, with intervals.

An arm is one policy setting; it holds one or more runs (training seeds), and each run is given as the
reports of its evaluations (the trainer's `closed_loop.json`, `scripts/eval_sim.py --json` files), which
together may cover several seed sets. For each run: success per task with its Wilson interval and the
mean with its normal interval. For each arm (`summarize`, which also serves one arm alone): the mean over
its runs with the two-level bootstrap interval (`stats.arm_mean_interval`), the runs' spread, and per
task the mean, min and max over runs. Between the arms, b - a:

- paired, where both arms played the very same episodes (same tasks, same episode seeds): per
  episode each arm's mean over its runs, then `stats.paired_difference`; per task the episodes won
  and lost;
- the two-level bootstrap (`stats.success_difference`: runs, then each run's episodes; the arms
  unpaired), which is what carries the spread between training seeds into the interval.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vla.eval.closed_loop import wilson_interval
from vla.eval.stats import (
    EpisodeOutcomes,
    RunOutcomes,
    arm_mean_interval,
    mean_success_interval,
    paired_difference,
    seed_spread,
    success_difference,
)


class ReportError(ValueError):
    """An evaluation report that cannot be read or combined."""


def report_rows(report: Any, source: Path | str) -> list[tuple[str, int, bool]]:
    """(task, episode seed, success) of every episode of one closed-loop report (a parsed JSON dict)."""
    try:
        return [(t["task"], r["seed"], r["success"]) for t in report["tasks"] for r in t["results"]]
    except (KeyError, TypeError) as e:
        raise ReportError(
            f"{source}: not a closed-loop report (missing {e}); give the JSON that scripts/eval_sim.py "
            "--json or a run's closed_loop.json holds"
        ) from None


def read_run(paths: Sequence[Path | str]) -> dict[str, dict[int, bool]]:
    """One run's episodes from its evaluation reports: task -> episode seed -> success.

    A directory stands for the run's `closed_loop.json` (the trainer's final evaluation).

    Reports of different seed sets merge; an episode (task, seed) found twice is an error, since
    counting it twice would narrow every interval.
    """
    episodes: dict[str, dict[int, bool]] = {}
    owner: dict[tuple[str, int], Path] = {}
    for path in map(Path, paths):
        if path.is_dir():  # a run directory stands for its own final evaluation
            path = path / "closed_loop.json"
        if not path.is_file():
            raise ReportError(f"{path}: no such evaluation report")
        try:
            report = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReportError(f"{path}: not JSON ({e})") from None
        for task, seed, success in report_rows(report, path):
            key = (str(task), int(seed))
            if key in owner:
                raise ReportError(
                    f"{path}: episode {task} seed {seed} is also in {owner[key]}; give each seed set once"
                )
            owner[key] = path
            episodes.setdefault(key[0], {})[key[1]] = bool(success)
    if not episodes:
        raise ReportError(f"{', '.join(map(str, paths))}: no episodes")
    return episodes


def run_outcomes(run: dict[str, dict[int, bool]]) -> RunOutcomes:
    return {task: (sum(seeds.values()), len(seeds)) for task, seeds in run.items()}


def _episode_means(runs: Sequence[dict[str, dict[int, bool]]]) -> EpisodeOutcomes | None:
    """Per episode the mean over runs, or None where the runs did not all play the same episodes."""
    keys = {task: sorted(seeds) for task, seeds in runs[0].items()}
    if any({task: sorted(seeds) for task, seeds in run.items()} != keys for run in runs[1:]):
        return None
    return {
        task: {seed: statistics.fmean(float(run[task][seed]) for run in runs) for seed in seeds}
        for task, seeds in keys.items()
    }


def _run_summary(run: dict[str, dict[int, bool]]) -> dict[str, Any]:
    outcomes = run_outcomes(run)
    mean = mean_success_interval(outcomes)
    return {
        "mean_success": mean.mean,
        "ci95": list(mean.ci),
        "tasks": {
            task: {"successes": s, "episodes": n, "success_rate": s / n, "ci95": list(wilson_interval(s, n))}
            for task, (s, n) in outcomes.items()
        },
    }


def _arm_mean(runs: Sequence[dict[str, dict[int, bool]]], resamples: int, seed: int) -> dict[str, Any]:
    outcomes = [run_outcomes(run) for run in runs]
    mean = arm_mean_interval(outcomes, resamples=resamples, seed=seed)
    rates = {task: [o[task][0] / o[task][1] for o in outcomes] for task in outcomes[0]}
    return {**asdict(mean), "tasks": {task: asdict(seed_spread(r)) for task, r in rates.items()}}


def summarize(
    arms: dict[str, Sequence[dict[str, dict[int, bool]]]], *, resamples: int = 20000, seed: int = 0
) -> dict[str, Any]:
    """Each arm's runs (`read_run`) and its mean over them, as JSON-ready dicts."""
    arm_means = {}
    for name, runs in arms.items():
        try:  # also checks that the arm has runs and that they all hold the same tasks
            arm_means[name] = _arm_mean(runs, resamples, seed)
        except ValueError as exc:
            raise ReportError(f"{name}: {exc}") from None
    return {
        "arms": {name: [_run_summary(run) for run in runs] for name, runs in arms.items()},
        "arm_means": arm_means,
    }


def compare(
    a: Sequence[dict[str, dict[int, bool]]],
    b: Sequence[dict[str, dict[int, bool]]],
    *,
    names: tuple[str, str] = ("a", "b"),
    resamples: int = 20000,
    seed: int = 0,
) -> dict[str, Any]:
    """The comparison report (JSON-ready) of arm b against arm a, each a list of runs (`read_run`)."""
    try:  # also checks that there are runs on both sides and that they all hold the same tasks
        boot = success_difference(
            [run_outcomes(r) for r in a], [run_outcomes(r) for r in b], resamples=resamples, seed=seed
        )
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    means_a, means_b = _episode_means(a), _episode_means(b)
    paired = None
    if means_a is not None and means_b is not None:
        with contextlib.suppress(ValueError):  # different episodes: only the unpaired bootstrap applies
            paired = paired_difference(means_a, means_b)
    return {
        **summarize(dict(zip(names, (a, b))), resamples=resamples, seed=seed),
        "difference": f"{names[1]} - {names[0]}",
        "paired": None if paired is None else asdict(paired),
        "two_level_bootstrap": {**asdict(boot), "runs": [len(a), len(b)]},
    }


def _pct(x: float, sign: bool = False) -> str:
    return f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"


def _interval(value: float, ci: Sequence[float], sign: bool = False) -> str:
    """A rate as "88.3% [86.3, 90.3]", a difference (sign) in points as "+4.3 [+2.8, +5.8]"."""
    unit = "" if sign else "%"
    return f"{_pct(value, sign)}{unit} [{_pct(ci[0], sign)}, {_pct(ci[1], sign)}]"


def format_report(report: dict[str, Any]) -> str:
    """A short text table of `compare`'s or `summarize`'s report (percentages)."""
    lines = []
    for name, runs in report["arms"].items():
        for k, run in enumerate(runs):
            label = name if len(runs) == 1 else f"{name} run {k + 1}"
            lines.append(f"{label}: mean {_interval(run['mean_success'], run['ci95'])}")
            for task, t in run["tasks"].items():
                count = f"{t['successes']:>4}/{t['episodes']:<4}"
                lines.append(f"  {task:<24} {count} {_interval(t['success_rate'], t['ci95'])}")
        arm = report["arm_means"][name]
        spread = arm["spread"]
        if spread["seeds"] > 1:
            lines.append(
                f"{name}, mean over its {spread['seeds']} runs: {_interval(arm['mean'], arm['ci'])} (two-level "
                f"bootstrap); runs {_pct(spread['min'])}-{_pct(spread['max'])}%, sd {_pct(spread['std'])}"
            )
            for task, t in arm["tasks"].items():
                lines.append(f"  {task:<24} {_pct(t['mean'])}% (runs {_pct(t['min'])}-{_pct(t['max'])}%)")
    if "difference" not in report:
        return "\n".join(lines) + "\n(95% intervals)"
    paired, diff = report["paired"], report["difference"]
    if paired is None:
        lines.append(f"{diff}, paired: not available (the arms played different episodes)")
    else:
        lines.append(
            f"{diff}, paired over the same episodes: {_interval(paired['difference'], paired['ci'], True)}"
        )
        for task, t in paired["tasks"].items():
            won = f"won {t['won']}, lost {t['lost']} of {t['episodes']}"
            lines.append(f"  {task:<24} {_interval(t['difference'], t['ci'], True)}  {won}")
    boot = report["two_level_bootstrap"]
    runs_a, runs_b = boot["runs"]
    lines.append(
        f"{diff}, two-level bootstrap ({runs_a} and {runs_b} runs, then episodes; {boot['resamples']} "
        f"resamples): {_interval(boot['difference'], boot['ci'], True)}"
    )
    return "\n".join(lines) + "\n(differences in percentage points; 95% intervals)"
