"""Exponential moving average of the trainable parameters, shard by shard.

Shadow tensors are created like the parameters (DTensors under FSDP2), so the EMA is sharded the
same way, updates touch only local rows, and DCP saves and reshards it like any other state.

Warm-up: the n-th update (n = optimizer steps taken before it) uses min(decay, (1 + n) / (10 + n)), the
rule of TensorFlow's ExponentialMovingAverage(num_updates) and diffusers' EMAModel. A fixed decay of
0.999 would leave the random initial weights at 0.999^n of the average: 37% after 1000 steps, 13.5%
after 2000. With the warm-up they weigh 0.1 after the first update and under 1e-10 after 50, and the
average spans about the last n / 9 steps until n reaches about 9 / (1 - decay). The rule depends on
n alone, which the trainer restores on resume, so resumed runs stay bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from dmuon.layout import local_tensor as _local


class EMA:
    """shadow <- d * shadow + (1 - d) * param after every optimizer step, d = `decay_at(step)`."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        self.shadow = {n: params[n].detach().clone() for n in self.names}

    def decay_at(self, step: int) -> float:
        """The decay of the update after `step` optimizer steps: min(decay, (1 + step) / (10 + step))."""
        if step < 0:
            raise ValueError(f"EMA step must be >= 0, got {step}")
        return min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Fold the current parameters in; `step` = optimizer steps taken before the one just made."""
        params = dict(model.named_parameters())
        shadow = [_local(self.shadow[n]) for n in self.names]
        live = [_local(params[n].detach()) for n in self.names]
        torch._foreach_lerp_(shadow, live, 1.0 - self.decay_at(step))

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
