"""Closed-loop MetaWorld evaluation inside a training run (trainer.closed_loop), split over the ranks.

Every rank takes an unsharded copy of the policy (under FSDP2 the full weights are gathered once; the
EMA weights when EMA is on) and plays its share of the episodes (episode e goes to rank e % W) with no
collective inside the loop, so ranks never wait on each other mid-episode; the per-episode results are
then gathered and every rank builds the same report.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vla.training.config import TrainConfig


def local_policy_copy(model: nn.Module, sharded: bool) -> nn.Module:
    """A plain (unsharded, unwrapped) policy with `model`'s current weights. Collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from vla.models import build_policy

    inner = getattr(model, "module", model)
    if not sharded:
        return copy.deepcopy(inner).eval()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    with torch.device("cpu"):
        policy = build_policy(inner.config)
    policy.load_state_dict({k: v.detach().cpu() for k, v in full.items()})
    return policy.eval()


def check_closed_loop_seeds(cfg: TrainConfig) -> None:
    """Refuse evaluation seeds that overlap the recorded demonstrations' seeds (ValueError naming the key).

    Covers every closed-loop evaluation of the run (trainer.closed_loop.episodes and final_episodes), so
    the trainer calls it once the dataset exists, before the first step, not when the first evaluation
    comes round minutes into training. A no-op unless the run evaluates MetaWorld policies.
    """
    settings_cfg = cfg.trainer.closed_loop
    if cfg.data.source != "metaworld" or settings_cfg.episodes == 0:
        return
    from vla.sim import parse_tasks
    from vla.sim.demos import training_seeds

    count = max(settings_cfg.episodes, settings_cfg.final_episodes or 0)
    seeds = set(range(settings_cfg.seed, settings_cfg.seed + count))
    trained = training_seeds(cfg.data.root)
    for task in parse_tasks(list(settings_cfg.tasks or cfg.data.metaworld.tasks)):
        overlap = sorted(seeds & trained.get(task, set()))
        if overlap:
            raise ValueError(
                f"trainer.closed_loop.seed={settings_cfg.seed}: seeds {overlap[:5]} of {task} are training "
                f"demonstrations (data.root {cfg.data.root}); set trainer.closed_loop.seed >= "
                f"{max(trained[task]) + 1}"
            )


def closed_loop_evaluation(
    cfg: TrainConfig,
    model: nn.Module,
    processor: Any,
    sharded: bool,
    video_dir: Path | None,
    episodes: int | None = None,
) -> dict[str, Any] | None:
    """Success per task for the run's MetaWorld tasks, or None when not evaluating (see module doc).

    episodes: per task (default trainer.closed_loop.episodes), on seeds closed_loop.seed, seed + 1, ...
    """
    settings_cfg = cfg.trainer.closed_loop
    if cfg.data.source != "metaworld" or settings_cfg.episodes == 0:
        return None
    from vla.eval.closed_loop import (
        ClosedLoopReport,
        ClosedLoopSettings,
        run_episodes,
        task_report,
        write_rollouts,
    )
    from vla.eval.policy_runner import PolicyActor
    from vla.sim import parse_tasks

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    recorded = cfg.data.metaworld
    tasks = parse_tasks(list(settings_cfg.tasks or recorded.tasks))
    settings = ClosedLoopSettings(
        cameras=tuple(recorded.cameras),
        resolution=recorded.resolution,
        max_episode_steps=settings_cfg.max_episode_steps,
        replan_every=settings_cfg.replan_every,
        parallel_envs=settings_cfg.parallel_envs,
    )
    count = settings_cfg.episodes if episodes is None else episodes
    seeds = list(range(settings_cfg.seed, settings_cfg.seed + count))
    check_closed_loop_seeds(cfg)
    policy = local_policy_copy(model, sharded)
    actor = PolicyActor(policy, processor, name=cfg.run_name, seed=settings_cfg.seed)
    mine = seeds[rank::world]
    local: dict[str, list[Any]] = {}
    for task in tasks:
        record = settings_cfg.videos if rank == 0 and video_dir is not None else 0
        results, clips = run_episodes(actor, task, mine, settings, record=record)
        local[task] = results
        if clips:
            write_rollouts(video_dir, task, results, clips)  # type: ignore[arg-type]
    gathered = [local]
    if world > 1:
        gathered = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
    reports = []
    for task in tasks:
        results = sorted((r for part in gathered for r in part[task]), key=lambda r: r.seed)
        reports.append(task_report(task, results))
    report = ClosedLoopReport(policy=cfg.run_name, seed=settings_cfg.seed, settings=settings, tasks=reports)
    return report.to_dict() | {"scalars": report.scalars()}
