"""Checkpoints under FSDP2 on 2 gloo ranks: resume on 2 ranks and on 1, failures, export, DDP.

One spawn (see _checkpoint_workers.fsdp_checkpoint_scenarios) runs every multi-rank scenario; the
1-rank resumes run in this process, with no process group at all.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _checkpoint_workers import (
    GLOBAL_BATCH,
    M_STEPS,
    N_STEPS,
    OPTIMIZERS,
    build,
    draws,
    full_params,
    probe_outputs,
    seed_rank_rngs,
    shadow_copy,
    train,
)
from harness import run_ranks

from vla.training.checkpoint import CheckpointManager, read_safetensors_metadata

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WORLD = 2


# SigLIP's attention key bias has an exactly zero gradient (softmax ignores a shift common to all keys),
# so what it gets is rounding noise, which AdamW scales up to lr-sized steps: a different reduction
# order (2 ranks vs 1 process) changes it completely. Every other tensor is compared.
NOISE_ONLY = "self_attn.k_proj.bias"


def _max_rel(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert got.keys() == expected.keys()
    return max(
        float((got[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-12))
        for k in expected
        if not k.endswith(NOISE_ONLY)
    )


def _assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{label}: {name} differs"


def _assert_same_draws(got: dict, expected: dict, label: str) -> None:
    assert got["python"] == expected["python"], label
    assert np.array_equal(got["numpy"], expected["numpy"]), label
    assert torch.equal(got["torch"], expected["torch"]), label


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[list[dict], object]:
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    # A single-process checkpoint for the 1 -> 2 rank resume inside the spawn.
    policy, opt, scheduler = build("muon", seed=3)
    train(policy, opt, scheduler, range(1))
    single_manager = CheckpointManager(root / "single")
    single_path = single_manager.save(1, policy, opt, scheduler=scheduler)
    results = run_ranks(
        "_checkpoint_workers:fsdp_checkpoint_scenarios",
        WORLD,
        args=(str(root), str(single_path)),
        timeout=240,
    )
    return results, {"single_params": full_params(policy), "root": root}


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_two_rank_resume_continues_the_uninterrupted_run(two_rank_run, kind: str) -> None:
    results, _ = two_rank_run
    for rank, result in enumerate(results):
        _assert_bitwise(result[f"{kind}/resumed"], result[f"{kind}/uninterrupted"], f"{kind} rank {rank}")
        assert result[f"{kind}/resumed_lrs"] == result[f"{kind}/uninterrupted_lrs"]
        _assert_same_draws(result[f"{kind}/resumed_draws"], result[f"{kind}/uninterrupted_draws"], kind)
        _assert_bitwise(result[f"{kind}/ema_resumed"], result[f"{kind}/ema"], f"{kind} extra_state")
        assert result[f"{kind}/extra_n"] == 7
        # trainer_state comes from rank 0, whichever rank loads it.
        assert result[f"{kind}/trainer_state"] == {
            "epoch": 0,
            "index": N_STEPS * GLOBAL_BATCH,
            "rank_written": 0,
            "step": N_STEPS,
        }
    # Each rank's own RNG stream was restored (they were seeded differently).
    assert results[0][f"{kind}/resumed_draws"]["python"] != results[1][f"{kind}/resumed_draws"]["python"]
    # Both ranks hold the same full model (the uninterrupted run really trained: it moved from init).
    _assert_bitwise(results[1][f"{kind}/uninterrupted"], results[0][f"{kind}/uninterrupted"], "replicas")
    assert _max_rel(results[0][f"{kind}/uninterrupted"], results[0][f"{kind}/after_n_plus_1"]) > 1e-4


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_checkpoint_saved_on_two_ranks_resumes_in_one_process(two_rank_run, kind: str) -> None:
    results, _ = two_rank_run
    path = results[0][f"{kind}/path"]
    manifest = CheckpointManager(Path(path).parent).read_manifest(path)
    assert manifest["world_size"] == WORLD and manifest["step"] == N_STEPS

    policy, opt, scheduler = build(kind, seed=11)  # plain module, no process group
    seed_rank_rngs(4242)
    ema = shadow_copy(policy)
    manager = CheckpointManager(Path(path).parent)
    state = manager.load(path, policy, opt, scheduler=scheduler, extra_state={"ema": ema})
    _assert_bitwise(ema, results[0][f"{kind}/ema"], f"{kind} extra_state 2 -> 1 ranks")
    assert state["step"] == N_STEPS and state["index"] == N_STEPS * GLOBAL_BATCH
    lrs = train(policy, opt, scheduler, range(N_STEPS, N_STEPS + 1))
    rel = _max_rel(full_params(policy), results[0][f"{kind}/after_n_plus_1"])
    assert rel < 1e-5, f"{kind}: first step after a 2 -> 1 rank resume differs by {rel:.2e}"
    lrs += train(policy, opt, scheduler, range(N_STEPS + 1, N_STEPS + M_STEPS))
    assert lrs == results[0][f"{kind}/uninterrupted_lrs"]
    rel = _max_rel(full_params(policy), results[0][f"{kind}/uninterrupted"])
    assert rel < 1e-5, f"{kind}: {M_STEPS} steps after a 2 -> 1 rank resume differ by {rel:.2e}"
    # This process took rank 0's place, so it continues rank 0's RNG streams.
    _assert_same_draws(draws(), results[0][f"{kind}/uninterrupted_draws"], f"{kind} 2 -> 1 rank RNG")


def test_a_save_failing_on_one_rank_raises_everywhere_and_keeps_the_previous_checkpoint(two_rank_run) -> None:
    results, _ = two_rank_run
    for result in results:
        error = result["failed_save_error"]
        assert error is not None, "the save should have failed on every rank"
        assert "No space left on device (simulated on rank 1)" in error
        assert f"saving step {N_STEPS + M_STEPS}" in error
        assert result["latest_after_failure"].endswith(f"step_{N_STEPS:08d}")
        assert result["entries_after_failure"] == [f"step_{N_STEPS:08d}"]  # no tmp dir left behind


def test_export_from_two_ranks_reloads_into_a_plain_and_a_sharded_policy(two_rank_run) -> None:
    results, _ = two_rank_run
    path = results[0]["export_path"]
    probe = results[0]["probe"]
    torch.testing.assert_close(results[1]["probe"], probe, rtol=0, atol=0)

    from vla.eval.policy_runner import load_exported_policy

    policy, _, _ = build("muon", seed=12)
    assert not torch.allclose(probe_outputs(policy), probe)  # the export must carry the trained weights
    torch.testing.assert_close(probe_outputs(load_exported_policy(path)), probe, rtol=1e-5, atol=1e-6)
    meta = read_safetensors_metadata(path)
    assert meta["vla.layout"] == "lerobot_pi0" and '"kind": "pi0"' in meta["policy_config"]


def test_single_process_checkpoint_resumes_on_two_ranks(two_rank_run) -> None:
    results, extra = two_rank_run
    for rank, result in enumerate(results):
        _assert_bitwise(result["from_single_process"], extra["single_params"], f"rank {rank}")
    assert results[0]["from_single_process_warnings"] == []
    (warning,) = results[1]["from_single_process_warnings"]
    assert "saved on 1 rank(s), this is rank 1 of 2" in warning and "keeps its current RNG" in warning


def test_ddp_checkpoint_loads_into_a_plain_model(two_rank_run) -> None:
    results, _ = two_rank_run
    _assert_bitwise(results[1]["ddp_params"], results[0]["ddp_params"], "ddp replicas")
    policy, opt, scheduler = build("muon", seed=13)
    ddp_path = results[0]["ddp_path"]
    CheckpointManager(Path(ddp_path).parent).load(ddp_path, policy, opt, scheduler=scheduler)
    _assert_bitwise(full_params(policy), results[0]["ddp_params"], "ddp -> plain")
    assert opt.state and scheduler.last_epoch == 1


def test_a_flipped_bit_in_one_ranks_shard_is_found_by_both_ranks(two_rank_run) -> None:
    results, _ = two_rank_run
    for rank in results:
        assert Path(rank["flip_resolved"]).name == "step_00000001"
        (reason,) = rank["flip_skipped"]
        assert "__1_0.distcp does not match its checksum" in reason, reason
