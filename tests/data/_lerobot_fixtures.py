"""Writes small LeRobot datasets with our writer and keeps the ground truth they were written from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.writer import LeRobotDatasetWriter

FPS = 10
HEIGHT, WIDTH = 16, 24
STATE_DIM, ACTION_DIM = 3, 2
TASKS = ("pick the red cube", "open the drawer")


@dataclass
class WrittenDataset:
    """What went into a dataset: per global frame index, the values passed to add_frame."""

    root: Path
    lengths: list[int]
    state: np.ndarray  # (N, STATE_DIM) float32
    action: np.ndarray  # (N, ACTION_DIM) float32
    images: dict[str, np.ndarray] = field(default_factory=dict)  # camera key -> (N, H, W, 3) uint8
    tasks: list[str] = field(default_factory=list)  # per frame
    episode_of_frame: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def episode_start(self, episode: int) -> int:
        return int(sum(self.lengths[:episode]))


def smooth_image(episode: int, frame: int, camera: int) -> np.ndarray:
    """Blocky gradients: compress well, so video round trips stay close to the source."""
    y = np.arange(HEIGHT)[:, None]
    x = np.arange(WIDTH)[None, :]
    image = np.empty((HEIGHT, WIDTH, 3), dtype=np.uint8)
    image[..., 0] = (40 + 8 * x + 20 * episode) % 256
    image[..., 1] = (30 + 6 * y + 10 * frame) % 256
    image[..., 2] = 80 + 60 * camera
    return image


def write_dataset(
    root: Path,
    lengths: list[int],
    use_videos: bool,
    codec: str = "av1",
    cameras: tuple[str, ...] = ("top", "wrist"),
    seed: int = 0,
    **writer_kwargs: Any,
) -> WrittenDataset:
    rng = np.random.default_rng(seed)
    features: dict[str, dict[str, Any]] = {
        f"observation.images.{camera}": {
            "dtype": "video",
            "shape": [HEIGHT, WIDTH, 3],
            "names": ["height", "width", "channels"],
        }
        for camera in cameras
    }
    features["observation.state"] = {"dtype": "float32", "shape": [STATE_DIM], "names": ["x", "y", "z"]}
    features["action"] = {"dtype": "float32", "shape": [ACTION_DIM], "names": ["dx", "dy"]}
    total = sum(lengths)
    written = WrittenDataset(
        root=root,
        lengths=list(lengths),
        state=rng.normal(size=(total, STATE_DIM)).astype(np.float32),
        action=rng.uniform(-2, 3, size=(total, ACTION_DIM)).astype(np.float32),
        images={f"observation.images.{c}": np.empty((total, HEIGHT, WIDTH, 3), np.uint8) for c in cameras},
        episode_of_frame=np.repeat(np.arange(len(lengths)), lengths),
    )
    with LeRobotDatasetWriter(
        root, fps=FPS, features=features, robot_type="test_bot", use_videos=use_videos, video_codec=codec,
        **writer_kwargs,
    ) as writer:  # fmt: skip
        index = 0
        for episode, length in enumerate(lengths):
            task = TASKS[episode % len(TASKS)]
            for frame in range(length):
                values: dict[str, Any] = {
                    "observation.state": written.state[index],
                    "action": written.action[index],
                }
                for camera_number, camera in enumerate(cameras):
                    image = smooth_image(episode, frame, camera_number)
                    written.images[f"observation.images.{camera}"][index] = image
                    values[f"observation.images.{camera}"] = image
                writer.add_frame(values, task=task)
                written.tasks.append(task)
                index += 1
            writer.save_episode()
    return written
