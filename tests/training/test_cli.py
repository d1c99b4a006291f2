"""train.py's glue around Hydra and the launchers (vla.training.cli), without launching anything."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from vla.training import cli
from vla.training.config import TrainConfig


def test_dict_fields_are_found_in_the_schema() -> None:
    assert cli.dict_field_paths(TrainConfig) == [
        "model.overrides",
        "data.camera_map",
        "data.norm_modes",
        "data.task_weights",
        "data.image_transforms.tfs",
    ]


def test_the_first_failing_rank_reports_and_the_others_stay_quiet(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-run")
    monkeypatch.setenv("RANK", "1")
    assert cli.report_once(ValueError("bad batch"))
    assert capsys.readouterr().err == "[rank 1] failed:\n"
    monkeypatch.setenv("RANK", "0")
    assert not cli.report_once(ValueError("bad batch"))  # the same error: nothing more
    assert capsys.readouterr().err == ""
    assert not cli.report_once(RuntimeError("Connection closed by peer"))  # another one: one line
    assert capsys.readouterr().err == "[rank 0] failed too: RuntimeError: Connection closed by peer\n"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.report_once(ValueError("single process"))  # no launcher: always report


def test_the_launchers_process_count_is_read_from_its_command_line(monkeypatch) -> None:
    code = "import time; time.sleep(30)"
    for args, expected in ((["--num_processes", "3"], 3), (["--num-processes=4"], 4), (["x"], None)):
        process = subprocess.Popen([sys.executable, "-c", code, *args])
        try:
            # Right after fork the child's /proc cmdline is still pytest's: wait (bounded) for its exec.
            cmdline = Path(f"/proc/{process.pid}/cmdline")
            deadline = time.monotonic() + 20
            while code.encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert cli._parent_num_processes(process.pid) == expected
        finally:
            process.kill()
            process.wait()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(cli, "_parent_num_processes", lambda pid=None: 2)
    with pytest.raises(cli.LaunchError, match=r"accelerate launch --multi_gpu --num_processes 2 train\.py"):
        cli.check_launch()
    monkeypatch.setenv("WORLD_SIZE", "2")  # a real multi-process launch
    cli.check_launch()


def test_an_unused_hydra_directory_goes_with_the_parents_it_leaves_empty(tmp_path, monkeypatch) -> None:
    from vla.training.cli import remove_if_empty

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "pi0_tiny-dmuon" / "2026-12-01_10-00-00").mkdir(parents=True)
    remove_if_empty("outputs/pi0_tiny-dmuon/2026-12-01_10-00-00")
    assert list(tmp_path.iterdir()) == []  # no empty outputs/ left in the checkout
    (tmp_path / "outputs" / "a" / "t1").mkdir(parents=True)
    (tmp_path / "outputs" / "b" / "run.log").parent.mkdir(parents=True)
    (tmp_path / "outputs" / "b" / "run.log").write_text("kept")
    remove_if_empty(tmp_path / "outputs" / "a" / "t1")
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["b"]
    remove_if_empty(tmp_path)  # never the working directory itself
    assert tmp_path.is_dir()
