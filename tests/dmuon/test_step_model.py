"""dmuon.step_model on hand-made plans (prices of flat, two-level and fan-out transfers, the schedule
replay), and the planner choices made with it (HSDP sharing, bucket tuning)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dmuon
from dmuon.exchange import node_layout, send_matrix
from dmuon.functional import NSConfig
from dmuon.layout import chunk_rows
from dmuon.planner import CostModel, MatrixSpec, Plan, _plan, build_plan
from dmuon.split_ns import split_collectives, split_message_elements
from dmuon.step_model import (
    Network,
    Transfer,
    fan_out_transfer,
    flat_transfer,
    replay,
    split_bytes,
    step_seconds,
    two_level_transfers,
)

NS = NSConfig(steps=5, coefficients=tuple(dmuon.coefficient_schedule("jordan", 5)), algorithm="auto")
ALPHA, INTRA, INTER = 1e-5, 100e9, 10e9
NET = Network(alpha=ALPHA, intra=INTRA, inter=INTER, gpus_per_node=2)


def _plan_of(world: int, per_replica: int, owners: list[int], *, buckets=None, seconds=None) -> Plan:
    """Two 4 x 8 matrices "a", "b" with the given owners, rows sharded over `per_replica` ranks."""
    specs = tuple(MatrixSpec(name, 4, 8, NS, chunk_rows(4, per_replica)) for name in ("a", "b"))
    buckets = buckets or ((0, 1),)
    seconds = seconds or tuple((0.0,) * world for _ in buckets)
    return Plan(
        world=world,
        specs=specs,
        owners=tuple(owners),
        buckets=buckets,
        rank_seconds=tuple(sum(b[r] for b in seconds) for r in range(world)),
        strategy="hand",
        bucket_seconds=seconds,
        ranks_per_replica=per_replica,
    )


def test_send_matrix_is_what_each_rank_sends_each_other() -> None:
    plan = _plan_of(4, 4, [0, 3])  # one row (8 elements) of each matrix per rank
    matrix = send_matrix(plan, 0, 0)
    assert matrix[:, 0].tolist() == [8, 8, 8, 8] and matrix[:, 3].tolist() == [8, 8, 8, 8]
    assert int(matrix.sum()) == 64


def test_flat_exchange_counts_intra_and_inter_node_bytes() -> None:
    # 4 ranks on 2 nodes, one row of "a" (8 floats = 32 bytes) per rank, owner 0.
    plan = _plan_of(4, 4, [0, 3], buckets=((0,), (1,)))
    t = flat_transfer(plan, 0, NET)
    # rank 0 receives 32 B from rank 1 (same node) and 64 B from ranks 2, 3 (other node).
    assert t.seconds == pytest.approx(3 * ALPHA + 32 / INTRA + 64 / INTER)
    assert t.moved == [96, 32, 32, 32] and set(t.links) == {"intra", "inter"}
    assert flat_transfer(plan, 0, NET, element_bytes=2).seconds == pytest.approx(
        3 * ALPHA + 16 / INTRA + 32 / INTER
    )
    assert fan_out_transfer(plan, 0, NET) is None  # one replica: no fan-out


def test_two_level_exchange_goes_through_the_rail_then_the_node() -> None:
    plan = _plan_of(4, 4, [0, 3], buckets=((0,), (1,)))
    layout = node_layout(range(4), 2)
    assert (layout.nodes, layout.per_node, layout.messages()) == (2, 2, 2)
    a, b = two_level_transfers(plan, 0, NET, layout)
    # A: ranks 2 and 3 send their rows to their rail peers 0 and 1 on the owner's node (32 B each).
    assert a.seconds == pytest.approx(ALPHA + 32 / INTER) and a.links == ("inter",)
    assert a.moved == [32, 32, 32, 32]
    # B: rank 1 hands rank 0 its own row and rank 3's (64 B).
    assert b.seconds == pytest.approx(ALPHA + 64 / INTRA) and b.links == ("intra",)
    assert b.moved == [64, 64, 0, 0]
    # One node, or one rank per node: no grid to use.
    assert node_layout(range(4), 4).two_level is False and node_layout(range(4), 1).two_level is False
    assert node_layout([0, 2, 1, 3], 2) is None  # not in node order
    assert node_layout(range(6), 4) is None  # nodes of unequal size


def test_split_group_receives_column_chunks_and_counts_its_collectives() -> None:
    # "a" (4 x 8, wide) split over ranks 0, 1: each gets its 4 columns of every rank's row (16 B).
    plan = dataclasses.replace(_plan_of(4, 4, [0, 2]), members=((0, 1), (2,)), buckets=((0,), (1,)))
    t = flat_transfer(plan, 0, NET)
    assert t.seconds == pytest.approx(3 * ALPHA + 16 / INTRA + 32 / INTER)
    assert t.moved == [64, 64, 32, 32]
    reduces, gathers = split_collectives(NS.algorithm_for((4, 8)), NS.steps)
    assert split_message_elements(4, 2) == (10, 10)
    ring = (2 * reduces * 10 + gathers * 10) * 1 / 2 * 4
    assert split_bytes(plan, (0, 1)) == [2 * ring, 2 * ring, 0, 0]


def test_hsdp_exchange_stays_in_the_replica_and_fan_out_crosses_nodes() -> None:
    # HSDP 2 x 2: "a" owned by rank 2 (replica 1, shard 0), "b" by rank 1 (replica 0, shard 1).
    plan = _plan_of(4, 2, [2, 1])
    t = flat_transfer(plan, 0, NET)
    assert t.seconds == pytest.approx(ALPHA + 64 / INTRA) and t.links == ("intra",)
    assert t.moved == [64, 64, 64, 64]
    fan = fan_out_transfer(plan, 0, NET, padded=True)
    assert fan.seconds == pytest.approx(ALPHA + 64 / INTER) and fan.moved == [128, 128, 128, 128]
    lopsided = _plan_of(4, 2, [0, 1])  # both on replica 0: exact sends no padding
    assert fan_out_transfer(lopsided, 0, NET, padded=True).seconds == pytest.approx(ALPHA + 128 / INTER)
    exact = fan_out_transfer(lopsided, 0, NET)
    assert exact.seconds == pytest.approx(2 * ALPHA + 128 / INTER) and exact.moved == [128] * 4
    three = dataclasses.replace(lopsided, world=6)  # ring relay: replica 1 forwards to replica 2
    exact = fan_out_transfer(three, 0, NET)
    assert exact.seconds == pytest.approx(3 * ALPHA + 128 / INTER)
    assert exact.moved == [128, 128, 256, 256, 128, 128]
    # A bucket every replica computes itself fans nothing out, and is priced on its template.
    own = dataclasses.replace(plan, owners=(0, 1), members=((0,), (1,)), bucket_replicas=(1,))
    assert fan_out_transfer(own, 0, NET) is None and own.replica_local() == {0, 1}
    assert flat_transfer(own, 0, NET).seconds == pytest.approx(ALPHA + 64 / INTRA)


def _t(seconds: float, links: tuple[str, ...] = ("intra", "inter")) -> Transfer:
    return Transfer(seconds, links)


def test_replay_follows_the_dmuon_comm_schedule() -> None:
    t = 0.1
    # One bucket: exchange, compute, return.
    assert replay([2.0], [[_t(t)]], [[_t(t)]], [None]) == pytest.approx(t + 2.0 + t)
    # Compute far longer than transfers: only the first exchange and the last return show.
    assert replay([3.0, 5.0], [[_t(t)], [_t(t)]], [[_t(t)], [_t(t)]], [None, None]) == pytest.approx(
        t + 8.0 + t
    )
    # Compute negligible: every transfer on the same links is exposed, one after another.
    assert replay([0.0, 0.0], [[_t(t)], [_t(t)]], [[_t(t)], [_t(t)]], [None, None]) == pytest.approx(4 * t)
    # Serial: everything adds up.
    assert replay([1.0, 1.0], [[_t(t)], [_t(t)]], [[_t(t)], [_t(t)]], [None, None], overlap=False) == (
        pytest.approx(2.0 + 4 * t)
    )
    # HSDP: bucket 0's return is unpacked on the compute stream after compute 1 was issued, so its
    # fan-out leaves when compute 1 ends (2.6 s), on the inter-node link, and ends the step.
    fan = _t(1.0, ("inter",))
    local = _t(t, ("intra",))
    seconds = replay([0.5, 2.0], [[local], [local]], [[local], [local]], [fan, None])
    assert seconds == pytest.approx(t + 0.5 + 2.0 + 1.0)
    # With a third bucket of compute it hides under that one instead.
    seconds = replay([0.5, 2.0, 3.0], [[local]] * 3, [[local]] * 3, [fan, None, None])
    assert seconds == pytest.approx(t + 0.5 + 2.0 + 3.0 + t)
    # Two-level stages: stage B of a return follows its stage A.
    a, b = _t(t, ("inter",)), _t(t / 2, ("intra",))
    assert replay([1.0], [[a, b]], [[a, b]], [None]) == pytest.approx(1.5 * t + 1.0 + 1.5 * t)


def _hsdp_specs(per_replica: int) -> list[MatrixSpec]:
    shapes = [(256, 64)] * 6 + [(64, 256)] * 6 + [(128, 128)] * 4 + [(512, 128)] * 2 + [(32, 64)] * 8
    return [MatrixSpec(f"m{i}", m, n, NS, chunk_rows(m, per_replica)) for i, (m, n) in enumerate(shapes)]


@pytest.mark.parametrize("inter", [1e8, 1e9, 1e11])
def test_auto_sharing_is_never_predicted_slower_than_either_extreme(inter: float) -> None:
    world, per = 8, 2
    cost = CostModel(flops_per_second=1e11, ranks_per_node=2, inter_node_bandwidth=inter)
    net = cost.network()
    specs = tuple(_hsdp_specs(per))
    options = dict(strategy="lpt", cost=cost, bucket_bytes=64 << 10, milp_time_limit=1.0, split="off")
    shared = build_plan(specs, world, ranks_per_replica=per, bucket_bytes=64 << 10, cost=cost)
    everything = _plan(specs, world, per_replica=per, local=frozenset(range(len(specs))), **options)
    auto = build_plan(specs, world, ranks_per_replica=per, bucket_bytes=64 << 10, cost=cost, sharing="auto")
    assert set(everything.bucket_replicas) == {1} and not shared.bucket_replicas
    predicted = {
        name: step_seconds(p, net)["dmuon_s"]
        for name, p in [("shared", shared), ("own", everything), ("auto", auto)]
    }
    assert predicted["auto"] <= min(predicted["shared"], predicted["own"]) * (1 + 1e-12), predicted
    covered = sorted(i for bucket in auto.buckets for i in bucket)
    assert covered == list(range(len(specs)))
    for k, bucket in enumerate(auto.buckets):  # a bucket of one's own is planned on replica 0
        if auto.sharing(k) == 1:
            assert all(auto.members[i][-1] < per for i in bucket)
    if inter == 1e9:  # here the best plan mixes both kinds
        assert set(auto.bucket_replicas) == {1, world // per}, auto.bucket_replicas
    assert auto.digest() != shared.digest() or not auto.bucket_replicas


def test_tuned_buckets_are_never_predicted_slower() -> None:
    world = 8
    cost = CostModel(flops_per_second=1e11, ranks_per_node=4, inter_node_bandwidth=1e9)
    specs = [MatrixSpec(f"m{i}", 256, 256, NS, chunk_rows(256, world)) for i in range(16)]
    plain = build_plan(specs, world, cost=cost)
    tuned = build_plan(specs, world, cost=cost, tune_buckets=True)
    net = cost.network()
    assert step_seconds(tuned, net)["dmuon_s"] <= step_seconds(plain, net)["dmuon_s"]
    assert len(tuned.buckets) > len(plain.buckets)  # this compute-heavy case pipelines


def test_two_level_is_priced_where_the_shard_group_spans_nodes() -> None:
    world = 8
    cost = CostModel(flops_per_second=1e11, ranks_per_node=4, inter_node_bandwidth=1e9)
    specs = [MatrixSpec(f"m{i}", 64, 256, NS, chunk_rows(64, world)) for i in range(8)]
    plan = build_plan(specs, world, cost=cost)
    net = cost.network()
    two = step_seconds(plan, net)
    flat = step_seconds(plan, net, exchange="flat")
    assert two["two_level"] == 1.0 and flat["two_level"] == 0.0
    one_node = step_seconds(plan, dataclasses.replace(net, gpus_per_node=8))
    assert one_node["two_level"] == 0.0
    # Fewer messages: 1 + 3 per rank instead of 7; the same bytes cross the nodes.
    assert two["exchange_s"] < flat["exchange_s"]


def test_auto_split_is_judged_by_the_messages_it_sends() -> None:
    """Three wide matrices whose owners' links set the step: the stage sums (compute only) call
    splitting no faster, the step model (messages priced on the network) calls it 7% faster, and
    split="auto" keeps the split plan it predicts faster."""
    world = 8
    cost = CostModel(flops_per_second=1e12, ranks_per_node=4, inter_node_bandwidth=1e9, bandwidth=1e10)
    shapes = [(256, 4096)] * 3 + [(256, 256)] * 8
    specs = tuple(MatrixSpec(f"m{i:02d}", m, n, NS, chunk_rows(m, world)) for i, (m, n) in enumerate(shapes))
    options = dict(strategy="lpt", cost=cost, bucket_bytes=64 << 20, milp_time_limit=1.0, per_replica=world)
    by_stages = _plan(specs, world, split="auto", local=frozenset(), **options)
    owners = _plan(specs, world, split="off", local=frozenset(), **options)
    auto = build_plan(specs, world, split="auto", cost=cost)
    assert by_stages.split_indices == () and "not faster" in by_stages.split
    assert auto.split_indices == (0, 1, 2) and auto.split == "auto"
    net = cost.network()
    assert step_seconds(auto, net)["dmuon_s"] < 0.95 * step_seconds(owners, net)["dmuon_s"]


@pytest.mark.parametrize("world", [4, 8, 16])
def test_auto_split_is_never_predicted_slower_than_owners_only(world: int) -> None:
    gen = torch.Generator().manual_seed(world)
    shape_sets = [[(256, 4096)] * 3 + [(256, 256)] * 8, [(4096, 1024)] + [(256, 1024)] * 12]
    shape_sets.append(
        [tuple(int(x) for x in torch.randint(16, 2048, (2,), generator=gen)) for _ in range(30)]
    )
    for shapes in shape_sets:
        specs = [MatrixSpec(f"m{i:02d}", m, n, NS, chunk_rows(m, world)) for i, (m, n) in enumerate(shapes)]
        for cost in (
            CostModel(),
            CostModel(flops_per_second=1e12, ranks_per_node=4, inter_node_bandwidth=1e9, bandwidth=1e10),
        ):
            net = cost.network()
            off = step_seconds(build_plan(specs, world, split="off", cost=cost), net)["dmuon_s"]
            auto = step_seconds(build_plan(specs, world, split="auto", cost=cost), net)["dmuon_s"]
            assert auto <= off * (1 + 1e-12), (world, shapes[:3])


def test_owners_balance_their_nodes_bytes_as_well_as_their_seconds() -> None:
    """Square matrices (much NS per byte) and wide ones (little): balancing NS seconds alone piles
    bytes on some nodes, whose rails then set the step; counting each node's rail seconds spreads
    the bytes over the nodes and is predicted 1.4x faster (8 ranks as 4 nodes x 2)."""
    world = 8
    cost = CostModel(flops_per_second=1e12, ranks_per_node=2, inter_node_bandwidth=1e8, bandwidth=1e9)
    shapes = [(512, 512)] * 4 + [(128, 4096)] * 8
    specs = tuple(MatrixSpec(f"m{i:02d}", m, n, NS, chunk_rows(m, world)) for i, (m, n) in enumerate(shapes))
    aware = build_plan(specs, world, cost=cost)
    blind = build_plan(specs, world, cost=dataclasses.replace(cost, ranks_per_node=0))
    net = cost.network()
    assert step_seconds(aware, net)["dmuon_s"] < step_seconds(blind, net)["dmuon_s"] / 1.4

    def node_bytes(plan: Plan) -> list[int]:
        owned = [0] * (world // 2)
        for spec, owner in zip(plan.specs, plan.owners):
            owned[owner // 2] += spec.numel
        return owned

    assert max(node_bytes(aware)) < max(node_bytes(blind))
    assert max(node_bytes(aware)) <= 1.25 * sum(node_bytes(aware)) / len(node_bytes(aware))
    # One node, or a shard group inside one (HSDP's), has no rails to balance: the plan is unchanged.
    for per_replica in (world, 2):
        one = CostModel(flops_per_second=1e12, ranks_per_node=world if per_replica == world else 2)
        same = build_plan(specs, world, cost=one, ranks_per_replica=per_replica)
        base = build_plan(
            specs, world, cost=dataclasses.replace(one, ranks_per_node=0), ranks_per_replica=per_replica
        )
        assert same.members == base.members
