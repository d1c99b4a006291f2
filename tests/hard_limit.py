"""A per-test limit that holds even when the main thread is stuck in native code (a pytest plugin).

pyproject's `timeout` (pytest-timeout, signal method) raises in the main thread, so it cannot end a test
whose main thread is blocked in C: a native deadlock, or a write to a pipe nobody reads. A CI run then
sits out its whole budget and prints nothing. faulthandler's watchdog is a C thread: past the limit it
prints every thread's Python stack to the real stderr and ends the process with status 1, so such a hang
costs minutes and says where it is.

The limit is VLA_TEST_HARD_LIMIT_S seconds (default 900: pytest-timeout's 600 plus room for it to
report first; 0 turns it off). SIGUSR1 prints the same stacks at any time and the run goes on: CI's
supervisor (.ci/supervise.py) sends it before it kills a run past its budget. tests/conftest.py loads
this plugin; tests/test_hard_limit.py tests it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Iterator
from typing import IO

import pytest

DEFAULT_LIMIT_S = 900.0

_real_stderr: IO[str] | None = None
_limit_s = 0.0


def limit_seconds() -> float:
    raw = os.environ.get("VLA_TEST_HARD_LIMIT_S", "")
    try:
        return float(raw) if raw else DEFAULT_LIMIT_S
    except ValueError:
        raise pytest.UsageError(f"VLA_TEST_HARD_LIMIT_S={raw!r} is not a number of seconds") from None


def pytest_configure(config: pytest.Config) -> None:
    global _real_stderr, _limit_s
    _limit_s = limit_seconds()
    # Taken before any test runs: during a test pytest points fd 2 at a capture file that is lost
    # when the watchdog ends the process.
    _real_stderr = os.fdopen(os.dup(2), "w")
    faulthandler.register(signal.SIGUSR1, file=_real_stderr, all_threads=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _real_stderr
    faulthandler.cancel_dump_traceback_later()
    faulthandler.unregister(signal.SIGUSR1)
    if _real_stderr is not None:
        _real_stderr.close()
        _real_stderr = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _limit_s > 0 and _real_stderr is not None:
        faulthandler.dump_traceback_later(_limit_s, exit=True, file=_real_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
