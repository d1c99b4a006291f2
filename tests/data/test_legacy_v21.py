"""Reading the v2.1 layout (one parquet/mp4 per episode, jsonl metadata, no stats.json)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from _lerobot_fixtures import WrittenDataset

from vla.data import LeRobotDataset
from vla.data import lerobot_format as fmt
from vla.data.metadata import DatasetMetadata
from vla.data.video import encode_video


def convert_to_v21(written: WrittenDataset, root: Path) -> Path:
    """Rewrite a v3.0 dataset as LeRobot v2.1 lays it out."""
    meta = DatasetMetadata(written.root)
    info = json.loads((written.root / fmt.INFO_PATH).read_text())
    has_videos = bool(meta.video_keys)
    info.update(
        codebase_version="v2.1",
        data_path=fmt.LEGACY_DATA_PATH,
        video_path=fmt.LEGACY_VIDEO_PATH if has_videos else None,
        total_chunks=1,
        total_videos=len(meta.video_keys) * meta.total_episodes,
    )
    for key in ("data_files_size_in_mb", "video_files_size_in_mb"):
        info.pop(key)
    (root / "meta").mkdir(parents=True)
    (root / fmt.INFO_PATH).write_text(json.dumps(info, indent=2))
    table = pq.read_table(written.root / "data/chunk-000/file-000.parquet")
    episode_stats = meta.load_episode_stats()
    episodes_lines, stats_lines = [], []
    for episode, info_row in meta.episodes.items():
        rows = table.filter(pc.equal(table.column("episode_index"), episode))
        path = root / fmt.LEGACY_DATA_PATH.format(episode_chunk=0, episode_index=episode)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(rows, path)
        for key in meta.video_keys:
            start = written.episode_start(episode)
            frames = written.images[key][start : start + info_row.length]
            video = root / fmt.LEGACY_VIDEO_PATH.format(episode_chunk=0, video_key=key, episode_index=episode)
            encode_video(video, frames, fps=meta.fps, codec="h264")
        episodes_lines.append({"episode_index": episode, "tasks": info_row.tasks, "length": info_row.length})
        stats = {f: {k: v.tolist() for k, v in s.items()} for f, s in episode_stats[episode].items()}
        stats_lines.append({"episode_index": episode, "stats": stats})
    tasks_lines = [{"task_index": i, "task": t} for i, t in enumerate(meta.tasks)]
    for name, lines in (
        ("episodes", episodes_lines),
        ("episodes_stats", stats_lines),
        ("tasks", tasks_lines),
    ):
        (root / f"meta/{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


@pytest.mark.parametrize("kind", ["image", "video"])
def test_v21_items_match_v30_items(kind, image_dataset, video_dataset, tmp_path) -> None:
    written = image_dataset if kind == "image" else video_dataset
    legacy_root = convert_to_v21(written, tmp_path / "v21")
    deltas = {"action": [0.0, 0.1, 0.2]}
    legacy = LeRobotDataset(legacy_root, delta_timestamps=deltas, image_dtype="uint8")
    current = LeRobotDataset(written.root, delta_timestamps=deltas, image_dtype="uint8")
    assert legacy.meta.codebase_version == "v2.1" and legacy.meta.is_legacy
    assert len(legacy) == len(current) and legacy.meta.tasks == current.meta.tasks
    for index in range(len(current)):
        old, new = legacy[index], current[index]
        assert set(old) == set(new)
        for key in ("action", "action_is_pad", "observation.state", "index", "episode_index", "frame_index"):
            assert torch.equal(old[key], new[key]), key
        assert old["task"] == new["task"]
        for key in current.camera_keys:
            if kind == "image":
                assert torch.equal(old[key], new[key])
            else:  # per-episode H.264 vs concatenated AV1: both close to the written frames
                truth = torch.from_numpy(written.images[key][index]).permute(2, 0, 1).float()
                assert (old[key].float() - truth).abs().mean() < 6


def test_v21_stats_are_aggregated_from_episode_stats(image_dataset, tmp_path) -> None:
    legacy = DatasetMetadata(convert_to_v21(image_dataset, tmp_path / "v21"))
    assert not (legacy.root / "meta/stats.json").exists()
    state = image_dataset.state.astype(np.float64)
    np.testing.assert_allclose(legacy.stats["observation.state"]["mean"], state.mean(0), rtol=1e-6)
    np.testing.assert_allclose(legacy.stats["observation.state"]["std"], state.std(0), rtol=1e-6)
    np.testing.assert_allclose(legacy.stats["action"]["max"], image_dataset.action.max(0))
    assert legacy.stats["action"]["count"].tolist() == [21]
    assert legacy.episodes[2].data_path == "data/chunk-000/episode_000002.parquet"
