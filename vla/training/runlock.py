"""One writer per run directory: `output_dir/run.lock`, held by rank 0 for the whole run.

The lock is an flock on `run.lock` (released by the kernel however the process ends, kill -9
included) whose content names the holder: pid, host, start time and command line. A second run on
the same output_dir fails at once naming the holder. A lock file left by a dead process is taken over
with a warning: the flock is free and, on the same host, the recorded pid no longer runs. A lock
file whose holder is on another host and whose flock is free cannot be checked from here (flock over
a network filesystem is not reliable): the error says to delete the file if that run is over.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

LOCK_FILE = "run.lock"


class RunLockError(RuntimeError):
    """Another run holds the output directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unknown process (the lock file is empty)"
    command = holder.get("command", "")
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}" + (
        f" ({command})" if command else ""
    )


class RunLock:
    """The lock on one run directory; `acquire()` raises RunLockError if another run holds it."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _read(self, fd: int) -> dict[str, Any]:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 1 << 16).decode(errors="replace")
        try:
            holder = json.loads(text) if text.strip() else {}
        except ValueError:
            holder = {"command": f"unreadable lock content {text[:80]!r}"}
        return holder if isinstance(holder, dict) else {}

    def acquire(self) -> None:
        if self._fd is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # retried only if the file was replaced between open and flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = self._read(fd)
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise RunLockError(f"cannot lock {self.path}: {exc}; check the filesystem") from exc
                message = self._held_message(holder)
                pid = holder.get("pid")
                if (
                    holder.get("host") == socket.gethostname()
                    and isinstance(pid, int)
                    and not _pid_alive(pid)
                ):
                    message += (
                        f" (pid {pid} has exited but a child of it still holds the lock, e.g. a DataLoader "
                        "worker that is ending: retry in a few seconds)"
                    )
                raise RunLockError(message) from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:
                os.close(fd)
                continue
            try:
                self._take(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            return
        raise RunLockError(f"could not lock {self.path}: it kept being replaced; is another run starting?")

    def _take(self, fd: int) -> None:
        previous = self._read(fd)
        host = socket.gethostname()
        if previous and previous.get("pid") != os.getpid():
            pid = previous.get("pid")
            if previous.get("host") != host:
                raise RunLockError(
                    self._held_message(previous)
                    + f" (on another host, so this host cannot check whether it still runs: if that run "
                    f"is over, delete {self.path})"
                )
            if isinstance(pid, int) and _pid_alive(pid):
                raise RunLockError(self._held_message(previous))
            warnings.warn(
                f"{self.path}: taking over the stale lock of {_describe(previous)}, which no longer runs "
                "(killed?); its last checkpoint is intact, see trainer.resume=auto",
                stacklevel=3,
            )
        record = {
            "pid": os.getpid(),
            "host": host,
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:500],
        }
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)

    def _held_message(self, holder: dict[str, Any]) -> str:
        return (
            f"output_dir {self.directory} is in use by another run: {_describe(holder)} holds {self.path}. "
            "Two runs writing one directory would mix their checkpoints and metrics. Wait for it to finish "
            "or stop it, or give this run another output_dir=..."
        )

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def acquire_run_lock(directory: Path, *, is_main: bool) -> RunLock | None:
    """Rank 0 takes the lock; every rank raises RunLockError alike if it could not. Collective."""
    import torch.distributed as dist

    lock = RunLock(directory) if is_main else None
    box: list[str | None] = [None]
    if lock is not None:
        try:
            lock.acquire()
        except (RunLockError, OSError) as exc:
            box[0] = str(exc)
            if not (dist.is_available() and dist.is_initialized()):
                raise
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RunLockError(box[0])
    return lock
