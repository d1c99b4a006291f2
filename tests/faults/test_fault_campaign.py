"""scripts/fault_campaign.py (issue 18): generated damage never passes silently, and the campaign can
tell when it would (a negative control with checksums switched off)."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_a_small_campaign_has_no_silent_case(tmp_path) -> None:
    out = tmp_path / "campaign.json"
    command = [sys.executable, str(ROOT / "scripts" / "fault_campaign.py"), "--flips=3", "--nan-frames=6",
               "--export-flips=4", "--kills=2", "--disk-full=6", "--races=2", "--stalls=1",
               f"--json={out}"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    cases = json.loads(out.read_text())["cases"]
    kinds = {c["kind"] for c in cases}
    assert kinds == {
        "checkpoint_flip",
        "checkpoint_cut",
        "nan_frame",
        "export_flip",
        "kill_save",
        "disk_full",
        "race",
        "stall",
    }
    assert {c["file"] for c in cases if c["kind"] == "disk_full"} == {"checkpoint", "export", "dataset"}
    assert all(c["outcome"] in ("recovered", "named") for c in cases)
    files = {c["file"] for c in cases if c["kind"] == "checkpoint_flip"}
    assert {"manifest.json", "trainer.pt", "model_optim/.metadata"} <= files and any(
        ".distcp" in f for f in files
    )


def test_the_campaign_sees_a_silent_case_when_checksums_are_off(tmp_path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("fault_campaign", ROOT / "scripts" / "fault_campaign.py")
    campaign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(campaign)
    from vla.training.checkpoint import CheckpointManager

    original = CheckpointManager.verify
    monkeypatch.setattr(
        CheckpointManager,
        "verify",
        lambda self, path, checksums=True, part=(0, 1): original(self, path, checksums=False),
    )
    pristine = campaign.make_checkpoints(tmp_path / "pristine")
    shard = next(p for p in (pristine / "step_00000002" / "model_optim").iterdir() if p.suffix == ".distcp")
    relative = str(shard.relative_to(pristine / "step_00000002"))
    rng = random.Random(0)
    outcomes = [
        campaign.checkpoint_case(pristine, tmp_path, relative, "flip", rng)["outcome"] for _ in range(5)
    ]
    assert "silent" in outcomes  # a flipped bit in a tensor is invisible without the digests


def test_a_full_disk_inside_dcp_reaches_the_user_as_no_space_left(tmp_path) -> None:
    """torch.save inside DCP turns ENOSPC into RuntimeError("unexpected pos"): the manager digs the
    OSError out, and train.py's one-line error says where the disk is full and how to resume."""
    spec = importlib.util.spec_from_file_location("fault_campaign", ROOT / "scripts" / "fault_campaign.py")
    campaign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(campaign)
    from torch import nn

    from vla.training.checkpoint import CheckpointError, CheckpointManager
    from vla.training.user_errors import describe, is_user_error

    manager = CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as caught, campaign._DiskFull(budget=100_000):
        manager.save(1, nn.Linear(256, 256))
    assert "(DCP) failed: OSError: [Errno 28] No space left on device" in str(caught.value)
    assert is_user_error(caught.value)
    assert "no space left on the device holding" in describe(caught.value)
    assert "resume with trainer.resume=auto" in describe(caught.value)
    assert manager.checkpoints() == [] and not list((tmp_path / "ckpt").iterdir())
    # Nothing stays patched for the tests after it (the export's writer was once left "full" for good).
    import builtins
    import io

    import safetensors.torch

    import vla.models.weights

    assert vla.models.weights.save_file is safetensors.torch.save_file
    assert builtins.open is io.open and getattr(io.open, "__module__", "") != "fault_campaign"
