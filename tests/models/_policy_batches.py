"""Random batches shaped for a policy config (test helper)."""

from __future__ import annotations

import torch

from vla.models.config import PolicyConfig
from vla.types import Batch, Observation


def make_batch(
    config: PolicyConfig,
    batch_size: int = 2,
    *,
    prompt_len: int = 6,
    real_action_dims: int = 3,
    real_state_dims: int = 4,
    missing_camera: str | None = None,
    padded_steps: int = 0,
    prompt_lengths: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> Batch:
    """A Batch with random images in [-1, 1], right-padded prompts and zero-padded state/actions.

    missing_camera: that camera gets an all -1 image and mask False in every sample.
    padded_steps: the last `padded_steps` steps of sample 0 are flagged as past the episode end.
    prompt_lengths: real prompt tokens per sample (default: all prompt_len).
    """
    g = generator or torch.Generator().manual_seed(1234)
    size = config.vision.image_size
    images, masks = {}, {}
    for camera in config.cameras:
        images[camera] = torch.rand(batch_size, 3, size, size, generator=g) * 2 - 1
        masks[camera] = torch.ones(batch_size, dtype=torch.bool)
        if camera == missing_camera:
            images[camera] = torch.full_like(images[camera], -1.0)
            masks[camera] = torch.zeros(batch_size, dtype=torch.bool)
    lengths = prompt_lengths or [prompt_len] * batch_size
    prompt = torch.randint(1, 200, (batch_size, prompt_len), generator=g)
    prompt_mask = torch.arange(prompt_len)[None, :] < torch.tensor(lengths)[:, None]
    prompt = prompt.masked_fill(~prompt_mask, 0)
    state = torch.zeros(batch_size, config.max_state_dim)
    state[:, :real_state_dims] = torch.randn(batch_size, real_state_dims, generator=g)
    horizon, action_dim = config.action_horizon, config.max_action_dim
    actions = torch.zeros(batch_size, horizon, action_dim)
    actions[:, :, :real_action_dims] = (
        torch.rand(batch_size, horizon, real_action_dims, generator=g) * 1.8 - 0.9
    )
    action_is_pad = torch.zeros(batch_size, horizon, dtype=torch.bool)
    if padded_steps:
        action_is_pad[0, horizon - padded_steps :] = True
    action_dim_mask = torch.zeros(batch_size, action_dim, dtype=torch.bool)
    action_dim_mask[:, :real_action_dims] = True
    observation = Observation(
        images=images,
        image_masks=masks,
        state=state,
        tokenized_prompt=prompt,
        tokenized_prompt_mask=prompt_mask,
    )
    return Batch(
        observation=observation, actions=actions, action_is_pad=action_is_pad, action_dim_mask=action_dim_mask
    )
