"""PyAV encode/decode: frames come back within codec tolerance at the right timestamps."""

from __future__ import annotations

import numpy as np
import pytest

from vla.data import FrameTimestampError, LeRobotDataset
from vla.data.video import VideoEncoder, VideoFrameReader, decode_all_frames, encode_video, probe_video_info


def moving_square_frames(count: int, height: int = 32, width: int = 48) -> np.ndarray:
    frames = np.full((count, height, width, 3), 50, dtype=np.uint8)
    for i in range(count):
        top, left = 4 + i % 12, 2 + (2 * i) % 30
        frames[i, top : top + 10, left : left + 12] = (200, 180, 60)
    return frames


@pytest.mark.parametrize(("codec", "canonical"), [("av1", "av1"), ("h264", "h264")])
def test_decode_equals_encoded_frames_within_codec_tolerance(tmp_path, codec, canonical) -> None:
    frames = moving_square_frames(30)
    path = tmp_path / f"{codec}.mp4"
    encode_video(path, frames, fps=15, codec=codec)
    decoded, times = decode_all_frames(path)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    np.testing.assert_allclose(times, np.arange(30) / 15, atol=1e-4)
    error = np.abs(decoded.astype(np.int16) - frames)
    assert error.mean() < 3.0, error.mean()  # lossy, yuv420p chroma subsampling at the square's edges
    assert np.median(error) <= 2
    info = probe_video_info(path)
    assert info["video.codec"] == canonical and info["video.pix_fmt"] == "yuv420p"
    assert (info["video.height"], info["video.width"], info["video.fps"]) == (32, 48, 15)


def test_random_access_matches_sequential_decode(tmp_path) -> None:
    frames = moving_square_frames(60)
    path = tmp_path / "clip.mp4"
    encode_video(path, frames, fps=10, codec="av1")
    reference, _ = decode_all_frames(path)
    reader = VideoFrameReader(tolerance_s=1e-4)
    rng = np.random.default_rng(0)
    for _ in range(60):
        start = int(rng.integers(0, 57))
        wanted = [start, start + int(rng.integers(0, 3))]
        out = reader.read(path, [i / 10 for i in wanted])
        np.testing.assert_array_equal(out, reference[wanted])
    for start in range(55):  # overlapping forward windows reuse decoded frames instead of seeking
        np.testing.assert_array_equal(
            reader.read(path, [start / 10, (start + 1) / 10]), reference[[start, start + 1]]
        )
    assert reader.frames_decoded < 60 * 3 + 60


def test_a_cached_segment_is_decoded_once_even_where_frames_fall_between_keys(tmp_path) -> None:
    # MetaWorld records at 80 fps: frame times fall on half milliseconds, and LeRobot stores them as
    # float32, so a requested time is the frame's plus float noise. Every frame must come from the
    # cache after its segment was decoded once (a lookup that rounds the two to different keys
    # decoded the whole segment again for each such frame, each time: 30x the decoding of an epoch).
    frames = moving_square_frames(40)
    path = tmp_path / "clip80.mp4"
    encode_video(path, frames, fps=80, codec="h264")
    reference, _ = decode_all_frames(path)
    times = np.arange(40, dtype=np.float32) / np.float32(80)  # as a LeRobot parquet holds them
    reader = VideoFrameReader(tolerance_s=1e-4, cache_mb=16)
    for _ in range(2):
        for i, t in enumerate(times):
            out = reader.read(path, [float(t)], segment=(0.0, float(times[-1])))
            np.testing.assert_array_equal(out[0], reference[i])
    assert reader.frames_decoded == 40  # the segment, once
    assert (reader.cache.misses, reader.cache.hits) == (1, 79)


def test_the_frame_cache_finds_a_frame_a_microsecond_off() -> None:
    from vla.data.video import FrameCache

    cache = FrameCache(1 << 20)
    frame = np.zeros((2, 2, 3), np.uint8)
    cache.put(FrameCache.key("v.mp4", 1 / 128), frame)  # 7812.5 us: on half a key
    assert cache.get_near("v.mp4", 1 / 128 + 4e-7) is frame  # rounds to the next microsecond
    assert cache.get_near("v.mp4", 1 / 128 - 4e-7) is frame
    assert cache.get_near("v.mp4", 1 / 128 + 3e-6) is None and cache.get_near("w.mp4", 1 / 128) is None
    assert (cache.hits, cache.misses) == (2, 2)


def test_timestamp_outside_tolerance_names_the_file(tmp_path) -> None:
    path = tmp_path / "short.mp4"
    encode_video(path, moving_square_frames(10), fps=10, codec="h264")
    reader = VideoFrameReader(tolerance_s=1e-4)
    with pytest.raises(FrameTimestampError, match=r"short\.mp4.*0\.3500"):
        reader.read(path, [0.35])
    with pytest.raises(FrameTimestampError, match=r"short\.mp4"):
        reader.read(path, [5.0])


def test_encoder_rejects_odd_sizes_and_wrong_frames(tmp_path) -> None:
    with pytest.raises(ValueError, match="even width and height"):
        VideoEncoder(tmp_path / "odd.mp4", fps=10, width=15, height=16)
    with VideoEncoder(tmp_path / "ok.mp4", fps=10, width=16, height=16, codec="h264") as encoder:
        with pytest.raises(ValueError, match=r"expected \(16, 16, 3\) uint8"):
            encoder.add_frame(np.zeros((16, 16, 3), dtype=np.float32))
        encoder.add_frame(np.zeros((16, 16, 3), dtype=np.uint8))


@pytest.mark.parametrize("codec", ["av1", "h264"])
def test_dataset_video_frames_match_written_frames(make_dataset, codec) -> None:
    written = make_dataset([4, 6], use_videos=True, codec=codec, cameras=("top",))
    dataset = LeRobotDataset(written.root, image_dtype="uint8")
    for index in range(len(dataset)):
        decoded = dataset[index]["observation.images.top"].permute(1, 2, 0).numpy().astype(np.int16)
        assert np.abs(decoded - written.images["observation.images.top"][index]).mean() < 4, index
