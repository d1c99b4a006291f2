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

from vla.training.cli import main as train_main
from vla.training.cli import register_configs
from vla.training.guards import EXIT_FINISHED

register_configs()
_exit_code = [EXIT_FINISHED]


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    _exit_code[0] = train_main(cfg)


if __name__ == "__main__":
    main()
    sys.exit(_exit_code[0])
