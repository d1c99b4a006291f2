"""Datasets a generator writes on first use: atomic writes and a marker that guards against overwriting.

A generated dataset root holds the generator's marker file (JSON with "generator" and "config"). A
root is reused when its marker records the same generator and config, generated when it is absent or
empty, and otherwise left alone with an error: a dataset made with other settings (or one we did not
make) is never overwritten behind the user's back.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vla.data.errors import DatasetError


def read_marker(root: Path | str, marker: str) -> dict[str, Any] | None:
    """The marker JSON at root/marker, or None when there is none."""
    path = Path(root) / marker
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DatasetError(
            f"{path} is not readable JSON ({exc}); delete the dataset root and regenerate it"
        ) from exc


def write_atomically(root: Path | str, write: Callable[[Path], None], *, overwrite: bool = False) -> Path:
    """Run `write(staging_dir)` in a sibling temporary folder, then rename it to `root`.

    A reader (or another rank generating the same data) never sees a half-written root. A non-empty
    `root` is replaced only with overwrite=True.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise DatasetError(f"{root} is a file, not a dataset directory; choose another root")
    if root.exists() and any(root.iterdir()) and not overwrite:
        raise DatasetError(
            f"{root} exists and is not empty; choose a new root, or replace it with --overwrite (the scripts) / "
            "overwrite=True (Python)"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if overwrite and root.exists():
        shutil.rmtree(root)
    try:
        os.replace(staging, root)  # fails if another process already put a non-empty root there
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not root.is_dir() or not any(root.iterdir()):
            raise
    return root


def config_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """'key: saved -> wanted' for every top-level key whose value differs."""
    keys = sorted(set(saved) | set(wanted))
    return [f"{k}: {saved.get(k)!r} -> {wanted.get(k)!r}" for k in keys if saved.get(k) != wanted.get(k)]


def ensure_generated(
    root: Path | str,
    *,
    marker: str,
    generator: str,
    config: dict[str, Any],
    generate: Callable[[Path], Path],
    config_key: str,
) -> Path:
    """Reuse the dataset at `root` if `generator` made it with `config`, else generate it if root is empty.

    marker: path of the marker file inside the root; config: the JSON form of the generator settings;
    generate(root): writes the dataset (atomically); config_key: the config prefix named in errors
    (e.g. "data.synthetic").
    """
    root = Path(root)
    saved = read_marker(root, marker)
    if saved is not None:
        if saved.get("generator") == generator and saved.get("config") == config:
            if (root / "meta" / "info.json").is_file():
                return root
            raise DatasetError(
                f"{root} has the marker {marker} but no meta/info.json: it is damaged; delete {root} to "
                "regenerate it"
            )
        changes = config_differences(saved.get("config") or {}, config)
        raise DatasetError(
            f"{root} holds a dataset generated with other settings ({'; '.join(changes) or saved.get('generator')}); "
            f"refusing to overwrite it. Point data.root at another directory for these {config_key} "
            f"settings, or delete {root} yourself to regenerate it."
        )
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise DatasetError(
            f"{root} exists and is not a dataset made by {generator} (no {marker}); refusing to overwrite "
            "it. Choose another data.root for the generated data."
        )
    return generate(root)
