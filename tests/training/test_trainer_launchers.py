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

    import tempfile

    markers = set(Path(tempfile.gettempdir()).glob("vla-run-*.error"))
    quiet = _run(
        [sys.executable, "-m", "vla.launch", "--standalone", "--nproc-per-node=2", "train.py", *overrides]
    )
    # The first-error marker the ranks shared is gone with its launch (no /tmp leftovers).
    assert set(Path(tempfile.gettempdir()).glob("vla-run-*.error")) <= markers
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(900)
def test_two_nodes_through_the_c10d_rendezvous_train_like_one_node_of_two(
    synthetic_dataset, tmp_path
) -> None:
    """The README's multi-node launch (and scripts/slurm/train.sbatch's): `torchrun --nnodes 2
    --rdzv-backend c10d --rdzv-endpoint HOST:PORT` once per node; here 2 "nodes" of 1 process on this
    machine, sharing the output directory as nodes share a filesystem. Same losses as --standalone x 2."""
    port = _free_port()
    out = tmp_path / "nodes"
    overrides = tiny_overrides(synthetic_dataset, out, "trainer.steps=3")
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "vla-test",
            "train.py", *overrides]  # fmt: skip
    nodes = [
        subprocess.Popen(node, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=600) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for p, (_, stderr) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
    assert summary(out)["world_size"] == 2
    single = tmp_path / "single"
    standalone = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "train.py", *tiny_overrides(synthetic_dataset, single, "trainer.steps=3")]  # fmt: skip
    result = _run(standalone, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in metrics(out)]
    assert len(losses) == 3 and losses == [r["loss"] for r in metrics(single)]


@pytest.mark.timeout(900)
def test_the_slurm_script_launches_one_torchrun_per_node(synthetic_dataset, tmp_path) -> None:
    """scripts/slurm/train.sbatch under stand-ins for srun (one copy of the command per "node", as srun
    --ntasks-per-node=1 starts it) and scontrol: 2 nodes x 1 process meet at the head node and train."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nshift  # --kill-on-bad-exit=1\npids=()\n"
        'for _ in $(seq "$SLURM_JOB_NUM_NODES"); do "$@" & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc\n'
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    out = tmp_path / "job"
    env = {**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(ROOT), "GPUS_PER_NODE": "1",
           "RDZV_PORT": str(_free_port()), "PYTHON": sys.executable, "OUTPUT_DIR": str(out)}  # fmt: skip
    overrides = [
        o
        for o in tiny_overrides(synthetic_dataset, out, "trainer.steps=2")
        if not o.startswith("output_dir=")
    ]
    result = subprocess.run(
        ["bash", "scripts/slurm/train.sbatch", *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(out)["world_size"] == 2 and len(metrics(out)) == 2
    assert "parallel=auto: 2 process(es) -> parallel=fsdp2" in result.stdout
