"""Reading an exported policy file's header, and checking its bytes, shared by evaluation and the
trainer (which sits above)."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from vla.checksums import check_sidecar, sidecar


class DamagedExportError(ValueError):
    """An exported / given safetensors file cannot be trusted: its digest differs or it does not parse."""


def check_export_bytes(path: Path | str) -> None:
    """Compare `path` with its `<file>.sha256` (written with every export); a file without one passes.
    Raises DamagedExportError naming the file."""
    path = Path(path)
    if check_sidecar(path) is False:
        raise DamagedExportError(
            f"{path} is damaged: its sha256 differs from the one recorded in {sidecar(path)} when it was "
            "written (disk or copy damage). Re-export it from the run's last checkpoint, or copy it again"
        )


def read_safetensors_metadata(path: Path | str) -> dict[str, str]:
    """The header metadata of an exported file (e.g. json.loads(meta["policy_config"])).
    Raises DamagedExportError naming the file when it is not a readable safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except SafetensorError as exc:
        raise DamagedExportError(
            f"{path} is not a readable safetensors file ({exc}): truncated or damaged. Re-export it, or "
            "copy it again"
        ) from exc
