"""Scripted-expert demonstrations of MetaWorld tasks, written as a LeRobot v3.0 dataset.

For every task the expert is rolled out on seeds seed, seed + 1, ... until `episodes` of them
succeed (or `max_attempts` seeds were tried). An episode is recorded frame by frame (observation,
then the expert's action) up to and including the step that reaches success; failed episodes are
dropped. With `action_noise` > 0 the recording is DART-style (Laskey et al., 2017): the environment
steps with the expert's action plus Gaussian noise on the hand's x, y, z, while the frame keeps the
expert's clean action as its label, so the data shows how the expert recovers from states just off its
own path. With `hand_start_noise` > 0 every episode starts with the hand moved from the task's start by
a random offset (x, y in [-r, r], z in [0, r]: upward only, so it never starts inside an object), so the
hand's position alone no longer tells the direction to the goal and a policy has to read the goal from
its images; evaluation keeps MetaWorld's start. With `steps_after_success` = N > 0 the expert goes on for
N more steps after the first success (within max_episode_steps), so the data show what to do once at the
goal (stay there) instead of ending where the success radius is first crossed: without them a policy's
last chunks are all padding, and one that comes within millimetres of the radius keeps moving past the
goal. With `expert_aims_tcp` the reach experts steer the tool centre point, which success is measured on,
onto the goal instead of the hand 4.5 cm above it (vla.sim.metaworld_env, "Reach's expert"), so their
demonstrations head for the middle of the success sphere, not for its edge. Every kept episode's seed is
recorded in meta/metaworld.json, so evaluation can use seeds that were never trained on, and the expert's success
rate per task is recorded beside it.

With workers > 1 the rollouts run in that many processes (each with its own simulator) while this process
encodes; an episode depends on its seed alone, so the frames handed to the encoder are the same, bit for
bit, whatever the number of workers (tests/sim/test_parallel_recording.py), and `workers` is not one of the
settings a recording is reused for. The video bytes are not reproducible in general: SVT-AV1 (4.1.0, with
level of parallelism 1 too) now and then encodes the same frames to different bytes under CPU contention
(seen with recording workers and a training run sharing 2 cores), one whole GOP at a time, so two
recordings of the same settings, with any number of workers, can decode to frames a level or two apart.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.generated import ensure_generated, read_marker, write_atomically
from vla.data.writer import LeRobotDatasetWriter
from vla.sim.metaworld_env import (
    CONTROL_FPS,
    DEFAULT_TASKS,
    MetaWorldEnv,
    SimError,
    parse_tasks,
    sim_features,
)

MARKER_PATH = "meta/metaworld.json"
GENERATOR = "vla.sim.demos"
# Recorder version, part of the settings a dataset is reused for. 2: the first frame of an episode shows
# its own layout (MetaWorldEnv.reset runs mj_forward); recordings of version 1 (no "recorder" key) show
# the previous episode's goal and drawer there, and are not reused.
RECORDER_VERSION = 2
# Beyond ~20 cm the hand starts outside the region the experts were written for.
MAX_HAND_START_NOISE = 0.2
# workers=0 ("auto"): one recording process per CPU this process may use, up to this many (past ~8 the
# encoder in the main process is the bottleneck).
MAX_AUTO_WORKERS = 8
# One expert episode takes about a second here (<= max_episode_steps steps): a worker that has not answered
# in this long is stuck, and the recording fails instead of waiting for ever.
ROLLOUT_TIMEOUT_S = 600.0


@dataclass
class DemoConfig:
    """What to record. episodes: successful episodes per task; max_attempts: seeds tried per task
    (default 2 x episodes) before giving up on reaching `episodes`. The defaults are data=metaworld's
    (vla.training.config.MetaWorldDataConfig) and scripts/make_sim_dataset.py's."""

    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    episodes: int = 50
    resolution: int = 64
    cameras: list[str] = field(default_factory=lambda: ["corner2", "topview"])
    seed: int = 0
    max_episode_steps: int = 200
    max_attempts: int | None = None
    # H.264, not AV1: the SVT-AV1 encoder PyAV ships (4.1.0) stalls here on long streams now and then
    # (every thread waiting on a semaphore, CPU idle; known upstream for SVT-AV1 3.1+); libx264 does not.
    codec: str = "h264"
    # H.264 at 18 loses about what AV1 at its default 30 does on 64-px MetaWorld frames (mean absolute
    # error 4.1 vs 3.8 levels; at 30, H.264 loses 8.1), so training frames stay close to the clean
    # renders the policy sees in closed loop.
    crf: int = 18
    # Std of the Gaussian noise added to the executed hand action (x, y, z; the gripper is left alone),
    # in action units ([-1, 1]; 1 moves the hand about 1 cm per step). The label stays the clean action.
    # Measured (scripts/ablate_recipe.py, variant dart_noise): see the README's ablation table.
    action_noise: float = 0.0
    # Half-width r (metres) of the random offset of the hand's start in each recorded episode (module
    # docstring). Measured (scripts/ablate_recipe.py, variant random_start): see the README's ablation table.
    hand_start_noise: float = 0.0
    # Expert steps recorded after the first success (module docstring); 0 ends an episode at its success.
    steps_after_success: int = 0
    # Reach experts aim the tool centre point at the goal, not the hand (module docstring); other tasks
    # are recorded as without it.
    expert_aims_tcp: bool = False

    def __post_init__(self) -> None:
        self.tasks = parse_tasks(self.tasks)
        self.cameras = [str(c) for c in self.cameras]
        if self.episodes < 1:
            raise SimError(f"episodes must be >= 1, got {self.episodes}")
        if self.max_attempts is not None and self.max_attempts < self.episodes:
            raise SimError(f"max_attempts ({self.max_attempts}) must be >= episodes ({self.episodes})")
        if self.seed < 0:
            raise SimError(f"seed must be >= 0, got {self.seed}")
        if not 0 <= self.crf <= 51:
            raise SimError(f"crf must be in [0, 51] (lower: better quality, bigger files), got {self.crf}")
        if not (math.isfinite(self.action_noise) and 0 <= self.action_noise <= 1):
            raise SimError(f"action_noise must be in [0, 1] (action units), got {self.action_noise}")
        if not (math.isfinite(self.hand_start_noise) and 0 <= self.hand_start_noise <= MAX_HAND_START_NOISE):
            raise SimError(
                f"hand_start_noise must be in [0, {MAX_HAND_START_NOISE}] metres, got {self.hand_start_noise}"
            )
        if isinstance(self.steps_after_success, bool) or not isinstance(self.steps_after_success, int):
            raise SimError(f"steps_after_success must be an int >= 0, got {self.steps_after_success!r}")
        if not 0 <= self.steps_after_success < self.max_episode_steps:
            raise SimError(
                f"steps_after_success must be in [0, max_episode_steps={self.max_episode_steps}), "
                f"got {self.steps_after_success}"
            )
        if not isinstance(self.expert_aims_tcp, bool):
            raise SimError(f"expert_aims_tcp must be true or false, got {self.expert_aims_tcp!r}")

    @property
    def attempts(self) -> int:
        return self.max_attempts if self.max_attempts is not None else 2 * self.episodes

    def to_json(self) -> dict[str, Any]:
        settings = asdict(self) | {"recorder": RECORDER_VERSION}
        # Recordings made before these settings existed had none of them: they stay reusable.
        for name in ("action_noise", "hand_start_noise", "steps_after_success", "expert_aims_tcp"):
            if settings[name] == 0:
                del settings[name]
        return settings


@dataclass
class ExpertStats:
    """One task's recording: seeds tried, how many succeeded, and what was kept."""

    task: str
    attempts: int
    successes: int
    kept: int
    mean_length: float

    @property
    def success_rate(self) -> float:
        return self.successes / max(self.attempts, 1)


# progress(task, kept, wanted): called after every attempt
Progress = Callable[[str, int, int], None]


def record_demos(
    root: Path, config: DemoConfig, progress: Progress | None = None, workers: int = 1
) -> list[ExpertStats]:
    """Write the dataset into the (empty or new) directory `root`; see the module docstring.

    workers: processes rolling out the expert (1: in this process; 0: `auto_workers()`); the result does
    not depend on it.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise SimError(
            f"workers must be an int >= 0 (processes rolling out the expert; 0: one per CPU), got {workers!r}"
        )
    workers = workers or auto_workers()
    episodes_meta: list[dict[str, Any]] = []
    stats: list[ExpertStats] = []
    with (
        LeRobotDatasetWriter(
            root,
            fps=CONTROL_FPS,
            features=sim_features(config.cameras, config.resolution),
            robot_type="sawyer",
            use_videos=True,
            video_codec=config.codec,
            video_crf=config.crf,
            overwrite=True,  # the caller hands over a fresh staging folder
        ) as writer,
        _Rollouts(config, workers) as rollouts,
    ):
        for task in config.tasks:
            kept, successes, lengths = 0, 0, []
            attempt = 0
            episodes = rollouts.episodes(task)
            try:
                for seed, instruction, frames, success in episodes:
                    attempt += 1
                    if success:
                        successes += 1
                        for frame in frames:
                            writer.add_frame(frame, task=instruction)
                        writer.save_episode()
                        episodes_meta.append(
                            {
                                "episode_index": len(episodes_meta),
                                "task": task,
                                "seed": seed,
                                "length": len(frames),
                            }
                        )
                        lengths.append(len(frames))
                        kept += 1
                    if progress is not None:
                        progress(task, kept, config.episodes)
                    if kept == config.episodes:
                        break
            finally:
                episodes.close()  # cancels the rollouts of seeds not needed any more
            if kept < config.episodes:
                raise SimError(
                    f"the {task} expert succeeded on only {kept} of {attempt} seeds; wanted {config.episodes} "
                    "episodes. Raise max_attempts or max_episode_steps, or record fewer episodes."
                )
            stats.append(ExpertStats(task, attempt, successes, kept, sum(lengths) / len(lengths)))
    marker = {
        "generator": GENERATOR,
        "config": config.to_json(),
        "episodes": episodes_meta,
        "expert": [{**asdict(s), "success_rate": s.success_rate} for s in stats],
    }
    (root / MARKER_PATH).write_text(json.dumps(marker, indent=1))
    return stats


def auto_workers() -> int:
    """Recording processes for workers=0: the CPUs this process may run on, at most MAX_AUTO_WORKERS."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, MAX_AUTO_WORKERS))


# (seed, instruction, frames, success) of one expert episode
Episode = tuple[int, str, list[dict[str, Any]], bool]


class _Rollouts:
    """The expert's episodes of a task, seed after seed, rolled out here (workers=1) or by a pool of
    `workers` processes, at most 2 x workers seeds ahead of the one the recorder waits for, and always
    handed over in seed order."""

    def __init__(self, config: DemoConfig, workers: int) -> None:
        self.config = config
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Rollouts:
        if self.workers > 1:
            # spawn, not fork: a forked child would share this process's GL context and MuJoCo state
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_start,
                initargs=(os.getpid(),),
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def episodes(self, task: str) -> Iterator[Episode]:
        c = self.config
        seeds = range(c.seed, c.seed + c.attempts)
        if self._pool is None:
            with MetaWorldEnv(task, c.cameras, c.resolution, c.max_episode_steps) as env:
                for seed in seeds:
                    frames, success = _rollout(
                        env,
                        seed,
                        c.action_noise,
                        c.hand_start_noise,
                        c.steps_after_success,
                        c.expert_aims_tcp,
                    )
                    yield seed, env.instruction, frames, success
            return
        pending: deque[tuple[int, Future[Episode]]] = deque()
        upcoming = iter(seeds)
        try:
            while True:
                while len(pending) < 2 * self.workers and (seed := next(upcoming, None)) is not None:
                    pending.append((seed, self._pool.submit(_worker_rollout, c, task, seed)))
                if not pending:
                    return
                seed, future = pending.popleft()
                try:
                    episode = future.result(timeout=ROLLOUT_TIMEOUT_S)
                except TimeoutError:
                    raise SimError(
                        f"a recording worker gave no {task} episode for seed {seed} in {ROLLOUT_TIMEOUT_S:.0f} s; "
                        "it is stuck (one episode takes about a second). Record with workers=1 to see where."
                    ) from None
                except BrokenProcessPool as exc:
                    raise SimError(
                        f"a recording worker died while rolling out {task} (seed {seed}): {exc}. Record with "
                        "workers=1 to see the error, or with fewer workers if memory ran out."
                    ) from None
                yield episode
        finally:
            for _, future in pending:
                future.cancel()


_worker_env: MetaWorldEnv | None = None


def _worker_start(parent_pid: int) -> None:
    """A recording worker ends itself once the process that started it is gone (killed, say), instead of
    waiting for ever for work that will not come."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _close_worker_env() -> None:
    global _worker_env
    if _worker_env is not None:
        _worker_env.close()
        _worker_env = None


def _worker_rollout(config: DemoConfig, task: str, seed: int) -> Episode:
    """One expert episode in a recording worker; the worker keeps one simulator, rebuilt when the task
    changes."""
    global _worker_env
    if _worker_env is None or _worker_env.task != task:
        _close_worker_env()
        _worker_env = MetaWorldEnv(task, config.cameras, config.resolution, config.max_episode_steps)
    frames, success = _rollout(
        _worker_env,
        seed,
        config.action_noise,
        config.hand_start_noise,
        config.steps_after_success,
        config.expert_aims_tcp,
    )
    return seed, _worker_env.instruction, frames, success


def hand_start_offset(seed: int, hand_start_noise: float) -> np.ndarray | None:
    """(3,) metres the hand's start of `seed`'s recorded episode moves (None: MetaWorld's start)."""
    if hand_start_noise == 0:
        return None
    r = hand_start_noise
    return np.random.default_rng([seed, 0x57A7]).uniform([-r, -r, 0.0], [r, r, r])


def _rollout(
    env: MetaWorldEnv,
    seed: int,
    action_noise: float = 0.0,
    hand_start_noise: float = 0.0,
    steps_after_success: int = 0,
    expert_aims_tcp: bool = False,
) -> tuple[list[dict[str, Any]], bool]:
    """The expert's episode on `seed`: frames (observation + clean expert action) up to the first
    success and `steps_after_success` steps beyond it (fewer where max_episode_steps ends the episode
    first); success: whether it was reached. The hand starts at `hand_start_offset` and the executed
    action carries `action_noise` (both seeded by `seed`, so a recording replays); `expert_aims_tcp`:
    MetaWorldEnv.expert_action's aim_tcp."""
    observation = env.reset(seed, hand_start_offset(seed, hand_start_noise))
    noise = np.random.default_rng([seed, 0xDA27])
    frames = []
    first_success: int | None = None  # env.steps at the first success
    while True:
        action = env.expert_action(aim_tcp=expert_aims_tcp)
        frame = {k: v for k, v in observation.items() if k != "task"}
        frame["action"] = action
        frames.append(frame)
        executed = action
        if action_noise > 0:
            executed = action.copy()
            executed[:3] += noise.normal(0.0, action_noise, size=3).astype(np.float32)
        step = env.step(executed)
        if step.success and first_success is None:
            first_success = env.steps
        held_long_enough = first_success is not None and env.steps - first_success >= steps_after_success
        if held_long_enough or env.steps >= env.max_episode_steps:
            return frames, first_success is not None
        observation = step.observation


def generate_sim_dataset(
    root: Path | str,
    config: DemoConfig,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    workers: int = 1,
) -> Path:
    """Record the dataset atomically into `root` (a non-empty root only with overwrite=True), rolling
    out in `workers` processes."""
    return write_atomically(
        root, lambda staging: record_demos(staging, config, progress, workers), overwrite=overwrite
    )


def ensure_sim_dataset(
    root: Path | str, config: DemoConfig, progress: Progress | None = None, workers: int = 1
) -> Path:
    """Reuse the dataset at `root` if it was recorded with `config`; record it (in `workers` processes)
    if root is empty.

    A root recorded with other settings, or holding anything else, is never overwritten (DatasetError
    names the differing settings).
    """
    return ensure_generated(
        root,
        marker=MARKER_PATH,
        generator=GENERATOR,
        config=config.to_json(),
        generate=lambda target: generate_sim_dataset(target, config, progress=progress, workers=workers),
        config_key="data.metaworld",
    )


def load_sim_marker(root: Path | str) -> dict[str, Any] | None:
    """The recording's record ({"config", "episodes": [{episode_index, task, seed, length}], "expert"}),
    or None when `root` was not recorded by this module."""
    marker = read_marker(root, MARKER_PATH)
    return marker if marker is not None and marker.get("generator") == GENERATOR else None


def training_seeds(root: Path | str) -> dict[str, set[int]]:
    """task -> seeds of the recorded episodes (empty when `root` is not a recorded MetaWorld dataset)."""
    marker = load_sim_marker(root)
    seeds: dict[str, set[int]] = {}
    for episode in (marker or {}).get("episodes", []):
        seeds.setdefault(episode["task"], set()).add(int(episode["seed"]))
    return seeds
