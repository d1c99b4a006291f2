"""Write the synthetic multi-camera, multi-task "reach" dataset in the LeRobot v3.0 layout.

    python scripts/make_synthetic_dataset.py --root data/synthetic --episodes 30 --cameras top,wrist \
        --video --codec av1 --image-size 64

See vla/data/synthetic.py for the world, the expert and the features.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vla.data.synthetic import CAMERAS, SyntheticConfig, generate_synthetic_dataset
from vla.help_format import HelpFormatter


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("data/synthetic"), help="dataset folder to create")
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--episode-length", type=int, default=50, help="frames per episode")
    parser.add_argument("--image-size", type=int, default=64, help="square camera images (even)")
    parser.add_argument("--cameras", default=",".join(CAMERAS), help=f"comma-separated subset of {CAMERAS}")
    parser.add_argument(
        "--video", action=argparse.BooleanOptionalAction, default=True, help="MP4 or PNG in parquet"
    )
    parser.add_argument(
        "--codec",
        choices=["av1", "h264"],
        default="av1",
        help="video codec (av1: libsvtav1, LeRobot's default; h264: libx264)",
    )
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-std", type=float, default=0.01, help="position noise per step")
    parser.add_argument("--colours", type=int, default=4, help="targets (and tasks) per episode, 1..4")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --root")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    config = SyntheticConfig(
        episodes=args.episodes,
        episode_length=args.episode_length,
        image_size=args.image_size,
        cameras=tuple(c.strip() for c in args.cameras.split(",") if c.strip()),
        use_videos=args.video,
        codec=args.codec,
        fps=args.fps,
        seed=args.seed,
        noise_std=args.noise_std,
        colours=args.colours,
    )
    start = time.perf_counter()
    root = generate_synthetic_dataset(args.root, config, overwrite=args.overwrite)
    frames = config.episodes * config.episode_length
    storage = f"{config.codec} video" if config.use_videos else "PNG in parquet"
    print(
        f"wrote {root}: {config.episodes} episodes, {frames} frames, cameras {list(config.cameras)} "
        f"({storage}) in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    from vla.training.user_errors import report_user_errors

    sys.exit(report_user_errors(main))
