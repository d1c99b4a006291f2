"""Shared pieces of the checkpoint tests: pi0_tiny training on a fixed global batch, and per-rank bodies.

Every step's global batch, flow noise and flow time come from a generator seeded by the step, and each
rank takes an equal slice, so W ranks (FSDP2 averages gradients) follow the single-process trajectory.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _policy_batches import make_batch
from torch import nn

import dmuon
from vla.models import build_policy
from vla.training.checkpoint import CheckpointError, CheckpointManager
from vla.training.export import export_policy
from vla.types import Batch

GLOBAL_BATCH = 4
N_STEPS = 3  # before the save
M_STEPS = 2  # after it
OPTIMIZERS = ("muon", "adamw")


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def build(
    optimizer_kind: str, seed: int = 0, mesh: Any = None
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """pi0_tiny (weights from `seed`; FSDP2-sharded over `mesh` if given), its optimizer, a LambdaLR."""
    torch.manual_seed(seed)
    policy = build_policy("pi0_tiny")
    if mesh is not None:
        shard(policy, mesh)  # before the optimizer: fully_shard replaces the parameters
    if optimizer_kind == "muon":
        opt: torch.optim.Optimizer = dmuon.Muon(
            dmuon.param_groups(policy), lr=0.02, adamw_lr=1e-3, weight_decay=0.01, ns_algorithm="standard"
        )
    elif optimizer_kind == "adamw":
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        raise ValueError(optimizer_kind)
    return policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def shard(policy: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for unit in policy.shard_units():
        fully_shard(unit, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    # FSDP2 gathers the root's own params in forward; sample_actions needs the same hook.
    register_fsdp_forward_method(policy, "sample_actions")
    return policy


def _slice(value: Any, lo: int, hi: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[lo:hi]
    if isinstance(value, dict):
        return {k: _slice(v, lo, hi) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(
            value, **{f.name: _slice(getattr(value, f.name), lo, hi) for f in dataclasses.fields(value)}
        )
    return value


def step_inputs(
    config: Any, step: int, rank: int = 0, world: int = 1
) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """This rank's slice of step `step`'s global batch, flow noise and flow time."""
    gen = torch.Generator().manual_seed(1000 + step)
    batch = make_batch(config, GLOBAL_BATCH, generator=gen)
    noise = torch.randn(batch.actions.shape, generator=gen)
    time = torch.rand(GLOBAL_BATCH, generator=gen) * 0.9 + 0.05
    per = GLOBAL_BATCH // world
    lo, hi = rank * per, (rank + 1) * per
    return _slice(batch, lo, hi), noise[lo:hi], time[lo:hi]


def train(
    policy: nn.Module,
    opt: torch.optim.Optimizer,
    scheduler: Any,
    steps: range,
    rank: int = 0,
    world: int = 1,
    *,
    global_rng: bool = False,
) -> list[float]:
    """Train on the fixed global batches; returns the lr used at each step.

    global_rng: draw the flow noise and time from the global torch RNG, as a real run does, instead of
    from the step's generator (then the trajectory depends on the RNG state a resume restores).
    """
    lrs = []
    for step in steps:
        batch, noise, time = step_inputs(policy.config, step, rank, world)
        if global_rng:
            noise = time = None
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad(set_to_none=True)
        loss, _ = policy(batch, noise=noise, time=time)  # through __call__: FSDP2/DDP hooks run
        loss.backward()
        opt.step()
        scheduler.step()
    return lrs


def full_params_of(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full (gathered, for DTensors; collective) copies of the tensors."""
    return {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for n, t in tensors.items()
    }


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return full_params_of(dict(model.named_parameters()))


def shadow_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an EMA holds: a detached copy of every parameter, sharded like it."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def seed_rank_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draws() -> dict[str, Any]:
    """One draw from each global RNG the checkpoint restores."""
    return {"python": random.random(), "numpy": np.random.rand(3), "torch": torch.rand(3)}


def probe_outputs(policy: nn.Module) -> torch.Tensor:
    """Sampled actions on a fixed observation and fixed noise: a function of the weights only."""
    batch, noise, _ = step_inputs(policy.config, 999)
    with torch.no_grad():
        return policy.sample_actions(batch, noise=noise, num_steps=2)


def fsdp_checkpoint_scenarios(rank: int, world: int, root: str, single_process_ckpt: str) -> dict[str, Any]:
    """Train / save / resume / fail / export on `world` FSDP2 ranks. See test_checkpoint_distributed."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, Any] = {}
    for kind in OPTIMIZERS:
        manager = CheckpointManager(Path(root) / kind, keep_last=2)
        policy, opt, scheduler = build(kind, mesh=mesh)
        seed_rank_rngs(100 + rank)  # every rank's RNGs differ, as in a real run
        train(policy, opt, scheduler, range(N_STEPS), rank, world)
        state = {"epoch": 0, "index": N_STEPS * GLOBAL_BATCH, "rank_written": rank}
        ema = shadow_copy(policy)  # DTensors sharded like the params, as an EMA keeps them
        saved = manager.save(
            N_STEPS, policy, opt, scheduler=scheduler, trainer_state=state, extra_state={"ema": ema, "n": 7}
        )
        results[f"{kind}/ema"] = full_params_of(ema)
        lrs = train(policy, opt, scheduler, range(N_STEPS, N_STEPS + 1), rank, world)
        results[f"{kind}/after_n_plus_1"] = full_params(policy)
        lrs += train(policy, opt, scheduler, range(N_STEPS + 1, N_STEPS + M_STEPS), rank, world)
        results[f"{kind}/uninterrupted"] = full_params(policy)
        results[f"{kind}/uninterrupted_lrs"] = lrs
        results[f"{kind}/uninterrupted_draws"] = draws()
        results[f"{kind}/path"] = str(saved)

        # Resume on the same ranks into a differently initialised model with scrambled RNGs.
        fresh, fresh_opt, fresh_scheduler = build(kind, seed=7, mesh=mesh)
        seed_rank_rngs(555)
        extra = {"ema": shadow_copy(fresh), "n": 0}
        fresh_ema = dict(extra["ema"])
        results[f"{kind}/trainer_state"] = manager.load(
            saved, fresh, fresh_opt, scheduler=fresh_scheduler, extra_state=extra
        )
        results[f"{kind}/ema_resumed"] = full_params_of(fresh_ema)  # the very tensors passed in
        results[f"{kind}/extra_n"] = extra["n"]
        resumed_lrs = train(fresh, fresh_opt, fresh_scheduler, range(N_STEPS, N_STEPS + M_STEPS), rank, world)
        results[f"{kind}/resumed"] = full_params(fresh)
        results[f"{kind}/resumed_lrs"] = resumed_lrs
        results[f"{kind}/resumed_draws"] = draws()

    # A save that fails on rank 1 only (mid-write, after rank 0 wrote its shards) raises on every rank
    # and leaves the previous checkpoint as the latest one.
    manager = CheckpointManager(Path(root) / "muon", keep_last=2)
    original_write = FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        raise OSError("No space left on device (simulated on rank 1)")

    if rank == 1:
        FileSystemWriter.write_data = failing_write
    try:
        manager.save(N_STEPS + M_STEPS, fresh, fresh_opt, scheduler=fresh_scheduler)
        results["failed_save_error"] = None
    except CheckpointError as exc:
        results["failed_save_error"] = str(exc)
    finally:
        FileSystemWriter.write_data = original_write
    results["latest_after_failure"] = str(manager.latest())
    results["entries_after_failure"] = sorted(p.name for p in manager.root.iterdir())

    # Consolidated export from the sharded model (the trainer's export path: gathered to rank 0).
    export_dir = Path(root) / "export"
    export_dir.mkdir(parents=True, exist_ok=True)
    export_path = export_policy(fresh, export_dir, rank=rank, lerobot_config=None)
    results["export_path"] = str(export_path)
    results["probe"] = probe_outputs(fresh)

    # A checkpoint written by one process (no process group) resumes here: DCP reshards it and the
    # ranks the saver did not have keep their RNG, with a warning.
    single, single_opt, single_scheduler = build("muon", seed=9, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CheckpointManager(Path(single_process_ckpt).parent).load(
            single_process_ckpt, single, single_opt, scheduler=single_scheduler
        )
    results["from_single_process"] = full_params(single)
    results["from_single_process_warnings"] = [str(w.message) for w in caught]

    # A flipped bit in one rank's shard of the newest checkpoint: the ranks split the checksum reads,
    # agree, and both fall back to the previous checkpoint, naming the shard.
    flip = CheckpointManager(Path(root) / "flip", keep_last=None)
    flip_policy, flip_opt, flip_scheduler = build("muon", seed=10, mesh=mesh)
    train(flip_policy, flip_opt, flip_scheduler, range(1), rank, world)
    flip.save(1, flip_policy, flip_opt, scheduler=flip_scheduler)
    newest = flip.save(2, flip_policy, flip_opt, scheduler=flip_scheduler)
    if rank == 0:
        shard = newest / "model_optim" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x40
        shard.write_bytes(bytes(data))
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results["flip_resolved"] = str(flip.resolve("auto"))
    results["flip_skipped"] = [reason for _, reason in flip.skipped]

    # DDP: the saved names carry no "module." prefix, so a plain model loads them. Every rank trains on
    # the full batch, so the replicas agree without relying on DDP's gradient hooks.
    ddp_policy, ddp_opt, ddp_scheduler = build("muon")
    ddp = DDP(ddp_policy)
    train(ddp_policy, ddp_opt, ddp_scheduler, range(1))
    ddp_manager = CheckpointManager(Path(root) / "ddp")
    results["ddp_path"] = str(ddp_manager.save(1, ddp, ddp_opt, scheduler=ddp_scheduler))
    results["ddp_params"] = full_params(ddp_policy)
    dist.barrier()
    return results
