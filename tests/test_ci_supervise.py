"""CI's supervisor (.ci/supervise.py): a stuck or stopped run is reported and ended, never sat out."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUPERVISE = [sys.executable, str(ROOT / ".ci" / "supervise.py")]


def _run(options: list[str], command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SUPERVISE, *options, "--", *command], capture_output=True, text=True, timeout=120, **kwargs
    )


def test_the_commands_output_and_status_pass_through() -> None:
    proc = _run([], ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert proc.returncode == 3
    assert proc.stdout == "out\n"
    assert proc.stderr == "err\n"


def test_the_command_runs_without_a_controlling_terminal_and_heartbeats_are_printed() -> None:
    script = "import os, time; print(os.getsid(0) == os.getpid()); time.sleep(1.5)"
    proc = _run(["--poll-s", "0.2", "--heartbeat-s", "0.5"], [sys.executable, "-c", script])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "True\n"  # it leads a session of its own
    assert re.search(
        r"\[ci/supervise\] \d+s: 1 processes \(([RSD]:1)\), load [\d.]+, \d+ MB available", proc.stderr
    )


def test_a_stopped_process_is_reported_and_continued() -> None:
    start = time.monotonic()
    proc = _run(["--poll-s", "0.2"], ["sh", "-c", "kill -STOP $$; echo resumed"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "resumed\n"
    assert "has been stopped by a signal for over 0.2s; continuing it" in proc.stderr
    assert "kill -STOP" in proc.stderr  # the process list names it
    assert time.monotonic() - start < 30


def test_a_command_past_its_budget_is_listed_and_killed_with_its_children() -> None:
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    start = time.monotonic()
    proc = _run(["--budget-s", "1", "--poll-s", "0.2", "--grace-s", "0"], [sys.executable, "-c", script])
    assert proc.returncode == 124
    assert time.monotonic() - start < 60
    assert "still running after its 1s budget" in proc.stderr
    listing = proc.stderr.split("budget", 1)[1]
    assert re.search(r"\n\s+\d+\s+\d+ S\s+\d+ \S+\s+sleep 300\n", listing), (
        listing
    )  # pid ppid state age wchan cmd
    grandchild = int(proc.stdout.split()[0])
    time.sleep(0.5)
    stat = Path(f"/proc/{grandchild}/stat")
    assert not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"


def test_a_stuck_pytest_prints_every_stack_before_it_is_killed(tmp_path: Path) -> None:
    (tmp_path / "test_case.py").write_text("import time\n\n\ndef test_stuck():\n    time.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "VLA_TEST_HARD_LIMIT_S": "0"}
    pytest_cmd = [sys.executable, "-m", "pytest", "-p", "hard_limit", "-p", "no:cacheprovider", "--timeout=0"]
    proc = _run(
        ["--budget-s", "4", "--poll-s", "0.2", "--grace-s", "2"],
        [*pytest_cmd, "test_case.py"],
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 124
    assert 'test_case.py", line 5 in test_stuck' in proc.stderr  # pytest's SIGUSR1 stacks


def test_a_spawned_rank_past_the_rank_limit_writes_its_stacks_and_is_killed(tmp_path: Path) -> None:
    # A distributed test's rank that outlives every test: the command (the test) goes on and sees it die.
    stacks = tmp_path / "rank.stacks"
    script = (
        "import faulthandler, multiprocessing, signal, sys, time\n"
        "def rank(path):\n"
        "    faulthandler.register(signal.SIGUSR1, file=open(path, 'w'), all_threads=True)\n"
        "    time.sleep(300)\n"
        "if __name__ == '__main__':\n"
        "    child = multiprocessing.get_context('spawn').Process(target=rank, args=(sys.argv[1],))\n"
        "    child.start(); child.join()\n"
        "    print('rank ended with', child.exitcode)\n"
    )
    (tmp_path / "pytest_like.py").write_text(script)  # only pytest's spawned children are ranks
    start = time.monotonic()
    proc = _run(
        ["--rank-limit-s", "2", "--poll-s", "0.2", "--grace-s", "1"],
        [sys.executable, str(tmp_path / "pytest_like.py"), str(stacks)],
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "rank ended with -9\n"  # killed, and the command itself went on
    assert "a spawned child (a distributed test's rank), has run" in proc.stderr
    assert (
        "longer than any test may (--rank-limit-s 2): asking for its stacks, then killing it" in proc.stderr
    )
    assert "in rank" in stacks.read_text()  # the stacks it wrote when asked
    assert time.monotonic() - start < 60


def test_a_signal_to_the_supervisor_ends_the_command() -> None:
    supervisor = subprocess.Popen(
        [*SUPERVISE, "--poll-s", "0.2", "--", "sleep", "300"], stderr=subprocess.PIPE
    )
    time.sleep(1.0)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=30) == 128 + signal.SIGTERM


def test_no_command_is_a_usage_error() -> None:
    proc = subprocess.run(SUPERVISE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no command given" in proc.stderr
