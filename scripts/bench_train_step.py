"""End-to-end training step time: AdamW vs naive Muon vs dmuon, on 1 and 2 processes (FSDP2, gloo).

    python scripts/bench_train_step.py [--model pi0_small] [--steps 6] [--warmup 2] [--batch 8]
                                       [--nprocs 1,2] [--optims adamw,muon,dmuon] [--compile off,on]
                                       [--train-arg KEY=VALUE ...] [--json PATH] [--plot PATH]

Each configuration is a real `train.py` run (the same seed, global batch, precision and data), one
process with parallel=none or N processes under torchrun with parallel=fsdp2. From its
metrics.jsonl the script takes the median over the steps after --warmup of the time split the
trainer logs: data, forward+backward, optimizer (and the optimizer's exposed communication).

Reported: the table (with each run's peak memory per rank and, compiled, its compile seconds), the
JSON, a stacked-bar PNG, and at each process count the fraction of naive Muon's extra step time over
AdamW that dmuon removes: (muon - dmuon) / (muon - adamw). --compile off,on runs every configuration
eager and with trainer.compile=true; --train-arg passes any other train.py override (bf16, gradient
checkpointing, ...) to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from vla.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("data_s", "forward_backward_s", "optimizer_s", "optimizer_comm_s")


def run_config(
    model: str, optim: str, nproc: int, args: argparse.Namespace, out: Path, compiled: bool = False
) -> dict:
    overrides = [
        f"model={model}",
        f"optim={optim}",
        f"trainer.steps={args.steps + args.warmup}",
        f"trainer.batch_size={args.batch}",
        "trainer.warmup_steps=1",
        "trainer.val_every=100000",
        "trainer.checkpoint_every=100000",
        "trainer.export_safetensors=false",
        "trainer.progress_bar=false",
        "trainer.tracker=none",
        f"trainer.seed={args.seed}",
        f"output_dir={out}",
        f"data.root={args.data_root}",
        f"trainer.compile={str(compiled).lower()}",
        *args.train_arg,
    ]
    if nproc == 1:
        command = [sys.executable, "train.py", *overrides]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command += ["train.py", *overrides, "parallel=fsdp2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(
            f"{optim} on {nproc} process(es) failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"][args.warmup :]
    medians = {part: statistics.median(r[part] for r in rows) for part in PARTS}
    medians["step_s"] = statistics.median(r["step_s"] for r in rows)
    medians["loss_last"] = rows[-1]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    medians["peak_memory_gib"] = summary.get("peak_memory_gib")
    medians["compile_s"] = summary.get("compile_s")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="pi0_small")
    parser.add_argument("--steps", type=int, default=6, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nprocs", default="1,2")
    parser.add_argument("--optims", default="adamw,muon,dmuon")
    parser.add_argument("--compile", default="off", help="off, on, or off,on (both, side by side)")
    parser.add_argument(
        "--train-arg",
        action="append",
        default=[],
        help="an extra train.py override for every run (repeatable)",
    )
    parser.add_argument("--data-root", default="data/synthetic")
    parser.add_argument("--json", type=Path, default=Path("bench_results/train_step.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench_results/train_step.png"))
    args = parser.parse_args()
    nprocs = [int(n) for n in args.nprocs.split(",")]
    optims = args.optims.split(",")
    compiles = [c.strip() == "on" for c in args.compile.split(",")]

    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in nprocs:
            for compiled in compiles:
                for optim in optims:
                    label = f"{optim}+compile" if compiled else optim
                    print(f"running {args.model} with {label} on {nproc} process(es) ...", flush=True)
                    row = run_config(args.model, optim, nproc, args, Path(tmp) / f"{label}-{nproc}", compiled)
                    results.setdefault(str(nproc), {})[label] = row

    print(
        f"\n{args.model}, global batch {args.batch}, median of {args.steps} steps after {args.warmup} warmup"
    )
    header = (
        f"{'procs':>5} {'optim':<15} {'step s':>8} {'data':>7} {'fwd+bwd':>8} {'optim':>7} {'comm':>7} "
        f"{'x adamw':>8} {'peak GiB':>9} {'compile s':>10}"
    )
    print(header)
    print("-" * len(header))
    removed: dict[str, float] = {}
    for nproc, rows in results.items():
        for optim, r in rows.items():
            adamw = rows.get("adamw+compile" if optim.endswith("+compile") else "adamw", {}).get("step_s")
            ratio = r["step_s"] / adamw if adamw else float("nan")
            peak = f"{r['peak_memory_gib']:.2f}" if r.get("peak_memory_gib") is not None else "-"
            comp = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
            print(
                f"{nproc:>5} {optim:<15} {r['step_s']:>8.3f} {r['data_s']:>7.3f} {r['forward_backward_s']:>8.3f} "
                f"{r['optimizer_s']:>7.3f} {r['optimizer_comm_s']:>7.3f} {ratio:>8.2f} {peak:>9} {comp:>10}"
            )
        if {"adamw", "muon", "dmuon"} <= rows.keys():
            extra = rows["muon"]["step_s"] - rows["adamw"]["step_s"]
            removed[nproc] = (
                (rows["muon"]["step_s"] - rows["dmuon"]["step_s"]) / extra if extra > 0 else float("nan")
            )
    for nproc, fraction in removed.items():
        print(f"{nproc} process(es): dmuon removes {fraction:.2f} of naive Muon's extra step time over AdamW")

    payload = {
        "model": args.model,
        "batch": args.batch,
        "steps": args.steps,
        "train_args": args.train_arg,
        "results": results,
        "removed": removed,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.json}")
    plot(results, args)


def plot(results: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, parts = (
        [],
        {p: [] for p in ("data_s", "forward_backward_s", "optimizer compute", "optimizer_comm_s")},
    )
    for nproc, rows in results.items():
        for optim, r in rows.items():
            labels.append(f"{optim}\n{nproc}p")
            parts["data_s"].append(r["data_s"])
            parts["forward_backward_s"].append(r["forward_backward_s"])
            parts["optimizer compute"].append(r["optimizer_s"] - r["optimizer_comm_s"])
            parts["optimizer_comm_s"].append(r["optimizer_comm_s"])
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.1), 4))
    bottom = [0.0] * len(labels)
    names = {"data_s": "data", "forward_backward_s": "forward+backward", "optimizer_comm_s": "optimizer comm"}
    for part, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=names.get(part, part))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per step (median)")
    ax.set_title(f"{args.model}: step time split, FSDP2 on gloo (1p = single process)")
    ax.legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
