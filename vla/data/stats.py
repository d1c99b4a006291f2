"""Feature statistics as LeRobot stores them in meta/stats.json and the episodes parquet.

Per feature: min, max, mean, std, count and quantiles q01 q10 q50 q90 q99.
- Vector features (N, D): every stat has shape (D,); count has shape (1,) = N.
- Camera features: per channel in [0, 1], every stat has shape (3, 1, 1) (LeRobot's layout, which
  broadcasts against C x H x W images); count = number of sampled frames.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.errors import DatasetFileNotFoundError, DatasetFormatError, StatsError
from vla.data.lerobot_format import QUANTILE_KEYS

QUANTILES = {key: int(key[1:]) / 100 for key in QUANTILE_KEYS}
Stats = dict[str, dict[str, np.ndarray]]

# LeRobot samples at most this many frames of an episode for image stats and downsamples frames
# wider than IMAGE_DOWNSAMPLE_THRESHOLD: image stats are only used for sanity checks, not training.
_MIN_IMAGE_SAMPLES = 100
_MAX_IMAGE_SAMPLES = 10_000
IMAGE_DOWNSAMPLE_THRESHOLD = 300
IMAGE_DOWNSAMPLE_TARGET = 150


def vector_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Stats over axis 0 of (N, ...) numeric values (exact quantiles, linear interpolation)."""
    data = np.asarray(values, dtype=np.float64)
    if data.ndim == 1:
        data = data[:, None]
    if data.shape[0] == 0:
        raise ValueError("cannot compute stats of an empty array")
    stats = {
        "min": data.min(axis=0),
        "max": data.max(axis=0),
        "mean": data.mean(axis=0),
        "std": data.std(axis=0),
        "count": np.array([data.shape[0]], dtype=np.int64),
    }
    quantiles = np.quantile(data, list(QUANTILES.values()), axis=0)
    for key, value in zip(QUANTILES, quantiles):
        stats[key] = value
    return stats


def image_sample_indices(num_frames: int) -> np.ndarray:
    """Evenly spaced frame indices, as many as LeRobot's heuristic (100 up to ~500 frames, then N^0.75)."""
    num_samples = max(min(_MIN_IMAGE_SAMPLES, num_frames), min(int(num_frames**0.75), _MAX_IMAGE_SAMPLES))
    return np.round(np.linspace(0, num_frames - 1, num_samples)).astype(np.int64)


def _uint8_channel_stats(values: np.ndarray) -> dict[str, float]:
    """Exact stats of uint8 values via their 256-bin histogram (np.quantile's linear method)."""
    counts = np.bincount(values, minlength=256).astype(np.float64)
    levels = np.arange(256, dtype=np.float64)
    total = counts.sum()
    mean = (counts * levels).sum() / total
    present = np.flatnonzero(counts)
    out = {
        "min": levels[present[0]],
        "max": levels[present[-1]],
        "mean": mean,
        "std": np.sqrt((counts * (levels - mean) ** 2).sum() / total),
    }
    cumulative = np.cumsum(counts)
    for key, q in QUANTILES.items():
        position = q * (total - 1)
        lower, upper = np.floor(position), np.ceil(position)
        # value of the k-th smallest element (0-based) = first level whose cumulative count exceeds k
        value_lower = levels[np.searchsorted(cumulative, lower, side="right")]
        value_upper = levels[np.searchsorted(cumulative, upper, side="right")]
        out[key] = value_lower + (position - lower) * (value_upper - value_lower)
    return out


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats of sampled frames (N, H, W, 3) uint8, scaled to [0, 1], shaped (3, 1, 1)."""
    sample = frames[image_sample_indices(len(frames))]
    height, width = sample.shape[1:3]
    if max(height, width) >= IMAGE_DOWNSAMPLE_THRESHOLD:
        step = max(height, width) // IMAGE_DOWNSAMPLE_TARGET
        sample = sample[:, ::step, ::step]
    pixels = sample.reshape(-1, 3)
    per_channel = [_uint8_channel_stats(pixels[:, c]) for c in range(3)]
    out = {
        key: (np.array([channel[key] for channel in per_channel]) / 255.0).reshape(3, 1, 1)
        for key in per_channel[0]
    }
    out["count"] = np.array([len(sample)], dtype=np.int64)
    return out


def aggregate_stats(stats_list: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Combine per-episode stats of one feature: exact min/max/mean/std (parallel variance formula).

    Quantiles cannot be merged exactly from summaries: they are the count-weighted mean of the
    inputs (the writer instead recomputes exact quantiles over all frames of vector features).
    """
    counts = np.array([float(s["count"][0]) for s in stats_list])
    total = counts.sum()
    weights = (counts / total).reshape(-1, *([1] * np.ndim(stats_list[0]["mean"])))
    means = np.stack([s["mean"] for s in stats_list])
    variances = np.stack([s["std"] ** 2 for s in stats_list])
    mean = (weights * means).sum(axis=0)
    variance = (weights * (variances + (means - mean) ** 2)).sum(axis=0)
    out = {
        "min": np.min(np.stack([s["min"] for s in stats_list]), axis=0),
        "max": np.max(np.stack([s["max"] for s in stats_list]), axis=0),
        "mean": mean,
        "std": np.sqrt(variance),
        "count": np.array([int(total)], dtype=np.int64),
    }
    for key in QUANTILES:
        if all(key in s for s in stats_list):
            out[key] = (weights * np.stack([s[key] for s in stats_list])).sum(axis=0)
    return out


def stats_to_json(stats: Stats) -> dict[str, dict[str, Any]]:
    return {
        feature: {key: np.asarray(value).tolist() for key, value in feature_stats.items()}
        for feature, feature_stats in stats.items()
    }


def stats_from_json(raw: Any, source: str) -> Stats:
    """Parse {feature: {stat: nested list}} into arrays (at least 1-D), rejecting NaN and inf."""
    if not isinstance(raw, dict):
        raise DatasetFormatError(f"{source}: expected an object of feature -> stats.")
    stats: Stats = {}
    for feature, feature_stats in raw.items():
        if not isinstance(feature_stats, dict):
            raise DatasetFormatError(f"{source}: stats of {feature!r} must be an object of stat -> values.")
        stats[feature] = {}
        for key, value in feature_stats.items():
            try:
                array = np.atleast_1d(np.asarray(value, dtype=np.float64))
            except (TypeError, ValueError) as exc:
                raise DatasetFormatError(f"{source}: {feature}/{key} is not numeric ({exc}).") from exc
            stats[feature][key] = array
    check_finite(stats, source)
    return stats


def check_finite(stats: Stats, source: str, features: Sequence[str] | None = None) -> None:
    """Raise StatsError naming the first feature/stat that holds NaN or inf."""
    for feature in features if features is not None else stats:
        for key, value in stats.get(feature, {}).items():
            if not np.all(np.isfinite(value)):
                bad = [v for v in np.asarray(value).ravel().tolist() if not math.isfinite(v)]
                raise StatsError(
                    f"{source}: stats of {feature!r}, entry {key!r} contain non-finite values {bad[:4]}. "
                    "Recompute the stats (the data likely has NaN/inf in that feature) or fix the file."
                )


def load_stats(path: Path) -> Stats:
    """Read meta/stats.json; missing file -> DatasetFileNotFoundError, NaN/inf -> StatsError."""
    if not path.is_file():
        raise DatasetFileNotFoundError(
            f"Missing normalisation stats {path}. Recreate them with LeRobot or our writer, or pass "
            "stats explicitly to the processor."
        )
    # json accepts the non-standard tokens NaN/Infinity that Python's json.dump writes.
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(
            f"{path}: invalid JSON ({type(exc).__name__}: {exc}). The file is truncated or garbled; "
            "recompute the stats, or re-download or regenerate the dataset."
        ) from exc
    return stats_from_json(raw, str(path))
