"""scripts/eval_sim.py never loses its guard (issue 18 item 7, issue 15 item 5): the training seeds
come from the run's dataset found relative to where the run was launched; a run whose dataset cannot
be found is refused unless --unknown-training-seeds; a run not trained on MetaWorld says so in one line;
tasks, cameras and resolution come from the run's config."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _run_dir(tmp_path: Path, data: dict, hydra_cwd: Path | None = None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": data}))
    if hydra_cwd is not None:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "hydra.yaml").write_text(
            yaml.safe_dump({"hydra": {"runtime": {"cwd": str(hydra_cwd)}}})
        )
    return run


def _eval(run: Path, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / "eval_sim.py"), str(run), "--json", str(run / "e.json")]
    return subprocess.run([*command, *extra], capture_output=True, text=True, cwd=cwd, timeout=100)


METAWORLD = {"tasks": ["reach-v3"], "cameras": ["topview"], "resolution": 48}


def test_a_run_not_trained_on_metaworld_says_so_in_one_line(tmp_path) -> None:
    run = _run_dir(tmp_path, {"source": "synthetic", "root": "data/synthetic"})
    result = _eval(run, cwd=tmp_path)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "data.source='synthetic', not MetaWorld" in result.stderr


def test_a_run_whose_dataset_is_missing_is_refused_unless_told(tmp_path) -> None:
    run = _run_dir(tmp_path, {"source": "metaworld", "root": "data/moved_away", "metaworld": METAWORLD})
    result = _eval(run, cwd=tmp_path)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "data.root='data/moved_away'" in result.stderr and "--unknown-training-seeds" in result.stderr
    assert str(tmp_path / "data" / "moved_away") in result.stderr  # where it looked


def _load_script():
    spec = importlib.util.spec_from_file_location("eval_sim", ROOT / "scripts" / "eval_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dataset_is_found_where_the_run_was_launched_and_settings_come_from_the_config(
    tmp_path, monkeypatch
) -> None:
    launched = tmp_path / "project"
    dataset = launched / "data" / "mw"
    (dataset / "meta").mkdir(parents=True)
    (dataset / "meta" / "info.json").write_text("{}")
    marker = {
        "generator": "vla.sim.demos",
        "config": {},
        "episodes": [{"episode_index": 0, "task": "reach-v3", "seed": 7, "length": 40}],
    }
    (dataset / "meta" / "metaworld.json").write_text(json.dumps(marker))
    run = _run_dir(tmp_path, {"source": "metaworld", "root": "data/mw", "metaworld": METAWORLD}, launched)
    monkeypatch.chdir(tmp_path)  # not where the run was launched
    eval_sim = _load_script()
    recorded, exclude = eval_sim.run_settings(run, unknown_training_seeds=False)
    assert recorded == METAWORLD and exclude == {"reach-v3": {7}}
    # Without the dataset, only the explicit switch evaluates, and without any seed check.
    (dataset / "meta" / "info.json").unlink()
    with pytest.raises(ValueError, match="--unknown-training-seeds"):
        eval_sim.run_settings(run, unknown_training_seeds=False)
    assert eval_sim.run_settings(run, unknown_training_seeds=True) == (METAWORLD, {})


def test_the_replan_interval_and_step_limit_default_to_the_run_s(tmp_path) -> None:
    """eval_sim.py (and, for the interval, the LeRobot export) plays episodes as the run's own evaluation did."""
    from vla.eval.policy_runner import run_max_episode_steps, run_replan_every

    run = _run_dir(tmp_path, {"source": "metaworld", "root": "data/mw", "metaworld": METAWORLD})
    # a config without trainer.closed_loop: the trainer's defaults
    assert (run_replan_every(run), run_max_episode_steps(run)) == (5, 200)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(
        yaml.safe_dump({**config, "trainer": {"closed_loop": {"replan_every": 3, "max_episode_steps": 150}}})
    )
    assert (run_replan_every(run), run_max_episode_steps(run)) == (3, 150)
    for broken in (0, True, "150"):  # never a value a run could not have used
        (run / "config.yaml").write_text(
            yaml.safe_dump({**config, "trainer": {"closed_loop": {"max_episode_steps": broken}}})
        )
        assert run_max_episode_steps(run) == 200
    usage = " ".join(_eval(run, "--help", cwd=tmp_path).stdout.split())
    assert "(default: the run's trainer.closed_loop.replan_every" in usage
    assert "(default: the run's trainer.closed_loop.max_episode_steps; 200 for --policy)" in usage
