"""A learnable synthetic dataset: a 2-D point-mass "reach and grasp" world with coloured targets.

Each episode places one target of every colour in the unit square and asks for one of them
("reach the red target"). The expert action depends on the task (which colour), on the image
(where that colour is) and on the state (where the agent is), so a policy must use all three:

    state  (6): x, y, z, vx, vy, gripper     z = height (starts at 1), v = last planar step
    action (4): dx, dy, dz, grip
        (dx, dy) = clip(GAIN * (target - (x, y)), +-MAX_STEP)
        dz       = clip(Z_GAIN * (z_goal - z), +-MAX_Z_STEP), z_goal = 0 within REACH_RADIUS else 1
        grip     = 1 when within REACH_RADIUS and z < GRASP_HEIGHT, else 0

Cameras: "top" renders the whole square (targets as discs, the agent as a white square, grey once
the gripper closes); "wrist" looks down from the agent with a field of view of WRIST_FOV.
`ReachWorld` is the same world as a closed-loop environment for evaluation.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.errors import DatasetError
from vla.data.generated import ensure_generated, write_atomically
from vla.data.writer import LeRobotDatasetWriter

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 45, 45),
    "green": (45, 190, 70),
    "blue": (60, 90, 235),
    "yellow": (235, 205, 40),
}
BACKGROUND = (40, 40, 40)
OUTSIDE = (0, 0, 0)
AGENT_OPEN = (240, 240, 240)
AGENT_CLOSED = (140, 140, 140)

GAIN = 0.3
MAX_STEP = 0.05
Z_GAIN = 0.5
MAX_Z_STEP = 0.2
REACH_RADIUS = 0.05
GRASP_HEIGHT = 0.3
TARGET_RADIUS = 0.07
AGENT_HALF_SIZE = 0.035
WRIST_FOV = 0.5
MIN_TARGET_SEPARATION = 0.22

STATE_NAMES = ["x", "y", "z", "vx", "vy", "gripper"]
ACTION_NAMES = ["dx", "dy", "dz", "grip"]
CAMERAS = ("top", "wrist")
MARKER_PATH = "meta/synthetic.json"
GENERATOR = "vla.data.synthetic"


def episode_seed(dataset_seed: int, episode: int) -> int:
    """The ReachWorld.reset seed of one episode of a generated dataset (to replay it in closed loop)."""
    return dataset_seed * 100_003 + episode


def task_for(colour: str) -> str:
    return f"reach the {colour} target"


def expert_action(state: np.ndarray, target_xy: np.ndarray) -> np.ndarray:
    """The action (4,) float32 for a state (6,) when the task's target is at target_xy (2,)."""
    state = np.asarray(state, dtype=np.float64)
    delta = np.asarray(target_xy, dtype=np.float64) - state[:2]
    step = np.clip(GAIN * delta, -MAX_STEP, MAX_STEP)
    near = float(np.hypot(*delta)) < REACH_RADIUS
    z = state[2]
    dz = np.clip(Z_GAIN * ((0.0 if near else 1.0) - z), -MAX_Z_STEP, MAX_Z_STEP)
    grip = 1.0 if near and z < GRASP_HEIGHT else 0.0
    return np.array([step[0], step[1], dz, grip], dtype=np.float32)


def render(
    size: int,
    center: np.ndarray,
    view: float,
    targets: dict[str, np.ndarray],
    agent: np.ndarray | None,
    closed: bool,
) -> np.ndarray:
    """(size, size, 3) uint8 image of the square [center - view/2, center + view/2]^2 (y grows down)."""
    pixel = (np.arange(size) + 0.5) / size - 0.5
    xs = center[0] + pixel * view  # world x of each column
    ys = center[1] + pixel * view  # world y of each row
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    outside = ((ys < 0) | (ys > 1))[:, None] | ((xs < 0) | (xs > 1))[None, :]
    image[outside] = OUTSIDE
    for colour, (tx, ty) in targets.items():
        disc = ((xs[None, :] - tx) ** 2 + (ys[:, None] - ty) ** 2) < TARGET_RADIUS**2
        image[disc] = COLOURS[colour]
    if agent is not None:
        square = (np.abs(xs[None, :] - agent[0]) < AGENT_HALF_SIZE) & (
            np.abs(ys[:, None] - agent[1]) < AGENT_HALF_SIZE
        )
        image[square] = AGENT_CLOSED if closed else AGENT_OPEN
    return image


class ReachWorld:
    """The synthetic world as an environment: reset() -> observation, step(action) -> observation.

    Observations are dicts with the dataset's keys: "observation.state" (6,) float32,
    "observation.images.<camera>" (H, W, 3) uint8, "task" str.
    """

    def __init__(
        self,
        image_size: int = 64,
        cameras: tuple[str, ...] = CAMERAS,
        noise_std: float = 0.01,
        colours: int = 4,
    ) -> None:
        unknown = [c for c in cameras if c not in CAMERAS]
        if unknown:
            raise ValueError(f"unknown camera(s) {unknown}; available: {list(CAMERAS)}")
        if not 1 <= colours <= len(COLOURS):
            raise ValueError(f"colours must be in 1..{len(COLOURS)}, got {colours}")
        self.image_size = image_size
        self.cameras = tuple(cameras)
        self.noise_std = noise_std
        self.colours = list(COLOURS)[:colours]
        self.targets: dict[str, np.ndarray] = {}
        self.goal = ""
        self.state = np.zeros(6, dtype=np.float64)
        self._rng = np.random.default_rng(0)

    @property
    def task(self) -> str:
        return task_for(self.goal)

    @property
    def target(self) -> np.ndarray:
        return self.targets[self.goal]

    def reset(self, seed: int) -> dict[str, Any]:
        """Start an episode (episode e of a dataset generated with seed s used episode_seed(s, e))."""
        rng = self._rng = np.random.default_rng(seed)
        points: list[np.ndarray] = []
        while len(points) < len(self.colours) + 1:  # the targets, then the agent's start
            candidate = rng.uniform(0.1, 0.9, size=2)
            if all(np.hypot(*(candidate - p)) >= MIN_TARGET_SEPARATION for p in points):
                points.append(candidate)
        self.targets = dict(zip(self.colours, points[:-1]))
        self.goal = self.colours[int(rng.integers(len(self.colours)))]
        self.state = np.array([*points[-1], 1.0, 0.0, 0.0, 0.0])
        return self.observation()

    def observation(self) -> dict[str, Any]:
        position, closed = self.state[:2], self.state[5] > 0.5
        obs: dict[str, Any] = {"observation.state": self.state.astype(np.float32)}
        for camera in self.cameras:
            if camera == "top":
                image = render(self.image_size, np.array([0.5, 0.5]), 1.0, self.targets, position, closed)
            else:
                image = render(self.image_size, position, WRIST_FOV, self.targets, None, closed)
            obs[f"observation.images.{camera}"] = image
        obs["task"] = self.task
        return obs

    def expert_action(self) -> np.ndarray:
        return expert_action(self.state.astype(np.float32), self.target)

    def step(self, action: np.ndarray) -> dict[str, Any]:
        action = np.asarray(action, dtype=np.float64)
        dx, dy = np.clip(action[:2], -MAX_STEP, MAX_STEP)
        dz = float(np.clip(action[2], -MAX_Z_STEP, MAX_Z_STEP))
        noise = self._rng.normal(0.0, self.noise_std, size=2) if self.noise_std > 0 else np.zeros(2)
        x, y = np.clip(self.state[:2] + np.array([dx, dy]) + noise, 0.0, 1.0)
        z = float(np.clip(self.state[2] + dz, 0.0, 1.0))
        self.state = np.array([x, y, z, dx, dy, 1.0 if action[3] > 0.5 else 0.0])
        return self.observation()

    def success(self) -> bool:
        """Grasped: gripper closed within reach of the task's target."""
        return bool(self.state[5] > 0.5 and np.hypot(*(self.state[:2] - self.target)) < REACH_RADIUS)


class DatasetConfigError(DatasetError, ValueError):
    """A synthetic dataset setting out of range."""


@dataclass
class SyntheticConfig:
    episodes: int = 30
    episode_length: int = 50
    image_size: int = 64
    cameras: tuple[str, ...] = CAMERAS
    use_videos: bool = True
    codec: str = "av1"
    fps: int = 10
    seed: int = 0
    noise_std: float = 0.01
    colours: int = 4
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("episodes", "episode_length", "image_size", "fps"):
            if getattr(self, name) < 1:
                raise DatasetConfigError(f"synthetic {name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.colours <= 4:
            raise DatasetConfigError(f"synthetic colours (targets per episode) must be in 1..4, got {self.colours}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["cameras"] = list(self.cameras)
        return data


def synthetic_features(config: SyntheticConfig) -> dict[str, dict[str, Any]]:
    size = config.image_size
    features: dict[str, dict[str, Any]] = {
        f"observation.images.{camera}": {
            "dtype": "video" if config.use_videos else "image",
            "shape": [size, size, 3],
            "names": ["height", "width", "channels"],
        }
        for camera in config.cameras
    }
    features["observation.state"] = {"dtype": "float32", "shape": [6], "names": STATE_NAMES}
    features["action"] = {"dtype": "float32", "shape": [4], "names": ACTION_NAMES}
    return features


def generate_synthetic_dataset(root: Path | str, config: SyntheticConfig, overwrite: bool = False) -> Path:
    """Write the dataset (LeRobot v3.0) and meta/synthetic.json (config + per-episode targets).

    Written to a sibling temporary folder and renamed into place, so a reader (or another rank
    generating the same data) never sees a half-written root.
    """
    return write_atomically(root, lambda staging: _write_synthetic(staging, config), overwrite=overwrite)


def _write_synthetic(root: Path, config: SyntheticConfig) -> None:
    world = ReachWorld(config.image_size, tuple(config.cameras), config.noise_std, config.colours)
    episodes_meta = []
    with LeRobotDatasetWriter(
        root,
        fps=config.fps,
        features=synthetic_features(config),
        robot_type="synthetic_reach",
        use_videos=config.use_videos,
        video_codec=config.codec,
        overwrite=True,  # the fresh staging folder
    ) as writer:
        for episode in range(config.episodes):
            observation = world.reset(seed=episode_seed(config.seed, episode))
            for _ in range(config.episode_length):
                action = world.expert_action()
                frame = {k: v for k, v in observation.items() if k != "task"}
                frame["action"] = action
                writer.add_frame(frame, task=observation["task"])
                observation = world.step(action)
            writer.save_episode()
            episodes_meta.append(
                {
                    "episode_index": episode,
                    "goal": world.goal,
                    "targets": {c: p.tolist() for c, p in world.targets.items()},
                }
            )
    marker = {"generator": GENERATOR, "config": config.to_json(), "episodes": episodes_meta}
    (root / MARKER_PATH).write_text(json.dumps(marker, indent=2))


def ensure_synthetic_dataset(root: Path | str, config: SyntheticConfig) -> Path:
    """Generate the dataset at `root` unless it already holds one made with the same config.

    A root that holds anything else (another dataset, or synthetic data made with other settings)
    is never overwritten: that raises DatasetError naming the differing settings. Safe to call from
    every rank at once (each may generate, the atomic rename keeps one complete copy); calling it on
    rank 0 before a barrier saves the duplicate work.
    """
    return ensure_generated(
        root,
        marker=MARKER_PATH,
        generator=GENERATOR,
        config=config.to_json(),
        generate=lambda target: generate_synthetic_dataset(target, config),
        config_key="data.synthetic",
    )


def load_synthetic_marker(root: Path | str) -> dict[str, Any]:
    """The generator's record: {"config": ..., "episodes": [{"episode_index", "goal", "targets"}]}."""
    return json.loads((Path(root) / MARKER_PATH).read_text())
