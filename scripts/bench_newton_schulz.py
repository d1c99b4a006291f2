"""Newton-Schulz speed: standard vs Gram, single vs batched, on pi0-like shapes and two squares.

    python scripts/bench_newton_schulz.py [--shapes 512x4096,1024x1024] [--repeats 5] [--batch 4]
                                          [--steps 5] [--threads 2] [--json PATH] [--plot PATH]
    python scripts/bench_newton_schulz.py --device cuda [--dtype bfloat16] [--shapes ...] [--json PATH]

CPU (default): for every shape, median seconds of one standard call, one Gram call, a loop of B single
calls and one batched (B, m, n) call (with the algorithm "auto" picks), the measured ratios and the
FLOP-model ratio, printed as a table and written as JSON (and a PNG bar chart with --plot).

--device cuda: Gram NS with the Triton SYRK kernel (dmuon.kernels.syrk, upper-triangle tiles only)
against Gram NS with torch matmuls and standard NS, single and batched (B, m, n), plus the bare
X X^T product (SYRK vs torch), medians and ratios side by side, table + JSON. Needs a CUDA device
and triton; exits with a message saying which is missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from dmuon import choose_algorithm, newton_schulz, ns_flops
from dmuon.kernels import syrk, syrk_backend, triton_available
from dmuon.profiling import measure
from vla.help_format import HelpFormatter

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


# GPU shapes: pi0's own (Gemma-2B width 2048 / MLP 16384, gemma_300m expert 1024 / 4096), squares.
CUDA_SHAPES = [
    (2048, 2048),
    (2048, 16384),
    (16384, 2048),
    (1024, 4096),
    (4096, 1024),
    (1024, 1024),
    (4096, 4096),
    (256, 2048),
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


def bench_shape_cuda(
    shape: tuple[int, int], *, batch: int, steps: int, repeats: int, dtype: torch.dtype, device: str
) -> dict:
    """Gram NS with SYRK vs Gram NS with torch matmuls vs standard NS, and X X^T alone, on `device`."""
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    stack = torch.randn((batch, *shape), generator=gen).to(device=device, dtype=dtype)
    X = G if shape[0] <= shape[1] else G.mT.contiguous()  # the (short, long) orientation NS iterates on
    dev = torch.device(device)

    def ns(x: torch.Tensor, algorithm: str, use_syrk: bool | None) -> torch.Tensor:
        return newton_schulz(x, steps=steps, algorithm=algorithm, dtype=dtype, syrk=use_syrk)

    timings = {
        "standard": lambda: ns(G, "standard", None),
        "gram_torch": lambda: ns(G, "gram", False),
        "gram_syrk": lambda: ns(G, "gram", True),
        "batched_standard": lambda: ns(stack, "standard", None),
        "batched_gram_torch": lambda: ns(stack, "gram", False),
        "batched_gram_syrk": lambda: ns(stack, "gram", True),
        "xxt_torch": lambda: X @ X.mT,
        "xxt_syrk": lambda: syrk(X),
    }
    med = {name: measure(fn, repeats=repeats, warmup=2, device=dev).median for name, fn in timings.items()}
    ref = ns(G, "gram", False).double()
    return {
        "shape": list(shape),
        "aspect": max(shape) / min(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        **{f"{name}_s": t for name, t in med.items()},
        "syrk_speedup_gram": med["gram_torch"] / med["gram_syrk"],
        "syrk_gram_vs_standard": med["standard"] / med["gram_syrk"],
        "syrk_speedup_batched_gram": med["batched_gram_torch"] / med["batched_gram_syrk"],
        "syrk_speedup_xxt": med["xxt_torch"] / med["xxt_syrk"],
        "syrk_gram_rel_diff": float((ns(G, "gram", True).double() - ref).norm() / ref.norm()),
    }


def print_table_cuda(rows: list[dict]) -> None:
    header = (
        f"{'shape':>11} {'std ms':>8} {'gram ms':>8} {'syrk ms':>8} {'syrk x':>7} {'vs std':>7} "
        f"{'B std':>8} {'B gram':>8} {'B syrk':>8} {'B syrk x':>8} {'XXt':>7} {'XXt syrk':>8} "
        f"{'XXt x':>6} {'rel diff':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ms = {k: r[k] * 1e3 for k in r if k.endswith("_s")}
        print(
            f"{'x'.join(map(str, r['shape'])):>11} {ms['standard_s']:>8.3f} {ms['gram_torch_s']:>8.3f} "
            f"{ms['gram_syrk_s']:>8.3f} {r['syrk_speedup_gram']:>7.2f} {r['syrk_gram_vs_standard']:>7.2f} "
            f"{ms['batched_standard_s']:>8.3f} {ms['batched_gram_torch_s']:>8.3f} "
            f"{ms['batched_gram_syrk_s']:>8.3f} {r['syrk_speedup_batched_gram']:>8.2f} "
            f"{ms['xxt_torch_s']:>7.3f} {ms['xxt_syrk_s']:>8.3f} {r['syrk_speedup_xxt']:>6.2f} "
            f"{r['syrk_gram_rel_diff']:>8.1e}"
        )


def cuda_unavailable_reason() -> str | None:
    """Why --device cuda cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return (
            f"--device cuda: no CUDA device is visible (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda}); the SYRK comparison needs a GPU. Run without --device for the CPU table."
        )
    if not triton_available():
        return '--device cuda: triton is not installed; pip install "triton>=3.0" (the gpu or dev extra)'
    if syrk_backend(torch.zeros(1, 1, device="cuda")) != "triton":
        return "--device cuda: dmuon.kernels.syrk would not take the Triton kernel on this device"
    return None


def main_cuda(args: argparse.Namespace) -> None:
    reason = cuda_unavailable_reason()
    if reason is not None:
        sys.exit(reason)
    dtype = DTYPES[args.dtype]
    shapes = args.shapes if args.shapes is not None else CUDA_SHAPES
    rows = [
        bench_shape_cuda(
            s, batch=args.batch, steps=args.steps, repeats=args.repeats, dtype=dtype, device="cuda"
        )
        for s in shapes
    ]
    name = torch.cuda.get_device_name()
    print(
        f"Newton-Schulz on {name}, {args.steps} steps, {args.dtype}, median of {args.repeats}, B={args.batch}"
    )
    print("syrk x = Gram(torch) / Gram(SYRK); vs std = standard / Gram(SYRK); B = batched (B, m, n) call")
    print_table_cuda(rows)
    json_path = args.json if args.json is not None else Path("bench_results/newton_schulz_cuda.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": name,
        "triton": __import__("triton").__version__,
        "steps": args.steps,
        "dtype": args.dtype,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {json_path}")


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="NS dtype (cuda only)")
    parser.add_argument("--shapes", type=parse_shapes, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--json", type=Path, default=None, help="default bench_results/newton_schulz[_cuda].json"
    )
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda":
        main_cuda(args)
        return
    if args.dtype != "float32":
        parser.error("--dtype applies to --device cuda only (CPU Newton-Schulz runs in float32)")
    torch.set_num_threads(args.threads)
    shapes = args.shapes if args.shapes is not None else DEFAULT_SHAPES
    args.json = args.json if args.json is not None else Path("bench_results/newton_schulz.json")
    rows = [bench_shape(s, batch=args.batch, steps=args.steps, repeats=args.repeats) for s in shapes]
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
