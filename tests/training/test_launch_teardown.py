"""vla.launch after Ctrl-C: torchrun's rendezvous heartbeat may be released on its own thread (a torch race)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from _trainer_runs import ROOT

# The race made deterministic: the heartbeat holds its handler while the main thread drops the last other
# reference, so the handler (and its _PeriodicTimer) is released on the timer's own thread.
RACE = textwrap.dedent(
    """
    import sys, threading, time, weakref
    from datetime import timedelta
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    if sys.argv[1] == "quiet":
        from vla.launch import drop_heartbeat_self_join_reports
        drop_heartbeat_self_join_reports()

    inside_beat = threading.Event()

    class Handler:  # as DynamicRendezvousHandler: the timer calls back through a weak reference
        def __init__(self):
            self.timer = _PeriodicTimer(timedelta(seconds=0.01), Handler.beat, weakref.ref(self))
            self.timer.start()

        @staticmethod
        def beat(weak_self):
            self = weak_self()
            if self is not None:
                inside_beat.set()
                time.sleep(0.3)

    handler = Handler()
    thread = handler.timer._thread
    assert inside_beat.wait(10)
    del handler
    thread.join(10)
    assert not thread.is_alive()
    class Other:
        def __del__(self):
            raise ValueError("another unraisable error")
    Other()
    print("done")
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", RACE, mode], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_heartbeat_releasing_itself_prints_no_traceback_under_vla_launch() -> None:
    plain = _run("plain")  # torch as it is: the finalizer joins its own thread
    assert plain.returncode == 0 and "done" in plain.stdout, plain.stderr
    assert "cannot join current thread" in plain.stderr and "_stop_thread" in plain.stderr

    quiet = _run("quiet")
    assert quiet.returncode == 0 and "done" in quiet.stdout, quiet.stderr
    assert "cannot join current thread" not in quiet.stderr and "_stop_thread" not in quiet.stderr
    assert "another unraisable error" in quiet.stderr  # every other report still printed
