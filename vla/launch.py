"""`python -m vla.launch [torchrun options] train.py [overrides]`: torchrun, with a quiet ending.

Takes exactly torchrun's arguments and runs torchrun (`torch.distributed.run`) in this process. What it
changes is how the launcher ends:
- Ctrl-C / SIGTERM: torchrun forwards the signal to the workers, which finish their step, save a
  checkpoint and exit; torchrun itself then raises SignalException (a traceback, exit status 1). Here that
  becomes one line and exit status 130 (SIGINT) or 143 (SIGTERM), the shell's convention.
- A failed worker: the first rank that failed has already printed its error (vla.training.cli); instead of
  torchrun's ChildFailedError report, one line names the failed ranks and their exit codes (exit status 1).
- After a signal torchrun leaves its rendezvous heartbeat running on purpose (other nodes may still need the
  rendezvous). When the handler is then released while the heartbeat thread is inside a beat, the last
  reference drops on that thread, and the timer's finalizer joins its own thread: a harmless "Exception
  ignored ... cannot join current thread" traceback (the stop event is already set, so the thread ends). That
  one report is dropped; every other unraisable exception is printed as before.
Plain `torchrun` works the same otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

_HEARTBEAT_TEARDOWN = "torch/distributed/elastic/rendezvous/utils.py"


def _is_heartbeat_self_join(unraisable: Any) -> bool:
    """True for the one report described above: the rendezvous timer's finalizer joining its own thread."""
    if unraisable.exc_type is not RuntimeError or str(unraisable.exc_value) != "cannot join current thread":
        return False
    return any(
        frame.f_code.co_name == "_stop_thread"
        and frame.f_code.co_filename.replace(os.sep, "/").endswith(_HEARTBEAT_TEARDOWN)
        for frame, _ in traceback.walk_tb(unraisable.exc_traceback)
    )


def drop_heartbeat_self_join_reports() -> None:
    """Install a `sys.unraisablehook` that drops the heartbeat's self-join report and passes on the rest."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _is_heartbeat_self_join(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun's own log lines ("Sending process ... closing signal", "failed (exitcode: 1)") repeat what the
    # one line below says; rendezvous and worker-group problems still surface as exceptions.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    drop_heartbeat_self_join_reports()
    try:
        torchrun(argv)
    except SignalException as exc:
        print(f"vla.launch: stopped by {exc.sigval.name}; the workers saved a checkpoint", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        failed = ", ".join(
            f"rank {rank} (exit code {f.exitcode})" for rank, f in sorted(exc.failures.items())
        )
        print(f"vla.launch: failed: {failed}; the error is printed above", file=sys.stderr)
        return 1
    finally:
        # The workers' first-error marker (vla.training.cli.report_once) is named after this process.
        from vla.training.cli import remove_stale_error_markers

        remove_stale_error_markers(os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
