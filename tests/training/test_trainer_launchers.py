"""Launchers as documented: accelerate launch on CPU, one error report under torchrun, a clean Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _trainer_runs import ROOT, metrics, summary, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _run(command: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.timeout(900)
def test_accelerate_launch_runs_two_processes_on_cpu(synthetic_dataset, tmp_path) -> None:
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    out = tmp_path / "fsdp2"
    # No parallel=...: the default (auto) shards with FSDP2 on several processes.
    overrides = tiny_overrides(synthetic_dataset, out, "trainer.steps=2")
    result = _run([*accelerate, "--multi_gpu", "--num_processes", "2", "train.py", *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(out)["world_size"] == 2 and summary(out)["layout"]["dtensor_params"] > 0
    assert "parallel=auto: 2 process(es) -> parallel=fsdp2" in result.stdout

    # Without --multi_gpu Accelerate starts one process on a machine without GPUs: refused, naming the fix.
    single = _run(
        [
            *accelerate,
            "--num_processes",
            "2",
            "train.py",
            *tiny_overrides(synthetic_dataset, tmp_path / "one"),
        ]
    )
    assert single.returncode != 0
    assert "accelerate launch --multi_gpu --num_processes 2 train.py" in single.stdout + single.stderr
    assert not (tmp_path / "one").exists()


@pytest.mark.timeout(600)
def test_an_error_under_torchrun_is_reported_once(synthetic_dataset, tmp_path) -> None:
    overrides = tiny_overrides(synthetic_dataset, tmp_path / "bad", "parallel=ddp", "trainer.batch_size=5")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = _run([*torchrun, "train.py", *overrides])
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("trainer.batch_size=5 must divide by world size") == 1, output[-4000:]
    assert len(re.findall(r"\[rank [01]\] failed:\nerror: trainer.batch_size=5", output)) == 1  # one block
    # No worker traceback (torchrun's launcher still prints its own ChildFailedError: vla.launch below
    # is the quiet launcher).
    assert "Error executing job" not in output and "vla/training/" not in output

    quiet = _run(
        [sys.executable, "-m", "vla.launch", "--standalone", "--nproc-per-node=2", "train.py", *overrides]
    )
    output = quiet.stdout + quiet.stderr
    assert quiet.returncode == 1
    assert output.count("trainer.batch_size=5 must divide by world size") == 1
    assert "ChildFailedError" not in output and "vla.launch: failed: rank 0" in output


@pytest.mark.timeout(600)
def test_ctrl_c_under_the_launcher_ends_cleanly(synthetic_dataset, tmp_path) -> None:
    out = tmp_path / "interrupted"
    overrides = tiny_overrides(
        synthetic_dataset, out, "parallel=ddp", "trainer.steps=100000", "trainer.checkpoint_every=100000"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "vla.launch", "--standalone", "--nproc-per-node=2", "train.py", *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while not (out / "metrics.jsonl").is_file() or len(metrics(out)) < 2:
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
            time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal: the launcher's process group
        output, _ = process.communicate(timeout=200)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, output[-4000:]
    assert "Traceback" not in output and "SignalException" not in output
    assert "vla.launch: stopped by SIGINT" in output
    saved = sorted((out / "checkpoints").iterdir())
    assert len(saved) == 1 and int(saved[0].name.split("_")[1]) == len(metrics(out))


@pytest.mark.timeout(600)
def test_the_console_script_trains_from_any_directory(synthetic_dataset, tmp_path) -> None:
    script = Path(sys.executable).parent / "vla-train"  # installed by `pip install -e .` ([project.scripts])
    assert script.is_file(), f"{script} is missing: reinstall the package (pip install -e .)"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    result = subprocess.run(
        [str(script), *tiny_overrides(synthetic_dataset, out, "trainer.steps=2")],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=400,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(out)["steps"] == 2 and list(elsewhere.iterdir()) == []  # nothing written where it ran
