"""Two arms of training runs, paired by training seed, up to a step: validation loss and closed-loop success.

    # AdamW against DMuon over the first 4000 steps of experiment=metaworld_long, training seeds 0, 1, 2
    python scripts/compare_training.py --names adamw,dmuon --seeds 0,1,2 --up-to 4000 \\
        --a runs/adamw_seed0 --a runs/adamw_seed1 --a runs/adamw_seed2 \\
        --b runs/dmuon_seed0 --b runs/dmuon_seed1 --b runs/dmuon_seed2 \\
        --json out/compare.json --plot out/compare.png

Prints per seed the steps b needs to reach a's best validation loss (up to --up-to), and at every step both
arms evaluated in closed loop each arm's success and b - a with a 95% two-level bootstrap interval
(vla/eval/training_compare.py says where each number comes from). --episodes N compares every run on the
first N episode seeds of each task (a run's final report holds them episode by episode).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vla.eval.curves import validation_curve  # noqa: E402
from vla.eval.training_compare import compare_training, format_report  # noqa: E402
from vla.help_format import HelpFormatter  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--a", action="append", required=True, type=Path, help="a run of arm a (one per seed)")
    p.add_argument("--b", action="append", required=True, type=Path, help="a run of arm b (same seed order)")
    p.add_argument("--names", default="a,b", help="the arms' names, comma-separated")
    p.add_argument("--seeds", default=None, help="the runs' training seeds, comma-separated (default 0..n-1)")
    p.add_argument("--up-to", type=int, required=True, help="compare up to this step")
    p.add_argument("--episodes", type=int, default=None, help="compare on each task's first N episode seeds")
    p.add_argument("--resamples", type=int, default=20000)
    p.add_argument("--json", type=Path, default=None, help="write the comparison here")
    p.add_argument("--plot", type=Path, default=None, help="write validation loss and success curves here")
    return p.parse_args(argv)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_val, ax_success) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = dict(zip(report["names"], ("tab:blue", "tab:red")))
    for name, runs in report["runs"].items():
        for seed, run in zip(report["seeds"], runs):
            metrics = Path(run) / "metrics.jsonl"
            if metrics.is_file():
                steps, losses = validation_curve(metrics)
                kept = [(s, v) for s, v in zip(steps, losses) if s <= report["up_to"]]
                ax_val.plot(*zip(*kept), color=colours[name], lw=1, alpha=0.8, label=f"{name} seed {seed}")
    steps = [int(s) for s in report["success"]]
    for name in report["names"]:
        means = [report["success"][str(s)][name]["spread"]["mean"] for s in steps]
        ax_success.plot(steps, means, "o-", color=colours[name], lw=2, label=f"{name}, mean over seeds")
        for s in steps:
            runs = report["success"][str(s)][name]["runs"].values()
            ax_success.scatter([s] * len(runs), list(runs), color=colours[name], s=12, alpha=0.6)
    ax_val.set(
        xlabel="optimizer step", ylabel="validation loss", yscale="log", title="validation loss per seed"
    )
    ax_success.set(
        xlabel="optimizer step",
        ylabel="closed-loop success (mean over tasks)",
        ylim=(0, 1),
        title="success: arm mean (line) and runs (dots)",
    )
    for ax in (ax_val, ax_success):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = tuple(args.names.split(","))
    if len(names) != 2:
        raise SystemExit(f"--names needs two names, got {args.names!r}")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    try:
        report = compare_training(
            args.a,
            args.b,
            args.up_to,
            names=names,
            seeds=seeds,
            episodes=args.episodes,
            resamples=args.resamples,
        )
    except ValueError as e:  # RunError, or runs that do not report the same tasks
        raise SystemExit(f"error: {e}") from None
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
