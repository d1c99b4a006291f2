"""Checks that cost milliseconds, run before the model is built or a checkpoint read (issue 15 item 2).

- The dataset against the model: when the dataset exists already (a LeRobot root, or generated data
  recorded earlier), its metadata is checked against `data.camera_map`, the state/action keys and the
  normalisation modes, naming `data.camera_map` and the cameras the dataset has.
- Memory: what one rank needs (parameters, gradients, optimizer state and activations at the batch,
  from the policy's exact parameter count on the meta device) against what the device has (available
  RAM on CPU, free memory on CUDA). A run that cannot fit is refused with the numbers and the ways
  out; `trainer.check_memory=false` skips the check.

The activation figure is an estimate (per transformer layer and token, about 68 x width bytes in fp32,
half in bf16, after Korthikanti et al. 2022; with gradient checkpointing only each layer's input is
kept), good to a factor of about two: the check refuses only what is clearly too big.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30


class InsufficientMemoryError(RuntimeError):
    """The run needs more memory per rank than the device has."""


def check_dataset_before_model(cfg: Any, policy_config: Any) -> None:
    """Validate an existing dataset's metadata against the data config and the policy (cheap)."""
    from vla.data.metadata import DatasetMetadata
    from vla.data.processor import validate_dataset
    from vla.training.data import processor_config

    root = Path(cfg.data.root)
    # A generated source writes its metadata on first use (checked then); a missing lerobot root fails later.
    if (root / "meta" / "info.json").is_file():
        validate_dataset(processor_config(cfg.data, policy_config), DatasetMetadata(root))


@dataclass
class MemoryEstimate:
    """Bytes one rank needs. sharded: parameters, gradients and optimizer state divided over ranks."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    world: int
    sharded: bool

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        parts = ", ".join(
            f"{name} {value / GIB:.1f}"
            for name, value in (
                ("parameters", self.parameters),
                ("gradients", self.gradients),
                ("optimizer state", self.optimizer),
                ("activations", self.activations),
            )
        )
        return f"{self.total / GIB:.1f} GiB per rank ({parts})"


def _tokens(policy_config: Any, max_prompt_length: int) -> tuple[int, int, int]:
    """(image tokens per camera, prefix tokens, suffix tokens) of one sample."""
    vision = policy_config.vision
    per_camera = (vision.image_size // vision.patch_size) ** 2
    prefix = per_camera * len(policy_config.cameras) + max_prompt_length
    suffix = 1 + policy_config.action_horizon if getattr(policy_config, "kind", "") == "pi0" else 0
    return per_camera, prefix, suffix


def estimate_memory(cfg: Any, policy_config: Any, world: int) -> MemoryEstimate:
    """See the module docstring. cfg: the TrainConfig; world: processes of the launch."""
    from vla.models import build_policy

    with torch.device("meta"):
        policy = build_policy(policy_config)
    total = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    bf16 = cfg.trainer.precision == "bf16"
    sharded = cfg.parallel.mode in ("fsdp2", "hsdp") and world > 1
    share = world if sharded else 1
    if sharded and cfg.parallel.mode == "hsdp":
        from vla.training.config import hsdp_replicas

        share = max(1, world // max(1, hsdp_replicas(cfg.parallel, world)))  # shards per replica
    # Mixed precision keeps fp32 master weights; AdamW two moments, Muon one (its AdamW part is small).
    optimizer_bytes = 8 if cfg.optim.name == "adamw" else 4
    micro_batch = max(1, cfg.trainer.batch_size // (max(1, world) * cfg.trainer.grad_accum))
    per_camera, prefix, suffix = _tokens(policy_config, cfg.data.max_prompt_length)
    token_layer_widths = [
        (per_camera * len(policy_config.cameras), policy_config.vision.width, policy_config.vision.depth)
    ]
    if hasattr(policy_config, "vlm"):
        token_layer_widths.append((prefix, policy_config.vlm.width, policy_config.vlm.depth))
    if getattr(policy_config, "expert", None) is not None and suffix:
        token_layer_widths.append((suffix, policy_config.expert.width, policy_config.expert.depth))
    per_token_layer = 4 if policy_config.gradient_checkpointing else (34 if bf16 else 68)
    activations = sum(
        micro_batch * tokens * width * depth * per_token_layer for tokens, width, depth in token_layer_widths
    )
    return MemoryEstimate(
        parameters=4 * total // share,
        gradients=4 * trainable // share,
        optimizer=optimizer_bytes * trainable // share,
        activations=int(activations),
        world=world,
        sharded=sharded,
    )


def available_memory(device: torch.device | str) -> tuple[int | None, str]:
    """(bytes this rank may use, what they are), or (None, why unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {torch.cuda.get_device_name(device)}"
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None, "unknown (no /proc/meminfo)"
    fields = {line.split(":")[0]: line.split()[1] for line in text.splitlines() if ":" in line}
    if "MemAvailable" not in fields:
        return None, "unknown (no MemAvailable)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the ranks on this machine share its RAM
    return int(fields["MemAvailable"]) * 1024 // max(1, local), (
        "available RAM" + (f" / {local} ranks on this machine" if local > 1 else "")
    )


def check_memory(cfg: Any, policy_config: Any, world: int, device: torch.device | str) -> str:
    """Refuse a run that cannot fit (InsufficientMemoryError naming the numbers and the ways out);
    otherwise return the line to log."""
    estimate = estimate_memory(cfg, policy_config, world)
    have, what = available_memory(device)
    line = f"memory: the run needs about {estimate.describe()}"
    if have is None:
        return f"{line}; {what}"
    line += f"; {what}: {have / GIB:.1f} GiB"
    if estimate.total <= have:
        return line
    ways = []
    if not estimate.sharded:
        ways.append("more ranks with FSDP2 (torchrun --nproc_per_node N train.py: parallel=auto shards)")
    if not policy_config.gradient_checkpointing:
        ways.append("model.gradient_checkpointing=true")
    if cfg.trainer.precision != "bf16":
        ways.append("trainer.precision=bf16")
    ways += [
        f"a smaller trainer.batch_size (now {cfg.trainer.batch_size}) or more trainer.grad_accum",
        "a smaller model preset (pi0_small, pi0_sim)",
        "trainer.check_memory=false to try anyway",
    ]
    raise InsufficientMemoryError(
        f"this run needs about {estimate.describe()}, more than the {have / GIB:.1f} GiB of {what}. "
        f"Ways out: {'; '.join(ways)}"
    )
