"""Recording in several processes: the same dataset as one process, bounded waits, no orphaned workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _sim_fixtures import sim_demos

from vla.data import LeRobotDataset
from vla.sim import DemoConfig, SimError, ensure_sim_dataset
from vla.sim.demos import auto_workers, record_demos


def test_two_workers_record_the_same_dataset_as_one(sim_dataset: Path, tmp_path: Path) -> None:
    """Episodes, seeds, states, actions and every decoded frame equal the one-process recording (the
    session fixture), and the marker does not say how many workers recorded it (so either is reused)."""
    parallel = ensure_sim_dataset(tmp_path / "parallel", sim_demos(), workers=2)
    serial_marker = json.loads((sim_dataset / "meta/metaworld.json").read_text())
    assert json.loads((parallel / "meta/metaworld.json").read_text()) == serial_marker
    assert ensure_sim_dataset(parallel, sim_demos(), workers=1) == parallel  # reused, not refused
    serial, other = LeRobotDataset(sim_dataset), LeRobotDataset(parallel)
    assert len(serial) == len(other) == sum(e["length"] for e in serial_marker["episodes"])
    for index in range(len(serial)):
        a, b = serial[index], other[index]
        assert a["task"] == b["task"]
        for key in (
            "observation.state",
            "action",
            "observation.images.corner2",
            "observation.images.topview",
        ):
            assert a[key].equal(b[key]), (index, key)


def test_workers_keep_the_expert_accounting_and_its_error(tmp_path: Path) -> None:
    """Seeds the experts fail on are counted, and beyond max_attempts the error is the one-process one."""
    config = DemoConfig(
        tasks=["drawer-open-v3"], episodes=1, resolution=16, cameras=["corner2"], max_episode_steps=5
    )
    with pytest.raises(SimError, match=r"succeeded on only 0 of 2 seeds.*max_episode_steps"):
        record_demos(tmp_path / "d", config, workers=2)
    with pytest.raises(SimError, match=r"workers must be an int >= 0"):
        record_demos(tmp_path / "e", config, workers=-1)
    assert 1 <= auto_workers() <= 8


_ORPHAN_SCRIPT = """
import os, sys, time
import vla.sim
from vla.sim.demos import DemoConfig, _Rollouts
config = DemoConfig(tasks=["reach-v3"], episodes=1, resolution=16, cameras=["corner2"])
with _Rollouts(config, 2) as rollouts:
    next(rollouts.episodes("reach-v3"))
    print(" ".join(str(pid) for pid in rollouts._pool._processes), flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone for our purposes
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_workers_end_when_the_recording_process_is_killed() -> None:
    """SIGKILL to the recorder (no cleanup runs): its workers notice within seconds and exit, instead of
    waiting for ever for work."""
    recorder = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    workers: list[int] = []
    try:
        workers = [int(pid) for pid in recorder.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
        recorder.send_signal(signal.SIGKILL)
        recorder.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers)
    finally:
        for pid in [recorder.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
