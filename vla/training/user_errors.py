"""Which failures are the user's to fix, and how train.py reports them: one short block, no traceback.

A user error is a problem in what the user gave (configuration, data, checkpoint, launch, files and
disk): its message already names the key or file and the fix, so a traceback would only bury it.
Everything else is a bug and keeps its traceback. HYDRA_FULL_ERROR=1 (Hydra's switch) or
VLA_TRACEBACK=1 shows the traceback of user errors too.

Classified as user errors:
- the project's own error types for bad input (_USER_ERROR_CLASSES), and missing / unreadable paths;
- ValueError / TypeError raised by the project's own validation (the innermost frame is in vla/ or
  dmuon/: a deliberate check, not a library failing on a bug), and OmegaConf's type/value errors;
- a disk that is full (ENOSPC), wherever it surfaces;
- a CheckpointError (a collective that failed on some rank) whose cause is one of the above.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
_OUR_CODE = (str(_REPO / "vla") + os.sep, str(_REPO / "dmuon") + os.sep)
TRACEBACK_SWITCHES = ("HYDRA_FULL_ERROR", "VLA_TRACEBACK")
MAX_LINES = 6


# The project's bad-input error types, by defining module: looked up in sys.modules, never imported, so
# classifying an error costs nothing (importing them all took ~4 s: DCP, transformers) and an exception
# can only be an instance of a class whose module has run.
_USER_ERROR_CLASSES = (
    ("vla.data.errors", "DatasetError"),
    ("vla.eval.exported", "DamagedExportError"),
    ("vla.models.weights", "CheckpointMismatchError"),
    ("vla.sim.metaworld_env", "SimError"),
    ("vla.training.checkpoint.errors", "DamagedCheckpointError"),
    ("vla.training.checkpoint.errors", "NonFiniteWeightsError"),
    ("vla.training.cli", "LaunchError"),
    ("vla.training.guards", "NonFiniteMetricError"),
    ("vla.training.loop", "NonFiniteLossError"),
    ("vla.training.preflight", "InsufficientMemoryError"),
    ("vla.training.resume", "ResumeMismatchError"),
    ("vla.training.rundir", "RunDirectoryError"),
    ("vla.training.runlock", "RunLockError"),
    ("omegaconf.errors", "OmegaConfBaseException"),
)
_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _loaded(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    """The classes among `names` whose modules are loaded."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in names)
    return tuple(cls for cls in found if isinstance(cls, type))


def _user_error_types() -> tuple[type[BaseException], ...]:
    return (*_loaded(_USER_ERROR_CLASSES), *_PATH_ERRORS)


def _raised_in_our_code(exc: BaseException) -> bool:
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return filename.startswith(_OUR_CODE)


def disk_full_error(exc: BaseException | None) -> OSError | None:
    """The ENOSPC OSError in `exc`'s cause chain (a checkpoint, export or dataset write on a full disk)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def is_user_error(exc: BaseException) -> bool:
    """Whether `exc` (or the failure it wraps) is the user's to fix; see the module docstring."""
    if disk_full_error(exc) is not None:
        return True
    if isinstance(exc, _user_error_types()):
        return True
    if isinstance(exc, ValueError | TypeError) and _raised_in_our_code(exc):
        return True
    wrapper = _loaded((("vla.training.checkpoint.errors", "CheckpointError"),))
    if wrapper and isinstance(exc, wrapper) and exc.__cause__ is not None:
        return is_user_error(exc.__cause__)
    return False


def traceback_requested() -> bool:
    return any(os.environ.get(name, "") not in ("", "0") for name in TRACEBACK_SWITCHES)


def describe(exc: BaseException) -> str:
    """The block train.py prints: 'error: <message>' and the switch for the traceback, at most
    MAX_LINES lines (a longer message is cut, saying how many lines were left out)."""
    full = disk_full_error(exc)
    if full is not None:
        where = full.filename or "the output or data directory"
        message = (
            f"no space left on the device holding {where}. The last complete checkpoint is kept: free some "
            "space (or point output_dir elsewhere), then resume with trainer.resume=auto"
        )
    else:
        message = str(exc) or type(exc).__name__
    lines = message.strip().splitlines() or [type(exc).__name__]
    budget = MAX_LINES - 1
    if len(lines) > budget:
        lines = [
            *lines[: budget - 1],
            f"... ({len(lines) - budget + 1} more lines; VLA_TRACEBACK=1 shows all)",
        ]
    lines[0] = f"error: {lines[0]}"
    return "\n".join([*lines, "(set VLA_TRACEBACK=1 or HYDRA_FULL_ERROR=1 for the traceback)"])


def report_user_errors(main: Callable[[], int]) -> int:
    """Run a script's main(): a user error prints describe()'s block and returns 1; a bug raises."""
    try:
        return main()
    except Exception as exc:
        if is_user_error(exc) and not traceback_requested():
            print(describe(exc), file=sys.stderr, flush=True)
            return 1
        raise
