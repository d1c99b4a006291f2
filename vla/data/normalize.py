"""Per-feature normalisation from dataset stats, and its inverse for actions at inference.

Modes (the names LeRobot and openpi use):
    MEAN_STD   (x - mean) / (std + eps)     (eps 1e-8, LeRobot's)      pi0 state and action
    MIN_MAX    2 (x - min) / (max - min + eps) - 1   -> [-1, 1]
    QUANTILES  2 (x - q01) / (q99 - q01 + eps) - 1   -> [-1, 1] on the 1st..99th percentile
               (OpenVLA's action bounds, openpi's pi0.5); values outside may exceed [-1, 1]
    IDENTITY   x                                                images (scaled separately)

The stats a Normalizer holds are all it needs at inference: save `to_dict()` next to a checkpoint
and rebuild with `Normalizer.from_dict()`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vla.data.errors import StatsError
from vla.data.stats import Stats, check_finite

# Added to the width each mode divides by: LeRobot's NormalizerProcessorStep eps, so a policy normalises
# as its LeRobot processor files (vla.data.lerobot_processor) say. Normalisers saved before (processor.json
# without "eps") used 1e-6 and keep it.
EPS = 1e-8
LEGACY_EPS = 1e-6
# The dataset-level statistic each mode divides by is "zero" at or below ZERO_WIDTH: x would then be
# scaled by ~1/EPS. Data whose own statistic exceeds DATA_VARIES means the stats do not describe it.
ZERO_WIDTH = 1e-6
DATA_VARIES = 10 * ZERO_WIDTH


class NormMode(StrEnum):
    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    QUANTILES = "QUANTILES"
    IDENTITY = "IDENTITY"


_SPREAD_NAME = {NormMode.MEAN_STD: "std", NormMode.MIN_MAX: "max - min", NormMode.QUANTILES: "q99 - q01"}

REQUIRED_STATS = {  # the stats each mode reads
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

    def __init__(
        self, stats: Stats, modes: Mapping[str, NormMode | str], source: str = "stats", eps: float = EPS
    ) -> None:
        self.modes = parse_modes(modes)
        self.source = source
        self.eps = eps
        self._scale: dict[str, Tensor] = {}
        self._offset: dict[str, Tensor] = {}
        self.stats: dict[str, dict[str, np.ndarray]] = {}
        for key, mode in self.modes.items():
            if mode == NormMode.IDENTITY:
                continue
            needed = REQUIRED_STATS[mode]
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
            self._check_spread(key, mode, kept, stats[key])
            self.stats[key] = kept
            # x_norm = (x - offset) * scale; every mode is affine, so the inverse is exact.
            if mode == NormMode.MEAN_STD:
                offset, scale = kept["mean"], 1.0 / (kept["std"] + eps)
            else:
                low, high = (
                    (kept["min"], kept["max"]) if mode == NormMode.MIN_MAX else (kept["q01"], kept["q99"])
                )
                offset, scale = (low + high) / 2.0, 2.0 / (high - low + eps)
            self._offset[key] = torch.as_tensor(offset, dtype=torch.float32)
            self._scale[key] = torch.as_tensor(scale, dtype=torch.float32)

    @staticmethod
    def _spread(mode: NormMode, stats: Mapping[str, np.ndarray]) -> np.ndarray:
        """The per-dim width the mode divides by (std, max - min or q99 - q01)."""
        if mode == NormMode.MEAN_STD:
            return np.asarray(stats["std"], dtype=np.float64).reshape(-1)
        low, high = ("min", "max") if mode == NormMode.MIN_MAX else ("q01", "q99")
        return (np.asarray(stats[high], np.float64) - np.asarray(stats[low], np.float64)).reshape(-1)

    def _blow_up(self, key: str, mode: NormMode, dims: list[int], evidence: str) -> str:
        return (
            f"{self.source}: stats of {key!r} give {_SPREAD_NAME[mode]} = 0 for dim(s) {dims} while {evidence}; "
            f"{mode.value} normalisation divides by that width (+{self.eps:g}), which would scale those dims by "
            f"~{1 / self.eps:.0e} and make the loss explode. The stats are stale or wrong for this data: recompute "
            f"them (LeRobot's compute_stats, or rewrite the dataset with vla.data.LeRobotDatasetWriter), or "
            f"set the norm mode of {key!r} to another mode or IDENTITY (data.norm_modes)."
        )

    def _check_spread(
        self, key: str, mode: NormMode, kept: Mapping[str, np.ndarray], full: Mapping[str, Any]
    ) -> None:
        """Zero width in the mode's stats while the feature's other stats say it varies: raise or warn.

        std = 0 with max > min (or max = min with std > 0) cannot both hold: StatsError. q01 = q99 with
        max > min is possible (a dim that rarely moves), but its rare values normalise to ~1e6: a warning.
        """
        spread = self._spread(mode, kept)
        flat = np.flatnonzero(spread <= ZERO_WIDTH)
        if flat.size == 0:
            return
        dims = flat.tolist()
        other = {n: np.asarray(v, dtype=np.float64).reshape(-1) for n, v in full.items()}
        if mode == NormMode.MIN_MAX:
            width = other["std"] if "std" in other and other["std"].shape == spread.shape else None
            what = "std"
        else:
            has_range = all(n in other and other[n].shape == spread.shape for n in ("min", "max"))
            width = other["max"] - other["min"] if has_range else None
            what = "max - min"
        if width is None or not np.any(width[flat] > DATA_VARIES):
            return
        varying = [d for d in dims if width[d] > DATA_VARIES]
        evidence = f"their {what} is {np.round(width[varying], 6).tolist()} there"
        if mode == NormMode.QUANTILES:
            warnings.warn(
                f"{self.source}: stats of {key!r} give q99 - q01 = 0 for dim(s) {varying} while max - min is "
                f"{np.round(width[varying], 6).tolist()}: the rare values outside [q01, q99] normalise to "
                f"~{1 / self.eps:.0e}. Use MIN_MAX or MEAN_STD for {key!r} (data.norm_modes) if that dim matters.",
                stacklevel=3,
            )
            return
        raise StatsError(self._blow_up(key, mode, varying, evidence))

    def check_data(self, key: str, values: np.ndarray, data_source: str) -> None:
        """Raise StatsError when the stats give `key` zero width in a dim where `values` (N, D) vary.

        Catches stats.json files whose std (or range) is 0 while the data moves, which would train at
        a loss of ~1e7 without a word. Features without stats (IDENTITY) pass.
        """
        mode = self.modes.get(key)
        if mode is None or mode == NormMode.IDENTITY or key not in self.stats:
            return
        spread = self._spread(mode, self.stats[key])
        flat = np.flatnonzero(spread <= ZERO_WIDTH)
        if flat.size == 0 or len(values) == 0:
            return
        data = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
        if data.shape[1] != spread.shape[0]:
            raise StatsError(
                f"{self.source}: stats of {key!r} have {spread.shape[0]} dims but {data_source} holds "
                f"{data.shape[1]} values per frame. Recompute the stats for this dataset."
            )
        columns = data[:, flat]
        if mode == NormMode.MEAN_STD:
            width = columns.std(axis=0)
        elif mode == NormMode.MIN_MAX:
            width = columns.max(axis=0) - columns.min(axis=0)
        else:
            q01, q99 = np.quantile(columns, [0.01, 0.99], axis=0)
            width = q99 - q01
        varying = [int(d) for d, w in zip(flat, width) if w > DATA_VARIES]
        if varying:
            found = [float(w) for w in width if w > DATA_VARIES]
            evidence = (
                f"the data in {data_source} varies there ({_SPREAD_NAME[mode]} "
                f"{np.round(found, 6).tolist()} over {len(data)} frames)"
            )
            raise StatsError(self._blow_up(key, mode, varying, evidence))

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
        """JSON-serialisable {"eps", "modes": {...}, "stats": {feature: {stat: list}}}."""
        return {
            "eps": self.eps,
            "modes": {k: m.value for k, m in self.modes.items()},
            "stats": {k: {n: v.tolist() for n, v in s.items()} for k, s in self.stats.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "saved normalizer") -> Normalizer:
        stats = {k: {n: np.asarray(v) for n, v in s.items()} for k, s in data["stats"].items()}
        return cls(stats, data["modes"], source=source, eps=float(data.get("eps", LEGACY_EPS)))
