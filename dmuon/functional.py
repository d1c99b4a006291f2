"""The math of one optimizer step, as plain functions on plain tensors.

`dmuon.Muon` (single process and every distributed layout) calls exactly these functions, so the
distributed result is the single-process result: elementwise phases run on whatever rows a rank
holds, and orthogonalisation sees whole matrices (or, split over ranks, forms the same products
out of column chunks with exact collectives: dmuon.split_ns).

Muon, per matrix W (m x n) with gradient g and momentum buffer buf:

    buf <- mu * buf + g                       (first step: buf = g)
    u   <- g + mu * buf   (Nesterov)  or  buf
    O   <- NS(u)                              (Newton-Schulz on the (shape[0], -1) view)
    W   <- W * (1 - lr * wd) - lr * scale(m, n) * O

torch.optim.Muon keeps buf as an exponential average (lerp); that buffer is (1 - mu) times ours and
NS normalises the scale away, so both give the same update.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.adam import adam

from dmuon.newton_schulz import DEFAULT_EPS, choose_algorithm, coefficient_schedule, newton_schulz

ADJUST_LR_CHOICES = ("original", "match_rms_adamw", "spectral", None)


@dataclass(frozen=True)
class NSConfig:
    """Newton-Schulz settings of a param group; hashable, so it keys batches of same-config matrices."""

    steps: int = 5
    coefficients: tuple[tuple[float, float, float], ...] = ()
    algorithm: str = "auto"
    dtype: torch.dtype = torch.float32
    eps: float = DEFAULT_EPS

    @staticmethod
    def from_group(group: dict) -> NSConfig:
        steps = group["ns_steps"]
        return NSConfig(
            steps=steps,
            coefficients=tuple(coefficient_schedule(group["ns_coefficients"], steps)),
            algorithm=group["ns_algorithm"],
            dtype=group["ns_dtype"],
            eps=group["ns_eps"],
        )

    def algorithm_for(self, shape: Sequence[int]) -> str:
        """The concrete algorithm ('standard' or 'gram') for a matrix of this shape."""
        return choose_algorithm(shape, self.steps) if self.algorithm == "auto" else self.algorithm


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D view Muon orthogonalises: (shape[0], prod(shape[1:]))."""
    if len(shape) < 2:
        raise ValueError(f"Muon needs a parameter with ndim >= 2, got shape {tuple(shape)}")
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def update_scale(shape: Sequence[int], adjust_lr: str | None) -> float:
    """Multiplier of lr for a matrix of `shape` (ndim > 2 viewed as (shape[0], -1)).

    "original": sqrt(max(1, m/n)) (Keller Jordan); "match_rms_adamw": 0.2 sqrt(max(m, n)) (Moonlight:
    gives Muon's update AdamW's RMS, so AdamW's lr and wd carry over); "spectral": sqrt(m/n) (Dion);
    None: 1.
    """
    m, n = matrix_shape(shape)
    if adjust_lr == "original":
        return math.sqrt(max(1.0, m / n))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr == "spectral":
        return math.sqrt(m / n)
    if adjust_lr is None:
        return 1.0
    raise ValueError(f"unknown adjust_lr {adjust_lr!r}: use one of {ADJUST_LR_CHOICES}")


def muon_momentum_(
    bufs: list[Tensor], grads: list[Tensor], *, momentum: float, nesterov: bool
) -> list[Tensor]:
    """Update momentum buffers in place and return the tensors to orthogonalise.

    Elementwise, so it runs on local shards as well as on whole tensors with identical results.
    Without Nesterov the returned tensors are the buffers themselves: read them, never modify them.
    """
    if not bufs:
        return []
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    if nesterov:
        return list(torch._foreach_add(grads, bufs, alpha=momentum))
    return list(bufs)


def apply_muon_update_(
    params: list[Tensor], updates: list[Tensor], *, lr: float, weight_decay: float, scales: list[float]
) -> None:
    """W <- W (1 - lr wd) - lr scale O, in place; `updates[i]` has the (local) shape of `params[i]`."""
    if not params:
        return
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    for p, o, s in zip(params, updates, scales, strict=True):
        p.add_(o.view_as(p), alpha=-lr * s)


def orthogonalize_batch(matrices: Tensor, ns: NSConfig) -> Tensor:
    """NS on a (B, m, n) stack of same-shape matrices, in `ns.dtype`, returned in the input dtype."""
    return newton_schulz(
        matrices,
        steps=ns.steps,
        coefficients=ns.coefficients,
        algorithm=ns.algorithm_for(matrices.shape[-2:]),
        dtype=ns.dtype,
        eps=ns.eps,
    )


def orthogonalize(matrices: list[Tensor], ns: NSConfig, *, max_batch_bytes: int = 1 << 28) -> list[Tensor]:
    """Orthogonalise 2-D matrices, batching same-shape ones into one (B, m, n) call.

    Batches are capped at `max_batch_bytes` of stacked input so a model with many large same-shape
    matrices does not double its memory at once. Order of the result follows the input.
    """
    out: list[Tensor | None] = [None] * len(matrices)
    by_shape: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, mat in enumerate(matrices):
        if mat.ndim != 2:
            raise ValueError(f"orthogonalize expects 2-D matrices, got shape {tuple(mat.shape)} at {i}")
        by_shape[(*mat.shape, mat.dtype)].append(i)  # type: ignore[arg-type]
    for indices in by_shape.values():
        per_matrix = matrices[indices[0]].numel() * max(matrices[indices[0]].element_size(), 4)
        chunk = max(1, max_batch_bytes // max(per_matrix, 1))
        for start in range(0, len(indices), chunk):
            part = indices[start : start + chunk]
            result = orthogonalize_batch(torch.stack([matrices[i] for i in part]), ns)
            for j, i in enumerate(part):
                out[i] = result[j]
    return out  # type: ignore[return-value]


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    foreach: bool | None,
    fused: bool | None,
) -> None:
    """torch's own AdamW kernels (fused / foreach / single-tensor), so results equal torch.optim.AdamW."""
    if not params:
        return
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        state_steps,
        foreach=foreach,
        fused=fused,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
