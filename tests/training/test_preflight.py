"""Cheap checks before the model is built (issue 15 item 2): the memory estimate and its refusal."""

from __future__ import annotations

import pytest
import torch

from vla.models import build_policy
from vla.models.factory import resolve_config
from vla.training import preflight
from vla.training.cli import compose
from vla.training.preflight import InsufficientMemoryError, check_memory, estimate_memory


def test_the_estimate_counts_the_exact_parameters_and_shards_them() -> None:
    cfg = compose(["model=pi0_tiny", "optim=adamw"])
    config = resolve_config("pi0_tiny")
    numel = sum(p.numel() for p in build_policy(config).parameters())
    one = estimate_memory(cfg, config, world=1)
    assert one.parameters == 4 * numel and one.optimizer == 2 * one.gradients  # AdamW: two moments
    sharded = estimate_memory(compose(["model=pi0_tiny", "optim=adamw", "parallel=fsdp2"]), config, world=4)
    assert sharded.parameters == one.parameters // 4 and sharded.sharded
    checkpointed = resolve_config("pi0_tiny", gradient_checkpointing=True)
    assert estimate_memory(cfg, checkpointed, world=1).activations < one.activations / 10


def test_a_run_that_cannot_fit_is_refused_with_the_numbers_and_the_ways_out(monkeypatch) -> None:
    cfg = compose(["model=pi0_tiny"])
    config = resolve_config("pi0_tiny")
    need = estimate_memory(cfg, config, world=1).total
    monkeypatch.setattr(preflight, "available_memory", lambda device: (need // 2, "available RAM"))
    with pytest.raises(InsufficientMemoryError) as info:
        check_memory(cfg, config, 1, torch.device("cpu"))
    message = str(info.value)
    assert "per rank (parameters" in message and "more than the" in message
    for way in (
        "FSDP2",
        "model.gradient_checkpointing=true",
        "trainer.precision=bf16",
        "trainer.check_memory=false",
    ):
        assert way in message
    monkeypatch.setattr(preflight, "available_memory", lambda device: (need * 2, "available RAM"))
    assert check_memory(cfg, config, 1, torch.device("cpu")).startswith("memory: the run needs about")
