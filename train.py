"""Train a VLA policy: `python train.py model=pi0 optim=dmuon [key=value ...]` (Hydra overrides).

Multi-process: `torchrun --standalone --nproc_per_node N train.py parallel=fsdp2` (or `accelerate
launch`). Configuration lives in configs/ and is validated by vla/training/config.py.
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra
from omegaconf import DictConfig

from vla.training.cli import main as train_main
from vla.training.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    train_main(cfg)


if __name__ == "__main__":
    main()
