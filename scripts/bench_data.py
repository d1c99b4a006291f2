"""Data-loading throughput: items/s through dataset -> processor collate -> Batch, side by side.

    python scripts/bench_data.py [--episodes 12] [--episode-length 40] [--image-size 96]
                                 [--resolution 224] [--batch-size 16] [--epochs 3] [--quick]
                                 [--json bench_results/data_loading.json]

Writes the synthetic dataset (two cameras) three ways: PNG inside parquet, AV1 video (LeRobot's
default), H.264 video. For every storage x transport mode (float32 = LeRobot's items and float batches;
uint8 = uint8 batches at R x R; uint8_native = uint8 batches at the stored size, resized by
finalize(), which runs on the accelerator in training and on the CPU here) x DataLoader workers
(0, 2) x decoded-frame cache (off, on) it builds the loader the trainer uses (random order, batch of --batch-size, resize-with-pad to --resolution, a missing third
camera, tokenised prompts, action chunk of 10) and reports the median items/s over --epochs timed
epochs after one warm-up epoch (which fills the cache, when on). A second table times bare
`dataset[i]` (no collate, one process). Timings on shared machines are noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from vla.data import BatchProcessor, LeRobotDataset, ProcessorConfig, make_dataloader
from vla.data.synthetic import SyntheticConfig, generate_synthetic_dataset
from vla.help_format import HelpFormatter

STORAGES = {"png": (False, "av1"), "av1": (True, "av1"), "h264": (True, "h264")}
# mode -> (item image dtype, ProcessorConfig.uint8_images, ProcessorConfig.resize_on_finalize)
MODES = {
    "float32": ("float32", False, False),  # LeRobot's items, float batches from the workers
    "uint8": ("uint8", True, False),  # uint8 transport at R x R, scaled by finalize()
    "uint8_native": ("uint8", True, True),  # uint8 at stored size, resized + scaled by finalize()
}
CACHE_MB = 512
HORIZON = 10


def write_datasets(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    paths = {}
    for name, (use_videos, codec) in STORAGES.items():
        config = SyntheticConfig(
            episodes=args.episodes,
            episode_length=args.episode_length,
            image_size=args.image_size,
            use_videos=use_videos,
            codec=codec,
        )
        start = time.perf_counter()
        paths[name] = generate_synthetic_dataset(root / name, config)
        size_mb = sum(f.stat().st_size for f in paths[name].rglob("*") if f.is_file()) / 2**20
        print(f"wrote {name:5s} dataset: {size_mb:6.2f} MB in {time.perf_counter() - start:.1f} s")
    return paths


def make_processor(root: Path, resolution: int, uint8: bool, resize_on_finalize: bool) -> BatchProcessor:
    config = ProcessorConfig(
        camera_map={"observation.images.top": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
        model_cameras=["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"],
        image_size=resolution,
        action_horizon=HORIZON,
        uint8_images=uint8,
        resize_on_finalize=resize_on_finalize,
    )
    return BatchProcessor.from_dataset(config, LeRobotDataset(root).meta)


def bench_loader(root: Path, mode: str, workers: int, cache_mb: float, args: argparse.Namespace) -> dict:
    dtype, uint8, resize_on_finalize = MODES[mode]
    processor = make_processor(root, args.resolution, uint8, resize_on_finalize)
    dataset = LeRobotDataset(
        root, delta_timestamps=processor.delta_timestamps(10), image_dtype=dtype, frame_cache_mb=cache_mb
    )
    loader = make_dataloader(
        dataset, processor, batch_size=args.batch_size, num_workers=workers, seed=0, rank=0, world_size=1
    )
    rates = []
    for epoch in range(args.epochs + 1):
        start = time.perf_counter()
        items = sum(batch.batch_size for batch in loader)
        if epoch > 0:  # epoch 0 warms up workers (and the cache)
            rates.append(items / (time.perf_counter() - start))
    batch_mb = (
        sum(t.numel() * t.element_size() for t in next(iter(loader.loader)).observation.images.values())
        / 2**20
    )
    del loader
    return {
        "items_per_s": statistics.median(rates),
        "all": rates,
        "worker_to_main_images_mb_per_batch": batch_mb,
    }


def bench_getitem(root: Path, dtype: str, cache_mb: float, args: argparse.Namespace) -> dict:
    dataset = LeRobotDataset(
        root,
        delta_timestamps={"action": [i / 10 for i in range(HORIZON)]},
        image_dtype=dtype,
        frame_cache_mb=cache_mb,
    )
    rng = np.random.default_rng(0)
    rates = []
    for epoch in range(args.epochs + 1):
        order = rng.permutation(len(dataset))
        start = time.perf_counter()
        for index in order:
            dataset[int(index)]
        if epoch > 0:
            rates.append(len(order) / (time.perf_counter() - start))
    return {"items_per_s": statistics.median(rates), "all": rates, **dataset.frame_cache_stats}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--episodes", type=int, default=12)
    parser.add_argument("--episode-length", type=int, default=40)
    parser.add_argument("--image-size", type=int, default=96, help="stored camera resolution (square)")
    parser.add_argument("--resolution", type=int, default=224, help="model input resolution R")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per row (median reported)")
    parser.add_argument("--quick", action="store_true", help="fewer rows: no float32 rows with workers")
    parser.add_argument("--json", type=Path, default=Path("bench_results/data_loading.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    results: dict = {"settings": vars(args) | {"json": str(args.json)}, "loader": [], "getitem": []}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        paths = write_datasets(Path(tmp), args)
        print(f"\nloader (collate to {args.resolution}x{args.resolution}, batch {args.batch_size}), items/s:")
        print(f"{'storage':8s} {'mode':13s} {'workers':>7s} {'cache':>6s} {'items/s':>9s} {'MB/batch':>9s}")
        for storage, root in paths.items():
            for mode in MODES:
                for workers in (0, 2):
                    if args.quick and mode != "uint8" and workers > 0:
                        continue
                    for cache_mb in (0, CACHE_MB):
                        if storage == "png" and cache_mb and workers:
                            continue  # PNG decode is cheap; one cached row (workers=0) shows it
                        row = bench_loader(root, mode, workers, cache_mb, args)
                        row.update(storage=storage, mode=mode, workers=workers, cache_mb=cache_mb)
                        results["loader"].append(row)
                        print(
                            f"{storage:8s} {mode:13s} {workers:7d} {cache_mb:6d} {row['items_per_s']:9.0f} "
                            f"{row['worker_to_main_images_mb_per_batch']:9.2f}",
                            flush=True,
                        )
        print("\nbare dataset[i] (one process, random order), items/s:")
        print(f"{'storage':8s} {'dtype':8s} {'cache':>6s} {'items/s':>9s} {'decoded':>8s}")
        for storage, root in paths.items():
            for dtype in ("float32", "uint8"):
                for cache_mb in (0, CACHE_MB):
                    row = bench_getitem(root, dtype, cache_mb, args)
                    row.update(storage=storage, dtype=dtype, cache_mb=cache_mb)
                    results["getitem"].append(row)
                    print(
                        f"{storage:8s} {dtype:8s} {cache_mb:6d} {row['items_per_s']:9.0f} {row['frames_decoded']:8d}",
                        flush=True,
                    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
