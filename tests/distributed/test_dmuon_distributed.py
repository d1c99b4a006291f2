"""Distributed dmuon equals single-process dmuon: FSDP2, DDP, HSDP, DCP resharding, failure modes.

Every scenario runs on fresh gloo processes (see harness.py) and compares full parameters after a
few steps with `dmuon.Muon` run in this process on the full tensors and the global batch.
"""

from __future__ import annotations

import _thread
import multiprocessing
import shutil
import signal
import threading
import time

import pytest
import torch
import workers
from harness import HangRetried, RankHang, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

TOL = 1e-5  # relative Frobenius error per parameter (fp32)


def _assert_matches(got: dict, expected: dict, label: str) -> None:
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        rel = float((got[name] - ref).norm() / ref.norm())
        assert rel < TOL, f"{label}: {name} differs from single process by {rel:.2e}"


def _assert_plans_valid(plans_per_rank: list[list[dict]], label: str) -> None:
    first = plans_per_rank[0]
    for other in plans_per_rank[1:]:
        assert [p["digest"] for p in other] == [p["digest"] for p in first], (
            f"{label}: plans differ across ranks"
        )
    for plan in first:
        covered = sorted(i for bucket in plan["buckets"] for i in bucket)
        assert covered == list(range(len(plan["names"]))), f"{label}: a matrix is in no bucket or in two"
        assert len(plan["owners"]) == len(plan["names"])


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {"standard": workers.reference(), "gram": workers.reference(ns_algorithm="gram")}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_and_ddp_match_single_process(world: int, references) -> None:
    results = run_ranks("workers:fsdp_scenarios", world, timeout=250)
    keys = [
        "fsdp_standard_lpt",
        "fsdp_gram_milp",
        "fsdp_buckets_overlap",
        "fsdp_buckets_serial",
        "fsdp_swapped",
    ]
    keys += ["ddp", "ddp_gram"] if world > 1 else []
    for key in keys:
        expected = references["gram" if "gram" in key else "standard"]
        for rank, result in enumerate(results):
            _assert_matches(result[key], expected, f"{key} rank {rank}/{world}")
    for key in [k for k in results[0] if k.endswith("/plans")]:
        _assert_plans_valid([r[key] for r in results], key)
    assert all(r["state_is_sharded"] for r in results)  # momentum lives sharded like the param
    if world == 2:
        # The tiny bucket size really pipelines. (On 4 ranks the planner keeps these 8 small matrices
        # in one bucket: no split of them balances 4 ranks to 95%.)
        buckets = results[0]["fsdp_buckets_overlap/plans"][0]["buckets"]
        assert len(buckets) > 1
    if world > 1:
        assert "balance efficiency" in results[0]["plan_table"]


@pytest.mark.parametrize("ns_algorithm", ["standard", "gram"])
def test_hsdp_2x2_matches_single_process_and_replicas_agree(ns_algorithm: str, references) -> None:
    results = run_ranks("workers:hsdp_scenario", 4, args=(ns_algorithm,), timeout=250)
    assert results[0]["placements"] == ("Replicate", "Shard")
    for key in (
        "share",
        "share_split",
        "share_split_serial",
        "share_buckets",
        "repeat",
        "auto_local",
        "auto_mixed_split",
    ):
        for rank, result in enumerate(results):
            _assert_matches(result[key]["params"], references[ns_algorithm], f"hsdp {key} rank {rank}")
        # Mesh (replicate, shard): ranks 0 and 2 hold the same shard, as do 1 and 3; bitwise equal.
        for a, b in ((0, 2), (1, 3)):
            for name in results[a][key]["local"]:
                assert torch.equal(results[a][key]["local"][name], results[b][key]["local"][name]), (
                    key,
                    name,
                )
        _assert_plans_valid([r[key]["plans"] for r in results], f"hsdp {key}")
    # Sharing: one plan over all 4 ranks, and every rank of both replicas computes something.
    (shared,) = results[0]["share"]["plans"]
    assert shared["world"] == 4 and sorted({g[0] for g in shared["members"]}) == [0, 1, 2, 3]
    assert "2 replicas x 2" in results[0]["share"]["table"]
    (split,) = results[0]["share_split"]["plans"]
    assert len(split["split"]) == len(split["names"])  # "always": every matrix split
    assert {len(g) for g in split["members"]} == {2}  # over one replica's shard group
    assert {g[0] // 2 for g in split["members"]} == {0, 1}  # both replicas take split matrices
    assert "split:" in results[0]["share_split"]["table"]
    # The older path: a plan per shard group of 2, repeated by each replica.
    assert [p["world"] for p in results[0]["repeat"]["plans"]] == [2]
    # "auto" on a slow link between the replicas: every bucket computed by each replica itself (1),
    # or such buckets next to shared ones (2) in the same step (split); exact either way.
    (local,) = results[0]["auto_local"]["sharing"]
    assert set(local) == {1}, local
    (mixed,) = results[0]["auto_mixed_split"]["sharing"]
    assert set(mixed) == {1, 2}, mixed


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ns_algorithm", ["standard", "gram"])
def test_split_matrices_match_single_process(world: int, ns_algorithm: str, references) -> None:
    """Split over all ranks: tall (fc_in, 37 rows sharded 10/10/10/7) and wide matrices, an empty shard
    (head, 3 rows on 4 ranks: also fewer m x m rows than ranks), 3-D/4-D weights, a batch of three
    same-shape matrices, pipelined and serial buckets, FSDP2 and DDP."""
    results = run_ranks("workers:split_scenarios", world, args=(ns_algorithm,), timeout=250)
    for key in ("fsdp_split", "fsdp_split_buckets_serial", "fsdp_split_buckets_overlap", "ddp_split"):
        for rank, result in enumerate(results):
            _assert_matches(result[key], references[ns_algorithm], f"{key} rank {rank}/{world}")
        _assert_plans_valid([r[key + "/plans"] for r in results], key)
        (plan,) = results[0][key + "/plans"]
        assert len(plan["split"]) == len(plan["names"]) and all(len(g) == world for g in plan["members"])
    assert len(results[0]["fsdp_split_buckets_serial/plans"][0]["buckets"]) > 1
    assert f"over {world} ranks" in results[0]["fsdp_split/table"]


def test_dcp_checkpoint_saved_on_2_ranks_resumes_on_1_and_4(tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    uninterrupted = run_ranks("workers:dcp_save", 2, args=(directory, 2), timeout=250)[0]
    _assert_matches(uninterrupted, workers.reference(steps=3), "uninterrupted 2-rank run")
    for world in (1, 4):
        resumed = run_ranks("workers:dcp_resume", world, args=(directory, 2), timeout=250)
        for rank, result in enumerate(resumed):
            _assert_matches(result, uninterrupted, f"resumed on {world} ranks, rank {rank}")


def test_ranks_with_different_muon_params_fail_fast_instead_of_hanging() -> None:
    with pytest.raises(AssertionError, match="built different Muon plans"):
        run_ranks("workers:diverging_plans", 2, timeout=120)


def test_a_dying_rank_is_reported_and_nobody_hangs() -> None:
    with pytest.raises(
        AssertionError, match=r"(?s)rank 1 failed first \(then ranks \[0\]\):.*rank 1 fails on purpose"
    ):
        run_ranks("workers:failing_rank", 2, timeout=120, pg_timeout=30)


def test_a_hang_is_cut_at_the_deadline_naming_where_each_rank_was() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as caught:
        run_ranks("workers:hanging_rank", 2, timeout=15, pg_timeout=300, attempts=1)
    assert caught.type is RankHang
    assert time.monotonic() - start < 60  # the deadline, not the 120 s sleep or the 300 s gloo timeout
    message = str(caught.value)
    # each rank ends itself at the deadline (its own watchdog), not waiting for the parent to kill it;
    # rank 1, inside the collective, may instead see rank 0 leave first and fail: rank 0 is the hang
    rank0 = message.split("--- rank 0 (ended itself) ---")[1].split("--- rank 1")[0]
    assert 'workers.py", line' in rank0 and "in hanging_rank" in rank0
    if "ranks [0, 1] still running after 15s (hang); their stacks" in message:
        rank1 = message.split("--- rank 1 (ended itself) ---")[1]
        assert "in barrier" in rank1 and "in hanging_rank" in rank1
    else:
        assert "ranks [0] still running after 15s (hang); then ranks [1] failed (their peers left)" in message


def test_a_rank_spinning_without_end_is_ended_by_its_cpu_limit_naming_where_it_was(tmp_path) -> None:
    # The wall deadline (120 s) is far off: the kernel's CPU-time limit ends the spinning rank, and its
    # stacks were written at the soft limit. Rank 0, whose barrier then fails, is not the cause.
    start = time.monotonic()
    with pytest.raises(RankHang) as caught:
        run_ranks(
            "workers:spins_the_first_time", 2, args=(str(tmp_path),), timeout=120, cpu_limit=8, attempts=1
        )
    assert time.monotonic() - start < 60
    message = str(caught.value)
    assert "ranks [1] ended from outside without a result (hang)" in message
    assert "--- rank 1 (ended by SIGKILL: its CPU-time limit of 8s, or a supervisor) ---" in message
    assert "in spins_the_first_time" in message.split("--- rank 1")[1]
    # the harness looked at it before the kernel ended it: which thread spun, and its native stacks
    seen = message.split("--- rank 1, seen by the harness before it ended: ")[1]
    assert seen.startswith("it had used ") and "s of CPU time (8s allowed)" in seen
    spinning = [line for line in seen.splitlines() if " python " in line and " R user " in line]
    assert spinning, seen  # the main thread, running
    if shutil.which("gdb"):
        assert "Thread 1 " in seen and "#0 " in seen


def test_a_run_that_hangs_once_is_run_again_with_a_warning_holding_its_stacks(tmp_path) -> None:
    with pytest.warns(HangRetried) as warned:
        results = run_ranks(
            "workers:spins_the_first_time", 2, args=(str(tmp_path),), timeout=120, cpu_limit=8
        )
    assert results == [0, 1]  # the second run passed
    (warning,) = warned
    assert "workers:spins_the_first_time on 2 ranks hung; running it again." in str(warning.message)
    assert "in spins_the_first_time" in str(warning.message)


def test_a_run_that_hangs_every_time_fails_with_each_runs_stacks() -> None:
    with pytest.warns(HangRetried), pytest.raises(RankHang) as caught:
        run_ranks("workers:spins_the_first_time", 2, args=(None,), timeout=120, cpu_limit=8)
    message = str(caught.value)
    assert "[run 1 of 2]" in message and "[run 2 of 2]" in message
    assert message.count("in spins_the_first_time") == 2  # rank 1's stacks, from each run


def test_no_rank_outlives_a_wait_that_is_cut_short() -> None:
    # What pytest-timeout or Ctrl-C does to the parent's wait: an exception raised inside it. A shell
    # starts background jobs (`cmd &`, nohup) with SIGINT ignored, and interrupt_main() then does nothing:
    # Python's own handler is installed for the test's duration.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(8.0, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_ranks("workers:hanging_rank", 2, timeout=120, pg_timeout=250)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert multiprocessing.active_children() == []  # killed and joined, not left running


def test_calibrated_cost_model_is_shared_and_cached(tmp_path, references) -> None:
    results = run_ranks("workers:calibrated_cost_model", 2, args=(str(tmp_path),), timeout=250)
    for rank, result in enumerate(results):
        _assert_matches(result["params"], references["standard"], f"calibrated rank {rank}")
    _assert_plans_valid([r["plans"] for r in results], "calibrated")
    assert any(name.startswith("ns_profile-cpu") for name in results[0]["cache"])


def test_pinned_process_group_runs_independent_jobs() -> None:
    results = run_ranks("workers:pinned_process_group", 4, timeout=250)
    for result in results:
        expected = workers.pinned_reference(result["job"])
        for got, ref in zip(result["params"], expected):
            assert float((got - ref).norm() / ref.norm()) < TOL
        assert result["plans"][0]["owners"]  # the replicated path (owners + all-gather) ran
    assert not torch.equal(results[0]["params"][0], results[2]["params"][0])  # the jobs differ


def test_unsupported_layouts_get_clear_errors() -> None:
    for errors in run_ranks("workers:unsupported_layouts", 2, timeout=200):
        assert "'proj.weight'" in errors["shard1"] and "Shard(0)" in errors["shard1"]
        assert "'fc.weight'" in errors["pinned"] and "pinned" in errors["pinned"]


@pytest.mark.parametrize("world", [2, 3])
def test_split_newton_schulz_equals_the_whole_matrix_iteration(world: int) -> None:
    results = run_ranks("workers:split_ns_cases", world, timeout=200)
    for rank, result in enumerate(results):
        for key, case in result.items():
            got, expected = case["got"], case["expected"]
            assert got.shape == expected.shape, key
            if expected.numel():
                rel = float((got - expected).norm() / expected.norm())
                assert rel < 3e-5, f"{key} rank {rank}/{world}: {rel:.2e}"
            # The planner's cost model counts exactly the collectives the iteration makes.
            assert case["counts"] == case["predicted"], key


@pytest.mark.parametrize(("world", "ranks_per_node"), [(4, 2), (6, 2), (6, 3)])
def test_two_level_exchange_moves_what_the_flat_one_moves(world: int, ranks_per_node: int) -> None:
    """Ragged sizes with zeros and an all-empty rank, 2x2, 3x2 and 2x3 node grids: the two-level
    exchange delivers the flat one's buffer bit for bit, in both directions, over groups of the
    node count and the ranks per node (never the whole world); the bf16 wire rounds and nothing more."""
    results = run_ranks("workers:exchange_cases", world, args=(ranks_per_node,), timeout=200)
    nodes = world // ranks_per_node
    for rank, r in enumerate(results):
        assert (r["layout"].nodes, r["layout"].per_node) == (nodes, ranks_per_node)
        assert torch.equal(r["forward/flat/fp32"], r["expected_forward"]), rank
        for direction in ("forward", "return"):
            flat = r[f"{direction}/flat/fp32"]
            assert torch.equal(r[f"{direction}/two_level/fp32"], flat), (rank, direction)
            assert r[f"{direction}/flat/fp32/groups"] == [world]
            assert r[f"{direction}/two_level/fp32/groups"] == [nodes, ranks_per_node]
            for name in ("flat", "two_level"):
                wired = r[f"{direction}/{name}/bf16"]
                assert wired.dtype == torch.float32
                assert torch.equal(wired, flat.to(torch.bfloat16).float()), (rank, direction, name)


def test_two_level_exchange_and_bf16_wire_in_the_optimizer(references) -> None:
    """4 gloo ranks as 2 nodes x 2: two-level (pipelined, serial, split) equals the flat exchange bit
    for bit and the single process within 1e-5; the bf16 wire is close but not exact, and leaves
    HSDP replicas identical."""
    results = run_ranks("workers:two_level_scenarios", 4, timeout=250)
    reference = references["standard"]
    for rank, r in enumerate(results):
        for key in (
            "flat",
            "two_level",
            "two_level_serial",
            "flat_split",
            "two_level_split",
            "auto_one_node",
        ):
            _assert_matches(r[key], reference, f"{key} rank {rank}")
        for key, flat in (
            ("two_level", "flat"),
            ("two_level_serial", "flat"),
            ("two_level_split", "flat_split"),
        ):
            for name, value in r[flat].items():
                assert torch.equal(r[key][name], value), (key, name)
        # Three steps at lr 0.05 on 12-48-wide matrices move the weights by about their own size, so the
        # rounding of the updates (2^-9 each way, amplified by NS on small singular values) shows as
        # ~1% of the weights here; scripts/bench_wire.py measures it per update at pi0's shapes.
        for key in ("wire_bf16", "wire_bf16_all", "hsdp_wire_bf16"):
            errors = {n: float((r[key][n] - ref).norm() / ref.norm()) for n, ref in reference.items()}
            assert 1e-5 < max(errors.values()) < 5e-2, (key, errors)
    for a, b in ((0, 2), (1, 3)):  # (replicate, shard) mesh: same shard, same bits
        for name, value in results[a]["hsdp_wire_bf16/local"].items():
            assert torch.equal(value, results[b]["hsdp_wire_bf16/local"][name]), name
    # Split matrices fill all 4 ranks each, so tiny buckets really pipeline the two-level path.
    assert len(results[0]["two_level_split/plans"][0]["buckets"]) > 1
