"""Process-level faults, each in a subprocess under a hard timeout (issue 10 items 7, 10, 11):
SIGTERM outside a training step (building data, in validation) and inside a step that never ends,
kill -9 of the torchrun agent (the worker must exit), and kill -9 at a random (seeded) moment
followed by resume=auto, compared with an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _trainer_runs import ROOT, losses, metrics, run_in_process, tiny_overrides

from vla.training.guards import EXIT_STOPPED
from vla.training.runlock import LOCK_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DRIVER = Path(__file__).with_name("_fault_driver.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _wait_until(condition, process: subprocess.Popen, what: str, bound_s: float = 400) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the process exited ({process.returncode}) before {what}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"not reached within {bound_s} s: {what}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited (its new parent may not reap it)


@pytest.mark.parametrize(
    ("fault", "extra", "group", "expected"),
    [
        ("build", [], False, "SIGTERM arrived while outside a training step"),
        ("validation", ["trainer.val_every=2"], False, "SIGTERM arrived while validation"),
        (
            "step",
            ["trainer.stop_grace_s=2"],
            False,
            "the training step did not end within trainer.stop_grace_s=2 s",
        ),
        # to the whole process group, as scancel does: the DataLoader workers die of it too, and PyTorch's
        # "worker is killed by signal" error used to turn the stop into a failure with a traceback (exit 1)
        ("validation", ["trainer.val_every=2", "data.num_workers=2"], True, "SIGTERM arrived"),
    ],
)
def test_sigterm_ends_the_process_wherever_it_is(
    synthetic_dataset, tmp_path, fault, extra, group, expected
) -> None:
    marker, out = tmp_path / "marker", tmp_path / "run"
    overrides = tiny_overrides(synthetic_dataset, out, "trainer.steps=4", *extra)
    process = subprocess.Popen(
        [sys.executable, str(DRIVER), fault, str(marker), *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=group,
    )  # fmt: skip
    try:
        _wait_until(marker.exists, process, f"the {fault} hang")
        if group:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)  # it used to wait for a step boundary forever
    finally:
        process.kill()
    assert process.returncode == EXIT_STOPPED, output
    assert expected in output and "trainer.resume=auto" in output, output
    assert "Traceback" not in output, output
    assert not (out / LOCK_FILE).exists()  # released on the way out


def test_workers_exit_when_the_torchrun_agent_is_killed(synthetic_dataset, tmp_path) -> None:
    out, log = tmp_path / "run", tmp_path / "log.txt"
    overrides = tiny_overrides(
        synthetic_dataset, out, "trainer.steps=100000", "trainer.checkpoint_every=100000"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    with open(log, "w") as sink:
        agent = subprocess.Popen(
            [*command, "train.py", *overrides], cwd=ROOT, stdout=sink, stderr=sink, env=ENV
        )
    worker = None
    try:
        _wait_until(lambda: (out / "metrics.jsonl").is_file() and len(metrics(out)) >= 2, agent, "training")
        import json

        worker = json.loads((out / LOCK_FILE).read_text())["pid"]  # the lock names rank 0's pid
        assert worker != agent.pid and _alive(worker)
        agent.kill()  # kill -9 the launcher: nothing forwards a signal to the worker
        agent.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), f"orphaned worker {worker} still trains:\n{log.read_text()[-3000:]}"
        assert f"the launcher (pid {agent.pid}) of rank 0 (pid {worker}) is gone" in log.read_text()
    finally:
        agent.kill()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_kill_at_a_random_moment_and_resume_matches_an_uninterrupted_run(synthetic_dataset, tmp_path) -> None:
    common = [
        "trainer.steps=6",
        "trainer.checkpoint_every=2",
        "trainer.val_every=3",
        "trainer.open_loop_eval=false",
    ]
    common += ["trainer.export_safetensors=false", "trainer.tracker=none"]  # kept short
    straight, split = tmp_path / "straight", tmp_path / "split"

    def train(out: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "train.py", *tiny_overrides(synthetic_dataset, out, *common, *extra)],
            cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=400,
        )  # fmt: skip

    run_in_process(tiny_overrides(synthetic_dataset, straight, *common))  # the reference, uninterrupted

    # kill -9 after `kill_after` logged steps and a further `delay` s (seeded): wherever the run is then
    # (a checkpoint, validation, a step). The driver makes every step last >= 1 s (SLOW_STEP_S), so the kill
    # cannot come after the run's end: a tiny step takes ~0.01 s, and step 5 of 6 used to be the last
    # record before the run ended and released its lock within the 0.1 s poll.
    rng = random.Random(10)
    kill_after, delay = rng.randint(1, 5), rng.uniform(0.0, 0.3)
    process = subprocess.Popen(
        [sys.executable, str(DRIVER), "slow", str(tmp_path / "marker"), *tiny_overrides(synthetic_dataset, split, *common)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
    )  # fmt: skip
    try:
        _wait_until(
            lambda: (split / "metrics.jsonl").is_file() and len(metrics(split)) >= kill_after,
            process,
            f"{kill_after} steps",
        )
        time.sleep(delay)
        assert process.poll() is None, f"the run ended ({process.returncode}) before the kill"
        process.kill()
        process.wait(timeout=30)
    finally:
        process.kill()
    assert (split / LOCK_FILE).exists()  # kill -9 leaves the lock file behind

    resumed = train(split, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "taking over the stale lock" in resumed.stderr
    assert losses(split) == losses(straight)  # one record per step, bitwise the same trajectory
    assert [r["step"] for r in metrics(split)] == list(range(1, 7))
    assert metrics(split, "val")[-1]["loss"] == metrics(straight, "val")[-1]["loss"]
