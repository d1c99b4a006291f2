"""The LeRobot dataset layout (v3.0, and v2.1 for reading): constants, info.json schema, paths.

v3.0 layout (LeRobot >= 0.4), relative to the dataset root:

    meta/info.json                          codebase_version, fps, features, path templates, totals
    meta/stats.json                         feature -> {min, max, mean, std, count, q01 .. q99}
    meta/tasks.parquet                      task string (pandas index "task") <-> task_index
    meta/episodes/chunk-000/file-000.parquet one row per episode (indices, file locations, stats/...)
    data/chunk-XXX/file-YYY.parquet         many episodes per file, one row per frame
    videos/<key>/chunk-XXX/file-YYY.mp4     many episodes concatenated per file

v2.1 (LeRobot <= 0.3): one parquet/mp4 per episode, meta/episodes.jsonl, meta/tasks.jsonl,
meta/episodes_stats.jsonl.

Feature schema: {"dtype": "float32"|"int64"|...|"image"|"video", "shape": [...], "names": ...}.
Camera features have shape [H, W, C] (channel last, as LeRobot records them); the reader returns
them channel first.
"""

from __future__ import annotations

import json
from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.errors import DatasetFileNotFoundError, DatasetFormatError, UnsupportedVersionError

CODEBASE_VERSION = "v3.0"
LEGACY_VERSIONS = ("v2.0", "v2.1")
SUPPORTED_VERSIONS = (CODEBASE_VERSION, *LEGACY_VERSIONS)

DEFAULT_CHUNK_SIZE = 1000
DEFAULT_DATA_FILE_SIZE_IN_MB = 100
DEFAULT_VIDEO_FILE_SIZE_IN_MB = 200

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
CHUNK_FILE_PATTERN = "chunk-{chunk_index:03d}/file-{file_index:03d}"
EPISODES_PATH = EPISODES_DIR + "/" + CHUNK_FILE_PATTERN + ".parquet"
DATA_PATH = "data/" + CHUNK_FILE_PATTERN + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE_PATTERN + ".mp4"

LEGACY_EPISODES_PATH = "meta/episodes.jsonl"
LEGACY_TASKS_PATH = "meta/tasks.jsonl"
LEGACY_EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"
LEGACY_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
LEGACY_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"

# Columns every LeRobot dataset carries; the writer fills them, callers never pass them.
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
CAMERA_DTYPES = ("image", "video")
QUANTILE_KEYS = ("q01", "q10", "q50", "q90", "q99")

_REQUIRED_INFO_KEYS = ("codebase_version", "fps", "features", "data_path")


def is_camera(feature: dict[str, Any]) -> bool:
    return feature.get("dtype") in CAMERA_DTYPES


def camera_keys(features: dict[str, dict[str, Any]]) -> list[str]:
    """Keys of image and video features, in info.json order."""
    return [key for key, ft in features.items() if is_camera(ft)]


def video_keys(features: dict[str, dict[str, Any]]) -> list[str]:
    return [key for key, ft in features.items() if ft.get("dtype") == "video"]


def image_keys(features: dict[str, dict[str, Any]]) -> list[str]:
    return [key for key, ft in features.items() if ft.get("dtype") == "image"]


def validate_feature(key: str, feature: Any, source: str) -> None:
    """Check one entry of info.json["features"]; raise DatasetFormatError naming `source` and `key`."""
    if not isinstance(feature, dict) or "dtype" not in feature or "shape" not in feature:
        raise DatasetFormatError(
            f"{source}: feature {key!r} must be a dict with 'dtype' and 'shape' (got {feature!r}). "
            'Fix the entry, e.g. {"dtype": "float32", "shape": [6], "names": null}.'
        )
    shape = feature["shape"]
    if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise DatasetFormatError(
            f"{source}: feature {key!r} has shape {shape!r}; expected a list of positive ints."
        )
    dtype = feature["dtype"]
    if dtype in CAMERA_DTYPES:
        if len(shape) != 3 or shape[2] != 3:
            raise DatasetFormatError(
                f"{source}: camera feature {key!r} has shape {list(shape)}; expected [height, width, 3] "
                "(channel last, RGB). Depth or grayscale cameras are not supported."
            )
        return
    if dtype in ("string", "language"):
        return
    try:
        np.dtype(dtype)
    except TypeError as exc:
        raise DatasetFormatError(
            f"{source}: feature {key!r} has dtype {dtype!r}, which is neither a numpy dtype nor one of "
            f"{CAMERA_DTYPES}."
        ) from exc


def check_codebase_version(version: Any, source: str) -> str:
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"{source}: codebase_version is {version!r}; this reader supports {list(SUPPORTED_VERSIONS)}. "
            "Convert the dataset with LeRobot (python -m lerobot.scripts.convert_dataset_v21_to_v30 for "
            "v2.1, or an older LeRobot release for v1.x), or rewrite it with vla.data.LeRobotDatasetWriter."
        )
    return version


def load_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise DatasetFileNotFoundError(f"Missing {what}: {path} does not exist.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(
            f"{path}: invalid JSON ({type(exc).__name__}: {exc}). The file is truncated, garbled or "
            "hand-edited wrongly; fix it, or re-download or regenerate the dataset."
        ) from exc


def load_info(root: Path) -> dict[str, Any]:
    """Read and validate meta/info.json under `root`. Shapes stay lists, as in the file."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetFileNotFoundError(
            f"Dataset root {root} does not exist. Point the dataset root at a LeRobot dataset folder "
            "(with meta/, data/ and videos/), or generate one with scripts/make_synthetic_dataset.py."
        )
    path = root / INFO_PATH
    info = load_json(
        path, "dataset metadata meta/info.json (is the root the folder that contains meta/ and data/?)"
    )
    if not isinstance(info, dict):
        raise DatasetFormatError(f"{path}: expected a JSON object at top level.")
    missing = [k for k in _REQUIRED_INFO_KEYS if k not in info]
    if missing:
        raise DatasetFormatError(f"{path}: missing required key(s) {missing}.")
    check_codebase_version(info["codebase_version"], str(path))
    if not isinstance(info["fps"], int | float) or info["fps"] <= 0:
        raise DatasetFormatError(f"{path}: 'fps' must be a positive number, got {info['fps']!r}.")
    if not isinstance(info["features"], dict) or not info["features"]:
        raise DatasetFormatError(f"{path}: 'features' must be a non-empty object.")
    for key, feature in info["features"].items():
        validate_feature(key, feature, f"{path} features")
    if video_keys(info["features"]) and not info.get("video_path"):
        raise DatasetFormatError(
            f"{path}: features {video_keys(info['features'])} have dtype 'video' but 'video_path' is empty."
        )
    return info


def build_info(
    fps: int,
    features: dict[str, dict[str, Any]],
    robot_type: str | None,
    chunks_size: int = DEFAULT_CHUNK_SIZE,
    data_files_size_in_mb: int = DEFAULT_DATA_FILE_SIZE_IN_MB,
    video_files_size_in_mb: int = DEFAULT_VIDEO_FILE_SIZE_IN_MB,
) -> dict[str, Any]:
    """An info.json dict in LeRobot v3.0 field order, with totals at zero.

    `features` must already contain DEFAULT_FEATURES; `video_path` is null when no feature is a video.
    """
    return {
        "codebase_version": CODEBASE_VERSION,
        "robot_type": robot_type,
        "total_episodes": 0,
        "total_frames": 0,
        "total_tasks": 0,
        "chunks_size": chunks_size,
        "data_files_size_in_mb": data_files_size_in_mb,
        "video_files_size_in_mb": video_files_size_in_mb,
        "fps": fps,
        "splits": {},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if video_keys(features) else None,
        "features": deepcopy(features),
    }


def with_default_features(features: dict[str, dict[str, Any]], source: str) -> dict[str, dict[str, Any]]:
    """User features followed by LeRobot's automatic columns; rejects user keys that clash with them."""
    clash = sorted(set(features) & set(DEFAULT_FEATURES))
    if clash:
        raise DatasetFormatError(
            f"{source}: features {clash} are filled in automatically by the writer; remove them."
        )
    merged = {key: {**deepcopy(ft), "shape": list(ft["shape"])} for key, ft in features.items()}
    for key, ft in merged.items():
        validate_feature(key, ft, source)
    merged.update(deepcopy(DEFAULT_FEATURES))
    return merged


def update_chunk_file_indices(chunk_index: int, file_index: int, chunks_size: int) -> tuple[int, int]:
    """The (chunk, file) pair after this one: a chunk holds `chunks_size` files."""
    if file_index == chunks_size - 1:
        return chunk_index + 1, 0
    return chunk_index, file_index + 1
