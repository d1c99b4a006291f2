"""Is a checkpoint intact: every file present, of its recorded size, readable, and (checksums) with the
digest recorded at save time; and the digests themselves, computed at save time."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from vla.checksums import digests as file_digests
from vla.checksums import mismatches as digest_mismatches
from vla.training.checkpoint.collective import _agree, _capture, _describe, _dist_info, _first
from vla.training.checkpoint.errors import DamagedCheckpointError
from vla.training.checkpoint.layout import (
    FORMAT,
    MANIFEST,
    MODEL_OPTIM_DIR,
    RNG_DIR,
    TRAINER_FILE,
    _manifest_digest,
)


def verify_checkpoint(
    path: Path | str, *, checksums: bool = True, part: tuple[int, int] = (0, 1)
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
    if (recorded_self is not None or manifest.get("version", 1) >= 3) and recorded_self != _manifest_digest(
        {k: v for k, v in manifest.items() if k != "self_digest"}
    ):
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
            raise damaged(file, f"has {actual} bytes, the manifest records {size} (truncated or replaced)")
        if isinstance(entry, dict) and isinstance(entry.get("digest"), str):
            expected[relative] = entry["digest"]
    if checksums:
        if not expected:
            warnings.warn(
                f"checkpoint {path} records no checksums (saved before they were kept): its files are "
                "checked by size only",
                stacklevel=3,
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


def checksum_files(tmp: Path, step: int, rank: int, world: int) -> dict[str, dict[str, Any]]:
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
