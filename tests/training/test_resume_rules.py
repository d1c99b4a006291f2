"""vla.training.resume.check_resume on hand-made saved configs: a setting the saved config predates is
taken at its default (so runs saved before a new option resume), anything else that changes the
trajectory is refused."""

from __future__ import annotations

import pytest

from vla.training.config import TrainConfig
from vla.training.resume import ResumeMismatchError, check_resume, flatten


def _saved(without: tuple[str, ...] = (), **changes) -> dict:
    saved = flatten(TrainConfig())
    for key in without:
        saved.pop(key)
    return {**saved, **changes}


def test_a_setting_newer_than_the_checkpoint_runs_at_its_default(tmp_path) -> None:
    cfg = TrainConfig()
    retired = {"optim.retired_knob": 3}  # a setting a later version of the code removed: logged, not refused
    state = {"step": 1, "config": _saved(without=("optim.exchange", "optim.wire_dtype"), **retired)}
    notes = check_resume(cfg, state, tmp_path / "ckpt", tmp_path, tmp_path)
    assert "resume: optim.retired_knob (saved 3) is no longer a setting" in notes
    assert any("optim.exchange is newer than this checkpoint's config" in n and "'auto'" in n for n in notes)
    assert not any("wire_dtype" in n for n in notes)  # absent and None (its default) are the same


def test_a_new_setting_away_from_its_default_or_a_changed_one_is_refused(tmp_path) -> None:
    cfg = TrainConfig()
    cfg.optim.wire_dtype = "bfloat16"
    state = {"step": 1, "config": _saved(without=("optim.wire_dtype",))}
    with pytest.raises(ResumeMismatchError, match=r"optim\.wire_dtype: None -> 'bfloat16'"):
        check_resume(cfg, state, tmp_path / "ckpt", tmp_path, tmp_path)
    state = {"step": 1, "config": _saved(**{"optim.lr": 0.5})}
    with pytest.raises(ResumeMismatchError, match=r"optim\.lr: 0\.5 -> 0\.02"):
        check_resume(TrainConfig(), state, tmp_path / "ckpt", tmp_path, tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [("exchange", "ring"), ("hsdp_replicas", "all"), ("wire_scope", "inputs"), ("wire_dtype", "fp8")],
)
def test_the_dmuon_distribution_options_are_checked(key: str, value: str) -> None:
    from vla.training.config import OptimConfig

    with pytest.raises(ValueError, match=rf"optim\.{key}={value!r} is not one of"):
        OptimConfig(**{key: value})
