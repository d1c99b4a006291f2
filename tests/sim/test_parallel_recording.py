"""Recording in several processes: the same dataset as one process, bounded waits, no orphaned workers."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _sim_fixtures import sim_demos

from vla.data import LeRobotDataset
from vla.sim import DemoConfig, SimError, ensure_sim_dataset
from vla.sim.demos import Episode, _Rollouts, auto_workers, record_demos


def _first_episodes(workers: int, per_task: int = 3) -> list[Episode]:
    """The first `per_task` expert episodes of each of sim_demos()'s tasks, as the recorder receives them."""
    config = sim_demos()
    received: list[Episode] = []
    with _Rollouts(config, workers) as rollouts:
        for task in config.tasks:
            episodes = rollouts.episodes(task)
            try:
                received += itertools.islice(episodes, per_task)
            finally:
                episodes.close()
    return received


def test_two_workers_hand_the_encoder_the_same_frames_as_one() -> None:
    """Seeds, instructions, successes and every frame (each camera's rendered image, the state, the
    expert's action) that reach the writer are bit-equal with one process and with two workers."""
    serial, parallel = _first_episodes(1), _first_episodes(2)
    frame_keys = {"observation.state", "observation.images.corner2", "observation.images.topview", "action"}
    assert [(seed, success) for seed, _, _, success in serial] == [(5, True), (6, True), (7, True)] * 2
    for (seed, instruction, frames, success), (seed2, instruction2, frames2, success2) in zip(
        serial, parallel, strict=True
    ):
        assert (seed, instruction, len(frames), success) == (seed2, instruction2, len(frames2), success2)
        for index, (a, b) in enumerate(zip(frames, frames2)):
            assert a.keys() == b.keys() == frame_keys
            for key in a:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"seed {seed} frame {index} {key}")


def test_two_workers_record_the_same_dataset_as_one(sim_dataset: Path, tmp_path: Path) -> None:
    """The marker (episodes, seeds, expert accounting) is the one-process recording's (the session
    fixture) and does not say how many workers recorded it, so either is reused; states, actions and
    tasks are equal, and the decoded frames are equal up to the encoder's own noise.

    SVT-AV1 now and then encodes the same frames to different bytes under CPU contention:
    one GOP at a time, on average up to 1.4 intensity levels over a frame and 36 in one pixel (measured
    under load: 5 of 20 runs of an exact version of this test failed, and 2 of 10 paired recordings
    differed, the frames handed to the encoder bit-equal). The test above checks those frames exactly;
    this one bounds the decoded difference by 4 levels on average per frame.
    """
    parallel = ensure_sim_dataset(tmp_path / "parallel", sim_demos(), workers=2)
    serial_marker = json.loads((sim_dataset / "meta/metaworld.json").read_text())
    assert json.loads((parallel / "meta/metaworld.json").read_text()) == serial_marker
    assert ensure_sim_dataset(parallel, sim_demos(), workers=1) == parallel  # reused, not refused
    serial, other = LeRobotDataset(sim_dataset), LeRobotDataset(parallel)
    assert len(serial) == len(other) == sum(e["length"] for e in serial_marker["episodes"])
    for index in range(len(serial)):
        a, b = serial[index], other[index]
        assert (a["task"], int(a["episode_index"])) == (b["task"], int(b["episode_index"]))
        for key in ("observation.state", "action"):
            assert a[key].equal(b[key]), (index, key)
        for key in ("observation.images.corner2", "observation.images.topview"):
            assert a[key].shape == b[key].shape == (3, 32, 32), (index, key)
            assert (a[key] - b[key]).abs().mean() <= 4 / 255, (index, key)


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
