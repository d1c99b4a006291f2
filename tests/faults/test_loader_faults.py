"""A training split smaller than one batch fails at once with a clear error instead of hanging.

Every test carries a timeout: a regression to the old `while True: yield from self` spin must
show up as a failure, not as a hung suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vla.data import BatchProcessor, LeRobotDataset, ProcessorConfig, build_pipeline, make_dataloader
from vla.data.errors import DatasetTooSmallError
from vla.data.synthetic import SyntheticConfig, generate_synthetic_dataset

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 episodes x 10 frames, parquet images (no video decode needed)."""
    root = tmp_path_factory.mktemp("loader_faults") / "ds"
    return generate_synthetic_dataset(
        root, SyntheticConfig(episodes=3, episode_length=10, image_size=32, use_videos=False)
    )


def _config() -> ProcessorConfig:
    return ProcessorConfig(
        camera_map={"observation.images.top": "cam"}, image_size=16, max_state_dim=8, max_action_dim=8,
        action_horizon=2,
    )  # fmt: skip


def _processor_and_dataset(root: Path) -> tuple[BatchProcessor, LeRobotDataset]:
    meta = LeRobotDataset(root).meta
    processor = BatchProcessor.from_dataset(_config(), meta)
    return processor, LeRobotDataset(root, delta_timestamps=processor.delta_timestamps(meta.fps))


def test_batch_larger_than_training_split_fails_at_construction(small_dataset) -> None:
    # 30 frames, val_fraction 0.34 -> 1 validation episode, 20 training frames < batch 32.
    with pytest.raises(
        DatasetTooSmallError,
        match=r"training split has 20 frames, 20 per rank over 1 rank\(s\), fewer than one batch of 32 "
        r"frames.*Lower trainer\.batch_size.*add episodes.*lower data\.val_fraction",
    ):
        build_pipeline(small_dataset, _config(), batch_size=32, val_fraction=0.34, rank=0, world_size=1)


def test_shard_smaller_than_batch_over_ranks(small_dataset) -> None:
    processor, dataset = _processor_and_dataset(small_dataset)
    # 30 frames over 4 ranks -> 7 per rank < 8.
    with pytest.raises(DatasetTooSmallError, match=r"30 frames, 7 per rank over 4 rank\(s\).*batch of 8"):
        make_dataloader(dataset, processor, batch_size=8, rank=1, world_size=4)
    # One batch per rank fits: the loader builds and yields full batches.
    loader = make_dataloader(dataset, processor, batch_size=7, rank=1, world_size=4)
    assert len(loader) == 1
    batches = [b for _, b in zip(range(3), loader.forever())]
    assert [b.actions.shape[0] for b in batches] == [7, 7, 7] and loader.epoch == 2


def test_without_drop_last_a_partial_batch_is_allowed(small_dataset) -> None:
    processor, dataset = _processor_and_dataset(small_dataset)
    loader = make_dataloader(dataset, processor, batch_size=64, drop_last=False, rank=0, world_size=1)
    assert len(loader) == 1
    assert [b.actions.shape[0] for b in loader] == [30]


@pytest.mark.parametrize("batch_size", [0, -4, 2.5, True])
def test_batch_size_must_be_a_positive_integer(small_dataset, batch_size) -> None:
    processor, dataset = _processor_and_dataset(small_dataset)
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got"):
        make_dataloader(dataset, processor, batch_size=batch_size, rank=0, world_size=1)


def test_fewer_frames_than_ranks(small_dataset) -> None:
    processor, dataset = _processor_and_dataset(small_dataset)
    with pytest.raises(
        DatasetTooSmallError, match=r"30 samples cannot be sharded over 31 ranks.*Add episodes"
    ):
        make_dataloader(dataset, processor, batch_size=1, rank=0, world_size=31)


def test_forever_raises_when_an_epoch_comes_out_empty(small_dataset) -> None:
    processor, dataset = _processor_and_dataset(small_dataset)
    loader = make_dataloader(dataset, processor, batch_size=4, rank=0, world_size=1)
    loader.sampler.num_samples = 3  # the dataset shrank under the loader: no full batch any more
    with pytest.raises(DatasetTooSmallError, match=r"a full epoch over 30 frames yielded no batch of 4"):
        next(loader.forever())


def test_forever_resumes_from_a_completed_epoch(small_dataset) -> None:
    # State saved right after an epoch's last batch: the first pass is empty, then epochs go on.
    processor, dataset = _processor_and_dataset(small_dataset)
    loader = make_dataloader(dataset, processor, batch_size=10, rank=0, world_size=1)
    loader.load_state_dict({**loader.state_dict(), "epoch": 0, "batches_in_epoch": 3})
    batches = [b for _, b in zip(range(4), loader.forever())]
    assert len(batches) == 4 and (loader.epoch, loader.batches_in_epoch) == (2, 1)
