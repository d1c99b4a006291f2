"""What trainer.compile buys: forward + backward of a policy, eager vs per-block torch.compile, side by side.

    python scripts/bench_compile.py [--presets pi0_sim,pi0_small] [--batch 32] [--steps 20] [--warmup 3]
        [--threads 2] [--mode default] [--json bench_results/compile.json]

For each preset one policy is built (seed 0) and deep-copied; the copy gets `vla.training.parallel.
compile_units` (what trainer.compile does: every shard unit compiled, before any sharding). Both run
`compute_loss` + backward on the same random batch with the same noise and time draws, alternating
eager and compiled step by step after --warmup untimed steps each (the first compiled step compiles:
reported apart). Then --profile-steps more steps of each, alternating, under torch.profiler, split each step
into its matrix products (mm, addmm, bmm, attention, convolution: the kernels inductor leaves to ATen)
and the rest; eager step / eager GEMM seconds is the most compile can gain if it made everything else
free. Prints a table (median seconds, speed-up, compile seconds, largest relative loss difference, GEMM
seconds on both sides, that bound) and writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "models"))

import torch  # noqa: E402

from vla.help_format import HelpFormatter  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--presets", default="pi0_sim,pi0_small", help="comma-separated model presets")
    parser.add_argument("--batch", type=int, default=32, help="samples per forward")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads")
    parser.add_argument("--profile-steps", type=int, default=5, help="profiled steps per variant (0: none)")
    parser.add_argument("--mode", default=None, help="torch.compile mode (trainer.compile_mode)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args()


def fwd_bwd(policy: torch.nn.Module, batch, seed: int) -> tuple[float, float]:
    """One compute_loss + backward; (seconds, loss). Noise and flow times come from `seed`."""
    policy.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    start = time.perf_counter()
    loss, _ = policy.compute_loss(batch)
    loss.backward()
    return time.perf_counter() - start, loss.item()


# Matrix products: what inductor hands to ATen's kernels instead of generating code (extern kernels).
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_convolution",
            "aten::convolution_backward"}  # fmt: skip
GEMM_PREFIXES = ("aten::_scaled_dot_product",)  # attention: several kernels, forward and backward


def is_gemm(op: str) -> bool:
    """Whether a profiler op name is a matrix product."""
    return op in GEMM_OPS or op.startswith(GEMM_PREFIXES)


def profile_steps(policies: dict[str, torch.nn.Module], batch, steps: int) -> dict[str, dict[str, float]]:
    """Per policy, seconds per profiled step: the step and its matrix products (self time), median.

    The policies take turns step by step, each step under its own profiler, so a change in machine
    load falls on both sides alike. The profiler slows eager's thousands of small ops more than a
    compiled step, so compare GEMM seconds, not profiled steps.
    """
    from torch.profiler import ProfilerActivity, profile

    samples: dict[str, dict[str, list[float]]] = {name: {"step_s": [], "gemm_s": []} for name in policies}
    for i in range(steps):
        for name, policy in policies.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                seconds, _ = fwd_bwd(policy, batch, 200 + i)
            gemm = sum(e.self_cpu_time_total for e in prof.key_averages() if is_gemm(e.key)) / 1e6
            samples[name]["step_s"].append(seconds)
            samples[name]["gemm_s"].append(gemm)
    return {
        name: {key: statistics.median(values) for key, values in sides.items()}
        for name, sides in samples.items()
    }


def bench(preset: str, args: argparse.Namespace) -> dict:
    from _policy_batches import make_batch

    from vla.models import build_policy
    from vla.training.parallel import compile_units

    torch.manual_seed(0)
    eager = build_policy(preset).train()
    compiled = copy.deepcopy(eager)
    units = compile_units(compiled, args.mode)
    batch = make_batch(eager.config, args.batch)
    first, _ = fwd_bwd(compiled, batch, 0)  # compiles
    for i in range(args.warmup):
        fwd_bwd(eager, batch, i)
        fwd_bwd(compiled, batch, i)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    worst = 0.0
    for i in range(args.steps):
        t_eager, l_eager = fwd_bwd(eager, batch, 100 + i)
        t_compiled, l_compiled = fwd_bwd(compiled, batch, 100 + i)
        times["eager"].append(t_eager)
        times["compiled"].append(t_compiled)
        worst = max(worst, abs(l_compiled - l_eager) / max(abs(l_eager), 1e-12))
    eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
    profiled = {}
    if args.profile_steps > 0:
        sides = profile_steps({"eager": eager, "compiled": compiled}, batch, args.profile_steps)
        profiled = {f"profile_{name}": side for name, side in sides.items()}
        # The unprofiled median over the profiled GEMM seconds: what is left if all but GEMMs were free.
        profiled["gemm_share"] = sides["eager"]["gemm_s"] / eager_s
        profiled["speedup_bound"] = eager_s / sides["eager"]["gemm_s"]
    return {
        "preset": preset,
        "batch": args.batch,
        "units_compiled": units,
        "eager_s": eager_s,
        "compiled_s": compiled_s,
        "speedup": eager_s / compiled_s,
        "compile_s": max(0.0, first - compiled_s),
        "max_rel_loss_diff": worst,
        "times": times,
        **profiled,
    }


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "mode": args.mode or "default", "steps": args.steps, "runs": []}
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        results["runs"].append(bench(preset, args))
    print(
        f"fwd+bwd, median of {args.steps} steps, batch {args.batch}, {args.threads} thread(s), mode {results['mode']}"
    )
    print(
        f"  {'preset':<10} {'eager s':>9} {'compiled s':>11} {'speed-up':>9} {'compile s':>10} {'max rel loss diff':>18}"
        f" {'GEMM s eager/compiled':>22} {'GEMM share':>11} {'bound':>7}"
    )
    for r in results["runs"]:
        line = (
            f"  {r['preset']:<10} {r['eager_s']:9.4f} {r['compiled_s']:11.4f} {r['speedup']:9.2f}x "
            f"{r['compile_s']:10.1f} {r['max_rel_loss_diff']:18.2e}"
        )
        if "gemm_share" in r:
            gemm = f"{r['profile_eager']['gemm_s']:.4f} / {r['profile_compiled']['gemm_s']:.4f}"
            line += f" {gemm:>22} {r['gemm_share']:11.3f} {r['speedup_bound']:6.2f}x"
        print(line)
    if any("gemm_share" in r for r in results["runs"]):
        print(
            "  bound: eager step / its GEMM seconds, the speed-up if compile made everything but GEMMs free"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
