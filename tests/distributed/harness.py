"""Run a function on W gloo ranks in fresh processes, with a hard timeout and per-rank errors.

    results = run_ranks("workers:fsdp_scenarios", world=2, args=(...), timeout=250)

The target is "module:function" resolved in the child with this directory on sys.path, called as
fn(rank, world, *args); its return value comes back through torch.save. A rank that raises fails
the test with that rank's traceback. A rank that does not finish is a hang, bounded three ways, each
writing the rank's stacks: its own watchdog ends it at the deadline, the kernel ends it past its
CPU-time limit (a rank spinning in native code), and CI's supervisor asks a rank that outlives every
test's limit for its stacks and kills it. Before a rank ends that way, the harness records which of its
threads ran or waited (CPU seconds, kernel wait channel) and their native stacks (gdb, where installed):
at 3/4 of its CPU-time limit, and 20 s before the deadline. A hang is run once more, with a warning that
carries the first run's report (a rank of the 4-rank split scenario was seen to spin 133 CPU-seconds
waiting on an all-to-all, rarely, and never twice in a row); a second hang fails the test with both.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Ended from outside without a result: the kernel's CPU-time limit (SIGKILL at the hard limit, SIGXCPU
# if a handler chain lets it through) or a supervisor's SIGKILL.
_OUTSIDE_SIGNALS = {-signal.SIGKILL: "SIGKILL", -signal.SIGXCPU: "SIGXCPU"}


class RankHang(AssertionError):
    """Ranks that did not finish: still running at the deadline, or ended from outside."""


class HangRetried(UserWarning):
    """A run of ranks hung once and passed when run again; the message holds the first run's stacks."""


def thread_table(pid: int) -> str:
    """One line per thread of `pid` (Linux /proc): name, state, CPU seconds, kernel wait channel, syscall."""
    hz = os.sysconf("SC_CLK_TCK")
    rows = []
    tasks = Path(f"/proc/{pid}/task")
    for task in sorted(tasks.iterdir(), key=lambda t: int(t.name)) if tasks.exists() else []:
        try:
            stat = (task / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            name = (task / "comm").read_text().strip()
            wchan = (task / "wchan").read_text().strip() or "-"
            syscall = (task / "syscall").read_text().split()[0]
        except (OSError, IndexError):
            continue
        user, system = int(fields[11]) / hz, int(fields[12]) / hz
        rows.append(
            f"  tid {task.name:>7} {name:<16} {fields[0]} user {user:6.1f}s sys {system:6.1f}s "
            f"wchan {wchan:<20} syscall {syscall}"
        )
    return "\n".join(rows)


def native_stacks(pid: int, timeout: float = 60) -> str:
    """Every thread's native stack (gdb, where installed; it stops the process while it reads)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb is not installed: no native stacks)"
    try:
        done = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 16"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"(gdb did not finish in {timeout:.0f}s)"
    return "\n".join(line for line in done.stdout.splitlines() if line.startswith(("Thread ", "#")))


def _cpu_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world: int,
    port: int,
    target: str,
    args: tuple,
    out_dir: str,
    pg_timeout: float,
    deadline_s: float,
    cpu_limit_s: float,
) -> None:
    import torch
    import torch.distributed as dist

    # A rank still running at the deadline writes every thread's stack and exits (a C watchdog thread:
    # it works while the rank is blocked in gloo). The rank ends itself rather than waiting for the
    # parent to kill it: once, two ranks spinning in gloo's TCP loop starved the parent so that its
    # own deadline passed unnoticed for 15 minutes.
    stack_file = open(Path(out_dir) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (lives as long as the rank)
    faulthandler.dump_traceback_later(deadline_s, exit=True, file=stack_file)
    # A rank spinning in native code (gloo's TCP loop, seen at 95% CPU) starved every other process
    # here, watchdogs included, for as long as it spun. The kernel's CPU-time limit needs no one's
    # help: at the soft limit SIGXCPU writes the stacks, one CPU-second later the hard limit kills it.
    faulthandler.register(signal.SIGXCPU, file=stack_file, all_threads=True)
    soft = max(1, int(cpu_limit_s))
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    # CI's supervisor asks for the stacks (SIGUSR1) before it kills a rank that outlived every test.
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    sys.path.insert(0, str(HERE))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(rank, world, *args)
        tmp = out / f"rank{rank}.pt.tmp"
        torch.save(result, tmp)
        tmp.rename(out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def run_ranks(
    target: str,
    world: int,
    args: tuple = (),
    *,
    timeout: float = 300,
    pg_timeout: float = 120,
    cpu_limit: float | None = None,
    attempts: int = 2,
) -> list[Any]:
    """fn(rank, world, *args) on `world` fresh gloo ranks; every rank's return value, in rank order.

    timeout: wall seconds before a rank is a hang; `attempts` runs of it must fit in the test's
    pytest-timeout (600 s), so 250 s at most with the default two (a scenario takes 10-70 s here).
    cpu_limit: CPU seconds per rank before the kernel ends it (default timeout / 3: the heaviest
    scenario used 12.5 s). attempts: runs allowed when the ranks hang (a failure a rank raises is never
    run again).
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    cpu_limit = max(timeout / 3, 10.0) if cpu_limit is None else cpu_limit
    hangs: list[str] = []
    for attempt in range(1, attempts + 1):
        try:
            return _run_once(target, world, args, timeout, pg_timeout, cpu_limit)
        except RankHang as hang:
            hangs.append(f"[run {attempt} of {attempts}] {hang}")
            if attempt < attempts:
                warnings.warn(
                    f"{target} on {world} ranks hung; running it again.\n{hang}", HangRetried, stacklevel=2
                )
    raise RankHang("\n\n".join(hangs))


def _run_once(
    target: str, world: int, args: tuple, timeout: float, pg_timeout: float, cpu_limit: float
) -> list[Any]:
    import torch

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        out = Path(out_dir)
        port = free_port()
        procs = [
            ctx.Process(
                target=_entry,
                args=(r, world, port, target, args, out_dir, pg_timeout, timeout, cpu_limit),
                daemon=True,
            )
            for r in range(world)
        ]
        diagnosed: set[int] = set()

        def diagnose(r: int, why: str) -> None:
            """Which thread of a suspect rank spins or waits, and where in native code, before it ends."""
            pid = procs[r].pid
            if r in diagnosed or pid is None or not procs[r].is_alive():
                return
            diagnosed.add(r)
            table = thread_table(pid)
            (out / f"rank{r}.native").write_text(
                f"{why}\nthreads:\n{table}\nnative stacks:\n{native_stacks(pid)}\n"
            )

        try:
            for p in procs:
                p.start()
            start = time.monotonic()
            deadline = start + timeout + 10  # the ranks' own watchdogs end them at `timeout`
            # A hang's native picture is taken while the ranks still run: 20 s before their deadline,
            # and for a rank that has used 3/4 of its CPU-time limit (a spin; the kernel ends it at the limit).
            look_at = start + timeout - 20 if timeout >= 60 else None
            failed_at: float | None = None
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                for r, p in enumerate(procs):
                    used = _cpu_seconds(p.pid) if p.pid is not None else 0.0
                    if used > 0.75 * cpu_limit:
                        diagnose(r, f"it had used {used:.0f}s of CPU time ({cpu_limit:.0f}s allowed)")
                if look_at is not None and now > look_at:
                    for r in range(world):
                        diagnose(
                            r,
                            f"it was still running {now - start:.0f}s after it started ({timeout:.0f}s allowed)",
                        )
                    look_at = None
                errors = sorted(out.glob("rank*.err"))
                if errors and failed_at is None:
                    failed_at = now
                # After one rank fails, the others get a short grace to fail too (their collectives
                # error out), then they are killed: the suite never waits out a hang.
                if now > deadline or (failed_at is not None and now - failed_at > 20):
                    break
                time.sleep(0.05)
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:
            # Also when the wait is cut short (pytest-timeout, Ctrl-C): no rank outlives its test.
            for p in (p for p in procs if p.pid is not None):  # the started ones
                if p.is_alive():
                    p.kill()
                p.join(5)

        def finished(r: int) -> bool:
            return (out / f"rank{r}.pt").exists() or (out / f"rank{r}.err").exists()

        def stacks(ranks: list[int], how: dict[int, str]) -> str:
            text = ""
            for r in ranks:
                stack_file = out / f"rank{r}.stacks"
                stack = stack_file.read_text() if stack_file.exists() else ""
                text += f"\n--- rank {r} ({how[r]}) ---\n{stack or '(none written: it had not started)'}"
                native = out / f"rank{r}.native"
                if native.exists():
                    text += f"\n--- rank {r}, seen by the harness before it ended: {native.read_text()}"
            return text

        # A rank ended by a signal from outside is the cause; the others' errors follow from it.
        outside = {
            r: f"ended by {_OUTSIDE_SIGNALS[p.exitcode]}: its CPU-time limit of {cpu_limit:.0f}s, or a supervisor"
            for r, p in enumerate(procs)
            if r not in alive and not finished(r) and p.exitcode in _OUTSIDE_SIGNALS
        }
        if outside:
            raise RankHang(
                f"{target} on {world} ranks: ranks {sorted(outside)} ended from outside without a result "
                f"(hang); their stacks:{stacks(sorted(outside), outside)}"
            )
        # A rank whose watchdog ended it at the deadline wrote its stacks first; a peer whose collective
        # then failed (the rank left) is not the cause.
        error_files = sorted(out.glob("rank*.err"), key=lambda f: f.stat().st_mtime)
        ended_itself = [r for r in range(world) if not finished(r) and _size(out / f"rank{r}.stacks") > 0]
        first_dump = min(((out / f"rank{r}.stacks").stat().st_mtime for r in ended_itself), default=None)
        dumped_first = first_dump is not None and (
            not error_files or first_dump <= error_files[0].stat().st_mtime
        )
        if dumped_first or (alive and not error_files):
            how = {r: "ended itself" for r in ended_itself} | {r: "killed by the harness" for r in alive}
            after = [int(f.stem[4:]) for f in error_files]
            raise RankHang(
                f"{target} on {world} ranks: ranks {sorted(how)} still running after {timeout:.0f}s (hang)"
                + (f"; then ranks {after} failed (their peers left)" if after else "")
                + f"; their stacks at the deadline:{stacks(sorted(how), how)}"
            )
        # The first rank to fail is the cause; the others usually fail because it left.
        if error_files:
            first = error_files[0]
            others = [int(f.stem[4:]) for f in error_files[1:]]
            raise AssertionError(
                f"{target} on {world} ranks: rank {int(first.stem[4:])} failed first "
                f"(then ranks {others}):\n{first.read_text()}"
            )
        results = []
        for r in range(world):
            path = out / f"rank{r}.pt"
            if not path.exists():
                code = procs[r].exitcode
                raise AssertionError(f"{target}: rank {r} exited with code {code} and returned nothing")
            # A rank may abort at interpreter shutdown after returning (a known gloo teardown race);
            # its result was written atomically before that, so it still counts.
            results.append(torch.load(path, weights_only=False))
        return results
