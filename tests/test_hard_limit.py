"""The suite's watchdog (tests/hard_limit.py): a stuck test ends the run with every stack; others are untouched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _pytest(tmp_path: Path, body: str, limit_s: str) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "test_case.py").write_text(body)
    env = {**os.environ, "VLA_TEST_HARD_LIMIT_S": limit_s, "PYTHONPATH": str(TESTS)}
    cmd = [sys.executable, "-m", "pytest", "-p", "hard_limit", "-p", "no:cacheprovider", "--timeout=0", "-q"]
    start = time.monotonic()
    proc = subprocess.run(
        [*cmd, "test_case.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    return proc, time.monotonic() - start


def test_a_test_past_the_limit_ends_the_run_printing_where_it_was(tmp_path: Path) -> None:
    body = "import time\n\n\ndef test_stuck():\n    time.sleep(90)\n\n\ndef test_never_reached():\n    pass\n"
    proc, elapsed = _pytest(tmp_path, body, "2")
    assert proc.returncode == 1
    assert elapsed < 60  # not the 90 s the test would have taken
    # The stack went to the real stderr, not to pytest's capture of the test.
    assert "Timeout (0:00:02)!" in proc.stderr
    assert 'test_case.py", line 5 in test_stuck' in proc.stderr
    assert "test_never_reached" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_limit_is_per_test_and_leaves_passing_runs_alone(tmp_path: Path) -> None:
    # Three tests of 1.5 s under a 2 s limit: 4.5 s in all, so the watchdog must be re-armed per test.
    body = "import time\n\n\n" + "".join(f"def test_{i}():\n    time.sleep(1.5)\n\n\n" for i in range(3))
    proc, _ = _pytest(tmp_path, body, "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout
    assert "Timeout" not in proc.stderr


def test_a_bad_limit_is_a_usage_error(tmp_path: Path) -> None:
    proc, _ = _pytest(tmp_path, "def test_ok():\n    pass\n", "ten minutes")
    assert proc.returncode == 4  # pytest's usage-error status
    assert "VLA_TEST_HARD_LIMIT_S='ten minutes' is not a number of seconds" in proc.stderr


def test_sigusr1_prints_every_stack_and_the_run_goes_on(tmp_path: Path) -> None:
    body = (
        "import os, signal\n\n\n"
        "def test_asks_for_its_stacks():\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n\n\n"
        "def test_after():\n    pass\n"
    )
    proc, _ = _pytest(tmp_path, body, "900")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
    assert 'test_case.py", line 5 in test_asks_for_its_stacks' in proc.stderr
