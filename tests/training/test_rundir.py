"""vla.training.rundir: a fresh run never overwrites an earlier one (issue 18 item 1)."""

from __future__ import annotations

import pytest

from vla.training.rundir import RunDirectoryError, claim_run_directory, earlier_run
from vla.training.runlock import LOCK_FILE


def _a_run(directory):
    (directory / "checkpoints" / "step_00000002").mkdir(parents=True)
    (directory / "checkpoints" / "step_00000002" / "manifest.json").write_text("{}")
    (directory / "metrics.jsonl").write_text('{"step": 1}\n')
    (directory / "policy.safetensors").write_bytes(b"weights")
    (directory / "config.yaml").write_text("trainer: {}\n")
    (directory / LOCK_FILE).write_text("{}")
    (directory / ".hydra").mkdir()


def test_an_empty_or_new_directory_is_free(tmp_path) -> None:
    assert claim_run_directory(tmp_path / "new", resume="none", overwrite=False) is None
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)  # an empty checkpoints dir holds no run
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "empty" / ".hydra").mkdir()
    assert earlier_run(tmp_path / "empty") == []
    assert claim_run_directory(tmp_path / "empty", resume="none", overwrite=False) is None


def test_an_earlier_run_is_refused_with_the_choices(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _a_run(run)
    with pytest.raises(RunDirectoryError) as info:
        claim_run_directory(run, resume="none", overwrite=False)
    message = str(info.value)
    assert "checkpoints, policy.safetensors, metrics.jsonl" in message
    for choice in ("trainer.resume=auto", "output_dir=", "trainer.overwrite=true"):
        assert choice in message
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    # A resume continues the run that is there: not this module's business.
    assert claim_run_directory(run, resume="auto", overwrite=False) is None


def test_overwrite_moves_the_earlier_run_aside_and_deletes_nothing(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _a_run(run)
    line = claim_run_directory(run, resume="none", overwrite=True)
    aside = next(tmp_path.glob("run.replaced-*"))
    assert line is not None and str(aside) in line
    assert sorted(p.name for p in run.iterdir()) == [".hydra", LOCK_FILE]
    assert sorted(p.name for p in aside.iterdir()) == [
        "checkpoints", "config.yaml", "metrics.jsonl", "policy.safetensors",
    ]  # fmt: skip
    assert (aside / "policy.safetensors").read_bytes() == b"weights"
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # a second overwrite gets a directory of its own
    claim_run_directory(run, resume="none", overwrite=True)
    assert len(list(tmp_path.glob("run.replaced-*"))) == 2
