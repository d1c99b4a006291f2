"""Bad datasets and bad settings fail early with errors naming the file or key and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vla.data import (
    BatchProcessor,
    DatasetFileNotFoundError,
    DatasetFormatError,
    DeltaTimestampsError,
    LeRobotDataset,
    MissingFeatureError,
    ProcessorConfig,
    StatsError,
    UnsupportedVersionError,
)


@pytest.fixture
def dataset_copy(image_dataset, tmp_path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(image_dataset.root, root)
    return root


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_missing_root_and_meta_files(dataset_copy, tmp_path) -> None:
    with pytest.raises(
        DatasetFileNotFoundError, match=r"root .*nowhere does not exist.*make_synthetic_dataset"
    ):
        LeRobotDataset(tmp_path / "nowhere")
    (dataset_copy / "meta/tasks.parquet").unlink()
    with pytest.raises(DatasetFileNotFoundError, match=r"meta/tasks\.parquet"):
        LeRobotDataset(dataset_copy)
    (dataset_copy / "meta/info.json").unlink()
    with pytest.raises(DatasetFileNotFoundError, match=r"meta/info\.json does not exist"):
        LeRobotDataset(dataset_copy)


def test_missing_episode_metadata_and_data_files(dataset_copy) -> None:
    data_file = dataset_copy / "data/chunk-000/file-000.parquet"
    data_file.rename(dataset_copy / "moved.parquet")
    with pytest.raises(
        DatasetFileNotFoundError, match=r"data/chunk-000/file-000\.parquet.*episodes \[0, 1, 2\]"
    ):
        LeRobotDataset(dataset_copy)
    shutil.rmtree(dataset_copy / "meta/episodes")
    with pytest.raises(DatasetFileNotFoundError, match=r"meta/episodes/chunk-\*/file-\*\.parquet"):
        LeRobotDataset(dataset_copy)


def test_missing_video_file(video_dataset, tmp_path) -> None:
    root = tmp_path / "videos"
    shutil.copytree(video_dataset.root, root)
    (root / "videos/observation.images.wrist/chunk-000/file-000.mp4").unlink()
    with pytest.raises(DatasetFileNotFoundError, match=r"observation\.images\.wrist/chunk-000/file-000\.mp4"):
        LeRobotDataset(root)


@pytest.mark.parametrize("version", ["v1.6", "v4.0", None])
def test_unsupported_codebase_version(dataset_copy, version) -> None:
    edit_json(dataset_copy / "meta/info.json", lambda info: info.update(codebase_version=version))
    with pytest.raises(
        UnsupportedVersionError, match=r"info\.json: codebase_version is .*supports \['v3\.0'"
    ):
        LeRobotDataset(dataset_copy)


def test_feature_declared_but_absent_from_data(dataset_copy) -> None:
    def add(info):
        info["features"]["observation.effort"] = {"dtype": "float32", "shape": [3], "names": None}

    edit_json(dataset_copy / "meta/info.json", add)
    with pytest.raises(
        DatasetFormatError, match=r"file-000\.parquet: .*\['observation\.effort'\].*no such column"
    ):
        LeRobotDataset(dataset_copy)


def test_shape_mismatch_between_info_and_data(dataset_copy) -> None:
    edit_json(dataset_copy / "meta/info.json", lambda info: info["features"]["action"].update(shape=[5]))
    with pytest.raises(
        DatasetFormatError, match=r"file-000\.parquet: column 'action' holds 2 values .*shape \[5\]"
    ):
        LeRobotDataset(dataset_copy)


def test_image_shape_mismatch(dataset_copy) -> None:
    edit_json(
        dataset_copy / "meta/info.json",
        lambda info: info["features"]["observation.images.top"].update(shape=[20, 24, 3]),
    )
    dataset = LeRobotDataset(dataset_copy)
    with pytest.raises(
        DatasetFormatError, match=r"'observation\.images\.top' .*decodes to \(16, 24, 3\).*\[20, 24, 3\]"
    ):
        dataset[0]


def test_malformed_feature_schema(dataset_copy) -> None:
    edit_json(dataset_copy / "meta/info.json", lambda info: info["features"]["action"].pop("dtype"))
    with pytest.raises(
        DatasetFormatError, match=r"info\.json features: feature 'action' must be a dict with 'dtype'"
    ):
        LeRobotDataset(dataset_copy)


def test_nan_in_stats(dataset_copy) -> None:
    edit_json(dataset_copy / "meta/stats.json", lambda stats: stats["action"].update(std=[1.0, float("nan")]))
    with pytest.raises(
        StatsError, match=r"stats\.json: stats of 'action', entry 'std' contain non-finite values \[nan\]"
    ):
        LeRobotDataset(dataset_copy)


def test_missing_stats_only_fails_when_normalising(dataset_copy) -> None:
    (dataset_copy / "meta/stats.json").unlink()
    meta = LeRobotDataset(dataset_copy).meta  # reading frames needs no stats
    config = ProcessorConfig(
        camera_map={"observation.images.top": "cam"}, max_state_dim=4, max_action_dim=4, action_horizon=2
    )
    with pytest.raises(DatasetFileNotFoundError, match=r"normalisation stats .*meta/stats\.json"):
        BatchProcessor.from_dataset(config, meta)


def test_expected_feature_missing_lists_what_exists(image_dataset) -> None:
    meta = LeRobotDataset(image_dataset.root).meta
    config = ProcessorConfig(camera_map={"observation.images.top": "cam"}, action_key="actions")
    with pytest.raises(
        MissingFeatureError, match=r"expects feature\(s\) \['actions'\].*Available features: \[.*'action'"
    ):
        BatchProcessor.from_dataset(config, meta)


def test_bad_delta_timestamps(image_dataset) -> None:
    with pytest.raises(
        DeltaTimestampsError, match=r"delta_timestamps\['action'\] has \[0\.05\], not multiples of 1/fps"
    ):
        LeRobotDataset(image_dataset.root, delta_timestamps={"action": [0.0, 0.05, 0.1]})
    with pytest.raises(DeltaTimestampsError, match=r"names \['actions'\], which are not dataset features"):
        LeRobotDataset(image_dataset.root, delta_timestamps={"actions": [0.0]})


def test_episode_indices_out_of_range(image_dataset) -> None:
    with pytest.raises(IndexError, match=r"episodes \[3, 7\] are not in .*episodes 0\.\.2"):
        LeRobotDataset(image_dataset.root, episodes=[0, 3, 7])


def test_unfinished_dataset(dataset_copy) -> None:
    edit_json(dataset_copy / "meta/info.json", lambda info: info.update(total_episodes=5))
    with pytest.raises(
        DatasetFormatError, match=r"total_episodes is 5 but the episode metadata lists 3.*finalize"
    ):
        LeRobotDataset(dataset_copy)
