"""Optimizer-step time under FSDP2 on gloo: AdamW vs naive Muon vs dmuon (LPT, MILP, ablations).

    python scripts/bench_optimizer.py --nproc 2 [--preset pi0_small | --shapes dominant] [--steps 5]
                                      [--warmup 2] [--only CONFIG ...] [--json PATH] [--plot PATH]

Re-launches itself under torchrun (one thread per rank). Each rank builds the preset's parameter
shapes on the meta device, materialises them as FSDP2-sharded (Shard(0)) stand-ins, fills random
gradients and times `optimizer.step()` between barriers: median of --steps after --warmup (the
first step builds state and the plan). Configurations:

  adamw          torch.optim.AdamW (fused) on every parameter
  naive          Muon, the DMuon paper's vanilla baseline: every rank all-gathers every matrix and
                 orthogonalises all of them, one standard-NS call each (fp32)
  dmuon_std      dmuon owners (LPT) with standard NS: the gain from sharing the work alone
  dmuon_lpt      dmuon owners (LPT), NS "auto" (Gram on wide matrices), batching, pipelined buckets,
                 split="off": one owner per matrix
  dmuon_milp     as dmuon_lpt, owners from the MILP
  dmuon_serial   as dmuon_lpt without overlap (every collective waited for at once)
  dmuon_split    as dmuon_lpt with split="auto" (dmuon's default): the planner splits a matrix over
                 a group of ranks where that matrix alone outlasts the ideal per-rank load
  dmuon_split_all  as dmuon_lpt with split="always": every matrix split over all ranks
Muon configurations route embeddings, heads, norms and biases to AdamW (dmuon.param_groups).

--shapes dominant replaces the preset by a set with one dominant matrix (a 1024 x 4096 MLP-like
matrix beside 16 matrices of 256 x 1024 and 8 of 256 x 256, and a 2048 x 256 embedding for AdamW):
no owner-only plan can finish before the big matrix, which is what splitting is for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vla.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "adamw": None,
    "naive": {"distribution": "naive", "ns_algorithm": "standard"},
    "dmuon_std": {"planner": "lpt", "ns_algorithm": "standard", "split": "off"},
    "dmuon_lpt": {"planner": "lpt", "ns_algorithm": "auto", "split": "off"},
    "dmuon_milp": {"planner": "milp", "ns_algorithm": "auto", "split": "off"},
    "dmuon_serial": {"planner": "lpt", "ns_algorithm": "auto", "overlap": False, "split": "off"},
    "dmuon_split": {"planner": "lpt", "ns_algorithm": "auto", "split": "auto"},
    "dmuon_split_all": {"planner": "lpt", "ns_algorithm": "auto", "split": "always"},
}
DOMINANT_SHAPES = (
    [("embed_tokens.weight", (2048, 256)), ("mlp.dominant.weight", (1024, 4096))]
    + [(f"blocks.{i}.proj.weight", (256, 1024)) for i in range(16)]
    + [(f"blocks.{i}.attn.weight", (256, 256)) for i in range(8)]
)


def preset_parameters(preset: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every trainable parameter of a policy preset, read on the meta device."""
    from vla.models import build_policy

    with torch.device("meta"):
        policy = build_policy(preset)
    return [(n, tuple(p.shape)) for n, p in policy.named_parameters() if p.requires_grad]


class StandIn(torch.nn.Module):
    """Parameters with the preset's names and shapes, one submodule per top-level block for FSDP."""

    def __init__(self, parameters: list[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        self.names = [n for n, _ in parameters]
        self.blocks = torch.nn.ModuleList()
        for _, shape in parameters:
            block = torch.nn.Module()
            block.weight = torch.nn.Parameter(torch.randn(shape) * 0.02)
            self.blocks.append(block)

    def original_named_parameters(self):
        return [(name, block.weight) for name, block in zip(self.names, self.blocks)]


def build_optimizer(model: StandIn, config: dict | None, milp_time_limit: float, bucket_mb: float):
    import dmuon

    if config is None:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    from vla.training.config import OptimConfig
    from vla.training.optim import routing_rules

    class Named(torch.nn.Module):  # routing by the preset's real names, as the trainer routes them
        def named_parameters(self, *args, **kwargs):
            return iter(model.original_named_parameters())

    options = {"bucket_mb": bucket_mb, **config} if config.get("distribution") != "naive" else config
    groups = dmuon.param_groups(Named(), routing_rules(OptimConfig()))
    return dmuon.Muon(groups, lr=0.02, adamw_lr=1e-4, milp_time_limit=milp_time_limit, **options)


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise SystemExit("bench_optimizer.py --device cuda: no CUDA device here")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mesh = init_device_mesh(args.device, (world,))
    parameters = DOMINANT_SHAPES if args.shapes == "dominant" else preset_parameters(args.preset)
    names = [name for name in CONFIGS if not args.only or name in args.only]
    setups = {}
    for name in names:
        with torch.device(args.device):
            model = StandIn(parameters)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = build_optimizer(model, CONFIGS[name], args.milp_time_limit, args.bucket_mb)
        gen = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            local = p.grad.to_local()
            local.copy_(torch.randn(local.shape, generator=gen))
        for _ in range(args.warmup):  # state, plans, calibration
            opt.step()
        setups[name] = (model, opt)

    def timed_step(opt) -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - start

    # Round-robin over the configurations, so a slow spell of the machine hits all of them alike.
    times: dict[str, list[float]] = {name: [] for name in names}
    phases: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.steps):
        for name in names:
            opt = setups[name][1]
            times[name].append(timed_step(opt))
            phases[name].append(dict(getattr(opt, "last_step_stats", {})))
    results = {}
    for name in names:
        opt = setups[name][1]
        results[name] = {"median_s": statistics.median(times[name]), "samples_s": times[name]}
        if phases[name][0]:
            keys = phases[name][0]
            results[name]["phases_s"] = {k: statistics.median(p[k] for p in phases[name]) for k in keys}
        config = CONFIGS[name]
        if config is not None and config.get("distribution") != "naive" and opt.plans():
            plan = opt.plans()[0]
            results[name]["plan"] = {
                "strategy": plan.strategy,
                "efficiency": plan.efficiency,
                "stage_efficiency": plan.stage_efficiency,
                "buckets": len(plan.buckets),
                "predicted_rank_s": list(plan.rank_seconds),
            }
            results[name]["plan"]["split_matrices"] = len(plan.split_indices)
            if rank == 0 and name in ("dmuon_lpt", "dmuon_split"):
                print(f"{name}:\n{opt.plan_summary()}", flush=True)
    if rank == 0:
        report(results, args, world)
    dist.destroy_process_group()


def report(results: dict, args: argparse.Namespace, world: int) -> None:
    naive = results.get("naive", {}).get("median_s")
    adamw = results.get("adamw", {}).get("median_s")
    owner_only = results.get("dmuon_lpt", {}).get("median_s")
    label = "one-dominant-matrix shapes" if args.shapes == "dominant" else f"{args.preset} stand-ins"
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(f"\noptimizer.step() on {label}, FSDP2 over {world} {backend} ranks, median of {args.steps}")
    print(
        f"{'config':<16} {'median ms':>10} {'naive / x':>10} {'x / adamw':>10} {'x / lpt*':>8} {'plan eff.':>9} "
        f"{'split':>5}   phases ms (momentum / orthogonalize (comm wait) / apply / adamw)"
    )
    for name, row in results.items():
        speedup = naive / row["median_s"] if naive else float("nan")
        over_adamw = row["median_s"] / adamw if adamw else float("nan")
        # Paired: the configurations run in rounds, so a slow spell of the machine hits a round alike.
        over_owner = (
            statistics.median(x / o for x, o in zip(row["samples_s"], results["dmuon_lpt"]["samples_s"]))
            if owner_only
            else float("nan")
        )
        row["speedup_vs_naive"], row["ratio_vs_adamw"] = speedup, over_adamw
        row["ratio_vs_owner_only"] = over_owner
        splits = row.get("plan", {}).get("split_matrices")
        efficiency = row.get("plan", {}).get("efficiency")
        eff = f"{efficiency:.3f}" if efficiency is not None else "-"
        ph = row.get("phases_s")
        phases = (
            f"{ph['momentum_s'] * 1e3:.0f} / {ph['orthogonalize_s'] * 1e3:.0f} ({ph['comm_wait_s'] * 1e3:.0f}) / "
            f"{ph['apply_s'] * 1e3:.0f} / {ph['adamw_s'] * 1e3:.0f}"
            if ph
            else ""
        )
        print(
            f"{name:<16} {row['median_s'] * 1e3:>10.1f} {speedup:>10.2f} {over_adamw:>10.2f} {over_owner:>8.2f} "
            f"{eff:>9} {'-' if splits is None else splits:>5}   {phases}"
        )
    payload = {
        "preset": args.preset,
        "shapes": args.shapes,
        "world": world,
        "steps": args.steps,
        "torch": torch.__version__,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2))
    if owner_only:
        print("x / lpt*: median over rounds of each round's ratio to dmuon_lpt (owners only, split off)")
    print(f"wrote {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(results)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(names, [results[n]["median_s"] * 1e3 for n in names], color="tab:blue")
        ax.set_ylabel("optimizer.step() ms (median)")
        ax.set_title(f"{label}, FSDP2 on {world} gloo ranks")
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL (gloo on CPU)"
    )
    parser.add_argument("--preset", default="pi0_small")
    parser.add_argument(
        "--shapes",
        choices=["preset", "dominant"],
        default="preset",
        help="the preset's parameters, or a set with one dominant matrix (see above)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), default=None)
    parser.add_argument("--milp-time-limit", type=float, default=5.0)
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="dmuon pipeline bucket size")
    parser.add_argument("--json", type=Path, default=Path("bench_results/optimizer.json"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    raise SystemExit(relaunch_under_torchrun(args.nproc))


def relaunch_under_torchrun(nproc: int) -> int:
    """Run this script again under torchrun on `nproc` local ranks (torchrun sets 1 thread each)."""
    forwarded, skip = [], False
    for arg in sys.argv[1:]:  # --nproc is ours; torchrun would take it for its own abbreviation
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            forwarded.append(arg)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.call([*command, __file__, *forwarded])


if __name__ == "__main__":
    main()
