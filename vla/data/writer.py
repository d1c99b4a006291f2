"""Write datasets in the LeRobot v3.0 layout (what LeRobot itself writes and reads).

    with LeRobotDatasetWriter(root, fps=10, features=FEATURES, use_videos=True) as writer:
        for episode in episodes:
            for frame in episode:
                writer.add_frame({"observation.state": ..., "observation.images.top": ..., "action": ...},
                                 task="pick the cube")
            writer.save_episode()
    # leaving the block calls finalize(): meta/info.json, stats.json, tasks.parquet, episodes parquet

Data rows go to data/chunk-XXX/file-YYY.parquet (one row group per episode, rolling to a new file once
the rows in a file pass `data_files_size_in_mb` uncompressed). Videos are encoded as a continuous
stream per camera and file, so episode k of a file occupies [from_timestamp, to_timestamp) with
from_timestamp = frames before it / fps, exactly what LeRobot's concatenation records.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vla.data import lerobot_format as fmt
from vla.data import parquet_io
from vla.data.errors import DatasetError, DatasetFormatError
from vla.data.stats import Stats, aggregate_stats, image_stats, stats_to_json, vector_stats
from vla.data.video import DEFAULT_CRF, DEFAULT_GOP, ENCODERS, SVTAV1_PRESET, VideoEncoder, probe_video_info

_MB = 2**20


def as_hwc_uint8(image: Any, key: str, height: int, width: int) -> np.ndarray:
    """A camera frame given as (H, W, 3) or (3, H, W), uint8 or float in [0, 1] -> (H, W, 3) uint8."""
    array = np.asarray(image)
    if array.shape == (3, height, width) and array.shape != (height, width, 3):
        array = array.transpose(1, 2, 0)
    if array.shape != (height, width, 3):
        raise DatasetFormatError(
            f"frame[{key!r}] has shape {array.shape}; the feature declares ({height}, {width}, 3) "
            f"(or channel first (3, {height}, {width}))."
        )
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if np.issubdtype(array.dtype, np.floating):
        if not np.all(np.isfinite(array)) or array.min() < 0.0 or array.max() > 1.0:
            raise DatasetFormatError(f"frame[{key!r}] is float but not within [0, 1]; pass uint8 or [0, 1].")
        return np.ascontiguousarray(np.round(array * 255.0).astype(np.uint8))
    raise DatasetFormatError(f"frame[{key!r}] has dtype {array.dtype}; pass uint8 or float in [0, 1].")


def _json_number(value: float) -> int | float:
    """Whole numbers as int, as LeRobot's info.json has them; fractions (tests forcing rollover) kept."""
    return int(value) if float(value).is_integer() else float(value)


@dataclass
class _EpisodeBuffer:
    values: dict[str, list[Any]] = field(default_factory=dict)
    tasks: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tasks)


@dataclass
class _DataFile:
    chunk_index: int
    file_index: int
    writer: pq.ParquetWriter
    nbytes: int = 0


@dataclass
class _VideoFile:
    chunk_index: int
    file_index: int
    encoder: VideoEncoder


class LeRobotDatasetWriter:
    """Writes episodes frame by frame into a new LeRobot v3.0 dataset at `root`.

    features: user features, LeRobot schema ({"dtype", "shape", "names"}); camera features use
        dtype "image" or "video" with shape [H, W, 3]. `use_videos` overrides the camera dtype (True:
        MP4 per camera, False: PNG inside the parquet). The automatic columns (timestamp,
        frame_index, episode_index, index, task_index) are added here.
    video_codec: "av1" (libsvtav1, LeRobot's default) or "h264" (libx264).
    """

    def __init__(
        self,
        root: Path | str,
        fps: int,
        features: dict[str, dict[str, Any]],
        robot_type: str | None = None,
        use_videos: bool = True,
        video_codec: str = "av1",
        video_crf: int = DEFAULT_CRF,
        chunks_size: int = fmt.DEFAULT_CHUNK_SIZE,
        data_files_size_in_mb: float = fmt.DEFAULT_DATA_FILE_SIZE_IN_MB,
        video_files_size_in_mb: float = fmt.DEFAULT_VIDEO_FILE_SIZE_IN_MB,
        overwrite: bool = False,
    ) -> None:
        self.root = Path(root)
        if video_codec not in ENCODERS:
            raise ValueError(f"video_codec must be one of {sorted(ENCODERS)}, got {video_codec!r}.")
        if not isinstance(fps, int) or fps <= 0:
            raise ValueError(f"fps must be a positive int, got {fps!r}.")
        if self.root.exists() and any(self.root.iterdir()):
            if not overwrite:
                raise DatasetError(
                    f"{self.root} exists and is not empty; choose a new root or pass overwrite=True."
                )
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

        camera_dtype = "video" if use_videos else "image"
        user_features = {
            key: {**ft, "dtype": camera_dtype} if fmt.is_camera(ft) else dict(ft)
            for key, ft in features.items()
        }
        self.features = fmt.with_default_features(user_features, "LeRobotDatasetWriter(features=...)")
        for ft in self.features.values():
            if not fmt.is_camera(ft):
                parquet_io.arrow_type(ft)  # rejects unsupported numeric shapes up front
        self.user_keys = list(user_features)
        self.fps = fps
        self.video_codec = video_codec
        self.video_crf = video_crf
        self.info = fmt.build_info(
            fps,
            self.features,
            robot_type,
            chunks_size,
            _json_number(data_files_size_in_mb),
            _json_number(video_files_size_in_mb),
        )
        self._data_limit_bytes = data_files_size_in_mb * _MB
        self._video_limit_bytes = video_files_size_in_mb * _MB
        self._schema = parquet_io.data_schema(self.features)
        self._video_keys = fmt.video_keys(self.features)
        self._image_keys = fmt.image_keys(self.features)
        self._numeric_keys = [k for k, ft in self.features.items() if not fmt.is_camera(ft)]

        self.tasks: dict[str, int] = {}
        self.num_episodes = 0
        self.num_frames = 0
        self._buffer = _EpisodeBuffer()
        self._data_file: _DataFile | None = None
        self._next_data_file = (0, 0)
        self._video_files: dict[str, _VideoFile] = {}
        self._next_video_file = dict.fromkeys(self._video_keys, (0, 0))
        self._episode_rows: list[dict[str, Any]] = []
        self._numeric_history: dict[str, list[np.ndarray]] = {k: [] for k in self._numeric_keys}
        self._camera_episode_stats: dict[str, list[dict[str, np.ndarray]]] = {
            k: [] for k in self._video_keys + self._image_keys
        }
        self._finalized = False

    # -- frames and episodes ---------------------------------------------------------------------
    def add_frame(self, frame: dict[str, Any], task: str) -> None:
        """Buffer one frame of the current episode. `frame` holds every user feature, nothing else."""
        if self._finalized:
            raise DatasetError(f"{self.root}: writer already finalized; open a new writer to add data.")
        if not isinstance(task, str) or not task:
            raise DatasetFormatError(f"task must be a non-empty string, got {task!r}.")
        missing = [k for k in self.user_keys if k not in frame]
        extra = [k for k in frame if k not in self.user_keys]
        if missing or extra:
            raise DatasetFormatError(
                f"frame keys do not match the features: missing {missing}, unexpected {extra} "
                f"(declared: {self.user_keys}; timestamp/frame_index/... are filled in automatically)."
            )
        for key in self.user_keys:
            feature = self.features[key]
            if fmt.is_camera(feature):
                height, width, _ = feature["shape"]
                value = as_hwc_uint8(frame[key], key, height, width)
            else:
                value = self._numeric_value(key, frame[key], feature)
            self._buffer.values.setdefault(key, []).append(value)
        self._buffer.tasks.append(task)

    @staticmethod
    def _numeric_value(key: str, raw: Any, feature: dict[str, Any]) -> np.ndarray:
        value = np.asarray(raw.detach().cpu().numpy() if hasattr(raw, "detach") else raw)
        shape = tuple(feature["shape"])
        if value.shape != shape and not (shape == (1,) and value.shape == ()):
            raise DatasetFormatError(f"frame[{key!r}] has shape {value.shape}; the feature declares {shape}.")
        if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
            raise DatasetFormatError(f"frame[{key!r}] contains NaN or inf: {value.tolist()}.")
        return value.astype(feature["dtype"]).reshape(shape)

    def save_episode(self) -> int:
        """Write the buffered frames as one episode; returns its episode_index."""
        if len(self._buffer) == 0:
            raise DatasetError("save_episode() called with no frames; call add_frame() first.")
        episode_index = self.num_episodes
        length = len(self._buffer)
        for task in self._buffer.tasks:
            self.tasks.setdefault(task, len(self.tasks))
        columns: dict[str, np.ndarray] = {k: np.stack(self._buffer.values[k]) for k in self.user_keys}
        columns["timestamp"] = (np.arange(length) / self.fps).astype(np.float32)
        columns["frame_index"] = np.arange(length, dtype=np.int64)
        columns["episode_index"] = np.full(length, episode_index, dtype=np.int64)
        columns["index"] = np.arange(self.num_frames, self.num_frames + length, dtype=np.int64)
        columns["task_index"] = np.array([self.tasks[t] for t in self._buffer.tasks], dtype=np.int64)

        episode_stats: Stats = {}
        for key in self._numeric_keys:
            episode_stats[key] = vector_stats(columns[key])
            self._numeric_history[key].append(columns[key])
        for key in self._video_keys + self._image_keys:
            episode_stats[key] = image_stats(columns[key])
            self._camera_episode_stats[key].append(episode_stats[key])

        row: dict[str, Any] = {
            "episode_index": episode_index,
            "tasks": list(dict.fromkeys(self._buffer.tasks)),
            "length": length,
        }
        row.update(self._write_data(columns, length))
        for key in self._video_keys:
            row.update(self._write_video(key, columns[key]))
        for key, feature_stats in episode_stats.items():
            for name, value in feature_stats.items():
                row[f"stats/{key}/{name}"] = np.asarray(value).tolist()
        row["meta/episodes/chunk_index"] = 0
        row["meta/episodes/file_index"] = 0
        self._episode_rows.append(row)
        self.num_episodes += 1
        self.num_frames += length
        self._buffer = _EpisodeBuffer()
        return episode_index

    def _write_data(self, columns: dict[str, np.ndarray], length: int) -> dict[str, int]:
        arrays = []
        for key in self._schema.names:
            if key in self._image_keys:
                pngs = [parquet_io.encode_png(frame) for frame in columns[key]]
                arrays.append(parquet_io.image_column(pngs, 0))
            else:
                arrays.append(parquet_io.column_from_numpy(columns[key], self.features[key]))
        table = pa.Table.from_arrays(arrays, schema=self._schema)
        current = self._data_file
        if (
            current is not None
            and current.nbytes > 0
            and current.nbytes + table.nbytes > self._data_limit_bytes
        ):
            current.writer.close()
            self._next_data_file = fmt.update_chunk_file_indices(
                current.chunk_index, current.file_index, self.info["chunks_size"]
            )
            current = None
        if current is None:
            chunk_index, file_index = self._next_data_file
            path = self.root / self.info["data_path"].format(chunk_index=chunk_index, file_index=file_index)
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = pq.ParquetWriter(path, self._schema, compression="snappy")
            current = self._data_file = _DataFile(chunk_index, file_index, writer)
        current.writer.write_table(table)  # one row group per episode, as LeRobot writes
        current.nbytes += table.nbytes
        return {
            "data/chunk_index": current.chunk_index,
            "data/file_index": current.file_index,
            "dataset_from_index": self.num_frames,
            "dataset_to_index": self.num_frames + length,
        }

    def _write_video(self, key: str, frames: np.ndarray) -> dict[str, Any]:
        current = self._video_files.get(key)
        if current is not None and current.encoder.num_frames > 0:
            bytes_per_frame = current.encoder.bytes_written / current.encoder.num_frames
            if current.encoder.bytes_written + bytes_per_frame * len(frames) > self._video_limit_bytes:
                current.encoder.close()
                self._next_video_file[key] = fmt.update_chunk_file_indices(
                    current.chunk_index, current.file_index, self.info["chunks_size"]
                )
                current = None
        if current is None:
            chunk_index, file_index = self._next_video_file[key]
            path = self.root / self.info["video_path"].format(
                video_key=key, chunk_index=chunk_index, file_index=file_index
            )
            height, width, _ = self.features[key]["shape"]
            encoder = VideoEncoder(path, self.fps, width, height, codec=self.video_codec, crf=self.video_crf)
            current = self._video_files[key] = _VideoFile(chunk_index, file_index, encoder)
        from_timestamp = current.encoder.num_frames / self.fps
        for frame in frames:
            current.encoder.add_frame(frame)
        return {
            f"videos/{key}/chunk_index": current.chunk_index,
            f"videos/{key}/file_index": current.file_index,
            f"videos/{key}/from_timestamp": from_timestamp,
            f"videos/{key}/to_timestamp": from_timestamp + len(frames) / self.fps,
        }

    # -- finishing -------------------------------------------------------------------------------
    def _close_files(self) -> None:
        if self._data_file is not None:
            self._data_file.writer.close()
            self._data_file = None
        for video in self._video_files.values():
            video.encoder.close()
        self._video_files.clear()

    def finalize(self) -> Path:
        """Close data/video files and write meta/. Idempotent; returns the dataset root."""
        if self._finalized:
            return self.root
        if len(self._buffer) > 0:
            raise DatasetError(
                f"{len(self._buffer)} frames were added after the last save_episode(); call save_episode() "
                "before finalize() (or they would be lost)."
            )
        if self.num_episodes == 0:
            raise DatasetError(f"{self.root}: no episode was saved; nothing to finalize.")
        self._close_files()
        for key in self._video_keys:
            first_file = self.root / self.info["video_path"].format(
                video_key=key, chunk_index=0, file_index=0
            )
            video_info = probe_video_info(first_file)
            video_info.update({"video.g": DEFAULT_GOP, "video.crf": self.video_crf})
            if self.video_codec == "av1":
                video_info["video.preset"] = SVTAV1_PRESET
            self.features[key]["info"] = video_info
        self.info["features"] = self.features
        self.info["total_episodes"] = self.num_episodes
        self.info["total_frames"] = self.num_frames
        self.info["total_tasks"] = len(self.tasks)
        self.info["splits"] = {"train": f"0:{self.num_episodes}"}

        self._write_episodes()
        self._write_tasks()
        (self.root / fmt.STATS_PATH).write_text(json.dumps(stats_to_json(self.dataset_stats()), indent=4))
        (self.root / fmt.INFO_PATH).write_text(json.dumps(self.info, indent=4))
        self._finalized = True
        return self.root

    def dataset_stats(self) -> Stats:
        """Whole-dataset stats: exact over every frame for numeric features, merged per episode for cameras."""
        stats: Stats = {}
        for key in self.features:
            if key in self._numeric_history:
                stats[key] = vector_stats(np.concatenate(self._numeric_history[key]))
            else:
                stats[key] = aggregate_stats(self._camera_episode_stats[key])
        return stats

    def _write_episodes(self) -> None:
        path = self.root / fmt.EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self._episode_rows), path, compression="snappy")

    def _write_tasks(self) -> None:
        """meta/tasks.parquet as pandas writes a frame indexed by "task" (LeRobot reads it with pandas)."""
        names = list(self.tasks)
        table = pa.table(
            {
                "task_index": pa.array([self.tasks[t] for t in names], type=pa.int64()),
                "task": pa.array(names, type=pa.string()),
            }
        )
        pandas_metadata = {
            "index_columns": ["task"],
            "column_indexes": [
                {
                    "name": None,
                    "field_name": None,
                    "pandas_type": "unicode",
                    "numpy_type": "object",
                    "metadata": {"encoding": "UTF-8"},
                }
            ],
            "columns": [
                {
                    "name": "task_index",
                    "field_name": "task_index",
                    "pandas_type": "int64",
                    "numpy_type": "int64",
                    "metadata": None,
                },
                {
                    "name": "task",
                    "field_name": "task",
                    "pandas_type": "unicode",
                    "numpy_type": "object",
                    "metadata": None,
                },
            ],
            "attributes": {},
            "creator": {"library": "pyarrow", "version": pa.__version__},
            "pandas_version": "2.2.3",
        }
        table = table.replace_schema_metadata({"pandas": json.dumps(pandas_metadata)})
        pq.write_table(table, self.root / fmt.TASKS_PATH)

    def close(self) -> None:
        """Release open files without writing metadata (the dataset stays unfinished)."""
        self._close_files()

    def __enter__(self) -> LeRobotDatasetWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.close()
