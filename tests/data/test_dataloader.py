"""Sampler sharding across ranks, determinism by seed and epoch, and exact mid-epoch resume."""

from __future__ import annotations

import pytest
import torch

from vla.data import (
    BatchProcessor,
    LeRobotDataset,
    ProcessorConfig,
    ShardedResumableSampler,
    build_pipeline,
    make_dataloader,
    split_episodes,
    train_val_datasets,
)


def test_ranks_get_disjoint_shards_covering_the_epoch() -> None:
    shards = [
        ShardedResumableSampler(103, seed=1, rank=r, world_size=4, drop_last=True).indices() for r in range(4)
    ]
    assert all(len(s) == 25 for s in shards)
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == 100
    padded = [ShardedResumableSampler(103, seed=1, rank=r, world_size=4).indices() for r in range(4)]
    assert all(len(s) == 26 for s in padded) and set().union(*map(set, padded)) == set(range(103))


def test_order_depends_on_seed_and_epoch_only() -> None:
    sampler = ShardedResumableSampler(50, seed=7)
    first = sampler.indices()
    assert ShardedResumableSampler(50, seed=7).indices() == first
    assert sorted(first) == list(range(50)) and first != list(range(50))
    sampler.set_epoch(1)
    assert sampler.indices() != first
    assert ShardedResumableSampler(50, seed=8).indices() != first
    assert ShardedResumableSampler(50, shuffle=False).indices() == list(range(50))


def test_resume_mid_epoch_replays_exactly_the_remaining_batches(image_dataset) -> None:
    config = ProcessorConfig(
        camera_map={"observation.images.top": "cam"}, image_size=16, max_state_dim=4, max_action_dim=4,
        action_horizon=2,
    )  # fmt: skip
    meta = LeRobotDataset(image_dataset.root).meta
    processor = BatchProcessor.from_dataset(config, meta)
    dataset = LeRobotDataset(image_dataset.root, delta_timestamps=processor.delta_timestamps(meta.fps))

    def loader():
        return make_dataloader(dataset, processor, batch_size=3, seed=5, rank=1, world_size=2)

    reference = loader()
    full_run = [b.meta["index"].tolist() for b in reference] + [b.meta["index"].tolist() for b in reference]
    assert len(reference) == 3 and reference.epoch == 2  # 21 frames -> 10 per rank -> 3 batches of 3

    interrupted = loader()
    seen = []
    for batch in interrupted:
        seen.append(batch.meta["index"].tolist())
        if len(seen) == 2:
            break
    state = interrupted.state_dict()
    assert (state["epoch"], state["batches_in_epoch"]) == (0, 2)

    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b.meta["index"].tolist() for b in resumed] + [b.meta["index"].tolist() for b in resumed]
    assert seen + rest == full_run

    other_rank = make_dataloader(dataset, processor, batch_size=3, seed=5, rank=0, world_size=2)
    mine = {i for batch in full_run[:3] for i in batch}
    theirs = {i for batch in other_rank for i in batch.meta["index"].tolist()}
    assert not mine & theirs
    with pytest.raises(ValueError, match="batch_size"):
        make_dataloader(dataset, processor, batch_size=4, seed=5, rank=1, world_size=2).load_state_dict(state)


def test_forever_crosses_epochs(image_dataset) -> None:
    config = ProcessorConfig(
        camera_map={},
        model_cameras=["cam"],
        image_size=8,
        max_state_dim=4,
        max_action_dim=4,
        action_horizon=1,
    )
    meta = LeRobotDataset(image_dataset.root).meta
    processor = BatchProcessor.from_dataset(config, meta)
    dataset = LeRobotDataset(image_dataset.root, delta_timestamps=processor.delta_timestamps(meta.fps))
    loader = make_dataloader(dataset, processor, batch_size=8, seed=0, rank=0, world_size=1)
    batches = [b for _, b in zip(range(5), loader.forever())]
    assert len(batches) == 5 and loader.epoch == 2 and loader.batches_in_epoch == 1
    assert batches[0].observation.image_masks["cam"].sum() == 0
    assert torch.all(batches[0].observation.images["cam"] == -1)


def test_split_by_episodes_is_deterministic_and_disjoint(image_dataset) -> None:
    train, val = split_episodes(20, val_fraction=0.2, seed=0)
    assert len(val) == 4 and len(train) == 16 and not set(train) & set(val)
    assert split_episodes(20, val_fraction=0.2, seed=0) == (train, val)
    assert split_episodes(20, val_fraction=0.2, seed=1) != (train, val)
    assert split_episodes([3, 5, 9], val_fraction=0.1)[1] and len(split_episodes(3, 0.1)[1]) == 1
    assert split_episodes(5, val_fraction=0.0) == ([0, 1, 2, 3, 4], [])
    with pytest.raises(ValueError, match="keep any for training"):
        split_episodes(1, val_fraction=0.5)
    train_set, val_set = train_val_datasets(image_dataset.root, val_fraction=0.34, seed=0)
    assert val_set is not None and train_set.num_episodes == 2 and val_set.num_episodes == 1
    assert not set(train_set.episodes) & set(val_set.episodes)
    assert len(train_set) + len(val_set) == 21


def test_build_pipeline_from_config_values(image_dataset) -> None:
    config = ProcessorConfig(
        camera_map={"observation.images.top": "base_0_rgb"}, model_cameras=["base_0_rgb", "wrist"], image_size=16,
        max_state_dim=8, max_action_dim=8, action_horizon=3, uint8_images=True,
    )  # fmt: skip
    data = build_pipeline(
        image_dataset.root, config, batch_size=4, val_fraction=0.34, split_seed=0, rank=0, world_size=1
    )
    assert data.val_dataset is not None and data.val is not None
    assert data.train_dataset.num_episodes == 2 and data.val_dataset.num_episodes == 1
    assert data.train_dataset.image_dtype == "uint8"
    batch = next(iter(data.train))
    assert batch.actions.shape == (4, 3, 8) and batch.observation.images["base_0_rgb"].dtype == torch.float32
    val_indices = [i for b in data.val for i in b.meta["index"].tolist()]
    assert sorted(set(val_indices)) == sorted(data.val_dataset.column("index").tolist())
    assert data.processor.state_dict()["action_dim"] == 2
