"""Multi-process training under torchrun (gloo): FSDP2 and DDP follow the single-process trajectory,
FSDP2 really shards, checkpoints resume on 2 and on 1 process, and a dying rank ends the run."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from _trainer_runs import losses, run_in_process, run_torchrun, summary, tiny_overrides
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

STEPS = ["trainer.steps=12", "trainer.checkpoint_every=6", "trainer.warmup_steps=2"]


@pytest.fixture(scope="module")
def runs(synthetic_dataset, tmp_path_factory) -> dict:
    """One single-process, one FSDP2 and one DDP run of the same configuration."""
    base = tmp_path_factory.mktemp("runs")
    out = {name: base / name for name in ("single", "fsdp2", "ddp")}
    run_in_process(tiny_overrides(synthetic_dataset, out["single"], *STEPS))
    run_torchrun(tiny_overrides(synthetic_dataset, out["fsdp2"], *STEPS, "parallel=fsdp2"), nproc=2)
    run_torchrun(tiny_overrides(synthetic_dataset, out["ddp"], *STEPS, "parallel=ddp"), nproc=2)
    return {"dataset": synthetic_dataset, "base": base, **out}


@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_data_parallel_runs_follow_the_single_process_trajectory(runs, mode) -> None:
    single, parallel = losses(runs["single"]), losses(runs[mode])
    assert len(parallel) == len(single) == 12
    torch.testing.assert_close(torch.tensor(parallel), torch.tensor(single), rtol=2e-4, atol=0)
    assert sum(parallel[-4:]) / 4 < 0.9 * sum(parallel[:3]) / 3  # and it learns


def test_fsdp2_shards_every_parameter_over_the_ranks(runs) -> None:
    fsdp2, single, ddp = summary(runs["fsdp2"]), summary(runs["single"]), summary(runs["ddp"])
    assert fsdp2["world_size"] == 2 and fsdp2["layout"]["placements"] == ["(Shard(dim=0),)"]
    assert fsdp2["layout"]["dtensor_params"] > 0
    full = single["layout"]["local_param_bytes"]
    assert ddp["layout"]["local_param_bytes"] == full and ddp["layout"]["dtensor_params"] == 0
    # Rank 0 holds about half (ceil(rows / 2) of every parameter).
    assert 0.45 * full < fsdp2["layout"]["local_param_bytes"] < 0.56 * full
    # Sampling through the sharded policy (the end-of-run open-loop evaluation) matches one process.
    assert fsdp2["open_loop"]["mse"] == pytest.approx(single["open_loop"]["mse"], rel=1e-3)


def test_resume_on_two_ranks_equals_the_uninterrupted_run(runs) -> None:
    split = runs["base"] / "split"
    overrides = tiny_overrides(runs["dataset"], split, *STEPS, "parallel=fsdp2")
    first = run_torchrun(overrides, nproc=2, env={"VLA_TEST_EXIT_AFTER_STEP": "6"}, check=False)
    assert first.returncode != 0 and len(losses(split)) == 6
    run_torchrun([*overrides, "trainer.resume=auto"], nproc=2)
    assert losses(split) == losses(runs["fsdp2"])


def test_a_two_rank_checkpoint_resumes_in_one_process(runs) -> None:
    one = runs["base"] / "one"
    shutil.copytree(runs["fsdp2"] / "checkpoints" / "step_00000006", one / "checkpoints" / "step_00000006")
    run_in_process(tiny_overrides(runs["dataset"], one, *STEPS, "trainer.resume=auto"))
    torch.testing.assert_close(
        torch.tensor(losses(one)), torch.tensor(losses(runs["fsdp2"])[6:]), rtol=2e-4, atol=0
    )


def test_a_rank_that_dies_ends_the_run_instead_of_hanging(runs) -> None:
    out = runs["base"] / "crash"
    start = time.monotonic()
    result = run_torchrun(
        tiny_overrides(runs["dataset"], out, *STEPS, "parallel=fsdp2"),
        nproc=2,
        env={"VLA_TEST_CRASH_AT_STEP": "3", "VLA_TEST_CRASH_RANK": "1"},
        check=False,
        timeout=240,
    )
    assert result.returncode != 0
    assert time.monotonic() - start < 200
    assert "exitcode  : 17" in result.stderr or "exitcode: 17" in result.stderr
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("step_*"))


@pytest.mark.timeout(900)
def test_hsdp_on_two_nodes_of_two_follows_the_single_process_trajectory(runs, tmp_path) -> None:
    """parallel=hsdp on 4 ranks as 2 replicas x 2 shards: the (Replicate, Shard(0)) layout, half the bytes of
    one process per rank, and the single-process losses (DMuon routes over the 2-D mesh)."""
    out = tmp_path / "hsdp"
    # The first 4 steps of the same 12-step schedule (4 ranks share 2 cores: kept short).
    first_steps = ["trainer.steps=4", "trainer.schedule_steps=12", "trainer.warmup_steps=2"]
    run_torchrun(
        tiny_overrides(runs["dataset"], out, *first_steps, "parallel=hsdp", "parallel.replicas=2"),
        nproc=4,
        env={"OMP_NUM_THREADS": "1"},
        timeout=800,
    )
    hsdp, single = summary(out), summary(runs["single"])
    assert hsdp["world_size"] == 4 and hsdp["layout"]["placements"] == ["(Replicate(), Shard(dim=0))"]
    full = single["layout"]["local_param_bytes"]
    assert 0.45 * full < hsdp["layout"]["local_param_bytes"] < 0.56 * full  # sharded over 2, not 4
    assert len(losses(out)) == 4
    torch.testing.assert_close(
        torch.tensor(losses(out)), torch.tensor(losses(runs["single"])[:4]), rtol=2e-4, atol=0
    )
    # parallel.replicas must leave shard groups of >= 2 processes.
    bad = run_torchrun(
        tiny_overrides(runs["dataset"], tmp_path / "bad", *STEPS, "parallel=hsdp", "parallel.replicas=4"),
        nproc=4,
        env={"OMP_NUM_THREADS": "1"},
        check=False,
    )
    output = bad.stdout + bad.stderr
    assert bad.returncode != 0 and output.count("got parallel.replicas=4") == 1, output[-3000:]
    assert "vla/training/" not in output  # one short block, no worker traceback


def test_a_state_blind_policy_under_fsdp2_follows_one_process_and_exports_no_state_weight(runs) -> None:
    """model.overrides use_state=false: its frozen zero weight shares an FSDP2 unit with a trainable bias."""
    blind = ["trainer.steps=6", "trainer.warmup_steps=2", "model.overrides={use_state: false}"]
    out = {name: runs["base"] / f"blind_{name}" for name in ("single", "fsdp2")}
    run_in_process(tiny_overrides(runs["dataset"], out["single"], *blind))
    run_torchrun(tiny_overrides(runs["dataset"], out["fsdp2"], *blind, "parallel=fsdp2"), nproc=2)
    torch.testing.assert_close(
        torch.tensor(losses(out["fsdp2"])), torch.tensor(losses(out["single"])), rtol=2e-4, atol=0
    )
    assert losses(out["single"]) != losses(runs["single"])[:6]
    for run in out.values():
        exported = load_file(str(run / "policy.safetensors"))
        assert exported["model.state_proj.weight"].abs().max() == 0
        assert exported["model.state_proj.bias"].abs().max() > 0
