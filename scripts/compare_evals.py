"""Is policy B better than policy A? Success per task and b - a with 95% intervals, from evaluation reports.

    python scripts/compare_evals.py \
        --a runs/long/closed_loop.json out/long_s2000.json out/long_s3000.json \
        --b runs/ft/closed_loop.json out/ft_s2000.json out/ft_s3000.json --names first_stage,fine_tune
    python scripts/compare_evals.py --a runs/adamw_s0/closed_loop.json --a runs/adamw_s1/closed_loop.json \
        --b runs/dmuon_s0/closed_loop.json --b runs/dmuon_s1/closed_loop.json --json out/compare.json
    python scripts/compare_evals.py --a runs/s0 --a runs/s1 --a runs/s2 --names recipe   # one arm: its summary

Each --a / --b is one run (one training seed) given as its evaluation reports: the trainer's
closed_loop.json (or the run directory, which stands for it) and `scripts/eval_sim.py --json` files,
which may cover several seed sets (--seed 1000, 2000, ...). Repeat --a / --b for more training seeds.
Prints each run's success per task (Wilson interval) and mean (normal interval); for an arm of several
runs, its mean over them with the two-level bootstrap interval and per task the runs' range; then b - a
two ways (without --b, the summary of arm A alone):
paired episode by episode where both arms played the same episodes (the tighter test: each layout is
played by both), and the two-level bootstrap over runs and then episodes (which carries the spread
between training seeds; one run per arm gives the episodes alone). Differences are in percentage points.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vla.eval.compare import ReportError, compare, format_report, read_run, summarize
from vla.help_format import HelpFormatter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    for arm in ("a", "b"):
        parser.add_argument(
            f"--{arm}",
            action="append",
            nargs="+",
            type=Path,
            required=arm == "a",
            metavar="REPORT",
            help=f"one run of arm {arm.upper()}: its evaluation reports (repeat for more runs)",
        )
    parser.add_argument(
        "--names", default=None, help="the arms' names, comma-separated (default: a,b, or a without --b)"
    )
    parser.add_argument("--resamples", type=int, default=20000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms = 1 if args.b is None else 2
    default_names = "a,b" if arms == 2 else "a"
    names = tuple(n.strip() for n in (args.names or default_names).split(","))
    try:
        if len(names) != arms or not all(names) or len(set(names)) != arms:
            wanted = "one name (there is no --b)" if arms == 1 else "two different names"
            raise ReportError(f"--names needs {wanted}, got {args.names!r}")
        if args.resamples < 100:
            raise ReportError(f"--resamples must be at least 100, got {args.resamples}")
        a = [read_run(paths) for paths in args.a]
        if args.b is None:
            report = summarize({names[0]: a}, resamples=args.resamples, seed=args.seed)
        else:
            report = compare(
                a,
                [read_run(paths) for paths in args.b],
                names=names,  # type: ignore[arg-type]
                resamples=args.resamples,
                seed=args.seed,
            )
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
