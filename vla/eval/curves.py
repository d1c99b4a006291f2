"""Curves of a run read back from its metrics.jsonl: closed-loop success and validation loss over training.

A run with `trainer.closed_loop.every=K` evaluates in MetaWorld every K steps and at the end; each
evaluation is one `eval` record with success/<task>, success/mean, train_s (training seconds so far:
data + forward/backward + optimizer, evaluation excluded) and episodes. A resumed run re-logs the
steps after its checkpoint; the last record of a step wins.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class SuccessCurve:
    """Success against steps and training seconds. tasks: task -> success rate at each point."""

    steps: list[int] = field(default_factory=list)
    train_s: list[float | None] = field(default_factory=list)
    episodes: list[int | None] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    tasks: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (a torn last line from a killed run is ignored)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _last_per_step(records: list[dict[str, Any]], split: str, key: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.get("split") == split and key in record:
            out[int(record["step"])] = record
    return out


def success_curve(metrics_path: Path | str) -> SuccessCurve:
    """The closed-loop success curve of a run (empty when it never evaluated in closed loop)."""
    points = _last_per_step(read_metrics(metrics_path), "eval", "success/mean")
    curve = SuccessCurve()
    task_names = sorted(
        {k.removeprefix("success/") for r in points.values() for k in r if k.startswith("success/")}
        - {"mean"}
    )
    curve.tasks = {task: [] for task in task_names}
    for step in sorted(points):
        record = points[step]
        curve.steps.append(step)
        curve.train_s.append(record.get("train_s"))
        curve.episodes.append(int(record["episodes"]) if "episodes" in record else None)
        curve.mean.append(float(record["success/mean"]))
        for task in task_names:
            curve.tasks[task].append(float(record.get(f"success/{task}", float("nan"))))
    return curve


def validation_curve(metrics_path: Path | str) -> tuple[list[int], list[float]]:
    """(steps, validation losses) of a run."""
    points = _last_per_step(read_metrics(metrics_path), "val", "loss")
    steps = sorted(points)
    return steps, [float(points[s]["loss"]) for s in steps]


def steps_to_reach(steps: list[int], losses: list[float], target: float) -> int | None:
    """The first step whose validation loss is <= target (None if none is)."""
    return next((s for s, v in zip(steps, losses) if v <= target), None)


def steps_to_baseline_best(
    baseline: tuple[list[int], list[float]], other: tuple[list[int], list[float]]
) -> tuple[float, int, int | None]:
    """(the baseline's best validation loss, the first step it has it, the first step `other` reaches
    it: None if never). Both curves are (steps, losses) on the same validation set."""
    steps, losses = baseline
    if not losses:
        raise ValueError("the baseline run has no validation losses")
    best = min(losses)
    return best, steps[losses.index(best)], steps_to_reach(*other, best)
