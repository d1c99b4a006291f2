"""One call from config values to train/validation loaders (what the trainer needs).

data = build_pipeline(root, ProcessorConfig(...), batch_size=32, val_fraction=0.1, num_workers=4,
                      device="cuda")
for batch in data.train.forever(): ...            # vla.types.Batch on the device
save(data.processor.state_dict(), data.train.state_dict())   # for inference / resuming
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vla.data.augment import ImageAugmenter, ImageTransformsConfig
from vla.data.loader import BatchLoader, make_dataloader
from vla.data.metadata import DatasetMetadata
from vla.data.mixture import task_mixture
from vla.data.processor import BatchProcessor, ProcessorConfig
from vla.data.reader import LeRobotDataset
from vla.data.scan import ON_BAD_FRAMES, BadFramesError, describe, scan_frames
from vla.data.splits import split_episodes


@dataclass
class DataPipeline:
    meta: DatasetMetadata
    processor: BatchProcessor
    train_dataset: LeRobotDataset
    train: BatchLoader
    val_dataset: LeRobotDataset | None
    val: BatchLoader | None
    notes: list[str]  # what the trainer should tell the user (episodes left out by the data scan)


def build_pipeline(
    root: Path | str,
    config: ProcessorConfig,
    batch_size: int,
    *,
    val_fraction: float = 0.0,
    episodes: list[int] | None = None,
    split_seed: int = 0,
    seed: int = 0,
    num_workers: int = 0,
    frame_cache_mb: float = 0.0,
    rank: int | None = None,
    world_size: int | None = None,
    device: torch.device | str | None = None,
    val_batch_size: int | None = None,
    val_shuffle: bool = False,
    tokenizer: Any | None = None,
    image_transforms: ImageTransformsConfig | None = None,
    on_bad_frames: str = "error",
    task_weights: dict[str, float] | None = None,
) -> DataPipeline:
    """Datasets, processor and loaders for a LeRobot dataset at `root`.

    Episodes (all, or `episodes`) are split train/val by `split_seed`; normalisation uses the whole
    dataset's meta/stats.json (as LeRobot does). Items are uint8 when config.uint8_images. The train
    loader shuffles and drops the last partial batch; the val loader keeps every frame (shards are
    padded by wrapping around, so a few frames repeat when sizes do not divide), in dataset order or,
    with `val_shuffle`, in a fixed shuffled order (so its first batches sample many episodes).
    Raises StatsError when stats.json gives the state or action zero width (std, range) in a dim
    where the training data varies, and DatasetTooSmallError when the training split holds less than
    one batch per rank. image_transforms (when enabled) augments the training loader's images only,
    seeded by `seed` (vla.data.augment); validation is never augmented.
    Every frame of both splits is scanned first (vla.data.scan): NaN/inf values or empty tasks raise
    BadFramesError naming file, episode and frame, or with on_bad_frames="drop_episode" their episodes
    are left out (DataPipeline.notes says which).
    task_weights (task text -> weight, vla.data.mixture) changes how often the training loader draws
    each task's frames (notes gives the shares); validation keeps every frame once. A name the dataset
    lacks, or a bad weight, raises TaskWeightsError.
    """
    if on_bad_frames not in ON_BAD_FRAMES:
        raise ValueError(f"data.on_bad_frames must be one of {list(ON_BAD_FRAMES)}, got {on_bad_frames!r}")
    meta = DatasetMetadata(root)
    processor = BatchProcessor.from_dataset(config, meta, tokenizer=tokenizer)
    pool = sorted(meta.episodes) if episodes is None else sorted(episodes)
    train_episodes, val_episodes = split_episodes(pool, val_fraction, split_seed)
    dataset_kwargs = {
        "delta_timestamps": processor.delta_timestamps(meta.fps),
        "image_dtype": "uint8" if config.uint8_images else "float32",
        "frame_cache_mb": frame_cache_mb,
    }
    train_dataset = LeRobotDataset(root, episodes=train_episodes, **dataset_kwargs)
    val_dataset = LeRobotDataset(root, episodes=val_episodes, **dataset_kwargs) if val_episodes else None
    notes: list[str] = []
    bad = scan_frames(train_dataset) + (scan_frames(val_dataset) if val_dataset is not None else [])
    if bad:
        splits = "training" if val_dataset is None else "training and validation"
        if on_bad_frames == "error":
            raise BadFramesError(describe(bad, meta.root, splits))
        dropped = sorted({b.episode for b in bad})
        train_episodes = [e for e in train_episodes if e not in dropped]
        val_episodes = [e for e in val_episodes if e not in dropped]
        if not train_episodes:
            raise BadFramesError(describe(bad, meta.root, splits) + "; every training episode holds one")
        train_dataset = LeRobotDataset(root, episodes=train_episodes, **dataset_kwargs)
        val_dataset = LeRobotDataset(root, episodes=val_episodes, **dataset_kwargs) if val_episodes else None
        notes.append(
            f"data.on_bad_frames=drop_episode: left out {len(dropped)} episode(s) {dropped} of {meta.root} "
            f"({len(bad)} bad frame(s), first: {bad[0]})"
        )
    # stats.json with std (or range) 0 where the data moves would scale those dims by ~1e6: refuse.
    for key in (config.state_key, config.action_key):
        if key:
            processor.normalizer.check_data(
                key, train_dataset.column(key), f"the data files under {meta.root} (training split)"
            )
    loader_kwargs = {
        "num_workers": num_workers,
        "seed": seed,
        "rank": rank,
        "world_size": world_size,
        "device": device,
    }
    augment = (
        ImageAugmenter(image_transforms, processor.model_cameras, seed)
        if image_transforms is not None and image_transforms.enable
        else None
    )
    mixture = task_mixture(train_dataset.column("task_index"), meta.tasks, task_weights or {}, str(meta.root))
    if mixture is not None:
        notes.append(mixture.describe())
    train = make_dataloader(
        train_dataset,
        processor,
        batch_size,
        shuffle=True,
        drop_last=True,
        augment=augment,
        mixture=mixture,
        **loader_kwargs,
    )
    val = (
        make_dataloader(
            val_dataset,
            processor,
            val_batch_size or batch_size,
            shuffle=val_shuffle,
            drop_last=False,
            **{**loader_kwargs, "seed": seed + 1},
        )
        if val_dataset is not None
        else None
    )
    return DataPipeline(meta, processor, train_dataset, train, val_dataset, val, notes)
