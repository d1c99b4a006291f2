"""A seeded fault campaign: generated damage, and whether each case ends in a correct recovery or a
clear error (never a silent wrong result).

    python scripts/fault_campaign.py [--seed 0] [--flips 24] [--nan-frames 50] [--export-flips 30]
                                     [--json out/campaign.json]

Cases (all in this process, on small artefacts made at the start):
  checkpoint_flip   one bit flipped at a random offset of each file of the newest of two checkpoints
                    (--flips offsets per file). Correct: resume=auto falls back to the older one and
                    names the file; an explicit load of the damaged one fails naming it.
  checkpoint_cut    each file of the newest checkpoint truncated at a random length (--flips per file).
                    Correct: the same.
  nan_frame         NaN or inf written into a random (episode, frame, key, dim) of a dataset's parquet.
                    Correct: the data scan names exactly that file, episode, frame and key.
  export_flip       one bit flipped at a random offset of an exported policy.safetensors. Correct: the
                    loader refuses it naming the file (DamagedExportError).
Outcomes: recovered (the correct recovery), named (a clear error naming the damaged file or frame),
silent (anything that proceeds as if nothing happened, or blames something else). Prints the table of
outcomes per kind and writes the cases as JSON; exits 1 if any case is silent.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vla.help_format import HelpFormatter  # noqa: E402
from vla.training.checkpoint import CheckpointError, CheckpointManager, DamagedCheckpointError  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flips", type=int, default=24, help="offsets per checkpoint file (flips and cuts)")
    parser.add_argument("--nan-frames", type=int, default=50)
    parser.add_argument("--export-flips", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


# -- artefacts -------------------------------------------------------------------------------------


def make_checkpoints(root: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    manager = CheckpointManager(root, keep_last=None)
    for step in (1, 2):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        manager.save(step, model, optimizer, trainer_state={"step": step})
    return root


def _flip(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    offset = rng.randrange(len(data))
    data[offset] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return offset


def _cut(path: Path, rng: random.Random) -> int:
    data = path.read_bytes()
    length = rng.randrange(len(data))
    path.write_bytes(data[:length])
    return length


# -- cases -----------------------------------------------------------------------------------------


def checkpoint_case(
    pristine: Path, work: Path, relative: str, damage: str, rng: random.Random
) -> dict[str, Any]:
    root = work / "ckpt"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(pristine, root)
    target = root / "step_00000002" / relative
    where = (_flip if damage == "flip" else _cut)(target, rng)
    manager = CheckpointManager(root, keep_last=None)
    case = {"kind": f"checkpoint_{damage}", "file": relative, "at": where}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            chosen = manager.resolve("auto")
        except DamagedCheckpointError as exc:
            return {
                **case,
                "outcome": "named" if str(target) in str(exc) else "silent",
                "detail": str(exc)[:200],
            }
    reasons = " ".join(reason for _, reason in manager.skipped)
    if (
        chosen is not None
        and chosen.name == "step_00000001"
        and (str(target) in reasons or relative in reasons)
    ):
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        try:  # the explicit load of the damaged one must fail too, naming the file
            CheckpointManager(root).load(root / "step_00000002", model)
        except (CheckpointError, DamagedCheckpointError, FileNotFoundError) as exc:
            named = str(target) in str(exc) or relative in str(exc)
            return {**case, "outcome": "recovered" if named else "silent", "detail": reasons[:200]}
        return {**case, "outcome": "silent", "detail": "explicit load of the damaged checkpoint succeeded"}
    return {**case, "outcome": "silent", "detail": f"resume=auto chose {chosen} ({reasons[:150]})"}


def make_dataset(root: Path) -> Path:
    from vla.data.synthetic import SyntheticConfig, generate_synthetic_dataset

    generate_synthetic_dataset(root, SyntheticConfig(episodes=6, episode_length=10, image_size=32))
    return root


def nan_case(pristine: Path, work: Path, rng: random.Random) -> dict[str, Any]:
    from vla.data import LeRobotDataset
    from vla.data.scan import scan_frames

    root = work / "data"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(pristine, root)
    (path,) = sorted((root / "data").rglob("*.parquet"))
    table = pq.read_table(path)
    key = rng.choice(["observation.state", "action"])
    row = rng.randrange(table.num_rows)
    column = table.column(key)
    values = np.stack(column.to_numpy(zero_copy_only=False)).astype(np.float32)
    dim = rng.randrange(values.shape[1])
    values[row, dim] = rng.choice([float("nan"), float("inf"), float("-inf")])
    table = table.set_column(table.schema.get_field_index(key), key, pa.array(list(values), type=column.type))
    pq.write_table(table, path)
    episode = int(table.column("episode_index")[row].as_py())
    frame = int(table.column("frame_index")[row].as_py())
    case = {"kind": "nan_frame", "file": str(path.relative_to(root)), "at": [episode, frame, key, dim]}
    found = scan_frames(LeRobotDataset(root))
    hit = [
        b
        for b in found
        if (b.episode, b.frame, b.key) == (episode, frame, key) and b.file.endswith(path.name)
    ]
    outcome = "named" if len(found) == 1 and hit else "silent"
    return {**case, "outcome": outcome, "detail": "; ".join(map(str, found))[:200]}


def make_export(root: Path) -> Path:
    from vla.models import build_policy
    from vla.training.export import write_export

    torch.manual_seed(0)
    policy = build_policy("pi0_tiny")
    root.mkdir(parents=True, exist_ok=True)
    return write_export(policy.state_dict(), policy.config, root)


def export_case(pristine: Path, work: Path, rng: random.Random) -> dict[str, Any]:
    from vla.eval.exported import DamagedExportError
    from vla.eval.policy_runner import load_exported_policy

    directory = work / "export"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(pristine.parent, directory)
    path = directory / pristine.name
    where = _flip(path, rng)
    case = {"kind": "export_flip", "file": path.name, "at": where}
    try:
        load_exported_policy(path)
    except DamagedExportError as exc:
        return {**case, "outcome": "named" if str(path) in str(exc) else "silent", "detail": str(exc)[:200]}
    return {**case, "outcome": "silent", "detail": "a damaged export loaded"}


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    start = time.perf_counter()
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checkpoints = make_checkpoints(work / "pristine_ckpt")
        newest = checkpoints / "step_00000002"
        files = sorted(str(p.relative_to(newest)) for p in newest.rglob("*") if p.is_file())
        for relative in files:
            for damage in ("flip", "cut"):
                for _ in range(args.flips):
                    cases.append(checkpoint_case(checkpoints, work, relative, damage, rng))
        dataset = make_dataset(work / "pristine_data")
        cases += [nan_case(dataset, work, rng) for _ in range(args.nan_frames)]
        export = make_export(work / "pristine_export")
        cases += [export_case(export, work, rng) for _ in range(args.export_flips)]
    table = Counter((c["kind"], c["outcome"]) for c in cases)
    kinds = sorted({c["kind"] for c in cases})
    print(f"{'kind':<18}{'cases':>7}{'recovered':>11}{'named':>7}{'silent':>8}")
    for kind in kinds:
        n = sum(v for (k, _), v in table.items() if k == kind)
        print(
            f"{kind:<18}{n:>7}{table[(kind, 'recovered')]:>11}{table[(kind, 'named')]:>7}{table[(kind, 'silent')]:>8}"
        )
    silent = [c for c in cases if c["outcome"] == "silent"]
    print(f"{len(cases)} cases in {time.perf_counter() - start:.0f} s; silent: {len(silent)}")
    for case in silent[:10]:
        print(f"  SILENT {case}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seed": args.seed, "cases": cases}, indent=1))
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
