"""Dataset metadata (info, tasks, episodes, stats) for LeRobot v3.0 and v2.x roots, in one shape.

Both layouts are read into `DatasetMetadata`: `episodes` maps episode_index -> EpisodeInfo with the
relative data file and, per video key, the file and [from_timestamp, to_timestamp) segment inside
it (v2.x videos hold one episode each, so their segment starts at 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vla.data import lerobot_format as fmt
from vla.data.errors import (
    DatasetFileNotFoundError,
    DatasetFormatError,
    MissingFeatureError,
    corrupt_file_error,
)
from vla.data.parquet_io import read_parquet_schema, read_parquet_table
from vla.data.stats import Stats, aggregate_stats, check_finite, load_stats, stats_from_json


@dataclass(frozen=True)
class VideoSegment:
    """Where one episode of one camera lives: a file (relative to the root) and a time span in it."""

    path: str
    from_timestamp: float
    to_timestamp: float


@dataclass
class EpisodeInfo:
    episode_index: int
    length: int
    dataset_from_index: int
    dataset_to_index: int
    tasks: list[str]
    data_path: str
    videos: dict[str, VideoSegment] = field(default_factory=dict)


def _read_table(path: Path, what: str) -> Any:
    if not path.is_file():
        raise DatasetFileNotFoundError(f"Missing {what}: {path} does not exist.")
    return read_parquet_table(path)


def _require_columns(names: list[str], columns: list[str], path: Path) -> None:
    missing = [c for c in columns if c not in names]
    if missing:
        raise DatasetFormatError(
            f"{path}: missing column(s) {missing}; present: {names}. The file was not written by LeRobot "
            "v3.0 or was truncated; re-create the dataset."
        )


def _read_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetFileNotFoundError(f"Missing {what}: {path} does not exist.")
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise corrupt_file_error(path, "JSON-lines file", exc) from exc
    for line_number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(f"{path}:{line_number}: invalid JSON line ({exc}).") from exc
    return rows


def _tasks_from_rows(pairs: list[tuple[int, str]], path: Path) -> list[str]:
    by_index = dict(pairs)
    if sorted(by_index) != list(range(len(pairs))):
        raise DatasetFormatError(
            f"{path}: task_index values must be 0..{len(pairs) - 1} without gaps, got {sorted(by_index)}."
        )
    return [by_index[i] for i in range(len(pairs))]


class DatasetMetadata:
    """Everything under meta/ of a LeRobot dataset root.

    Attributes: root, info (the info.json dict), features, fps, codebase_version, tasks (list: position
    = task_index), episodes (dict episode_index -> EpisodeInfo, in index order), stats (feature ->
    stat -> np.ndarray, or None when the dataset has no stats file).
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.info = fmt.load_info(self.root)
        self.codebase_version: str = self.info["codebase_version"]
        self.is_legacy = self.codebase_version in fmt.LEGACY_VERSIONS
        if self.is_legacy:
            self.tasks = self._load_legacy_tasks()
            self.episodes = self._load_legacy_episodes()
            self.stats = self._load_legacy_stats()
        else:
            self.tasks = self._load_tasks()
            self.episodes = self._load_episodes()
            stats_path = self.root / fmt.STATS_PATH
            self.stats = load_stats(stats_path) if stats_path.is_file() else None
        self._check_totals()

    # -- info shortcuts ------------------------------------------------------------------------
    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.info["features"]

    @property
    def fps(self) -> int:
        return self.info["fps"]

    @property
    def robot_type(self) -> str | None:
        return self.info.get("robot_type")

    @property
    def camera_keys(self) -> list[str]:
        return fmt.camera_keys(self.features)

    @property
    def video_keys(self) -> list[str]:
        return fmt.video_keys(self.features)

    @property
    def image_keys(self) -> list[str]:
        return fmt.image_keys(self.features)

    @property
    def total_episodes(self) -> int:
        return len(self.episodes)

    @property
    def total_frames(self) -> int:
        return sum(ep.length for ep in self.episodes.values())

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of one frame of `key` as the reader returns it (cameras channel first: (3, H, W))."""
        feature = self.require_features([key])[0]
        shape = tuple(feature["shape"])
        if fmt.is_camera(feature):
            return (shape[2], shape[0], shape[1])
        return () if shape == (1,) else shape

    def require_features(self, keys: list[str], needed_by: str = "the configuration") -> list[dict[str, Any]]:
        """The feature dicts of `keys`; MissingFeatureError listing what exists when one is absent."""
        missing = [k for k in keys if k not in self.features]
        if missing:
            raise MissingFeatureError(
                f"{needed_by} expects feature(s) {missing}, but {self.root / fmt.INFO_PATH} has none of that "
                f"name. Available features: {sorted(self.features)}. Fix the key mapping in the "
                "configuration (e.g. the camera map or state/action keys) or use a dataset that has them."
            )
        return [self.features[k] for k in keys]

    def require_stats(self, keys: list[str]) -> Stats:
        """Stats of `keys`, checked finite; a clear error when the file or a feature entry is missing."""
        path = self.root / fmt.STATS_PATH
        if self.stats is None:
            raise DatasetFileNotFoundError(
                f"Missing normalisation stats {path}. Recompute them (LeRobot or vla.data writer) or pass "
                "stats explicitly."
            )
        missing = [k for k in keys if k not in self.stats]
        if missing:
            raise MissingFeatureError(
                f"{path} has no stats for {missing} (stats exist for {sorted(self.stats)}). Recompute stats."
            )
        check_finite(self.stats, str(path), keys)
        return {k: self.stats[k] for k in keys}

    # -- v3.0 ------------------------------------------------------------------------------------
    def _load_tasks(self) -> list[str]:
        path = self.root / fmt.TASKS_PATH
        table = _read_table(path, "task list meta/tasks.parquet")
        # LeRobot writes a pandas frame indexed by task: the index lands in a "task" column
        # (or "__index_level_0__" when the index was unnamed).
        task_column = next((c for c in ("task", "__index_level_0__") if c in table.column_names), None)
        if task_column is None or "task_index" not in table.column_names:
            raise DatasetFormatError(
                f"{path}: expected columns 'task' and 'task_index', found {table.column_names}."
            )
        pairs = list(zip(table.column("task_index").to_pylist(), table.column(task_column).to_pylist()))
        return _tasks_from_rows(pairs, path)

    def _load_episodes(self) -> dict[int, EpisodeInfo]:
        directory = self.root / fmt.EPISODES_DIR
        paths = sorted(directory.glob("chunk-*/file-*.parquet"))
        if not paths:
            raise DatasetFileNotFoundError(
                f"Missing episode metadata: no {fmt.EPISODES_DIR}/chunk-*/file-*.parquet under {self.root}."
            )
        base = ["episode_index", "tasks", "length", "data/chunk_index", "data/file_index"]
        base += ["dataset_from_index", "dataset_to_index"]
        video_columns = [
            f"videos/{key}/{name}"
            for key in self.video_keys
            for name in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
        ]
        episodes: dict[int, EpisodeInfo] = {}
        for path in paths:
            _require_columns(read_parquet_schema(path).names, base + video_columns, path)
            rows = read_parquet_table(path, columns=base + video_columns).to_pylist()
            for row in rows:
                index = int(row["episode_index"])
                data_path = self.info["data_path"].format(
                    chunk_index=row["data/chunk_index"], file_index=row["data/file_index"]
                )
                videos = {
                    key: VideoSegment(
                        path=self.info["video_path"].format(
                            video_key=key,
                            chunk_index=row[f"videos/{key}/chunk_index"],
                            file_index=row[f"videos/{key}/file_index"],
                        ),
                        from_timestamp=float(row[f"videos/{key}/from_timestamp"]),
                        to_timestamp=float(row[f"videos/{key}/to_timestamp"]),
                    )
                    for key in self.video_keys
                }
                episodes[index] = EpisodeInfo(
                    episode_index=index,
                    length=int(row["length"]),
                    dataset_from_index=int(row["dataset_from_index"]),
                    dataset_to_index=int(row["dataset_to_index"]),
                    tasks=list(row["tasks"] or []),
                    data_path=data_path,
                    videos=videos,
                )
        return dict(sorted(episodes.items()))

    def load_episode_stats(self) -> dict[int, Stats]:
        """Per-episode stats (episode_index -> feature -> stat -> array) from the stats/ columns."""
        if self.is_legacy:
            rows = _read_jsonl(self.root / fmt.LEGACY_EPISODES_STATS_PATH, "meta/episodes_stats.jsonl")
            source = str(self.root / fmt.LEGACY_EPISODES_STATS_PATH)
            return {int(r["episode_index"]): stats_from_json(r["stats"], source) for r in rows}
        out: dict[int, Stats] = {}
        for path in sorted((self.root / fmt.EPISODES_DIR).glob("chunk-*/file-*.parquet")):
            names = [n for n in read_parquet_schema(path).names if n.startswith("stats/")]
            table = read_parquet_table(path, columns=["episode_index", *names])
            for row in table.to_pylist():
                nested: dict[str, dict[str, Any]] = {}
                for name in names:
                    _, feature_and_stat = name.split("/", 1)
                    feature, stat = feature_and_stat.rsplit("/", 1)
                    nested.setdefault(feature, {})[stat] = row[name]
                out[int(row["episode_index"])] = stats_from_json(nested, str(path))
        return out

    # -- v2.x ------------------------------------------------------------------------------------
    def _load_legacy_tasks(self) -> list[str]:
        path = self.root / fmt.LEGACY_TASKS_PATH
        rows = _read_jsonl(path, "task list meta/tasks.jsonl")
        return _tasks_from_rows([(int(r["task_index"]), r["task"]) for r in rows], path)

    def _load_legacy_episodes(self) -> dict[int, EpisodeInfo]:
        path = self.root / fmt.LEGACY_EPISODES_PATH
        rows = sorted(_read_jsonl(path, "episode list meta/episodes.jsonl"), key=lambda r: r["episode_index"])
        chunks_size = int(self.info.get("chunks_size", fmt.DEFAULT_CHUNK_SIZE))
        episodes: dict[int, EpisodeInfo] = {}
        start = 0
        for row in rows:
            index, length = int(row["episode_index"]), int(row["length"])
            chunk = index // chunks_size
            videos = {
                key: VideoSegment(
                    path=self.info["video_path"].format(
                        episode_chunk=chunk, video_key=key, episode_index=index
                    ),
                    from_timestamp=0.0,
                    to_timestamp=length / self.fps,
                )
                for key in self.video_keys
            }
            episodes[index] = EpisodeInfo(
                episode_index=index,
                length=length,
                dataset_from_index=start,
                dataset_to_index=start + length,
                tasks=list(row.get("tasks", [])),
                data_path=self.info["data_path"].format(episode_chunk=chunk, episode_index=index),
                videos=videos,
            )
            start += length
        return episodes

    def _load_legacy_stats(self) -> Stats | None:
        if (self.root / fmt.STATS_PATH).is_file():
            return load_stats(self.root / fmt.STATS_PATH)
        if not (self.root / fmt.LEGACY_EPISODES_STATS_PATH).is_file():
            return None
        per_episode = self.load_episode_stats()
        features = sorted({f for stats in per_episode.values() for f in stats})
        return {
            f: aggregate_stats([stats[f] for stats in per_episode.values() if f in stats]) for f in features
        }

    def _check_totals(self) -> None:
        declared = self.info.get("total_episodes")
        if declared is not None and declared != len(self.episodes):
            raise DatasetFormatError(
                f"{self.root / fmt.INFO_PATH}: total_episodes is {declared} but the episode metadata lists "
                f"{len(self.episodes)} episodes. The dataset was not finalised (LeRobotDatasetWriter."
                "finalize()) or files are missing."
            )
        declared_frames = self.info.get("total_frames")
        if declared_frames is not None and declared_frames != self.total_frames:
            raise DatasetFormatError(
                f"{self.root / fmt.INFO_PATH}: total_frames is {declared_frames} but the episode metadata "
                f"lists {self.total_frames} frames ({len(self.episodes)} episodes). info.json and meta/episodes "
                "disagree: the dataset was not finalised, files are missing, or info.json was edited; set "
                f"total_frames to {self.total_frames} if the episodes are right, else re-create the dataset."
            )
        if self.episodes and sorted(self.episodes) != list(range(len(self.episodes))):
            raise DatasetFormatError(
                f"{self.root}: episode indices must be 0..{len(self.episodes) - 1}, got "
                f"{sorted(self.episodes)[:10]}..."
            )
