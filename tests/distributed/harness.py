"""Run a function on W gloo ranks in fresh processes, with a hard timeout and per-rank errors.

    results = run_ranks("workers:fsdp_scenarios", world=2, args=(...), timeout=240)

The target is "module:function" resolved in the child with this directory on sys.path, called as
fn(rank, world, *args); its return value comes back through torch.save. A rank that raises fails
the test with that rank's traceback; ranks still running at the deadline are killed and named with
the stacks they were in shortly before, so a collective mismatch can never hang the suite and a hang
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
    stacks_after: float,
) -> None:
    import torch
    import torch.distributed as dist

    # A rank still running just before the parent's deadline writes every thread's stack (a C
    # watchdog thread: it works while the rank is blocked in gloo), so a hang says where it is.
    stack_file = open(Path(out_dir) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (lives as long as the rank)
    faulthandler.dump_traceback_later(stacks_after, file=stack_file)
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
                args=(r, world, port, target, args, out_dir, pg_timeout, max(timeout - 10, timeout / 2)),
                daemon=True,
            )
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
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
        if alive:
            stacks = ""
            for r in alive:
                stack_file = Path(out_dir) / f"rank{r}.stacks"
                stack = stack_file.read_text() if stack_file.exists() else ""
                stacks += f"\n--- rank {r} ---\n{stack or '(none written: it had not started)'}"
            raise AssertionError(
                f"{target} on {world} ranks: ranks {alive} still running after {timeout:.0f}s (hang); "
                f"their stacks shortly before:{stacks}"
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
