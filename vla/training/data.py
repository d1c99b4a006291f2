"""Datasets, processor and loaders for a run, from the `data` group and the policy's layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from vla.data.loader import BatchLoader, make_dataloader
from vla.data.metadata import DatasetMetadata
from vla.data.processor import BatchProcessor, ProcessorConfig
from vla.data.reader import LeRobotDataset
from vla.data.splits import split_episodes
from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset
from vla.training.config import DataConfig

# pi0 normalises state and action by mean/std; OpenVLA-style bins actions in [-1, 1] from quantiles.
DEFAULT_NORM_MODES = {
    "pi0": {"state": "MEAN_STD", "action": "MEAN_STD"},
    "openvla": {"state": "MEAN_STD", "action": "QUANTILES"},
}


@dataclass
class DataBundle:
    train: BatchLoader
    val: BatchLoader | None
    processor: BatchProcessor
    root: Path
    train_episodes: list[int]
    val_episodes: list[int]


def dataset_root(cfg: DataConfig, rank: int) -> Path:
    """The dataset directory; for data=synthetic, rank 0 writes it on first use while others wait."""
    root = Path(cfg.root)
    if cfg.source != "synthetic":
        if not (root / "meta" / "info.json").is_file():
            raise FileNotFoundError(
                f"data.root={cfg.root!r} is not a LeRobot dataset (no meta/info.json there); point data.root "
                "at a local LeRobot v3.0 dataset, or use data=synthetic"
            )
        return root
    s = cfg.synthetic
    synthetic = SyntheticConfig(
        episodes=s.episodes,
        episode_length=s.episode_length,
        image_size=s.image_size,
        use_videos=s.use_videos,
        codec=s.codec,
        fps=s.fps,
        seed=s.seed,
    )
    if rank == 0:
        ensure_synthetic_dataset(root, synthetic)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return root


def processor_config(cfg: DataConfig, policy_config: Any) -> ProcessorConfig:
    defaults = DEFAULT_NORM_MODES[policy_config.kind]
    norm_modes = dict(cfg.norm_modes) if cfg.norm_modes is not None else {}
    if cfg.norm_modes is None:
        if cfg.state_key:
            norm_modes[cfg.state_key] = defaults["state"]
        norm_modes[cfg.action_key] = defaults["action"]
    if not cfg.camera_map:
        raise ValueError(
            "data.camera_map is empty: map the dataset's camera keys onto the model's cameras "
            f"{list(policy_config.cameras)}, e.g. 'data.camera_map={{observation.images.top: "
            f"{policy_config.cameras[0]}}}'"
        )
    return ProcessorConfig(
        camera_map=dict(cfg.camera_map),
        model_cameras=list(policy_config.cameras),
        image_size=policy_config.vision.image_size,
        max_state_dim=policy_config.max_state_dim,
        max_action_dim=policy_config.max_action_dim,
        action_horizon=policy_config.action_horizon,
        state_key=cfg.state_key,
        action_key=cfg.action_key,
        norm_modes=norm_modes,
        max_prompt_length=cfg.max_prompt_length,
        tokenizer_path=cfg.tokenizer_path,
        uint8_images=cfg.uint8_transport,
    )


def build_data(
    cfg: DataConfig, policy_config: Any, *, micro_batch: int, seed: int, rank: int, world: int, device: Any
) -> DataBundle:
    """Train / validation loaders (episodes split by `val_fraction`), each sharded over the ranks.

    micro_batch: samples per rank per forward. Every rank sees distinct samples of one global
    permutation, so the union of a step's batches is the same global batch at any world size.
    """
    root = dataset_root(cfg, rank)
    meta = DatasetMetadata(root)
    processor = BatchProcessor.from_dataset(processor_config(cfg, policy_config), meta)
    episodes = cfg.episodes if cfg.episodes is not None else sorted(meta.episodes)
    if cfg.val_fraction > 0:
        train_episodes, val_episodes = split_episodes(episodes, cfg.val_fraction, seed)
    else:
        train_episodes, val_episodes = sorted(episodes), []
    delta = processor.delta_timestamps(meta.fps)
    common: dict[str, Any] = {
        "delta_timestamps": delta,
        "image_dtype": "uint8" if cfg.uint8_transport else "float32",
    }
    train_set = LeRobotDataset(root, episodes=train_episodes, frame_cache_mb=256, **common)
    loader_kwargs = {"num_workers": cfg.num_workers, "rank": rank, "world_size": world, "device": device}
    train = make_dataloader(train_set, processor, micro_batch, shuffle=True, seed=seed, **loader_kwargs)
    val = None
    if val_episodes:
        val_set = LeRobotDataset(root, episodes=val_episodes, **common)
        if len(val_set) >= world * micro_batch:
            val = make_dataloader(
                val_set,
                processor,
                micro_batch,
                shuffle=True,
                seed=seed + 1,
                **{**loader_kwargs, "num_workers": 0},
            )
    return DataBundle(train, val, processor, root, list(train_episodes), list(val_episodes))
