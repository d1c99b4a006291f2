"""Writing one file so that readers see the old content or the new one, never half of it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_file_atomically(path: Path, write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` writes a temporary file beside `path`; it is fsynced and renamed onto `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
