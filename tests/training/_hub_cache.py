"""A Hugging Face cache on disk in the hub's own layout (`<type>s--org--name/{refs/main, snapshots/<hash>}`),
for tests that run offline against it (HF_HUB_CACHE=..., HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo_id: str, repo_type: str, files: dict[str, Path | str | bytes]) -> Path:
    """Put `files` (name -> source path, or text/bytes content) into the cache as repo_id's main revision;
    returns the snapshot directory."""
    org, name = repo_id.split("/")
    repo = cache / f"{repo_type}s--{org}--{name}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    for target, source in files.items():
        path = snapshot / target
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path) and source.is_dir():
            shutil.copytree(source, path, dirs_exist_ok=True)
        elif isinstance(source, Path):
            shutil.copyfile(source, path)
        elif isinstance(source, bytes):
            path.write_bytes(source)
        else:
            path.write_text(source)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def paligemma_sized_tokenizer(directory: Path, size: int = 257_152) -> Path:
    """A word-level tokenizer with PaliGemma's number of ids (its real one cannot be downloaded here)."""
    from vla.data.tokenizer import save_word_level_tokenizer

    words = [
        "reach",
        "the",
        "goal",
        "push",
        "puck",
        "pick",
        "and",
        "place",
        "open",
        "drawer",
        "press",
        "button",
    ]
    return save_word_level_tokenizer(directory, words, size)
