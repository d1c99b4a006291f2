"""Shared pytest setup: offline hubs, deterministic seeds, the trainer tests' dataset.

No test needs a GPU: the GPU checks are scripts/gpu_check.sh, rehearsed on CPU by test_gpu_check.py."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# A watchdog that ends a test stuck in native code, printing every stack (see hard_limit.py).
pytest_plugins = ["hard_limit"]


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer tests' dataset: written once, matching tests/training/_trainer_runs.TINY."""
    from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset

    root = tmp_path_factory.mktemp("data") / "synthetic"
    ensure_synthetic_dataset(root, SyntheticConfig(episodes=8, episode_length=20, image_size=32))
    return root
