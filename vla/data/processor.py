"""Items (dicts as LeRobotDataset returns them) -> `vla.types.Batch` for a policy.

Per batch: cameras renamed (dataset key -> model camera name), resized with padding to R x R and
scaled to [-1, 1]; model cameras the dataset lacks are filled with -1 and masked out; state and
actions normalised from the dataset stats and zero-padded to the model's max dims; task strings
tokenised to a fixed length.

uint8 transport: with `ProcessorConfig(uint8_images=True)` the collate (which runs inside DataLoader
workers) emits uint8 images, 4x smaller to ship to the main process; `finalize()` then converts
them to float32 [-1, 1], ideally after moving the batch to the accelerator. With
`resize_on_finalize=True` as well, workers ship the images at their stored resolution and
`finalize()` also resizes them (on the accelerator: the workers only decode).

`collate` output is the final Batch unless one of those options is set; `finalize` is a no-op on
final batches, so a loop can always call it (BatchLoader does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from vla.data.augment import AUGMENT_KEY, ImageAugmenter
from vla.data.errors import DatasetFormatError, MissingFeatureError
from vla.data.metadata import DatasetMetadata
from vla.data.normalize import Normalizer, NormMode, parse_modes
from vla.data.tokenizer import PromptTokenizer, load_tokenizer
from vla.data.transforms import resize_with_pad, to_model_range
from vla.data.windows import action_delta_timestamps
from vla.types import Batch, Observation

_META_KEYS = ("episode_index", "index", "frame_index", "timestamp")


@dataclass
class ProcessorConfig:
    """Plain settings (the trainer fills them from its Hydra config).

    camera_map: dataset camera key -> model camera name.
    model_cameras: every camera name the model takes, in order (default: camera_map's values);
        names no dataset key maps to become masked, -1-filled images.
    norm_modes: feature -> "MEAN_STD" | "MIN_MAX" | "QUANTILES" | "IDENTITY" (pi0: MEAN_STD for
        state and action; OpenVLA-style: QUANTILES or MIN_MAX for action).
    state_key: None for datasets without proprioception (state is then all zeros).
    """

    camera_map: dict[str, str]
    model_cameras: list[str] | None = None
    image_size: int = 224
    max_state_dim: int = 32
    max_action_dim: int = 32
    action_horizon: int = 50
    state_key: str | None = "observation.state"
    action_key: str = "action"
    norm_modes: dict[str, str] = field(
        default_factory=lambda: {"observation.state": "MEAN_STD", "action": "MEAN_STD"}
    )
    max_prompt_length: int = 48
    tokenizer_path: str | None = None
    uint8_images: bool = False
    resize_on_finalize: bool = False

    def __post_init__(self) -> None:
        # Hydra hands over DictConfig/ListConfig; plain containers keep state_dict() JSON-serialisable.
        self.camera_map = {str(k): str(v) for k, v in self.camera_map.items()}
        if self.model_cameras is not None:
            self.model_cameras = [str(c) for c in self.model_cameras]
        self.norm_modes = {str(k): str(v) for k, v in self.norm_modes.items()}

    def cameras(self) -> list[str]:
        cameras = (
            list(self.model_cameras) if self.model_cameras is not None else list(self.camera_map.values())
        )
        unknown = [name for name in self.camera_map.values() if name not in cameras]
        if unknown:
            raise ValueError(
                f"the camera map (data.camera_map) targets {unknown}, which are not cameras of the model "
                f"{cameras}. Map each dataset camera key to one of them, e.g. "
                f"'data.camera_map={{<dataset camera key>: {cameras[0]}}}'"
            )
        if len(set(self.camera_map.values())) != len(self.camera_map):
            raise ValueError(f"camera_map maps two dataset keys to one model camera: {self.camera_map}")
        return cameras


class BatchProcessor:
    """Collate function and inference-time pre/post-processing for one policy on one dataset.

    state_dim / action_dim: the dataset's real dims (<= the max dims). Build with `from_dataset`
    for training; rebuild at inference with `from_state_dict(saved)`.
    """

    def __init__(
        self,
        config: ProcessorConfig,
        normalizer: Normalizer,
        state_dim: int,
        action_dim: int,
        tokenizer: Any | None = None,
    ) -> None:
        self.config = config
        self.model_cameras = config.cameras()
        self.normalizer = normalizer
        self.state_dim = state_dim
        self.action_dim = action_dim
        if state_dim > config.max_state_dim:
            raise ValueError(
                f"state {config.state_key!r} has {state_dim} dims > max_state_dim={config.max_state_dim}; "
                "raise max_state_dim in the model config."
            )
        if action_dim > config.max_action_dim:
            raise ValueError(
                f"action {config.action_key!r} has {action_dim} dims > max_action_dim={config.max_action_dim}; "
                "raise max_action_dim in the model config."
            )
        self.prompts = PromptTokenizer(
            tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer_path),
            config.max_prompt_length,
        )

    @classmethod
    def from_dataset(
        cls, config: ProcessorConfig, meta: DatasetMetadata, tokenizer: Any | None = None
    ) -> BatchProcessor:
        """Validate the dataset against the config and build the normaliser from meta/stats.json."""
        validate_dataset(config, meta)
        modes = parse_modes(config.norm_modes)
        stats_keys = [k for k, m in modes.items() if m != NormMode.IDENTITY]
        meta.require_features(stats_keys, "ProcessorConfig.norm_modes")
        normalizer = Normalizer(
            meta.require_stats(stats_keys), modes, source=str(meta.root / "meta/stats.json")
        )
        # validate_dataset checked both are 1-D: shape [D] (LeRobot stores [1] as a scalar column).
        state_dim = int(meta.features[config.state_key]["shape"][0]) if config.state_key else 0
        action_dim = int(meta.features[config.action_key]["shape"][0])
        return cls(config, normalizer, state_dim, action_dim, tokenizer)

    def delta_timestamps(self, fps: float) -> dict[str, list[float]]:
        """The dataset's delta_timestamps for this policy: one action chunk of action_horizon frames."""
        return action_delta_timestamps(self.config.action_horizon, fps, self.config.action_key)

    # -- batches -------------------------------------------------------------------------------
    def observation(
        self, items: Sequence[Mapping[str, Any]], augment: ImageAugmenter | None = None
    ) -> Observation:
        """Observation of B items (dicts with the dataset keys and "task"; no action needed).

        Camera values may be (3, H, W) tensors as the reader returns them, or (H, W, 3) uint8 arrays
        as environments (e.g. synthetic.ReachWorld) return them. augment (training batches only):
        applied to each camera's stacked images before resizing; the items then carry
        AUGMENT_KEY = (epoch, index), which seeds each frame's draw (vla.data.augment).
        """
        config = self.config
        batch_size = len(items)
        size = config.image_size
        images: dict[str, Tensor] = {}
        masks: dict[str, Tensor] = {}
        for dataset_key, camera in config.camera_map.items():
            stacked = _stack(items, dataset_key, "a camera in ProcessorConfig.camera_map")
            if stacked.ndim == 4 and stacked.shape[1] != 3 and stacked.shape[-1] == 3:
                stacked = stacked.permute(0, 3, 1, 2)  # channel-last environment frames
            if stacked.ndim != 4 or stacked.shape[1] != 3:
                raise DatasetFormatError(
                    f"items[{dataset_key!r}] stack to {tuple(stacked.shape)}; expected (B, 3, H, W). Camera "
                    "keys must not have delta_timestamps windows."
                )
            if config.uint8_images and stacked.dtype != torch.uint8:
                stacked = stacked.mul(255.0).round_().clamp_(0, 255).to(torch.uint8)
            elif not config.uint8_images and stacked.dtype == torch.uint8:
                # Float output (inference: vla.eval.policy_runner): resize in float, as LeRobot and openpi
                # do, so raw uint8 frames give what their processors give (uint8 transport keeps uint8).
                stacked = stacked.to(torch.float32).div_(255.0)
            if augment is not None:
                stacked = augment.augment(stacked, camera, _augment_keys(items))
            if not config.resize_on_finalize:
                stacked = resize_with_pad(stacked, size)
            images[camera] = stacked if config.uint8_images else to_model_range(stacked)
            masks[camera] = torch.ones(batch_size, dtype=torch.bool)
        # A missing camera is black (-1 after scaling); 1x1 until finalize() when it resizes anyway.
        missing_size = 1 if config.resize_on_finalize else size
        for camera in self.model_cameras:
            if camera not in images:
                shape = (batch_size, 3, missing_size, missing_size)
                images[camera] = (
                    torch.zeros(shape, dtype=torch.uint8) if config.uint8_images else _minus_ones(shape)
                )
                masks[camera] = torch.zeros(batch_size, dtype=torch.bool)
        state = torch.zeros(batch_size, config.max_state_dim, dtype=torch.float32)
        if config.state_key:
            raw_state = _stack(items, config.state_key, "ProcessorConfig.state_key").to(torch.float32)
            if raw_state.ndim == 1 and self.state_dim == 1:  # a shape-(1,) feature reads as a scalar
                raw_state = raw_state.unsqueeze(-1)
            if raw_state.ndim != 2 or raw_state.shape[1] != self.state_dim:
                raise DatasetFormatError(
                    f"items[{config.state_key!r}] stack to {tuple(raw_state.shape)}; expected (B, {self.state_dim})."
                )
            state[:, : self.state_dim] = self.normalizer.normalize(config.state_key, raw_state)
        tasks = [str(item.get("task", "")) for item in items]
        prompt_ids, prompt_mask = self.prompts(tasks)
        return Observation(
            images={camera: images[camera] for camera in self.model_cameras},
            image_masks={camera: masks[camera] for camera in self.model_cameras},
            state=state,
            tokenized_prompt=prompt_ids,
            tokenized_prompt_mask=prompt_mask,
        )

    def collate(self, items: Sequence[Mapping[str, Any]], augment: ImageAugmenter | None = None) -> Batch:
        """DataLoader collate_fn: B items -> Batch (images uint8 when config.uint8_images); `augment`
        only for training batches (see `observation`)."""
        config = self.config
        observation = self.observation(items, augment)
        actions = _stack(items, config.action_key, "ProcessorConfig.action_key").to(torch.float32)
        if actions.ndim == 2 and self.action_dim == 1:  # a shape-(1,) feature reads as (T,) per item
            actions = actions.unsqueeze(-1)
        horizon = config.action_horizon
        if actions.ndim != 3 or actions.shape[1] != horizon or actions.shape[2] != self.action_dim:
            raise DatasetFormatError(
                f"items[{config.action_key!r}] stack to {tuple(actions.shape)}; expected (B, {horizon}, "
                f"{self.action_dim}). Build the dataset with delta_timestamps=processor.delta_timestamps(fps)."
            )
        batch_size = actions.shape[0]
        padded = torch.zeros(batch_size, horizon, config.max_action_dim, dtype=torch.float32)
        padded[:, :, : self.action_dim] = self.normalizer.normalize(config.action_key, actions)
        pad_key = f"{config.action_key}_is_pad"
        is_pad = (
            _stack(items, pad_key, "the action window").to(torch.bool)
            if pad_key in items[0]
            else torch.zeros(batch_size, horizon, dtype=torch.bool)
        )
        dim_mask = torch.zeros(batch_size, config.max_action_dim, dtype=torch.bool)
        dim_mask[:, : self.action_dim] = True
        meta: dict[str, object] = {k: _stack(items, k, "meta") for k in _META_KEYS if k in items[0]}
        meta["task"] = [str(item.get("task", "")) for item in items]
        return Batch(
            observation=observation, actions=padded, action_is_pad=is_pad, action_dim_mask=dim_mask, meta=meta
        )

    __call__ = collate

    def finalize(self, batch: Batch) -> Batch:
        """Transport images -> (B, 3, R, R) float32 in [-1, 1] on the batch's device (in place).

        Resizes images not yet at R (resize_on_finalize) and scales uint8 ones; final batches pass.
        """
        size = self.config.image_size
        images = batch.observation.images
        for camera, image in images.items():
            if image.shape[-2:] != (size, size):
                if image.dtype != torch.uint8:  # float transport holds [-1, 1]; pad must stay -1
                    image = (image + 1.0) / 2.0
                image = resize_with_pad(image, size)
                image = to_model_range(image)
            elif image.dtype == torch.uint8:
                image = to_model_range(image)
            images[camera] = image
        return batch

    def unnormalize_actions(self, actions: Tensor) -> Tensor:
        """(..., max_action_dim) normalised policy output -> (..., action_dim) in dataset units."""
        return self.normalizer.unnormalize(self.config.action_key, actions[..., : self.action_dim])

    # -- persistence (for inference) -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: config, dims and normalisation stats. The tokenizer is rebuilt from its path."""
        return {
            "config": asdict(self.config),
            "state_dim": self.state_dim,
            "action_dim": self.action_dim,
            "normalizer": self.normalizer.to_dict(),
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], tokenizer: Any | None = None) -> BatchProcessor:
        return cls(
            ProcessorConfig(**state["config"]),
            Normalizer.from_dict(state["normalizer"]),
            int(state["state_dim"]),
            int(state["action_dim"]),
            tokenizer,
        )


def validate_dataset(config: ProcessorConfig, meta: DatasetMetadata) -> None:
    """Every key the config names must exist with a usable dtype; errors list what the dataset has."""
    config.cameras()
    cameras = meta.camera_keys
    missing_cameras = [k for k in config.camera_map if k not in cameras]
    if missing_cameras:
        raise MissingFeatureError(
            f"the camera map (data.camera_map) expects camera(s) {missing_cameras}, but {meta.root} has cameras "
            f"{cameras} (all features: {sorted(meta.features)}). Map the dataset's camera keys to model "
            "cameras, e.g. camera_map={" + ", ".join(f"'{k}': '<model camera>'" for k in cameras) + "}."
        )
    keys = [config.action_key] + ([config.state_key] if config.state_key else [])
    for key, feature in zip(keys, meta.require_features(keys, "ProcessorConfig (state_key/action_key)")):
        if feature["dtype"] in ("image", "video", "string") or len(feature["shape"]) != 1:
            raise DatasetFormatError(
                f"{meta.root / 'meta/info.json'}: {key!r} has dtype {feature['dtype']} shape {feature['shape']}; "
                "state and action must be 1-D numeric features."
            )


def _stack(items: Sequence[Mapping[str, Any]], key: str, role: str) -> Tensor:
    try:
        return torch.stack([torch.as_tensor(item[key]) for item in items])
    except KeyError:
        present = sorted(items[0].keys()) if items else []
        raise MissingFeatureError(
            f"item has no {key!r} ({role}); item keys: {present}. Fix the processor config or the dataset."
        ) from None
    except RuntimeError as exc:
        raise DatasetFormatError(f"items[{key!r}] have different shapes across the batch: {exc}") from exc


def _augment_keys(items: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
    try:
        return [tuple(item[AUGMENT_KEY]) for item in items]  # type: ignore[misc]
    except KeyError:
        raise ValueError(
            f"augmentation needs every item's {AUGMENT_KEY!r} (epoch, index); load training items through "
            "BatchLoader(augment=...), which adds it"
        ) from None


def _minus_ones(shape: tuple[int, ...]) -> Tensor:
    return torch.full(shape, -1.0, dtype=torch.float32)
