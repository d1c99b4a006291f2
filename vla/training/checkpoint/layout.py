"""What a checkpoint directory holds (names, format), its manifest, and durable small-file writes."""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORMAT = "vla.checkpoint"
FORMAT_VERSION = 3  # 3: + a digest of the manifest itself; 2: every file with its size and digest; 1: sizes
MANIFEST = "manifest.json"
MODEL_OPTIM_DIR = "model_optim"
RNG_DIR = "rng"
TRAINER_FILE = "trainer.pt"

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp_step_"
_TRASH_PREFIX = ".trash_step_"


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
