"""scripts/simulate_scaling.py: the naive baseline's price, and the script end to end on
pi0_small with the FLOP model (no calibration): layouts, split modes, fan-out, JSON and plot."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dmuon.layout import chunk_rows
from dmuon.planner import CostModel, MatrixSpec

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "simulate_scaling.py"


def _load():
    spec = importlib.util.spec_from_file_location("simulate_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_scaling"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


sim = _load()
NS = sim.ns_config("auto")
ALPHA, INTRA, INTER = 1e-5, 100e9, 10e9
NET = sim.Network(alpha=ALPHA, intra=INTRA, inter=INTER, gpus_per_node=2)


def test_naive_gathers_over_the_shard_group_at_the_right_bandwidth() -> None:
    cost = CostModel(flops_per_second=1e12)
    spec = MatrixSpec("a", 64, 32, NS, chunk_rows(64, 4))
    ns = cost.matrix_seconds((64, 32, sim.ns_config("standard")))
    gather = 64 * 32 * 4 * 3 / 4
    assert sim.naive_seconds([spec], 4, cost, NET) == pytest.approx(ns + 3 * ALPHA + gather / INTER)
    wide = sim.Network(ALPHA, INTRA, INTER, gpus_per_node=4)  # the 4 ranks fit on one node
    assert sim.naive_seconds([spec], 4, cost, wide) == pytest.approx(ns + 3 * ALPHA + gather / INTRA)
    assert sim.naive_seconds([spec], 1, cost, NET) == pytest.approx(ns)


def test_ranks_per_replica_of_the_layouts() -> None:
    assert sim.ranks_per_replica("flat", 64, 8) == 64
    assert sim.ranks_per_replica("hsdp", 64, 8) == 8
    assert sim.ranks_per_replica("hsdp", 4, 8) == 4  # one node
    assert sim.ranks_per_replica("hsdp", 12, 8) is None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    out = tmp_path_factory.mktemp("simulate")
    argv = [
        "--preset=pi0_small",
        "--worlds=8,12,16,32",
        "--flops-per-second=1e12",
        "--bandwidth-gbs=20",  # the old option: now the inter-node bandwidth
        f"--json={out / 'sim.json'}",
        f"--plot={out / 'sim.png'}",
    ]
    return sim.main(argv), out / "sim.json", out / "sim.png"


def _row(result: dict, layout: str, split: str, world: int) -> dict:
    (row,) = [r for r in result["rows"] if (r["layout"], r["split"], r["world"]) == (layout, split, world)]
    return row


def test_script_rows_json_and_plot(run: tuple[dict, Path, Path]) -> None:
    result, json_path, png_path = run
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(result))
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = result["meta"]
    assert meta["inter_bandwidth_bytes_per_s"] == 20e9 and meta["intra_bandwidth_bytes_per_s"] == 200e9
    assert meta["preset"] == "pi0_small" and meta["gpus_per_node"] == 8 and meta["fan_out"] == "exact"
    expected = {("flat", s, w) for s in ("off", "auto") for w in (8, 12, 16, 32)}
    expected |= {("hsdp", s, w) for s in ("off", "auto") for w in (8, 16, 32)}  # 12 is not 8k: skipped
    assert {(r["layout"], r["split"], r["world"]) for r in result["rows"]} == expected
    for r in result["rows"]:
        assert {
            "naive_s",
            "dmuon_s",
            "dmuon_serial_s",
            "speedup",
            "dmuon_compute_s",
            "efficiency",
            "split_matrices",
            "max_mb_per_rank",
            "buckets",
            "fan_s",
            "exchange_s",
        } <= set(r)
        assert r["speedup"] > 1 and r["speedup"] == pytest.approx(r["naive_s"] / r["dmuon_s"])
        assert r["dmuon_compute_s"] <= r["dmuon_s"] <= r["dmuon_serial_s"] + 1e-12
        assert 0 < r["efficiency"] <= 1 and r["max_mb_per_rank"] > 0
    for w, label in [(8, "hsdp 1x8"), (16, "hsdp 2x8"), (32, "hsdp 4x8")]:
        row = _row(result, "hsdp", "off", w)
        assert row["label"] == label and row["replicas"] == w // 8 and row["ranks_per_replica"] == 8
    # at W = 8 both layouts are the same single node, so the same plan and times
    for key in ("naive_s", "dmuon_s", "efficiency", "max_mb_per_rank"):
        assert _row(result, "flat", "off", 8)[key] == pytest.approx(_row(result, "hsdp", "off", 8)[key])


def test_script_splitting_never_slows_the_predicted_compute(run: tuple[dict, Path, Path]) -> None:
    """split=auto keeps a split plan only if its buckets' NS (plus their all-to-all latency) is
    predicted faster than the owner-only plan's, at every W (12 included)."""
    result = run[0]
    for layout in ("flat", "hsdp"):
        for world in (8, 12, 16, 32):
            if layout == "hsdp" and world == 12:
                continue
            off, auto = _row(result, layout, "off", world), _row(result, layout, "auto", world)
            assert off["split_matrices"] == 0
            latency = 2 * 20e-6 * (auto["ranks_per_replica"] - 1)
            assert auto["dmuon_compute_s"] + auto["buckets"] * latency <= (
                off["dmuon_compute_s"] + off["buckets"] * latency
            ) * (1 + 1e-9), (layout, world)
    # at 32 ranks pi0_small's largest matrices are each more than a rank's share: auto splits them
    assert _row(result, "flat", "auto", 32)["split_matrices"] > 0
    assert (
        _row(result, "flat", "auto", 32)["efficiency"] > _row(result, "flat", "off", 32)["efficiency"] + 0.1
    )


def test_script_counts_the_hsdp_fan_out(run: tuple[dict, Path, Path]) -> None:
    result = run[0]
    for split in ("off", "auto"):
        assert (
            _row(result, "hsdp", split, 8)["fan_s"] == 0 == _row(result, "hsdp", split, 8)["fan_mb_per_rank"]
        )
        assert _row(result, "flat", split, 32)["fan_s"] == 0
        for world in (16, 32):
            row = _row(result, "hsdp", split, world)
            assert row["fan_s"] > 0 and row["fan_mb_per_rank"] > 0
            # exact moves no more bytes than padded; it pays one more message latency per bucket
            assert row["fan_padded_s"] + row["buckets"] * 20e-6 >= row["fan_exact_s"] > 0
            # HSDP exchanges stay inside a node of 8: less exchange time than flat FSDP over W ranks
            assert row["exchange_s"] < _row(result, "flat", split, world)["exchange_s"]
            assert row["dmuon_serial_s"] == pytest.approx(
                row["dmuon_compute_s"] + 2 * row["exchange_s"] + row["fan_s"]
            )
    # 2 replicas: each rank receives the other replica's half of its rows, at least
    elements = result["meta"]["elements"]
    assert _row(result, "hsdp", "off", 16)["fan_mb_per_rank"] >= elements * 4 / 8 / 2**20 * 0.99


def test_script_options_price_what_the_optimizer_would_send() -> None:
    """--exchange / --hsdp-sharing / --bucket-mb auto / --wire reach the plan and the prices: two-level
    only across nodes; auto sharing and tuned buckets never predicted slower; a bf16 wire halves the
    returned bytes."""
    matrices = sim.muon_matrices("pi0_small")
    net = sim.Network(alpha=20e-6, intra=200e9, inter=20e9, gpus_per_node=8)
    cost = dataclasses.replace(
        CostModel(flops_per_second=1e12),
        latency_s=net.alpha,
        bandwidth=net.intra,
        ranks_per_node=8,
        inter_node_bandwidth=net.inter,
    )

    def row(layout: str, **options) -> dict:
        return sim.simulate(matrices, layout, "off", 32, cost, net, **options)

    two, flat = row("flat"), row("flat", exchange="flat")
    assert two["two_level"] == 1.0 and flat["two_level"] == 0.0 and two["exchange_s"] < flat["exchange_s"]
    assert row("hsdp")["two_level"] == 0.0  # the shard group is one node
    shared, auto = row("hsdp", sharing="all"), row("hsdp", sharing="auto")
    assert auto["dmuon_s"] <= shared["dmuon_s"] and shared["replica_local_buckets"] == 0
    assert row("flat", tune_buckets=True)["dmuon_s"] <= two["dmuon_s"]
    wired = row("hsdp", sharing="all", wire="bf16")
    assert wired["return_s"] < shared["return_s"] and wired["exchange_s"] == pytest.approx(
        shared["exchange_s"]
    )
    assert wired["fan_s"] < shared["fan_s"]
