"""What a resume may change: the saved config and dataset against the current ones.

Every checkpoint's trainer state holds the run's config (flattened to dotted keys) and a fingerprint
of its dataset. On resume (`check_resume`):

- keys that change the trajectory (`TRAJECTORY_KEYS`: every optim.*, model.* and data.* key except
  the ones in `HARMLESS`, trainer.batch_size / seed / schedule / warmup_steps / schedule_steps /
  lengthen_schedule_at / min_lr_ratio / clip_grad_norm / ema_decay / precision) must be unchanged: a
  changed one raises ResumeMismatchError listing every changed key with its saved and new value, and
  how to proceed (put the saved values back, or start a new run in another output_dir). They are
  refused rather than applied because the restored optimizer and scheduler state would silently keep
  the old values (e.g. the lr).
- a different dataset (another fingerprint: info.json totals, fps, features and a hash of meta/) is
  refused the same way, also when data.root is unchanged; a moved dataset (new data.root, same
  fingerprint) is accepted.
- trainer.steps: below the checkpoint's step is an error; a change is applied and logged with what it
  does to the schedule (the decay now ends at the new step count).
- any other changed key (log/val/checkpoint intervals, parallel.*, grad_accum, ...) is applied and
  logged: it does not change the trajectory.
- a key the saved config has and the code no longer knows (a removed setting) is logged.

Checkpoints written before this module kept no config: then output_dir/config.yaml (the config of
the run that wrote it) is compared, and without either only the step check runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

TRAJECTORY_KEYS = (
    "optim.",
    "model.",
    "data.",
    "trainer.batch_size",
    "trainer.seed",
    "trainer.schedule",
    "trainer.warmup_steps",
    "trainer.schedule_steps",
    "trainer.lengthen_schedule_at",
    "trainer.min_lr_ratio",
    "trainer.clip_grad_norm",
    "trainer.ema_decay",
    "trainer.precision",
)
# Under the prefixes above, but without effect on the trajectory (or checked by fingerprint instead).
HARMLESS = frozenset(
    {
        "model.weights",  # only read at the start of a fresh run
        "model.weights_format",
        "model.gradient_checkpointing",  # recomputes activations, same numbers
        "data.root",  # the dataset fingerprint decides
        "data.num_workers",
        "data.uint8_transport",
    }
)


class ResumeMismatchError(ValueError):
    """The resumed run's config or dataset differs from the checkpoint's in a way that matters."""


_VALUE_DICTS = frozenset({"model.overrides", "data.camera_map", "data.norm_modes"})  # user dicts: one value


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"optim.lr": 0.02, ...} from a nested dict / dataclass; lists and user dicts stay values
    (JSON-normalised: tuples become lists, so a config read back from YAML compares equal)."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = dataclasses.asdict(tree)
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in _VALUE_DICTS:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = json.loads(json.dumps(value, default=str))
    return out


def dataset_fingerprint(root: Path | str) -> dict[str, Any]:
    """info.json totals, fps and feature names, and a sha256 over every file under meta/."""
    root = Path(root)
    info_path = root / "meta" / "info.json"
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        info = {}
    digest = hashlib.sha256()
    meta = root / "meta"
    for file in sorted(p for p in meta.rglob("*") if p.is_file()) if meta.is_dir() else []:
        digest.update(str(file.relative_to(meta)).encode() + b"\0")
        digest.update(file.read_bytes())
    return {
        "total_episodes": info.get("total_episodes"),
        "total_frames": info.get("total_frames"),
        "fps": info.get("fps"),
        "features": sorted(info.get("features", {})),
        "meta_sha256": digest.hexdigest(),
    }


def saved_config(trainer_state: dict[str, Any], output_dir: Path) -> dict[str, Any] | None:
    """The flattened config the checkpoint was trained with (or output_dir/config.yaml's), else None."""
    if isinstance(trainer_state.get("config"), dict):
        return trainer_state["config"]
    path = output_dir / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    return flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def _schema_defaults(cfg: Any) -> dict[str, Any]:
    """The flattened defaults of `cfg`'s schema (empty when it has no default-constructible type)."""
    try:
        return flatten(type(cfg)())
    except TypeError:
        return {}


def _trajectory_key(key: str) -> bool:
    return key not in HARMLESS and any(key == k or key.startswith(k) for k in TRAJECTORY_KEYS)


def compare_config(
    saved: dict[str, Any], cfg: Any, also_refuse: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """(trajectory changes, {key: note} for the other changes) of `cfg` against a saved flattened config.

    A trajectory change (`TRAJECTORY_KEYS`, not `HARMLESS`) reads "key: saved -> now"; the notes: the same
    for keys that do not change the trajectory (marked applied, except trainer.steps), a key newer than the
    saved config at its default (the behaviour the run had), and a key the saved config has that is no
    longer a setting. `also_refuse`: more key prefixes to count as trajectory changes (a caller comparing
    what a finished run measured, e.g. its evaluation settings).
    """
    current = flatten(cfg)
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    changed = [k for k in changed if k not in ("trainer.resume", "output_dir", "run_name")]
    defaults = _schema_defaults(cfg)
    problems: list[str] = []
    notes: dict[str, str] = {}
    for key in changed:
        line = f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
        if key not in saved and key in defaults and current.get(key) == defaults[key]:
            notes[key] = (
                f"{key} is newer than this checkpoint's config; it runs at its default {current[key]!r}"
            )
        elif key not in current:
            notes[key] = f"{key} (saved {saved[key]!r}) is no longer a setting"
        elif _trajectory_key(key) or any(key.startswith(prefix) for prefix in also_refuse):
            problems.append(line)
        elif key == "trainer.steps":
            notes[key] = line
        else:
            notes[key] = f"{line} (applied; does not change the trajectory)"
    return problems, notes


def check_resume(
    cfg: Any,
    trainer_state: dict[str, Any],
    checkpoint: Path,
    output_dir: Path,
    dataset_root: Path | str,
) -> list[str]:
    """Raise ResumeMismatchError for a refused change; return the lines to log for accepted ones."""
    step = int(trainer_state["step"])
    steps = cfg.trainer.steps
    if steps < step:
        raise ResumeMismatchError(
            f"trainer.steps={steps} is below the step of the checkpoint being resumed ({checkpoint}, step "
            f"{step}): there is nothing left to train. Set trainer.steps above {step} to train further, or "
            "resume an earlier checkpoint explicitly (trainer.resume=<path>)"
        )
    saved = saved_config(trainer_state, output_dir)
    if saved is None:
        notes = [f"resume: {checkpoint} records no config; the resumed settings are not compared"]
        problems: list[str] = []
    else:
        problems, changes = compare_config(saved, cfg)
        if "trainer.steps" in changes:
            changes["trainer.steps"] += f"; {_schedule_note(saved, cfg, step)}"
        notes = [f"resume: {line}" for line in changes.values()]
    fingerprint = trainer_state.get("dataset")
    if isinstance(fingerprint, dict):
        now = dataset_fingerprint(dataset_root)
        if now != fingerprint:
            diffs = [
                f"{k} {fingerprint.get(k)!r} -> {now.get(k)!r}" for k in now if now[k] != fingerprint.get(k)
            ]
            problems.append(
                f"the dataset at data.root={str(dataset_root)!r} is not the one the checkpoint was trained on "
                f"({', '.join(diffs)})"
            )
    if problems:
        listing = "\n  ".join(problems)
        raise ResumeMismatchError(
            f"resuming {checkpoint} with settings that change the training trajectory:\n  {listing}\n"
            "The restored optimizer, schedule and data position were made with the saved values, so these "
            "cannot be applied mid-run. Put the saved values back on the command line to continue this "
            "run, or start a new run with the new values in another output_dir (trainer.resume=none)"
        )
    return notes


def _schedule_note(saved: dict[str, Any], cfg: Any, step: int) -> str:
    from vla.training.optim import lr_multiplier

    trainer = cfg.trainer
    old = SimpleNamespace(
        **{**dataclasses.asdict(trainer), "steps": saved.get("trainer.steps", trainer.steps)}
    )
    before, after = lr_multiplier(step, old), lr_multiplier(step, trainer)
    if trainer.schedule == "constant" or math.isclose(before, after):
        return "applied (the lr schedule is unchanged at the resumed step)"
    return (
        f"applied: the {trainer.schedule} schedule now ends at step {trainer.steps}, so the lr multiplier at "
        f"step {step} changes from {before:.4g} to {after:.4g}"
    )


def truncate_metrics(path: Path, step: int, rerun_at_step: tuple[str, ...] = ()) -> int:
    """Drop metrics.jsonl records of steps > `step` (to be re-run) and unreadable lines, in place.

    rerun_at_step: splits whose records *at* `step` go too (a resume at the last step re-runs the
    final evaluations, "eval", but not that step's training and validation records).

    Records carry the optimizer step 1..N they were logged after, so resuming from the checkpoint of
    step S re-runs steps S+1, S+2, ... and their records go. The file is rewritten in place (same
    inode): an append-mode handle open on it keeps working. Returns the number of lines dropped.
    """
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    with open(path, "r+") as f:
        for line in f.read().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                dropped += 1  # a line cut short by a crash
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                at = record["step"]
                if at > step or (at == step and record.get("split") in rerun_at_step):
                    dropped += 1
                    continue
            kept.append(line)
        if dropped:
            f.seek(0)
            f.write("".join(f"{line}\n" for line in kept))
            f.truncate()
    return dropped
