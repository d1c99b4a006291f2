"""What checksums cost a checkpoint: save and verify times of a preset with its optimizer state.

    python scripts/bench_checkpoint.py [--preset pi0_small] [--optim adamw] [--repeats 5] [--json PATH]

One process. Builds the preset, takes one optimizer step on random gradients (so the optimizer has its
state), then saves --repeats checkpoints (vla.training.checkpoint.CheckpointManager, keep_last=1) into a
temporary directory and reads, per save, the seconds the sha256 of every file took (the manifest's
`checksum_s`). Verification is timed with and without checksums (a resume's check). Prints medians and
ratios as a table and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vla.models import build_policy  # noqa: E402
from vla.training.checkpoint import MANIFEST, CheckpointManager  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--preset", default="pi0_small")
    parser.add_argument("--optim", choices=["adamw"], default="adamw", help="state saved beside the weights")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    policy = build_policy(args.preset)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    saves, checksums, verify_sizes, verify_digests = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(Path(tmp) / "checkpoints", keep_last=1)
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            path = manager.save(step, policy, optimizer, trainer_state={"step": step})
            saves.append(time.perf_counter() - start)
            manifest = json.loads((path / MANIFEST).read_text())
            checksums.append(manifest["checksum_s"])
            start = time.perf_counter()
            manager.verify(path, checksums=False)
            verify_sizes.append(time.perf_counter() - start)
            start = time.perf_counter()
            manager.verify(path)
            verify_digests.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    result = {
        "preset": args.preset,
        "optimizer": args.optim,
        "checkpoint_bytes": size,
        "repeats": args.repeats,
        "save_s": statistics.median(saves),
        "checksum_s": statistics.median(checksums),
        "checksum_share_of_save": statistics.median(c / s for c, s in zip(checksums, saves, strict=True)),
        "verify_sizes_s": statistics.median(verify_sizes),
        "verify_checksums_s": statistics.median(verify_digests),
        "hash_mb_per_s": size / 1e6 / statistics.median(checksums),
    }
    print(f"{args.preset} + {args.optim} state: {size / 1e6:.0f} MB per checkpoint, median of {args.repeats}")
    print(f"{'save (incl. checksums)':<28}{result['save_s']:>9.3f} s")
    print(
        f"{'  of which checksums':<28}{result['checksum_s']:>9.3f} s  ({result['checksum_share_of_save']:.1%})"
    )
    print(f"{'verify, sizes only':<28}{result['verify_sizes_s']:>9.3f} s")
    print(f"{'verify, with checksums':<28}{result['verify_checksums_s']:>9.3f} s")
    print(f"{'hashing throughput':<28}{result['hash_mb_per_s']:>9.0f} MB/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
