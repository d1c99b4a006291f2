"""The writer produces LeRobot v3.0 files that our reader returns value for value."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from _lerobot_fixtures import ACTION_DIM, FPS, HEIGHT, STATE_DIM, TASKS, WIDTH

from vla.data import DatasetError, DatasetFormatError, LeRobotDataset, LeRobotDatasetWriter
from vla.data.metadata import DatasetMetadata


def test_image_dataset_reads_back_identical(image_dataset) -> None:
    dataset = LeRobotDataset(image_dataset.root)
    assert len(dataset) == sum(image_dataset.lengths) == dataset.num_frames
    assert dataset.num_episodes == 3
    for index in range(len(dataset)):
        item = dataset[index]
        episode = int(image_dataset.episode_of_frame[index])
        frame = index - image_dataset.episode_start(episode)
        np.testing.assert_array_equal(item["observation.state"].numpy(), image_dataset.state[index])
        np.testing.assert_array_equal(item["action"].numpy(), image_dataset.action[index])
        for key, images in image_dataset.images.items():
            restored = (item[key] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            np.testing.assert_array_equal(restored, images[index])
        assert item["index"].item() == index
        assert item["episode_index"].item() == episode
        assert item["frame_index"].item() == frame
        assert item["timestamp"].item() == pytest.approx(frame / FPS)
        assert item["task"] == image_dataset.tasks[index]
        assert TASKS[item["task_index"].item()] == item["task"]


def test_info_json_follows_lerobot_v30(video_dataset) -> None:
    info = json.loads((video_dataset.root / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0"
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 21, 2)
    assert info["splits"] == {"train": "0:3"}
    assert info["chunks_size"] == 1000
    assert (info["data_files_size_in_mb"], info["video_files_size_in_mb"]) == (100, 200)
    assert info["fps"] == FPS and info["robot_type"] == "test_bot"
    features = info["features"]
    assert list(features)[-5:] == ["timestamp", "frame_index", "episode_index", "index", "task_index"]
    assert features["timestamp"] == {"dtype": "float32", "shape": [1], "names": None}
    assert features["observation.state"]["shape"] == [STATE_DIM]
    top = features["observation.images.top"]
    assert top["dtype"] == "video" and top["shape"] == [HEIGHT, WIDTH, 3]
    assert top["names"] == ["height", "width", "channels"]
    video_info = top["info"]
    assert video_info["video.codec"] == "av1" and video_info["video.pix_fmt"] == "yuv420p"
    assert (video_info["video.height"], video_info["video.width"], video_info["video.fps"]) == (
        HEIGHT,
        WIDTH,
        FPS,
    )
    assert video_info["has_audio"] is False and video_info["is_depth_map"] is False


def test_episode_and_task_tables_follow_lerobot_v30(video_dataset) -> None:
    root = video_dataset.root
    tasks = pq.read_table(root / "meta/tasks.parquet")
    assert tasks.column("task").to_pylist() == list(TASKS)
    assert tasks.column("task_index").to_pylist() == [0, 1]
    # pandas (which LeRobot reads it with) restores "task" as the index
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]

    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["episode_index"] for e in episodes] == [0, 1, 2]
    assert [e["length"] for e in episodes] == video_dataset.lengths
    assert [e["tasks"] for e in episodes] == [[TASKS[0]], [TASKS[1]], [TASKS[0]]]
    assert [(e["dataset_from_index"], e["dataset_to_index"]) for e in episodes] == [(0, 5), (5, 12), (12, 21)]
    for e in episodes:
        assert (e["data/chunk_index"], e["data/file_index"]) == (0, 0)
        assert e["meta/episodes/chunk_index"] == 0 and e["meta/episodes/file_index"] == 0
    # three episodes share one file per camera, one after the other
    spans = [
        (e["videos/observation.images.top/from_timestamp"], e["videos/observation.images.top/to_timestamp"])
        for e in episodes
    ]
    assert np.allclose(spans, [(0.0, 0.5), (0.5, 1.2), (1.2, 2.1)])
    assert set(episodes[0]) >= {
        "stats/action/mean", "stats/action/q01", "stats/observation.images.top/std", "stats/timestamp/max",
    }  # fmt: skip


def test_stats_match_numpy_over_all_frames(image_dataset) -> None:
    stats = json.loads((image_dataset.root / "meta/stats.json").read_text())
    action = image_dataset.action.astype(np.float64)
    expected = {
        "min": action.min(0), "max": action.max(0), "mean": action.mean(0), "std": action.std(0),
        "q01": np.quantile(action, 0.01, axis=0), "q10": np.quantile(action, 0.10, axis=0),
        "q50": np.quantile(action, 0.50, axis=0), "q90": np.quantile(action, 0.90, axis=0),
        "q99": np.quantile(action, 0.99, axis=0),
    }  # fmt: skip
    for key, value in expected.items():
        np.testing.assert_allclose(stats["action"][key], value, rtol=1e-6, err_msg=key)
    assert stats["action"]["count"] == [21]
    image = stats["observation.images.top"]
    assert np.asarray(image["mean"]).shape == (3, 1, 1)
    pixels = image_dataset.images["observation.images.top"].reshape(-1, 3) / 255.0
    np.testing.assert_allclose(np.asarray(image["mean"]).ravel(), pixels.mean(0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(image["max"]).ravel(), pixels.max(0))
    assert stats["frame_index"]["max"] == [8.0]


def test_episode_stats_are_per_episode(image_dataset) -> None:
    per_episode = DatasetMetadata(image_dataset.root).load_episode_stats()
    assert sorted(per_episode) == [0, 1, 2]
    start, end = 5, 12
    np.testing.assert_allclose(
        per_episode[1]["observation.state"]["mean"], image_dataset.state[start:end].mean(0), rtol=1e-6
    )
    assert per_episode[1]["action"]["count"].tolist() == [7]


def test_files_roll_over_by_size_and_still_read_back(make_dataset) -> None:
    written = make_dataset(
        [6, 6, 6, 6],
        use_videos=True,
        codec="h264",
        data_files_size_in_mb=0.0005,
        video_files_size_in_mb=0.0005,
    )
    root = written.root
    assert len(list((root / "data").glob("chunk-000/file-*.parquet"))) > 1
    assert len(list((root / "videos/observation.images.top").glob("chunk-000/file-*.mp4"))) > 1
    meta = DatasetMetadata(root)
    assert {ep.data_path for ep in meta.episodes.values()} != {"data/chunk-000/file-000.parquet"}
    first_in_new_file = [
        ep
        for ep in meta.episodes.values()
        if ep.videos["observation.images.top"].path.endswith("file-001.mp4")
    ]
    assert first_in_new_file and first_in_new_file[0].videos["observation.images.top"].from_timestamp == 0.0
    dataset = LeRobotDataset(root, image_dtype="uint8")
    for index in range(len(dataset)):
        item = dataset[index]
        np.testing.assert_array_equal(item["action"].numpy(), written.action[index])
        decoded = item["observation.images.top"].permute(1, 2, 0).numpy().astype(np.int16)
        assert np.abs(decoded - written.images["observation.images.top"][index]).mean() < 6


def test_writer_rejects_bad_frames(tmp_path) -> None:
    features = {"observation.state": {"dtype": "float32", "shape": [2], "names": None}}
    writer = LeRobotDatasetWriter(tmp_path / "ds", fps=10, features=features, use_videos=False)
    with pytest.raises(DatasetFormatError, match="missing"):
        writer.add_frame({}, task="t")
    with pytest.raises(DatasetFormatError, match="unexpected"):
        writer.add_frame({"observation.state": np.zeros(2), "action": np.zeros(2)}, task="t")
    with pytest.raises(DatasetFormatError, match=r"shape \(3,\)"):
        writer.add_frame({"observation.state": np.zeros(3)}, task="t")
    with pytest.raises(DatasetFormatError, match="NaN"):
        writer.add_frame({"observation.state": np.array([0.0, np.nan])}, task="t")
    with pytest.raises(DatasetError, match="no episode"):
        writer.finalize()
    writer.add_frame({"observation.state": np.zeros(2)}, task="t")
    with pytest.raises(DatasetError, match="save_episode"):
        writer.finalize()
    writer.save_episode()
    writer.finalize()
    with pytest.raises(DatasetError, match="finalized"):
        writer.add_frame({"observation.state": np.zeros(2)}, task="t")
    with pytest.raises(DatasetError, match="not empty"):
        LeRobotDatasetWriter(tmp_path / "ds", fps=10, features=features)


def test_writer_accepts_channel_first_float_images(tmp_path) -> None:
    features = {
        "cam": {"dtype": "image", "shape": [4, 6, 3], "names": None},
        "s": {"dtype": "float32", "shape": [1], "names": None},
    }
    image = np.random.default_rng(0).integers(0, 256, size=(4, 6, 3)).astype(np.uint8)
    with LeRobotDatasetWriter(tmp_path / "ds", fps=5, features=features, use_videos=False) as writer:
        writer.add_frame({"cam": image.transpose(2, 0, 1).astype(np.float32) / 255.0, "s": 1.5}, task="t")
        writer.save_episode()
    item = LeRobotDataset(tmp_path / "ds", image_dtype="uint8")[0]
    np.testing.assert_array_equal(item["cam"].permute(1, 2, 0).numpy(), image)
    assert item["s"].shape == () and item["s"].item() == 1.5
    assert ACTION_DIM == 2  # the shared fixtures' layout, used above via make_dataset
