"""Damaged datasets fail with an error that names the file (or info.json / stats.json key) and the fix.

The corpus is generated from one small valid synthetic dataset: each case copies it, damages one file
(truncated, zero bytes, garbage, garbled middle) or one metadata entry, and asserts the error type
and that the message names the file. Everything is bounded by a timeout, so a hang fails.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from vla.data import (
    BatchProcessor,
    DatasetFormatError,
    LeRobotDataset,
    Normalizer,
    ProcessorConfig,
    StatsError,
    build_pipeline,
    make_dataloader,
)
from vla.data.normalize import EPS
from vla.data.stats import vector_stats
from vla.data.synthetic import SyntheticConfig, generate_synthetic_dataset
from vla.data.writer import LeRobotDatasetWriter

pytestmark = pytest.mark.timeout(60)

SMALL = SyntheticConfig(episodes=3, episode_length=10, image_size=32)


@pytest.fixture(scope="module")
def video_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_synthetic_dataset(tmp_path_factory.mktemp("faults") / "video", SMALL)


@pytest.fixture(scope="module")
def image_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = SyntheticConfig(episodes=3, episode_length=10, image_size=32, use_videos=False)
    return generate_synthetic_dataset(tmp_path_factory.mktemp("faults") / "image", config)


def copy_of(base: Path, tmp_path: Path) -> Path:
    root = tmp_path / "damaged"
    shutil.copytree(base, root)
    return root


def edit_json(path: Path, change: Callable[[Any], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def garbage(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda data: data[: len(data) // 2],
    "zero_bytes": lambda data: b"",
    "garbage": lambda data: garbage(len(data)),
    "garbled_middle": lambda data: (
        data[: len(data) // 3] + garbage(len(data) // 3) + data[2 * len(data) // 3 :]
    ),
}

FILES = [
    "data/chunk-000/file-000.parquet",
    "meta/episodes/chunk-000/file-000.parquet",
    "meta/tasks.parquet",
    "meta/info.json",
    "meta/stats.json",
    "videos/observation.images.top/chunk-000/file-000.mp4",
    "videos/observation.images.wrist/chunk-000/file-000.mp4",
]


def open_and_read_everything(root: Path) -> None:
    dataset = LeRobotDataset(root)
    for index in range(len(dataset)):
        dataset[index]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("relative", FILES)
def test_damaged_file_names_the_file_and_the_fix(video_base, tmp_path, relative, damage) -> None:
    root = copy_of(video_base, tmp_path)
    path = root / relative
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    with pytest.raises(DatasetFormatError) as caught:
        open_and_read_everything(root)
    message = str(caught.value)
    assert message.startswith(str(path)), message
    assert "re-download" in message and "regenerate" in message, message
    if damage == "zero_bytes" and path.suffix != ".json":
        assert "the file is empty (0 bytes)" in message


def test_garbled_video_packets_fail_in_a_dataloader_worker_with_the_file(video_base, tmp_path) -> None:
    # Garbled frame data (the container header intact) passes the open-time probe; decoding in a
    # DataLoader worker must still name the file.
    root = copy_of(video_base, tmp_path)
    path = root / FILES[-1]
    with av.open(str(path)) as container:
        first = next(p for p in container.demux(container.streams.video[0]) if p.size)
        position, size = first.pos, first.size
    data = bytearray(path.read_bytes())
    data[position : position + size] = garbage(size)
    path.write_bytes(bytes(data))
    config = ProcessorConfig(
        camera_map={"observation.images.wrist": "cam"}, image_size=16, max_state_dim=8, max_action_dim=8,
        action_horizon=2,
    )  # fmt: skip
    data_pipeline = build_pipeline(root, config, batch_size=30, num_workers=1, rank=0, world_size=1)
    with pytest.raises(DatasetFormatError, match=rf"{FILES[-1]}: not a readable video file.*re-download"):
        next(iter(data_pipeline.train))


def test_garbled_png_inside_parquet_names_the_data_file_and_row(image_base, tmp_path) -> None:
    root = copy_of(image_base, tmp_path)
    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    column = table.column("observation.images.top").combine_chunks()
    png = column.field("bytes").to_pylist()
    png[12] = png[12][:40] + garbage(len(png[12]) - 40)
    broken = pa.StructArray.from_arrays(
        [pa.array(png, pa.binary()), column.field("path")], fields=list(column.type)
    )
    index = table.schema.get_field_index("observation.images.top")
    pq.write_table(table.set_column(index, table.schema.field(index), broken), path)
    dataset = LeRobotDataset(root)
    dataset[11]  # its neighbours still read
    with pytest.raises(
        DatasetFormatError,
        match=r"data/chunk-000/file-000\.parquet: not a readable PNG image in column 'observation\.images\.top' "
        r"\(episode 1, row 12\).*re-download",
    ):
        dataset[12]


# -- metadata that disagrees with the data ----------------------------------------------------------


def test_info_total_frames_that_disagree_with_the_episodes(image_base, tmp_path) -> None:
    root = copy_of(image_base, tmp_path)
    edit_json(root / "meta/info.json", lambda info: info.update(total_frames=31))
    with pytest.raises(
        DatasetFormatError,
        match=r"meta/info\.json: total_frames is 31 but the episode metadata lists 30 frames \(3 episodes\)"
        r".*set total_frames to 30",
    ):
        LeRobotDataset(root)


@pytest.mark.parametrize("fps", [30, 5])
def test_info_fps_that_disagrees_with_the_timestamps(image_base, tmp_path, fps) -> None:
    root = copy_of(image_base, tmp_path)
    edit_json(root / "meta/info.json", lambda info: info.update(fps=fps))
    with pytest.raises(
        DatasetFormatError,
        match=rf"meta/info\.json: fps is {fps} but the timestamps in .*file-000\.parquet.* advance by 0\.1 s "
        r"per frame within episodes \(10 fps\)\. Set fps in meta/info\.json",
    ):
        LeRobotDataset(root)


def test_timestamps_within_one_percent_of_fps_pass(image_base, tmp_path) -> None:
    root = copy_of(image_base, tmp_path)
    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    stretched = pa.array(table.column("timestamp").to_numpy() * 1.005, pa.float32())
    index = table.schema.get_field_index("timestamp")
    pq.write_table(table.set_column(index, table.schema.field(index), stretched), path)
    assert LeRobotDataset(root).fps == 10


# -- stats.json with zero width ---------------------------------------------------------------------

PIPELINE_CONFIG = ProcessorConfig(
    camera_map={"observation.images.top": "cam"}, image_size=16, max_state_dim=8, max_action_dim=8,
    action_horizon=2,
)  # fmt: skip


def test_std_zero_while_min_max_vary_is_refused(image_base, tmp_path) -> None:
    root = copy_of(image_base, tmp_path)
    edit_json(root / "meta/stats.json", lambda stats: stats["action"]["std"].__setitem__(1, 0.0))
    meta = LeRobotDataset(root).meta
    with pytest.raises(
        StatsError,
        match=r"meta/stats\.json: stats of 'action' give std = 0 for dim\(s\) \[1\] while their max - min is "
        r"\[[0-9.]+\] there.*scale those dims by ~1e\+08.*recompute them.*data\.norm_modes",
    ):
        BatchProcessor.from_dataset(PIPELINE_CONFIG, meta)


def test_std_zero_with_a_stale_range_is_caught_against_the_data(image_base, tmp_path) -> None:
    root = copy_of(image_base, tmp_path)

    def flatten_dim(stats: dict[str, Any]) -> None:
        action = stats["action"]
        action["std"][2] = 0.0
        for key in ("min", "max", "q01", "q10", "q50", "q90", "q99"):
            action[key][2] = action["mean"][2]

    edit_json(root / "meta/stats.json", flatten_dim)
    BatchProcessor.from_dataset(PIPELINE_CONFIG, LeRobotDataset(root).meta)  # self-consistent stats
    true_std = float(LeRobotDataset(root).column("action")[:, 2].std())
    assert true_std > 0.01
    with pytest.raises(
        StatsError,
        match=r"stats\.json: stats of 'action' give std = 0 for dim\(s\) \[2\] while the data in the data "
        r"files under .* \(training split\) varies there \(std \[[0-9.]+\] over 30 frames\)",
    ):
        build_pipeline(root, PIPELINE_CONFIG, batch_size=4, rank=0, world_size=1)


def test_min_max_zero_width_while_std_varies_is_refused() -> None:
    stats = {"action": vector_stats(np.random.default_rng(0).normal(size=(50, 2)))}
    stats["action"]["max"] = stats["action"]["max"].copy()
    stats["action"]["max"][0] = stats["action"]["min"][0]
    with pytest.raises(StatsError, match=r"give max - min = 0 for dim\(s\) \[0\] while their std is"):
        Normalizer(stats, {"action": "MIN_MAX"}, source="stats.json")


def test_quantile_width_zero_warns_and_constant_dims_pass() -> None:
    values = np.zeros((200, 3))
    values[:, 0] = np.random.default_rng(0).normal(size=200)
    values[0, 1] = 5.0  # a dim that almost never moves: q01 = q99 = 0, max = 5
    stats = {"action": vector_stats(values)}
    with pytest.warns(UserWarning, match=r"stats of 'action' give q99 - q01 = 0 for dim\(s\) \[1\]"):
        Normalizer(stats, {"action": "QUANTILES"}, source="stats.json")
    # Dim 2 is constant in stats and data: std 0 is right there, and it normalises to exactly 0.
    normalizer = Normalizer({"action": vector_stats(values[:, [0, 2]])}, {"action": "MEAN_STD"})
    normalizer.check_data("action", values[:, [0, 2]], "the data")
    out = normalizer.normalize("action", torch.tensor(values[:, [0, 2]], dtype=torch.float32))
    assert torch.all(out[:, 1] == 0) and out[:, 0].abs().max() < 5


# -- 1-dim state and action -------------------------------------------------------------------------


def write_one_dim_dataset(root: Path) -> tuple[np.ndarray, np.ndarray]:
    features = {
        "observation.images.top": {
            "dtype": "image",
            "shape": [8, 8, 3],
            "names": ["height", "width", "channels"],
        },
        "observation.state": {"dtype": "float32", "shape": [1], "names": ["x"]},
        "action": {"dtype": "float32", "shape": [1], "names": ["dx"]},
    }
    rng = np.random.default_rng(0)
    state = rng.normal(size=(12, 1)).astype(np.float32)
    action = rng.normal(size=(12, 1)).astype(np.float32)
    with LeRobotDatasetWriter(root, fps=10, features=features, use_videos=False) as writer:
        for episode in range(2):
            for frame in range(6):
                index = episode * 6 + frame
                image = np.full((8, 8, 3), 10 * index, dtype=np.uint8)
                values = {
                    "observation.images.top": image,
                    "observation.state": state[index],
                    "action": action[index],
                }
                writer.add_frame(values, task="slide")
            writer.save_episode()
    return state[:, 0], action[:, 0]


def test_one_dim_state_and_action_train_like_any_other(tmp_path) -> None:
    root = tmp_path / "one_dim"
    state, action = write_one_dim_dataset(root)
    config = ProcessorConfig(
        camera_map={"observation.images.top": "cam"}, image_size=8, max_state_dim=4, max_action_dim=3,
        action_horizon=3,
    )  # fmt: skip
    meta = LeRobotDataset(root).meta
    processor = BatchProcessor.from_dataset(config, meta)
    assert (processor.state_dim, processor.action_dim) == (1, 1)
    dataset = LeRobotDataset(root, delta_timestamps=processor.delta_timestamps(meta.fps))
    batch = next(
        iter(make_dataloader(dataset, processor, batch_size=12, shuffle=False, rank=0, world_size=1))
    )
    assert batch.actions.shape == (12, 3, 3) and batch.observation.state.shape == (12, 4)
    state_stats, action_stats = meta.stats["observation.state"], meta.stats["action"]
    expected_state = (state - state_stats["mean"][0]) / (state_stats["std"][0] + EPS)
    np.testing.assert_allclose(batch.observation.state[:, 0].numpy(), expected_state, rtol=1e-5, atol=1e-5)
    assert torch.all(batch.observation.state[:, 1:] == 0)
    # Frame 4 of episode 0: actions 4, 5 and a pad (the episode ends) repeating the last frame.
    expected = (action[[4, 5, 5]] - action_stats["mean"][0]) / (action_stats["std"][0] + EPS)
    np.testing.assert_allclose(batch.actions[4, :, 0].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert batch.action_is_pad[4].tolist() == [False, False, True]
    assert torch.all(batch.actions[:, :, 1:] == 0) and batch.action_dim_mask[0].tolist() == [
        True,
        False,
        False,
    ]
    restored = processor.unnormalize_actions(batch.actions[4])
    np.testing.assert_allclose(restored[:, 0].numpy(), action[[4, 5, 5]], rtol=1e-5, atol=1e-5)
