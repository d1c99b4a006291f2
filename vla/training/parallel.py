"""Devices and processes: the one place that talks to Accelerate.

`resolve_auto` turns parallel=auto into none / fsdp2 / ddp for the launch; `setup_accelerator` returns
an Accelerator for parallel=none | ddp | fsdp2. `prepare` wraps the
policy and the optimizer (DDP, or FSDP2 on every `policy.shard_units()` class plus the root) and
registers the policy's non-forward entry points with FSDP2 so they gather parameters as forward does.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
)
from torch import nn

from vla.training.config import ParallelConfig


def resolve_auto(
    parallel: ParallelConfig, world_size: int, policy: nn.Module
) -> tuple[ParallelConfig, str | None]:
    """parallel.mode=auto made concrete for a launch of `world_size` processes: none on one, fsdp2 on
    several (ddp when the policy has no unit FSDP2 could shard; policy=None: not known yet, fsdp2).
    Returns the config and a log line."""
    if parallel.mode != "auto":
        return parallel, None
    if world_size <= 1:
        mode = "none"
    else:
        units = [None] if policy is None else (policy.shard_units() if hasattr(policy, "shard_units") else [])
        mode = "fsdp2" if list(units) else "ddp"
    return dataclasses.replace(
        parallel, mode=mode
    ), f"parallel=auto: {world_size} process(es) -> parallel={mode}"


def launched_world_size() -> int:
    """The number of processes torchrun / accelerate launch started (WORLD_SIZE), 1 without a launcher."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def setup_accelerator(parallel: ParallelConfig, precision: str, shard_unit_classes: list[str]) -> Accelerator:
    """An Accelerator for this process; raises if the launch does not fit `parallel.mode`."""
    mixed_precision = {"fp32": "no", "bf16": "bf16"}[precision]
    kwargs: dict[str, Any] = {
        "mixed_precision": mixed_precision,
        "cpu": not torch.cuda.is_available(),
        "kwargs_handlers": [
            InitProcessGroupKwargs(timeout=timedelta(seconds=parallel.timeout_s), backend=parallel.backend)
        ],
    }
    plugin = None
    if parallel.mode in ("fsdp2", "hsdp"):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=shard_unit_classes,
            reshard_after_forward=parallel.reshard_after_forward,
        )
        kwargs["fsdp_plugin"] = plugin
    elif parallel.mode == "ddp":
        # Every trainable parameter of our policies gets a gradient (vla.models freezes the dead ones),
        # so DDP need not search for unused parameters.
        kwargs["kwargs_handlers"].append(DistributedDataParallelKwargs(find_unused_parameters=False))
    accelerator = Accelerator(**kwargs)
    if plugin is not None and accelerator.state.distributed_type != DistributedType.FSDP:
        # Accelerate enables FSDP only for GPU-type devices and silently falls back to DDP on CPU.
        # Its FSDP2 code path itself runs on CPU (sharding, clipping, state dicts all work), so we
        # select it explicitly: the run then really shards, as it would on GPUs.
        # AcceleratorState re-copies PartialState's fields whenever it is constructed again (Accelerate
        # does that internally), so the choice must be made in both shared states.
        from accelerate.state import PartialState

        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    if parallel.mode == "hsdp":
        _use_hsdp_mesh(accelerator, parallel)
        if mixed_precision != "no":
            plugin.set_mixed_precision(mixed_precision)
    return accelerator


def _use_hsdp_mesh(accelerator: Accelerator, parallel: ParallelConfig) -> None:
    """Give Accelerate's FSDP2 path a (dp_replicate, dp_shard) mesh: fully_shard then replicates across
    the first dimension and shards along the second (HSDP). Set after construction because Accelerate
    validates a ParallelismConfig against the device type, and refuses CPU processes."""
    from accelerate.parallelism_config import ParallelismConfig

    from vla.training.config import hsdp_replicas

    world = accelerator.num_processes
    replicas = hsdp_replicas(parallel, world)
    config = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=world // replicas)
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.build_device_mesh(accelerator.device.type)


def compile_units(policy: nn.Module, mode: str | None) -> int:
    """torch.compile every shard unit of the policy in place (per block, before FSDP2 wraps them, as
    torchtitan does): one graph per block type, reused by every block of that type, each block still
    an FSDP2 unit. Random ops inside compiled code draw from eager's generator (inductor's
    fallback_random), so a compiled run samples what an eager run samples. Returns the units compiled."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    # Every block class shares one code object (the checkpointing layer's __call__), and blocks differ
    # in what dynamo guards on: training vs evaluation (grad mode), the last layer's frozen weights,
    # prefix vs suffix lengths, sampling's KV cache. Past the default limit of 8 variants dynamo would
    # silently run the rest eager.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    units = list(policy.shard_units()) if hasattr(policy, "shard_units") else []
    for unit in units:
        unit.compile(mode=mode)
    return len(units)


def shard_unit_classes(policy: nn.Module) -> list[str]:
    """Class names of the modules FSDP2 wraps one by one (each layer pair, each vision block)."""
    return sorted({type(module).__name__ for module in policy.shard_units()})


def prepare(
    accelerator: Accelerator, policy: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[nn.Module, Any]:
    """Wrap policy and optimizer for the launch; the optimizer's params become the live ones."""
    model, optimizer = accelerator.prepare(policy, optimizer)
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import register_fsdp_forward_method

        # FSDP2 gathers parameters around forward(); the training loop and evaluation call these.
        for method in ("compute_loss", "sample_actions"):
            register_fsdp_forward_method(model, method)
    return model, optimizer


def reshard(model: nn.Module) -> None:
    """Return FSDP2 parameters to their sharded form after a forward without backward.

    FSDP2 keeps the root's parameters gathered after forward (backward would gather them again);
    an evaluation forward has no backward, so without this the module would hold plain full
    tensors in place of its DTensor parameters until the next training step.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def unwrap(model: nn.Module) -> nn.Module:
    """The policy under DDP's wrapper (FSDP2 modules are the policy itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
