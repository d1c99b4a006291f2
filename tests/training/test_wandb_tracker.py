"""trainer.tracker=wandb in offline mode: the same numbers as metrics.jsonl, one wandb run per run dir."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from _trainer_runs import metrics, run_in_process, tiny_overrides

pytest.importorskip("wandb", reason="the [wandb] extra (in [dev]) brings wandb")


def _records(path: Path) -> list[bytes]:
    """The protobuf records of an offline .wandb file (LevelDB-log framing: 32 KiB blocks of
    crc32 / length / type chunks, after a 7-byte header)."""
    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, partial, pos = [], b"", 7
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        chunk = data[pos + header : pos + header + length]
        pos += header + length
        if kind == 1:  # full
            records.append(chunk)
        elif kind == 2:  # first
            partial = chunk
        elif kind == 3:  # middle
            partial += chunk
        elif kind == 4:  # last
            records.append(partial + chunk)
    return records


def _history(run_dir: Path) -> tuple[str, dict[int, dict[str, float]]]:
    from wandb.proto import wandb_internal_pb2 as pb

    (file,) = run_dir.glob("run-*.wandb")
    run_id, history = "", {}
    for raw in _records(file):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history[int(items["_step"])] = items
    return run_id, history


def test_wandb_offline_logs_what_metrics_jsonl_holds_and_resume_continues_the_run(
    synthetic_dataset, tmp_path
) -> None:
    from vla.training.tracking import wandb_run_id

    output = tmp_path / "run"
    common = ["trainer.tracker=wandb", "trainer.wandb_mode=offline", "trainer.checkpoint_every=2"]
    run_in_process(tiny_overrides(synthetic_dataset, output, "trainer.steps=2", *common))
    assert not (output / "tb").exists()  # wandb alone: no TensorBoard
    (first,) = (output / "wandb").glob("offline-run-*")
    run_id, history = _history(first)
    assert run_id == wandb_run_id(output)
    train = metrics(output)
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert history[record["step"]]["train/loss"] == record["loss"]
        assert history[record["step"]]["train/lr"] == record["lr"]
    run_in_process(
        tiny_overrides(synthetic_dataset, output, "trainer.steps=4", "trainer.resume=auto", *common)
    )
    runs = sorted((output / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    resumed_id, resumed = _history(next(r for r in runs if r != first))
    assert resumed_id == run_id  # the same wandb run, continued
    assert sorted(resumed) == [3, 4] and resumed[4]["train/loss"] == metrics(output)[-1]["loss"]
