"""The data scan (vla.data.scan): NaN/inf values and empty tasks named by file, episode and frame, in
training and validation episodes alike; data.on_bad_frames=drop_episode leaves those episodes out;
a NaN loss names the batch's frames (issue 18 item 3)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vla.data import LeRobotDataset, ProcessorConfig, build_pipeline
from vla.data.scan import BadFramesError, scan_frames
from vla.data.synthetic import SyntheticConfig, generate_synthetic_dataset

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("scan") / "clean"
    generate_synthetic_dataset(root, SyntheticConfig(episodes=6, episode_length=10, image_size=32))
    return root


def _poison(root: Path, key: str, episode: int, frame: int, value: float, dim: int = 0) -> Path:
    """Set `key`[dim] of one frame to `value` in the data file; returns that file."""
    (path,) = sorted((root / "data").rglob("*.parquet"))
    table = pq.read_table(path)
    rows = np.flatnonzero(
        (table.column("episode_index").to_numpy() == episode)
        & (table.column("frame_index").to_numpy() == frame)
    )
    column = table.column(key)
    values = np.stack(column.to_numpy(zero_copy_only=False)).astype(np.float32)
    values[rows[0], dim] = value
    array = pa.array(list(values), type=column.type)
    table = table.set_column(table.schema.get_field_index(key), key, array)
    pq.write_table(table, path)
    return path


def _copy(clean: Path, tmp_path: Path) -> Path:
    root = tmp_path / "data"
    shutil.copytree(clean, root)
    return root


def _config() -> ProcessorConfig:
    return ProcessorConfig(
        camera_map={"observation.images.top": "base_0_rgb"}, image_size=32, action_horizon=4
    )


def test_a_clean_dataset_has_no_bad_frames(clean: Path) -> None:
    assert scan_frames(LeRobotDataset(clean)) == []


def test_non_finite_values_and_empty_tasks_are_named_by_file_episode_and_frame(clean, tmp_path) -> None:
    root = _copy(clean, tmp_path)
    file = _poison(root, "observation.state", episode=2, frame=5, value=float("nan"), dim=1)
    _poison(root, "action", episode=4, frame=0, value=float("inf"))
    bad = scan_frames(LeRobotDataset(root))
    assert [(b.episode, b.frame, b.key) for b in bad] == [(4, 0, "action"), (2, 5, "observation.state")]
    assert str(bad[1]).startswith(f"{file.relative_to(root)}: episode 2 frame 5: observation.state holds NaN")
    assert "inf (1 of" in bad[0].problem

    tasks = root / "meta" / "tasks.parquet"
    table = pq.read_table(tasks)
    names = table.column("task").to_pylist()
    names[0] = "  "
    pq.write_table(table.set_column(table.schema.get_field_index("task"), "task", pa.array(names)), tasks)
    empty = [b for b in scan_frames(LeRobotDataset(root)) if b.key == "task"]
    assert empty and all("empty or null" in b.problem for b in empty)


def test_the_pipeline_refuses_bad_frames_in_either_split_or_drops_their_episodes(clean, tmp_path) -> None:
    root = _copy(clean, tmp_path)
    _poison(root, "action", episode=3, frame=7, value=float("nan"))
    # Whichever split episode 3 falls in (val_fraction 0.5: half the episodes), it is found.
    for seed in (0, 1):
        with pytest.raises(
            BadFramesError, match=r"(?s)episode 3 frame 7: action holds NaN.*on_bad_frames=drop_episode"
        ):
            build_pipeline(root, _config(), 2, val_fraction=0.5, split_seed=seed)
    data = build_pipeline(root, _config(), 2, val_fraction=0.5, on_bad_frames="drop_episode")
    kept = set(data.train_dataset.episodes) | set(data.val_dataset.episodes)
    assert kept == {0, 1, 2, 4, 5}
    (note,) = data.notes
    assert "left out 1 episode(s) [3]" in note and "episode 3 frame 7" in note
    assert np.isfinite(data.train_dataset.column("action")).all()
    with pytest.raises(ValueError, match="data.on_bad_frames must be one of"):
        build_pipeline(root, _config(), 2, on_bad_frames="ignore")
