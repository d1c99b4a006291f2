"""LeRobotDataset items: LeRobot's keys, dtypes and shapes; delta windows clamp and flag padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _lerobot_fixtures import ACTION_DIM, FPS, HEIGHT, STATE_DIM, WIDTH

from vla.data import LeRobotDataset, action_delta_timestamps

EXPECTED_ITEM = {
    # key: (dtype, shape) as lerobot.LeRobotDataset.__getitem__ returns them
    "observation.images.top": (torch.float32, (3, HEIGHT, WIDTH)),
    "observation.images.wrist": (torch.float32, (3, HEIGHT, WIDTH)),
    "observation.state": (torch.float32, (STATE_DIM,)),
    "action": (torch.float32, (ACTION_DIM,)),
    "timestamp": (torch.float32, ()),
    "frame_index": (torch.int64, ()),
    "episode_index": (torch.int64, ()),
    "index": (torch.int64, ()),
    "task_index": (torch.int64, ()),
}


@pytest.mark.parametrize("kind", ["image", "video"])
def test_item_keys_dtypes_and_shapes_match_lerobot(kind, image_dataset, video_dataset) -> None:
    written = image_dataset if kind == "image" else video_dataset
    item = LeRobotDataset(written.root)[6]
    assert set(item) == {*EXPECTED_ITEM, "task"}
    for key, (dtype, shape) in EXPECTED_ITEM.items():
        assert item[key].dtype == dtype, key
        assert tuple(item[key].shape) == shape, key
    assert isinstance(item["task"], str)
    image = item["observation.images.top"]
    assert image.min() >= 0.0 and image.max() <= 1.0


def test_dataset_properties(image_dataset) -> None:
    dataset = LeRobotDataset(image_dataset.root)
    assert dataset.fps == FPS
    assert dataset.num_episodes == 3 and dataset.num_frames == 21 and len(dataset) == 21
    assert dataset.camera_keys == ["observation.images.top", "observation.images.wrist"]
    assert dataset.features["action"]["shape"] == [ACTION_DIM]
    assert dataset.meta.tasks == ["pick the red cube", "open the drawer"]
    assert list(dataset.episode_rows(1)) == list(range(5, 12))
    np.testing.assert_array_equal(dataset.column("action"), image_dataset.action)
    assert dataset[-1]["index"].item() == 20
    with pytest.raises(IndexError):
        dataset[21]


def test_action_window_clamps_and_flags_padding_at_episode_ends(image_dataset) -> None:
    horizon = 4
    dataset = LeRobotDataset(image_dataset.root, delta_timestamps=action_delta_timestamps(horizon, FPS))
    for index in range(len(dataset)):
        item = dataset[index]
        episode = int(image_dataset.episode_of_frame[index])
        start = image_dataset.episode_start(episode)
        end = start + image_dataset.lengths[episode]
        wanted = np.arange(index, index + horizon)
        expected_pad = wanted >= end
        np.testing.assert_array_equal(item["action_is_pad"].numpy(), expected_pad)
        assert item["action_is_pad"].dtype == torch.bool
        # padded steps repeat the episode's last action (LeRobot clamps, never crosses episodes)
        np.testing.assert_array_equal(
            item["action"].numpy(), image_dataset.action[np.minimum(wanted, end - 1)]
        )
        assert item["action"].shape == (horizon, ACTION_DIM)


def test_past_windows_clamp_at_episode_start(image_dataset) -> None:
    deltas = {"observation.state": [-0.2, -0.1, 0.0], "observation.images.top": [-0.1, 0.0]}
    dataset = LeRobotDataset(image_dataset.root, delta_timestamps=deltas)
    item = dataset[5]  # first frame of episode 1
    np.testing.assert_array_equal(item["observation.state_is_pad"].numpy(), [True, True, False])
    np.testing.assert_array_equal(item["observation.state"].numpy(), image_dataset.state[[5, 5, 5]])
    assert item["observation.images.top"].shape == (2, 3, HEIGHT, WIDTH)
    np.testing.assert_array_equal(item["observation.images.top_is_pad"].numpy(), [True, False])
    item = dataset[7]
    np.testing.assert_array_equal(item["observation.state"].numpy(), image_dataset.state[[5, 6, 7]])
    assert not item["observation.state_is_pad"].any()
    assert "action_is_pad" not in item and item["action"].shape == (ACTION_DIM,)


def test_video_window_decodes_each_timestamp(video_dataset) -> None:
    dataset = LeRobotDataset(
        video_dataset.root,
        delta_timestamps={"observation.images.wrist": [-0.1, 0.0, 0.1]},
        image_dtype="uint8",
    )
    item = dataset[11]  # last frame of episode 1: the +0.1 step clamps to itself
    frames = item["observation.images.wrist"].permute(0, 2, 3, 1).numpy().astype(np.int16)
    truth = video_dataset.images["observation.images.wrist"][[10, 11, 11]]
    assert frames.shape == (3, HEIGHT, WIDTH, 3)
    assert np.abs(frames - truth).mean(axis=(1, 2, 3)).max() < 4
    np.testing.assert_array_equal(item["observation.images.wrist_is_pad"].numpy(), [False, False, True])


def test_episode_selection(image_dataset) -> None:
    dataset = LeRobotDataset(image_dataset.root, episodes=[2, 0])
    assert dataset.episodes == [0, 2] and dataset.num_episodes == 2 and len(dataset) == 5 + 9
    indices = [dataset[i]["index"].item() for i in range(len(dataset))]
    assert indices == list(range(0, 5)) + list(range(12, 21))
    item = dataset[5]  # first frame of episode 2
    np.testing.assert_array_equal(item["action"].numpy(), image_dataset.action[12])
    windowed = LeRobotDataset(image_dataset.root, episodes=[2], delta_timestamps={"action": [-0.1, 0.0]})
    assert windowed[0]["action_is_pad"].tolist() == [True, False]
    np.testing.assert_array_equal(windowed[0]["action"].numpy(), image_dataset.action[[12, 12]])


def test_uint8_items_equal_float_items_times_255(video_dataset) -> None:
    as_float = LeRobotDataset(video_dataset.root)[9]
    as_uint8 = LeRobotDataset(video_dataset.root, image_dtype="uint8")[9]
    for key in ("observation.images.top", "observation.images.wrist"):
        assert as_uint8[key].dtype == torch.uint8
        torch.testing.assert_close(as_uint8[key].float() / 255.0, as_float[key])


def test_image_transforms_apply_to_every_camera(image_dataset) -> None:
    dataset = LeRobotDataset(image_dataset.root, image_transforms=lambda image: 1.0 - image)
    plain = LeRobotDataset(image_dataset.root)
    for key in plain.camera_keys:
        torch.testing.assert_close(dataset[3][key], 1.0 - plain[3][key])


@pytest.mark.parametrize("kind", ["image", "video"])
def test_frame_cache_serves_identical_frames(kind, image_dataset, video_dataset) -> None:
    written = image_dataset if kind == "image" else video_dataset
    cached = LeRobotDataset(written.root, frame_cache_mb=8, image_dtype="uint8")
    plain = LeRobotDataset(written.root, image_dtype="uint8")
    order = np.random.default_rng(0).permutation(len(plain)).tolist() * 2
    for index in order:
        for key in plain.camera_keys:
            torch.testing.assert_close(cached[index][key], plain[index][key], rtol=0, atol=0)
    stats = cached.frame_cache_stats
    assert stats["hits"] > stats["misses"] > 0
    if kind == "video":  # whole episodes decoded once (plus <= 1 frame of GOP lead-in), then from memory
        assert 2 * len(plain) <= stats["frames_decoded"] <= 2 * (len(plain) + plain.num_episodes)


def test_whole_episodes_are_cached_only_where_the_decoded_frames_fit(video_dataset) -> None:
    probe = LeRobotDataset(video_dataset.root, image_dtype="uint8")
    shapes = [probe.features[k]["shape"] for k in probe.meta.video_keys]
    assert probe.decoded_video_bytes == len(probe) * sum(int(np.prod(s)) for s in shapes) > 0
    fits_mb = probe.decoded_video_bytes / 2**20
    roomy = LeRobotDataset(video_dataset.root, frame_cache_mb=fits_mb * 1.01, image_dtype="uint8")
    tight = LeRobotDataset(video_dataset.root, frame_cache_mb=fits_mb * 0.5, image_dtype="uint8")
    assert roomy._video_reader.cache_whole_segments and not tight._video_reader.cache_whole_segments
    # A budget short of the dataset decodes only what is asked for: one random pass decodes at most
    # each requested frame plus a GOP lead-in per seek, never whole episodes on every miss.
    order = np.random.default_rng(1).permutation(len(probe)).tolist()
    for index in order:
        for key in probe.camera_keys:
            torch.testing.assert_close(tight[index][key], probe[index][key], rtol=0, atol=0)
    cameras = len(probe.camera_keys)
    assert tight.frame_cache_stats["frames_decoded"] <= cameras * len(probe) * 2

