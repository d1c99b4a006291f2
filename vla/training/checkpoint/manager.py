"""CheckpointManager: where a run's checkpoints live, saving (atomic, collective), finding the newest
intact one, retention, and loading."""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
from torch.optim import Optimizer

from vla.atomic import fsync_dir as _fsync_dir
from vla.training.checkpoint.collective import (
    _agree,
    _capture,
    _describe,
    _dist_info,
    _first,
    _single_process_is_intended,
)
from vla.training.checkpoint.errors import CheckpointError, DamagedCheckpointError, check_finite_tensors
from vla.training.checkpoint.layout import (
    _STEP_DIR,
    _TMP_PREFIX,
    _TRASH_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MODEL_OPTIM_DIR,
    RNG_DIR,
    TRAINER_FILE,
    _manifest_digest,
    _read_manifest,
    _write_durably,
)
from vla.training.checkpoint.state import (
    _capture_rng,
    _check_optimizer_matches,
    _restore_rng,
    _state_for,
    _unwrap_optimizer,
)
from vla.training.checkpoint.verify import checksum_files, verify_checkpoint


class CheckpointManager:
    """Saves, finds, prunes and loads the checkpoints of one training run under `root`.

    Args:
        root: directory holding `step_{step:08d}/` checkpoints (created on the first save). It must be
            visible to every rank, and only one job may write into it at a time.
        keep_last: after each successful save, keep only this many newest complete checkpoints (the one
            just written is never deleted); None keeps all.

    Non-collective: `path_for`, `checkpoints`, `latest`, `read_manifest`, `verify`.
    Collective (every rank calls it): `save`, `load`, and `resolve` under a process
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
        """vla.training.checkpoint.verify.verify_checkpoint (every file present, sized, readable, and with
        `checksums` its digest as saved); returns the manifest."""
        return verify_checkpoint(path, checksums=checksums, part=part)

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
            manifest["files"] = checksum_files(tmp, step, rank, world)
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
