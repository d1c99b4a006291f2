"""Exponential moving average of the trainable parameters, shard by shard.

Shadow tensors are created like the parameters (DTensors under FSDP2), so the EMA is sharded the
same way, updates touch only local rows, and DCP saves and reshards it like any other state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from dmuon.layout import local_tensor as _local


class EMA:
    """shadow <- decay * shadow + (1 - decay) * param after every optimizer step."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        self.shadow = {n: params[n].detach().clone() for n in self.names}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        shadow = [_local(self.shadow[n]) for n in self.names]
        live = [_local(params[n].detach()) for n in self.names]
        torch._foreach_lerp_(shadow, live, 1.0 - self.decay)

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing = sorted(set(self.names) - set(state))
        if missing:
            raise KeyError(f"EMA state lacks {len(missing)} parameters, e.g. {missing[:3]}")
        with torch.no_grad():
            for n in self.names:
                _local(self.shadow[n]).copy_(_local(state[n]))

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """Temporarily swap the EMA weights into `model` (for validation or export)."""
        params = dict(model.named_parameters())
        backup = {n: _local(params[n].detach()).clone() for n in self.names}
        with torch.no_grad():
            for n in self.names:
                _local(params[n].detach()).copy_(_local(self.shadow[n]))
        try:
            yield
        finally:
            with torch.no_grad():
                for n in self.names:
                    _local(params[n].detach()).copy_(backup[n])
