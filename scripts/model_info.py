"""Print the policy presets' parameter counts and their Muon-eligible hidden matrices (built on meta).

    python scripts/model_info.py                 # table of every preset
    python scripts/model_info.py --json out.json # also write counts and matrix shapes as JSON
    python scripts/model_info.py --time pi0_small --threads 2   # median build and train-step times

Building on the meta device allocates nothing, so the full-size presets work on any machine. --time builds
the preset for real and times compute_loss + backward on a random batch (cameras of the config, horizon
of the config, prompt of --prompt-len tokens); it is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from vla.help_format import HelpFormatter
from vla.models import PRESETS, PolicyConfig, build_policy
from vla.models.naming import parameter_role
from vla.types import Batch, Observation


def preset_info(name: str) -> dict[str, object]:
    """Counts (total, trainable, per role) and hidden-matrix shapes of one preset."""
    with torch.device("meta"):
        policy = build_policy(name)
    total = trainable = 0
    by_role: Counter[str] = Counter()
    matrix_shapes: Counter[tuple[int, int]] = Counter()
    matrices: list[dict[str, object]] = []
    for param_name, parameter in policy.named_parameters():
        total += parameter.numel()
        if not parameter.requires_grad:
            continue
        trainable += parameter.numel()
        role = parameter_role(param_name, parameter)
        by_role[role] += parameter.numel()
        if role == "hidden_matrix":
            shape = (int(parameter.shape[0]), int(parameter.shape[1]))
            matrix_shapes[shape] += 1
            matrices.append({"name": param_name, "shape": list(shape)})
    return {
        "preset": name,
        "kind": policy.config.kind,
        "total_params": total,
        "trainable_params": trainable,
        "trainable_params_by_role": dict(by_role),
        "hidden_matrix_shapes": [
            {"shape": list(shape), "count": count} for shape, count in sorted(matrix_shapes.items())
        ],
        "hidden_matrices": matrices,
    }


def random_batch(config: PolicyConfig, batch_size: int, prompt_len: int) -> Batch:
    """A random batch in the layout `config` expects (images in [-1, 1], 7 real state/action dims)."""
    size, horizon = config.vision.image_size, config.action_horizon
    observation = Observation(
        images={c: torch.rand(batch_size, 3, size, size) * 2 - 1 for c in config.cameras},
        image_masks={c: torch.ones(batch_size, dtype=torch.bool) for c in config.cameras},
        state=torch.randn(batch_size, config.max_state_dim),
        tokenized_prompt=torch.randint(1, 200, (batch_size, prompt_len)),
        tokenized_prompt_mask=torch.ones(batch_size, prompt_len, dtype=torch.bool),
    )
    dim_mask = torch.zeros(batch_size, config.max_action_dim, dtype=torch.bool)
    dim_mask[:, :7] = True
    actions = (torch.rand(batch_size, horizon, config.max_action_dim) * 2 - 1) * dim_mask[:, None, :]
    return Batch(observation, actions, torch.zeros(batch_size, horizon, dtype=torch.bool), dim_mask)


def time_train_step(name: str, batch_size: int, prompt_len: int, repeats: int) -> dict[str, object]:
    """Median seconds of building the preset and of one compute_loss + backward."""
    build_times = []
    for _ in range(3):
        start = time.perf_counter()
        policy = build_policy(name)
        build_times.append(time.perf_counter() - start)
    batch = random_batch(policy.config, batch_size, prompt_len)
    step_times = []
    for _ in range(repeats + 1):  # the first step warms up allocators and kernels
        start = time.perf_counter()
        loss, _ = policy.compute_loss(batch)
        loss.backward()
        step_times.append(time.perf_counter() - start)
        policy.zero_grad(set_to_none=True)
    return {
        "preset": name,
        "threads": torch.get_num_threads(),
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "build_s_median": statistics.median(build_times),
        "train_step_s_median": statistics.median(step_times[1:]),
        "train_step_s_all": [round(t, 3) for t in step_times[1:]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--json", type=Path, help="write the full report (every hidden matrix) to this file")
    parser.add_argument(
        "--presets", nargs="*", default=sorted(PRESETS), help="presets to report (default: all)"
    )
    parser.add_argument(
        "--time", metavar="PRESET", help="also time build and compute_loss+backward of PRESET"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads for --time")
    parser.add_argument("--batch-size", type=int, default=8, help="batch size for --time")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens for --time")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps for --time (median reported)")
    args = parser.parse_args()
    infos = [preset_info(name) for name in args.presets]

    print(f"{'preset':<15} {'total':>15} {'trainable':>15} {'Muon matrices':>15} {'Muon params':>15}")
    for info in infos:
        shapes = info["hidden_matrix_shapes"]
        count = sum(s["count"] for s in shapes)
        muon = info["trainable_params_by_role"].get("hidden_matrix", 0)
        print(
            f"{info['preset']:<15} {info['total_params']:>15,} {info['trainable_params']:>15,} "
            f"{count:>15,} {muon:>15,}"
        )
    for info in infos:
        shapes = ", ".join(f"{s['count']}x{tuple(s['shape'])}" for s in info["hidden_matrix_shapes"])
        print(f"\n{info['preset']} hidden matrices (count x (out, in)): {shapes}")
    report: dict[str, object] = {"presets": infos}
    if args.time:
        torch.set_num_threads(args.threads)
        timing = time_train_step(args.time, args.batch_size, args.prompt_len, args.repeats)
        report["timing"] = timing
        print(f"\ntiming: {json.dumps(timing)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
