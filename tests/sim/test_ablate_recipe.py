"""scripts/ablate_recipe.py: its variants compose, and the report reads finished runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import ablate_recipe  # noqa: E402


def test_every_variant_composes_over_the_recipe() -> None:
    from vla.training.cli import compose_many

    configs = compose_many([["experiment=metaworld", *o] for _, o in ablate_recipe.VARIANTS.values()])
    by_name = dict(zip(ablate_recipe.VARIANTS, configs))
    assert not by_name["recipe"].data.image_transforms.enable  # measured to hurt here: off in the recipe
    assert by_name["shift_augmentation"].data.image_transforms.enable
    assert by_name["ema"].trainer.ema_decay == 0.999 and by_name["steps_4000"].trainer.steps == 4000
    assert by_name["patch_8"].model.overrides == {"vision": {"patch_size": 8}}
    assert by_name["resolution_96"].data.metaworld.resolution == 96
    assert by_name["demos_100"].data.root != by_name["recipe"].data.root  # another recording, another root
    after = by_name["after_success_20"].data
    assert after.metaworld.steps_after_success == 20 and after.root != by_name["recipe"].data.root
    tcp = by_name["expert_tcp"].data
    assert tcp.metaworld.expert_aims_tcp and not by_name["recipe"].data.metaworld.expert_aims_tcp
    assert tcp.root != by_name["recipe"].data.root
    side = by_name["side_camera"]
    assert (
        list(side.data.metaworld.cameras) == ["workspace_side", "topview"] == side.model.overrides["cameras"]
    )
    assert dict(side.data.camera_map) == {f"observation.images.{c}": c for c in side.data.metaworld.cameras}
    wrist = by_name["wrist_camera"]
    assert (
        list(wrist.data.metaworld.cameras) == ["workspace", "gripperPOV"] == wrist.model.overrides["cameras"]
    )
    assert dict(wrist.data.camera_map) == {f"observation.images.{c}": c for c in wrist.data.metaworld.cameras}
    assert wrist.data.root not in (side.data.root, by_name["recipe"].data.root)


def _fake_run(run_dir: Path, successes: dict[str, int], step_s: float) -> None:
    run_dir.mkdir(parents=True)
    records = [
        {"step": s, "split": "train", "loss": 1.0, "step_s": step_s, "optimizer_s": 0.1} for s in (1, 2)
    ]
    records += [{"step": 2, "split": "val", "loss": 0.3}]
    records += [{"step": 2, "split": "eval", "success/mean": 0.5, "train_s": 2 * step_s, "episodes": 4.0}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    tasks = [{"task": t, "successes": k, "episodes": 4, "ci95": [0, 1]} for t, k in successes.items()]
    mean = sum(successes.values()) / (4 * len(successes))
    (run_dir / "closed_loop.json").write_text(json.dumps({"mean_success": mean, "tasks": tasks}))
    (run_dir / "summary.json").write_text(
        json.dumps({"steps": 2, "status": "finished", "stopped_early": None})
    )


def test_report_tabulates_finished_runs(tmp_path) -> None:
    _fake_run(tmp_path / "runs" / "recipe", {"reach-v3": 4, "push-v3": 2}, 1.0)
    _fake_run(tmp_path / "runs" / "shift_augmentation", {"reach-v3": 1, "push-v3": 0}, 0.9)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/ablate_recipe.py"), f"--out={tmp_path}", "--report",
         "--variants=recipe,shift_augmentation,ema"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "ablations.json").read_text())["rows"]
    assert set(rows) == {"recipe", "shift_augmentation"}  # ema never ran
    assert (
        rows["recipe"]["mean_success"] == 0.75
        and rows["shift_augmentation"]["tasks"]["reach-v3"]["successes"] == 1
    )
    low, high = rows["shift_augmentation"]["tasks"]["push-v3"]["ci95"]
    assert low == 0.0 and 0.3 < high < 0.6  # Wilson interval of 0/4
    assert abs(rows["shift_augmentation"]["step_time_vs_recipe"] - 0.9) < 1e-9
    assert "shift_augmentation" in result.stdout and (tmp_path / "ablations.png").stat().st_size > 1000


def test_report_keeps_earlier_rows_whose_runs_are_elsewhere(tmp_path) -> None:
    """--keep: rows of an earlier report stay for variants without a run here; a run here wins."""
    earlier = {"rows": {"recipe": {"changes": "old", "mean_success": 0.1, "tasks": {"reach-v3": {"successes": 2, "episodes": 20}}},
                        "ema": {"changes": "kept", "mean_success": 0.3, "tasks": {"reach-v3": {"successes": 6, "episodes": 20}}}}}  # fmt: skip
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    _fake_run(tmp_path / "out" / "runs" / "recipe", {"reach-v3": 4, "push-v3": 2}, 1.0)
    command = [sys.executable, str(ROOT / "scripts/ablate_recipe.py"), f"--out={tmp_path / 'out'}", "--report",
               "--variants=recipe", f"--keep={tmp_path / 'earlier.json'}"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "out" / "ablations.json").read_text())["rows"]
    assert set(rows) == {"recipe", "ema"} and rows["recipe"]["mean_success"] == 0.75
    assert rows["ema"]["changes"] == "kept" and rows["ema"]["tasks"]["reach-v3"]["ci95"][0] > 0
    missing = subprocess.run([*command[:-1], f"--keep={tmp_path / 'none.json'}"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)  # fmt: skip
    assert missing.returncode != 0 and "--keep" in missing.stderr and "Traceback" not in missing.stderr
