"""The data scan before training: frames no policy should train or validate on, found by file, episode
and frame.

Found: NaN/inf in any float column (state, action, timestamps, other numeric features) and empty or
null task strings. Indices out of range (task_index past meta/tasks, frame_index not 0..L-1, rows
that disagree with the episode lengths) already fail in the reader (vla.data.reader) naming the file.

The scan runs over the numeric columns the reader has already loaded (vectorised numpy, no second
read of the parquet files: a few ms for 16k frames here), for the training and validation episodes
alike, so nothing needs caching. `data.on_bad_frames` decides what follows: `error` (the default) stops
with the list, `drop_episode` trains and validates without the episodes that hold them (a line says
which).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vla.data.errors import DatasetError

ON_BAD_FRAMES = ("error", "drop_episode")
_SHOWN = 8  # bad frames listed in a message; the rest are counted


class BadFramesError(DatasetError, ValueError):
    """The dataset holds frames with non-finite values or empty task strings."""


@dataclass(frozen=True)
class BadFrame:
    file: str
    episode: int
    frame: int
    key: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: episode {self.episode} frame {self.frame}: {self.key} {self.problem}"


def scan_frames(dataset: object) -> list[BadFrame]:
    """Every bad frame of a vla.data.reader.LeRobotDataset's selected episodes, in row order per check."""
    meta = dataset.meta  # type: ignore[attr-defined]
    episode_of_row = dataset.column("episode_index")  # type: ignore[attr-defined]
    frame_of_row = dataset.column("frame_index")  # type: ignore[attr-defined]
    found: list[BadFrame] = []

    def record(rows: np.ndarray, key: str, problem: str) -> None:
        for row in rows.tolist():
            episode = int(episode_of_row[row])
            found.append(BadFrame(meta.episodes[episode].data_path, episode, int(frame_of_row[row]), key, problem))

    for key in sorted(dataset._numeric):  # type: ignore[attr-defined]
        values = dataset.column(key)  # type: ignore[attr-defined]
        if not np.issubdtype(values.dtype, np.floating) or not len(values):
            continue
        finite = np.isfinite(values).reshape(len(values), -1).all(axis=1)
        if not finite.all():
            bad = np.flatnonzero(~finite)
            flat = values[bad].reshape(len(bad), -1)
            for row, value in zip(bad.tolist(), flat, strict=True):
                kinds = sorted({"NaN" if np.isnan(v) else "inf" for v in value if not np.isfinite(v)})
                record(np.array([row]), key, f"holds {'/'.join(kinds)} ({int((~np.isfinite(value)).sum())} of {value.size} values)")
    empty_tasks = [i for i, task in enumerate(meta.tasks) if task is None or not str(task).strip()]
    if empty_tasks:
        task_of_row = dataset.column("task_index")  # type: ignore[attr-defined]
        rows = np.flatnonzero(np.isin(task_of_row, empty_tasks))
        record(rows, "task", "is empty or null (meta/tasks.parquet)")
    return found


def describe(bad: list[BadFrame], root: object, split: str) -> str:
    """The message for `bad` frames of the `split` episodes of the dataset at `root`."""
    episodes = sorted({b.episode for b in bad})
    lines = [str(b) for b in bad[:_SHOWN]]
    if len(bad) > _SHOWN:
        lines.append(f"... and {len(bad) - _SHOWN} more")
    return (
        f"the dataset at {root} holds {len(bad)} bad frame(s) in {len(episodes)} episode(s) "
        f"{episodes[:20]}{' ...' if len(episodes) > 20 else ''} (scanned: the {split} episodes):\n  "
        + "\n  ".join(lines)
        + "\n"
        "Fix or re-record those episodes, or set data.on_bad_frames=drop_episode to leave them out"
    )
