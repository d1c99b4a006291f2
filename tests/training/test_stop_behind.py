"""`stop_behind`: a SIGTERM to the whole process group also kills the DataLoader workers, and the error
PyTorch raises for them must still end the run as stopped (exit 130), not as a failure."""

from __future__ import annotations

import pytest

from vla.training.guards import StopRequested, StopSignals, stop_behind

WORKER_DIED = "DataLoader worker (pid 2560) is killed by signal: Terminated. "


def _raised_while_handling(first: BaseException, second: BaseException) -> BaseException:
    try:
        try:
            raise first
        finally:
            raise second
    except BaseException as exc:
        return exc


def test_the_stop_behind_a_later_error_is_found() -> None:
    stop = StopRequested("stopped: SIGTERM arrived while the closed-loop evaluation")
    error = _raised_while_handling(stop, RuntimeError(WORKER_DIED))
    assert stop_behind(error) is stop
    # two links deep, and through an explicit `raise ... from`
    deeper = _raised_while_handling(error, OSError("EGL_NOT_INITIALIZED"))
    assert stop_behind(deeper) is stop
    caused = ValueError("wrapped")
    caused.__cause__ = stop
    assert stop_behind(caused) is stop


def test_an_error_of_its_own_is_not_a_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StopSignals, "received", None)
    assert stop_behind(RuntimeError("shape mismatch")) is None
    assert stop_behind(_raised_while_handling(KeyError("a"), RuntimeError("b"))) is None
    # a worker that died with no stop signal in this process is a real failure (out of memory, a crash)
    assert stop_behind(RuntimeError(WORKER_DIED)) is None


def test_a_dead_worker_after_a_stop_signal_is_the_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StopSignals, "received", "SIGTERM")
    stop = stop_behind(RuntimeError(WORKER_DIED))
    assert isinstance(stop, StopRequested)
    assert "SIGTERM arrived" in str(stop) and "trainer.resume=auto" in str(stop)
    assert stop_behind(RuntimeError("shape mismatch")) is None  # other errors stay errors
