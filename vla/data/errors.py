"""Exceptions raised on bad datasets and bad data configuration.

Every message names the offending file or key and says how to fix it, so a user reading a
traceback from a DataLoader worker knows which file to look at.
"""

from __future__ import annotations

import os


class DatasetError(Exception):
    """Base class of every data-pipeline error."""


class DatasetFileNotFoundError(DatasetError, FileNotFoundError):
    """A dataset root or one of its metadata/data/video files is missing."""


class DatasetTooSmallError(DatasetError, ValueError):
    """The (training split of a) dataset holds too few frames for the requested batch."""


class DatasetFormatError(DatasetError, ValueError):
    """A file exists but its content does not follow the LeRobot layout (schema, shapes, indices)."""


class UnsupportedVersionError(DatasetError, ValueError):
    """meta/info.json declares a codebase_version this reader does not handle."""


class MissingFeatureError(DatasetError, ValueError):
    """A feature the model/processor configuration expects is absent from the dataset."""


class StatsError(DatasetError, ValueError):
    """meta/stats.json (or the stats handed to a normaliser) is missing an entry or holds NaN/inf."""


class TaskWeightsError(DatasetError, ValueError):
    """data.task_weights names a task the dataset lacks, or gives a weight that cannot be used."""


class FrameTimestampError(DatasetError, ValueError):
    """A video has no decoded frame within tolerance of a requested timestamp."""


class DeltaTimestampsError(DatasetError, ValueError):
    """delta_timestamps are not multiples of 1/fps or name unknown features."""


def corrupt_file_error(path: str | os.PathLike[str], what: str, cause: BaseException) -> DatasetFormatError:
    """The error for a dataset file that exists but cannot be decoded (truncated, zero bytes, garbled).

    Names the file, what it should hold and the library's complaint, and says how to fix it.
    """
    try:
        empty = os.path.getsize(path) == 0
    except OSError:
        empty = False
    reason = "the file is empty (0 bytes)" if empty else f"{type(cause).__name__}: {cause}"
    return DatasetFormatError(
        f"{os.fspath(path)}: not a readable {what} ({reason}). The file is truncated or corrupt (an "
        "interrupted download, copy or write?); re-download the dataset or regenerate it."
    )
