"""Ablations of the MetaWorld recipe (experiment=metaworld): one lever changed per row, success with intervals.

    python scripts/ablate_recipe.py --out outputs/ablations                      # every variant
    python scripts/ablate_recipe.py --out outputs/ablations --variants recipe,shift_augmentation
    python scripts/ablate_recipe.py --out outputs/ablations --report             # table from finished runs

Each variant is `train.py experiment=metaworld` plus its overrides (VARIANTS below: augmentation,
resolution and patch size, demonstrations per task, steps, EMA, action horizon), same training seed,
closed-loop success every --eval-every steps and at the end on --episodes episodes per task (seeds from
--eval-seed, never the demonstrations'). The replan interval needs no training: --replan 1,3,8,16
re-evaluates the recipe's export with scripts/eval_sim.py at each interval.

Per row: final success per task with its 95% Wilson interval, mean success, the success curve (steps,
training seconds), median step time and its ratio to the recipe's. Runs go --parallel at a time (one
intra-op thread each) and are reused when finished (resumed when interrupted). Writes out/ablations.json,
out/ablations.png (success against step per variant) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from study_optimizers import collect_run, finished  # noqa: E402

from vla.eval.closed_loop import wilson_interval  # noqa: E402

# name -> (what it changes, train.py overrides on top of experiment=metaworld)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "recipe": ("experiment=metaworld as documented", []),
    "shift_augmentation": ("random shifts (4 px) + colour jitter", ["image_transforms=shift"]),
    "openpi_augmentation": ("openpi's crop, rotation and colour jitter", ["image_transforms=openpi"]),
    "ema": ("EMA of the weights (0.999, warmed up), evaluated with it", ["trainer.ema_decay=0.999"]),
    "steps_4000": ("twice the steps", ["trainer.steps=4000"]),
    "steps_8000": ("four times the steps (8000; the schedule spans them)", ["trainer.steps=8000"]),
    "demos_200_steps_8000": (
        "200 demonstrations per task and 8000 steps",
        ["data.metaworld.episodes=200", "data.root=data/metaworld_200", "trainer.steps=8000"],
    ),
    "patch_8": ("8-px patches (64 tokens per camera)", ["model.overrides={vision: {patch_size: 8}}"]),
    "resolution_96": (
        "96-px images (recorded anew), 16-px patches",
        [
            "data.metaworld.resolution=96",
            "data.root=data/metaworld_96",
            "model.overrides={vision: {image_size: 96}}",
        ],
    ),
    "demos_100": (
        "100 demonstrations per task",
        ["data.metaworld.episodes=100", "data.root=data/metaworld_100"],
    ),
    "demos_200": (
        "200 demonstrations per task",
        ["data.metaworld.episodes=200", "data.root=data/metaworld_200"],
    ),
    "no_state": (
        "no proprioception (state zeroed): the goal must be read from the images",
        ["data.state_key=null"],
    ),
    "dart_noise": (
        "DART-style demonstrations: noise (std 0.3) on the executed hand action, clean labels",
        ["data.metaworld.action_noise=0.3", "data.root=data/metaworld_dart"],
    ),
    "random_start": (
        "demonstrations from random hand starts (x, y +-10 cm, z 0-10 cm); evaluation from MetaWorld's",
        ["data.metaworld.hand_start_noise=0.1", "data.root=data/metaworld_start"],
    ),
    "after_success_20": (
        "demonstrations that go on 20 expert steps past their first success (staying at the goal)",
        ["data.metaworld.steps_after_success=20", "data.root=data/metaworld_after20"],
    ),
    "expert_tcp": (
        "reach's expert steers the tool centre point (what success measures) onto the goal, not the hand",
        ["data.metaworld.expert_aims_tcp=true", "data.root=data/metaworld_tcp"],
    ),
    "dart_noise_demos_200": (
        "DART-style demonstrations (std 0.3), 200 per task",
        [
            "data.metaworld.action_noise=0.3",
            "data.metaworld.episodes=200",
            "data.root=data/metaworld_dart_200",
        ],
    ),
    "workspace_camera": (
        "corner2 + the workspace view (vla.sim FREE_VIEWS, ~1 cm a pixel) instead of topview",
        [
            "data.metaworld.cameras=[corner2,workspace]",
            "data.root=data/metaworld_workspace",
            "data.camera_map={observation.images.corner2: corner2, observation.images.workspace: workspace}",
            "model.overrides={cameras: [corner2, workspace]}",
        ],
    ),
    "workspace_cameras": (
        "both cameras framed on the workspace (workspace + workspace_top, ~1 cm a pixel)",
        [
            "data.metaworld.cameras=[workspace,workspace_top]",
            "data.root=data/metaworld_workspace2",
            "data.camera_map={observation.images.workspace: workspace, observation.images.workspace_top: "
            "workspace_top}",
            "model.overrides={cameras: [workspace, workspace_top]}",
        ],
    ),
    "side_camera": (
        "the side view (vla.sim workspace_side: heights as image rows) instead of corner2",
        [
            "data.metaworld.cameras=[workspace_side,topview]",
            "data.root=data/metaworld_side",
            "data.camera_map={observation.images.workspace_side: workspace_side, observation.images.topview: "
            "topview}",
            "model.overrides={cameras: [workspace_side, topview]}",
        ],
    ),
    "wrist_camera": (
        "the workspace view + MetaWorld's gripperPOV (a camera on the hand) instead of corner2 + topview",
        [
            "data.metaworld.cameras=[workspace,gripperPOV]",
            "data.root=data/metaworld_wrist",
            "data.camera_map={observation.images.workspace: workspace, observation.images.gripperPOV: "
            "gripperPOV}",
            "model.overrides={cameras: [workspace, gripperPOV]}",
        ],
    ),
    "horizon_8": ("8-step action chunks", ["model.overrides={action_horizon: 8}"]),
    "horizon_32": ("32-step action chunks", ["model.overrides={action_horizon: 32}"]),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=lambda prog: argparse.ArgumentDefaultsHelpFormatter(prog, width=110),
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/ablations"))
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}"
    )
    parser.add_argument("--eval-every", type=int, default=500, help="closed-loop evaluation interval (steps)")
    parser.add_argument("--episodes", type=int, default=20, help="episodes per task, at every evaluation")
    parser.add_argument("--eval-seed", type=int, default=1000)
    parser.add_argument("--replan", default="", help="replan intervals to evaluate the recipe's export at")
    parser.add_argument("--parallel", type=int, default=2, help="runs trained at once (cores shared out)")
    parser.add_argument("--report", action="store_true", help="only collect finished runs and report")
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="an earlier ablations.json whose rows stay in the report where this --out has no finished run "
        "of that variant (its runs were on another machine), e.g. docs/ablations/ablations.json",
    )
    parser.add_argument(
        "--train-arg", action="append", default=[], help="extra train.py override (repeatable)"
    )
    args = parser.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    return args


def _env(parallel: int) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if parallel > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // parallel))
    return env


def launch(args: argparse.Namespace, name: str) -> subprocess.Popen | None:
    run_dir = args.out / "runs" / name
    summary = run_dir / "summary.json"
    if summary.is_file() and finished(run_dir, json.loads(summary.read_text())["steps"]):
        print(f"  {name}: finished earlier, reused", flush=True)
        return None
    overrides = [
        "experiment=metaworld",
        f"trainer.closed_loop.every={args.eval_every}",
        f"trainer.closed_loop.episodes={args.episodes}",
        f"trainer.closed_loop.final_episodes={args.episodes}",
        f"trainer.closed_loop.seed={args.eval_seed}",
        "trainer.progress_bar=false",
        f"output_dir={run_dir}",
        *VARIANTS[name][1],
        *args.train_arg,
    ]
    # auto: continues an interrupted run, and starts a new dir (or one stopped before its first checkpoint) afresh
    overrides.append("trainer.resume=auto")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"  {name}: training ...", flush=True)
    log = open(run_dir / "train.log", "a")  # noqa: SIM115 (closed after wait)
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_env(args.parallel),
    )
    process.log, process.name = log, name  # type: ignore[attr-defined]
    return process


def train_all(args: argparse.Namespace) -> None:
    for first in range(0, len(args.variants), args.parallel):
        started = [launch(args, name) for name in args.variants[first : first + args.parallel]]
        for process in started:
            if process is None:
                continue
            code = process.wait()
            process.log.close()  # type: ignore[attr-defined]
            if code != 0:
                name = process.name  # type: ignore[attr-defined]
                raise SystemExit(f"{name} failed (exit {code}); see {args.out / 'runs' / name / 'train.log'}")


def replan_rows(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's export evaluated at other replan intervals (no training), side by side."""
    intervals = [int(x) for x in args.replan.split(",") if x.strip()]
    recipe = args.out / "runs" / "recipe"
    rows: dict[str, Any] = {}
    pending = []
    for k in intervals:
        path = args.out / "replan" / f"replan_{k}.json"
        if not path.is_file() and not args.report:
            path.parent.mkdir(parents=True, exist_ok=True)
            command = [
                sys.executable,
                str(ROOT / "scripts" / "eval_sim.py"),
                str(recipe),
                f"--episodes={args.episodes}",
                f"--seed={args.eval_seed}",
                f"--replan-every={k}",
                f"--json={path}",
            ]
            log = open(path.with_suffix(".log"), "w")  # noqa: SIM115
            pending.append(
                (
                    log,
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        env=_env(min(len(intervals), args.parallel)),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                )
            )
            if len(pending) >= args.parallel:
                for log_file, process in pending:
                    process.wait()
                    log_file.close()
                pending = []
    for log_file, process in pending:
        process.wait()
        log_file.close()
    for k in intervals:
        path = args.out / "replan" / f"replan_{k}.json"
        if path.is_file():
            report = json.loads(path.read_text())
            rows[f"replan_{k}"] = {
                "changes": f"recipe's policy, replanning every {k} actions",
                "mean_success": report["mean_success"],
                "tasks": {
                    t["task"]: {"successes": t["successes"], "episodes": t["episodes"]}
                    for t in report["tasks"]
                },
            }
    return rows


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not args.report:
        train_all(args)
    rows: dict[str, Any] = {}
    for name in args.variants:
        run_dir = args.out / "runs" / name
        if not (run_dir / "closed_loop.json").is_file():
            continue
        run = collect_run(run_dir)
        rows[name] = {
            "changes": VARIANTS[name][0],
            "overrides": VARIANTS[name][1],
            "mean_success": run["final"]["mean_success"],
            "tasks": {
                t: {k: v[k] for k in ("successes", "episodes")} for t, v in run["final"]["tasks"].items()
            },
            "success_curve": run["success_curve"],
            "median_step_s": run["median_step_s"],
            "best_val_loss": min(run["val_loss"]) if run["val_loss"] else None,
        }
    if args.replan:
        rows |= replan_rows(args)
    if args.keep is not None:
        if not args.keep.is_file():
            raise SystemExit(
                f"--keep {args.keep}: no such file; give an ablations.json an earlier report wrote"
            )
        kept = json.loads(args.keep.read_text()).get("rows", {})
        rows = {**{n: r for n, r in kept.items() if n not in rows}, **rows}
    for row in rows.values():
        for t in row["tasks"].values():
            t["ci95"] = list(wilson_interval(t["successes"], t["episodes"]))
    recipe_step = rows.get("recipe", {}).get("median_step_s")
    for row in rows.values():
        if recipe_step and row.get("median_step_s"):
            row["step_time_vs_recipe"] = row["median_step_s"] / recipe_step
    result = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "seconds": time.perf_counter() - start,
    }
    (args.out / "ablations.json").write_text(json.dumps(result, indent=1))
    plot(rows, args.out / "ablations.png")
    print_table(rows)
    return 0


def plot(rows: dict[str, Any], path: Path) -> None:
    curves = {n: r["success_curve"] for n, r in rows.items() if r.get("success_curve", {}).get("steps")}
    if not curves:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours, markers = plt.get_cmap("tab20").colors, "os^Dv<>pX*"
    for i, (name, curve) in enumerate(curves.items()):
        # 20 colours, then the next marker: 200 variants before a style repeats (tab10 repeats after 10)
        style = {
            "color": colours[i % 20],
            "marker": markers[i // 20 % 10],
            "lw": 2 if name == "recipe" else 1,
        }
        by_step.plot(curve["steps"], curve["mean"], label=name, **style)
        by_time.plot(curve["seconds"], curve["mean"], label=name, **style)
    for ax, xlabel in ((by_step, "optimizer step"), (by_time, "training seconds (step x median step time)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("closed-loop success (mean over tasks)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.suptitle("MetaWorld recipe ablations (pi0_sim, DMuon): success over training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(rows: dict[str, Any]) -> None:
    if not rows:
        print("no finished variant yet")
        return
    tasks = sorted(next(iter(rows.values()))["tasks"])
    header = f"{'variant':<20} " + " ".join(f"{t.removesuffix('-v3')[:14]:>16}" for t in tasks)
    print("\n" + header + f" {'mean':>6} {'step s':>8} {'x recipe':>9}")
    for name, row in rows.items():
        cells = []
        for t in tasks:
            cell = row["tasks"].get(t)
            cells.append(
                f"{cell['successes'] / cell['episodes']:.0%} [{cell['ci95'][0]:.2f},{cell['ci95'][1]:.2f}]"
                if cell
                else "-"
            )
        step = f"{row['median_step_s']:.3f}" if row.get("median_step_s") else "-"
        ratio = f"{row['step_time_vs_recipe']:.2f}" if row.get("step_time_vs_recipe") else "-"
        print(
            f"{name:<20} "
            + " ".join(f"{c:>16}" for c in cells)
            + f" {row['mean_success']:>6.0%} {step:>8} {ratio:>9}"
        )


if __name__ == "__main__":
    sys.exit(main())
