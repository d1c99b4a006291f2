"""Predicted Muon optimizer-step time of pi0 on W ranks: naive FSDP2 Muon vs dmuon, under flat FSDP2 and
HSDP, with and without split Newton-Schulz. A model, not a measurement: nothing runs on W ranks.

    python scripts/simulate_scaling.py [--preset pi0] [--worlds 8,16,64,128,1024]
        [--layouts flat,hsdp] [--gpus-per-node 8] [--splits off,auto]
        [--flops-per-second F] [--alpha-us 20] [--intra-gbs 200] [--inter-gbs 25]
        [--bucket-mb 64|auto] [--planner lpt|milp] [--fan-out exact|padded] [--exchange auto|flat|two_level]
        [--hsdp-sharing auto|all] [--wire fp32|bf16|bf16-all] [--json PATH] [--plot PATH]

--bandwidth-gbs is an alias of --inter-gbs. One row per (layout, split, W).

Matrices: the preset's Muon parameters (dmuon.param_groups with the trainer's pi0 routing), read on
the meta device; Newton-Schulz "auto", 5 steps, jordan coefficients.

Layouts (G = --gpus-per-node; domain rank w sits on node w // G):
  flat  FSDP2 over all W ranks: one shard group of W ranks, ranks_per_replica = W.
  hsdp  W/G nodes x G: replicate over nodes, shard within a node, ranks_per_replica = G (W <= G: one
        node of W ranks); a W > G that is not a multiple of G is skipped.
  A matrix's rows are Shard(0) over its shard group of P = ranks_per_replica ranks in torch.chunk
  order: MatrixSpec.rows = dmuon.layout.chunk_rows(m, P).

Compute: Newton-Schulz seconds from the planner's CostModel, calibrated by default (each shape class
timed once on this machine's CPU at batch 1 and 2, cached like dmuon's cost_model="calibrated"), or
FLOPs / F with --flops-per-second F. The plan is dmuon.planner.build_plan(specs, W,
strategy=--planner, bucket_bytes=--bucket-mb MiB, split=off|auto, ranks_per_replica=P) under that
cost model with the network below set in it (latency_s = alpha, bandwidth = intra, ranks_per_node =
G, inter_node_bandwidth = inter), so "auto" prices a split group wider than a node at inter. Bucket
k's compute_k is its slowest rank's plan.bucket_seconds[k]: batched NS, and for a split group 1/k of
the work plus its m x m all-reduces and all-gathers, which are not counted again below.

Network: alpha seconds per message; per rank and direction (full duplex) intra bytes/s to a rank on
the same node and inter bytes/s to a rank on another node.

  naive   every matrix in turn: a ring all-gather of its shards over its shard group of P ranks
          (flat: all W, at intra if W <= G, else inter; hsdp: the ranks of one node, at intra),
          alpha (P-1) + (P-1)/P of its bytes / bandwidth; then every rank orthogonalises the whole
          matrix (standard NS, one call per matrix). Nothing overlaps; HSDP replicas repeat it all.
  dmuon   dmuon.step_model.step_seconds: the messages dmuon.comm sends for this plan (per bucket the
          exchange, flat or two-level (--exchange), the return, the HSDP fan-out of the buckets the
          replicas share; element bytes from --wire), replayed in dmuon.comm's issue order on three
          resources (compute stream, intra- and inter-node link); see its docstring. The plan is the
          one dmuon.Muon builds with the same options (--hsdp-sharing auto: hsdp_replicas="auto";
          --bucket-mb auto: bucket_mb="auto"), priced with the same model by the planner.
    serial:  compute + exchange + return + fan-out, nothing overlapped.

Columns: naive s; dmuon s (overlapped T); serial s; speedup = naive / dmuon, both in the same layout;
NS s = sum_k compute_k; efficiency = plan.efficiency (all NS work / W over the slowest rank's NS
seconds, split collectives counted as lost time); split = matrices the plan splits; max MB/rank =
the busiest rank's MiB sent + received in one step (exchange, return, fan-out as modelled, split
groups' ring collectives); buckets; plan s = seconds build_plan took here. --json PATH (default
bench_results/simulate_scaling.json): {"meta": ..., "rows": [...]}, the rows with these columns and
the parts (exchange_s / return_s: the stages of every bucket summed; fan_s, fan_padded_s and
fan_exact_s both ways; replica_local_buckets; two_level;
fan_mb_per_rank, the busiest rank's fan-out MiB sent + received; split_groups; plan_s; ...);
--plot PATH: a PNG of efficiency (log x) and speedup (log-log) vs W, one line per (layout, split).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dmuon
from dmuon.functional import NSConfig, matrix_shape
from dmuon.layout import chunk_rows
from dmuon.planner import CostModel, MatrixSpec, Plan, build_plan
from dmuon.step_model import ELEMENT_BYTES, Network, fan_out_transfer, step_seconds
from vla.help_format import HelpFormatter

WIRE_BYTES = {"fp32": (4, 4), "bf16": (4, 2), "bf16-all": (2, 2)}  # (momentum, result) bytes per element
LAYOUTS = ("flat", "hsdp")
SPLITS = ("off", "auto", "always")


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


def ranks_per_replica(layout: str, world: int, gpus_per_node: int) -> int | None:
    """P, the shard group size of `layout` on `world` ranks, or None if hsdp cannot use this W."""
    if layout == "flat" or world <= gpus_per_node:
        return world
    return gpus_per_node if world % gpus_per_node == 0 else None


def dmuon_seconds(
    plan: Plan,
    net: Network,
    *,
    padded_fan_out: bool = False,
    exchange: str = "auto",
    input_bytes: int = ELEMENT_BYTES,
    result_bytes: int = ELEMENT_BYTES,
) -> dict[str, float]:
    """dmuon.step_model's prediction of the plan's step, with the fan-out priced both ways."""
    parts = step_seconds(
        plan,
        net,
        exchange=exchange,
        input_bytes=input_bytes,
        result_bytes=result_bytes,
        padded_fan_out=padded_fan_out,
    )
    fans = {
        padded: sum(
            f.seconds
            for k in range(len(plan.buckets))
            if (f := fan_out_transfer(plan, k, net, padded=padded, element_bytes=result_bytes)) is not None
        )
        for padded in (False, True)
    }
    return parts | {"fan_padded_s": fans[True], "fan_exact_s": fans[False]}


def naive_seconds(specs: list[MatrixSpec], group: int, cost: CostModel, net: Network) -> float:
    """Every rank all-gathers every matrix over its shard group of `group` ranks and orthogonalises it."""
    bandwidth = net.intra if group <= net.gpus_per_node else net.inter
    standard = ns_config("standard")
    total = 0.0
    for spec in specs:
        total += cost.matrix_seconds((spec.m, spec.n, standard))
        if group > 1:
            total += net.alpha * (group - 1) + (group - 1) / group * spec.numel * ELEMENT_BYTES / bandwidth
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


def _csv(value: str, allowed: tuple[str, ...], option: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"{option}: expected a comma list of {allowed}, got {value!r}")
    return items


def simulate(
    matrices: list[tuple[str, tuple[int, int]]],
    layout: str,
    split: str,
    world: int,
    cost: CostModel,
    net: Network,
    *,
    planner: str = "lpt",
    bucket_bytes: int = 64 << 20,
    fan_out_mode: str = "exact",
    exchange: str = "auto",
    sharing: str = "auto",
    tune_buckets: bool = False,
    wire: str = "fp32",
) -> dict | None:
    """One table row: the plan of `matrices` under (layout, split, world) and its predicted times.

    The plan is what dmuon.Muon builds with exchange=`exchange`, hsdp_replicas=`sharing` ("all" is
    the optimizer's "share"), bucket_mb="auto" when `tune_buckets`, and the wire `wire`."""
    size = ranks_per_replica(layout, world, net.gpus_per_node)
    if size is None:
        return None
    auto = ns_config("auto")
    specs = [MatrixSpec(name, m, n, auto, chunk_rows(m, size)) for name, (m, n) in matrices]
    input_bytes, result_bytes = WIRE_BYTES[wire]
    start = time.perf_counter()
    plan = build_plan(
        specs,
        world,
        strategy=planner,
        cost=cost,
        bucket_bytes=bucket_bytes,
        split=split,
        ranks_per_replica=size,
        sharing=sharing,
        tune_buckets=tune_buckets,
        exchange=exchange,
        result_bytes=result_bytes,
    )
    plan_s = time.perf_counter() - start
    parts = dmuon_seconds(
        plan,
        net,
        padded_fan_out=fan_out_mode == "padded",
        exchange=exchange,
        input_bytes=input_bytes,
        result_bytes=result_bytes,
    )
    naive = naive_seconds(specs, size, cost, net)
    nodes = -(-world // net.gpus_per_node)
    label = "flat" if layout == "flat" else f"hsdp {plan.replicas}x{size}"
    return {
        "layout": layout,
        "label": label,
        "split": split,
        "world": world,
        "nodes": nodes,
        "ranks_per_replica": size,
        "replicas": plan.replicas,
        "naive_s": naive,
        **parts,
        "speedup": naive / parts["dmuon_s"],
        "efficiency": plan.efficiency,
        "stage_efficiency": plan.stage_efficiency,
        "split_matrices": len(plan.split_indices),
        "split_groups": [
            {"shape": list(g["shape"]), "ranks": g["ranks"], "matrices": g["matrices"]}
            for g in plan.split_groups()
        ],
        "buckets": len(plan.buckets),
        "replica_local_buckets": sum(1 for k in range(len(plan.buckets)) if plan.sharing(k) == 1)
        if plan.replicas > 1
        else 0,
        "largest_matrix_s": max(cost.matrix_seconds(s.shape_class) for s in specs),
        "ideal_compute_s": plan.work_seconds / world,
        "slowest_rank_s": plan.makespan,
        "plan_s": plan_s,
    }


def plot(rows: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        series.setdefault((r["layout"], r["split"]), []).append(r)
    colors = {"flat": "tab:blue", "hsdp": "tab:orange"}
    markers = {"flat": ("o", 7), "hsdp": ("s", 4)}  # HSDP over flat where they coincide (W <= G)
    styles = {"off": "--", "auto": "-", "always": ":"}
    for (layout, split), points in series.items():
        points = sorted(points, key=lambda r: r["world"])
        ws = [r["world"] for r in points]
        name = "flat FSDP2" if layout == "flat" else f"HSDP ({points[0]['ranks_per_replica']}/node)"
        marker, size = markers.get(layout, ("o", 6))
        kw = {"color": colors.get(layout), "linestyle": styles.get(split, "-"), "marker": marker}
        ax1.semilogx(ws, [r["efficiency"] for r in points], label=f"{name}, split {split}", ms=size, **kw)
        ax2.loglog(ws, [r["speedup"] for r in points], label=f"{name}, split {split}", ms=size, **kw)
    ax1.axhline(0.95, color="gray", linestyle=":", linewidth=1)
    ax1.set_ylim(0, 1.05)
    ax1.set_xlabel("ranks W")
    ax1.set_ylabel("balance efficiency (plan.efficiency)")
    ax2.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax2.set_xlabel("ranks W")
    ax2.set_ylabel("speedup over naive Muon, same layout")
    ax1.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="pi0")
    parser.add_argument("--worlds", default="8,16,64,128,1024")
    parser.add_argument("--layouts", default="flat,hsdp", help="comma list of flat, hsdp")
    parser.add_argument("--splits", default="off,auto", help="comma list of off, auto, always")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--flops-per-second", type=float, default=None, help="use the FLOP model instead of calibrating"
    )
    parser.add_argument("--alpha-us", type=float, default=20.0, help="latency per message (us)")
    parser.add_argument("--intra-gbs", type=float, default=200.0, help="intra-node GB/s per rank")
    parser.add_argument(
        "--inter-gbs",
        "--bandwidth-gbs",
        dest="inter_gbs",
        type=float,
        default=25.0,
        help="inter-node GB/s per rank (--bandwidth-gbs: alias)",
    )
    parser.add_argument(
        "--bucket-mb",
        default="64",
        help="MiB per bucket, or auto (dmuon.Muon(bucket_mb='auto'): 2-8 equal buckets tried as well)",
    )
    parser.add_argument(
        "--exchange",
        choices=["auto", "flat", "two_level"],
        default="auto",
        help="dmuon.Muon(exchange=...): auto is two-level where a shard group spans several nodes",
    )
    parser.add_argument(
        "--hsdp-sharing",
        choices=["auto", "all"],
        default="auto",
        help="HSDP: auto (dmuon.Muon's default hsdp_replicas='auto': matrices every replica computes "
        "itself, chosen by predicted step) or all (hsdp_replicas='share': every bucket fanned out)",
    )
    parser.add_argument(
        "--wire",
        choices=sorted(WIRE_BYTES),
        default="fp32",
        help="fp32 (exact), bf16 (wire_dtype=bf16: results in bf16) or bf16-all (wire_scope='all')",
    )
    parser.add_argument(
        "--fan-out",
        choices=["exact", "padded"],
        default="exact",
        help="HSDP fan-out: exact (dmuon.comm's broadcast per replica) or padded (an all-gather padded to the "
        "largest replica)",
    )
    parser.add_argument("--planner", choices=["lpt", "milp"], default="lpt")
    parser.add_argument("--json", type=Path, default=Path("bench_results/simulate_scaling.json"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    tune_buckets = args.bucket_mb == "auto"
    try:
        bucket_bytes = int((64.0 if tune_buckets else float(args.bucket_mb)) * 2**20)
    except ValueError:
        raise SystemExit(f"--bucket-mb: a number of MiB or auto, got {args.bucket_mb!r}") from None
    layouts = _csv(args.layouts, LAYOUTS, "--layouts")
    splits = _csv(args.splits, SPLITS, "--splits")
    if args.gpus_per_node < 1 or any(w < 1 for w in worlds):
        raise SystemExit("--gpus-per-node and every W must be >= 1")
    net = Network(
        alpha=args.alpha_us * 1e-6,
        intra=args.intra_gbs * 1e9,
        inter=args.inter_gbs * 1e9,
        gpus_per_node=args.gpus_per_node,
    )

    matrices = muon_matrices(args.preset)
    auto = ns_config("auto")
    classes = sorted(
        {(m, n, auto) for _, (m, n) in matrices} | {(m, n, ns_config("standard")) for _, (m, n) in matrices},
        key=str,
    )
    compute_cost, cost_note = calibrated_cost(classes, args.flops_per_second)
    cost = dataclasses.replace(
        compute_cost,
        latency_s=net.alpha,
        bandwidth=net.intra,
        ranks_per_node=net.gpus_per_node,
        inter_node_bandwidth=net.inter,
    )
    elements = sum(m * n for _, (m, n) in matrices)
    print(
        f"{args.preset}: {len(matrices)} Muon matrices, {elements / 1e9:.2f}B elements; compute: {cost_note}"
    )
    print(
        f"communication: alpha {args.alpha_us} us per message, {args.intra_gbs} GB/s intra-node and "
        f"{args.inter_gbs} GB/s inter-node per rank, {args.gpus_per_node} GPUs per node; "
        f"buckets {args.bucket_mb} MB; planner {args.planner}; HSDP fan-out {args.fan_out}, sharing "
        f"{args.hsdp_sharing}; exchange {args.exchange}; wire {args.wire}"
    )
    header = (
        f"{'layout':<12} {'split':>5} {'W':>5} {'naive s':>9} {'dmuon s':>9} {'serial s':>9} {'speedup':>8} "
        f"{'NS s':>7} {'efficiency':>10} {'split':>5} {'max MB/rank':>11} {'buckets':>7} {'plan s':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for layout in layouts:
        for split in splits:
            for world in worlds:
                r = simulate(
                    matrices,
                    layout,
                    split,
                    world,
                    cost,
                    net,
                    planner=args.planner,
                    bucket_bytes=bucket_bytes,
                    fan_out_mode=args.fan_out,
                    exchange=args.exchange,
                    sharing=args.hsdp_sharing,
                    tune_buckets=tune_buckets,
                    wire=args.wire,
                )
                if r is None:
                    print(
                        f"{layout:<12} {split:>5} {world:>5}  skipped: W > {args.gpus_per_node} is not a "
                        f"multiple of --gpus-per-node"
                    )
                    continue
                rows.append(r)
                print(
                    f"{r['label']:<12} {split:>5} {world:>5} {r['naive_s']:>9.3f} {r['dmuon_s']:>9.4f} "
                    f"{r['dmuon_serial_s']:>9.4f} {r['speedup']:>8.1f} {r['dmuon_compute_s']:>7.4f} "
                    f"{r['efficiency']:>10.3f} {r['split_matrices']:>5} {r['max_mb_per_rank']:>11.1f} "
                    f"{r['buckets']:>7} {r['plan_s']:>6.2f}",
                    flush=True,
                )
    if rows:
        print()
        for layout in layouts:
            for split in splits:
                mine = [r for r in rows if r["layout"] == layout and r["split"] == split]
                if not mine:
                    continue
                worst = min(mine, key=lambda r: r["efficiency"])
                ideal, slowest, largest = (
                    worst[k] * 1e3 for k in ("ideal_compute_s", "slowest_rank_s", "largest_matrix_s")
                )
                print(
                    f"lowest efficiency, {layout} split {split}: {worst['efficiency']:.3f} at "
                    f"W={worst['world']} ({worst['label']}): ideal per-rank NS {ideal:.4g} ms, "
                    f"slowest rank {slowest:.4g} ms, largest single matrix alone {largest:.4g} ms"
                )
    meta = {
        "preset": args.preset,
        "matrices": len(matrices),
        "elements": elements,
        "cost": cost_note,
        "alpha_s": net.alpha,
        "intra_bandwidth_bytes_per_s": net.intra,
        "inter_bandwidth_bytes_per_s": net.inter,
        "gpus_per_node": net.gpus_per_node,
        "bucket_mb": args.bucket_mb,
        "planner": args.planner,
        "fan_out": args.fan_out,
        "exchange": args.exchange,
        "hsdp_sharing": args.hsdp_sharing,
        "wire": args.wire,
        "layouts": layouts,
        "splits": splits,
        "worlds": worlds,
    }
    result = {"meta": meta, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    if args.plot:
        title = (
            f"{args.preset}, {len(matrices)} Muon matrices; compute: {cost_note.split(' (')[0]}; "
            f"alpha {args.alpha_us} us, {args.intra_gbs} / {args.inter_gbs} GB/s intra / inter"
        )
        plot(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return result


if __name__ == "__main__":
    main()
