"""Closed-loop evaluation in MetaWorld of a trained run, the scripted expert, or a baseline.

    python scripts/eval_sim.py RUN_DIR --tasks reach-v3,push-v3 --episodes 20 --seed 1000 \
        --json out/eval.json [--videos 2] [--replan-every 5]
    python scripts/eval_sim.py RUN_DIR --checkpoint step_00004000 --episodes 50 --seed 2000 --json out/4000.json
    python scripts/eval_sim.py --policy expert --tasks reach-v3 --episodes 20 --json out/expert.json
    python scripts/eval_sim.py --policy zero|random ...

A run is evaluated from its export (policy.safetensors) and processor.json; cameras, resolution and
tasks default to those in its config.yaml (data.metaworld), and seeds its demonstrations used are
refused: the dataset is looked up from data.root relative to where the run was launched, the working
directory and the repository. If it cannot be found the run is refused unless --unknown-training-seeds.
--checkpoint evaluates one of the run's checkpoints instead (exported first into
RUN_DIR/exports/<checkpoint>, as scripts/export_lerobot.py does; the EMA weights when the run kept an
EMA). To choose a checkpoint, compare them on seeds apart from those you report (e.g. --seed 2000; the
run's own evaluations use trainer.closed_loop.seed, 1000 by default). Writes the JSON report, a PNG of
success per task (next to the JSON) and, with --videos N, the first N episodes of each task as mp4 files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vla.eval.closed_loop import (
    ClosedLoopSettings,
    ExpertPolicy,
    RandomPolicy,
    ZeroPolicy,
    evaluate_closed_loop,
    write_report,
)
from vla.help_format import HelpFormatter
from vla.sim import DEFAULT_TASKS, SimError, parse_tasks
from vla.sim.demos import training_seeds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("run_dir", nargs="?", type=Path, help="a training run directory (omit with --policy)")
    parser.add_argument(
        "--policy", choices=["expert", "zero", "random"], help="evaluate a built-in policy instead"
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="evaluate this checkpoint of the run (a name under checkpoints/ or a path) instead of its export",
    )
    parser.add_argument(
        "--tasks", default=None, help="comma-separated tasks (default: the run's dataset tasks)"
    )
    parser.add_argument("--episodes", type=int, default=20, help="episodes per task")
    parser.add_argument("--seed", type=int, default=1000, help="episode e runs on seed + e")
    parser.add_argument(
        "--cameras", default=None, help="comma-separated cameras (default: the run's dataset's)"
    )
    parser.add_argument(
        "--resolution", type=int, default=None, help="image size (default: the run's dataset's)"
    )
    parser.add_argument(
        "--max-episode-steps",
        type=int,
        default=None,
        help="steps before an episode counts as failed (default: the run's trainer.closed_loop.max_episode_steps; "
        "200 for --policy)",
    )
    parser.add_argument(
        "--replan-every",
        type=int,
        default=None,
        help="actions played from each predicted chunk (default: the run's trainer.closed_loop.replan_every, "
        "which its LeRobot export's n_action_steps also carries; 5 for --policy)",
    )
    parser.add_argument(
        "--parallel-envs", type=int, default=10, help="episodes run in lockstep per policy call"
    )
    parser.add_argument(
        "--num-steps", type=int, default=None, help="flow-matching Euler steps (default: model's)"
    )
    parser.add_argument("--json", type=Path, required=True, help="report path; the PNG goes beside it")
    parser.add_argument(
        "--unknown-training-seeds",
        action="store_true",
        help="evaluate a run whose dataset cannot be found (its demonstration seeds are then not excluded)",
    )
    parser.add_argument("--videos", type=int, default=0, help="episodes per task to save as mp4")
    args = parser.parse_args()
    if (args.run_dir is None) == (args.policy is None):
        parser.error("give either RUN_DIR or --policy expert|zero|random")
    if args.checkpoint is not None and args.run_dir is None:
        parser.error("--checkpoint needs RUN_DIR")
    return args


def run_settings(run_dir: Path, unknown_training_seeds: bool) -> tuple[dict, dict[str, set[int]]]:
    """Tasks, cameras and resolution from the run's saved config, and the seeds its demonstrations used
    (from the dataset it trained on). Raises ValueError for a run not trained on MetaWorld, or when
    that dataset cannot be found and --unknown-training-seeds was not given."""
    from vla.eval.policy_runner import dataset_candidates, run_data_config, run_dataset_root
    from vla.sim.demos import MARKER_PATH

    data = run_data_config(run_dir)
    if data.get("source") != "metaworld":
        raise ValueError(
            f"{run_dir} was trained on data.source={data.get('source')!r}, not MetaWorld; eval_sim.py evaluates "
            "runs trained with data=metaworld (scripts/eval_sim.py --policy expert needs no run)"
        )
    metaworld = data.get("metaworld") or {}
    recorded = {k: metaworld[k] for k in ("tasks", "cameras", "resolution") if k in metaworld}
    root = run_dataset_root(run_dir, MARKER_PATH)
    if root is not None:
        return recorded, training_seeds(root)
    looked = ", ".join(str(p) for p in dataset_candidates(run_dir, data.get("root") or "?"))
    if not unknown_training_seeds:
        raise ValueError(
            f"the dataset {run_dir} trained on (data.root={data.get('root')!r}) is not at {looked}, so the "
            "seeds of its demonstrations are unknown and evaluation could reuse them. Run from the directory "
            "the run was launched in, or pass --unknown-training-seeds to evaluate on --seed.. anyway"
        )
    print(f"warning: {run_dir}'s dataset is not at {looked}; evaluating without the training-seed check")
    return recorded, {}


def main() -> int:
    args = parse_args()
    try:
        recorded, exclude = {}, {}
        # --policy plays the harness's own defaults; a run, its own settings (read below)
        replan_every, max_episode_steps = (
            ClosedLoopSettings.replan_every,
            ClosedLoopSettings.max_episode_steps,
        )
        if args.run_dir is not None:
            from vla.eval.policy_runner import (
                EXPORT_FILE,
                load_run_policy,
                run_max_episode_steps,
                run_replan_every,
            )

            replan_every, max_episode_steps = (
                run_replan_every(args.run_dir),
                run_max_episode_steps(args.run_dir),
            )

            recorded, exclude = run_settings(args.run_dir, args.unknown_training_seeds)
            export, name = None, args.run_dir.name
            if args.checkpoint is not None:
                from vla.training.export import export_checkpoint

                exported = export_checkpoint(args.run_dir, args.checkpoint)
                export, name = exported / EXPORT_FILE, f"{args.run_dir.name}@{exported.name}"
                print(f"exported {args.checkpoint} to {exported}")
            policy = load_run_policy(
                args.run_dir,
                export=export,
                name=name,
                seed=args.seed,
                num_steps=args.num_steps,
            )
        else:
            policy = {"expert": ExpertPolicy, "zero": ZeroPolicy, "random": lambda: RandomPolicy(args.seed)}[
                args.policy
            ]()
        tasks = parse_tasks(args.tasks or recorded.get("tasks") or list(DEFAULT_TASKS))
        cameras = (
            [c.strip() for c in args.cameras.split(",")]
            if args.cameras
            else recorded.get("cameras", ["corner2"])
        )
        settings = ClosedLoopSettings(
            cameras=tuple(cameras),
            resolution=args.resolution or recorded.get("resolution", 64),
            max_episode_steps=max_episode_steps if args.max_episode_steps is None else args.max_episode_steps,
            replan_every=replan_every if args.replan_every is None else args.replan_every,
            parallel_envs=args.parallel_envs,
        )
        start = time.perf_counter()
        report = evaluate_closed_loop(
            policy,
            tasks,
            args.episodes,
            args.seed,
            settings,
            exclude_seeds=exclude,
            videos=args.videos,
            video_dir=args.json.parent / f"{args.json.stem}_videos",
            progress=lambda task, n: print(
                f"  {task}: {n} episodes ({time.perf_counter() - start:.0f} s)", flush=True
            ),
        )
        if exclude:  # how far these layouts are from the demonstrations'
            from vla.sim.layouts import layout_report

            seeds = range(args.seed, args.seed + args.episodes)
            for t in report.tasks:
                if exclude.get(t.task):
                    t.layout = layout_report(t.task, seeds, exclude[t.task])
    except (SimError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_report(report, args.json, args.json.with_suffix(".png"))
    print(f"\n{report.policy}: closed-loop success, {args.episodes} episodes per task, seeds {args.seed}..")
    print(
        f"{'task':<26} {'success':>8} {'95% CI':>14} {'steps to success':>17} "
        f"{'failures: closest, cm (median)':>31} {'nearest demo layout, mm (median / max)':>40}"
    )
    for t in report.tasks:
        steps = f"{t.mean_steps_to_success:.1f}" if t.mean_steps_to_success is not None else "-"
        near = (t.layout or {}).get("nearest_training_layout_m")
        near_text = f"{near['median'] * 1e3:.1f} / {near['max'] * 1e3:.1f}" if near else "-"
        closest = t.median_closest_failed_m
        closest_text = f"{closest * 100:.1f}" if closest is not None else "-"
        print(
            f"{t.task:<26} {t.success_rate:>8.0%} {f'[{t.ci95[0]:.2f}, {t.ci95[1]:.2f}]':>14} {steps:>17} "
            f"{closest_text:>31} {near_text:>40}"
        )
    print(f"{'mean':<26} {report.mean_success:>8.0%}")
    print(f"wrote {args.json} and {args.json.with_suffix('.png')} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
