"""The contract every policy meets, and the input checks that turn bad batches into clear errors.

A policy is an nn.Module that consumes `vla.types.Batch` / `Observation` (shapes documented there) with
the layout its config fixes: the configured cameras at image_size, state padded to max_state_dim,
actions (B, action_horizon, max_action_dim).
"""

from __future__ import annotations

from typing import NoReturn, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from vla.models.config import PolicyConfig
from vla.types import Batch, Observation


@runtime_checkable
class Policy(Protocol):
    """What the trainer and evaluators may rely on."""

    config: PolicyConfig

    def compute_loss(
        self, batch: Batch, *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Scalar training loss and detached scalar metrics (always including "loss")."""
        ...

    def sample_actions(
        self, observation: Observation | Batch, *, noise: Tensor | None = None, num_steps: int | None = None
    ) -> Tensor:
        """(B, action_horizon, max_action_dim) actions in the normalised space of the training data."""
        ...

    def forward(
        self, batch: Batch, *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Same as compute_loss; lets DDP / FSDP2 wrappers see the training call."""
        ...

    def shard_units(self) -> list[nn.Module]:
        """Submodules to wrap one by one with FSDP2 (decoder layer pairs / layers, vision encoder layers)."""
        ...

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each shard unit's activations in backward instead of storing them."""
        ...


def as_observation(observation: Observation | Batch) -> Observation:
    if isinstance(observation, Batch):
        return observation.observation
    if isinstance(observation, Observation):
        return observation
    raise TypeError(f"expected a vla.types.Observation or Batch, got {type(observation).__name__}")


def _fail(where: str, problem: str, fix: str) -> NoReturn:
    raise ValueError(f"{where}: {problem}. {fix}")


def _check_shape(where: str, tensor: object, expected: tuple[int | str, ...], fix: str) -> None:
    if not isinstance(tensor, Tensor):
        _fail(where, f"expected a tensor of shape {expected}, got {type(tensor).__name__}", fix)
    ok = tensor.ndim == len(expected) and all(
        isinstance(e, str) or tensor.shape[i] == e for i, e in enumerate(expected)
    )
    if not ok:
        _fail(where, f"expected shape {expected}, got {tuple(tensor.shape)}", fix)


def check_observation(observation: Observation, config: PolicyConfig, *, text_token_limit: int) -> None:
    """Raise ValueError naming the field, the expected shape and the fix when `observation` does not fit.

    text_token_limit: real prompt ids must be below it (vocab_size, or the first action-bin id).
    """
    batch = observation.batch_size
    size = config.vision.image_size
    image_shape = (batch, 3, size, size)
    cameras = set(config.cameras)
    for name, mapping in (("images", observation.images), ("image_masks", observation.image_masks)):
        missing = [c for c in config.cameras if c not in mapping]
        extra = sorted(set(mapping) - cameras)
        fix = (
            f"The policy expects cameras {config.cameras}: map the dataset's camera names onto them, or set "
            "`cameras` in the policy config (missing cameras still need an all -1 image with mask False)"
        )
        if missing:
            _fail(f"observation.{name}", f"missing camera(s) {missing}", fix)
        if extra:
            _fail(f"observation.{name}", f"unexpected camera(s) {extra}", fix)
    for camera in config.cameras:
        image = observation.images[camera]
        _check_shape(
            f"observation.images[{camera!r}]",
            image,
            image_shape,
            f"Images must be (B, 3, {size}, {size}) float in [-1, 1] "
            f"(resize with padding to image_size={size})",
        )
        if not image.is_floating_point():
            _fail(
                f"observation.images[{camera!r}]",
                f"dtype {image.dtype} is not floating point",
                "Scale to [-1, 1]",
            )
        mask = observation.image_masks[camera]
        _check_shape(f"observation.image_masks[{camera!r}]", mask, (batch,), "One bool per sample")
    _check_shape(
        "observation.state",
        observation.state,
        (batch, config.max_state_dim),
        f"Pad the normalised state with zeros to max_state_dim={config.max_state_dim}",
    )
    if not observation.state.is_floating_point():
        _fail("observation.state", f"dtype {observation.state.dtype} is not floating point", "Use float32")
    tokens, token_mask = observation.tokenized_prompt, observation.tokenized_prompt_mask
    _check_shape("observation.tokenized_prompt", tokens, (batch, "L"), "Token ids (B, L) int64, right-padded")
    _check_shape(
        "observation.tokenized_prompt_mask",
        token_mask,
        (batch, tokens.shape[1]),
        "Same shape as tokenized_prompt",
    )
    if tokens.dtype not in (torch.int64, torch.int32):
        _fail("observation.tokenized_prompt", f"dtype {tokens.dtype} is not an integer type", "Use int64 ids")
    if tokens.numel():
        out_of_vocab = (tokens < 0) | (tokens >= config.vocab_size)
        collides = token_mask.bool() & (tokens >= text_token_limit)
        if bool((out_of_vocab | collides).any()):
            worst = int(tokens.max())
            _fail(
                "observation.tokenized_prompt",
                f"token ids must lie in [0, {config.vocab_size}) and real ones below {text_token_limit} "
                f"(got min {int(tokens.min())}, max {worst})",
                "Use a tokenizer whose ids fit the policy's vocab_size (ids from the action-bin range are "
                "reserved for actions)",
            )


def check_batch(batch: Batch, config: PolicyConfig, *, text_token_limit: int) -> None:
    """check_observation plus the action fields: (B, H, A) actions, (B, H) pad flags, (B, A) dim mask."""
    if not isinstance(batch, Batch):
        raise TypeError(f"compute_loss expects a vla.types.Batch, got {type(batch).__name__}")
    check_observation(batch.observation, config, text_token_limit=text_token_limit)
    b, h, a = batch.observation.batch_size, config.action_horizon, config.max_action_dim
    _check_shape(
        "batch.actions",
        batch.actions,
        (b, h, a),
        f"Actions must be (B, action_horizon={h}, max_action_dim={a}), normalised and zero-padded",
    )
    if not batch.actions.is_floating_point():
        _fail("batch.actions", f"dtype {batch.actions.dtype} is not floating point", "Use float32 actions")
    _check_shape(
        "batch.action_is_pad", batch.action_is_pad, (b, h), "One bool per step, True past episode end"
    )
    _check_shape(
        "batch.action_dim_mask", batch.action_dim_mask, (b, a), "One bool per padded dim, True on real dims"
    )
