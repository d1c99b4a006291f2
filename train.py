"""Train a VLA policy: `python train.py model=pi0 optim=dmuon [key=value ...]` (Hydra overrides).

Multi-process: `torchrun --standalone --nproc_per_node N train.py parallel=fsdp2` (or `accelerate
launch`). Configuration lives in configs/ and is validated by vla/training/config.py.

Exit codes (vla.training.guards): 0 finished, 1 failed (the message names the key or file and the
fix), 130 stopped by SIGINT/SIGTERM (resume with trainer.resume=auto).
"""

import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra
from omegaconf import DictConfig

from vla.training.config import register_configs, to_train_config
from vla.training.guards import EXIT_FINISHED, EXIT_STOPPED, StopRequested
from vla.training.loop import run

register_configs()
_exit_code = [EXIT_FINISHED]


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        summary = run(to_train_config(cfg))
    except StopRequested as stop:
        print(f"vla: {stop}", file=sys.stderr, flush=True)
        _exit_code[0] = EXIT_STOPPED
        return
    if summary.stopped_early:
        print(
            f"vla: {summary.stopped_early}; resume with trainer.resume=auto (exit code 130)", file=sys.stderr
        )
        _exit_code[0] = EXIT_STOPPED


if __name__ == "__main__":
    main()
    sys.exit(_exit_code[0])
