"""Temporal windows: `delta_timestamps` -> frame offsets, clamped to the episode, with pad flags.

LeRobot semantics: for a frame at dataset row r of an episode spanning rows [start, end), the window
for offsets d_i gathers rows clip(r + d_i, start, end - 1) and flags `<key>_is_pad` where r + d_i
falls outside [start, end).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from vla.data.errors import DeltaTimestampsError


def action_delta_timestamps(horizon: int, fps: float, key: str = "action") -> dict[str, list[float]]:
    """{key: [0, 1/fps, ..., (horizon-1)/fps]}: the action chunk that starts at the current frame."""
    if horizon < 1:
        raise ValueError(f"action horizon must be >= 1, got {horizon}")
    return {key: [i / fps for i in range(horizon)]}


def delta_indices(
    delta_timestamps: Mapping[str, Sequence[float]],
    fps: float,
    tolerance_s: float,
    known_keys: Iterable[str],
) -> dict[str, np.ndarray]:
    """Frame offsets per key; DeltaTimestampsError for unknown keys or deltas off the 1/fps grid."""
    known = set(known_keys)
    unknown = sorted(set(delta_timestamps) - known)
    if unknown:
        raise DeltaTimestampsError(
            f"delta_timestamps names {unknown}, which are not dataset features. Available: {sorted(known)}."
        )
    out = {}
    for key, deltas in delta_timestamps.items():
        deltas = np.asarray(list(deltas), dtype=np.float64)
        if deltas.ndim != 1 or deltas.size == 0:
            raise DeltaTimestampsError(f"delta_timestamps[{key!r}] must be a non-empty list of seconds.")
        frames = np.round(deltas * fps)
        off_grid = np.abs(deltas - frames / fps) > tolerance_s
        if off_grid.any():
            raise DeltaTimestampsError(
                f"delta_timestamps[{key!r}] has {deltas[off_grid].tolist()}, not multiples of 1/fps = "
                f"{1 / fps:.6f} s within tolerance_s={tolerance_s}. Use i / fps for integer i "
                "(see vla.data.action_delta_timestamps)."
            )
        out[key] = frames.astype(np.int64)
    return out


def window_rows(row: int, offsets: np.ndarray, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows clamped to [start, end - 1], is_pad) for a frame at `row` of an episode in [start, end)."""
    wanted = row + offsets
    is_pad = (wanted < start) | (wanted >= end)
    return np.clip(wanted, start, end - 1), is_pad
