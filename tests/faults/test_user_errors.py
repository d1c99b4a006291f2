"""User errors end as one short block (issue 15 item 1): `python train.py ...` with a mistake exits 1
with at most 6 lines on stderr, no traceback, naming the key or file; bugs keep their traceback.
Each case is a real subprocess, as a user would meet it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _trainer_runs import ROOT, TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _train(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    full_env.pop("VLA_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**full_env, **(env or {})},
    )


# (case id, overrides relative to the tiny run (DATA: the test dataset, OUT: a fresh dir), expected text)
CASES = [
    ("missing_lerobot_root", ["data=lerobot", "data.root=/nonexistent/ds"], "data.root='/nonexistent/ds'"),
    ("negative_steps", ["trainer.steps=-3"], "trainer.steps must be > 0"),
    ("nan_lr", ["optim.lr=nan"], "optim.lr"),
    ("unknown_precision", ["trainer.precision=fp8"], "trainer.precision"),
    ("unknown_bad_frames_policy", ["data.on_bad_frames=ignore"], "data.on_bad_frames"),
    ("batch_not_divisible", ["trainer.batch_size=6", "trainer.grad_accum=4"], "trainer.batch_size=6"),
    ("missing_weights", ["model.weights=/nonexistent/pi0.safetensors"], "model.weights='/nonexistent/pi0"),
    ("garbage_weights", ["model.weights=GARBAGE"], "cannot be read"),
    ("output_dir_is_a_file", ["output_dir=AFILE"], "is a file, not a directory"),
    ("resume_missing_checkpoint", ["trainer.resume=step_00000099"], "step_00000099"),
    ("empty_camera_map", ["data.camera_map={}"], "data.camera_map"),
    (
        "unknown_transform",
        ["data.image_transforms.enable=true", "+data.image_transforms.tfs={x: {type: Blur}}"],
        "Blur",
    ),
    # Full pi0 on this machine: the dataset's cameras, memory, then the tokenizer are checked before the model
    # is built.
    (
        "pi0_without_camera_map",
        ["model=pi0"],
        "(data.camera_map) targets ['top', 'wrist']",
    ),
    (
        "pi0_without_paligemma_tokenizer",
        ["model=pi0", "data.camera_map={observation.images.top: base_0_rgb}", "trainer.check_memory=false"],
        "tokenizer 'google/paligemma-3b-pt-224' (data.tokenizer_path) is not in the Hugging Face cache",
    ),
    (
        "pi0_with_a_small_tokenizer",
        [
            "model=pi0",
            "data.camera_map={observation.images.top: base_0_rgb}",
            "data.tokenizer_path=builtin",
            "trainer.check_memory=false",
        ],
        "data.check_tokenizer_vocab=false",
    ),
    (
        "pi0_too_big",
        ["model=pi0", "data.camera_map={observation.images.top: base_0_rgb}"],
        "this run needs about",
    ),
    ("unknown_override_key", ["trainer.stepz=3"], "stepz"),
    ("not_an_int", ["trainer.steps=abc"], "trainer.steps"),
    ("unknown_group_option", ["optim=sgd"], "optim"),
]


@pytest.mark.parametrize(("case", "overrides", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_user_error_is_one_short_block(synthetic_dataset, tmp_path, case, overrides, expected) -> None:
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00garbage" * 10)
    overrides = [
        o.replace("AFILE", str(tmp_path / "afile")).replace("GARBAGE", str(tmp_path / "garbage.safetensors"))
        for o in overrides
    ]
    args = [*TINY, f"data.root={synthetic_dataset}", f"output_dir={tmp_path / 'run'}", *overrides]
    start = time.monotonic()
    result = _train(args, cwd=tmp_path)
    elapsed = time.monotonic() - start
    stderr = result.stderr.strip()
    assert result.returncode == 1, (result.returncode, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert expected in stderr, stderr
    ours = stderr.startswith("error: ")
    # Hydra's own override errors (unknown key, bad type, missing group option) keep its format.
    assert len(stderr.splitlines()) <= (6 if ours else 14), stderr
    assert not (tmp_path / "run").exists() or case == "resume_missing_checkpoint", (
        "a failed start left a run dir"
    )
    if case.startswith("pi0_"):  # no 45 s / 12 GB model build first (the imports alone take ~6 s here)
        assert elapsed < 30, elapsed


def test_a_bug_keeps_its_traceback_and_the_switch_shows_a_user_errors(synthetic_dataset, tmp_path) -> None:
    args = [*TINY, f"data.root={synthetic_dataset}", f"output_dir={tmp_path / 'run'}", "trainer.steps=-3"]
    shown = _train(args, cwd=tmp_path, env={"VLA_TRACEBACK": "1"})
    assert (
        shown.returncode == 1 and "Traceback" in shown.stderr and "trainer.steps must be > 0" in shown.stderr
    )
