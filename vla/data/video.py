"""MP4 encode (for the writer) and decode-by-timestamp (for the reader) with PyAV.

Encoding follows LeRobot's defaults: AV1 through libsvtav1 (LeRobot's default codec) or H.264
through libx264, pix_fmt yuv420p, GOP 2 (a keyframe every other frame, so a random access decodes
at most one extra frame), crf 30.

Decoding mirrors LeRobot's PyAV backend (seek to the keyframe at or before the first requested
timestamp, decode forward, match each request to the nearest decoded frame within `tolerance_s`)
and adds what its per-item `av.open` lacks: open containers are kept per process, a read that
continues just past the last decoded frame decodes on without seeking, and an optional LRU of
decoded frames (by bytes) serves repeated reads from memory.
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from vla.data import encode_watchdog
from vla.data.errors import (
    DatasetFileNotFoundError,
    DatasetFormatError,
    FrameTimestampError,
    corrupt_file_error,
)

# Our codec names -> PyAV encoder names. "av1" is also what LeRobot calls libsvtav1.
ENCODERS = {"av1": "libsvtav1", "h264": "libx264"}
DEFAULT_CRF = 30
DEFAULT_GOP = 2
# libsvtav1 presets go 0 (slow) .. 13 (fast); LeRobot records with 12 (the encoder maps it to 11).
SVTAV1_PRESET = 12


def _open_video(path: str) -> tuple[Any, Any]:
    """(container, first video stream) of an MP4 for reading; DatasetFormatError naming a damaged file."""
    try:
        container = av.open(path)
    except av.FFmpegError as exc:
        raise corrupt_file_error(path, "video file", exc) from exc
    if not container.streams.video:
        container.close()
        raise corrupt_file_error(path, "video file", ValueError("it holds no video stream"))
    return container, container.streams.video[0]


def encoder_options(codec: str, crf: int = DEFAULT_CRF, gop: int = DEFAULT_GOP) -> dict[str, str]:
    """PyAV codec options for one of ENCODERS' keys."""
    if codec not in ENCODERS:
        raise ValueError(f"video codec {codec!r} is not supported; choose one of {sorted(ENCODERS)}.")
    options = {"g": str(gop), "crf": str(crf)}
    if codec == "av1":
        options["preset"] = str(SVTAV1_PRESET)
    return options


class VideoEncoder:
    """Streams uint8 RGB frames (H, W, 3) into one MP4 file; frame i gets timestamp i / fps.

    `bytes_written` counts muxed packet bytes, so a writer can roll to a new file by size before the
    container is closed. Call `close()` (or use as a context manager) to flush the encoder.
    """

    def __init__(
        self,
        path: Path | str,
        fps: int,
        width: int,
        height: int,
        codec: str = "av1",
        crf: int = DEFAULT_CRF,
        gop: int = DEFAULT_GOP,
    ) -> None:
        if width % 2 or height % 2:
            raise DatasetFormatError(
                f"{path}: yuv420p video needs even width and height, got {width}x{height}. "
                "Resize the camera images to even sizes or store them as images (use_videos=False)."
            )
        # SVT-AV1 prints its configuration banner to stderr unless told otherwise (1 = errors only).
        os.environ.setdefault("SVT_LOG", "1")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fps = fps
        self.width = width
        self.height = height
        self.num_frames = 0
        self.bytes_written = 0
        self.codec = codec
        self._container = av.open(str(self.path), mode="w")
        self._stream = self._container.add_stream(
            ENCODERS[codec], rate=fps, options=encoder_options(codec, crf, gop)
        )
        self._stream.pix_fmt = "yuv420p"
        self._stream.width = width
        self._stream.height = height
        self._stream.codec_context.time_base = Fraction(1, fps)

    def add_frame(self, frame: np.ndarray) -> None:
        if frame.shape != (self.height, self.width, 3) or frame.dtype != np.uint8:
            raise DatasetFormatError(
                f"{self.path}: frame has shape {frame.shape} dtype {frame.dtype}; expected "
                f"({self.height}, {self.width}, 3) uint8."
            )
        video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        video_frame.pts = self.num_frames
        self.num_frames += 1
        with encode_watchdog.guard(self.path, self.codec):  # a stalled encoder ends the run, naming the file
            self._mux(self._stream.encode(video_frame))

    def _mux(self, packets: list[av.Packet]) -> None:
        for packet in packets:
            self.bytes_written += packet.size
            self._container.mux(packet)

    def close(self) -> None:
        if self._container is None:
            return
        with encode_watchdog.guard(self.path, self.codec):
            self._mux(self._stream.encode(None))
            self._container.close()
        self._container = None

    def __enter__(self) -> VideoEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode_video(
    path: Path | str, frames: np.ndarray, fps: int, codec: str = "av1", crf: int = DEFAULT_CRF
) -> None:
    """Encode frames (T, H, W, 3) uint8 into `path`."""
    with VideoEncoder(path, fps, frames.shape[2], frames.shape[1], codec=codec, crf=crf) as encoder:
        for frame in frames:
            encoder.add_frame(frame)


def probe_video_info(path: Path | str) -> dict[str, Any]:
    """The per-feature "info" dict LeRobot stores in info.json for a video feature."""
    path = Path(path)
    if not path.is_file():
        raise DatasetFileNotFoundError(f"Missing video file {path}.")
    container, stream = _open_video(str(path))
    with container:
        info = {
            "video.height": stream.height,
            "video.width": stream.width,
            "video.codec": stream.codec_context.codec.canonical_name,
            "video.pix_fmt": stream.pix_fmt,
            "is_depth_map": False,
            "video.fps": int(stream.base_rate),
            "video.channels": 3,
            "has_audio": len(container.streams.audio) > 0,
        }
    return info


def _to_rgb(reformatter: VideoReformatter, frame: av.VideoFrame) -> np.ndarray:
    """(H, W, 3) uint8 RGB, the pixels `frame.to_ndarray(format="rgb24")` gives.

    A reused reformatter keeps its swscale context (building one per frame, with its thread pool,
    costs ~30x the conversion at small sizes). threads=1: a context holding a thread pool
    deadlocks when a fork-started DataLoader worker frees the copy it inherited.
    """
    return reformatter.reformat(frame, format="rgb24", threads=1).to_ndarray()


def decode_all_frames(path: Path | str) -> tuple[np.ndarray, np.ndarray]:
    """Every frame of a video: (frames (T, H, W, 3) uint8, timestamps (T,) float64 seconds)."""
    frames, times = [], []
    reformatter = VideoReformatter()
    container, stream = _open_video(str(path))
    with container:
        try:
            for frame in container.decode(stream):
                frames.append(_to_rgb(reformatter, frame))
                times.append(float(frame.pts * stream.time_base))
        except av.FFmpegError as exc:
            raise corrupt_file_error(path, "video file", exc) from exc
    if not frames:
        raise corrupt_file_error(path, "video file", ValueError("no frame decodes"))
    return np.stack(frames), np.asarray(times)


class FrameCache:
    """LRU of decoded frames keyed by (video path, frame time in ms), bounded by bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._frames: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()

    @staticmethod
    def key(path: str, time_s: float) -> tuple[str, int]:
        # Microsecond keys: frames at fps <= 1000 lie >= 1000 keys apart.
        return path, round(time_s * 1_000_000)

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        frame = self._frames.get(key)
        if frame is None:
            self.misses += 1
            return None
        self.hits += 1
        self._frames.move_to_end(key)
        return frame

    def get_near(self, path: str, time_s: float) -> np.ndarray | None:
        """The frame stored within a microsecond of `time_s` (one hit or miss counted).

        A requested time (index / fps) and the decoded frame's (pts x time base) can differ by float
        noise, and where a frame falls on half a key (fps 80 at milliseconds, 128 at microseconds)
        they round to neighbouring keys; an exact lookup would then miss every time and decode the
        frame's whole segment again. Neighbouring keys cannot hold another frame at fps <= 1000.
        """
        _, center = self.key(path, time_s)
        for offset in (0, -1, 1):
            frame = self._frames.get((path, center + offset))
            if frame is not None:
                self.hits += 1
                self._frames.move_to_end((path, center + offset))
                return frame
        self.misses += 1
        return None

    def put(self, key: tuple[str, int], frame: np.ndarray) -> None:
        if self.max_bytes <= 0 or key in self._frames or frame.nbytes > self.max_bytes:
            return
        self._frames[key] = frame
        self.bytes += frame.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self._frames.popitem(last=False)
            self.bytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._frames)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into spawn-started workers: the budget travels, the frames do not.
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_bytes"])


@dataclass
class _OpenVideo:
    container: Any
    stream: Any
    decoder: Any = None  # live `container.decode(stream)` generator, positioned after `last_time`
    last_time: float = -1.0
    reformatter: VideoReformatter = field(default_factory=VideoReformatter)
    # The last few decoded frames: overlapping windows (frame t, then t..t+k) reuse them without a seek.
    recent: deque[tuple[float, np.ndarray]] = field(default_factory=lambda: deque(maxlen=32))


class VideoFrameReader:
    """Decodes frames by timestamp from MP4 files; one instance per dataset, used in one process.

    Not shareable across fork: containers are opened lazily and reopened when the process id
    changes, so a DataLoader worker never touches its parent's decoder state.

    `cache_mb` > 0 keeps decoded frames in an LRU; with `cache_whole_segments` a miss decodes the
    whole [segment_start, segment_end) span the caller passes (an episode), which pays off once the
    cache holds the dataset (later epochs read from memory) and costs one episode decode per miss
    otherwise.
    """

    # Continue decoding forward instead of seeking when the target is at most this far ahead.
    SEQUENTIAL_WINDOW_S = 1.0

    def __init__(
        self,
        tolerance_s: float = 1e-4,
        cache_mb: float = 0.0,
        cache_whole_segments: bool = True,
        max_open_files: int = 16,
    ) -> None:
        self.tolerance_s = tolerance_s
        self.cache = FrameCache(int(cache_mb * 2**20))
        self.cache_whole_segments = cache_whole_segments
        self.max_open_files = max_open_files
        self.frames_decoded = 0
        self._open: OrderedDict[str, _OpenVideo] = OrderedDict()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into spawn-started workers: ship the settings, not open containers.
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def close(self) -> None:
        for video in self._open.values():
            video.container.close()
        self._open.clear()

    def _video(self, path: str) -> _OpenVideo:
        if os.getpid() != self._pid:
            # Forked worker: the inherited containers share file offsets with the parent, so open new
            # ones. (Inherited cached frames stay valid.) Freeing the copies is safe because decoders
            # and the reformatter run single-threaded: no thread pool exists to be joined in the child.
            self._open = OrderedDict()
            self._pid = os.getpid()
        video = self._open.get(path)
        if video is not None:
            self._open.move_to_end(path)
            return video
        if not os.path.isfile(path):
            raise DatasetFileNotFoundError(
                f"Missing video file {path} (listed in meta/episodes). Restore the file or re-create the "
                "dataset."
            )
        container, stream = _open_video(path)
        # One decoder thread: frame threading delays output after every seek, and DataLoader workers
        # already use the cores.
        stream.codec_context.thread_count = 1
        video = _OpenVideo(container=container, stream=stream)
        self._open[path] = video
        while len(self._open) > self.max_open_files:
            _, old = self._open.popitem(last=False)
            old.container.close()
        return video

    def _decode_range(self, path: str, first: float, last: float) -> list[tuple[float, np.ndarray]]:
        """Decoded (time, frame) pairs covering [first - tolerance, last + tolerance].

        A file that fails to decode (garbled packets) raises DatasetFormatError naming it; its
        container is closed so the next read starts afresh.
        """
        video = self._video(path)
        try:
            return self._decode_open(video, first, last)
        except av.FFmpegError as exc:
            self._open.pop(path, None)
            video.container.close()
            raise corrupt_file_error(path, "video file", exc) from exc

    def _decode_open(self, video: _OpenVideo, first: float, last: float) -> list[tuple[float, np.ndarray]]:
        low, high = first - self.tolerance_s, last + self.tolerance_s
        recent = video.recent
        starts_in_recent = bool(recent) and recent[0][0] <= low <= video.last_time
        if starts_in_recent and video.last_time >= last - self.tolerance_s:
            return [(t, f) for t, f in recent if low <= t <= high]
        just_ahead = video.last_time < low <= video.last_time + self.SEQUENTIAL_WINDOW_S
        continue_forward = video.decoder is not None and (starts_in_recent or just_ahead)
        if continue_forward:
            out = [(t, f) for t, f in recent if t >= low]
        else:
            # Lands on the keyframe at or before `first`; decoding forward then covers any frame within
            # tolerance after it, so no safety margin (which would cost a GOP of extra decodes) is needed.
            target = max(0, round(first / video.stream.time_base))
            video.container.seek(target, stream=video.stream, backward=True, any_frame=False)
            video.decoder = video.container.decode(video.stream)
            video.last_time = -1.0
            recent.clear()
            out = []
        for frame in video.decoder:
            if frame.pts is None:
                continue
            time_s = float(frame.pts * video.stream.time_base)
            array = _to_rgb(video.reformatter, frame)
            self.frames_decoded += 1
            video.last_time = time_s
            recent.append((time_s, array))
            if time_s >= low:
                out.append((time_s, array))
            if time_s >= last - self.tolerance_s:
                break
        else:
            video.decoder = None  # end of file: the generator is exhausted
        return out

    def read(
        self,
        path: Path | str,
        timestamps: Sequence[float],
        segment: tuple[float, float] | None = None,
    ) -> np.ndarray:
        """Frames nearest to `timestamps` (seconds in the file): (T, H, W, 3) uint8.

        `segment` = (start, end) seconds of the episode the timestamps belong to; with a cache and
        `cache_whole_segments`, a miss decodes that whole segment into the cache.
        Raises FrameTimestampError naming the file when a request has no frame within tolerance.
        """
        path = str(path)
        result: list[np.ndarray | None] = [None] * len(timestamps)
        missing: list[int] = []
        for i, ts in enumerate(timestamps):
            frame = self.cache.get_near(path, ts) if self.cache.max_bytes > 0 else None
            if frame is None:
                missing.append(i)
            else:
                result[i] = frame
        if missing:
            wanted = [timestamps[i] for i in missing]
            first, last = min(wanted), max(wanted)
            if self.cache.max_bytes > 0 and self.cache_whole_segments and segment is not None:
                first, last = min(first, segment[0]), max(last, segment[1])
            decoded = self._decode_range(path, first, last)
            if not decoded:
                raise FrameTimestampError(
                    f"{path}: no frame decoded in [{first:.4f}, {last:.4f}] s; the file is shorter than "
                    "meta/episodes says (from_timestamp/to_timestamp). Re-encode or re-create the dataset."
                )
            times = np.asarray([t for t, _ in decoded])
            if self.cache.max_bytes > 0:
                for time_s, frame in decoded:
                    self.cache.put(FrameCache.key(path, time_s), frame)
            for i in missing:
                nearest = int(np.argmin(np.abs(times - timestamps[i])))
                if abs(times[nearest] - timestamps[i]) > self.tolerance_s:
                    raise FrameTimestampError(
                        f"{path}: requested timestamp {timestamps[i]:.4f} s but the nearest decoded frame "
                        f"is at {times[nearest]:.4f} s (tolerance_s={self.tolerance_s}). The video and "
                        "meta/episodes from_timestamp disagree, or the video was encoded at another fps; "
                        "raise tolerance_s only if the offset is a known constant."
                    )
                result[i] = decoded[nearest][1]
        return np.stack(result)  # type: ignore[arg-type]
