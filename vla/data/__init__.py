"""LeRobot-format datasets and the processing that turns their items into `vla.types.Batch`.

Reading:      LeRobotDataset (v3.0, v2.x), DatasetMetadata, split_episodes, train_val_datasets
Writing:      LeRobotDatasetWriter, synthetic.generate_synthetic_dataset / ensure_synthetic_dataset
Processing:   ProcessorConfig, BatchProcessor (collate, finalize, unnormalize_actions), Normalizer,
              NormMode, resize_with_pad, load_tokenizer, PromptTokenizer
Loading:      make_dataloader -> BatchLoader (sharded by rank, resumable), action_delta_timestamps,
              build_pipeline (config values -> processor + train/val loaders), task_mixture
              (per-task sampling weights -> TaskMixture)
Synthetic:    SyntheticConfig, generate_synthetic_dataset, ensure_synthetic_dataset, ReachWorld

This package never imports vla.models, vla.training, accelerate or hydra.
"""

from vla.data.errors import (
    DatasetError,
    DatasetFileNotFoundError,
    DatasetFormatError,
    DeltaTimestampsError,
    FrameTimestampError,
    MissingFeatureError,
    StatsError,
    TaskWeightsError,
    UnsupportedVersionError,
)
from vla.data.loader import BatchLoader, ShardedResumableSampler, make_dataloader
from vla.data.metadata import DatasetMetadata
from vla.data.mixture import TaskMixture, task_mixture
from vla.data.normalize import Normalizer, NormMode
from vla.data.pipeline import DataPipeline, build_pipeline
from vla.data.processor import BatchProcessor, ProcessorConfig
from vla.data.reader import LeRobotDataset
from vla.data.splits import split_episodes, train_val_datasets
from vla.data.synthetic import (
    ReachWorld,
    SyntheticConfig,
    ensure_synthetic_dataset,
    generate_synthetic_dataset,
)
from vla.data.tokenizer import PromptTokenizer, load_tokenizer
from vla.data.transforms import resize_with_pad, to_model_range
from vla.data.windows import action_delta_timestamps
from vla.data.writer import LeRobotDatasetWriter

__all__ = [
    "BatchLoader",
    "BatchProcessor",
    "DataPipeline",
    "DatasetError",
    "DatasetFileNotFoundError",
    "DatasetFormatError",
    "DatasetMetadata",
    "DeltaTimestampsError",
    "FrameTimestampError",
    "LeRobotDataset",
    "LeRobotDatasetWriter",
    "MissingFeatureError",
    "NormMode",
    "Normalizer",
    "ProcessorConfig",
    "PromptTokenizer",
    "ReachWorld",
    "ShardedResumableSampler",
    "StatsError",
    "SyntheticConfig",
    "TaskMixture",
    "TaskWeightsError",
    "UnsupportedVersionError",
    "action_delta_timestamps",
    "build_pipeline",
    "ensure_synthetic_dataset",
    "generate_synthetic_dataset",
    "load_tokenizer",
    "make_dataloader",
    "resize_with_pad",
    "split_episodes",
    "task_mixture",
    "to_model_range",
    "train_val_datasets",
]
