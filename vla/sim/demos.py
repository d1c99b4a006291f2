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
its images; evaluation keeps MetaWorld's start. Every kept episode's seed is recorded in
meta/metaworld.json, so evaluation can use seeds that were never trained on, and the expert's success
rate per task is recorded beside it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
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

    @property
    def attempts(self) -> int:
        return self.max_attempts if self.max_attempts is not None else 2 * self.episodes

    def to_json(self) -> dict[str, Any]:
        settings = asdict(self) | {"recorder": RECORDER_VERSION}
        # Recordings made before these settings existed had neither: they stay reusable.
        for name in ("action_noise", "hand_start_noise"):
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


def record_demos(root: Path, config: DemoConfig, progress: Progress | None = None) -> list[ExpertStats]:
    """Write the dataset into the (empty or new) directory `root`; see the module docstring."""
    episodes_meta: list[dict[str, Any]] = []
    stats: list[ExpertStats] = []
    with LeRobotDatasetWriter(
        root,
        fps=CONTROL_FPS,
        features=sim_features(config.cameras, config.resolution),
        robot_type="sawyer",
        use_videos=True,
        video_codec=config.codec,
        video_crf=config.crf,
        overwrite=True,  # the caller hands over a fresh staging folder
    ) as writer:
        for task in config.tasks:
            kept, successes, lengths = 0, 0, []
            attempt = 0
            with MetaWorldEnv(task, config.cameras, config.resolution, config.max_episode_steps) as env:
                while kept < config.episodes and attempt < config.attempts:
                    seed = config.seed + attempt
                    attempt += 1
                    frames, success = _rollout(env, seed, config.action_noise, config.hand_start_noise)
                    if success:
                        successes += 1
                        for frame in frames:
                            writer.add_frame(frame, task=env.instruction)
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


def hand_start_offset(seed: int, hand_start_noise: float) -> np.ndarray | None:
    """(3,) metres the hand's start of `seed`'s recorded episode moves (None: MetaWorld's start)."""
    if hand_start_noise == 0:
        return None
    r = hand_start_noise
    return np.random.default_rng([seed, 0x57A7]).uniform([-r, -r, 0.0], [r, r, r])


def _rollout(
    env: MetaWorldEnv, seed: int, action_noise: float = 0.0, hand_start_noise: float = 0.0
) -> tuple[list[dict[str, Any]], bool]:
    """The expert's episode on `seed`: frames (observation + clean expert action) up to the first
    success; the hand starts at `hand_start_offset` and the executed action carries `action_noise`
    (both seeded by `seed`, so a recording replays)."""
    observation = env.reset(seed, hand_start_offset(seed, hand_start_noise))
    noise = np.random.default_rng([seed, 0xDA27])
    frames = []
    while True:
        action = env.expert_action()
        frame = {k: v for k, v in observation.items() if k != "task"}
        frame["action"] = action
        frames.append(frame)
        executed = action
        if action_noise > 0:
            executed = action.copy()
            executed[:3] += noise.normal(0.0, action_noise, size=3).astype(np.float32)
        step = env.step(executed)
        if step.done:
            return frames, step.success
        observation = step.observation


def generate_sim_dataset(
    root: Path | str, config: DemoConfig, *, overwrite: bool = False, progress: Progress | None = None
) -> Path:
    """Record the dataset atomically into `root` (a non-empty root only with overwrite=True)."""
    return write_atomically(
        root, lambda staging: record_demos(staging, config, progress), overwrite=overwrite
    )


def ensure_sim_dataset(root: Path | str, config: DemoConfig, progress: Progress | None = None) -> Path:
    """Reuse the dataset at `root` if it was recorded with `config`; record it if root is empty.

    A root recorded with other settings, or holding anything else, is never overwritten (DatasetError
    names the differing settings).
    """
    return ensure_generated(
        root,
        marker=MARKER_PATH,
        generator=GENERATOR,
        config=config.to_json(),
        generate=lambda target: generate_sim_dataset(target, config, progress=progress),
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
