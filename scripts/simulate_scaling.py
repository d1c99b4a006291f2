"""Predicted Muon optimizer-step time of pi0 on W ranks: naive FSDP2 Muon vs dmuon, under flat FSDP2 and
HSDP, with and without split Newton-Schulz. A model, not a measurement: nothing runs on W ranks.

    python scripts/simulate_scaling.py [--preset pi0] [--worlds 8,16,64,128,1024]
        [--layouts flat,hsdp] [--gpus-per-node 8] [--splits off,auto]
        [--flops-per-second F] [--alpha-us 20] [--intra-gbs 200] [--inter-gbs 25]
        [--bucket-mb 64] [--planner lpt|milp] [--fan-out exact|padded] [--json PATH] [--plot PATH]

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
the same node and inter bytes/s to a rank on another node; 4 bytes per element. A collective over P
ranks takes alpha (P-1) plus, on its busiest rank, max(sent, received) of its intra-node bytes / intra
+ max(sent, received) of its inter-node bytes / inter (the two kinds of link do not overlap).

  naive   every matrix in turn: a ring all-gather of its shards over its shard group of P ranks
          (flat: all W, at intra if W <= G, else inter; hsdp: the ranks of one node, at intra),
          alpha (P-1) + (P-1)/P of its bytes / bandwidth; then every rank orthogonalises the whole
          matrix (standard NS, one call per matrix). Nothing overlaps; HSDP replicas repeat it all.
  dmuon   per bucket k:
    fwd_k   the all-to-all inside each replica's shard group (all replicas at once), one collective
            over P ranks: shard rank s of the computing replica sends member j of a matrix's owner
            or split group its piece (Plan.pieces); nothing moves when sender = member.
    ret_k   the reverse all-to-all: the same pieces of the results go back; ret_k = fwd_k.
    fan_k   HSDP with R = W/G > 1 replicas: per shard rank s, an exchange over the R replicas
            (one rank per node: all inter-node) of the rows at s of the results each replica
            computed. --fan-out exact (default, what dmuon.comm sends: one broadcast per replica,
            each of that replica's own c_r bytes, relayed along a ring as NCCL pipelines them):
            alpha R + the busiest rank's max(sent, received) / inter, where a rank receives the
            other replicas' contributions and forwards all but its ring successor's; padded (a
            plain all-gather): every replica contributes the largest replica's c bytes,
            alpha (R-1) + (R-1) max c / inter.
    serial:  sum_k (fwd_k + compute_k + ret_k + fan_k).
    overlap: the schedule of dmuon.comm.sharded_orthogonalize: fwd_{k+1} is issued before compute_k,
             ret_k right after it, fan_k once ret_k has arrived (after compute_{k+1}). So compute_k
             hides fwd_{k+1} + ret_{k-1} + fan_{k-2} (transfers in flight together add up):
             T = fwd_0 + sum_k max(compute_k, fwd_{k+1} + ret_{k-1} + fan_{k-2})
                 + ret_last + fan_{last-1} + fan_last.

Columns: naive s; dmuon s (overlapped T); serial s; speedup = naive / dmuon, both in the same layout;
NS s = sum_k compute_k; efficiency = plan.efficiency (all NS work / W over the slowest rank's NS
seconds, split collectives counted as lost time); split = matrices the plan splits; max MB/rank =
the busiest rank's MiB sent + received in one step (exchange, return, fan-out as modelled, split
groups' ring collectives); buckets; plan s = seconds build_plan took here. --json PATH (default
bench_results/simulate_scaling.json): {"meta": ..., "rows": [...]}, the rows with these columns and
the parts (exchange_s = sum fwd_k; fan_s = sum fan_k, fan_padded_s and fan_exact_s both ways;
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
from vla.help_format import HelpFormatter

ELEMENT_BYTES = 4
LAYOUTS = ("flat", "hsdp")
SPLITS = ("off", "auto", "always")


@dataclasses.dataclass(frozen=True)
class Network:
    """alpha seconds per message; intra / inter: bytes per second per rank and direction."""

    alpha: float
    intra: float
    inter: float
    gpus_per_node: int

    def same_node(self, a: int, b: int) -> bool:
        return a // self.gpus_per_node == b // self.gpus_per_node

    def busiest_seconds(
        self, intra_bytes: list[tuple[int, int]], inter_bytes: list[tuple[int, int]]
    ) -> float:
        """The slowest rank's transfer time: max(sent, received) per link kind, the kinds added."""
        return max(
            (max(a) / self.intra + max(e) / self.inter for a, e in zip(intra_bytes, inter_bytes)),
            default=0.0,
        )


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


def exchange(plan: Plan, bucket: tuple[int, ...], net: Network) -> tuple[float, list[int]]:
    """One direction of a bucket's all-to-all inside every replica's shard group: (seconds, bytes sent +
    received per domain rank)."""
    size, world = plan.ranks_per_replica, plan.world
    sent = {True: [0] * world, False: [0] * world}  # keyed by "same node"
    received = {True: [0] * world, False: [0] * world}
    for i in bucket:
        group, base = plan.members[i], plan.replica_of(i) * size
        for s, j, lo, hi, c0, c1 in plan.pieces(i):
            src, dst = base + s, group[j]
            if src == dst:
                continue
            nbytes = (hi - lo) * (c1 - c0) * ELEMENT_BYTES
            local = net.same_node(src, dst)
            sent[local][src] += nbytes
            received[local][dst] += nbytes
    intra = list(zip(sent[True], received[True]))
    inter = list(zip(sent[False], received[False]))
    per_rank = [sum(a) + sum(e) for a, e in zip(intra, inter)]
    if size <= 1:
        return 0.0, per_rank
    return net.alpha * (size - 1) + net.busiest_seconds(intra, inter), per_rank


def fan_out(plan: Plan, bucket: tuple[int, ...], net: Network, *, padded: bool) -> tuple[float, list[int]]:
    """A bucket's HSDP fan-out, one ring all-gather per shard rank over the replicas (one rank per node,
    so inter-node): (seconds, bytes sent + received per domain rank). Exact (dmuon.comm's broadcast
    per replica, relayed on a ring): every replica's own contribution; padded (a plain all-gather):
    every replica sends the largest replica's contribution."""
    replicas, size, world = plan.replicas, plan.ranks_per_replica, plan.world
    if replicas <= 1:
        return 0.0, [0] * world
    contribution = [[0] * size for _ in range(replicas)]  # [replica][shard rank] bytes of results
    for i in bucket:
        spec, replica = plan.specs[i], plan.replica_of(i)
        for s, rows in enumerate(spec.rows or ()):
            contribution[replica][s] += rows * spec.n * ELEMENT_BYTES
    per_rank = [0] * world
    busiest = 0
    for s in range(size):
        column = [contribution[r][s] for r in range(replicas)]
        total, width = sum(column), max(column)
        for r in range(replicas):
            if padded:
                sent = received = (replicas - 1) * width
            else:  # a ring rank forwards every block but its successor's and receives all but its own
                sent, received = total - column[(r + 1) % replicas], total - column[r]
            per_rank[r * size + s] = sent + received
            busiest = max(busiest, sent, received)
    latency = net.alpha * (replicas - 1 if padded else replicas)  # one collective, or R broadcasts
    return latency + busiest / net.inter, per_rank


def split_bytes(plan: Plan, bucket: tuple[int, ...]) -> list[int]:
    """Bytes sent + received per domain rank by split groups' m x m collectives (ring volumes, as in
    Plan.traffic); their time is already in plan.bucket_seconds."""
    per_rank = [0] * plan.world
    for i in bucket:
        group = plan.members[i]
        if len(group) > 1:
            volume = plan.specs[i].split_ring_bytes(len(group), ELEMENT_BYTES)
            for w in group:
                per_rank[w] += 2 * volume
    return per_rank


def dmuon_seconds(plan: Plan, net: Network, *, padded_fan_out: bool = False) -> dict[str, float]:
    """Per-part and total predicted seconds of the plan's step, and the busiest rank's megabytes."""
    compute = [max(loads) for loads in plan.bucket_seconds]
    exchanges = [exchange(plan, b, net) for b in plan.buckets]
    fans = [fan_out(plan, b, net, padded=padded_fan_out) for b in plan.buckets]
    other_fan = sum(fan_out(plan, b, net, padded=not padded_fan_out)[0] for b in plan.buckets)
    fwd = [t for t, _ in exchanges]
    fan = [t for t, _ in fans]
    k = len(plan.buckets)

    def at(xs: list[float], j: int) -> float:
        return xs[j] if 0 <= j < k else 0.0

    overlapped = at(fwd, 0) + at(fwd, k - 1) + at(fan, k - 2) + at(fan, k - 1)
    for j in range(k):
        overlapped += max(compute[j], at(fwd, j + 1) + at(fwd, j - 1) + at(fan, j - 2))
    per_rank = [0] * plan.world
    for b, (_, moved), (_, fanned) in zip(plan.buckets, exchanges, fans):
        for w, nbytes in enumerate(split_bytes(plan, b)):
            per_rank[w] += 2 * moved[w] + fanned[w] + nbytes  # exchange and return move the same bytes
    fan_mb = max((sum(f[1][w] for f in fans) for w in range(plan.world)), default=0) / 2**20
    return {
        "dmuon_s": overlapped,
        "dmuon_serial_s": sum(compute) + 2 * sum(fwd) + sum(fan),
        "dmuon_compute_s": sum(compute),
        "exchange_s": sum(fwd),
        "fan_s": sum(fan),
        "fan_padded_s": sum(fan) if padded_fan_out else other_fan,
        "fan_exact_s": other_fan if padded_fan_out else sum(fan),
        "fan_mb_per_rank": fan_mb,
        "max_mb_per_rank": max(per_rank, default=0) / 2**20,
    }


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
) -> dict | None:
    """One table row: the plan of `matrices` under (layout, split, world) and its predicted times."""
    size = ranks_per_replica(layout, world, net.gpus_per_node)
    if size is None:
        return None
    auto = ns_config("auto")
    specs = [MatrixSpec(name, m, n, auto, chunk_rows(m, size)) for name, (m, n) in matrices]
    start = time.perf_counter()
    plan = build_plan(
        specs,
        world,
        strategy=planner,
        cost=cost,
        bucket_bytes=bucket_bytes,
        split=split,
        ranks_per_replica=size,
    )
    plan_s = time.perf_counter() - start
    parts = dmuon_seconds(plan, net, padded_fan_out=fan_out_mode == "padded")
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
    parser.add_argument("--bucket-mb", type=float, default=64.0)
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
        f"buckets {args.bucket_mb} MB; planner {args.planner}; HSDP fan-out {args.fan_out}"
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
                    bucket_bytes=int(args.bucket_mb * 2**20),
                    fan_out_mode=args.fan_out,
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
