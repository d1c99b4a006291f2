"""A local, hub-free reader of LeRobot datasets whose items match `lerobot.LeRobotDataset.__getitem__`.

Item of a dataset with features observation.state (S,), observation.images.top (H, W, 3), action (A,):

    {"observation.images.top": float32 (3, H, W) in [0, 1],   # (T, 3, H, W) with a delta window
     "observation.state": float32 (S,),
     "action": float32 (A,) or (T, A) with delta_timestamps["action"],
     "timestamp": float32 (), "frame_index": int64 (), "episode_index": int64 (), "index": int64 (),
     "task_index": int64 (),
     "action_is_pad": bool (T,),                                 # for each key with a delta window
     "task": str}

Numeric columns of the selected episodes are loaded into memory at construction (copy-on-write
shared with fork-started DataLoader workers); images embedded in parquet stay PNG bytes until read;
videos are decoded on demand by a per-process `VideoFrameReader`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from vla.data.errors import DatasetFileNotFoundError, DatasetFormatError, corrupt_file_error
from vla.data.metadata import DatasetMetadata, EpisodeInfo
from vla.data.parquet_io import column_to_numpy, decode_png, read_parquet_schema, read_parquet_table
from vla.data.video import FrameCache, VideoFrameReader, probe_video_info
from vla.data.windows import delta_indices, window_rows

ImageDType = Literal["float32", "uint8"]


class LeRobotDataset(torch.utils.data.Dataset):
    """Frames of a LeRobot v3.0 (or v2.x) dataset at `root`, item layout as LeRobot's.

    episodes: episode indices to keep (None = all); out-of-range indices raise.
    delta_timestamps: {feature: [seconds relative to the frame]}, multiples of 1/fps.
    image_transforms: callable applied to every camera tensor ((3, H, W) or (T, 3, H, W)).
    image_dtype: "float32" (LeRobot's [0, 1]) or "uint8" (0..255, 4x less worker->main traffic;
        the processor converts).
    frame_cache_mb: budget of each per-process LRU of decoded frames (one for video frames, one
        for embedded PNGs; every DataLoader worker has its own). With cache_whole_episodes, a
        video miss decodes its whole episode into the cache, which pays off once the budget holds
        the decoded video frames of the selected episodes (`decoded_video_bytes`: H * W * 3 bytes
        per frame and camera) and only then: where they do not fit, misses decode just the frames
        asked for (whole episodes would be decoded again and again as the LRU evicts them).
    """

    def __init__(
        self,
        root: Path | str,
        episodes: Sequence[int] | None = None,
        delta_timestamps: Mapping[str, Sequence[float]] | None = None,
        image_transforms: Callable[[torch.Tensor], torch.Tensor] | None = None,
        video_backend: str = "pyav",
        tolerance_s: float = 1e-4,
        image_dtype: ImageDType = "float32",
        frame_cache_mb: float = 0.0,
        cache_whole_episodes: bool = True,
    ) -> None:
        if video_backend != "pyav":
            raise ValueError(
                f"video_backend={video_backend!r} is not available here; only 'pyav' is supported "
                "(torchcodec does not load beside this torch build)."
            )
        if image_dtype not in ("float32", "uint8"):
            raise ValueError(f"image_dtype must be 'float32' or 'uint8', got {image_dtype!r}.")
        self.root = Path(root)
        self.meta = DatasetMetadata(self.root)
        self.tolerance_s = tolerance_s
        self.image_transforms = image_transforms
        self.image_dtype = image_dtype
        self.episodes = self._select_episodes(episodes)
        self.delta_indices = (
            delta_indices(delta_timestamps, self.fps, tolerance_s, self.meta.features)
            if delta_timestamps
            else {}
        )
        self.delta_timestamps = dict(delta_timestamps) if delta_timestamps else None
        budget = int(frame_cache_mb * 2**20)
        self._image_cache = FrameCache(budget)
        self._check_video_files()
        self._load_rows()
        fits = budget >= self.decoded_video_bytes
        self._video_reader = VideoFrameReader(
            tolerance_s=tolerance_s, cache_mb=frame_cache_mb, cache_whole_segments=cache_whole_episodes and fits
        )

    # -- properties mirroring LeRobotDataset ---------------------------------------------------
    @property
    def fps(self) -> int:
        return self.meta.fps

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.meta.features

    @property
    def camera_keys(self) -> list[str]:
        return self.meta.camera_keys

    @property
    def decoded_video_bytes(self) -> int:
        """Bytes of every video frame of the selected episodes, decoded (uint8, all video cameras)."""
        per_frame = sum(math.prod(self.features[key]["shape"]) for key in self.meta.video_keys)
        return per_frame * self.num_frames

    @property
    def num_frames(self) -> int:
        return len(self._episode_of_row)

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    def __len__(self) -> int:
        return self.num_frames

    def episode_rows(self, episode_index: int) -> range:
        """Item indices of one selected episode."""
        start, end = self._episode_bounds[episode_index]
        return range(start, end)

    def column(self, key: str) -> np.ndarray:
        """All selected frames of a numeric feature: (N,) or (N, *shape), without windows."""
        if key not in self._numeric:
            raise KeyError(f"{key!r} is not a numeric column; numeric columns: {sorted(self._numeric)}")
        return self._numeric[key]

    @property
    def frame_cache_stats(self) -> dict[str, int]:
        video_cache = self._video_reader.cache
        return {
            "hits": video_cache.hits + self._image_cache.hits,
            "misses": video_cache.misses + self._image_cache.misses,
            "frames_decoded": self._video_reader.frames_decoded,
        }

    # -- construction --------------------------------------------------------------------------
    def _select_episodes(self, episodes: Sequence[int] | None) -> list[int]:
        available = list(self.meta.episodes)
        if episodes is None:
            return available
        selected = sorted({int(e) for e in episodes})
        invalid = [e for e in selected if e not in self.meta.episodes]
        if invalid:
            raise IndexError(
                f"episodes {invalid} are not in {self.root} (it has episodes 0..{len(available) - 1}). "
                "Pick indices from that range (see vla.data.split_episodes)."
            )
        if not selected:
            raise ValueError("episodes=[] selects nothing; pass None for all episodes.")
        return selected

    def _check_video_files(self) -> None:
        missing = sorted(
            {
                segment.path
                for e in self.episodes
                for segment in self.meta.episodes[e].videos.values()
                if not (self.root / segment.path).is_file()
            }
        )
        if missing:
            raise DatasetFileNotFoundError(
                f"{self.root}: video file(s) {missing[:5]} listed in the episode metadata are missing. "
                "Restore them or re-create the dataset."
            )
        # Open every container once (about 0.3 ms a file): a truncated, zero-byte or garbled header fails
        # here, naming the file, rather than in a DataLoader worker mid-training.
        for path in sorted({s.path for e in self.episodes for s in self.meta.episodes[e].videos.values()}):
            probe_video_info(self.root / path)

    def _load_rows(self) -> None:
        stored = [k for k, ft in self.features.items() if ft["dtype"] != "video"]
        by_file: dict[str, list[EpisodeInfo]] = {}
        for e in self.episodes:
            info = self.meta.episodes[e]
            by_file.setdefault(info.data_path, []).append(info)
        tables = []
        for relative, infos in by_file.items():
            path = self.root / relative
            if not path.is_file():
                raise DatasetFileNotFoundError(
                    f"Missing data file {path} (episodes {[i.episode_index for i in infos]} point to it)."
                )
            names = read_parquet_schema(path).names
            absent = [k for k in stored if k not in names]
            if absent:
                raise DatasetFormatError(
                    f"{path}: meta/info.json declares feature(s) {absent} but the data file has no such "
                    f"column (columns: {names}). Fix info.json features or re-create the data file."
                )
            table = read_parquet_table(path, columns=stored)
            wanted = pa.array([i.episode_index for i in infos], type=pa.int64())
            table = table.filter(pc.is_in(table.column("episode_index").cast(pa.int64()), value_set=wanted))
            tables.append((path, table))

        self._numeric: dict[str, np.ndarray] = {}
        self._png: dict[str, pa.Array] = {}
        for key in stored:
            feature = self.features[key]
            if feature["dtype"] == "image":
                parts = [table.column(key).combine_chunks().field("bytes") for _, table in tables]
                self._png[key] = pa.concat_arrays(parts) if len(parts) > 1 else parts[0]
            else:
                self._numeric[key] = np.concatenate(
                    [column_to_numpy(table.column(key), feature, key, path) for path, table in tables]
                )
        self._index_episodes(tables)

    def _index_episodes(self, tables: list[tuple[Path, Any]]) -> None:
        episode_of_row = self._numeric["episode_index"]
        frame_index = self._numeric["frame_index"]
        self._episode_bounds: dict[int, tuple[int, int]] = {}
        change = np.flatnonzero(np.diff(episode_of_row)) + 1
        starts = np.concatenate([[0], change])
        ends = np.concatenate([change, [len(episode_of_row)]])
        files = {int(e): str(p) for p, t in tables for e in np.unique(t.column("episode_index").to_numpy())}
        for start, end in zip(starts.tolist(), ends.tolist()):
            episode = int(episode_of_row[start])
            info = self.meta.episodes[episode]
            if episode in self._episode_bounds or end - start != info.length:
                raise DatasetFormatError(
                    f"{files.get(episode, self.root)}: episode {episode} has {end - start} contiguous rows "
                    f"but meta/episodes says length {info.length}. The data file and episode metadata "
                    "disagree; re-create the dataset."
                )
            if not np.array_equal(frame_index[start:end], np.arange(end - start)):
                raise DatasetFormatError(
                    f"{files.get(episode, self.root)}: frame_index of episode {episode} is not 0..{end - start - 1}"
                    " in row order."
                )
            self._episode_bounds[episode] = (start, end)
        task_index = self._numeric["task_index"]
        if len(task_index) and (task_index.min() < 0 or task_index.max() >= len(self.meta.tasks)):
            raise DatasetFormatError(
                f"{self.root}: task_index values reach {int(task_index.max())} but meta/tasks lists "
                f"{len(self.meta.tasks)} tasks. Re-create the task table or the data."
            )
        missing = [e for e in self.episodes if e not in self._episode_bounds]
        if missing:
            raise DatasetFormatError(
                f"{self.root}: no data rows for episodes {missing}; re-create the dataset."
            )
        self._check_fps(tables)
        row_start = np.empty(len(episode_of_row), dtype=np.int64)
        row_end = np.empty(len(episode_of_row), dtype=np.int64)
        for start, end in self._episode_bounds.values():
            row_start[start:end] = start
            row_end[start:end] = end
        self._episode_of_row = episode_of_row
        self._row_start, self._row_end = row_start, row_end

    def _check_fps(self, tables: list[tuple[Path, Any]]) -> None:
        """info.json's fps must match the step of the timestamp column inside episodes.

        delta_timestamps and video frame lookups are computed from fps, so a wrong fps would silently
        pick the wrong frames. The median step is compared (1 % slack), so jitter and float32 rounding
        of long episodes pass.
        """
        timestamps = self._numeric["timestamp"].astype(np.float64)
        same_episode = np.diff(self._numeric["episode_index"]) == 0
        steps = np.diff(timestamps)[same_episode]
        if steps.size == 0:
            return
        step = float(np.median(steps))
        if abs(step * self.fps - 1.0) <= 0.01:
            return
        rate = f"{1.0 / step:.4g} fps" if step > 0 else "not increasing"
        files = sorted({str(path) for path, _ in tables})
        raise DatasetFormatError(
            f"{self.root / 'meta/info.json'}: fps is {self.fps} but the timestamps in {files[:3]} advance by "
            f"{step:.6g} s per frame within episodes ({rate}). Set fps in meta/info.json to the rate the "
            "data was recorded at, or re-create the dataset."
        )

    # -- items ---------------------------------------------------------------------------------
    def _image(self, key: str, rows: np.ndarray) -> np.ndarray:
        frames = []
        for row in rows.tolist():
            cache_key = (key, row)
            frame = self._image_cache.get(cache_key) if self._image_cache.max_bytes > 0 else None
            if frame is None:
                try:
                    frame = decode_png(self._png[key][row].as_py())
                except (OSError, ValueError, SyntaxError) as exc:  # PIL: UnidentifiedImageError, truncated
                    episode = int(self._episode_of_row[row])
                    raise corrupt_file_error(
                        self.root / self.meta.episodes[episode].data_path,
                        f"PNG image in column {key!r} (episode {episode}, row {row})",
                        exc,
                    ) from exc
                expected = tuple(self.features[key]["shape"])
                if frame.shape != expected:
                    raise DatasetFormatError(
                        f"{self.root}: image {key!r} at row {row} decodes to {frame.shape}, but meta/info.json "
                        f"declares {list(expected)}."
                    )
                self._image_cache.put(cache_key, frame)
            frames.append(frame)
        return np.stack(frames)

    def _video(self, key: str, episode: int, rows: np.ndarray) -> np.ndarray:
        segment = self.meta.episodes[episode].videos[key]
        timestamps = self._numeric["timestamp"][rows].astype(np.float64) + segment.from_timestamp
        last_frame = max(segment.from_timestamp, segment.to_timestamp - 1.0 / self.fps)
        frames = self._video_reader.read(
            self.root / segment.path, timestamps.tolist(), segment=(segment.from_timestamp, last_frame)
        )
        expected = tuple(self.features[key]["shape"])
        if frames.shape[1:] != expected:
            raise DatasetFormatError(
                f"{self.root / segment.path}: frames are {frames.shape[1:]} but meta/info.json declares "
                f"{key!r} as {list(expected)}."
            )
        return frames

    def _camera_tensor(self, frames: np.ndarray, windowed: bool) -> torch.Tensor:
        tensor = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # (T, 3, H, W) uint8
        if self.image_dtype == "float32":
            tensor = tensor.to(torch.float32).div_(255.0)
        if not windowed:
            tensor = tensor[0]
        if self.image_transforms is not None:
            tensor = self.image_transforms(tensor)
        return tensor

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"index {idx} out of range for a dataset of {len(self)} frames")
        row = int(idx) % len(self)
        episode = int(self._episode_of_row[row])
        start, end = int(self._row_start[row]), int(self._row_end[row])
        item: dict[str, Any] = {}
        pads: dict[str, torch.Tensor] = {}
        for key, feature in self.features.items():
            offsets = self.delta_indices.get(key)
            if offsets is not None:
                rows, is_pad = window_rows(row, offsets, start, end)
                pads[f"{key}_is_pad"] = torch.from_numpy(is_pad)
            else:
                rows = np.array([row])
            if feature["dtype"] == "video":
                item[key] = self._camera_tensor(self._video(key, episode, rows), offsets is not None)
            elif feature["dtype"] == "image":
                item[key] = self._camera_tensor(self._image(key, rows), offsets is not None)
            elif key in self._numeric:
                values = self._numeric[key][rows] if offsets is not None else self._numeric[key][row]
                item[key] = torch.tensor(values)
        item.update(pads)
        item["task"] = self.meta.tasks[int(self._numeric["task_index"][row])]
        return item

    def __repr__(self) -> str:
        return (
            f"LeRobotDataset(root={str(self.root)!r}, version={self.meta.codebase_version}, fps={self.fps}, "
            f"episodes={self.num_episodes}, frames={self.num_frames}, cameras={self.camera_keys})"
        )
