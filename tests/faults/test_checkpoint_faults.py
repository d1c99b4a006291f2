"""Checkpoint corruption at every file of a checkpoint, and NaN weights that must never be written.

Each file of a saved checkpoint (every .distcp shard, .metadata, trainer.pt, the RNG file, the
manifest) is deleted, truncated, garbled or has one bit flipped in turn (same-size damage is caught by
the manifest's sha256 of every file): `resolve("auto")` skips the damaged checkpoint,
names it and the file, and falls back to the previous intact one; an explicit path to it fails with
DamagedCheckpointError naming the file; `load` of the fallback restores the right step (issue 10
items 2, 5).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from vla.training.checkpoint import (
    CheckpointError,
    CheckpointManager,
    DamagedCheckpointError,
    NonFiniteWeightsError,
)
from vla.training.export import write_safetensors

pytestmark = pytest.mark.timeout(120)


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with two intact checkpoints (steps 1 and 2)."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    manager = CheckpointManager(root, keep_last=None)
    model, opt = _model_and_optimizer()
    for step in (1, 2):
        _train_step(model, opt, step)
        manager.save(step, model, opt, trainer_state={"step": step, "marker": f"step {step}"})
    return root


def _files(checkpoint: Path) -> list[str]:
    return sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())


def test_the_checkpoint_has_the_files_this_suite_damages(pristine: Path) -> None:
    files = _files(pristine / "step_00000002")
    assert "manifest.json" in files and "trainer.pt" in files and "rng/rank_00000.pt" in files
    assert "model_optim/.metadata" in files and any(f.endswith(".distcp") for f in files)


def _damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "delete":
        file.unlink()
    elif how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "garble":  # same size, different content
        file.write_bytes(bytes(b ^ 0xFF for b in data))
    elif how == "flip":  # one bit at a seeded offset: only the checksum can tell
        offset = random.Random(f"{file.name}-{len(data)}").randrange(len(data))
        file.write_bytes(data[:offset] + bytes([data[offset] ^ 0x40]) + data[offset + 1 :])


# Same-size damage (garble, a flipped bit) of a shard is found by its sha256 in the manifest.
CASES = [
    (name, how)
    for name in (
        "manifest.json",
        "model_optim/.metadata",
        "trainer.pt",
        "rng/rank_00000.pt",
        "model_optim/*.distcp",
    )
    for how in ("delete", "truncate", "empty", "garble", "flip")
    if not (name == "manifest.json" and how == "flip")  # a flipped bit in JSON may still parse: below
]


@pytest.mark.parametrize(("name", "how"), CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_a_damaged_newest_checkpoint_is_skipped_and_named(pristine: Path, tmp_path: Path, name, how) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(pristine, root)
    newest = root / "step_00000002"
    targets = sorted(newest.glob(name))
    assert targets, name
    for target in targets:
        _damage(target, how)
    manager = CheckpointManager(root, keep_last=None)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.resolve("auto") == root / "step_00000001"
    assert [p.name for p, _ in manager.skipped] == ["step_00000002"]
    reason = manager.skipped[0][1]
    assert str(targets[0]) in reason or (name == "manifest.json" and "manifest.json" in reason), reason
    assert any("resume=auto skips step_00000002" in str(w.message) for w in caught)

    with pytest.raises(DamagedCheckpointError) as info:
        manager.resolve(str(newest))
    assert str(targets[0]) in str(info.value) and info.value.file == targets[0]
    assert str(root / "step_00000001") in str(info.value) and "trainer.resume=auto" in str(info.value)

    model, opt = _model_and_optimizer()
    with pytest.warns(UserWarning, match="resume=auto skips step_00000002"):
        state = manager.load(manager.resolve("auto"), model, opt)
    assert state["marker"] == "step 1"


def test_every_byte_of_a_shard_is_covered_by_its_checksum(pristine: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(pristine, root)
    newest = root / "step_00000002"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert (
        manifest["version"] == 3
        and manifest["checksum_s"] >= 0
        and manifest["self_digest"].startswith("xxh3_128:")
    )
    assert all(entry["digest"].startswith("xxh3_128:") for entry in manifest["files"].values())
    assert set(manifest["files"]) == set(_files(newest)) - {"manifest.json"}
    (shard,) = newest.glob("model_optim/*.distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # the last byte: a tensor's lowest mantissa bit
    shard.write_bytes(bytes(data))
    manager = CheckpointManager(root, keep_last=None)
    with pytest.warns(UserWarning, match="resume=auto skips step_00000002.*does not match its checksum"):
        assert manager.resolve("auto") == root / "step_00000001"
    model, opt = _model_and_optimizer()
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        manager.load(newest, model, opt)  # an explicit load reads the checksums too


def test_a_version_2_manifest_without_its_own_digest_still_loads(pristine: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(pristine, root)
    newest = root / "step_00000002"
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["version"] = 2  # file digests, written before manifests carried their own
    del manifest["self_digest"]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    assert CheckpointManager(root, keep_last=None).resolve("auto") == newest


def test_a_checkpoint_without_checksums_still_loads_with_a_warning(pristine: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(pristine, root)
    newest = root / "step_00000002"
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["version"] = 1  # as written before checksums: sizes only, no digest of its own
    del manifest["self_digest"]
    manifest["files"] = {name: entry["bytes"] for name, entry in manifest["files"].items()}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    manager = CheckpointManager(root, keep_last=None)
    with pytest.warns(UserWarning, match="records no checksums"):
        assert manager.resolve("auto") == newest
    model, opt = _model_and_optimizer()
    assert manager.load(newest, model, opt)["marker"] == "step 2"


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(pristine: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(pristine, root)
    for step in (1, 2):
        (root / f"step_{step:08d}" / "trainer.pt").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            DamagedCheckpointError, match=r"every checkpoint under .* is damaged.*trainer\.pt"
        ):
            CheckpointManager(root).resolve("auto")


def test_nan_weights_are_never_saved_or_exported(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints")
    model, opt = _model_and_optimizer()
    _train_step(model, opt, 1)
    manager.save(1, model, opt)
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    with pytest.raises(CheckpointError, match=r"saving step 2.*2\.bias holds 1 non-finite value"):
        manager.save(2, model, opt)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]
    # EMA / extra state is checked too.
    with torch.no_grad():
        model[2].bias[1] = 0.0
    shadow = {"ema": {"0.weight": torch.full((8, 4), float("inf"))}}
    with pytest.raises(CheckpointError, match=r"extra\.ema\.0\.weight holds 32 non-finite"):
        manager.save(3, model, opt, extra_state=shadow)
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    export = tmp_path / "policy.safetensors"
    with pytest.raises(
        NonFiniteWeightsError, match=r"exporting .*policy\.safetensors: 0\.weight holds 1 non-finite"
    ):
        write_safetensors(model.state_dict(), export, {"format": "pt"})
    assert not export.exists() and list(tmp_path.glob(".policy*")) == []


def test_the_finite_check_reads_every_chunk_of_large_and_strided_tensors(monkeypatch) -> None:
    """The check runs chunk by chunk (its temporaries stay small at pi0's full size): a NaN in the last
    chunk, or in a non-contiguous view, is still found."""
    from vla.training.checkpoint import errors

    monkeypatch.setattr(errors, "_FINITE_CHUNK", 7)
    tensor = torch.zeros(10, 5)
    errors.check_finite_tensors({"w": tensor, "t": tensor.t()}, "saving")
    tensor[9, 4] = float("-inf")  # the last element: the 8th chunk of 7
    with pytest.raises(
        NonFiniteWeightsError, match=r"saving: w holds 1 non-finite value\(s\) \(NaN/inf\) of 50"
    ):
        errors.check_finite_tensors({"w": tensor}, "saving")
    with pytest.raises(NonFiniteWeightsError, match=r"saving: t holds 1 non-finite"):
        errors.check_finite_tensors({"t": tensor.t()}, "saving")


def test_a_damaged_export_is_named_not_a_raw_safetensors_error(tmp_path: Path) -> None:
    from vla.checksums import check_sidecar, sidecar
    from vla.eval.exported import DamagedExportError
    from vla.eval.policy_runner import load_exported_policy
    from vla.models import build_policy
    from vla.training.export import write_export
    from vla.training.loop import _load_weights

    torch.manual_seed(0)
    policy = build_policy("pi0_tiny")
    path = write_export(policy.state_dict(), policy.config, tmp_path)
    assert check_sidecar(path) is True and sidecar(path).read_text().endswith(f"  {path.name}\n")
    assert load_exported_policy(path) is not None
    pristine = path.read_bytes()

    flipped = bytearray(pristine)
    flipped[-3] ^= 0x40  # inside the last tensor: the header still parses, only the digest can tell
    path.write_bytes(bytes(flipped))
    for load in (load_exported_policy, lambda p: _load_weights(build_policy("pi0_tiny"), str(p), "auto")):
        with pytest.raises(DamagedExportError, match=rf"{path} is damaged: its sha256 differs"):
            load(path)

    sidecar(path).unlink()  # a file with no digest: a truncation is still named, not a raw SafetensorError
    path.write_bytes(pristine[: len(pristine) // 2])
    with pytest.raises(DamagedExportError, match=rf"{path}.*truncated or damaged"):
        load_exported_policy(path)
    with pytest.raises(DamagedExportError, match=r"model\.weights=.*truncated or damaged"):
        _load_weights(build_policy("pi0_tiny"), str(path), "auto")


def _export_inputs() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A small state dict (with a tied pair) and an export-like header of several entries."""
    weight = torch.arange(12.0).reshape(3, 4)
    state = {
        "w": weight,
        "w_tied": weight,
        "b": torch.ones(4),
        "scale": torch.tensor([0.5], dtype=torch.bfloat16),
    }
    config = {"name": 'a "quoted" name', "unicode": "café ✓", "control": "tab\there", "sizes": [1, 2, 3]}
    header = {"format": "pt", "vla.layout": "vla", "policy_config": json.dumps(config, sort_keys=True)}
    header.update({f"entry_{i}": str(i) * i for i in range(1, 7)})
    return state, header


def test_an_export_is_the_same_bytes_however_often_it_is_written(tmp_path: Path) -> None:
    """safetensors writes its metadata map in a random order on every write (safetensors#584), so the
    same weights exported twice had two sha256s; the export sorts it, keeping every entry and offset."""
    from safetensors import safe_open

    from vla.training.export import write_safetensors

    state, header = _export_inputs()
    paths = [write_safetensors(state, tmp_path / f"export_{i}.safetensors", header) for i in range(8)]
    assert len({p.read_bytes() for p in paths}) == 1
    with safe_open(str(paths[0]), framework="pt") as f:
        assert f.metadata() == {**header, "tied": json.dumps({"w_tied": "w"})}
        assert sorted(f.keys()) == ["b", "scale", "w"]
        assert torch.equal(f.get_tensor("w"), state["w"]) and f.get_tensor("scale").dtype == torch.bfloat16
    raw = paths[0].read_bytes()
    length = int.from_bytes(raw[:8], "little")
    assert list(json.loads(raw[8 : 8 + length])["__metadata__"]) == sorted([*header, "tied"])


_REWRITE_EXPORT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_checkpoint_faults import _export_inputs
from vla.checksums import write_sidecar
from vla.training.export import _write_lerobot_model, write_safetensors
state, header = _export_inputs()
for _ in range(int(sys.argv[2])):
    path = write_safetensors(state, Path(sys.argv[1]), header)
    write_sidecar(path)
    _write_lerobot_model(path.parent / "pretrained_model", path, {"type": "pi0"})
"""


def test_an_export_rewritten_by_other_processes_always_verifies(tmp_path: Path) -> None:
    """Two evaluations of one checkpoint both export it to the same directory while a third reads it:
    the file and its .sha256 must agree whenever they are read (they did not when the bytes depended
    on the write, and both writers shared one temporary sidecar name), and LeRobot's link to the file
    is replaced in one rename (an unlink then a link could collide)."""
    import subprocess
    import sys
    import time

    from vla.checksums import check_sidecar, write_sidecar
    from vla.training.export import write_safetensors

    state, header = _export_inputs()
    path = tmp_path / "policy.safetensors"
    write_sidecar(write_safetensors(state, path, header))
    here = str(Path(__file__).parent)
    writers = [
        subprocess.Popen([sys.executable, "-c", _REWRITE_EXPORT, str(path), "60", here]) for _ in range(2)
    ]
    checks, deadline = 0, time.monotonic() + 120
    try:
        while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
            assert check_sidecar(path) is True, f"check {checks}: {path} disagrees with its .sha256"
            checks += 1
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
            w.wait(timeout=30)
    assert [w.returncode for w in writers] == [0, 0] and checks > 10
    lerobot = tmp_path / "pretrained_model"
    assert (lerobot / "model.safetensors").read_bytes() == path.read_bytes()
    assert json.loads((lerobot / "config.json").read_text()) == {"type": "pi0"}
    assert not list(tmp_path.rglob(".*tmp*"))  # no temporary file left behind
