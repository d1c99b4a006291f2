"""The synthetic reach dataset: deterministic, LeRobot-readable, and its action is a function of what a
policy sees (task colour + target position in the image + state)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vla.data import BatchProcessor, DatasetError, LeRobotDataset, ProcessorConfig
from vla.data.synthetic import (
    AGENT_HALF_SIZE,
    COLOURS,
    TARGET_RADIUS,
    ReachWorld,
    SyntheticConfig,
    ensure_synthetic_dataset,
    episode_seed,
    expert_action,
    generate_synthetic_dataset,
    load_synthetic_marker,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/make_synthetic_dataset.py"


def small_config(**overrides) -> SyntheticConfig:
    settings = dict(episodes=4, episode_length=30, image_size=32, use_videos=False, seed=0)
    settings.update(overrides)
    return SyntheticConfig(**settings)


@pytest.fixture(scope="module")
def synthetic_png(tmp_path_factory) -> Path:
    config = SyntheticConfig(episodes=6, episode_length=40, image_size=64, use_videos=False, seed=3)
    return generate_synthetic_dataset(tmp_path_factory.mktemp("synthetic") / "ds", config)


def target_from_image(image: torch.Tensor, colour: str) -> np.ndarray | None:
    """World (x, y) of the colour's disc centroid in a top image (3, S, S) float, or None if absent."""
    pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    mask = np.all(pixels == np.array(COLOURS[colour], dtype=np.uint8), axis=-1)
    if mask.sum() == 0:
        return None
    rows, cols = np.nonzero(mask)
    size = image.shape[-1]
    return np.array([(cols.mean() + 0.5) / size, (rows.mean() + 0.5) / size])


def test_features_cameras_and_tasks(synthetic_png) -> None:
    dataset = LeRobotDataset(synthetic_png)
    assert dataset.camera_keys == ["observation.images.top", "observation.images.wrist"]
    assert dataset.features["observation.state"]["shape"] == [6]
    assert dataset.features["action"]["shape"] == [4]
    assert dataset.features["observation.images.top"]["shape"] == [64, 64, 3]
    assert set(dataset.meta.tasks) <= {f"reach the {c} target" for c in COLOURS}
    assert len(dataset.meta.tasks) >= 2  # several tasks across episodes
    assert dataset.meta.robot_type == "synthetic_reach" and dataset.fps == 10


def test_action_is_recovered_from_task_image_and_state(synthetic_png) -> None:
    dataset = LeRobotDataset(synthetic_png)
    targets = {
        e["episode_index"]: e["targets"][e["goal"]] for e in load_synthetic_marker(synthetic_png)["episodes"]
    }
    for index in range(len(dataset)):  # exactly the expert's function of the true target and the state
        item = dataset[index]
        truth = expert_action(
            item["observation.state"].numpy(), np.array(targets[item["episode_index"].item()])
        )
        np.testing.assert_allclose(item["action"].numpy(), truth, atol=1e-6)
    checked = 0
    for index in range(len(dataset)):
        item = dataset[index]
        colour = item["task"].split()[2]
        target = target_from_image(item["observation.images.top"], colour)
        state = item["observation.state"].numpy()
        assert target is not None
        if np.hypot(*(target - state[:2])) < TARGET_RADIUS + 2 * AGENT_HALF_SIZE:
            continue  # the agent occludes part of the disc: its centroid is biased
        expected = expert_action(state, target)
        np.testing.assert_allclose(item["action"].numpy(), expected, atol=3e-3)
        checked += 1
    assert checked > 20
    # the other targets would give other actions: the task string matters
    item = dataset[1]
    own = item["task"].split()[2]
    others = [
        c for c in COLOURS if c != own and target_from_image(item["observation.images.top"], c) is not None
    ]
    other_target = target_from_image(item["observation.images.top"], others[0])
    assert not np.allclose(
        expert_action(item["observation.state"].numpy(), other_target), item["action"].numpy(), atol=1e-2
    )


def test_expert_reaches_and_grasps_within_an_episode(synthetic_png) -> None:
    dataset = LeRobotDataset(synthetic_png)
    finished = [dataset[dataset.episode_rows(e)[-1]]["observation.state"][5].item() for e in dataset.episodes]
    assert sum(finished) >= 5  # gripper closed on the named target by the episode end
    world = ReachWorld(image_size=32)
    successes = 0
    for seed in range(10):
        world.reset(seed)
        for _ in range(40):
            world.step(world.expert_action())
        successes += world.success()
    assert successes >= 9


def test_generation_is_deterministic(tmp_path) -> None:
    first = LeRobotDataset(generate_synthetic_dataset(tmp_path / "a", small_config()))
    second = LeRobotDataset(generate_synthetic_dataset(tmp_path / "b", small_config()))
    other = LeRobotDataset(generate_synthetic_dataset(tmp_path / "c", small_config(seed=1)))
    np.testing.assert_array_equal(first.column("action"), second.column("action"))
    np.testing.assert_array_equal(first.column("observation.state"), second.column("observation.state"))
    torch.testing.assert_close(first[17]["observation.images.wrist"], second[17]["observation.images.wrist"])
    assert not np.array_equal(first.column("observation.state"), other.column("observation.state"))
    marker = load_synthetic_marker(tmp_path / "a")
    assert marker["config"]["seed"] == 0 and len(marker["episodes"]) == 4


def test_video_variant_keeps_targets_where_the_marker_says(tmp_path) -> None:
    root = generate_synthetic_dataset(tmp_path / "v", small_config(episodes=2, use_videos=True, codec="h264"))
    dataset = LeRobotDataset(root)
    marker = load_synthetic_marker(root)
    item = dataset[0]
    goal = marker["episodes"][0]["goal"]
    pixels = (item["observation.images.top"].permute(1, 2, 0) * 255).numpy()
    close = np.abs(pixels - np.array(COLOURS[goal])).max(axis=-1) < 40  # lossy codec: near the colour
    rows, cols = np.nonzero(close)
    centre = np.array([(cols.mean() + 0.5) / 32, (rows.mean() + 0.5) / 32])
    np.testing.assert_allclose(centre, marker["episodes"][0]["targets"][goal], atol=1.5 / 32)


def test_ensure_reuses_and_never_overwrites(tmp_path) -> None:
    root = tmp_path / "syn"
    ensure_synthetic_dataset(root, small_config(episodes=2))
    info = root / "meta/info.json"
    stamp = info.stat().st_mtime_ns
    ensure_synthetic_dataset(root, small_config(episodes=2))
    assert info.stat().st_mtime_ns == stamp
    # Other settings: the dataset is kept and the error names the differing setting.
    with pytest.raises(DatasetError, match=r"other settings \(episodes: 2 -> 3\)"):
        ensure_synthetic_dataset(root, small_config(episodes=3))
    assert json.loads(info.read_text())["total_episodes"] == 2
    assert info.stat().st_mtime_ns == stamp
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DatasetError, match="refusing to overwrite"):
        ensure_synthetic_dataset(foreign, small_config())


def test_script_writes_a_readable_dataset(tmp_path, monkeypatch, capsys) -> None:
    root = tmp_path / "cli"
    argv = [str(SCRIPT), "--root", str(root), "--episodes", "2", "--episode-length", "12", "--image-size", "32",
            "--cameras", "top", "--no-video"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exited.value.code == 0
    dataset = LeRobotDataset(root)
    assert dataset.num_episodes == 2 and len(dataset) == 24
    assert dataset.camera_keys == ["observation.images.top"]
    assert dataset.features["observation.images.top"]["dtype"] == "image"
    assert "24 frames" in capsys.readouterr().out


def test_environment_replays_the_dataset_and_feeds_the_processor(synthetic_png) -> None:
    """ReachWorld frames (H, W, 3 uint8) go through the same processor as dataset items (closed-loop eval)."""
    dataset = LeRobotDataset(synthetic_png)
    config = ProcessorConfig(
        camera_map={"observation.images.top": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
        image_size=96, max_state_dim=8, max_action_dim=8, action_horizon=1,
    )  # fmt: skip
    processor = BatchProcessor.from_dataset(config, dataset.meta)
    world = ReachWorld(image_size=64)
    observation = world.reset(episode_seed(3, 1))  # the fixture's seed, episode 1
    item = dataset[dataset.episode_rows(1)[0]]
    from_env, from_data = processor.observation([observation]), processor.observation([item])
    for camera in ("base_0_rgb", "left_wrist_0_rgb"):
        # uint8 frames resize in uint8 (within a level of the float path)
        torch.testing.assert_close(from_env.images[camera], from_data.images[camera], atol=2.5 / 255, rtol=0)
    torch.testing.assert_close(from_env.state, from_data.state)
    assert torch.equal(from_env.tokenized_prompt, from_data.tokenized_prompt)
    np.testing.assert_allclose(world.expert_action(), item["action"].numpy(), atol=1e-6)
