"""Sharded, atomic training checkpoints (torch.distributed.checkpoint) and a safetensors policy export.

Layout of one checkpoint, `root/step_{step:08d}/`:

    model_optim/          DCP checkpoint of {"model", "optim", "extra"}; every rank writes its own shards
    rng/rank_00000.pt     RNG states (python `random`, numpy, torch CPU, CUDA) of each rank at save time
    trainer.pt            scheduler state_dict and the caller's `trainer_state` (written by rank 0)
    manifest.json         step, world size, time, torch version, every file's size and xxh3-128 digest: written
                          last, it marks the checkpoint complete

Atomicity: everything is written into `root/.tmp_step_{step:08d}/`; after every rank has finished (and
fsynced) its files, rank 0 writes the manifest and renames the directory to `step_{step:08d}` with
`os.replace` (atomic on one filesystem). A crash mid-save therefore leaves at most a `.tmp_step_*`
directory, which is never listed and is removed by the next save; an exception mid-save removes it at
once and raises on every rank (no rank is left waiting in a collective). Old checkpoints beyond
`keep_last` are first renamed to `.trash_step_*` and then deleted, so a crash while pruning cannot leave a
half-deleted checkpoint that looks complete.

Model and optimizer state go through `torch.distributed.checkpoint.state_dict.get_state_dict` /
`set_state_dict`, so one code path serves a plain module (no process group needed), DDP (the `module.`
prefix is dropped) and FSDP2 (DTensor shards); a checkpoint saved on W ranks loads on any other number
of ranks, or into a plain module in a single process, because DCP reshards on load.

RNG and a change of world size: rank r restores the states saved by rank r. When resuming on more ranks
than saved, the extra ranks keep the RNG state they had before `load` (whatever the trainer seeded) and
a warning says so; when resuming on fewer ranks, the states of the missing ranks are ignored. RNGs that
live in objects (a DataLoader's generator, a sampler's seed) are not global state: put what is needed to
rebuild them (epoch, index into the sampler, seed) into `trainer_state`.

Requirements: `root` must be one directory that every rank sees (a shared filesystem when training on
several nodes), and only one job may write checkpoints into it at a time. Checkpoints contain pickles
(DCP metadata, `trainer.pt`): load only checkpoints you trust.

This module needs torch.distributed only (no Accelerate), so it works under torchrun, Accelerate or a
plain single process. Every function documented as collective must be called by all ranks of the
default process group, in the same order.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from vla.checksums import digests as file_digests
from vla.checksums import mismatches as digest_mismatches
from vla.eval.exported import read_safetensors_metadata  # re-exported: callers import it from here too

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "DamagedCheckpointError",
    "NonFiniteWeightsError",
    "export_safetensors",
    "load_safetensors_into",
    "read_safetensors_metadata",
]

FORMAT = "vla.checkpoint"
FORMAT_VERSION = 3  # 3: + a digest of the manifest itself; 2: every file with its size and digest; 1: sizes
MANIFEST = "manifest.json"
MODEL_OPTIM_DIR = "model_optim"
RNG_DIR = "rng"
TRAINER_FILE = "trainer.pt"
EXPORT_FORMAT = "vla.policy"

_RESERVED_METADATA = frozenset({"format", "tied"})  # read back by load_safetensors_into
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp_step_"
_TRASH_PREFIX = ".trash_step_"


class CheckpointError(RuntimeError):
    """A collective checkpoint operation failed on at least one rank; raised on every rank alike."""


class DamagedCheckpointError(FileNotFoundError):
    """A checkpoint directory is incomplete or one of its files is missing, truncated or unreadable.

    `path` is the checkpoint directory, `file` the first damaged file in it (or the directory itself).
    """

    def __init__(self, message: str, path: Path, file: Path) -> None:
        super().__init__(message)
        self.path = path
        self.file = file


class NonFiniteWeightsError(ValueError):
    """A tensor about to be saved (checkpoint or export) holds NaN or inf."""


def check_finite_tensors(tensors: Mapping[str, Any], what: str, prefix: str = "") -> None:
    """Raise NonFiniteWeightsError naming the first floating tensor (local shard) with NaN/inf.

    Nested mappings are walked (`ema.shadow.<name>`); non-tensor values are ignored.
    """
    for name, value in tensors.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            check_finite_tensors(value, what, f"{key}.")
            continue
        if not isinstance(value, Tensor) or not value.is_floating_point():
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.numel() and not bool(torch.isfinite(local).all()):
            bad = int((~torch.isfinite(local)).sum())
            raise NonFiniteWeightsError(
                f"{what}: {key} holds {bad} non-finite value(s) (NaN/inf) of {local.numel()}; refusing to "
                "write it. The training diverged or a setting is non-finite: resume from an earlier "
                "checkpoint with a lower optim.lr / trainer.clip_grad_norm, or check the data"
            )


# ---------------------------------------------------------------------------------------------------------
# Process-group helpers


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


# ---------------------------------------------------------------------------------------------------------
# Filesystem helpers


def _fsync_dir(path: Path) -> None:
    # Makes a rename or a new entry durable; not all platforms allow opening a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durably(path: Path, write: Any) -> None:
    """Write via `write(file_object)`, flushing and fsyncing before returning.

    The content is serialised in memory first (these files are small): torch.save writing straight
    into a file on a full disk reports "unexpected pos" and loses the ENOSPC, which must reach the
    user as "no space left"."""
    buffer = io.BytesIO()
    write(buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())


def _unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    # Wrappers such as Accelerate's AcceleratedOptimizer keep the real optimizer in `.optimizer`; the
    # state_dict helpers run a zero-lr step on a fresh optimizer, which must not go through the wrapper's
    # gradient-accumulation gating.
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, Optimizer):
        optimizer = inner
        inner = getattr(optimizer, "optimizer", None)
    return optimizer


# ---------------------------------------------------------------------------------------------------------
# RNG state


def _capture_rng() -> dict[str, Any]:
    """This process's global RNG states, in types that `torch.load(weights_only=True)` accepts."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": (version, internal, gauss),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    # Querying CUDA RNGs would initialise CUDA on every device; a run that never touched CUDA has none.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda_states = state["cuda"]
    if cuda_states and torch.cuda.is_available():
        for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


# ---------------------------------------------------------------------------------------------------------
# Model / optimizer state


def _check_optimizer_matches(model: nn.Module, optimizer: Optimizer) -> None:
    # get_state_dict maps optimizer params to names through the model; a stray param fails deep inside
    # it with a bare KeyError, and silently saves nothing if the stray params never got gradients.
    owned = {id(p) for p in model.parameters()}
    stray = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in owned)
    if stray:
        raise ValueError(
            f"{stray} parameter(s) of the {type(optimizer).__name__} are not parameters of the "
            f"{type(model).__name__}: the optimizer was probably built before fully_shard replaced the "
            "parameters with sharded ones. Build the optimizer after wrapping the model."
        )


def _state_for(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """The DCP state dict {"model": ..., "optim": ...} (sharded as the live model is)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    """The xxh3-128 digest of a manifest's content (keys sorted), without its own digest."""
    import xxhash

    text = json.dumps({k: v for k, v in manifest.items() if k != "self_digest"}, sort_keys=True)
    return f"xxh3_128:{xxhash.xxh3_128(text.encode()).hexdigest()}"


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint directory, else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    if not (path / MODEL_OPTIM_DIR / ".metadata").is_file():
        return None
    return manifest


class CheckpointManager:
    """Saves, finds, prunes and loads the checkpoints of one training run under `root`.

    Args:
        root: directory holding `step_{step:08d}/` checkpoints (created on the first save). It must be
            visible to every rank, and only one job may write into it at a time.
        keep_last: after each successful save, keep only this many newest complete checkpoints (the one
            just written is never deleted); None keeps all.

    Non-collective: `path_for`, `checkpoints`, `latest`, `read_manifest`, `verify`.
    Collective (every rank calls it): `save`, `load`, `export_safetensors`, and `resolve` under a process
    group (the ranks split the checksum reads and agree on the verdict).
    """

    def __init__(self, root: Path | str, keep_last: int | None = 3) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
            raise ValueError(
                f"keep_last must be a positive int (or None to keep every checkpoint), got {keep_last!r}"
            )
        self.root = Path(root)
        self.keep_last = keep_last
        self.skipped: list[tuple[Path, str]] = []  # damaged checkpoints the last resolve("auto") passed over
        self._checksummed: set[Path] = (
            set()
        )  # verified with checksums by resolve(): load need not re-read them

    def __repr__(self) -> str:
        return f"CheckpointManager(root={str(self.root)!r}, keep_last={self.keep_last})"

    # -- discovery ------------------------------------------------------------------------------------

    def path_for(self, step: int) -> Path:
        """Where the checkpoint of `step` lives (whether or not it exists)."""
        return self.root / f"step_{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints under root, oldest step first; interrupted saves are never listed."""
        if not self.root.is_dir():
            return []
        found: list[tuple[int, Path]] = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir() and _read_manifest(path) is not None:
                found.append((int(match.group(1)), path))
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None when there is none."""
        complete = self.checkpoints()
        return complete[-1] if complete else None

    def read_manifest(self, path: Path | str) -> dict[str, Any]:
        """The manifest of the checkpoint at `path`; FileNotFoundError if it is missing or incomplete."""
        return self._require_complete(Path(path), f"checkpoint {str(path)!r}")

    def resolve(self, resume: str | Path | None) -> Path | None:
        """Turn the `trainer.resume` setting into a verified checkpoint path (see `verify`).

        "auto": the newest intact checkpoint, or None when root holds no checkpoint at all (a fresh
        start). Damaged ones (a missing or truncated shard, .metadata, trainer.pt, RNG file or
        manifest) are skipped; `self.skipped` lists them as (path, reason) and a warning names each.
        If every checkpoint is damaged, DamagedCheckpointError (never a silent fresh start over them).
        None, "", "none": None; anything else: a checkpoint directory, as given or relative to root.
        A path that is not a complete checkpoint raises FileNotFoundError naming it and listing the
        available checkpoints; a damaged one raises DamagedCheckpointError naming the damaged file.
        """
        self.skipped: list[tuple[Path, str]] = []
        if resume is None:
            return None
        text = str(resume).strip()
        if text.lower() in ("", "none", "null", "false"):
            return None
        if text.lower() == "auto":
            return self._newest_intact()
        candidate = Path(text).expanduser()
        if not candidate.exists() and not candidate.is_absolute() and (self.root / candidate).exists():
            candidate = self.root / candidate
        if not candidate.is_dir():
            self._require_complete(candidate, f"trainer.resume={text!r}")  # raises, naming the path
        try:
            self._verify_agreed(candidate)
        except DamagedCheckpointError as exc:
            available = [str(p) for p in self.checkpoints() if p != candidate]
            listing = ", ".join(available) if available else f"none under {self.root}"
            raise DamagedCheckpointError(
                f"trainer.resume={text!r}: {exc}. Other checkpoints: {listing}. Resume from another one "
                "(trainer.resume=auto takes the newest intact one), or none to start fresh",
                exc.path,
                exc.file,
            ) from exc
        return candidate

    def _newest_intact(self) -> Path | None:
        """The newest checkpoint that passes `verify`, skipping (and warning about) damaged ones."""
        if not self.root.is_dir():
            return None
        candidates = sorted(
            (int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        )
        for _, path in reversed(candidates):
            try:
                self._verify_agreed(path)
            except DamagedCheckpointError as exc:
                self.skipped.append((path, str(exc)))
                warnings.warn(f"resume=auto skips {path.name}: {exc}", stacklevel=3)
                continue
            return path
        if candidates:
            detail = "; ".join(f"{p.name}: {reason}" for p, reason in self.skipped)
            raise DamagedCheckpointError(
                f"trainer.resume=auto: every checkpoint under {self.root} is damaged ({detail}). Starting "
                "fresh would overwrite this run: delete the damaged checkpoints (or the whole "
                "checkpoints/ directory) to start over, or use a new output_dir",
                self.root,
                self.root,
            )
        return None

    def _verify_agreed(self, path: Path) -> dict[str, Any]:
        """`verify` with the checksum reads split over the ranks; under a process group every rank raises
        the same DamagedCheckpointError (the lowest failing rank's). Collective when distributed."""
        rank, world, distributed = _dist_info()
        if not distributed:
            manifest = self.verify(path)
        else:
            error: tuple[str, str] | None = None
            manifest = {}
            try:
                manifest = self.verify(path, part=(rank, world))
            except DamagedCheckpointError as exc:
                error = (str(exc), str(exc.file))
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, error)
            first = next((e for e in gathered if e is not None), None)
            if first is not None:
                raise DamagedCheckpointError(first[0], path, Path(first[1]))
        self._checksummed.add(Path(path).absolute())
        return manifest

    def verify(
        self, path: Path | str, *, checksums: bool = True, part: tuple[int, int] = (0, 1)
    ) -> dict[str, Any]:
        """Check that every file of the checkpoint at `path` is present and readable; return its manifest.

        checksums: also compare each file's digest with the manifest's (reads every byte; a checkpoint
        saved before checksums were kept warns and is checked by size). part=(i, n): hash only every
        n-th file from the i-th (ranks of a collective check split the work).
        Checked: manifest.json (valid, ours), every file it lists with its recorded size, the DCP
        .metadata (unpickles) and every .distcp shard it references (present, long enough for every
        entry), trainer.pt (loads, has the scheduler and trainer state) and the RNG file of every saved
        rank (loads). Raises DamagedCheckpointError naming the first damaged file and what is wrong.
        """
        path = Path(path)

        def damaged(file: Path, problem: str) -> DamagedCheckpointError:
            return DamagedCheckpointError(f"checkpoint {path} is damaged: {file} {problem}", path, file)

        if not path.is_dir():
            raise damaged(path, "is not a directory")
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise damaged(manifest_path, "is missing (not a complete checkpoint)") from None
        except (OSError, ValueError) as exc:
            raise damaged(manifest_path, f"cannot be read ({_describe(exc)}): truncated or garbled") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise damaged(manifest_path, f"is not a {FORMAT} manifest (not a complete checkpoint)")
        recorded_self = manifest.get("self_digest")
        if (
            recorded_self is not None or manifest.get("version", 1) >= 3
        ) and recorded_self != _manifest_digest({k: v for k, v in manifest.items() if k != "self_digest"}):
            raise damaged(manifest_path, "does not match its own digest: its content changed after the save")
        for key in ("step", "world_size", "optimizer", "scheduler"):
            if key not in manifest:
                raise damaged(manifest_path, f"has no {key!r} entry (garbled)")
        expected: dict[str, str] = {}
        for relative, entry in (manifest.get("files") or {}).items():
            size = entry.get("bytes") if isinstance(entry, dict) else entry  # format 1: sizes only
            file = path / relative
            if not file.is_file():
                raise damaged(file, "is missing")
            actual = file.stat().st_size
            if actual != size:
                raise damaged(
                    file, f"has {actual} bytes, the manifest records {size} (truncated or replaced)"
                )
            if isinstance(entry, dict) and isinstance(entry.get("digest"), str):
                expected[relative] = entry["digest"]
        if checksums:
            if not expected:
                warnings.warn(
                    f"checkpoint {path} records no checksums (saved before they were kept): its files are "
                    "checked by size only",
                    stacklevel=2,
                )
            rank, world = part
            names = sorted(expected)[rank::world]
            for relative, want, got in digest_mismatches(path, {n: expected[n] for n in names}):
                raise damaged(
                    path / relative,
                    f"does not match its checksum (saved {want[:15]}..., now {got[:15]}...): its bytes "
                    "changed after the save (disk or copy damage)",
                )
        metadata_path = path / MODEL_OPTIM_DIR / ".metadata"
        if not metadata_path.is_file():
            raise damaged(metadata_path, "is missing (not a complete checkpoint)")
        try:
            metadata = dcp.FileSystemReader(str(path / MODEL_OPTIM_DIR)).read_metadata()
        except Exception as exc:  # a truncated pickle raises anything from EOFError to UnpicklingError
            raise damaged(metadata_path, f"cannot be read ({_describe(exc)})") from exc
        needed: dict[str, int] = {}
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        for relative, end in sorted(needed.items()):
            shard = path / MODEL_OPTIM_DIR / relative
            if not shard.is_file():
                raise damaged(shard, "is missing (listed in model_optim/.metadata)")
            if shard.stat().st_size < end:
                raise damaged(shard, f"has {shard.stat().st_size} bytes, .metadata needs {end} (truncated)")
        trainer_path = path / TRAINER_FILE
        try:
            payload = torch.load(trainer_path, map_location="cpu", weights_only=False)
        except FileNotFoundError:
            raise damaged(trainer_path, "is missing") from None
        except Exception as exc:
            raise damaged(trainer_path, f"cannot be loaded ({_describe(exc)})") from exc
        if not isinstance(payload, dict) or not {"scheduler", "trainer_state"} <= set(payload):
            raise damaged(trainer_path, "does not hold the scheduler and trainer state (garbled)")
        for rank in range(int(manifest["world_size"])):
            rng_path = path / RNG_DIR / f"rank_{rank:05d}.pt"
            try:
                torch.load(rng_path, map_location="cpu", weights_only=True)
            except FileNotFoundError:
                raise damaged(rng_path, "is missing") from None
            except Exception as exc:
                raise damaged(rng_path, f"cannot be loaded ({_describe(exc)})") from exc
        return manifest

    def _require_complete(self, path: Path, label: str) -> dict[str, Any]:
        manifest = _read_manifest(path) if path.is_dir() else None
        if manifest is not None:
            return manifest
        if not path.exists():
            problem = f"{path} does not exist"
        elif not path.is_dir():
            problem = f"{path} is not a directory"
        else:
            problem = (
                f"{path} is not a complete checkpoint (no valid {MANIFEST} or {MODEL_OPTIM_DIR}/.metadata; "
                "an interrupted save, or not a checkpoint directory)"
            )
        available = [str(p) for p in self.checkpoints()]
        listing = ", ".join(available) if available else f"none under {self.root}"
        raise FileNotFoundError(
            f"{label}: {problem}. Available checkpoints: {listing}. "
            "Use trainer.resume=auto to take the latest one, or none to start fresh."
        )

    # -- save -----------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        *,
        scheduler: Any = None,
        trainer_state: Mapping[str, Any] | None = None,
        extra_state: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of `step` atomically and prune old ones. Collective.

        Args:
            step: the optimizer step count reached; the same on every rank.
            model: the live model: plain, DDP-wrapped or FSDP2-sharded. Each rank writes its own shards.
            optimizer: its optimizer (torch.optim or dmuon.Muon; a wrapper holding the real optimizer in
                `.optimizer` is unwrapped), or None to save weights only. An optimizer that has not
                stepped yet has no state to save; the checkpoint records that, and `load` then leaves the
                caller's fresh optimizer as it is (equivalent, and nothing is perturbed here).
            scheduler: anything with state_dict/load_state_dict (an LR scheduler), saved from rank 0.
            trainer_state: step, data position (epoch, index into the sampler), metrics: anything
                torch.save can pickle; taken from rank 0, so keep it the same on every rank.
            extra_state: more state saved through DCP next to the model, e.g. {"ema": ema.state_dict()}:
                nested dicts of tensors (plain, or DTensors sharded like the model: each rank writes its
                shards) and picklable values. `load(..., extra_state=...)` fills it back in place.

        Returns:
            The final checkpoint directory `root/step_{step:08d}`; when the call returns it exists and is
            complete on every rank. If that step was already saved, the old copy is replaced.

        Raises:
            CheckpointError on every rank if any rank failed; the previous checkpoints are untouched and
            nothing named step_* is left behind.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        rank, world, _ = _dist_info()
        final = self.path_for(step)
        tmp = self.root / f"{_TMP_PREFIX}{step:08d}"
        if optimizer is not None:
            optimizer = _unwrap_optimizer(optimizer)

        failed: list[BaseException] = []
        if rank == 0:
            with _capture(failed):
                self.root.mkdir(parents=True, exist_ok=True)
                self._remove_leftovers()
                tmp.mkdir()
        _agree(_first(failed), f"saving step {step}: preparing {tmp}", value=step)

        try:
            manifest = self._write_contents(
                tmp, step, rank, world, model, optimizer, scheduler, trainer_state, extra_state
            )
            start = time.perf_counter()
            manifest["files"] = self._checksum_files(tmp, step, rank, world)
            manifest["checksum_s"] = round(time.perf_counter() - start, 6)
            if rank == 0:
                with _capture(failed):
                    self._publish(tmp, final, step, manifest)
            _agree(_first(failed), f"saving step {step}: publishing {final}")
        except BaseException as exc:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, CheckpointError) and _dist_info()[2]:
                # Raised by _agree on every rank alike, so all can meet once more: nobody returns while
                # the tmp dir still exists. Any other exception is local; a barrier could hang on it.
                dist.barrier()
            raise

        if rank == 0:
            self._prune(keep=final)
        return final

    def _write_contents(
        self,
        tmp: Path,
        step: int,
        rank: int,
        world: int,
        model: nn.Module,
        optimizer: Optimizer | None,
        scheduler: Any,
        trainer_state: Mapping[str, Any] | None,
        extra_state: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """Every rank writes its shards and RNG, rank 0 the trainer state; returns the manifest to publish."""
        failed: list[BaseException] = []
        has_state = optimizer is not None and bool(optimizer.state)
        with _capture(failed):
            if optimizer is not None:
                _check_optimizer_matches(model, optimizer)
            # get_state_dict would initialise an empty optimizer with a zero-lr step (AdamW's step count
            # becomes 1): saving must never change the trajectory, so a state-less optimizer is skipped.
            state = _state_for(model, optimizer if has_state else None)
            if extra_state:
                state["extra"] = dict(extra_state)
            # Never publish a checkpoint that holds NaN/inf weights (a resume would continue from it).
            check_finite_tensors(state["model"], f"saving step {step}")
            if extra_state:
                check_finite_tensors(state["extra"], f"saving step {step}", "extra.")
        # The flag is compared across ranks: a mix would save optimizer shards on some ranks only.
        _agree(_first(failed), f"saving step {step}: collecting the state dict", value=has_state)

        with _capture(failed), _single_process_is_intended():
            dcp.save(state, checkpoint_id=tmp / MODEL_OPTIM_DIR)
        _agree(_first(failed), f"saving step {step}: writing the model/optimizer shards (DCP)")

        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "world_size": world,
            "optimizer": "saved" if has_state else ("empty" if optimizer is not None else "absent"),
            "scheduler": scheduler is not None,
            "extra_state": sorted(extra_state or {}),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "unix_time": time.time(),
            "torch_version": torch.__version__,
        }
        with _capture(failed):
            (tmp / RNG_DIR).mkdir(exist_ok=True)
            rng = _capture_rng()
            _write_durably(tmp / RNG_DIR / f"rank_{rank:05d}.pt", lambda f: torch.save(rng, f))
            _fsync_dir(tmp / RNG_DIR)
            if rank == 0:
                payload = {
                    "scheduler": None if scheduler is None else scheduler.state_dict(),
                    "trainer_state": dict(trainer_state or {}),
                }
                _write_durably(tmp / TRAINER_FILE, lambda f: torch.save(payload, f))
        _agree(_first(failed), f"saving step {step}: writing RNG / scheduler / trainer state")
        return manifest

    def _checksum_files(self, tmp: Path, step: int, rank: int, world: int) -> dict[str, dict[str, Any]]:
        """{relative path: {"bytes", "digest"}} of every file in `tmp`; each rank hashes every W-th file
        (rank 0's listing, so all ranks split the same list). Collective."""
        failed: list[BaseException] = []
        names: list[str] = []
        with _capture(failed):
            if rank == 0:
                names = [str(f.relative_to(tmp)) for f in sorted(tmp.rglob("*")) if f.is_file()]
        if _dist_info()[2]:
            box = [names]
            dist.broadcast_object_list(box, src=0)
            names = box[0]
        local: dict[str, dict[str, Any]] = {}
        with _capture(failed):
            mine = names[rank::world]
            hashed = file_digests(tmp, mine)
            local = {name: {"bytes": (tmp / name).stat().st_size, "digest": hashed[name]} for name in mine}
        _agree(_first(failed), f"saving step {step}: checksumming the files")
        if not _dist_info()[2]:
            return local
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local)
        return {name: entry for part in gathered for name, entry in part.items()}

    def _publish(self, tmp: Path, final: Path, step: int, manifest: Mapping[str, Any]) -> None:
        # Every file with its size and digest (`verify` checks both); the manifest itself is written last,
        # with a digest of its own content (a flipped digit in "step" must not pass as another step).
        manifest = {**manifest, "self_digest": _manifest_digest(manifest)}
        _write_durably(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
        _fsync_dir(tmp)
        newer = [p for p in self.checkpoints() if int(_STEP_DIR.match(p.name).group(1)) > step]
        if final.exists():
            # os.replace cannot overwrite a non-empty directory: move the old copy aside first (a crash
            # right here leaves it as trash and the new one as tmp; both are cleaned on the next save).
            os.replace(final, self.root / f"{_TRASH_PREFIX}{step:08d}_{os.getpid()}")
        os.replace(tmp, final)
        _fsync_dir(self.root)
        if newer:
            warnings.warn(
                f"saved step {step} in {self.root}, which also holds later checkpoints "
                f"({', '.join(p.name for p in newer)}), e.g. from before a resume at an earlier step; "
                f"resume=auto will pick {newer[-1].name}. Delete them or resume from an explicit path.",
                stacklevel=4,
            )
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Delete interrupted saves (.tmp_step_*) and half-pruned checkpoints (.trash_step_*)."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        if self.keep_last is None:
            return
        complete = self.checkpoints()
        keep_set = {*complete[-self.keep_last :], keep}
        for path in complete:
            if path in keep_set:
                continue
            trash = self.root / f"{_TRASH_PREFIX}{path.name[len('step_') :]}_{os.getpid()}"
            try:
                # Renamed first so a crash mid-delete cannot leave a partial checkpoint named step_*.
                os.replace(path, trash)
                shutil.rmtree(trash)
            except OSError as exc:
                # The new checkpoint is safe; failing the save for a leftover would stop training.
                warnings.warn(f"could not delete old checkpoint {path}: {exc}", stacklevel=3)

    # -- load -----------------------------------------------------------------------------------------

    def read_trainer_state(self, path: Path | str) -> dict[str, Any]:
        """The `trainer_state` saved with the checkpoint at `path` (its config, step, data position),
        read without touching the model: what a resume checks before anything heavy is loaded.
        Raises DamagedCheckpointError when trainer.pt is missing or unreadable."""
        path = Path(path)
        file = path / TRAINER_FILE
        try:
            # Pickled by save() (trainer_state may hold any picklable object): trusted input only.
            payload = torch.load(file, map_location="cpu", weights_only=False)
            state = dict(payload["trainer_state"])
        except FileNotFoundError:
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged: {file} is missing", path, file
            ) from None
        except Exception as exc:
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged: {file} cannot be read ({_describe(exc)})", path, file
            ) from exc
        manifest = _read_manifest(path)
        if manifest is not None:
            state.setdefault("step", manifest.get("step"))
        return state

    def load(
        self,
        path: Path | str,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        *,
        scheduler: Any = None,
        restore_rng: bool = True,
        extra_state: MutableMapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint into the live model/optimizer/scheduler and restore this rank's RNG. Collective.

        The model may be plain, DDP-wrapped or FSDP2-sharded on any number of ranks (DCP reshards), but
        must have the same parameter names and shapes as at save time; the optimizer must have the same
        parameter groups. optimizer=None loads weights only (a checkpoint saved without an optimizer
        also needs optimizer=None); a checkpoint saved before the optimizer's first step leaves the
        given (fresh) optimizer as it is. scheduler: restored from the saved state_dict (None skips it).
        restore_rng: set this rank's python/numpy/torch/CUDA RNGs to those saved by the same rank (see
        the module docstring for a changed world size); False keeps the current RNG state.
        extra_state: the live counterpart of some of the `extra_state` saved, e.g.
        {"ema": ema.state_dict()} built on the resumed model: its tensors are overwritten in place
        (resharded like the model) and its other values are replaced in this mapping.

        Returns:
            The `trainer_state` passed to `save` (an empty dict if none), with "step" set to the saved
            step when the caller did not store one.

        Raises:
            CheckpointError on every rank, naming the problem (the rank's own exception is its
            __cause__): `path` is not a complete checkpoint (FileNotFoundError, listing the available
            ones), the checkpoint lacks the optimizer or scheduler state asked for, the optimizer's
            params are not the model's (ValueError), or the model/optimizer do not match the checkpoint.
        """
        path = Path(path)
        rank, world, _ = _dist_info()
        failed: list[BaseException] = []
        manifest: dict[str, Any] = {}
        with _capture(failed):
            self._require_complete(path, f"loading checkpoint {str(path)!r}")
            # resolve() already read every byte against its checksum; a path given directly is read here.
            checked = path.absolute() in self._checksummed
            manifest = self.verify(path, checksums=not checked, part=(rank, world))
            if optimizer is not None:
                optimizer = _unwrap_optimizer(optimizer)
                _check_optimizer_matches(model, optimizer)
                if manifest["optimizer"] == "absent":
                    raise ValueError(
                        f"checkpoint {path} holds no optimizer state (saved with optimizer=None); "
                        "pass optimizer=None to load its weights"
                    )
            missing_extra = sorted(set(extra_state or {}) - set(manifest.get("extra_state", [])))
            if missing_extra:
                raise ValueError(
                    f"checkpoint {path} holds no extra state {missing_extra} (it has "
                    f"{manifest.get('extra_state', [])}); leave those keys out of extra_state"
                )
            if scheduler is not None and not manifest["scheduler"]:
                raise ValueError(
                    f"checkpoint {path} holds no scheduler state (saved with scheduler=None); "
                    "pass scheduler=None and set the schedule from the restored step"
                )
        # Ranks must load the same checkpoint: a stale directory listing on one node would mix steps.
        _agree(_first(failed), f"loading {path}", value=(path.name, manifest.get("step")))

        load_optimizer = optimizer if manifest["optimizer"] == "saved" else None
        with _capture(failed):
            state = _state_for(model, load_optimizer)
            if extra_state:
                # The caller's mapping itself: DCP writes tensors in place and replaces other values in it.
                state["extra"] = extra_state
            with _single_process_is_intended():
                dcp.load(state, checkpoint_id=path / MODEL_OPTIM_DIR)
            if load_optimizer is None:
                set_model_state_dict(model, state["model"])
            else:
                set_state_dict(
                    model, load_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
                )
        _agree(
            _first(failed),
            f"loading model/optimizer state from {path / MODEL_OPTIM_DIR} (does the model and its "
            "optimizer's param groups match the run that saved it?)",
        )

        with _capture(failed):
            # Pickled by save() (trainer_state may hold any picklable object): trusted input only.
            payload = torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=False)
            if scheduler is not None:
                scheduler.load_state_dict(payload["scheduler"])
            if restore_rng:
                self._restore_rank_rng(path, rank, world, manifest["world_size"])
        _agree(_first(failed), f"restoring scheduler / RNG / trainer state from {path}")

        trainer_state = dict(payload["trainer_state"])
        trainer_state.setdefault("step", manifest["step"])
        return trainer_state

    @staticmethod
    def _restore_rank_rng(path: Path, rank: int, world: int, saved_world: int) -> None:
        if rank >= saved_world:
            warnings.warn(
                f"checkpoint {path} was saved on {saved_world} rank(s), this is rank {rank} of {world}: "
                "there is no saved RNG state for it, so it keeps its current RNG state",
                stacklevel=3,
            )
            return
        _restore_rng(
            torch.load(path / RNG_DIR / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=True)
        )

    # -- export ---------------------------------------------------------------------------------------

    def export_safetensors(
        self,
        model: nn.Module,
        path: Path | str,
        *,
        config: Any = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Path:
        """Same as the module-level `export_safetensors` (collective)."""
        return export_safetensors(model, path, config=config, metadata=metadata)


# ---------------------------------------------------------------------------------------------------------
# Consolidated safetensors export


def _policy_config(model: nn.Module) -> Any:
    inner = getattr(model, "module", model)  # DDP keeps the policy in .module; FSDP2 is the module itself
    return getattr(inner, "config", None)


def _config_json(config: Any) -> str | None:
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a Mapping or have .to_dict() (a PolicyConfig), got {type(config).__name__}"
        )
    return json.dumps(dict(config), sort_keys=True)


def export_safetensors(
    model: nn.Module,
    path: Path | str,
    *,
    config: Any = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write the full (unsharded) policy state dict as one .safetensors file, from rank 0. Collective.

    Under FSDP2 the shards are gathered to rank 0's CPU one tensor at a time (full_state_dict +
    cpu_offload), so no GPU ever holds the whole model. The file is written to a temporary name in the
    same directory and renamed, so a reader never sees a partial file.

    Args:
        model: plain, DDP-wrapped or FSDP2-sharded policy.
        path: destination file (parent directories are created).
        config: the policy config (a PolicyConfig or a dict), stored as JSON under "policy_config";
            defaults to `model.config` when the model has one, unless metadata holds "policy_config".
        metadata: extra string key/values for the file header ("format" and "tied" are reserved).

    Tied parameters (one tensor under two names) are stored once; the header's "tied" entry maps each
    dropped name to the kept one and `load_safetensors_into` restores both.

    Returns:
        `path` (on every rank; the file exists when the call returns).

    Raises:
        TypeError / ValueError for a config or metadata that cannot go into the header (before any
        collective); CheckpointError on every rank if gathering or writing failed on any rank.
    """
    path = Path(path)
    rank, _, _ = _dist_info()
    # Argument errors are the same on every rank: raise them before any collective.
    if config is None and "policy_config" not in (metadata or {}):
        config = _policy_config(model)
    header = _export_header(config, metadata)
    failed: list[BaseException] = []
    full: dict[str, Tensor] = {}
    with _capture(failed):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(model, options=options)
    _agree(_first(failed), f"exporting {path}: gathering the full state dict")

    if rank == 0:
        with _capture(failed):
            check_finite_tensors(full, f"exporting {path}")
            _write_safetensors(full, path, header)
    del full
    _agree(_first(failed), f"exporting {path}: writing the file")
    return path


def _export_header(config: Any, metadata: Mapping[str, str] | None) -> dict[str, str]:
    header: dict[str, str] = {"format": EXPORT_FORMAT, "torch_version": torch.__version__}
    config_json = _config_json(config)
    if config_json is not None:
        header["policy_config"] = config_json
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"safetensors metadata must map str to str; got {key!r}: {type(value).__name__}")
        if key in _RESERVED_METADATA:
            raise ValueError(
                f"metadata key {key!r} is written by export_safetensors itself (reserved: "
                f"{sorted(_RESERVED_METADATA)}); rename the key"
            )
        if key == "policy_config" and "policy_config" in header:
            raise ValueError("the policy config was given twice (config=... and metadata['policy_config'])")
        header[key] = value
    return header


def _write_safetensors(state: Mapping[str, Tensor], path: Path, header: dict[str, str]) -> None:
    tensors: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    views: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu")
        storage = tensor.untyped_storage().data_ptr()
        view = (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if tensor.numel() and view in views:
            tied[name] = views[view]
            continue
        views[view] = name
        # safetensors refuses tensors that are non-contiguous or overlap another stored tensor's memory
        # (views into one fused buffer): those are copied, the rest are written without a copy.
        if not tensor.is_contiguous() or (tensor.numel() and storage in storages):
            tensor = tensor.contiguous().clone()
        storages.add(storage)
        tensors[name] = tensor
    if tied:
        header = {**header, "tied": json.dumps(tied, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=header)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def load_safetensors_into(model: nn.Module, path: Path | str, *, strict: bool = True) -> None:
    """Load an `export_safetensors` file into `model` (plain, DDP or FSDP2; collective under FSDP2).

    Every rank reads the file (memory-mapped) and keeps its own shard. With strict=True, missing or
    unexpected keys raise a RuntimeError naming them.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no exported policy at {path}; write one with export_safetensors(model, path)"
        )
    tensors = load_file(str(path))
    for name, kept in json.loads(read_safetensors_metadata(path).get("tied", "{}")).items():
        tensors[name] = tensors[kept]
    try:
        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=strict))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise RuntimeError(f"{path} does not match {type(model).__name__}: {exc}") from exc
