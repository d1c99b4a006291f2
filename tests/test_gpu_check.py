"""scripts/gpu_check.sh's CPU rehearsal: every part runs and lands in one JSON (the GPU figures come when a
GPU is lent; the same script runs there without --device cpu --quick)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_rehearses_on_cpu(tmp_path) -> None:
    out = tmp_path / "gc"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=850, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["quick"] is True
    parts = report["parts"]
    assert set(parts) == {"ns_float32", "optimizer", "train_pi0_tiny"}
    assert set(parts["optimizer"]["results"]) == {"adamw", "naive", "dmuon_lpt"}
    rows = parts["train_pi0_tiny"]["results"]["1"]
    assert set(rows) == {"adamw", "dmuon", "adamw+compile", "dmuon+compile"}
    assert all(r["peak_memory_gib"] > 0 and r["step_s"] > 0 for r in rows.values())
    assert rows["dmuon"]["compile_s"] is None and rows["dmuon+compile"]["compile_s"] is not None
    assert "gpu_check (cpu, quick)" in result.stdout
    import torch

    if not torch.cuda.is_available():  # without --device cpu it wants a GPU, and says so
        no_gpu = subprocess.run(
            ["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, env=env
        )
        assert no_gpu.returncode == 1 and "no CUDA device here" in no_gpu.stderr
