"""Batch types shared by the data pipeline and the policies.

This module is the only coupling point between `vla.data` (which produces batches) and
`vla.models` (which consumes them): neither imports the other. Shapes use
B = batch, H = action horizon, A = padded action dim, S = padded state dim, L = prompt length,
C = 3 channels, R = model image resolution.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


@dataclass
class Observation:
    """What a policy sees at one time step.

    images:        camera name -> (B, C, R, R) float32 in [-1, 1] (resized with padding).
    image_masks:   camera name -> (B,) bool; False where the camera is missing (image is then -1).
    state:         (B, S) float32, normalised, zero-padded to the model's max state dim.
    tokenized_prompt:      (B, L) int64 token ids of the task prompt, right-padded.
    tokenized_prompt_mask: (B, L) bool, True on real tokens.
    """

    images: dict[str, Tensor]
    image_masks: dict[str, Tensor]
    state: Tensor
    tokenized_prompt: Tensor
    tokenized_prompt_mask: Tensor

    @property
    def batch_size(self) -> int:
        return int(self.state.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Observation:
        return Observation(
            images={k: v.to(device, non_blocking=non_blocking) for k, v in self.images.items()},
            image_masks={k: v.to(device, non_blocking=non_blocking) for k, v in self.image_masks.items()},
            state=self.state.to(device, non_blocking=non_blocking),
            tokenized_prompt=self.tokenized_prompt.to(device, non_blocking=non_blocking),
            tokenized_prompt_mask=self.tokenized_prompt_mask.to(device, non_blocking=non_blocking),
        )


@dataclass
class Batch:
    """One training batch: an observation and the action chunk that followed it.

    actions:         (B, H, A) float32, normalised, zero-padded to the model's max action dim.
    action_is_pad:   (B, H) bool, True where the chunk ran past the episode end (no loss there).
    action_dim_mask: (B, A) bool, True on the dataset's real action dims (loss only there).
    meta:            free-form per-batch extras (episode_index, index, task strings, ...);
                     never read by the models.
    """

    observation: Observation
    actions: Tensor
    action_is_pad: Tensor
    action_dim_mask: Tensor
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.actions.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        meta = {
            k: v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v
            for k, v in self.meta.items()
        }
        return replace(
            self,
            observation=self.observation.to(device, non_blocking=non_blocking),
            actions=self.actions.to(device, non_blocking=non_blocking),
            action_is_pad=self.action_is_pad.to(device, non_blocking=non_blocking),
            action_dim_mask=self.action_dim_mask.to(device, non_blocking=non_blocking),
            meta=meta,
        )
