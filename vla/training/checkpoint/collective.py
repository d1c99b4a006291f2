"""Rank agreement for the collective checkpoint calls: a failure on one rank is raised on every rank,
at the same point, so none is left waiting in the next collective."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from vla.training.checkpoint.errors import CheckpointError


def _dist_info() -> tuple[int, int, bool]:
    """(rank, world size, whether a default process group is initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _agree(error: BaseException | None, what: str, value: Any = None) -> None:
    """Every rank learns whether any rank failed `what` (and whether all passed the same `value`).

    This is the barrier between save/load phases: a rank that failed still joins it, so the others raise
    too instead of waiting forever in the next collective.
    """
    _, world, distributed = _dist_info()
    if not distributed:
        if error is not None:
            raise CheckpointError(f"{what} failed: {_describe(error)}") from error
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (None if error is None else _describe(error), value))
    failures = {r: msg for r, (msg, _) in enumerate(gathered) if msg is not None}
    if failures:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failures.items())
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failures)}: {detail}") from error
    values = [v for _, v in gathered]
    if any(v != values[0] for v in values):
        per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise CheckpointError(
            f"{what}: ranks disagree ({per_rank}); every rank must make the same checkpoint call "
            "with the same arguments"
        )


@contextmanager
def _capture(slot: list[BaseException]) -> Iterator[None]:
    """Record an exception for the next `_agree` instead of raising it before the other ranks know."""
    try:
        yield
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        slot.append(_unwrap_dcp(exc))


def _unwrap_dcp(exc: BaseException) -> BaseException:
    """DCP folds each rank's failure into a CheckpointException of tracebacks; an OSError inside (a full
    disk, a read-only directory) is what the user must see, with its errno, so it comes out first."""
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner: BaseException | None = failure[0] if isinstance(failure, tuple) else failure
            # torch.save inside DCP turns a failed write into RuntimeError("unexpected pos ..."), with
            # the OSError as its context.
            while inner is not None and not isinstance(inner, OSError):
                inner = inner.__cause__ or inner.__context__
            if inner is not None:
                inner.__context__ = exc
                return inner
    return exc


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # Without a process group DCP warns on every call that it assumes a single process; here that is
    # the documented, supported mode, so the warning would only be noise in every single-GPU run.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninit")
        yield


def _first(slot: list[BaseException]) -> BaseException | None:
    return slot[0] if slot else None
