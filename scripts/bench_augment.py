"""What training-time image augmentation costs: per transform and preset, and in real training steps.

    python scripts/bench_augment.py [--batch-size 32] [--resolution 64] [--cameras 2] [--repeats 20]
        [--train-steps 40 --train-arg data.root=... ...] [--json bench_results/augment.json]

Part 1 times `ImageAugmenter.augment` on uint8 (B, 3, R, R) camera batches, one intra-op thread (as
in a DataLoader worker): every transform type alone (drawn for every frame) and every preset of
configs/image_transforms, median of --repeats calls, in ms per training batch (all cameras).
Part 2 (with --train-steps) runs `train.py` twice, augmentation off and on (--preset), with the same
settings otherwise, and reports the median step time and its data-wait part of each; the runs go one
after the other, so compare them within one invocation. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from vla.data.augment import ImageAugmenter, ImageTransformConfig, ImageTransformsConfig  # noqa: E402

SINGLE = {
    "ColorJitter brightness": ImageTransformConfig(1.0, "ColorJitter", {"brightness": 0.2}),
    "ColorJitter contrast": ImageTransformConfig(1.0, "ColorJitter", {"contrast": 0.2}),
    "ColorJitter saturation": ImageTransformConfig(1.0, "ColorJitter", {"saturation": 0.5}),
    "ColorJitter hue": ImageTransformConfig(1.0, "ColorJitter", {"hue": 0.05}),
    "SharpnessJitter": ImageTransformConfig(1.0, "SharpnessJitter", {"sharpness": [0.5, 1.5]}),
    "RandomAffine": ImageTransformConfig(1.0, "RandomAffine", {"degrees": 5.0, "translate": [0.05, 0.05]}),
    "RandomResizedCrop": ImageTransformConfig(
        1.0, "RandomResizedCrop", {"scale": [0.9, 0.9], "ratio": [1, 1]}
    ),
    "RandomShift": ImageTransformConfig(1.0, "RandomShift", {"pad": 4}),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--train-steps", type=int, default=0, help="train.py steps per run (0: skip part 2)")
    parser.add_argument("--preset", default="shift", help="configs/image_transforms preset of part 2")
    parser.add_argument("--train-arg", action="append", default=[], help="train.py override (repeatable)")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def presets() -> dict[str, ImageTransformsConfig]:
    out = {}
    for path in sorted((ROOT / "configs" / "image_transforms").glob("*.yaml")):
        values = yaml.safe_load(path.read_text()) | {"enable": True}
        out[f"preset {path.stem}"] = ImageTransformsConfig(**values)
    return out


def time_augmenter(config: ImageTransformsConfig, args: argparse.Namespace) -> float:
    """Median ms to augment one training batch (every camera), one thread."""
    cameras = [f"cam{i}" for i in range(args.cameras)]
    augmenter = ImageAugmenter(config, cameras, seed=0)
    images = torch.randint(0, 256, (args.batch_size, 3, args.resolution, args.resolution), dtype=torch.uint8)
    times = []
    for repeat in range(args.repeats + 2):
        keys = [(repeat, i) for i in range(args.batch_size)]
        start = time.perf_counter()
        for camera in cameras:
            augmenter.augment(images, camera, keys)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def train_medians(args: argparse.Namespace, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, str(ROOT / "train.py"), *args.train_arg, f"trainer.steps={args.train_steps}",
                   "trainer.progress_bar=false", "trainer.closed_loop.episodes=0", "trainer.open_loop_eval=false",
                   "trainer.export_safetensors=false", f"trainer.val_every={args.train_steps}",
                   f"trainer.checkpoint_every={args.train_steps}", f"output_dir={tmp}/run", *extra]  # fmt: skip
        subprocess.run(
            command, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"][2:]  # after warm-up
    return {
        "step_s": statistics.median(r["step_s"] for r in train),
        "data_s": statistics.median(r["data_s"] for r in train),
        "forward_backward_s": statistics.median(r["forward_backward_s"] for r in train),
        "steps": len(train),
    }


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # what a DataLoader worker has
    results: dict[str, object] = {"settings": {k: str(v) for k, v in vars(args).items()}, "augment_ms": {}}
    configs = {name: ImageTransformsConfig(enable=True, max_num_transforms=1, tfs={name: spec})
               for name, spec in SINGLE.items()} | presets()  # fmt: skip
    print(
        f"augmenting one batch of {args.batch_size} x {args.cameras} camera(s) at {args.resolution} px, 1 thread:"
    )
    for name, config in configs.items():
        ms = time_augmenter(config, args)
        results["augment_ms"][name] = ms  # type: ignore[index]
        print(f"  {name:<26} {ms:8.2f} ms")
    if args.train_steps:
        off = train_medians(args, [])
        on = train_medians(args, [f"image_transforms={args.preset}"])
        results["train"] = {"off": off, "on": on, "step_ratio": on["step_s"] / off["step_s"]}
        print(f"\ntrain.py, {off['steps']} steps after warm-up (median s):")
        print(f"  {'augmentation':<14} {'step':>8} {'data wait':>10} {'fwd+bwd':>9}")
        for name, m in (("off", off), (f"on ({args.preset})", on)):
            print(f"  {name:<14} {m['step_s']:8.3f} {m['data_s']:10.4f} {m['forward_backward_s']:9.3f}")
        print(f"  step time with / without: {on['step_s'] / off['step_s']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
