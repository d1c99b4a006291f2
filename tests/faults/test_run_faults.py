"""The trainer under run-level faults, in this process with pi0_tiny (issue 10 items 3, 6, 8, 10):
two writers on one output_dir, a stale lock, an output_dir that is a file, resumes that change the
trajectory or the dataset, `steps` below the checkpoint, duplicate metrics of re-run steps, NaN
validation loss / open-loop error, and the skipped-steps count of nan_policy=skip.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest
from _trainer_runs import losses, metrics, run_in_process, summary, tiny_overrides

from vla.training.guards import NonFiniteMetricError
from vla.training.resume import ResumeMismatchError
from vla.training.rundir import RunDirectoryError
from vla.training.runlock import LOCK_FILE, RunLock, RunLockError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_second_writer_fails_naming_the_holder_and_a_stale_lock_is_taken_over(
    synthetic_dataset, tmp_path
) -> None:
    out = tmp_path / "run"
    holder = RunLock(out)
    holder.acquire()
    try:
        with pytest.raises(RunLockError) as info:
            run_in_process(tiny_overrides(synthetic_dataset, out, "trainer.steps=2"))
        message = str(info.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "another output_dir" in message and str(out / LOCK_FILE) in message
        assert not (out / "checkpoints").exists()  # nothing was written by the second run
    finally:
        holder.release()
    assert not (out / LOCK_FILE).exists()

    # A lock left by a process that died (kill -9 leaves the file; the flock went with the process).
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    (out / LOCK_FILE).write_text(json.dumps({"pid": dead_pid, "host": socket.gethostname(), "started": "x"}))
    with pytest.warns(UserWarning, match=rf"taking over the stale lock of pid {dead_pid}"):
        result = run_in_process(tiny_overrides(synthetic_dataset, out, "trainer.steps=2"))
    assert result.steps == 2 and result.status == "finished"
    assert not (out / LOCK_FILE).exists()  # released at the end

    # A holder on another host cannot be checked from here: refused, with the fix.
    (out / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "x"}))
    with pytest.raises(RunLockError, match=rf"pid 1 on host elsewhere.*delete {out / LOCK_FILE}"):
        run_in_process(tiny_overrides(synthetic_dataset, out, "trainer.steps=2"))


def test_an_output_dir_that_is_a_file_is_a_clear_error(synthetic_dataset, tmp_path) -> None:
    file = tmp_path / "run"
    file.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match=rf"output_dir='{file}' is a file, not a directory"):
        run_in_process(tiny_overrides(synthetic_dataset, file, "trainer.steps=2"))
    with pytest.raises(NotADirectoryError, match=rf"cannot be created: {file} is a file"):
        run_in_process(tiny_overrides(synthetic_dataset, file / "sub", "trainer.steps=2"))


def test_resume_refuses_trajectory_changes_and_other_data_and_keeps_metrics_unique(
    synthetic_dataset, tmp_path, capsys
) -> None:
    out = tmp_path / "run"
    common = ["trainer.checkpoint_every=2", "trainer.val_every=100"]
    run_in_process(tiny_overrides(synthetic_dataset, out, "trainer.steps=4", *common))
    config_before = (out / "config.yaml").read_text()

    with pytest.raises(ResumeMismatchError) as info:
        run_in_process(
            tiny_overrides(
                synthetic_dataset, out, "trainer.steps=6", "optim.adamw_lr=0.5", "trainer.seed=3",
                "trainer.resume=auto", *common,
            )
        )  # fmt: skip
    message = str(info.value)
    assert "optim.adamw_lr: 0.003 -> 0.5" in message and "trainer.seed: 0 -> 3" in message
    assert "another output_dir" in message and "trainer.steps" not in message
    assert (out / "config.yaml").read_text() == config_before  # a refused resume changes nothing
    assert not (out / LOCK_FILE).exists()  # released on the error path too

    with pytest.raises(ResumeMismatchError, match=r"trainer\.steps=3 is below the step .*step 4"):
        run_in_process(
            tiny_overrides(synthetic_dataset, out, "trainer.steps=3", "trainer.resume=auto", *common)
        )

    # Same size, other content (another seed): the fingerprint (a hash of meta/) tells them apart.
    from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset

    other = tmp_path / "other"
    ensure_synthetic_dataset(other, SyntheticConfig(episodes=8, episode_length=20, image_size=32, seed=1))
    with pytest.raises(ResumeMismatchError) as info:
        run_in_process(
            tiny_overrides(
                other, out, "trainer.steps=6", "trainer.resume=auto", "data.synthetic.seed=1", *common
            )
        )
    message = str(info.value)
    assert "data.synthetic.seed: 0 -> 1" in message
    assert f"the dataset at data.root='{other}' is not the one the checkpoint was trained on" in message
    assert "meta_sha256" in message and "total_frames" not in message  # same size

    # A moved copy of the same dataset is accepted; a re-run from step 2 leaves one record per step,
    # and a longer run logs what the new step count does to the schedule.
    moved = tmp_path / "moved"
    shutil.copytree(synthetic_dataset, moved)
    capsys.readouterr()
    result = run_in_process(
        tiny_overrides(
            moved, out, "trainer.steps=6", f"trainer.resume={out / 'checkpoints' / 'step_00000002'}",
            "trainer.log_every=1", *common,
        )
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert (result.status, result.steps) == ("finished", 6), printed
    assert "trainer.steps: 4 -> 6; applied: the cosine schedule now ends at step 6" in printed
    assert "dropped 4 record(s) of steps after 2" in printed  # train 3, 4 and the final val + eval
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))


def test_a_fresh_run_never_overwrites_an_earlier_one(synthetic_dataset, tmp_path) -> None:
    out = tmp_path / "run"
    common = ["trainer.checkpoint_every=2", "trainer.val_every=100"]
    run_in_process(tiny_overrides(synthetic_dataset, out, "trainer.steps=2", *common))
    files_before = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    with pytest.raises(RunDirectoryError, match=r"already holds a run \(checkpoints, policy\.safetensors"):
        run_in_process(tiny_overrides(synthetic_dataset, out, "trainer.steps=3", *common))
    after = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert after == files_before  # refused before anything was written (no metrics line, no tb file)

    # trainer.overwrite=true keeps the earlier run, moved aside whole.
    result = run_in_process(
        tiny_overrides(synthetic_dataset, out, "trainer.steps=3", "trainer.overwrite=true", *common)
    )
    assert result.steps == 3 and [r["step"] for r in metrics(out)] == [1, 2, 3]
    (aside,) = tmp_path.glob("run.replaced-*")
    assert [r["step"] for r in metrics(aside)] == [1, 2]
    assert (aside / "checkpoints" / "step_00000002").is_dir() and (aside / "policy.safetensors").is_file()

    # A run killed before its first checkpoint left records of steps 1-2 (as a kill -9 does);
    # restarted with resume=auto it starts over, and each step is recorded once.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "split": "train", "loss": 9.0}) + "\n" for s in (1, 2))
        + '{"step": 3, "spl'
    )
    run_in_process(
        tiny_overrides(
            synthetic_dataset, fresh, "trainer.steps=3", "trainer.checkpoint_every=5", "trainer.resume=auto"
        )
    )
    assert [r["step"] for r in metrics(fresh)] == [1, 2, 3] and 9.0 not in losses(fresh)


def test_a_resume_starts_from_the_runs_saved_configuration(synthetic_dataset, tmp_path) -> None:
    out = tmp_path / "run"
    run_in_process(
        tiny_overrides(
            synthetic_dataset, out, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.ema_decay=0.9"
        )
    )
    # Only the directory, the resume and the new length: model, data, optimizer and EMA come from config.yaml.
    result = run_in_process([f"output_dir={out}", "trainer.resume=auto", "trainer.steps=6"])
    assert (result.status, result.steps) == ("finished", 6)
    assert (
        "preset: pi0_tiny" in (out / "config.yaml").read_text()
        and "ema_decay: 0.9" in (out / "config.yaml").read_text()
    )
    with pytest.raises(ResumeMismatchError, match=r"optim\.adamw_lr: 0\.003 -> 0\.5"):
        run_in_process([f"output_dir={out}", "trainer.resume=auto", "trainer.steps=8", "optim.adamw_lr=0.5"])


def _tensorboard_steps(out) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_resume_at_the_last_step_records_every_evaluation_once(
    synthetic_dataset, tmp_path, monkeypatch
) -> None:
    # The export fails after the last checkpoint; the resume at that step re-runs only the export and
    # the final evaluations: each (step, kind) stays once, and the summary keeps the run's losses.
    import vla.training.export as export

    original = export.export_policy
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("No space left on device (simulated)")
        return original(*args, **kwargs)

    monkeypatch.setattr(export, "export_policy", failing_once)
    out = tmp_path / "run"
    common = ["trainer.steps=4", "trainer.checkpoint_every=2", "trainer.val_every=2"]
    with pytest.raises(OSError, match="No space left"):
        run_in_process(tiny_overrides(synthetic_dataset, out, *common))
    first_eval = metrics(out, "eval")
    assert [r["step"] for r in first_eval] == [4]  # the open-loop evaluation ran before the export
    result = run_in_process(tiny_overrides(synthetic_dataset, out, *common, "trainer.resume=auto"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["split"]) for r in rows]
    assert len(keys) == len(set(keys)), keys
    assert [r["step"] for r in metrics(out, "eval")] == [4] and [r["step"] for r in metrics(out, "val")] == [
        2,
        4,
    ]
    assert result.final_loss == losses(out)[-1] and result.val_loss == metrics(out, "val")[-1]["loss"]
    assert summary(out)["final_loss"] == losses(out)[-1]
    steps = _tensorboard_steps(out)
    assert steps["train/loss"] == [1, 2, 3, 4] and steps["val/loss"] == [2, 4], steps
    assert steps["eval/mse"] == [4], steps


def test_a_resume_with_another_model_lists_the_change_before_loading(synthetic_dataset, tmp_path) -> None:
    # Other shapes would fail inside DCP ("size mismatch"); the saved config is compared first.
    out = tmp_path / "run"
    common = ["trainer.checkpoint_every=2", "trainer.val_every=100"]
    run_in_process(tiny_overrides(synthetic_dataset, out, "trainer.steps=2", *common))
    files_before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(ResumeMismatchError) as info:
        run_in_process(
            tiny_overrides(
                synthetic_dataset, out, "trainer.steps=4", "trainer.resume=auto",
                "model.overrides={vision: {patch_size: 4}}", *common,
            )
        )  # fmt: skip
    message = str(info.value)
    assert "model.overrides: {} -> {'vision': {'patch_size': 4}}" in message, message
    assert "size mismatch" not in message and "another output_dir" in message
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == files_before  # no stray TensorBoard file


def _poison(monkeypatch, method: str, when) -> None:
    import torch

    from vla.models.pi0 import Pi0Policy

    original = getattr(Pi0Policy, method)

    def poisoned(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if not when(self):
            return out
        if isinstance(out, tuple):
            return (out[0] * float("nan"), *out[1:])
        return torch.full_like(out, float("nan"))

    monkeypatch.setattr(Pi0Policy, method, poisoned)


def test_nan_validation_loss_fails_after_saving_the_finite_weights(
    synthetic_dataset, tmp_path, monkeypatch
) -> None:
    _poison(monkeypatch, "compute_loss", lambda policy: not policy.training)  # validation only
    out = tmp_path / "run"
    with pytest.raises(
        NonFiniteMetricError, match=r"after step 2: validation loss = nan.*trainer\.val_batches=0"
    ):
        run_in_process(
            tiny_overrides(
                synthetic_dataset, out, "trainer.steps=6", "trainer.val_every=2", "trainer.checkpoint_every=5"
            )
        )
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]
    assert not (out / "policy.safetensors").exists() and not (out / "summary.json").exists()


def test_nan_open_loop_error_fails_without_an_export(synthetic_dataset, tmp_path, monkeypatch) -> None:
    _poison(monkeypatch, "sample_actions", lambda policy: True)
    out = tmp_path / "run"
    with pytest.raises(
        NonFiniteMetricError, match=r"after step 2: open-loop mse = nan.*No policy was exported"
    ):
        run_in_process(tiny_overrides(synthetic_dataset, out, "trainer.steps=2"))
    assert not (out / "policy.safetensors").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]


def test_skipped_steps_are_in_the_summary(synthetic_dataset, tmp_path, monkeypatch) -> None:
    calls = {"n": 0}

    def third_call(policy) -> bool:
        if policy.training:
            calls["n"] += 1
        return policy.training and calls["n"] == 3

    _poison(monkeypatch, "compute_loss", third_call)
    out = tmp_path / "run"
    result = run_in_process(
        tiny_overrides(
            synthetic_dataset,
            out,
            "trainer.steps=4",
            "trainer.nan_policy=skip",
            "trainer.max_skipped_steps=2",
        )
    )
    assert result.skipped_steps == 1 and summary(out)["skipped_steps"] == 1
    assert len(losses(out)) == 3 and all(math.isfinite(x) for x in losses(out))
