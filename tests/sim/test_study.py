"""scripts/study_optimizers.py end to end on a tiny model and recording: runs, reuse, report, plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _sim_fixtures import SIM_DATA_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import study_optimizers  # noqa: E402


def test_steps_to_reach_and_curves(tmp_path) -> None:
    records = [
        {"step": s, "split": "train", "loss": 1.0 / s, "step_s": t, "optimizer_s": t / 10}
        for s, t in enumerate([9.0, 1.0, 1.0, 3.0], 1)
    ]
    records += [{"step": 2, "split": "val", "loss": 0.5}, {"step": 4, "split": "val", "loss": 0.2}]
    records.append({"step": 4, "split": "val", "loss": 0.25})  # a resumed run re-logs a step: the last wins
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    curve = study_optimizers.curves(tmp_path)
    assert curve["val_steps"] == [2, 4] and curve["val_loss"] == [0.5, 0.25]
    assert curve["median_step_s"] == 2.0 and curve["val_seconds"] == [4.0, 8.0]
    assert curve["median_optimizer_s"] == pytest.approx(0.2)
    assert study_optimizers.steps_to_reach(curve, 0.3) == 4
    assert study_optimizers.steps_to_reach(curve, 0.5) == 2
    assert study_optimizers.steps_to_reach(curve, 0.1) is None
    # Metrics written before steps were numbered 1..N started at 0: read the same.
    for r in records:
        r["step"] -= 1
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert study_optimizers.curves(tmp_path)["val_steps"] == [2, 4]


@pytest.mark.slow
def test_study_runs_sweeps_and_reports(tmp_path, sim_dataset) -> None:
    out = tmp_path / "study"
    train_args = [
        "+model.overrides.cameras=[corner2,topview]",
        *SIM_DATA_OVERRIDES[1:],
        f"data.root={sim_dataset}",
        "data.num_workers=0",
        "data.val_fraction=0.25",
    ]
    command = [sys.executable, str(ROOT / "scripts/study_optimizers.py"), f"--out={out}", "--model=pi0_tiny",
               "--steps=4", "--batch-size=4", "--val-every=2", "--adamw-lrs=1e-3", "--dmuon-lrs=0.01,0.02",
               "--muon-steps=2", "--episodes=1", "--replan-every=5"]  # fmt: skip
    command += [f"--train-arg={a}" for a in train_args]
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    best_lr = study["runs"][study["best"]["dmuon"]]["lr"]
    assert set(study["runs"]) == {
        "adamw_lr0.001",
        "dmuon_lr0.01",
        "dmuon_lr0.02",
        f"muon_lr{best_lr:g}_2steps",  # naive Muon and its DMuon twin, 2 steps of the 4-step schedule
        f"dmuon_lr{best_lr:g}_2steps",
    }
    assert study["best"]["adamw"] == "adamw_lr0.001" and study["best"]["dmuon"] in (
        "dmuon_lr0.01",
        "dmuon_lr0.02",
    )
    assert study["runs"]["adamw_lr0.001"]["curve"]["val_steps"] == [2, 4]
    # Naive Muon is the same update as DMuon: the same losses at the same steps (Gram vs standard NS only).
    assert study["muon_vs_dmuon"]["steps"] == 2 and study["muon_vs_dmuon"]["max_rel_loss_diff"] < 1e-4
    twin = study["runs"][f"dmuon_lr{best_lr:g}_2steps"]["curve"]["train_loss"]
    assert (
        twin == study["runs"][f"dmuon_lr{best_lr:g}"]["curve"]["train_loss"][:2]
    )  # the full run's first steps
    assert set(study["closed_loop"]) == {"adamw", "dmuon"}
    assert all(t["episodes"] == 1 for t in study["closed_loop"]["adamw"]["tasks"])
    assert (out / "val_loss.png").stat().st_size > 1000 and (out / "success.png").stat().st_size > 1000
    # A second call reuses every finished run and evaluation.
    second = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and second.stdout.count("finished earlier, reused") == 5
    assert "closed-loop evaluation" not in second.stdout
