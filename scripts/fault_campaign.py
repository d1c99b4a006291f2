"""A seeded fault campaign: generated damage, and whether each case ends in a correct recovery or a
clear error (never a silent wrong result).

    python scripts/fault_campaign.py [--seed 0] [--flips 24] [--nan-frames 50] [--export-flips 30]
                                     [--kills 12] [--disk-full 24] [--races 8] [--stalls 3]
                                     [--json out/campaign.json]

Cases (on small artefacts made at the start; kills and stalls in child processes):
  checkpoint_flip   one bit flipped at a random offset of each file of the newest of two checkpoints
                    (--flips offsets per file). Correct: resume=auto falls back to the older one and
                    names the file; an explicit load of the damaged one fails naming it.
  checkpoint_cut    each file of the newest checkpoint truncated at a random length (--flips per file).
                    Correct: the same.
  nan_frame         NaN or inf written into a random (episode, frame, key, dim) of a dataset's parquet.
                    Correct: the data scan names exactly that file, episode, frame and key.
  export_flip       one bit flipped at a random offset of an exported policy.safetensors. Correct: the
                    loader refuses it naming the file (DamagedExportError).
  kill_save         a process saving checkpoints in a loop is killed -9 after a random (seeded) delay.
                    Correct: resume=auto picks the newest checkpoint it reported saved (or the one it
                    was publishing), its weights are exactly that step's, and no partial save is visible.
  disk_full         ENOSPC ("No space left on device") at a random byte of a checkpoint save, an export
                    or a dataset generation. Correct: an OSError(ENOSPC) naming the directory, the
                    previous checkpoint / export intact and chosen, no partial file or staging dir left.
  race              two generators of one dataset root at the same moment, with the same or (seeded)
                    different settings. Correct: same settings, both use one dataset; different, one
                    wins and the other refuses naming the difference; the marker is the winner's.
  stall             the video encoder stops making progress at a random call while a dataset is
                    generated. Correct: the process ends within the bound, naming the file, and leaves
                    no staging directory.
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
from vla.training.user_errors import disk_full_error  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flips", type=int, default=24, help="offsets per checkpoint file (flips and cuts)")
    parser.add_argument("--nan-frames", type=int, default=50)
    parser.add_argument("--export-flips", type=int, default=30)
    parser.add_argument("--kills", type=int, default=12, help="kill -9 during checkpoint saves")
    parser.add_argument("--disk-full", type=int, default=24, help="ENOSPC points (save, export, dataset)")
    parser.add_argument("--races", type=int, default=8, help="racing dataset generators")
    parser.add_argument("--stalls", type=int, default=3, help="stalled video encoders")
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


# -- kill -9 during checkpoint saves ---------------------------------------------------------------

_SAVER = """
import sys, torch
from torch import nn
from vla.training.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1], keep_last=2)
model = nn.Linear(64, 64)
for step in range(1, 1000):
    with torch.no_grad():
        model.weight.fill_(float(step))
        model.bias.fill_(-float(step))
    manager.save(step, model, trainer_state={"step": step})
    print(step, flush=True)
"""


def kill_case(work: Path, rng: random.Random) -> dict[str, Any]:
    import signal
    import subprocess

    root = work / "kill"
    shutil.rmtree(root, ignore_errors=True)
    delay = rng.uniform(0.0, 1.5)
    process = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    reported: list[int] = []
    first = process.stdout.readline() if process.stdout else ""  # the first save is done: start the clock
    if first.strip():
        reported.append(int(first))
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    out, _ = process.communicate(timeout=60)
    reported += [int(line) for line in out.split() if line.strip()]
    case = {"kind": "kill_save", "file": "step_*", "at": round(delay, 3)}
    last = max(reported, default=0)
    manager = CheckpointManager(root, keep_last=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            chosen = manager.resolve("auto")
        except (CheckpointError, DamagedCheckpointError) as exc:
            return {**case, "outcome": "named", "detail": str(exc)[:200]}
    if chosen is None:
        return {**case, "outcome": "silent", "detail": f"no checkpoint found after {last} reported saves"}
    step = int(chosen.name.split("_")[-1])
    model = nn.Linear(64, 64)
    manager.load(chosen, model)
    exact = bool((model.weight == step).all() and (model.bias == -step).all())
    visible = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    ok = (
        exact
        and step in (last, last + 1)
        and all(manager.verify(root / name) is not None for name in visible)
    )
    detail = f"reported {last}, resumed {step}, exact {exact}, visible {visible}"
    return {**case, "outcome": "recovered" if ok else "silent", "detail": detail}


# -- disk full -------------------------------------------------------------------------------------


class _DiskFull:
    """Patch builtins.open (and safetensors' writer) so that writes fail with ENOSPC once `budget` bytes
    were written in total, as a filling disk does."""

    def __init__(self, budget: int) -> None:
        self.budget, self.written = budget, 0

    def __enter__(self) -> _DiskFull:
        import builtins
        import io

        import safetensors.torch

        # Imported (and every original looked up) before anything is patched: a first import inside the
        # window would bind the patched save_file into vla.models.weights for good, and a failed lookup
        # after open is patched would leave every later write in the process "full".
        import vla.models.weights as weights_module

        self._open, self._save = builtins.open, safetensors.torch.save_file
        self._module_save = weights_module.save_file
        self._io_open = io.open
        owner = self

        class Writer:
            def __init__(self, file: Any) -> None:
                self._file = file

            def write(self, data: Any) -> int:
                size = len(data) if not isinstance(data, memoryview) else data.nbytes
                if owner.written + size > owner.budget:
                    owner._raise(getattr(self._file, "name", "?"))
                owner.written += size
                return self._file.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._file, name)

            def __enter__(self) -> Writer:
                return self

            def __exit__(self, *exc: Any) -> None:
                self._file.close()

            def __iter__(self):
                return iter(self._file)

        def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = owner._open(file, mode, *args, **kwargs)
            return Writer(handle) if any(c in mode for c in "wax+") else handle

        def saving(tensors: Any, filename: str, metadata: Any = None) -> None:
            owner._save(tensors, filename, metadata=metadata)
            size = Path(filename).stat().st_size
            if owner.written + size > owner.budget:
                keep = max(0, owner.budget - owner.written)
                with owner._open(filename, "r+b") as f:
                    f.truncate(keep)
                owner._raise(filename)
            owner.written += size

        builtins.open = io.open = opening  # io.open: what pathlib (and DCP's file system writer) call
        safetensors.torch.save_file = saving
        weights_module.save_file = saving  # where exports and save_pi0_weights call it
        return self

    def _raise(self, name: str) -> None:
        import errno
        import os

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)

    def __exit__(self, *exc: Any) -> None:
        import builtins
        import io

        import safetensors.torch

        import vla.models.weights as weights_module

        builtins.open, safetensors.torch.save_file = self._open, self._save
        io.open = self._io_open
        weights_module.save_file = self._module_save


class _FullAtCall:
    """ENOSPC at the `at`-th write call (0-based) of a dataset: parquet tables, video packets, JSON."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def _tick(self, name: str) -> None:
        if self.calls == self.at:
            import errno
            import os

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        self.calls += 1

    def __enter__(self) -> _FullAtCall:
        import pyarrow.parquet as parquet

        from vla.data import video

        owner = self
        self._saved = (
            parquet.write_table,
            parquet.ParquetWriter.write_table,
            video.VideoEncoder._mux,
            Path.write_text,
        )
        write_table, writer_table, mux, write_text = self._saved

        def table(table: Any, where: Any, *args: Any, **kwargs: Any) -> Any:
            owner._tick(str(where))
            return write_table(table, where, *args, **kwargs)

        def writer(self: Any, *args: Any, **kwargs: Any) -> Any:
            owner._tick("parquet file")
            return writer_table(self, *args, **kwargs)

        def packets(self: Any, *args: Any, **kwargs: Any) -> Any:
            owner._tick(str(getattr(self, "path", "video")))
            return mux(self, *args, **kwargs)

        def text(self: Path, *args: Any, **kwargs: Any) -> Any:
            owner._tick(str(self))
            return write_text(self, *args, **kwargs)

        parquet.write_table, parquet.ParquetWriter.write_table = table, writer
        video.VideoEncoder._mux, Path.write_text = packets, text
        return self

    def __exit__(self, *exc: Any) -> None:
        import pyarrow.parquet as parquet

        from vla.data import video

        parquet.write_table, parquet.ParquetWriter.write_table, video.VideoEncoder._mux, Path.write_text = (
            self._saved
        )


def _bytes_written(action: Any) -> int:
    with _DiskFull(budget=1 << 62) as meter:
        action()
    return meter.written


def disk_full_case(work: Path, rng: random.Random, target: str) -> dict[str, Any]:
    root = work / "full"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # its DCP shard (256 KiB) outweighs the RNG and trainer files
    if target == "checkpoint":
        manager = CheckpointManager(root / "checkpoints", keep_last=None)
        manager.save(1, model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)

        def action() -> None:
            manager.save(2, model)

        probe_root = work / "probe"
        shutil.rmtree(probe_root, ignore_errors=True)
        probe = CheckpointManager(probe_root, keep_last=None)
        total = _bytes_written(lambda: probe.save(2, model))
    elif target == "export":
        from vla.models import build_policy
        from vla.training.export import write_export

        policy = build_policy("pi0_tiny")
        first = write_export(policy.state_dict(), policy.config, root)
        before_bytes = first.read_bytes()
        with torch.no_grad():
            next(policy.parameters()).add_(1.0)

        def action() -> None:
            write_export(policy.state_dict(), policy.config, root)

        probe_root = work / "probe"
        shutil.rmtree(probe_root, ignore_errors=True)
        probe_root.mkdir(parents=True)
        total = _bytes_written(lambda: write_export(policy.state_dict(), policy.config, probe_root))
    else:
        from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset

        config = SyntheticConfig(episodes=2, episode_length=8, image_size=32)
        dataset = root / "synthetic"

        def action() -> None:
            ensure_synthetic_dataset(dataset, config)

        # pyarrow and PyAV write from C: count their write calls instead of bytes.
        with _FullAtCall(1 << 62) as meter:
            ensure_synthetic_dataset(work / "probe_data" / str(rng.random()), config)
        total = meter.calls
    budget = rng.randrange(max(1, total))
    case = {"kind": "disk_full", "file": target, "at": budget}
    full_disk = _FullAtCall(budget) if target == "dataset" else _DiskFull(budget)
    try:
        with full_disk:
            action()
    except BaseException as exc:
        full = disk_full_error(exc)
        if full is None:
            return {**case, "outcome": "silent", "detail": f"not an ENOSPC error: {exc!r}"[:200]}
        error = f"{exc} {full}"
    else:
        return {**case, "outcome": "silent", "detail": f"no error with {budget} of {total} bytes"}
    leftovers = [
        p.name for p in root.rglob("*") if p.name.startswith((".tmp", ".trash")) or ".tmp-" in p.name
    ]
    if target == "checkpoint":
        manager = CheckpointManager(root / "checkpoints", keep_last=None)
        chosen = manager.resolve("auto")
        restored = nn.Linear(256, 256)
        manager.load(chosen, restored)
        intact = (
            chosen is not None
            and chosen.name == "step_00000001"
            and all(torch.equal(restored.state_dict()[k], v) for k, v in before.items())
        )
    elif target == "export":
        intact = first.read_bytes() == before_bytes
    else:
        intact = not dataset.exists() and not any(p.name.startswith(".") for p in root.iterdir())
    ok = intact and not leftovers
    detail = f"{error[:150]}; previous intact {intact}; leftovers {leftovers[:3]}"
    return {**case, "outcome": "named" if ok else "silent", "detail": detail}


# -- racing generators -----------------------------------------------------------------------------


def race_case(work: Path, rng: random.Random) -> dict[str, Any]:
    import threading

    from vla.data.errors import DatasetError
    from vla.data.generated import lock_path, read_marker
    from vla.data.synthetic import MARKER_PATH, SyntheticConfig, ensure_synthetic_dataset

    root = work / "race" / "synthetic"
    shutil.rmtree(root.parent, ignore_errors=True)
    root.parent.mkdir(parents=True)
    same = rng.random() < 0.5
    seeds = (0, 0) if same else (0, rng.randrange(1, 100))
    configs = [SyntheticConfig(episodes=2, episode_length=8, image_size=32, seed=s) for s in seeds]
    outcomes: list[BaseException | None] = [None, None]
    barrier = threading.Barrier(2)

    def generate(i: int) -> None:
        barrier.wait()
        try:
            ensure_synthetic_dataset(root, configs[i])
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    case = {"kind": "race", "file": "same settings" if same else f"seeds {seeds}", "at": None}
    failed = [o for o in outcomes if o is not None]
    clean = not lock_path(root).exists() and sorted(p.name for p in root.parent.iterdir()) == ["synthetic"]
    if same:
        ok = not failed and (root / "meta" / "info.json").is_file() and clean
        return {**case, "outcome": "recovered" if ok else "silent", "detail": f"errors {failed}"[:200]}
    winner = configs[0] if outcomes[0] is None else configs[1]
    ok = (
        len(failed) == 1
        and isinstance(failed[0], DatasetError)
        and "seed" in str(failed[0])
        and read_marker(root, MARKER_PATH)["config"]["seed"] == winner.seed
        and clean
    )
    return {**case, "outcome": "named" if ok else "silent", "detail": f"errors {failed}"[:200]}


# -- stalled encoders ------------------------------------------------------------------------------

_STALLER = """
import sys, time
from vla.data import video
from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset
calls = {"n": 0}
original = video.VideoEncoder._mux
def stalling(self, packets):
    calls["n"] += 1
    if calls["n"] == int(sys.argv[2]):
        time.sleep(1000)
    return original(self, packets)
video.VideoEncoder._mux = stalling
ensure_synthetic_dataset(sys.argv[1], SyntheticConfig(episodes=2, episode_length=8, image_size=32))
print("not reached")
"""


def stall_case(work: Path, rng: random.Random) -> dict[str, Any]:
    import os
    import subprocess

    home = work / "stall"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    at = rng.randint(1, 8)
    env = {**os.environ, "VLA_ENCODER_STALL_S": "2", "HOME": str(home)}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _STALLER, str(home / "synthetic"), str(at)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    elapsed = time.monotonic() - start
    case = {"kind": "stall", "file": "encoder call", "at": at}
    left = sorted(p.name for p in home.iterdir() if p.name != ".cache")
    if result.returncode == 0 and "not reached" in result.stdout:
        # Fewer encoder calls than `at`: nothing stalled, the dataset must be complete.
        ok = (home / "synthetic" / "meta" / "info.json").is_file()
        return {**case, "outcome": "recovered" if ok else "silent", "detail": "no stall reached"}
    ok = (
        result.returncode == 1
        and "video encoder stalled" in result.stderr
        and ".mp4" in result.stderr
        and not left
        and elapsed < 90
    )
    detail = f"rc {result.returncode} in {elapsed:.0f} s; left {left}; {result.stderr[-150:]}"
    return {**case, "outcome": "named" if ok else "silent", "detail": detail}


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
        cases += [kill_case(work, rng) for _ in range(args.kills)]
        targets = ("checkpoint", "export", "dataset")
        cases += [disk_full_case(work, rng, targets[i % 3]) for i in range(args.disk_full)]
        cases += [race_case(work, rng) for _ in range(args.races)]
        cases += [stall_case(work, rng) for _ in range(args.stalls)]
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
