"""The state a checkpoint carries besides files: DCP state dicts of model and optimizer, and RNG states."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.optim import Optimizer


def _unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    # Wrappers such as Accelerate's AcceleratedOptimizer keep the real optimizer in `.optimizer`; the
    # state_dict helpers run a zero-lr step on a fresh optimizer, which must not go through the wrapper's
    # gradient-accumulation gating.
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, Optimizer):
        optimizer = inner
        inner = getattr(optimizer, "optimizer", None)
    return optimizer


# ---------------------------------------------------------------------------------------------------------
# RNG state


def _capture_rng() -> dict[str, Any]:
    """This process's global RNG states, in types that `torch.load(weights_only=True)` accepts."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": (version, internal, gauss),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    # Querying CUDA RNGs would initialise CUDA on every device; a run that never touched CUDA has none.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda_states = state["cuda"]
    if cuda_states and torch.cuda.is_available():
        for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


# ---------------------------------------------------------------------------------------------------------
# Model / optimizer state


def _check_optimizer_matches(model: nn.Module, optimizer: Optimizer) -> None:
    # get_state_dict maps optimizer params to names through the model; a stray param fails deep inside
    # it with a bare KeyError, and silently saves nothing if the stray params never got gradients.
    owned = {id(p) for p in model.parameters()}
    stray = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in owned)
    if stray:
        raise ValueError(
            f"{stray} parameter(s) of the {type(optimizer).__name__} are not parameters of the "
            f"{type(model).__name__}: the optimizer was probably built before fully_shard replaced the "
            "parameters with sharded ones. Build the optimizer after wrapping the model."
        )


def _state_for(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """The DCP state dict {"model": ..., "optim": ...} (sharded as the live model is)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}
