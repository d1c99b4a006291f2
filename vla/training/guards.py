"""How a run ends: stop signals, orphaned workers, exit codes, the output directory, non-finite metrics.

Exit codes of `train.py` (README, "How the trainer behaves"):

    0    finished: every step trained, evaluated and exported
    1    failed: an error (bad config or data, NaN, a damaged checkpoint, a locked output_dir, a lost
         launcher, ...); the message names the key or file and the fix
    130  stopped by SIGINT/SIGTERM: after a checkpoint when the signal came inside a training step, at
         once otherwise; `trainer.resume=auto` continues from the last checkpoint

Stop signals (`StopSignals`): inside the step loop a first SIGINT/SIGTERM only sets a flag; the loop
finishes the step, saves a checkpoint and stops. Outside a training step (building the data,
resuming, validation, evaluation, export) nothing would ever look at that flag soon, so the handler
raises `StopRequested` at once; a second signal, or a step that does not end within
`trainer.stop_grace_s` seconds (stuck in a loader or a collective), does the same. StopRequested is a
BaseException, so library code catching Exception does not swallow it.

A signal sent to the whole process group (Slurm's scancel, `kill -- -PGID`) also ends the DataLoader
workers, and PyTorch's SIGCHLD handler then raises "DataLoader worker ... is killed by signal" in the
middle of the stop; `stop_behind` finds the stop behind such an error, so the run still ends as stopped
(exit 130, one line) instead of failing with a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_STOPPED = 130


class StopRequested(BaseException):
    """SIGINT/SIGTERM ended the run without waiting for a step boundary."""


def stop_behind(exc: BaseException) -> StopRequested | None:
    """The StopRequested that `exc` was raised while handling (its __context__ / __cause__ chain), or, when
    a stop signal arrived in this process and `exc` is a DataLoader worker killed by a signal, a
    StopRequested saying so; None for an error of its own."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, StopRequested):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    if StopSignals.received is not None and "is killed by signal" in str(exc):
        return StopRequested(
            f"stopped: {StopSignals.received} arrived, and it ended the DataLoader workers too; nothing was "
            "saved for the current step. Resume from the last checkpoint with trainer.resume=auto (exit code 130)"
        )
    return None


def quiet_worker_deaths() -> None:
    """After a stop: put SIGCHLD back to its default, so DataLoader workers that died of the same signal do
    not make PyTorch's SIGCHLD handler raise again from iterators being torn down at exit ("Exception
    ignored in ... __del__" tracebacks). Main thread only; the run is over when this is called."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


class NonFiniteMetricError(RuntimeError):
    """Validation loss or open-loop error came out NaN/inf: the run must not end as a success."""


class StopSignals:
    """SIGINT/SIGTERM handling with a graceful phase (training steps) and an abrupt one (the rest).

    Use as a context manager (main thread only; elsewhere it does nothing). Nested uses share the
    outermost instance's handlers. `requested` is the flag the step loop reads at step boundaries.
    """

    _active: StopSignals | None = None
    # The first stop signal this process received (its name), kept after the handlers are removed
    received: str | None = None

    def __init__(self, grace_s: float = 120.0) -> None:
        self.grace_s = grace_s
        self.requested = False
        self.signal_name: str | None = None
        self.phase = "outside a training step (building the data, resuming, evaluating or exporting)"
        self.graceful = False
        self._previous: dict[int, Any] = {}
        self._owner = False
        self._timer: threading.Timer | None = None
        self._grace_expired = False

    # -- installation
    def __enter__(self) -> StopSignals:
        outer = StopSignals._active
        if outer is not None:  # reuse the installed handlers; the newest grace period wins
            outer.grace_s = self.grace_s
            return outer
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        self._owner = True
        StopSignals._active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._owner:
            return
        self._disarm()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._owner = False
        StopSignals._active = None

    # -- phases
    @contextlib.contextmanager
    def training_steps(self) -> Iterator[StopSignals]:
        """The step loop: a first signal sets `requested` (and arms the grace timer)."""
        with self._phase("a training step", graceful=True):
            yield self

    @contextlib.contextmanager
    def outside_step(self, what: str) -> Iterator[None]:
        """Validation, evaluation, ...: a signal arriving here stops at once."""
        with self._phase(what, graceful=False):
            yield

    def at_boundary(self) -> None:
        """The loop reached a step boundary and will save and stop: the grace timer is off."""
        self._disarm()
        self.phase = "saving the checkpoint after a stop request"

    @contextlib.contextmanager
    def _phase(self, what: str, *, graceful: bool) -> Iterator[None]:
        saved = self.phase, self.graceful
        self.phase, self.graceful = what, graceful
        try:
            yield
        finally:
            self.phase, self.graceful = saved

    # -- the handler
    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        StopSignals.received = StopSignals.received or name
        if self._grace_expired:
            self._stop(
                f"{self.signal_name} was received but the training step did not end within "
                f"trainer.stop_grace_s={self.grace_s:g} s (stuck in data loading or a collective?)"
            )
        if self.requested:
            self._stop(f"a second {name} arrived while {self.phase}")
        if not self.graceful:
            self.signal_name = name
            self._stop(f"{name} arrived while {self.phase}")
        self.requested = True
        self.signal_name = name
        # A timer thread re-sends the signal to the main thread when the grace period ends: a signal
        # aimed at the main thread interrupts a blocking call there (sleep, a queue wait), so the
        # handler runs and raises. (No SIGALRM/ITIMER_REAL: pytest-timeout and others own those.)
        main = threading.main_thread().ident
        self._timer = threading.Timer(self.grace_s, self._expire, args=(main, signum))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, main: int, signum: int) -> None:
        self._grace_expired = True
        signal.pthread_kill(main, signum)

    def _stop(self, why: str) -> None:
        self._disarm()
        raise StopRequested(
            f"stopped: {why}; nothing was saved for the current step. Resume from the last checkpoint with "
            "trainer.resume=auto (exit code 130)"
        )

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def outside_step(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Method decorator: run it in StopSignals' abrupt phase; skip it (return None) when a stop was
    requested during the step before, so the loop reaches its boundary, saves and stops."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            stop = StopSignals._active
            # Agreed over the ranks: one rank skipping a collective evaluation would hang the others.
            if stop is not None and _any_rank(stop.requested, getattr(self, "device", None)):
                return None
            context = stop.outside_step(what) if stop is not None else contextlib.nullcontext()
            with context:
                return fn(self, *args, **kwargs)

        return inner

    return wrap


def _any_rank(flag: bool, device: Any) -> bool:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


# ---------------------------------------------------------------------------------------------------------
# Orphaned workers


def launched_by_torchrun() -> bool:
    """torchrun / `accelerate launch` (torchelastic) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


def start_launcher_watchdog(interval_s: float = 1.0, *, force: bool = False) -> threading.Thread | None:
    """Exit this worker (code 1) when its launcher dies, instead of training on as an orphan.

    Only under torchrun / accelerate launch (or with force=True): a plain `python train.py` keeps
    running when its shell goes away (nohup). The daemon thread compares os.getppid() with the
    parent seen at start every `interval_s` seconds; a kill -9 of the torchrun agent reparents the
    worker, and within a second it prints what happened and exits without writing anything more.
    """
    if not (force or launched_by_torchrun()):
        return None
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                rank = os.environ.get("RANK", "?")
                sys.stderr.write(
                    f"vla: the launcher (pid {parent}) of rank {rank} (pid {os.getpid()}) is gone (killed?); "
                    "this worker exits now instead of training on as an orphan and writing into output_dir. "
                    "Relaunch the job with trainer.resume=auto to continue from the last checkpoint.\n"
                )
                sys.stderr.flush()
                os._exit(EXIT_FAILED)

    thread = threading.Thread(target=watch, name="vla-launcher-watchdog", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------------------------------------------
# The output directory and metrics


def check_output_dir(path: Path) -> None:
    """A clear error when output_dir (or one of its parents) is a file; nothing is created here."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"output_dir={str(path)!r} is a file, not a directory; set output_dir to a directory "
            "(it is created if missing) or move the file away"
        )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(
                    f"output_dir={str(path)!r} cannot be created: {parent} is a file; choose an "
                    "output_dir under a directory"
                )
            if not os.access(parent, os.W_OK | os.X_OK) and not path.exists():
                raise PermissionError(
                    f"output_dir={str(path)!r} cannot be created: {parent} is not writable; choose a "
                    "writable output_dir"
                )
            break


def check_finite_metrics(values: dict[str, Any], *, step: int, hint: str) -> None:
    """Raise NonFiniteMetricError naming every NaN/inf among `values` (floats; others ignored)."""
    bad = {k: v for k, v in values.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:
        listing = ", ".join(f"{k} = {v}" for k, v in bad.items())
        raise NonFiniteMetricError(
            f"after step {step}: {listing}; the run does not count as a success. {hint}"
        )
