#!/usr/bin/env python3
"""Run CI's command so that it can never sit out CI's whole budget silently.

    python3 .ci/supervise.py [--budget-s S] [--rank-limit-s R] [--poll-s P] [--heartbeat-s H] [--grace-s G] \
        -- COMMAND [ARGS...]

Two CI runs ended at CI's 5400 s limit with nothing printed after the same test, though pytest-timeout
(10 min), tests/hard_limit.py's watchdog thread (15 min) and the distributed harness's own deadline were
all armed. Most likely the test process was not running at all: stopped by a signal, blocked in the
kernel, or starved. The cause is not known. Only a process outside it can see any of that, so this one:

- runs COMMAND in a session of its own: it has no controlling terminal, so reading or configuring a
  terminal can never stop it (SIGTTIN/SIGTTOU);
- polls the processes of that session (psutil is not assumed: /proc only, stdlib only). One seen
  stopped (state T) on two polls running is reported and continued (SIGCONT);
- prints a one-line heartbeat every H seconds (processes, their states, load, free memory), so a
  freeze shows in the log as the time the heartbeats stopped;
- ends a child that pytest spawned (multiprocessing; a distributed test's rank) older than R seconds,
  longer than any test may (pytest-timeout's 600 s): it asks for its stacks first (SIGUSR1: the test
  harness writes them where the test reports them), then kills it, so the test fails or runs again
  instead of the whole run waiting. Once, such ranks and every bound inside the run (the harness's
  deadline, pytest-timeout, tests/hard_limit.py) stood still for an hour while this process kept time;
- past S seconds prints every process of the session (state, kernel wait channel, age, command
  line), asks pytest for every thread's stack (SIGUSR1: tests/hard_limit.py registers it), gives it
  G seconds to print them, then kills the session and exits 124.

It exits with COMMAND's status otherwise (128 + N if a signal N ended it, as a shell reports it).
SIGINT, SIGTERM and SIGHUP sent to it are passed on to the session.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

BUDGET_EXIT = 124
RANK_MARK = "from multiprocessing.spawn import spawn_main"  # how a spawned child's command line reads


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    session: int
    start_ticks: int
    wchan: str
    cmdline: str


def read_proc(pid: int) -> Proc | None:
    """One process from /proc, or None if it is gone (or unreadable)."""
    base = Path("/proc") / str(pid)
    try:
        stat = (base / "stat").read_text()
        raw_cmd = (base / "cmdline").read_bytes()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    try:
        wchan = (base / "wchan").read_text().strip() or "-"
    except OSError:
        wchan = "?"
    cmdline = raw_cmd.replace(b"\0", b" ").decode(errors="replace").strip()
    if not cmdline:
        cmdline = "[" + stat[stat.index("(") + 1 : stat.rindex(")")] + "]"
    return Proc(pid, int(fields[1]), fields[0], int(fields[3]), int(fields[19]), wchan, cmdline)


def session_processes(session: int) -> list[Proc]:
    """Every process whose session id is `session` (orphans reparented to init included)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            proc = read_proc(int(entry.name))
            if proc is not None and proc.session == session:
                found.append(proc)
    return sorted(found, key=lambda p: p.pid)


def _uptime_ticks() -> float:
    return float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")


def age_s(proc: Proc) -> float:
    return (_uptime_ticks() - proc.start_ticks) / os.sysconf("SC_CLK_TCK")


def describe(procs: list[Proc], width: int = 160) -> str:
    lines = [f"{'pid':>7} {'ppid':>7} st {'age_s':>7} {'wchan':<24} command"]
    for p in procs:
        age = age_s(p)
        lines.append(
            f"{p.pid:>7} {p.ppid:>7} {p.state:<2} {age:>7.0f} {p.wchan[:24]:<24} {p.cmdline[:width]}"
        )
    return "\n".join(lines)


def _memory_available_mb() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return f"{int(line.split()[1]) // 1024} MB"
    return "?"


def heartbeat(elapsed: float, procs: list[Proc]) -> str:
    states = Counter(p.state for p in procs)
    load = Path("/proc/loadavg").read_text().split()[0]
    summary = " ".join(f"{s}:{n}" for s, n in sorted(states.items()))
    return (
        f"[ci/supervise] {elapsed:.0f}s: {len(procs)} processes ({summary}), load {load}, "
        f"{_memory_available_mb()} available"
    )


def say(message: str) -> None:
    # stderr is CI's log; a line of its own so it is not lost inside pytest's row of dots.
    sys.stderr.write("\n" + message + "\n")
    sys.stderr.flush()


def end_overdue_ranks(procs: list[Proc], rank_limit_s: float, grace_s: float) -> None:
    """Ask every child that pytest spawned and that is older than rank_limit_s for its stacks, then kill it."""
    pytest_pids = {p.pid for p in procs if "pytest" in p.cmdline}
    overdue = [
        p for p in procs if p.ppid in pytest_pids and RANK_MARK in p.cmdline and age_s(p) > rank_limit_s
    ]
    if not overdue:
        return
    for p in overdue:
        say(
            f"[ci/supervise] pid {p.pid}, a spawned child (a distributed test's rank), has run "
            f"{age_s(p):.0f}s, longer than any test may (--rank-limit-s {rank_limit_s:g}): "
            f"asking for its stacks, then killing it"
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)
            os.kill(p.pid, signal.SIGUSR1)
    say(describe(procs))
    time.sleep(grace_s)
    for p in overdue:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)


def supervise(
    command: list[str],
    budget_s: float,
    rank_limit_s: float,
    poll_s: float,
    heartbeat_s: float,
    grace_s: float,
) -> int:
    child = subprocess.Popen(command, start_new_session=True)
    session = child.pid  # the child is its session's (and process group's) leader

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session, signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)

    start = time.monotonic()
    next_heartbeat = start + heartbeat_s
    seen_stopped: set[int] = set()
    listed: set[int] = set()  # a process that stops again and again is listed once, then named
    while True:
        try:
            status = child.wait(timeout=poll_s)
            return 128 - status if status < 0 else status
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        procs = session_processes(session)
        stopped = {p.pid for p in procs if p.state in ("T", "t")}
        for pid in sorted(stopped & seen_stopped):
            say(f"[ci/supervise] pid {pid} has been stopped by a signal for over {poll_s:g}s; continuing it")
            if pid not in listed:
                say(describe(procs))
                listed.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        seen_stopped = stopped - seen_stopped
        end_overdue_ranks(procs, rank_limit_s, grace_s)
        if now >= next_heartbeat:
            say(heartbeat(now - start, procs))
            next_heartbeat = now + heartbeat_s
        if now - start > budget_s:
            return _end_over_budget(child, session, budget_s, grace_s, procs)


def _end_over_budget(
    child: subprocess.Popen, session: int, budget_s: float, grace_s: float, procs: list[Proc]
) -> int:
    say(
        f"[ci/supervise] the command is still running after its {budget_s:.0f}s budget: "
        f"these are its processes; pytest's stacks follow, then they are killed"
    )
    say(describe(procs))
    for p in procs:
        if "pytest" in p.cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGUSR1)
    time.sleep(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(session, signal.SIGKILL)
    for p in session_processes(session):  # a process that left the group but not the session
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    child.wait(timeout=30)
    return BUDGET_EXIT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=3600.0, help="kill the command after this long")
    parser.add_argument(
        "--rank-limit-s",
        type=float,
        default=600.0,
        help="ask a spawned child (a distributed test's rank) older than this for its stacks and kill it",
    )
    parser.add_argument("--poll-s", type=float, default=5.0, help="how often its processes are checked")
    parser.add_argument("--heartbeat-s", type=float, default=300.0, help="how often a status line is printed")
    parser.add_argument("--grace-s", type=float, default=5.0, help="time for pytest to print its stacks")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: supervise.py [options] -- COMMAND [ARGS...]")
    if min(args.budget_s, args.rank_limit_s, args.poll_s, args.heartbeat_s) <= 0:
        parser.error("--budget-s, --rank-limit-s, --poll-s and --heartbeat-s must be positive")
    return supervise(
        command, args.budget_s, args.rank_limit_s, args.poll_s, args.heartbeat_s, max(args.grace_s, 0.0)
    )


if __name__ == "__main__":
    sys.exit(main())
