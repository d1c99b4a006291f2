"""Digests of checkpoint and export files, computed in worker threads.

A digest is written "<algorithm>:<hex>" and checked with the algorithm it names. Checkpoints use
xxh3-128 (xxhash: ~4 GB/s a core here, against sha256's ~0.5-1 GB/s, so checksumming stays a small part
of a save); exports use sha256, the digest people check by hand. Both release the GIL while hashing,
so files are hashed in parallel threads (and, in a distributed save or load, split over the ranks:
each hashes every W-th file).

Exports get a sidecar `<file>.sha256` in `sha256sum`'s format ("<hex>  <name>"), so
`sha256sum -c policy.safetensors.sha256` checks one by hand as well.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from vla.atomic import write_file_atomically

CHECKPOINT_ALGORITHM = "xxh3_128"
EXPORT_ALGORITHM = "sha256"
_ALGORITHMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_CHUNK = 8 << 20


def file_digest(path: Path | str, algorithm: str = CHECKPOINT_ALGORITHM) -> str:
    """The digest "<algorithm>:<hex>" of one file's bytes."""
    digest = _ALGORITHMS[algorithm]()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"{algorithm}:{digest.hexdigest()}"


def _algorithm_of(recorded: str) -> str:
    algorithm = recorded.split(":", 1)[0]
    return algorithm if algorithm in _ALGORITHMS else CHECKPOINT_ALGORITHM


def _workers(count: int) -> int:
    return max(1, min(count, os.cpu_count() or 1, 8))


def digests(
    root: Path, relative: Iterable[str], algorithm: str | Mapping[str, str] = CHECKPOINT_ALGORITHM
) -> dict[str, str]:
    """{relative path: digest} for files under `root`, hashed in parallel threads. algorithm: one for
    all, or per file."""
    names = list(relative)
    if not names:
        return {}

    def one(name: str) -> str:
        return file_digest(root / name, algorithm if isinstance(algorithm, str) else algorithm[name])

    with ThreadPoolExecutor(max_workers=_workers(len(names))) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def mismatches(root: Path, expected: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(relative path, expected, actual) for every file whose digest differs, in `expected`'s order;
    each file is hashed with the algorithm its expected digest names."""
    actual = digests(root, expected, {name: _algorithm_of(want) for name, want in expected.items()})
    return [(name, want, actual[name]) for name, want in expected.items() if actual[name] != want]


def sidecar(path: Path | str) -> Path:
    """Where the digest of an exported file lives: `<file>.sha256`."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def write_sidecar(path: Path | str) -> Path:
    """Write `<file>.sha256` for `path` (atomically: a temp file of this process renamed into place)."""
    path = Path(path)
    hex_digest = file_digest(path, EXPORT_ALGORITHM).split(":", 1)[1]
    return write_file_atomically(sidecar(path), lambda tmp: tmp.write_text(f"{hex_digest}  {path.name}\n"))


def check_sidecar(path: Path | str) -> bool | None:
    """True: `path` matches its `.sha256`; False: it does not; None: there is no (readable) sidecar."""
    path = Path(path)
    try:
        recorded = sidecar(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return file_digest(path, EXPORT_ALGORITHM) == f"{EXPORT_ALGORITHM}:{recorded}"
