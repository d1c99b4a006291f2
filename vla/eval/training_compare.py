"""Two arms of training runs compared up to a step, paired by training seed: validation loss and success.

For runs trained outside `scripts/study_optimizers.py`, e.g. the first 4000 steps of `experiment=metaworld_long`
with AdamW against the DMuon runs of the same preset. Each arm is a list of run directories in training-seed
order: arm a's i-th run and arm b's i-th run share a training seed, hence their validation episodes.

- Validation, per seed: a's best validation loss up to `step`, the first step it has it, and the first step
  b's run reaches it (`curves.steps_to_baseline_best` on both curves cut at `step`); the ratio b / a, and
  its mean over the seeds where both runs have a curve (None if b never reaches it in one of them).
- Closed-loop success at every step where both arms evaluated (up to `step`): each arm's mean over its runs
  and b - a with the two-level bootstrap over runs and episodes (`stats.success_difference`).

Where a run's outcomes at a step come from (task -> (successes, episodes)): the run's final report
(`closed_loop.json`, else `summary.json`'s `closed_loop`) when that step is its last (`summary.json`'s
`steps`), episode by episode, cut to the first `episodes` episode seeds of each task when given, so that
arms compare on the same episodes; else the `metrics.jsonl` eval record of that step (rate x episodes).
A directory holding only a `summary.json` (an archived run) gives its final outcomes and nothing else.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vla.eval.compare import ReportError, report_rows, run_outcomes
from vla.eval.curves import read_metrics, steps_to_baseline_best, success_curve, validation_curve
from vla.eval.stats import RunOutcomes, run_mean_success, seed_spread, success_difference


class RunError(ValueError):
    """A run directory that cannot be compared."""


@dataclass
class TrainingRun:
    """What a comparison needs from one run directory.

    success: step -> task -> (successes, episodes) from the metrics.jsonl eval records;
    final_episodes: task -> episode seed -> success, of the final report at final_step.
    """

    path: str
    final_step: int | None = None
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    success: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    final_episodes: dict[str, dict[int, bool]] = field(default_factory=dict)
    median_step_s: float | None = None


def load_run(run_dir: Path | str) -> TrainingRun:
    """Read a run directory (metrics.jsonl, summary.json, closed_loop.json; any may be missing)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: no such run directory")
    run = TrainingRun(str(run_dir))
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    summary = _read_json(summary_path) if summary_path.is_file() else {}
    if metrics_path.is_file():
        run.val_steps, run.val_loss = validation_curve(metrics_path)
        curve = success_curve(metrics_path)
        for i, step in enumerate(curve.steps):
            episodes = curve.episodes[i]
            if episodes:
                run.success[step] = {
                    task: (round(rates[i] * episodes), episodes)
                    for task, rates in curve.tasks.items()
                    if not math.isnan(rates[i])
                }
        step_s = [
            r["step_s"] for r in read_metrics(metrics_path) if r.get("split") == "train" and "step_s" in r
        ]
        run.median_step_s = statistics.median(step_s) if step_s else None
    report_path = run_dir / "closed_loop.json"
    if report_path.is_file():
        report, source = _read_json(report_path), report_path
    else:
        report, source = summary.get("closed_loop"), summary_path
    if report and summary.get("steps") is not None:
        run.final_step = int(summary["steps"])
        try:
            rows = report_rows(report, source)
        except ReportError as e:
            raise RunError(str(e)) from None
        for task, seed, success in rows:
            run.final_episodes.setdefault(str(task), {})[int(seed)] = bool(success)
    if not (run.val_steps or run.success or run.final_episodes):
        raise RunError(f"{run_dir}: no metrics.jsonl, and no summary.json with a final evaluation")
    return run


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{path}: not JSON ({e})") from None


def outcomes_at(run: TrainingRun, step: int, episodes: int | None = None) -> RunOutcomes | None:
    """task -> (successes, episodes) of `run` at `step`, or None where it did not evaluate there.

    episodes: use each task's first `episodes` episode seeds (a metrics.jsonl record holding more episodes
    than that cannot be cut, and is an error)."""
    if step == run.final_step and run.final_episodes:
        cut = {
            task: {s: results[s] for s in sorted(results)[:episodes]}
            for task, results in run.final_episodes.items()
        }
        return run_outcomes(cut)
    if step not in run.success:
        return None
    record = run.success[step]
    if episodes and any(n > episodes for _, n in record.values()):
        raise RunError(
            f"{run.path}: step {step} holds only rates over {max(n for _, n in record.values())} episodes per "
            f"task (metrics.jsonl), which cannot be cut to {episodes}; leave episodes unset"
        )
    return dict(record)


def _cut(steps: list[int], losses: list[float], up_to: int) -> tuple[list[int], list[float]]:
    kept = [(s, v) for s, v in zip(steps, losses) if s <= up_to]
    return [s for s, _ in kept], [v for _, v in kept]


def compare_training(
    a: Sequence[Path | str],
    b: Sequence[Path | str],
    up_to: int,
    *,
    names: tuple[str, str] = ("a", "b"),
    seeds: Sequence[int] | None = None,
    episodes: int | None = None,
    resamples: int = 20000,
) -> dict[str, Any]:
    """The comparison as a JSON-able dict: per seed validation, per step success (see the module doc)."""
    if len(a) != len(b) or not a:
        raise RunError(f"give each arm the same number of runs, one per training seed: {len(a)} and {len(b)}")
    seeds = list(seeds) if seeds is not None else list(range(len(a)))
    if len(seeds) != len(a):
        raise RunError(f"{len(seeds)} seeds named for {len(a)} runs per arm")
    runs_a, runs_b = [load_run(p) for p in a], [load_run(p) for p in b]
    validation = {}
    for seed, ra, rb in zip(seeds, runs_a, runs_b):
        curve_a, curve_b = _cut(ra.val_steps, ra.val_loss, up_to), _cut(rb.val_steps, rb.val_loss, up_to)
        if not curve_a[1] or not curve_b[1]:
            validation[str(seed)] = {"note": "no validation curve in one of the runs"}
            continue
        best, step_a, step_b = steps_to_baseline_best(curve_a, curve_b)
        validation[str(seed)] = {
            f"{names[0]}_best_val_loss": best,
            f"{names[0]}_step": step_a,
            f"{names[1]}_step": step_b,
            f"{names[1]}_best_val_loss": min(curve_b[1]),
            "ratio": step_b / step_a if step_b is not None else None,
        }
    ratios = [v.get("ratio") for v in validation.values() if "note" not in v]
    steps = sorted({s for r in [*runs_a, *runs_b] for s in [*r.success, r.final_step] if s and s <= up_to})
    success = {}
    for step in steps:
        arm_outcomes = []
        for runs in (runs_a, runs_b):
            arm_outcomes.append(
                {
                    str(seed): o
                    for seed, r in zip(seeds, runs)
                    if (o := outcomes_at(r, step, episodes)) is not None
                }
            )
        if not all(arm_outcomes):
            continue
        row: dict[str, Any] = {}
        for name, outcomes in zip(names, arm_outcomes):
            means = {seed: run_mean_success(o) for seed, o in outcomes.items()}
            tasks = sorted(next(iter(outcomes.values())))
            row[name] = {
                "runs": means,
                "spread": asdict(seed_spread(list(means.values()))),
                "tasks": {t: statistics.fmean(o[t][0] / o[t][1] for o in outcomes.values()) for t in tasks},
                "episodes": {seed: sorted({n for _, n in o.values()}) for seed, o in outcomes.items()},
            }
        difference = success_difference(
            list(arm_outcomes[0].values()), list(arm_outcomes[1].values()), resamples=resamples
        )
        row["difference"] = asdict(difference)
        success[str(step)] = row
    return {
        "names": list(names),
        "up_to": up_to,
        "seeds": seeds,
        "episodes": episodes,
        "runs": {names[0]: [str(p) for p in a], names[1]: [str(p) for p in b]},
        "median_step_s": {
            name: {str(seed): r.median_step_s for seed, r in zip(seeds, runs)}
            for name, runs in zip(names, (runs_a, runs_b))
        },
        "validation": validation,
        "mean_ratio": statistics.fmean(ratios) if ratios and None not in ratios else None,
        "success": success,
    }


def _pct(x: float, sign: bool = False) -> str:
    return f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}%"


def format_report(report: dict[str, Any]) -> str:
    """Markdown tables of a compare_training result."""
    a, b = report["names"]
    lines = [
        f"Validation (up to step {report['up_to']}): the steps {b} needs to reach {a}'s best loss, per seed",
        "",
        f"| seed | {a} best val loss (step) | {b} reaches it at | ratio | {b} best val loss |",
        "|---|---|---|---|---|",
    ]
    for seed, v in report["validation"].items():
        if "note" in v:
            lines.append(f"| {seed} | {v['note']} | | | |")
            continue
        ratio = "never" if v["ratio"] is None else f"{v['ratio']:.2f}x"
        lines.append(
            f"| {seed} | {v[f'{a}_best_val_loss']:.4f} ({v[f'{a}_step']}) | {v[f'{b}_step'] or 'never'} | "
            f"{ratio} | {v[f'{b}_best_val_loss']:.4f} |"
        )
    mean_ratio = report["mean_ratio"]
    lines += ["", f"mean ratio: {'n/a' if mean_ratio is None else f'{mean_ratio:.2f}x'}", ""]
    lines += [
        "Closed-loop success (mean over tasks; per run; b - a with the two-level bootstrap over runs and episodes)",
        "",
        f"| step | {a} runs | {a} mean | {b} runs | {b} mean | {b} - {a} [95%] |",
        "|---|---|---|---|---|---|",
    ]
    for step, row in report["success"].items():
        d = row["difference"]
        cells = []
        for name in (a, b):
            runs = ", ".join(
                f"s{seed} {_pct(m)} ({'/'.join(map(str, row[name]['episodes'][seed]))})"
                for seed, m in row[name]["runs"].items()
            )
            cells += [runs, _pct(row[name]["spread"]["mean"])]
        ci = f"[{_pct(d['ci'][0], True)}, {_pct(d['ci'][1], True)}]"
        lines.append(
            f"| {step} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {_pct(d['difference'], True)} {ci} |"
        )
    return "\n".join(lines)
