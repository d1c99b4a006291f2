"""AdamW vs DMuon on MetaWorld over several training seeds: learning rates, curves, success with intervals.

    # the documented study (its finished runs are in docs/study/archive, so this reuses them)
    python scripts/study_optimizers.py --out outputs/study --archive docs/study/archive \\
        --also adamw=5e-4 --budgets 0.65
    # tables and plots only: the same with --report

Every run is `train.py experiment=metaworld` (the MetaWorld recipe: model, data, augmentation,
schedule) with the optimizer, learning rate and training seed set here, the same data and the same
budget in steps, and closed-loop success measured during training (every --eval-every steps on
--curve-episodes episodes per task) and at the end (--episodes per task, seeds from --eval-seed).

1. Learning rates, chosen on validation loss (never on the success seeds that are reported): each
   optimizer runs its --adamw-lrs / --dmuon-lrs at training seed --seeds[0]; the lr with the lowest
   validation loss wins. That run is the optimizer's first seed (its success was not used to pick it).
2. Seeds: the winning lr of each optimizer on the other --seeds (AdamW and DMuon of one seed side by side).
3. Naive Muon (every rank does all the work) and a DMuon twin run --muon-steps steps of the same
   schedule: the exactness check (same update, so the same losses).
4. Sensitivity arms (--also adamw=5e-4,...): other lrs run on every seed too and are set against the
   other optimizer's chosen lr. They are not the protocol's choice and are reported apart, as what
   the difference would be had that lr been chosen (e.g. an lr whose validation loss lost narrowly).
5. Short budgets (--budgets 0.65,...): DMuon at its chosen lr on every seed with trainer.steps and
   trainer.schedule_steps a fraction of the budget, so its schedule ends there. Within one run the cosine
   schedule makes both optimizers take their last gains as the lr anneals, so where DMuon's curve crosses
   AdamW's best understates how much shorter a DMuon run can be; a run whose own schedule is shorter is
   what a user who trains for fewer steps gets. Reported per seed: does it reach AdamW's best validation
   loss of the same seed (and at which step), and its success against AdamW's full runs.

Reported per optimizer: final success (mean, spread and per task over seeds), success against steps
and against training seconds (step x the run's median step time) with seed bands, the steps each seed
needs to reach AdamW's best validation loss of the same seed (each seed holds out its own validation
episodes), and the difference in mean success (DMuon - AdamW)
with a 95% bootstrap interval over seeds and episodes (vla.eval.stats); per task, the distance of the
evaluation layouts to the nearest demonstration (vla.sim.layouts).

Runs go --parallel at a time (one intra-op thread each). Resumable: a finished run (summary.json with
every step) is reused, an interrupted one resumes from its last checkpoint. With --archive DIR each
finished run's records (config.yaml, metrics.jsonl, summary.json, closed_loop.json: no weights, ~1 MB)
are copied to DIR/<run>/ and a run found there is reused on any machine, so a study longer than one
machine's lifetime goes on where the last machine stopped (the documented study keeps its archive in
docs/study/archive). A reused run's config.yaml must match what the study gives it now (its training
settings and closed-loop evaluation; vla.training.resume decides which keys count): a preset changed
since it ran is refused with every difference named. Writes to --out:
    runs/<optimizer>_lr<lr>_seed<seed>/   each training run (its output_dir)
    study.json                            every number below
    val_loss.png                          validation loss against step and seconds, mean and seed band
    success_curve.png                     closed-loop success against step and seconds, mean and band
    success.png                           final success per task, mean over seeds with the seeds' range
and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vla.eval.curves import (  # noqa: E402
    read_metrics,
    steps_to_baseline_best,
    success_curve,
    validation_curve,
)
from vla.eval.stats import seed_spread, success_difference  # noqa: E402

OPTIMIZERS = ("adamw", "dmuon")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=lambda prog: argparse.ArgumentDefaultsHelpFormatter(prog, width=110),
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/study"), help="study directory")
    parser.add_argument(
        "--experiment", default="metaworld", help="configs/experiment preset every run starts from"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (default: the preset's)"
    )
    parser.add_argument("--seeds", default="0,1,2", help="training seeds; the first also picks the lr")
    parser.add_argument("--adamw-lrs", default="5e-4,1e-3,2e-3")
    parser.add_argument("--dmuon-lrs", default="0.005,0.01,0.02")
    parser.add_argument(
        "--dmuon-adamw-lr", type=float, default=None, help="DMuon's AdamW side (default: preset's)"
    )
    parser.add_argument(
        "--also",
        default="",
        help="sensitivity arms, optimizer=lr,... (e.g. adamw=5e-4): every seed, reported apart",
    )
    parser.add_argument(
        "--budgets",
        default="",
        help="short budgets, fractions of the study's steps (e.g. 0.7): DMuon at its chosen lr on every seed "
        "with a schedule that ends there; reported: does it reach AdamW's best validation loss, and success",
    )
    parser.add_argument("--muon-steps", type=int, default=30, help="naive Muon check steps (0: skip)")
    parser.add_argument("--eval-every", type=int, default=500, help="closed-loop evaluation interval (steps)")
    parser.add_argument("--curve-episodes", type=int, default=20, help="episodes per task at each interval")
    parser.add_argument("--episodes", type=int, default=50, help="episodes per task at the final step")
    parser.add_argument("--eval-seed", type=int, default=1000, help="first evaluation seed")
    parser.add_argument("--parallel", type=int, default=2, help="runs trained at once (cores shared out)")
    parser.add_argument("--resamples", type=int, default=20000, help="bootstrap resamples")
    parser.add_argument("--report", action="store_true", help="only collect finished runs and report")
    parser.add_argument(
        "--archive",
        type=Path,
        default=None,
        help="copy each finished run's records here, and reuse the runs found here (see above)",
    )
    parser.add_argument(
        "--train-arg", action="append", default=[], help="extra train.py override (repeatable)"
    )
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.lrs = {"adamw": _floats(args.adamw_lrs), "dmuon": _floats(args.dmuon_lrs)}
    if not args.seeds or not all(args.lrs.values()):
        parser.error("--seeds, --adamw-lrs and --dmuon-lrs need at least one value each")
    try:
        args.budget_fractions = _floats(args.budgets)
    except ValueError:
        args.budget_fractions = [math.nan]
    if not all(0 < f < 1 for f in args.budget_fractions):
        parser.error(f"--budgets takes fractions between 0 and 1 of the study's steps, got {args.budgets!r}")
    args.also_arms = []
    for item in (x.strip() for x in args.also.split(",")):
        if not item:
            continue
        optimizer, _, value = (part.strip() for part in item.partition("="))
        try:
            lr = float(value)
        except ValueError:
            lr = None
        if optimizer not in OPTIMIZERS or lr is None:
            parser.error(f"--also takes optimizer=lr items with optimizer in {OPTIMIZERS}, got {item!r}")
        args.also_arms.append((optimizer, lr))
    return args


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


class Job(NamedTuple):
    """One training run of the study."""

    optimizer: str
    lr: float
    seed: int
    steps: int | None = None  # an exactness-check run: the first `steps` of the full schedule, no evaluation
    budget: int | None = None  # a short-budget run: its own, shorter schedule, evaluated as the others


def run_name(
    optimizer: str, lr: float, seed: int, steps: int | None = None, budget: int | None = None
) -> str:
    """A run's directory name; exactness-check runs add their steps, short-budget runs their budget."""
    name = f"{optimizer}_lr{lr:g}_seed{seed}"
    if steps is not None:
        return f"{name}_{steps}steps"
    return name if budget is None else f"{name}_budget{budget}"


def budgets(args: argparse.Namespace) -> list[int]:
    """The short budgets in steps, shortest first."""
    return sorted({max(1, round(f * args.budget)) for f in args.budget_fractions})


def job_steps(args: argparse.Namespace, job: Job) -> int:
    """The steps a finished run of `job` has trained."""
    return job.steps or job.budget or args.budget


# What a finished run leaves that the report reads: the archive keeps these, never checkpoints or weights.
RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "closed_loop.json")


def _summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def finished(run_dir: Path, steps: int) -> bool:
    done = _summary(run_dir)
    return (
        done is not None
        and done.get("status", "finished") == "finished"
        and not done.get("stopped_early")
        and done["steps"] >= steps
    )


def archive_run(args: argparse.Namespace, run_dir: Path) -> None:
    """Copy a finished run's RECORDS into the archive (atomically per file; a copy there is replaced)."""
    if args.archive is None:
        return
    from vla.atomic import write_file_atomically

    target = args.archive / run_dir.name
    target.mkdir(parents=True, exist_ok=True)
    for name in RECORDS:
        if (run_dir / name).is_file():
            write_file_atomically(target / name, lambda tmp, src=run_dir / name: shutil.copyfile(src, tmp))


def records_dir(args: argparse.Namespace, name: str, steps: int) -> Path:
    """Where a run's records are read from: its run directory when it finished there, else its archived
    copy when there is one, else the run directory (a run still under way)."""
    run_dir = args.out / "runs" / name
    if finished(run_dir, steps) or args.archive is None:
        return run_dir
    archived = args.archive / name
    return archived if finished(archived, steps) else run_dir


# What a reused run must share with the study besides its training trajectory: how it was evaluated.
MEASUREMENT_KEYS = tuple(
    f"trainer.closed_loop.{k}"
    for k in ("episodes", "final_episodes", "every", "tasks", "seed", "replan_every", "max_episode_steps")
)


def check_reused(args: argparse.Namespace, job: Job | tuple, source: Path) -> None:
    """Exit naming every difference when the finished run at `source` was trained or evaluated with other
    settings than this study gives it now (say the preset's cameras changed after it was archived): its
    numbers would otherwise enter the tables as if they came from the current settings."""
    from vla.training.cli import compose
    from vla.training.resume import compare_config, saved_config

    saved = saved_config({}, source)
    if saved is None:
        return
    job = Job(*job)
    overrides = train_overrides(args, job.optimizer, job.lr, job.seed, source, job.steps, job.budget)
    cfg = compose([o for o in overrides if not o.startswith("trainer.resume=")])
    problems, _ = compare_config(saved, cfg, also_refuse=MEASUREMENT_KEYS)
    if problems:
        listing = "\n  ".join(problems)
        raise SystemExit(
            f"{source} was run with other settings than this study gives it now (saved -> now):\n  {listing}\n"
            f"Its results cannot stand for the current settings: pass the saved values with --train-arg to "
            f"report the study as it was run, or move {source} away to train it again with the new ones."
        )


def preset_steps(args: argparse.Namespace) -> int:
    """The step budget of the runs: --steps, else the experiment preset's trainer.steps."""
    if args.steps is not None:
        return args.steps
    from vla.training.cli import compose

    return compose([f"experiment={args.experiment}", *args.train_arg]).trainer.steps


def train_overrides(
    args: argparse.Namespace,
    optimizer: str,
    lr: float,
    seed: int,
    run_dir: Path,
    steps: int | None,
    budget: int | None = None,
) -> list[str]:
    """train.py overrides of one run; steps: None for a study run, N for an exactness-check run; budget:
    None for a run of the study's budget, N for a short-budget run (its schedule spans N steps)."""
    schedule = budget or args.budget
    overrides = [
        f"experiment={args.experiment}",
        f"optim={optimizer}",
        f"optim.lr={lr}",
        f"trainer.seed={seed}",
        f"trainer.steps={steps or schedule}",
        f"trainer.schedule_steps={schedule}",  # a check run follows the first steps of the full schedule
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        f"output_dir={run_dir}",
    ]
    if steps is not None:
        overrides.append("trainer.closed_loop.episodes=0")
    else:
        overrides += [
            f"trainer.closed_loop.every={args.eval_every}",
            f"trainer.closed_loop.episodes={args.curve_episodes}",
            f"trainer.closed_loop.final_episodes={args.episodes}",
            f"trainer.closed_loop.seed={args.eval_seed}",
        ]
    if optimizer != "adamw" and args.dmuon_adamw_lr is not None:
        overrides.append(f"optim.adamw_lr={args.dmuon_adamw_lr}")
    # auto: continues an interrupted run, and starts a new dir (or one stopped before its first checkpoint) afresh
    overrides.append("trainer.resume=auto")
    return [*overrides, *args.train_arg]


def launch(args: argparse.Namespace, job: Job | tuple) -> subprocess.Popen | None:
    """Start one train.py run (resumed when interrupted); None when it finished earlier."""
    job = Job(*job)
    run_dir = args.out / "runs" / run_name(*job)
    if finished(run_dir, job_steps(args, job)):
        check_reused(args, job, run_dir)
        print(f"  {run_dir.name}: finished earlier, reused", flush=True)
        archive_run(args, run_dir)
        return None
    if args.archive is not None and finished(args.archive / run_dir.name, job_steps(args, job)):
        check_reused(args, job, args.archive / run_dir.name)
        print(f"  {run_dir.name}: archived in {args.archive}, reused", flush=True)
        return None
    overrides = train_overrides(args, job.optimizer, job.lr, job.seed, run_dir, job.steps, job.budget)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"  {run_dir.name}: training ...", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.parallel > 1:  # share the cores out: one intra-op thread per run
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.parallel))
    log = open(run_dir / "train.log", "a")  # noqa: SIM115 (closed by wait())
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    process.run_dir, process.log, process.started = run_dir, log, time.perf_counter()  # type: ignore[attr-defined]
    return process


def wait(args: argparse.Namespace, process: subprocess.Popen) -> None:
    returncode = process.wait()
    process.log.close()  # type: ignore[attr-defined]
    run_dir = process.run_dir  # type: ignore[attr-defined]
    if returncode != 0:
        raise SystemExit(f"{run_dir.name} failed (exit {returncode}); see {run_dir / 'train.log'}")
    print(f"  {run_dir.name}: done in {time.perf_counter() - process.started:.0f} s", flush=True)  # type: ignore[attr-defined]
    archive_run(args, run_dir)


def train_all(args: argparse.Namespace, jobs: list[Job]) -> None:
    """Run the jobs, `args.parallel` at a time, in the order given."""
    for first in range(0, len(jobs), args.parallel):
        started = [launch(args, job) for job in jobs[first : first + args.parallel]]
        for process in started:
            if process is not None:
                wait(args, process)


def _interleave(a: list, b: list) -> list:
    out = [x for pair in zip(a, b) for x in pair]
    return out + a[len(b) :] + b[len(a) :]


def collect_run(run_dir: Path) -> dict[str, Any]:
    """Curves and the final closed-loop outcomes of one run directory."""
    records = read_metrics(run_dir / "metrics.jsonl")
    train = {int(r["step"]): r for r in records if r.get("split") == "train" and "step_s" in r}
    # seconds = step x the run's median step time: medians shrug off the machine's passing load
    median_step_s = statistics.median(r["step_s"] for r in train.values()) if train else math.nan
    val_steps, val_loss = validation_curve(run_dir / "metrics.jsonl")
    success = success_curve(run_dir / "metrics.jsonl")
    final_path = run_dir / "closed_loop.json"
    final = json.loads(final_path.read_text()) if final_path.is_file() else None
    return {
        "dir": str(run_dir),
        "median_step_s": median_step_s,
        "median_optimizer_s": statistics.median(r["optimizer_s"] for r in train.values())
        if train
        else math.nan,
        "train_steps": sorted(train),
        "train_loss": [train[s]["loss"] for s in sorted(train)],
        "val_steps": val_steps,
        "val_loss": val_loss,
        "val_seconds": [s * median_step_s for s in val_steps],
        "success_curve": success.to_dict() | {"seconds": [s * median_step_s for s in success.steps]},
        "final": None
        if final is None
        else {
            "step": success.steps[-1] if success.steps else None,
            "mean_success": final["mean_success"],
            "tasks": {
                t["task"]: {"successes": t["successes"], "episodes": t["episodes"], "ci95": t["ci95"]}
                for t in final["tasks"]
            },
        },
    }


def _outcomes(run: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {task: (t["successes"], t["episodes"]) for task, t in run["final"]["tasks"].items()}


def paired_steps(
    args: argparse.Namespace, runs: dict[str, dict[str, Any]], per: dict[str, Any]
) -> dict[str, Any]:
    """Per training seed: AdamW's best validation loss, the step it has it, and the steps DMuon's run of
    the same seed needs to reach it. Paired by seed, because each seed holds out its own validation
    episodes (the split follows trainer.seed), so losses of different seeds are not on one scale and a
    mean over seeds would mix them. ratio: mean over seeds of DMuon's / AdamW's steps (None where a
    DMuon seed never reaches its target)."""
    seeds: dict[str, Any] = {}
    for seed in args.seeds:
        adamw, dmuon = (runs.get(run_name(o, per[o]["lr"], seed)) for o in ("adamw", "dmuon"))
        if adamw is None or dmuon is None or adamw["final"] is None or dmuon["final"] is None:
            continue
        seeds[str(seed)] = _steps_to_adamw_best(adamw, dmuon)
    return {"seeds": seeds, "ratio": _mean_ratio(seeds)}


def _steps_to_adamw_best(adamw: dict[str, Any], dmuon: dict[str, Any]) -> dict[str, Any]:
    """AdamW's best validation loss, the step it has it, the step DMuon's run reaches it (None: never)."""
    best, adamw_step, dmuon_step = steps_to_baseline_best(
        (adamw["val_steps"], adamw["val_loss"]), (dmuon["val_steps"], dmuon["val_loss"])
    )
    return {
        "adamw_best_val_loss": best,
        "adamw_step": adamw_step,
        "dmuon_step": dmuon_step,
        "ratio": dmuon_step / adamw_step if dmuon_step is not None else None,
    }


def _mean_ratio(seeds: dict[str, Any]) -> float | None:
    """The mean of the seeds' ratios; None when there are none or a seed never reached its target."""
    ratios = [row["ratio"] for row in seeds.values()]
    return statistics.fmean(ratios) if ratios and None not in ratios else None


def summarise(
    args: argparse.Namespace, runs: dict[str, dict[str, Any]], best: dict[str, float]
) -> dict[str, Any]:
    """Per optimizer: seeds, final success spread, per-task means; the steps DMuon needs to AdamW's best
    validation loss (paired by seed) and the DMuon - AdamW difference with its bootstrap interval."""
    per: dict[str, Any] = {}
    for optimizer in OPTIMIZERS:
        names = [run_name(optimizer, best[optimizer], s) for s in args.seeds if optimizer in best]
        names = [n for n in names if n in runs and runs[n]["final"] is not None]
        if not names:
            continue
        finals = [runs[n]["final"]["mean_success"] for n in names]
        tasks = sorted(runs[names[0]]["final"]["tasks"])
        per[optimizer] = {
            "lr": best[optimizer],
            "runs": names,
            "final_success": asdict(seed_spread(finals)),
            "final_success_per_seed": dict(zip(names, finals)),
            "tasks": {
                t: asdict(
                    seed_spread(
                        [
                            runs[n]["final"]["tasks"][t]["successes"]
                            / runs[n]["final"]["tasks"][t]["episodes"]
                            for n in names
                        ]
                    )
                )
                for t in tasks
            },
            "median_step_s": statistics.median(runs[n]["median_step_s"] for n in names),
        }
    if "adamw" in per and "dmuon" in per:
        per["steps_to_adamw_best"] = paired_steps(args, runs, per)
        difference = success_difference(
            [_outcomes(runs[n]) for n in per["adamw"]["runs"]],
            [_outcomes(runs[n]) for n in per["dmuon"]["runs"]],
            resamples=args.resamples,
        )
        per["difference"] = asdict(difference)
    return per


def lr_sensitivity(
    args: argparse.Namespace, runs: dict[str, dict[str, Any]], best: dict[str, float]
) -> dict[str, Any]:
    """At the first seed, DMuon at its chosen lr minus AdamW at every lr of the sweep (episodes only).

    Not a selection (the lrs were chosen on validation loss): it says how much the difference rests
    on AdamW's lr, e.g. where the lr with the lower validation loss is not the one that succeeds more.
    """
    if "dmuon" not in best:
        return {}
    first = args.seeds[0]
    twin = runs.get(run_name("dmuon", best["dmuon"], first))
    if twin is None or twin["final"] is None:
        return {}
    rows: dict[str, Any] = {}
    for lr in args.lrs["adamw"]:
        run = runs.get(run_name("adamw", lr, first))
        if run is None or run["final"] is None:
            continue
        difference = success_difference([_outcomes(run)], [_outcomes(twin)], resamples=args.resamples)
        rows[f"{lr:g}"] = {
            "adamw_lr": lr,
            "chosen": lr == best.get("adamw"),
            "best_val_loss": min(run["val_loss"]) if run["val_loss"] else None,
            "adamw_success": run["final"]["mean_success"],
            "difference": asdict(difference),
        }
    return {"dmuon_lr": best["dmuon"], "seed": first, "against_adamw_lr": rows}


def sensitivity_arms(
    args: argparse.Namespace, runs: dict[str, dict[str, Any]], per: dict[str, Any]
) -> dict[str, Any]:
    """Each --also arm over its finished seeds, and DMuon - AdamW with it in place of its optimizer's
    chosen lr (bootstrap over seeds and episodes, as the main difference)."""
    arms: dict[str, Any] = {}
    for optimizer, lr in args.also_arms:
        names = [run_name(optimizer, lr, s) for s in args.seeds]
        names = [n for n in names if n in runs and runs[n]["final"] is not None]
        other = "dmuon" if optimizer == "adamw" else "adamw"
        if not names or other not in per:
            continue
        mine = [_outcomes(runs[n]) for n in names]
        theirs = [_outcomes(runs[n]) for n in per[other]["runs"]]
        adamw, dmuon = (mine, theirs) if optimizer == "adamw" else (theirs, mine)
        arms[f"{optimizer}_lr{lr:g}"] = {
            "optimizer": optimizer,
            "lr": lr,
            "chosen": per.get(optimizer, {}).get("lr") == lr,
            "runs": names,
            "final_success": asdict(seed_spread([runs[n]["final"]["mean_success"] for n in names])),
            "against": {"optimizer": other, "lr": per[other]["lr"], "runs": per[other]["runs"]},
            "difference": asdict(success_difference(adamw, dmuon, resamples=args.resamples)),
        }
    return arms


def short_budgets(
    args: argparse.Namespace, runs: dict[str, dict[str, Any]], per: dict[str, Any]
) -> dict[str, Any]:
    """Per short budget: DMuon at its chosen lr trained with a schedule that ends at that budget, paired by
    seed with AdamW's full-budget run: AdamW's best validation loss, the step the short run reaches it
    (None: never) and its final loss; then the short runs' final success and DMuon(short) - AdamW(full)
    with its bootstrap interval.

    Why: within one run the cosine schedule makes both optimizers take their last gains as the lr anneals
    at the end, so the step where DMuon's curve crosses AdamW's best understates how much shorter a DMuon
    run can be. A run whose own schedule ends at the budget is what a user who shortens training gets.
    ratio: mean over seeds of (step reached / AdamW's step at its best), as `steps_to_adamw_best`;
    budget_ratio: budget / the study's steps."""
    if "adamw" not in per or "dmuon" not in per:
        return {}
    rows: dict[str, Any] = {}
    for budget in budgets(args):
        seeds: dict[str, Any] = {}
        names = []
        for seed in args.seeds:
            adamw = runs.get(run_name("adamw", per["adamw"]["lr"], seed))
            name = run_name("dmuon", per["dmuon"]["lr"], seed, budget=budget)
            short = runs.get(name)
            if adamw is None or short is None or short["final"] is None or not adamw["val_loss"]:
                continue
            names.append(name)
            seeds[str(seed)] = _steps_to_adamw_best(adamw, short) | {
                "dmuon_final_val_loss": short["val_loss"][-1] if short["val_loss"] else None
            }
        if not names:
            continue
        paired_seeds = {runs[n]["seed"] for n in names}
        adamw_runs = [n for n in per["adamw"]["runs"] if runs[n]["seed"] in paired_seeds]
        rows[str(budget)] = {
            "budget": budget,
            "budget_ratio": budget / args.budget,
            "runs": names,
            "seeds": seeds,
            "reached": sum(row["ratio"] is not None for row in seeds.values()),
            "ratio": _mean_ratio(seeds),
            "final_success": asdict(seed_spread([runs[n]["final"]["mean_success"] for n in names])),
            "against": {"lr": per["adamw"]["lr"], "runs": adamw_runs},
            "difference": asdict(
                success_difference(
                    [_outcomes(runs[n]) for n in adamw_runs],
                    [_outcomes(runs[n]) for n in names],
                    resamples=args.resamples,
                )
            ),
        }
    return rows


def layout_distances(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Per task: how far the evaluation layouts are from the demonstrations of the runs' dataset."""
    from vla.eval.policy_runner import run_dataset_root
    from vla.sim.demos import training_seeds
    from vla.sim.layouts import layout_report

    finals = [r for r in runs.values() if r["final"] is not None]
    if not finals:
        return None
    root = run_dataset_root(Path(finals[0]["dir"]))
    trained = training_seeds(root) if root is not None else {}
    episodes = max(t["episodes"] for t in finals[0]["final"]["tasks"].values())
    seeds = range(args.eval_seed, args.eval_seed + episodes)
    return {
        task: layout_report(task, seeds, trained[task])
        for task in finals[0]["final"]["tasks"]
        if trained.get(task)
    }


def plot_curves(study: dict[str, Any], path: Path, key: str) -> None:
    """Mean over seeds and the seeds' range, against step (left) and seconds (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {"adamw": "tab:blue", "dmuon": "tab:red"}
    # The chosen lrs solid with their bands; sensitivity arms dashed, mean only (reported apart).
    lines = [
        (optimizer, entry, "-", True)
        for optimizer, entry in study["optimizers"].items()
        if optimizer in colours
    ]
    lines += [
        (arm["optimizer"], arm, "--", False)
        for arm in (study.get("sensitivity_arms") or {}).values()
        if arm["optimizer"] in colours and not arm["chosen"]
    ]
    for optimizer, entry, style, band in lines:
        series = []
        for name in entry["runs"]:
            run = study["runs"][name]
            if key == "val":
                series.append((run["val_steps"], run["val_loss"], run["median_step_s"]))
            else:
                curve = run["success_curve"]
                series.append((curve["steps"], curve["mean"], run["median_step_s"]))
        common = sorted(set.intersection(*(set(s) for s, _, _ in series))) if series else []
        if not common:
            continue
        values = [[dict(zip(s, v))[x] for x in common] for s, v, _ in series]
        mean = [statistics.fmean(col) for col in zip(*values)]
        low, high = [min(col) for col in zip(*values)], [max(col) for col in zip(*values)]
        step_s = statistics.median(m for _, _, m in series)
        label = f"{optimizer} lr {entry['lr']:g} ({len(series)} seeds)" + ("" if band else ", not chosen")
        for ax, x in ((axes[0], common), (axes[1], [c * step_s for c in common])):
            ax.plot(x, mean, color=colours[optimizer], lw=2 if band else 1.2, ls=style, label=label)
            if band:
                ax.fill_between(x, low, high, color=colours[optimizer], alpha=0.2)
    ylabel = "validation loss (flow matching)" if key == "val" else "closed-loop success (mean over tasks)"
    for ax, xlabel in zip(axes, ("optimizer step", "training seconds (step x median step time)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if key == "val":
            ax.set_yscale("log")
        else:
            ax.set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "AdamW vs DMuon on MetaWorld: mean over training seeds, band = the seeds' range (dashed: not chosen)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_final(study: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = {k: v for k, v in study["optimizers"].items() if k in OPTIMIZERS}
    if not entries:
        return
    tasks = sorted(next(iter(entries.values()))["tasks"])
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks) + 2), 4))
    width = 0.8 / len(entries)
    for i, (optimizer, entry) in enumerate(entries.items()):
        means = [entry["tasks"][t]["mean"] for t in tasks] + [entry["final_success"]["mean"]]
        lows = [m - entry["tasks"][t]["min"] for m, t in zip(means, tasks)] + [
            means[-1] - entry["final_success"]["min"]
        ]
        highs = [entry["tasks"][t]["max"] - m for m, t in zip(means, tasks)] + [
            entry["final_success"]["max"] - means[-1]
        ]
        xs = [j + i * width for j in range(len(tasks) + 1)]
        ax.bar(
            xs,
            means,
            width,
            yerr=[lows, highs],
            capsize=3,
            label=f"{optimizer} ({entry['final_success']['seeds']} seeds)",
        )
    ax.set_xticks([j + width * (len(entries) - 1) / 2 for j in range(len(tasks) + 1)])
    ax.set_xticklabels([t.removesuffix("-v3") for t in tasks] + ["mean"], rotation=15)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("closed-loop success")
    ax.set_title("final success per task: mean over seeds, bars = the seeds' range")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    args.budget = preset_steps(args)
    first = args.seeds[0]
    sweep = _interleave(
        [Job("adamw", lr, first) for lr in args.lrs["adamw"]],
        [Job("dmuon", lr, first) for lr in args.lrs["dmuon"]],
    )
    if not args.report:
        train_all(args, sweep)
    runs: dict[str, dict[str, Any]] = {}

    def gather(job: Job) -> None:
        name = run_name(*job)
        source = records_dir(args, name, job_steps(args, job))
        if finished(source, job_steps(args, job)):
            check_reused(args, job, source)
        if (source / "metrics.jsonl").is_file():
            runs[name] = {"optimizer": job.optimizer, "lr": job.lr, "seed": job.seed} | collect_run(source)
            if job.budget is not None:
                runs[name]["budget"] = job.budget

    for job in sweep:
        gather(job)
    best: dict[str, float] = {}
    for optimizer in OPTIMIZERS:  # the lr with the lowest validation loss at the first seed
        candidates = [
            r for r in runs.values() if r["optimizer"] == optimizer and finished(Path(r["dir"]), args.budget)
        ]
        candidates = [r for r in candidates if r["val_loss"]]
        if candidates:
            best[optimizer] = min(candidates, key=lambda r: min(r["val_loss"]))["lr"]
    seeds = _interleave(
        [Job("adamw", best["adamw"], s) for s in args.seeds[1:] if "adamw" in best],
        [Job("dmuon", best["dmuon"], s) for s in args.seeds[1:] if "dmuon" in best],
    )
    if len(best) == 2 and not args.report:
        train_all(args, seeds)
    for job in seeds:
        gather(job)
    also = [  # what the sweep and the chosen lrs' seeds have not run already
        Job(o, lr, s)
        for o, lr in args.also_arms
        for s in args.seeds
        if lr != best.get(o) and not (s == first and lr in args.lrs[o])
    ]
    if also and not args.report:
        train_all(args, also)
    for job in also:
        gather(job)
    short = [
        Job("dmuon", best["dmuon"], s, budget=b) for b in budgets(args) for s in args.seeds if "dmuon" in best
    ]
    if short and not args.report:
        train_all(args, short)
    for job in short:
        gather(job)
    checks: dict[str, str] = {}
    if "dmuon" in best and args.muon_steps:
        jobs = [
            Job("muon", best["dmuon"], first, args.muon_steps),
            Job("dmuon", best["dmuon"], first, args.muon_steps),
        ]
        if not args.report:
            train_all(args, jobs)
        for job in jobs:
            gather(job)
            name = run_name(*job)
            if name in runs:
                checks[job.optimizer] = name
    study: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
        "best_lr": best,
        "optimizers": summarise(args, runs, best),
        "lr_sensitivity": lr_sensitivity(args, runs, best),
    }
    study["sensitivity_arms"] = sensitivity_arms(args, runs, study["optimizers"])
    study["short_budgets"] = short_budgets(args, runs, study["optimizers"])
    if len(checks) == 2:
        muon, twin = runs[checks["muon"]], runs[checks["dmuon"]]
        pairs = [
            (a, b)
            for s, a in zip(muon["train_steps"], muon["train_loss"])
            for t, b in zip(twin["train_steps"], twin["train_loss"])
            if s == t
        ]
        study["muon_vs_dmuon"] = {
            "steps": len(pairs),
            "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None,
            "median_step_s": {"muon": muon["median_step_s"], "dmuon": twin["median_step_s"]},
        }
    study["layouts"] = layout_distances(args, runs)
    if study["optimizers"]:
        plot_curves(study, args.out / "val_loss.png", "val")
        plot_curves(study, args.out / "success_curve.png", "success")
        plot_final(study, args.out / "success.png")
    study["seconds"] = time.perf_counter() - start
    (args.out / "study.json").write_text(json.dumps(study, indent=1))
    print_tables(study)
    return 0


def print_tables(study: dict[str, Any]) -> None:
    print(f"\n{'run':<30} {'best val loss':>14} {'at step':>8} {'final success':>14} {'median step s':>14}")
    for name, run in study["runs"].items():
        best = min(run["val_loss"]) if run["val_loss"] else None
        at = run["val_steps"][run["val_loss"].index(best)] if best is not None else "-"
        final = f"{run['final']['mean_success']:.1%}" if run["final"] else "-"
        best_text = f"{best:.4f}" if best is not None else "-"
        print(f"{name:<30} {best_text:>14} {at!s:>8} {final:>14} {run['median_step_s']:>14.3f}")
    per = study["optimizers"]
    for optimizer in OPTIMIZERS:
        if optimizer not in per:
            continue
        e = per[optimizer]
        f = e["final_success"]
        tasks = ", ".join(f"{t.removesuffix('-v3')} {v['mean']:.0%}" for t, v in e["tasks"].items())
        print(
            f"\n{optimizer} (lr {e['lr']:g}, {f['seeds']} seeds): final success {f['mean']:.1%} "
            f"+- {f['std']:.1%} (range {f['min']:.0%}-{f['max']:.0%}); {tasks}"
        )
    paired = per.get("steps_to_adamw_best")
    if paired and paired["seeds"]:
        print(
            "\nsteps to AdamW's best validation loss, per training seed (each seed has its own validation episodes):"
        )
        for seed, row in paired["seeds"].items():
            dmuon = row["dmuon_step"] if row["dmuon_step"] is not None else "not reached"
            ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
            print(
                f"  seed {seed}: AdamW {row['adamw_best_val_loss']:.4f} at step {row['adamw_step']}; "
                f"DMuon reaches it at step {dmuon} ({ratio})"
            )
        if paired["ratio"] is not None:
            print(f"DMuon needs {paired['ratio']:.2f}x AdamW's steps (mean over seeds)")
    if "difference" in per:
        d = per["difference"]
        print(
            f"DMuon - AdamW mean success: {d['difference']:+.1%}, 95% interval [{d['ci'][0]:+.1%}, "
            f"{d['ci'][1]:+.1%}] ({'excludes' if d['excludes_zero'] else 'includes'} zero)"
        )
    sensitivity = study.get("lr_sensitivity") or {}
    if sensitivity.get("against_adamw_lr"):
        print(
            f"\nseed {sensitivity['seed']}: DMuon (lr {sensitivity['dmuon_lr']:g}) - AdamW at each lr of the sweep "
            "(the lrs were chosen on validation loss; this shows what the difference rests on)"
        )
        for lr, row in sensitivity["against_adamw_lr"].items():
            d = row["difference"]
            print(
                f"  AdamW lr {lr:<8} best val {row['best_val_loss']:.4f}  success {row['adamw_success']:.1%}  "
                f"difference {d['difference']:+.1%} [{d['ci'][0]:+.1%}, {d['ci'][1]:+.1%}]"
                f"{'  (chosen)' if row['chosen'] else ''}"
            )
    for name, arm in (study.get("sensitivity_arms") or {}).items():
        f, d, against = arm["final_success"], arm["difference"], arm["against"]
        print(
            f"sensitivity arm {name} ({f['seeds']} seeds, {'the chosen lr' if arm['chosen'] else 'not chosen'}): "
            f"final success {f['mean']:.1%} +- {f['std']:.1%}; DMuon - AdamW with it against {against['optimizer']} "
            f"lr {against['lr']:g}: {d['difference']:+.1%} [{d['ci'][0]:+.1%}, {d['ci'][1]:+.1%}]"
        )
    for budget, row in (study.get("short_budgets") or {}).items():
        f, d = row["final_success"], row["difference"]
        print(
            f"\nDMuon with a {budget}-step schedule ({row['budget_ratio']:.2f}x the study's steps; "
            f"{row['reached']} of {len(row['seeds'])} seeds reach AdamW's best validation loss):"
        )
        for seed, s in row["seeds"].items():
            reached = f"at step {s['dmuon_step']} ({s['ratio']:.2f}x)" if s["ratio"] is not None else "never"
            print(
                f"  seed {seed}: AdamW {s['adamw_best_val_loss']:.4f} at step {s['adamw_step']}; DMuon reaches "
                f"it {reached}, ends at {s['dmuon_final_val_loss']:.4f}"
            )
        if row["ratio"] is not None:
            print(f"  DMuon needs {row['ratio']:.2f}x AdamW's steps with this schedule (mean over seeds)")
        print(
            f"  final success {f['mean']:.1%} +- {f['std']:.1%}; DMuon ({budget} steps) - AdamW "
            f"(lr {row['against']['lr']:g}, full budget): {d['difference']:+.1%} [{d['ci'][0]:+.1%}, "
            f"{d['ci'][1]:+.1%}]"
        )
    if "muon_vs_dmuon" in study:
        m = study["muon_vs_dmuon"]
        print(
            f"naive Muon vs DMuon over {m['steps']} steps: max relative loss difference {m['max_rel_loss_diff']}"
        )
    for task, layout in (study.get("layouts") or {}).items():
        near = layout["nearest_training_layout_m"]
        print(
            f"layouts {task}: {layout['randomised_dims']} randomised dims, nearest demonstration "
            f"{near['median'] * 1e3:.1f} mm median, {near['max'] * 1e3:.1f} mm max"
        )


if __name__ == "__main__":
    sys.exit(main())
