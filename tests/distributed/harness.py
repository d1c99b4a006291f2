"""Run a function on W gloo ranks in fresh processes, with a hard timeout and per-rank errors.

    results = run_ranks("workers:fsdp_scenarios", world=2, args=(...), timeout=240)

The target is "module:function" resolved in the child with this directory on sys.path, called as
fn(rank, world, *args); its return value comes back through torch.save. A rank that raises fails
the test with that rank's traceback; a rank still running at the deadline writes its stacks and ends
itself, and the test names it with them, so a collective mismatch can never hang the suite and a hang
says where it is.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


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
) -> None:
    import torch
    import torch.distributed as dist

    # A rank still running at the deadline writes every thread's stack and exits (a C watchdog thread:
    # it works while the rank is blocked in gloo). The rank ends itself rather than waiting for the
    # parent to kill it: once, two ranks spinning in gloo's TCP loop starved the parent so that its
    # own deadline passed unnoticed for 15 minutes.
    stack_file = open(Path(out_dir) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (lives as long as the rank)
    faulthandler.dump_traceback_later(deadline_s, exit=True, file=stack_file)
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
    target: str, world: int, args: tuple = (), *, timeout: float = 300, pg_timeout: float = 120
) -> list[Any]:
    import torch

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [
            ctx.Process(
                target=_entry,
                args=(r, world, port, target, args, out_dir, pg_timeout, timeout),
                daemon=True,
            )
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout + 10  # the ranks' own watchdogs end them at `timeout`
            failed_at: float | None = None
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                errors = sorted(Path(out_dir).glob("rank*.err"))
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
        # The first rank to fail is the cause; the others usually fail because it left.
        error_files = sorted(Path(out_dir).glob("rank*.err"), key=lambda f: f.stat().st_mtime)
        if error_files:
            first = error_files[0]
            others = [int(f.stem[4:]) for f in error_files[1:]]
            raise AssertionError(
                f"{target} on {world} ranks: rank {int(first.stem[4:])} failed first "
                f"(then ranks {others}):\n{first.read_text()}"
            )
        out = Path(out_dir)
        hung = [  # killed here, or ended by its watchdog (stacks written) before returning anything
            r
            for r in range(world)
            if r in alive or (not (out / f"rank{r}.pt").exists() and _size(out / f"rank{r}.stacks") > 0)
        ]
        if hung:
            stacks = ""
            for r in hung:
                stack_file = out / f"rank{r}.stacks"
                stack = stack_file.read_text() if stack_file.exists() else ""
                how = "killed by the harness" if r in alive else "ended itself"
                stacks += f"\n--- rank {r} ({how}) ---\n{stack or '(none written: it had not started)'}"
            raise AssertionError(
                f"{target} on {world} ranks: ranks {hung} still running after {timeout:.0f}s (hang); "
                f"their stacks at the deadline:{stacks}"
            )
        results = []
        for r in range(world):
            path = Path(out_dir) / f"rank{r}.pt"
            if not path.exists():
                code = procs[r].exitcode
                raise AssertionError(f"{target}: rank {r} exited with code {code} and returned nothing")
            # A rank may abort at interpreter shutdown after returning (a known gloo teardown race);
            # its result was written atomically before that, so it still counts.
            results.append(torch.load(path, weights_only=False))
        return results
