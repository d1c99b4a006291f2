"""A new run never overwrites an earlier one in its output directory.

A fresh run (`trainer.resume=none`) into a directory that already holds a run's results (checkpoints,
an export, metrics, a summary) is refused with the three ways on: resume that run
(`trainer.resume=auto`), write to another `output_dir=...`, or `trainer.overwrite=true`, which moves
the earlier run's files into a sibling directory `<output_dir>.replaced-<time>` (never deletes them).
Runs with `trainer.resume` set continue the run that is there and are not checked here.

Called under the run lock (vla.training.runlock), so two runs cannot both pass the check.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from vla.training.runlock import LOCK_FILE

# What a run leaves behind; a directory holding any of them holds a run.
RUN_FILES = (
    "checkpoints",
    "policy.safetensors",
    "pretrained_model",
    "metrics.jsonl",
    "summary.json",
    "closed_loop.json",
    "tb",
)
# Never moved: the lock of the run now starting, and Hydra's record of this very invocation.
KEPT = frozenset({LOCK_FILE, ".hydra"})


class RunDirectoryError(RuntimeError):
    """The output directory holds an earlier run that a fresh run would overwrite."""


def _holds_something(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def earlier_run(directory: Path) -> list[str]:
    """The names in `directory` that show an earlier run was written there (empty: none)."""
    return [name for name in RUN_FILES if _holds_something(directory / name)]


def claim_run_directory(directory: Path, *, resume: str, overwrite: bool) -> str | None:
    """Check that a fresh run may write `directory`; with `overwrite`, move an earlier run aside first.

    Returns a line to log when something was moved, else None. Raises RunDirectoryError naming what
    was found and the choices.
    """
    if str(resume).strip().lower() not in ("", "none", "null", "false") or not directory.is_dir():
        return None
    found = earlier_run(directory)
    if not found:
        return None
    if not overwrite:
        raise RunDirectoryError(
            f"output_dir {directory} already holds a run ({', '.join(found)}); a fresh run would overwrite "
            "it. Continue it with trainer.resume=auto, give this run another output_dir=..., or set "
            "trainer.overwrite=true to move the earlier run aside (it is kept, not deleted)"
        )
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    aside = directory.with_name(f"{directory.name}.replaced-{stamp}")
    suffix = 1
    while aside.exists():
        suffix += 1
        aside = directory.with_name(f"{directory.name}.replaced-{stamp}-{suffix}")
    aside.mkdir()
    for entry in sorted(directory.iterdir()):
        if entry.name not in KEPT:
            entry.rename(aside / entry.name)
    return f"trainer.overwrite=true: moved the earlier run in {directory} to {aside}"


def claim_run_directory_collective(
    directory: Path, *, resume: str, overwrite: bool, is_main: bool
) -> str | None:
    """`claim_run_directory` on rank 0; every rank raises RunDirectoryError alike. Collective."""
    import torch.distributed as dist

    box: list[tuple[str, str | None]] = [("ok", None)]
    if is_main:
        try:
            box[0] = ("ok", claim_run_directory(directory, resume=resume, overwrite=overwrite))
        except (RunDirectoryError, OSError) as exc:
            if not (dist.is_available() and dist.is_initialized()):
                raise
            box[0] = ("error", str(exc))
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    kind, text = box[0]
    if kind == "error":
        raise RunDirectoryError(text)
    return text
