"""Optimizer and learning-rate schedule from the `optim` and `trainer` config groups."""

from __future__ import annotations

import math

import torch
from torch import nn

import dmuon
from vla.training.config import OptimConfig, TrainerConfig


def routing_rules(cfg: OptimConfig) -> list[dict]:
    """User rules first (first match wins), then the policies' input/output maps to AdamW."""
    return [
        *[dict(rule) for rule in cfg.routing_rules],
        {"pattern": cfg.adamw_patterns, "algorithm": "adamw"},
    ]


def build_optimizer(cfg: OptimConfig, policy: nn.Module) -> torch.optim.Optimizer:
    """AdamW, the naive Muon baseline, or dmuon, over the policy's trainable parameters."""
    if cfg.name == "adamw":
        params = [p for p in policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    groups = dmuon.param_groups(policy, routing_rules(cfg))
    naive = cfg.name == "muon"
    return dmuon.Muon(
        groups,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        adjust_lr=cfg.adjust_lr,
        ns_algorithm=cfg.ns_algorithm,
        ns_coefficients=cfg.ns_coefficients,
        ns_steps=cfg.ns_steps,
        adamw_lr=cfg.adamw_lr,
        adamw_betas=tuple(cfg.betas),
        adamw_eps=cfg.eps,
        adamw_weight_decay=cfg.adamw_weight_decay,
        distribution="naive" if naive else "owner",
        planner=cfg.planner,
        cost_model=cfg.cost_model,
        bucket_mb=cfg.bucket_mb,
        overlap=cfg.overlap,
        split=cfg.split,
        exchange=cfg.exchange,
        hsdp_replicas=cfg.hsdp_replicas,
        wire_dtype=cfg.wire_dtype,
        wire_scope=cfg.wire_scope,
    )


WARMUP_FRACTION_WHEN_CLAMPED = 0.1


def effective_warmup(cfg: TrainerConfig) -> tuple[int, str | None]:
    """Warmup steps the schedule uses, and a note when trainer.warmup_steps had to be shortened.

    A warmup as long as the run (trainer.warmup_steps >= trainer.steps, e.g. `trainer.steps=6` with the
    default 10) would never reach the peak lr: it becomes 10% of the run instead.
    """
    horizon = schedule_horizon(cfg)
    if cfg.warmup_steps < horizon:
        return cfg.warmup_steps, None
    warmup = int(horizon * WARMUP_FRACTION_WHEN_CLAMPED)
    return warmup, (
        f"trainer.warmup_steps={cfg.warmup_steps} is not shorter than the schedule ({horizon} steps): warming up "
        f"for {warmup} step(s) ({WARMUP_FRACTION_WHEN_CLAMPED:.0%} of the run) instead; set "
        "trainer.warmup_steps below trainer.steps to choose"
    )


def schedule_horizon(cfg: TrainerConfig, step: int | None = None) -> int:
    """Steps the lr schedule spans (at `step`): the first of trainer.lengthen_schedule_at above `step`,
    else trainer.schedule_steps, else the run's trainer.steps."""
    if step is not None:
        for stage in cfg.lengthen_schedule_at:
            if step < stage:
                return stage
    return cfg.schedule_steps if cfg.schedule_steps is not None else cfg.steps


def lr_multiplier(step: int, cfg: TrainerConfig) -> float:
    """Linear warmup to 1, then cosine / linear decay to min_lr_ratio at the last step (or constant); at each
    step of trainer.lengthen_schedule_at the decay is stretched to end at the next one (a warm restart)."""
    warmup, _ = effective_warmup(cfg)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, schedule_horizon(cfg, step) - warmup - 1))
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Scales every group's lr (Muon's and AdamW's alike) by `lr_multiplier`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))


def apply_schedule_at(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set every group's lr to what the live schedule gives at the scheduler's current step.

    A restored optimizer carries the lrs of the schedule it was saved under; when the run resumes under
    a reshaped schedule (a longer trainer.steps moves where the decay ends), the next step must already
    train at the new schedule's lr, not at the old one's (LambdaLR only rewrites lrs in `step()`, after
    the first resumed optimizer step).
    """
    step = scheduler.last_epoch
    for group, base, multiplier in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * multiplier(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
