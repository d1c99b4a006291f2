"""What the bf16 wire (dmuon.Muon(wire_dtype=torch.bfloat16)) costs in accuracy, per orthogonalised update.

    python scripts/bench_wire.py [--shapes 2048x2048,256x2048,...] [--rank 16] [--seed 0] [--json PATH]

The wire rounds the orthogonalised result on its way back to the shard ranks and over the HSDP fan-out
(wire_scope="results", the default), and with wire_scope="all" also the momentum on its way to the owner. For each shape (default: pi0's Muon shape classes, Gemma-2B 2048 / 16384, expert 1024 /
4096, SigLIP 1152 / 4304), on a momentum that is low-rank plus noise (as gradients of a network are)
and on a Gaussian one, it prints the relative Frobenius error against the fp32 path of:
    input:  NS(bf16(M))            (the exchange's rounding, passed through Newton-Schulz)
    output: bf16(NS(M))            (wire_scope="results": the return's and fan-out's rounding, ~2^-9)
    wire:   bf16(NS(bf16(M)))      (wire_scope="all")
and the cosine similarity of each wire's update with the exact one. NS: "auto", 5 jordan steps, fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dmuon
from dmuon.functional import NSConfig, orthogonalize_batch
from vla.help_format import HelpFormatter

PI0_SHAPES = (
    "2048x2048,256x2048,16384x2048,2048x16384,1024x1024,4096x1024,1024x4096,1152x1152,4304x1152,1152x4304"
)


def momentum(m: int, n: int, kind: str, rank: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "gaussian":
        return torch.randn(m, n, generator=gen)
    low = torch.randn(m, rank, generator=gen) @ torch.randn(rank, n, generator=gen) / rank**0.5
    return low + 0.05 * torch.randn(m, n, generator=gen)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a * b).sum() / (a.norm() * b.norm()))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--shapes", default=PI0_SHAPES)
    parser.add_argument("--rank", type=int, default=16, help="rank of the low-rank momentum")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench_results/bench_wire.json"))
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s.strip()]
    ns = NSConfig(steps=5, coefficients=tuple(dmuon.coefficient_schedule("jordan", 5)), algorithm="auto")
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    print(
        f"{'shape':>12} {'momentum':>10} {'input':>9} {'output':>9} {'all':>9} {'cos results':>12} {'cos all':>9}"
    )
    for m, n in shapes:
        for kind in ("low-rank", "gaussian"):
            M = momentum(m, n, kind, args.rank, gen)
            exact = orthogonalize_batch(M[None], ns)[0]
            rounded_in = orthogonalize_batch(M.bfloat16().float()[None], ns)[0]
            wire = rounded_in.bfloat16().float()
            row = {
                "shape": [m, n],
                "momentum": kind,
                "input_error": relative(rounded_in, exact),
                "output_error": relative(exact.bfloat16().float(), exact),
                "wire_error": relative(wire, exact),
                "cosine_results": cosine(exact.bfloat16().float(), exact),
                "cosine_all": cosine(wire, exact),
            }
            rows.append(row)
            print(
                f"{m:>5}x{n:<6} {kind:>10} {row['input_error']:>9.2e} {row['output_error']:>9.2e} "
                f"{row['wire_error']:>9.2e} {row['cosine_results']:>12.7f} {row['cosine_all']:>9.6f}",
                flush=True,
            )
    print(
        f"largest error per update (relative Frobenius): wire_scope='results' "
        f"{max(r['output_error'] for r in rows):.2e}, wire_scope='all' {max(r['wire_error'] for r in rows):.2e}"
    )
    result = {
        "meta": {"ns": "auto, 5 jordan steps, fp32", "rank": args.rank, "seed": args.seed},
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
