"""Per-feature normalisation from dataset stats, and its inverse for actions at inference.

Modes (the names LeRobot and openpi use):
    MEAN_STD   (x - mean) / (std + eps)                         pi0 state and action
    MIN_MAX    2 (x - min) / (max - min + eps) - 1   -> [-1, 1]
    QUANTILES  2 (x - q01) / (q99 - q01 + eps) - 1   -> [-1, 1] on the 1st..99th percentile
               (OpenVLA's action bounds, openpi's pi0.5); values outside may exceed [-1, 1]
    IDENTITY   x                                                images (scaled separately)

The stats a Normalizer holds are all it needs at inference: save `to_dict()` next to a checkpoint
and rebuild with `Normalizer.from_dict()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vla.data.errors import StatsError
from vla.data.stats import Stats, check_finite

EPS = 1e-6


class NormMode(StrEnum):
    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    QUANTILES = "QUANTILES"
    IDENTITY = "IDENTITY"


_REQUIRED = {
    NormMode.MEAN_STD: ("mean", "std"),
    NormMode.MIN_MAX: ("min", "max"),
    NormMode.QUANTILES: ("q01", "q99"),
    NormMode.IDENTITY: (),
}


def parse_modes(modes: Mapping[str, NormMode | str]) -> dict[str, NormMode]:
    out = {}
    for key, mode in modes.items():
        try:
            out[key] = NormMode(mode.upper() if isinstance(mode, str) else mode)
        except ValueError as exc:
            raise ValueError(
                f"normalisation mode {mode!r} for {key!r} is unknown; use one of {[m.value for m in NormMode]}"
            ) from exc
    return out


class Normalizer:
    """Normalises features along their last dimension: x of shape (..., D) with stats of shape (D,).

    stats: feature -> {stat: array}; only the entries the mode needs are kept (float32).
    modes: feature -> NormMode; features without a mode pass through unchanged.
    """

    def __init__(self, stats: Stats, modes: Mapping[str, NormMode | str], source: str = "stats") -> None:
        self.modes = parse_modes(modes)
        self.source = source
        self._scale: dict[str, Tensor] = {}
        self._offset: dict[str, Tensor] = {}
        self.stats: dict[str, dict[str, np.ndarray]] = {}
        for key, mode in self.modes.items():
            if mode == NormMode.IDENTITY:
                continue
            needed = _REQUIRED[mode]
            if key not in stats:
                raise StatsError(
                    f"{source}: no stats for {key!r} (needed for {mode.value}); stats exist for "
                    f"{sorted(stats)}. Recompute the dataset stats or set the mode to IDENTITY."
                )
            absent = [n for n in needed if n not in stats[key]]
            if absent:
                raise StatsError(
                    f"{source}: stats of {key!r} lack {absent} (needed for {mode.value}); they have "
                    f"{sorted(stats[key])}. Recompute the stats (LeRobot >= 0.4 writes quantiles) or pick "
                    "another mode."
                )
            kept = {n: np.asarray(stats[key][n], dtype=np.float64).reshape(-1) for n in needed}
            check_finite({key: kept}, source)
            self.stats[key] = kept
            # x_norm = (x - offset) * scale; every mode is affine, so the inverse is exact.
            if mode == NormMode.MEAN_STD:
                offset, scale = kept["mean"], 1.0 / (kept["std"] + EPS)
            else:
                low, high = (
                    (kept["min"], kept["max"]) if mode == NormMode.MIN_MAX else (kept["q01"], kept["q99"])
                )
                offset, scale = (low + high) / 2.0, 2.0 / (high - low + EPS)
            self._offset[key] = torch.as_tensor(offset, dtype=torch.float32)
            self._scale[key] = torch.as_tensor(scale, dtype=torch.float32)

    def _affine(self, key: str, x: Tensor) -> tuple[Tensor, Tensor] | None:
        if key not in self._scale:
            return None
        offset, scale = self._offset[key], self._scale[key]
        if x.shape[-1] != offset.shape[0]:
            raise ValueError(
                f"{key!r} has {x.shape[-1]} values in its last dim but its stats ({self.source}) have "
                f"{offset.shape[0]}. The stats belong to another dataset or the feature shape changed."
            )
        return offset.to(x.device), scale.to(x.device)

    def normalize(self, key: str, x: Tensor) -> Tensor:
        affine = self._affine(key, x)
        if affine is None:
            return x
        offset, scale = affine
        return (x.to(torch.float32) - offset) * scale

    def unnormalize(self, key: str, x: Tensor) -> Tensor:
        """Inverse of normalize (e.g. policy actions back to robot units)."""
        affine = self._affine(key, x)
        if affine is None:
            return x
        offset, scale = affine
        return x.to(torch.float32) / scale + offset

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable {"modes": {...}, "stats": {feature: {stat: list}}}."""
        return {
            "modes": {k: m.value for k, m in self.modes.items()},
            "stats": {k: {n: v.tolist() for n, v in s.items()} for k, s in self.stats.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "saved normalizer") -> Normalizer:
        stats = {k: {n: np.asarray(v) for n, v in s.items()} for k, s in data["stats"].items()}
        return cls(stats, data["modes"], source=source)
