"""AdamW vs DMuon on MetaWorld: learning-rate sweeps, validation curves, closed-loop success.

    python scripts/study_optimizers.py --out outputs/study            # the documented study
    python scripts/study_optimizers.py --out outputs/study --report   # tables and plots from finished runs

Trains the same policy (model=pi0_sim) on the same MetaWorld demonstrations (data=metaworld) with the
same seed, initial weights and data order, once per (optimizer, learning rate): AdamW over --adamw-lrs
and DMuon over --dmuon-lrs (its AdamW side fixed at --dmuon-adamw-lr). Naive Muon runs --muon-steps
steps at DMuon's best learning rate to show it follows DMuon's loss curve (same update, every rank
doing all the work). The best run of each optimizer (lowest validation loss) is then evaluated in
closed loop on unseen seeds.

Runs go two at a time by default (--parallel; AdamW lr_i beside DMuon lr_i, one intra-op thread
each), so the pairs that are compared share the machine alike. Step times for the per-second view are
each run's median. Resumable: a finished run (summary.json with all steps) is reused, an interrupted one resumes from its
last checkpoint, an evaluated run keeps its closed_loop_eval.json. Writes to --out:
    runs/<optimizer>_lr<lr>/        each training run (Hydra output_dir)
    study.json                      every number below
    val_loss.png                    validation loss against step and against training seconds
    success.png                     closed-loop success per task, best AdamW vs best DMuon
and prints a table of both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/study"))
    parser.add_argument("--model", default="pi0_sim", help="model preset (configs/model)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--adamw-lrs", default="2.5e-4,5e-4,1e-3")
    parser.add_argument("--dmuon-lrs", default="0.01,0.02,0.04")
    parser.add_argument(
        "--dmuon-adamw-lr", type=float, default=5e-4, help="DMuon's AdamW side (embeddings, heads)"
    )
    parser.add_argument("--muon-steps", type=int, default=30, help="naive Muon steps (0: skip)")
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--episodes", type=int, default=20, help="closed-loop episodes per task")
    parser.add_argument("--eval-seed", type=int, default=1000)
    parser.add_argument("--replan-every", type=int, default=5)
    parser.add_argument("--parallel", type=int, default=2, help="runs trained at once (cores shared out)")
    parser.add_argument(
        "--report", action="store_true", help="only collect finished runs and write the report"
    )
    parser.add_argument(
        "--train-arg", action="append", default=[], help="extra train.py override (repeatable)"
    )
    return parser.parse_args()


def _lrs(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run_name(optimizer: str, lr: float, steps: int | None = None) -> str:
    """A sweep run's directory name; short check runs (naive Muon and its DMuon twin) add their steps."""
    return f"{optimizer}_lr{lr:g}" + (f"_{steps}steps" if steps is not None else "")


def _summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def launch(args: argparse.Namespace, optimizer: str, lr: float, steps: int) -> subprocess.Popen | None:
    """Start one train.py run (resumed when interrupted); None when it finished earlier."""
    run_dir = args.out / "runs" / run_name(optimizer, lr, None if steps == args.steps else steps)
    done = _summary(run_dir)
    if done is not None and done["steps"] >= steps and not done.get("stopped_early"):
        print(f"  {run_dir.name}: finished earlier, reused", flush=True)
        return None
    overrides = [
        f"model={args.model}",
        "data=metaworld",
        f"optim={optimizer}",
        f"optim.lr={lr}",
        f"trainer.steps={steps}",
        f"trainer.batch_size={args.batch_size}",
        # Every run follows the same lr schedule, that of a --steps run: naive Muon's short run too.
        f"trainer.schedule_steps={args.steps}",
        f"trainer.warmup_steps={max(1, min(50, args.steps // 10))}",
        f"trainer.val_every={args.val_every}",
        "trainer.val_batches=4",
        f"trainer.checkpoint_every={max(args.val_every, 250)}",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "trainer.closed_loop.episodes=0",  # the study evaluates the best runs itself, on more episodes
        f"output_dir={run_dir}",
        *args.train_arg,
    ]
    if optimizer != "adamw":
        overrides.append(f"optim.adamw_lr={args.dmuon_adamw_lr}")
    if (run_dir / "checkpoints").is_dir():
        overrides.append("trainer.resume=auto")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"  {run_dir.name}: training {steps} steps ...", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.parallel > 1:  # share the cores out: one intra-op thread per run
        env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.parallel)))
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


def wait(process: subprocess.Popen) -> None:
    returncode = process.wait()
    process.log.close()  # type: ignore[attr-defined]
    run_dir = process.run_dir  # type: ignore[attr-defined]
    if returncode != 0:
        raise SystemExit(f"{run_dir.name} failed (exit {returncode}); see {run_dir / 'train.log'}")
    print(f"  {run_dir.name}: done in {time.perf_counter() - process.started:.0f} s", flush=True)  # type: ignore[attr-defined]


def train_all(args: argparse.Namespace, jobs: list[tuple[str, float, int]]) -> None:
    """Run the (optimizer, lr, steps) jobs, `args.parallel` at a time (AdamW and DMuon side by side)."""
    for first in range(0, len(jobs), args.parallel):
        started = [launch(args, *job) for job in jobs[first : first + args.parallel]]
        for process in started:
            if process is not None:
                wait(process)


def curves(run_dir: Path) -> dict[str, list[float]]:
    """Train / validation curves of a run: steps (1-based), losses, and training seconds at each step."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Steps are logged 1..N; metrics written before that convention count from 0: their last step is N - 1.
    logged = [r["step"] for r in records if r["split"] == "train"]
    summary = _summary(run_dir)
    finished = summary["steps"] if summary else None
    offset = 1 if logged and (min(logged) == 0 or max(logged) == (finished or 0) - 1) else 0
    train: dict[int, dict[str, Any]] = {}
    val: dict[int, float] = {}
    for r in records:  # a resumed run re-logs some steps: the last record of a step wins
        if r["split"] == "train":
            train[r["step"] + offset] = r
        elif r["split"] == "val":
            val[r["step"] + offset] = r["loss"]
    # Seconds = step x the run's median step time: medians shrug off the machine's passing load, which a
    # sum of step times would charge to whichever run it happened to hit.
    median_step_s = statistics.median(r["step_s"] for r in train.values()) if train else math.nan
    val_steps = sorted(val)
    return {
        "train_steps": sorted(train),
        "train_loss": [train[s]["loss"] for s in sorted(train)],
        "val_steps": val_steps,
        "val_loss": [val[s] for s in val_steps],
        "val_seconds": [s * median_step_s for s in val_steps],
        "median_step_s": median_step_s,
        "median_optimizer_s": statistics.median(r["optimizer_s"] for r in train.values())
        if train
        else math.nan,
    }


def steps_to_reach(curve: dict[str, list[float]], target: float) -> int | None:
    """The first validation step at which the loss is <= target."""
    return next((s for s, v in zip(curve["val_steps"], curve["val_loss"]) if v <= target), None)


def _cached_evaluation(args: argparse.Namespace, path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    cached = json.loads(path.read_text())
    same = cached["seed"] == args.eval_seed and cached["tasks"][0]["episodes"] == args.episodes
    return cached if same and cached["settings"]["replan_every"] == args.replan_every else None


def closed_loop(args: argparse.Namespace, run_dirs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Closed-loop reports of the runs' exports, evaluated side by side (cached in closed_loop_eval.json)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    pending = {
        k: d for k, d in run_dirs.items() if _cached_evaluation(args, d / "closed_loop_eval.json") is None
    }
    if len(pending) > 1:
        env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // len(pending))))
    processes = []
    for run_dir in pending.values():
        command = [
            sys.executable,
            str(ROOT / "scripts" / "eval_sim.py"),
            str(run_dir),
            f"--episodes={args.episodes}",
            f"--seed={args.eval_seed}",
            f"--replan-every={args.replan_every}",
            f"--json={run_dir / 'closed_loop_eval.json'}",
            "--videos=1",
        ]
        print(f"  {run_dir.name}: closed-loop evaluation ...", flush=True)
        log = open(run_dir / "eval.log", "w")  # noqa: SIM115 (closed below)
        processes.append(
            (run_dir, log, subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        )
    for run_dir, log, process in processes:
        returncode = process.wait()
        log.close()
        if returncode != 0:
            raise SystemExit(f"closed-loop evaluation of {run_dir.name} failed; see {run_dir / 'eval.log'}")
    return {k: json.loads((d / "closed_loop_eval.json").read_text()) for k, d in run_dirs.items()}


def plot_curves(runs: dict[str, dict[str, Any]], best: dict[str, str], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {"adamw": "tab:blue", "dmuon": "tab:red", "muon": "tab:green"}
    for name, run in runs.items():
        c = run["curve"]
        if not c["val_steps"]:
            continue
        bold = name in best.values()
        style = {"color": colours[run["optimizer"]], "alpha": 1.0 if bold else 0.35, "lw": 2 if bold else 1}
        by_step.plot(c["val_steps"], c["val_loss"], label=name, **style)
        by_time.plot(c["val_seconds"], c["val_loss"], label=name, **style)
    for ax, xlabel in ((by_step, "optimizer step"), (by_time, "training seconds (step x median step time)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (flow matching)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    fig.suptitle(f"AdamW vs DMuon on MetaWorld ({model}): best run of each in bold")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    adamw_lrs, dmuon_lrs = _lrs(args.adamw_lrs), _lrs(args.dmuon_lrs)
    # Interleaved (AdamW lr_i next to DMuon lr_i), so runs that share the machine compare like with like.
    plan = [(o, lr) for pair in zip(adamw_lrs, dmuon_lrs) for o, lr in zip(("adamw", "dmuon"), pair)]
    plan += [("adamw", lr) for lr in adamw_lrs[len(dmuon_lrs) :]] + [
        ("dmuon", lr) for lr in dmuon_lrs[len(adamw_lrs) :]
    ]
    if not args.report:
        train_all(args, [(o, lr, args.steps) for o, lr in plan])
    runs: dict[str, dict[str, Any]] = {}
    for optimizer, lr in plan:
        run_dir = args.out / "runs" / run_name(optimizer, lr)
        if (run_dir / "metrics.jsonl").is_file():
            runs[run_dir.name] = {
                "optimizer": optimizer,
                "lr": lr,
                "dir": str(run_dir),
                "curve": curves(run_dir),
            }
    best: dict[str, str] = {}
    for optimizer in ("adamw", "dmuon"):
        candidates = [
            n
            for n, r in runs.items()
            if r["optimizer"] == optimizer and r["curve"]["val_steps"][-1:] == [args.steps]
        ]
        if candidates:
            best[optimizer] = min(candidates, key=lambda n: min(runs[n]["curve"]["val_loss"]))
    checks: dict[str, str] = {}
    if "dmuon" in best and args.muon_steps:
        # Naive Muon and a DMuon twin, side by side for --muon-steps steps of the full runs' schedule: the
        # same update, so the same losses, while naive Muon has every rank do all the work.
        lr = runs[best["dmuon"]]["lr"]
        if not args.report:
            train_all(args, [("muon", lr, args.muon_steps), ("dmuon", lr, args.muon_steps)])
        for optimizer in ("muon", "dmuon"):
            run_dir = args.out / "runs" / run_name(optimizer, lr, args.muon_steps)
            if (run_dir / "metrics.jsonl").is_file():
                checks[optimizer] = run_dir.name
                runs[run_dir.name] = {
                    "optimizer": optimizer,
                    "lr": lr,
                    "dir": str(run_dir),
                    "curve": curves(run_dir),
                }
    study: dict[str, Any] = {"settings": vars(args) | {"out": str(args.out)}, "runs": runs, "best": best}
    if len(best) == 2:
        adamw, dmuon = runs[best["adamw"]]["curve"], runs[best["dmuon"]]["curve"]
        target = min(adamw["val_loss"])
        adamw_steps = adamw["val_steps"][adamw["val_loss"].index(target)]
        dmuon_steps = steps_to_reach(dmuon, target)
        study["comparison"] = {
            "adamw_best_val_loss": target,
            "adamw_steps_to_best": adamw_steps,
            "dmuon_best_val_loss": min(dmuon["val_loss"]),
            "dmuon_steps_to_adamw_best": dmuon_steps,
            "step_ratio": dmuon_steps / adamw_steps if dmuon_steps else None,
            "median_step_s": {k: runs[best[k]]["curve"]["median_step_s"] for k in best},
        }
    if len(checks) == 2:
        muon, dmuon = runs[checks["muon"]]["curve"], runs[checks["dmuon"]]["curve"]
        pairs = [(a, b) for s, a in zip(muon["train_steps"], muon["train_loss"]) for t, b in zip(dmuon["train_steps"], dmuon["train_loss"]) if s == t]  # fmt: skip
        study["muon_vs_dmuon"] = {
            "steps": len(pairs),
            "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None,
            "median_step_s": {"muon": muon["median_step_s"], "dmuon": dmuon["median_step_s"]},
        }
    evaluated = all((Path(runs[n]["dir"]) / "closed_loop_eval.json").is_file() for n in best.values())
    if best and (not args.report or evaluated):
        evaluations = closed_loop(args, {k: Path(runs[n]["dir"]) for k, n in best.items()})
        study["closed_loop"] = evaluations
        from vla.eval.closed_loop import ClosedLoopReport, ClosedLoopSettings, TaskReport, plot_success

        reports = {
            f"{k} ({best[k]})": ClosedLoopReport(
                policy=best[k],
                seed=e["seed"],
                settings=ClosedLoopSettings(**e["settings"]),
                tasks=[TaskReport(**{**t, "ci95": tuple(t["ci95"]), "results": []}) for t in e["tasks"]],
            )
            for k, e in evaluations.items()
        }
        plot_success(reports, args.out / "success.png", title=f"closed-loop success after {args.steps} steps")
    plot_curves(runs, best, args.out / "val_loss.png", args.model)
    study["seconds"] = time.perf_counter() - start
    (args.out / "study.json").write_text(json.dumps(study, indent=1))
    print_table(study)
    return 0


def print_table(study: dict[str, Any]) -> None:
    print(f"\n{'run':<22} {'best val loss':>14} {'at step':>8} {'median step s':>14} {'optimizer s':>12}")
    for name, run in study["runs"].items():
        c = run["curve"]
        if c["val_loss"]:
            i = c["val_loss"].index(min(c["val_loss"]))
            print(
                f"{name:<22} {c['val_loss'][i]:>14.4f} {c['val_steps'][i]:>8} {c['median_step_s']:>14.3f} "
                f"{c['median_optimizer_s']:>12.4f}"
            )
        else:
            print(
                f"{name:<22} {'-':>14} {'-':>8} {c['median_step_s']:>14.3f} {c['median_optimizer_s']:>12.4f}"
            )
    if "comparison" in study:
        c = study["comparison"]
        print(
            f"\nDMuon reaches AdamW's best validation loss {c['adamw_best_val_loss']:.4f} (AdamW: step "
            f"{c['adamw_steps_to_best']}) at step {c['dmuon_steps_to_adamw_best']}: ratio {c['step_ratio']}"
        )
    if "muon_vs_dmuon" in study:
        m = study["muon_vs_dmuon"]
        print(
            f"naive Muon vs DMuon over {m['steps']} logged steps: max relative loss difference {m['max_rel_loss_diff']}"
        )
    for optimizer, report in study.get("closed_loop", {}).items():
        rates = ", ".join(f"{t['task']} {t['success_rate']:.0%}" for t in report["tasks"])
        print(f"closed loop {optimizer}: mean {report['mean_success']:.0%} ({rates})")


if __name__ == "__main__":
    sys.exit(main())
