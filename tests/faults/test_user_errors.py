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
    (
        "fine_tune_without_weights",  # else it would train from scratch on the fine-tune's settings
        ["experiment=metaworld_finetune"],
        "e.g. model.weights=RUN/policy.safetensors (the export of an experiment=metaworld_long run)",
    ),
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
    # Data sources, hub ids and tokenizers (offline: HF_HUB_OFFLINE=1, an empty cache)
    ("lerobot_without_root", ["data=lerobot", "data.root=null"], "data.root is not set"),
    ("repo_id_needs_lerobot", ["data.repo_id=acme/reach"], "needs data=lerobot"),
    (
        "repo_id_not_cached",
        ["data=lerobot", "data.repo_id=acme/reach"],
        "hf download acme/reach --repo-type dataset",
    ),
    (
        "weights_id_not_cached",
        ["model.weights=acme/reach-policy"],
        "model.weights=acme/reach-policy: not in the Hugging",
    ),
    ("missing_tokenizer_dir", ["data.tokenizer_path=/nonexistent/tok"], "tokenizer path /nonexistent/tok"),
    ("tokenizer_too_big", ["data.tokenizer_path=google/paligemma-3b-pt-224"], "data.tokenizer_path"),
    ("bad_val_fraction", ["data.val_fraction=1.5"], "data.val_fraction"),
    ("bad_norm_mode", ["data.norm_modes={action: FOO}"], "data.norm_modes"),
    ("unknown_task_weight", ["data.task_weights={reach the purple target: 2}"], "not a task of"),
    ("bad_dart_noise", ["data=metaworld", "data.metaworld.action_noise=2"], "data.metaworld.action_noise"),
    (
        "bad_hand_start_noise",
        ["data=metaworld", "data.metaworld.hand_start_noise=1"],
        "data.metaworld.hand_start_noise",
    ),
    ("bad_record_workers", ["data=metaworld", "data.metaworld.workers=-2"], "data.metaworld.workers"),
    (
        "steps_after_success_past_episode",
        ["data=metaworld", "data.metaworld.steps_after_success=200"],
        "data.metaworld.steps_after_success (200) must be below",
    ),
    (
        "expert_aims_tcp_not_a_bool",
        ["data=metaworld", "data.metaworld.expert_aims_tcp=maybe"],
        "data.metaworld.expert_aims_tcp",
    ),
    # Trainer, trackers, compile
    ("unknown_tracker", ["trainer.tracker=csv"], "trainer.tracker"),
    ("unknown_wandb_mode", ["trainer.wandb_mode=cloud"], "trainer.wandb_mode"),
    ("unknown_compile_mode", ["trainer.compile_mode=fast"], "trainer.compile_mode"),
    ("bad_ema_decay", ["trainer.ema_decay=1.5"], "trainer.ema_decay"),
    ("unknown_schedule", ["trainer.schedule=step"], "trainer.schedule"),
    ("zero_batch", ["trainer.batch_size=0"], "trainer.batch_size"),
    ("resume_path_missing", ["trainer.resume=/nonexistent/ckpt"], "/nonexistent/ckpt"),
    # Launch layouts on one process
    ("ddp_on_one_process", ["parallel=ddp"], "parallel=ddp needs several processes"),
    ("hsdp_on_one_process", ["parallel=hsdp"], "parallel=hsdp needs replicas"),
    ("unknown_override_key", ["trainer.stepz=3"], "stepz"),
    ("not_an_int", ["trainer.steps=abc"], "trainer.steps"),
    ("unknown_group_option", ["optim=sgd"], "optim"),
]


@pytest.fixture(scope="module")
def corpus(synthetic_dataset, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, float, Path]]:
    """Every case's run (result, seconds, its directory), two at a time: each is a separate process that
    spends most of its few seconds importing, so the machine's two cores halve the corpus's time."""
    from concurrent.futures import ThreadPoolExecutor

    def run(case: str, overrides: list[str]) -> tuple[subprocess.CompletedProcess, float, Path]:
        directory = tmp_path_factory.mktemp(case)
        (directory / "afile").write_text("not a directory")
        (directory / "garbage.safetensors").write_bytes(b"\x00garbage" * 10)
        overrides = [
            o.replace("AFILE", str(directory / "afile")).replace(
                "GARBAGE", str(directory / "garbage.safetensors")
            )
            for o in overrides
        ]
        args = [*TINY, f"data.root={synthetic_dataset}", f"output_dir={directory / 'run'}", *overrides]
        start = time.monotonic()
        result = _train(args, cwd=directory)
        return result, time.monotonic() - start, directory

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(run, case, overrides) for case, overrides, _ in CASES}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize(("case", "overrides", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_user_error_is_one_short_block(corpus, case, overrides, expected) -> None:
    result, elapsed, tmp_path = corpus[case]
    stderr = result.stderr.strip()
    assert result.returncode == 1, (result.returncode, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert expected in stderr, stderr
    ours = stderr.startswith("error: ")
    # Hydra's own override errors (unknown key, bad type, missing group option) keep its format.
    assert len(stderr.splitlines()) <= (6 if ours else 14), stderr
    assert not (tmp_path / "run").exists() or case.startswith("resume_"), "a failed start left a run dir"
    if case.startswith("pi0_"):  # no 45 s / 12 GB model build first (the imports alone take ~6 s here)
        assert elapsed < 30, elapsed


def test_a_bug_keeps_its_traceback_and_the_switch_shows_a_user_errors(synthetic_dataset, tmp_path) -> None:
    args = [*TINY, f"data.root={synthetic_dataset}", f"output_dir={tmp_path / 'run'}", "trainer.steps=-3"]
    shown = _train(args, cwd=tmp_path, env={"VLA_TRACEBACK": "1"})
    assert (
        shown.returncode == 1 and "Traceback" in shown.stderr and "trainer.steps must be > 0" in shown.stderr
    )


# Scripts: (case id, script and arguments (TMP: a fresh directory), expected text)
SCRIPT_CASES = [
    ("export_lerobot_missing_run", ["scripts/export_lerobot.py", "TMP/none"], "no processor.json"),
    ("diagnose_missing_run", ["scripts/diagnose_policy.py", "TMP/none", "--task", "reach-v3"], "not a training run"),
    ("synthetic_zero_episodes", ["scripts/make_synthetic_dataset.py", "--episodes", "0", "--root", "TMP/d"],
     "synthetic episodes must be >= 1"),
    ("sim_dataset_bad_noise", ["scripts/make_sim_dataset.py", "--action-noise", "3", "--root", "TMP/d"],
     "action_noise must be in [0, 1]"),
    ("sim_dataset_bad_hand_start", ["scripts/make_sim_dataset.py", "--hand-start-noise", "-1", "--root", "TMP/d"],
     "hand_start_noise must be in [0, 0.2]"),
    ("sim_dataset_bad_steps_after_success",
     ["scripts/make_sim_dataset.py", "--steps-after-success", "-3", "--root", "TMP/d"],
     "steps_after_success must be in [0, max_episode_steps=200)"),
    ("sim_dataset_bad_workers", ["scripts/make_sim_dataset.py", "--workers", "-1", "--root", "TMP/d"],
     "workers must be an int >= 0"),
    ("sim_dataset_zero_episodes", ["scripts/make_sim_dataset.py", "--episodes", "0", "--root", "TMP/d"],
     "episodes must be >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "args", "expected"), SCRIPT_CASES, ids=[c[0] for c in SCRIPT_CASES])
def test_a_script_user_error_is_one_short_block(tmp_path, case, args, expected) -> None:
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in ("VLA_TRACEBACK", "HYDRA_FULL_ERROR")}
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env
    )
    stderr = result.stderr.strip()
    assert result.returncode == 1, (result.returncode, stderr[-2000:])
    assert "Traceback" not in stderr and expected in stderr, stderr
    assert stderr.startswith("error: ") and len(stderr.splitlines()) <= 6, stderr
    assert not (tmp_path / "d").exists()


def test_classifying_an_error_imports_none_of_the_heavy_modules() -> None:
    """is_user_error looks the project's error types up among the loaded modules: a config error's report
    no longer imports DCP and transformers first (~4 of the ~7.5 s `train.py trainer.steps=-3` took)."""
    code = (
        "import sys\n"
        "from vla.training.user_errors import describe, is_user_error\n"
        "assert is_user_error(FileNotFoundError('x')) and not is_user_error(RuntimeError('a bug'))\n"
        "describe(ValueError('x'))\n"
        "print(sorted(m for m in ('torch', 'transformers', 'torch.distributed.checkpoint', 'vla.models.weights',"
        " 'vla.training.checkpoint', 'vla.training.loop') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_loaded_error_types_and_wrapped_causes_are_user_errors() -> None:
    from vla.data.errors import DatasetError
    from vla.training.checkpoint import CheckpointError, NonFiniteWeightsError
    from vla.training.rundir import RunDirectoryError
    from vla.training.user_errors import is_user_error

    for error in (DatasetError("bad frame"), NonFiniteWeightsError("nan"), RunDirectoryError("taken")):
        assert is_user_error(error)
    wrapped = CheckpointError("saving failed on rank 1")
    wrapped.__cause__ = DatasetError("bad frame")
    assert is_user_error(wrapped)
    bug = CheckpointError("saving failed on rank 1")
    bug.__cause__ = RuntimeError("a bug")
    assert not is_user_error(bug) and not is_user_error(KeyError("a bug"))
