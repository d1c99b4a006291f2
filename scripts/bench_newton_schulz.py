"""Newton-Schulz speed: standard vs Gram, single vs batched, on pi0-like shapes and two squares.

    python scripts/bench_newton_schulz.py [--shapes 512x4096,1024x1024] [--repeats 5] [--batch 4]
                                          [--steps 5] [--threads 2] [--json PATH] [--plot PATH]

For every shape: median seconds of one standard call, one Gram call, a loop of B single calls and one
batched (B, m, n) call (with the algorithm "auto" picks), the measured ratios and the FLOP-model
ratio, printed as a table and written as JSON (and a PNG bar chart with --plot).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from dmuon import choose_algorithm, newton_schulz, ns_flops
from dmuon.profiling import measure

# pi0-like matrix shapes at the scale of this machine (PaliGemma width 512 / MLP 4096, expert width 256
# / MLP 1024, 8 heads x 64, one KV head), plus the two squares/rectangles the issue asks for.
DEFAULT_SHAPES = [
    (512, 512),  # q_proj / o_proj, VLM
    (64, 512),  # k_proj / v_proj, VLM (one KV head)
    (4096, 512),  # gate_proj / up_proj, VLM (aspect 8)
    (512, 4096),  # down_proj, VLM
    (512, 256),  # q_proj, expert (8 x 64 heads on width 256)
    (1024, 256),  # gate / up, expert (aspect 4)
    (256, 1024),  # down, expert
    (1024, 1024),
    (1024, 4096),
]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            m, n = (int(v) for v in item.lower().split("x"))
        except ValueError as exc:
            raise SystemExit(f"--shapes: {item!r} is not MxN (e.g. 512x4096)") from exc
        shapes.append((m, n))
    return shapes


def bench_shape(shape: tuple[int, int], *, batch: int, steps: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(shape, generator=gen)
    stack = torch.randn((batch, *shape), generator=gen)
    auto = choose_algorithm(shape, steps)
    standard = measure(lambda: newton_schulz(G, steps=steps, algorithm="standard"), repeats=repeats)
    gram = measure(lambda: newton_schulz(G, steps=steps, algorithm="gram"), repeats=repeats)
    loop = measure(lambda: [newton_schulz(x, steps=steps, algorithm=auto) for x in stack], repeats=repeats)
    batched = measure(lambda: newton_schulz(stack, steps=steps, algorithm=auto), repeats=repeats)
    flops_std = ns_flops(shape, "standard", steps)
    flops_gram = ns_flops(shape, "gram", steps)
    return {
        "shape": list(shape),
        "aspect": max(shape) / min(shape),
        "auto": auto,
        "standard_s": standard.median,
        "gram_s": gram.median,
        "gram_speedup": standard.median / gram.median,
        "flop_model_speedup": flops_std / flops_gram,
        "standard_gflops": flops_std / standard.median / 1e9,
        "batch": batch,
        "loop_s": loop.median,
        "batched_s": batched.median,
        "batching_speedup": loop.median / batched.median,
        "max_spread": max(t.spread for t in (standard, gram, loop, batched)),
    }


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'shape':>11} {'aspect':>6} {'std ms':>9} {'gram ms':>9} {'gram x':>7} {'model x':>7} "
        f"{'GFLOP/s':>8} {'auto':>8} {'loop ms':>9} {'batch ms':>9} {'batch x':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{'x'.join(map(str, r['shape'])):>11} {r['aspect']:>6.1f} {r['standard_s'] * 1e3:>9.2f} "
            f"{r['gram_s'] * 1e3:>9.2f} {r['gram_speedup']:>7.2f} {r['flop_model_speedup']:>7.2f} "
            f"{r['standard_gflops']:>8.1f} {r['auto']:>8} {r['loop_s'] * 1e3:>9.2f} "
            f"{r['batched_s'] * 1e3:>9.2f} {r['batching_speedup']:>7.2f}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["x".join(map(str, r["shape"])) for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    ax.bar(
        [x - 0.2 for x in xs],
        [r["gram_speedup"] for r in rows],
        width=0.4,
        label="Gram / standard (measured)",
    )
    ax.bar([x + 0.2 for x in xs], [r["flop_model_speedup"] for r in rows], width=0.4, label="FLOP model")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels, rotation=30, ha="right")
    ax.set_ylabel("speedup of Gram NS over standard")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=Path("bench_results/newton_schulz.json"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [bench_shape(s, batch=args.batch, steps=args.steps, repeats=args.repeats) for s in args.shapes]
    print(f"Newton-Schulz, {args.steps} steps, fp32, {args.threads} threads, median of {args.repeats}")
    print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "machine": platform.machine(),
        "steps": args.steps,
    }
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
