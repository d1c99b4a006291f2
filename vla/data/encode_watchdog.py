"""A bound on every video-encoder call: a stalled encoder ends the process with the file and the fix.

PyAV's SVT-AV1 4.1.0 was seen to stop for good here in the middle of a recording (every thread in a
futex wait, CPU idle; issue 18): nothing returns, so nothing above can recover. Each
encoder call (`VideoEncoder.add_frame` / `close`) runs inside `guard(path)`; a watchdog thread that
sees one call last longer than `VLA_ENCODER_STALL_S` seconds (default 300: a healthy call takes
milliseconds) prints one error naming the file, the codec and the fix, runs the registered cleanups
(the dataset writer's staging directory) and ends the process with exit code 1. PyAV's encode call
releases the GIL (measured: during a 1.3 s H.264 call another thread never waited more than 9 ms),
so the watchdog thread runs while an encoder is stuck.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_STALL_S = 300.0
EXIT_STALLED = 1

_lock = threading.Lock()
_active: dict[int, tuple[float, str, str]] = {}  # token -> (start, file, codec)
_cleanups: dict[int, Callable[[], None]] = {}
_thread: threading.Thread | None = None
_next = [0]


def stall_seconds() -> float:
    return float(os.environ.get("VLA_ENCODER_STALL_S", DEFAULT_STALL_S))


def _report_and_exit(path: str, codec: str, waited: float) -> None:
    fix = (
        "record with H.264 instead (data.metaworld.codec=h264, make_sim_dataset.py --codec h264, "
        "data.synthetic.codec=h264)"
        if codec == "av1"
        else "retry; if it stalls again, report it with this file name"
    )
    print(
        f"error: the {codec} video encoder stalled: no progress for {waited:.0f} s while writing {path} "
        f"(VLA_ENCODER_STALL_S={stall_seconds():g}). The partial dataset was removed; {fix}",
        file=sys.stderr,
        flush=True,
    )
    with _lock:
        cleanups = list(_cleanups.values())
    for cleanup in cleanups:
        with contextlib.suppress(Exception):
            cleanup()
    os._exit(EXIT_STALLED)


def _watch() -> None:
    while True:
        time.sleep(min(1.0, max(0.05, stall_seconds() / 10)))
        now = time.monotonic()
        with _lock:
            stalled = [(start, path, codec) for start, path, codec in _active.values() if now - start > stall_seconds()]
        if stalled:
            start, path, codec = stalled[0]
            _report_and_exit(path, codec, now - start)


def _ensure_thread() -> None:
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_watch, name="vla-encode-watchdog", daemon=True)
            _thread.start()


@contextlib.contextmanager
def guard(path: Path | str, codec: str) -> Iterator[None]:
    """Bound one encoder call on `path` (see the module docstring)."""
    _ensure_thread()
    with _lock:
        _next[0] += 1
        token = _next[0]
        _active[token] = (time.monotonic(), str(path), codec)
    try:
        yield
    finally:
        with _lock:
            _active.pop(token, None)


def on_stall(cleanup: Callable[[], None]) -> int:
    """Run `cleanup` if an encoder stalls (before the process ends); returns a handle for `forget`."""
    with _lock:
        _next[0] += 1
        _cleanups[_next[0]] = cleanup
        return _next[0]


def forget(handle: int) -> None:
    with _lock:
        _cleanups.pop(handle, None)
