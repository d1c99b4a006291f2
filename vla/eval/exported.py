"""Reading an exported policy file's header, shared by evaluation and the trainer (which sits above)."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open


def read_safetensors_metadata(path: Path | str) -> dict[str, str]:
    """The header metadata of an exported file (e.g. json.loads(meta["policy_config"]))."""
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})
