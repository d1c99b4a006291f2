"""Write LeRobot's `pretrained_model/` for an existing pi0 run or one of its checkpoints.

    python scripts/export_lerobot.py RUN_DIR                         # RUN_DIR/pretrained_model from its export
    python scripts/export_lerobot.py RUN_DIR --checkpoint step_00001000 [--out DIR]

The directory gets LeRobot 0.4.x's processor files (policy_preprocessor.json, its normalizer statistics,
policy_postprocessor.json, its unnormalizer statistics) from the run's processor.json and dataset, and,
where LeRobot can build the model's size (the full pi0), config.json and model.safetensors; then
`make_pre_post_processors(cfg, pretrained_path=DIR)` and `PI0Policy.from_pretrained(DIR)` load it.
A checkpoint is exported into RUN_DIR/exports/<checkpoint> (policy.safetensors + pretrained_model/),
with its EMA weights when the run kept an EMA. Runs export this at their end anyway; this is for runs
made before, and for checkpoints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vla.help_format import HelpFormatter
from vla.training.user_errors import report_user_errors


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a training run directory (config.yaml, processor.json)")
    parser.add_argument(
        "--checkpoint", default=None, help="a checkpoint of the run: its name under checkpoints/ or a path"
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: see above)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    from vla.training.export import export_for_lerobot

    directory = export_for_lerobot(args.run_dir, checkpoint=args.checkpoint, out=args.out)
    print(f"LeRobot's pretrained_model: {directory}")
    for path in sorted(directory.iterdir()):
        print(f"  {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(report_user_errors(main))
