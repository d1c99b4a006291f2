"""Flow-matching pieces of pi0: time sampling, sinusoidal time embedding, the Euler integrator.

Convention (openpi): t = 1 is pure noise and t = 0 the clean action chunk. A training sample is
x_t = t * noise + (1 - t) * actions, and the model regresses the velocity u = noise - actions = dx_t/dt.
Sampling integrates dx/dt = v(x, t) from t = 1 down to t = 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def sample_flow_time(
    batch_size: int, *, alpha: float, beta: float, time_min: float, device: torch.device | str
) -> Tensor:
    """Training times (B,) float32: Beta(alpha, beta) * (1 - time_min) + time_min.

    With pi0's Beta(1.5, 1) the mass leans towards t = 1 (noisier inputs); time_min keeps t away from 0,
    where the target velocity stops depending on the noise.
    """
    distribution = torch.distributions.Beta(
        torch.tensor(alpha, dtype=torch.float32, device=device),
        torch.tensor(beta, dtype=torch.float32, device=device),
    )
    return distribution.sample((batch_size,)) * (1.0 - time_min) + time_min


def sinusoidal_time_embedding(time: Tensor, dim: int, *, min_period: float, max_period: float) -> Tensor:
    """(B,) times -> (B, dim) float32 [sin | cos] features with periods spaced geometrically in [min, max].

    Computed in float64 (float32 on MPS, which has no float64) with openpi's / LeRobot's exact expression,
    then rounded to float32 once: the short periods at t near 1 need more than float32's resolution.
    """
    if dim % 2 != 0:
        raise ValueError(f"sinusoidal_time_embedding needs an even dim, got {dim}")
    if time.ndim != 1:
        raise ValueError(f"time must be (B,), got shape {tuple(time.shape)}")
    dtype = torch.float32 if time.device.type == "mps" else torch.float64
    with torch.autocast(device_type=time.device.type, enabled=False):
        fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=dtype, device=time.device)
        period = min_period * (max_period / min_period) ** fraction
        scaling_factor = 1.0 / period * 2 * math.pi
        angles = scaling_factor[None, :] * time[:, None].to(dtype)
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).to(torch.float32)


VelocityFn = Callable[[Tensor, Tensor], Tensor]


def euler_integrate(
    velocity: VelocityFn, x_start: Tensor, num_steps: int, *, t_start: float = 1.0, t_end: float = 0.0
) -> Tensor:
    """Integrate dx/dt = velocity(x, t) with `num_steps` explicit Euler steps from t_start to t_end.

    Args:
        velocity: (x (B, ...), t (B,)) -> dx/dt shaped like x.
        x_start: state at t_start, e.g. noise (B, H, A).
        num_steps: number of equal steps, >= 1.

    Returns:
        state at t_end, shaped like x_start. Step k evaluates the velocity at t_k = t_start + k * dt.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    dt = (t_end - t_start) / num_steps
    x = x_start
    batch = x_start.shape[0]
    for step in range(num_steps):
        t = torch.full((batch,), t_start + step * dt, dtype=torch.float32, device=x_start.device)
        x = x + dt * velocity(x, t)
    return x
