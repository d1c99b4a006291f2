"""Record scripted-expert MetaWorld demonstrations as a LeRobot v3.0 dataset (H.264 video).

    python scripts/make_sim_dataset.py --tasks reach-v3,push-v3 --episodes 50 --resolution 128 \
        --root data/metaworld --seed 0 [--cameras corner2] [--workers 8] [--overwrite]

Experts run on seeds --seed, --seed + 1, ... per task; only successful episodes are kept, and every
kept seed is recorded in meta/metaworld.json (evaluation uses seeds disjoint from them). Prints the
expert's success rate per task and what was kept. The experts run in --workers processes (default one
per CPU); the recording is the same whatever their number. See vla/sim/demos.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vla.data.errors import DatasetError
from vla.help_format import HelpFormatter
from vla.sim import DemoConfig, SimError, generate_sim_dataset


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    defaults = DemoConfig()  # data=metaworld's settings
    parser.add_argument(
        "--tasks", default=",".join(defaults.tasks), help="comma-separated MetaWorld v3 tasks"
    )
    parser.add_argument(
        "--episodes", type=int, default=defaults.episodes, help="successful episodes per task"
    )
    parser.add_argument(
        "--resolution", type=int, default=defaults.resolution, help="square camera images, pixels"
    )
    parser.add_argument(
        "--cameras",
        default=",".join(defaults.cameras),
        help="comma-separated cameras: MetaWorld's, or vla.sim's workspace views "
        "(workspace, workspace_top, workspace_side)",
    )
    parser.add_argument("--root", type=Path, default=Path("data/metaworld"), help="dataset folder to create")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="first expert seed of every task")
    parser.add_argument(
        "--max-episode-steps",
        type=int,
        default=defaults.max_episode_steps,
        help="an expert episode's step cap",
    )
    parser.add_argument(
        "--max-attempts", type=int, default=None, help="seeds tried per task (default 2 x episodes)"
    )
    parser.add_argument(
        "--codec",
        choices=["av1", "h264"],
        default=defaults.codec,
        help="video codec (h264: libx264; av1: libsvtav1, LeRobot's default)",
    )
    parser.add_argument("--crf", type=int, default=defaults.crf, help="video quality (lower: better, bigger)")
    parser.add_argument(
        "--action-noise",
        type=float,
        default=defaults.action_noise,
        help="std of DART-style noise on the executed hand action (labels stay the expert's)",
    )
    parser.add_argument(
        "--hand-start-noise",
        type=float,
        default=defaults.hand_start_noise,
        help="metres: each episode's hand starts off MetaWorld's start by x, y in [-r, r], z in [0, r]",
    )
    parser.add_argument(
        "--steps-after-success",
        type=int,
        default=defaults.steps_after_success,
        help="expert steps recorded past each episode's first success (0: episodes end at it)",
    )
    parser.add_argument(
        "--expert-aims-tcp",
        action="store_true",
        help="reach experts steer the tool centre point (what success measures) onto the goal, not the hand",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes rolling out the expert (0: one per CPU, at most 8); the recording does not depend on it",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --root")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    try:
        config = DemoConfig(
            tasks=args.tasks,
            episodes=args.episodes,
            resolution=args.resolution,
            cameras=[c.strip() for c in args.cameras.split(",") if c.strip()],
            seed=args.seed,
            max_episode_steps=args.max_episode_steps,
            max_attempts=args.max_attempts,
            codec=args.codec,
            crf=args.crf,
            action_noise=args.action_noise,
            hand_start_noise=args.hand_start_noise,
            steps_after_success=args.steps_after_success,
            expert_aims_tcp=args.expert_aims_tcp,
        )
        start = time.perf_counter()
        columns = (
            TextColumn("{task.description:<26}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, disable=not sys.stderr.isatty()) as bar:
            bars = {task: bar.add_task(task, total=config.episodes) for task in config.tasks}
            root = generate_sim_dataset(
                args.root,
                config,
                overwrite=args.overwrite,
                workers=args.workers,
                progress=lambda task, kept, wanted: bar.update(bars[task], completed=kept),
            )
    except (SimError, DatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from vla.sim.demos import load_sim_marker

    marker = load_sim_marker(root)
    assert marker is not None
    print(
        f"wrote {root} in {time.perf_counter() - start:.0f} s ({config.resolution}px, cameras {config.cameras})"
    )
    print(f"{'task':<26} {'expert success':>15} {'kept':>5} {'mean length':>12}")
    for s in marker["expert"]:
        print(
            f"{s['task']:<26} {s['success_rate']:>9.0%} ({s['successes']}/{s['attempts']}) "
            f"{s['kept']:>5} {s['mean_length']:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
