"""A stalled video encoder never hangs a run (issue 18 item 4): the watchdog ends the process within
its bound, naming the file and the fix, and removes the partial dataset's staging directory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def test_a_stalled_encoder_ends_the_process_naming_the_file_and_cleans_up(tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from vla.data import video
        from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset

        calls = {{"n": 0}}
        original = video.VideoEncoder._mux

        def stalling(self, packets):  # the 5th encoder call never returns, as SVT-AV1's did
            calls["n"] += 1
            if calls["n"] == 5:
                time.sleep(1000)
            return original(self, packets)

        video.VideoEncoder._mux = stalling
        ensure_synthetic_dataset({str(tmp_path / "synthetic")!r}, SyntheticConfig(episodes=2, episode_length=8, image_size=32))
        print("not reached")
        """
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        env={"PATH": "/usr/bin:/bin", "VLA_ENCODER_STALL_S": "2", "HOME": str(tmp_path)},
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    assert "not reached" not in result.stdout
    assert "video encoder stalled: no progress for" in result.stderr and ".mp4" in result.stderr
    assert "codec=h264" in result.stderr  # the synthetic data records AV1: the fix names H.264
    assert elapsed < 60
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".cache") == []  # no staging dir left
