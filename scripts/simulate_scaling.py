"""Predicted Muon optimizer-step time of full-size pi0 on W ranks: naive FSDP2 Muon vs dmuon.

    python scripts/simulate_scaling.py [--preset pi0] [--worlds 8,16,64,128,1024]
                                       [--flops-per-second F]
                                       [--alpha-us 20] [--bandwidth-gbs 25] [--bucket-mb 64]
                                       [--planner lpt|milp] [--json PATH] [--plot PATH]

Matrices: the preset's Muon parameters (dmuon.param_groups with the trainer's pi0 routing), read on
the meta device. Compute: the planner's cost model, calibrated by default (Newton-Schulz timed once per
shape class on this machine at batch 1 and 2, cached like dmuon's cost_model="calibrated"), or the
FLOP model at F FLOP/s when --flops-per-second F is given. Communication: an alpha-beta model, alpha seconds per message and
1 / bandwidth seconds per byte per rank; a ring collective over W ranks sends W-1 messages.

  naive:  for every matrix, an all-gather of its shards ((W-1)/W of its bytes arrive at each rank),
          then every rank orthogonalises it (standard NS, one call per matrix); nothing overlaps.
  dmuon:  the plan's buckets; per bucket an all-to-all to the owners (alpha (W-1) + the busiest
          rank's bytes / bandwidth), the slowest owner's batched NS, and the all-to-all back. With
          overlap, bucket k's compute hides the exchange of k+1 and the return of k-1:
          T = fwd_0 + sum_k max(compute_k, fwd_{k+1} + ret_{k-1}) + ret_last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dmuon
from dmuon.functional import NSConfig, matrix_shape
from dmuon.layout import chunk_rows
from dmuon.planner import CostModel, MatrixSpec, Plan, build_plan, rank_loads


def muon_matrices(preset: str) -> list[tuple[str, tuple[int, int]]]:
    from vla.models import build_policy

    with torch.device("meta"):
        policy = build_policy(preset)
    from vla.training.config import OptimConfig
    from vla.training.optim import routing_rules

    groups = dmuon.param_groups(policy, rules=routing_rules(OptimConfig()))  # the trainer's routing
    out = []
    for group in groups:
        if group["algorithm"] == "muon":
            out += [(n, matrix_shape(p.shape)) for n, p in zip(group["param_names"], group["params"])]
    return out


def ns_config(algorithm: str) -> NSConfig:
    return NSConfig(steps=5, coefficients=tuple(dmuon.coefficient_schedule("jordan", 5)), algorithm=algorithm)


def all_to_all_seconds(plan: Plan, bucket: tuple[int, ...], alpha: float, beta: float) -> float:
    """One direction of a bucket's exchange: latency plus the busiest rank's bytes."""
    busiest = [0] * plan.world
    for i in bucket:
        spec, owner = plan.specs[i], plan.owners[i]
        for r, rows in enumerate(spec.rows or ()):
            if r != owner and rows:
                busiest[r] += rows * spec.n * 4
                busiest[owner] += rows * spec.n * 4
    return alpha * (plan.world - 1) + max(busiest) / 2 * beta


def dmuon_seconds(plan: Plan, cost: CostModel, alpha: float, beta: float) -> tuple[float, float, float]:
    """(serial, overlapped, compute-only) predicted seconds."""
    compute = [
        max(rank_loads([plan.specs[i] for i in b], [plan.owners[i] for i in b], plan.world, cost))
        for b in plan.buckets
    ]
    comm = [all_to_all_seconds(plan, b, alpha, beta) for b in plan.buckets]
    serial = sum(compute) + 2 * sum(comm)
    k = len(plan.buckets)
    overlapped = comm[0] + comm[-1]
    for j in range(k):
        hidden = (comm[j + 1] if j + 1 < k else 0.0) + (comm[j - 1] if j > 0 else 0.0)
        overlapped += max(compute[j], hidden)
    return serial, overlapped, sum(compute)


def naive_seconds(specs: list[MatrixSpec], world: int, cost: CostModel, alpha: float, beta: float) -> float:
    total = 0.0
    for spec in specs:
        standard = (spec.m, spec.n, ns_config("standard"))
        total += cost.matrix_seconds(standard)
        total += alpha * (world - 1) + (world - 1) / world * spec.numel * 4 * beta
    return total


def calibrated_cost(classes: list[tuple], flops_per_second: float | None) -> tuple[CostModel, str]:
    if flops_per_second:
        return CostModel(flops_per_second=flops_per_second), f"FLOP model at {flops_per_second:.3g} FLOP/s"
    path = CostModel.default_cache_path(torch.device("cpu"))
    model = CostModel.load(path) if path.exists() else CostModel()
    missing = [c for c in classes if not model.profile.get(_key(c))]
    if missing:
        print(f"calibrating {len(missing)} shape classes on this CPU (cached in {path}) ...", flush=True)
    model.calibrate(classes, batch_sizes=(1, 2), repeats=1)
    model.save(path)
    return model, f"calibrated on this machine ({torch.get_num_threads()} threads, cache {path})"


def _key(cls: tuple) -> str:
    m, n, ns = cls
    return f"{m}x{n}|{ns.algorithm_for((m, n))}|{ns.steps}|float32"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="pi0")
    parser.add_argument("--worlds", default="8,16,64,128,1024")
    parser.add_argument(
        "--flops-per-second", type=float, default=None, help="use the FLOP model instead of calibrating"
    )
    parser.add_argument("--alpha-us", type=float, default=20.0)
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--planner", choices=["lpt", "milp"], default="lpt")
    parser.add_argument("--json", type=Path, default=Path("bench_results/simulate_scaling.json"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    alpha, beta = args.alpha_us * 1e-6, 1.0 / (args.bandwidth_gbs * 1e9)

    matrices = muon_matrices(args.preset)
    auto = ns_config("auto")
    classes = sorted(
        {(m, n, auto) for _, (m, n) in matrices} | {(m, n, ns_config("standard")) for _, (m, n) in matrices},
        key=str,
    )
    cost, cost_note = calibrated_cost(classes, args.flops_per_second)
    elements = sum(m * n for _, (m, n) in matrices)
    print(
        f"{args.preset}: {len(matrices)} Muon matrices, {elements / 1e9:.2f}B elements; compute: {cost_note}"
    )
    print(
        f"communication: alpha {args.alpha_us} us per message, {args.bandwidth_gbs} GB/s per rank; buckets {args.bucket_mb} MB"
    )
    rows = []
    header = (
        f"{'W':>5} {'naive s':>9} {'dmuon s':>9} {'serial s':>9} {'speedup':>8} {'NS s':>7} "
        f"{'efficiency':>10} {'max MB/rank':>11} {'buckets':>7}"
    )
    print(header)
    print("-" * len(header))
    for world in worlds:
        specs = [MatrixSpec(name, m, n, auto, chunk_rows(m, world)) for name, (m, n) in matrices]
        plan = build_plan(
            specs, world, strategy=args.planner, cost=cost, bucket_bytes=int(args.bucket_mb * 2**20)
        )
        serial, overlapped, compute = dmuon_seconds(plan, cost, alpha, beta)
        naive = naive_seconds(specs, world, cost, alpha, beta)
        max_mb = max(s + r for s, r in plan.traffic()) / 2**20
        rows.append(
            {
                "world": world,
                "naive_s": naive,
                "dmuon_s": overlapped,
                "dmuon_serial_s": serial,
                "dmuon_compute_s": compute,
                "speedup": naive / overlapped,
                "efficiency": plan.efficiency,
                "max_mb_per_rank": max_mb,
                "buckets": len(plan.buckets),
                "largest_matrix_s": max(cost.matrix_seconds(s.shape_class) for s in specs),
                "ideal_compute_s": sum(plan.rank_seconds) / world,
            }
        )
        r = rows[-1]
        print(
            f"{world:>5} {naive:>9.3f} {overlapped:>9.3f} {serial:>9.3f} {r['speedup']:>8.1f} {compute:>7.3f} "
            f"{plan.efficiency:>10.3f} {max_mb:>11.1f} {len(plan.buckets):>7}"
        )
    worst = min(rows, key=lambda r: r["efficiency"])
    print(
        f"\nlowest efficiency {worst['efficiency']:.3f} at W={worst['world']}: ideal per-rank NS "
        f"{worst['ideal_compute_s']:.3f}s, but the largest single matrix alone takes {worst['largest_matrix_s']:.3f}s"
    )
    meta = {
        "preset": args.preset,
        "matrices": len(matrices),
        "elements": elements,
        "cost": cost_note,
        "alpha_s": alpha,
        "bandwidth_bytes_per_s": 1 / beta,
        "bucket_mb": args.bucket_mb,
        "planner": args.planner,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
        ws = [r["world"] for r in rows]
        ax1.loglog(ws, [r["naive_s"] for r in rows], "o-", label="naive FSDP2 Muon")
        ax1.loglog(ws, [r["dmuon_s"] for r in rows], "o-", label="dmuon (overlap)")
        ax1.set_xlabel("ranks W")
        ax1.set_ylabel("predicted optimizer step (s)")
        ax1.legend()
        ax2.semilogx(ws, [r["efficiency"] for r in rows], "o-")
        ax2.axhline(0.95, color="gray", linestyle="--")
        ax2.set_xlabel("ranks W")
        ax2.set_ylabel("balance efficiency")
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
