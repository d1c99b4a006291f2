"""Helpers for trainer tests: tiny runs in this process or under torchrun, and their outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# pi0_tiny on a small generated dataset: a step takes a few hundredths of a second.
TINY = [
    "model=pi0_tiny",
    "optim.adamw_lr=3e-3",
    "trainer.batch_size=8",
    "trainer.warmup_steps=1",
    "trainer.progress_bar=false",
    "trainer.val_batches=2",
    "data.num_workers=0",
    "data.synthetic.episodes=8",
    "data.synthetic.episode_length=20",
    "data.synthetic.image_size=32",
]


def tiny_overrides(dataset: Path, output: Path, *extra: str) -> list[str]:
    return [*TINY, f"data.root={dataset}", f"output_dir={output}", *extra]


def run_in_process(overrides: list[str]):
    """Compose and fit in this process (Accelerate's singleton state is reset first)."""
    from accelerate.state import AcceleratorState

    from vla.training.cli import compose
    from vla.training.loop import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)
    return Trainer(compose(overrides)).fit()


def run_torchrun(
    overrides: list[str],
    nproc: int,
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node nproc train.py overrides...` from the repo root."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["train.py", *overrides]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and result.returncode != 0:
        raise AssertionError(
            f"torchrun exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def metrics(output: Path, split: str = "train") -> list[dict[str, Any]]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def losses(output: Path, split: str = "train") -> list[float]:
    return [r["loss"] for r in metrics(output, split)]


def summary(output: Path) -> dict[str, Any]:
    return json.loads((output / "summary.json").read_text())
