"""Single-process training runs: output layout, learning, resume == uninterrupted, NaN stop, Ctrl-C."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _trainer_runs import ROOT, losses, metrics, run_in_process, summary, tiny_overrides

from vla.training.checkpoint import read_safetensors_metadata
from vla.training.loop import NonFiniteLossError

pytestmark = pytest.mark.slow


def test_a_run_writes_config_metrics_tensorboard_checkpoints_and_export(synthetic_dataset, tmp_path) -> None:
    out = tmp_path / "run"
    result = run_in_process(
        tiny_overrides(
            synthetic_dataset, out, "trainer.steps=6", "trainer.checkpoint_every=2", "trainer.keep_last=2"
        )
    )
    assert result.steps == 6 and result.final_loss is not None and result.val_loss is not None
    assert (out / "config.yaml").read_text().count("preset: pi0_tiny") == 1
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))  # as the console and checkpoints/step_N count
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "adamw_lr",
        "samples_per_s",
        "data_s",
        "forward_backward_s",
        "optimizer_s",
    ):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup
    assert len(metrics(out, "val")) == 1  # val_every=50 > steps: once, at the end
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    assert (out / "processor.json").is_file() and summary(out)["steps"] == 6
    open_loop = summary(out)["open_loop"]  # sampled chunks vs recorded actions on held-out episodes
    assert open_loop["samples"] > 0 and len(open_loop["mse_by_horizon"]) == 10
    assert all(math.isfinite(open_loop[k]) for k in ("mse", "l1", "baseline_zero_mse", "baseline_center_mse"))
    assert [r["step"] for r in metrics(out, "eval")] == [6] and metrics(out, "val")[0]["step"] == 6
    # The export has LeRobot's names and our config; it loads back (and as model.weights=).
    from safetensors.torch import load_file

    from vla.eval.policy_runner import load_exported_policy
    from vla.models.weights import lerobot_pi0_key_set

    export = out / "policy.safetensors"
    policy = load_exported_policy(export)
    assert set(load_file(str(export))) == lerobot_pi0_key_set(policy.config)
    assert read_safetensors_metadata(export)["vla.layout"] == "lerobot_pi0"
    again = run_in_process(
        tiny_overrides(synthetic_dataset, tmp_path / "again", "trainer.steps=1", f"model.weights={export}")
    )
    assert again.steps == 1


def test_training_lowers_the_loss(synthetic_dataset, tmp_path) -> None:
    out = tmp_path / "run"
    run_in_process(
        tiny_overrides(
            synthetic_dataset,
            out,
            "trainer.steps=40",
            "trainer.warmup_steps=4",
            "trainer.checkpoint_every=40",
        )
    )
    train = losses(out)
    assert sum(train[-8:]) / 8 < 0.8 * sum(train[:3]) / 3, train


@pytest.mark.parametrize(
    ("optim", "extra"),
    [
        ("dmuon", None),
        ("adamw", None),
        ("dmuon", "image_transforms=openpi"),
        ("dmuon", "data.task_weights={reach the red target: 3}"),
    ],
)
def test_resume_continues_the_same_trajectory(synthetic_dataset, tmp_path, optim, extra) -> None:
    common = [f"optim={optim}", "trainer.steps=6", "trainer.checkpoint_every=3", "trainer.ema_decay=0.9"]
    common += [extra] if extra else []
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_in_process(tiny_overrides(synthetic_dataset, straight, *common))
    with pytest.raises(SystemExit):  # the first half "crashes" right after step 3's checkpoint
        os.environ["VLA_TEST_EXIT_AFTER_STEP"] = "3"
        try:
            run_in_process(tiny_overrides(synthetic_dataset, split, *common))
        finally:
            del os.environ["VLA_TEST_EXIT_AFTER_STEP"]
    assert len(losses(split)) == 3
    run_in_process(tiny_overrides(synthetic_dataset, split, *common, "trainer.resume=auto"))
    assert losses(split) == losses(straight)  # bitwise: same data, noise, lr, optimizer and EMA state
    assert metrics(split, "val")[-1]["loss"] == metrics(straight, "val")[-1]["loss"]
    a = torch.load(straight / "checkpoints" / "step_00000006" / "trainer.pt", weights_only=False)
    b = torch.load(split / "checkpoints" / "step_00000006" / "trainer.pt", weights_only=False)
    assert a["trainer_state"]["loader"] == b["trainer_state"]["loader"]
    if extra:  # augmentation or task weights were on: the same run without them trains on other batches
        plain = tmp_path / "plain"
        run_in_process(tiny_overrides(synthetic_dataset, plain, *common[:-1]))
        assert losses(plain)[0] != losses(straight)[0]


def test_resume_with_a_longer_schedule_trains_every_step_on_the_new_one(synthetic_dataset, tmp_path) -> None:
    # A 4-step run resumed to 8 steps must match an uninterrupted 8-step run step for step: the first
    # resumed step too, although the restored optimizer carries the 4-step schedule's last lr. With 3
    # warmup steps both schedules agree on steps 1-4 (warmup, then the cosine's start), so the weights
    # must come out equal as well.
    common = ["trainer.checkpoint_every=4", "trainer.val_every=100", "trainer.log_every=1"]
    common += ["trainer.warmup_steps=3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_in_process(tiny_overrides(synthetic_dataset, straight, "trainer.steps=8", *common))
    run_in_process(tiny_overrides(synthetic_dataset, resumed, "trainer.steps=4", *common))
    short_lrs = [r["lr"] for r in metrics(resumed)]
    run_in_process(
        tiny_overrides(synthetic_dataset, resumed, "trainer.steps=8", "trainer.resume=auto", *common)
    )
    straight_lrs = [r["lr"] for r in metrics(straight)]
    assert short_lrs == straight_lrs[:4]
    assert [r["lr"] for r in metrics(resumed)] == straight_lrs
    assert [r["adamw_lr"] for r in metrics(resumed)] == [r["adamw_lr"] for r in metrics(straight)]
    assert losses(resumed) == losses(straight)
    from safetensors.torch import load_file

    a, b = load_file(str(straight / "policy.safetensors")), load_file(str(resumed / "policy.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lengthen_schedule_at_trains_as_a_run_continued_to_more_steps(synthetic_dataset, tmp_path) -> None:
    # trainer.lengthen_schedule_at=[6] in one 10-step run == a 6-step run resumed to 10 steps: the same lrs
    # (the cosine ends at step 6, then restarts warm towards step 10), losses and weights, bit for bit.
    common = ["trainer.checkpoint_every=6", "trainer.val_every=100", "trainer.log_every=1"]
    common += ["trainer.warmup_steps=2"]
    staged, continued = tmp_path / "staged", tmp_path / "continued"
    run_in_process(
        tiny_overrides(
            synthetic_dataset, staged, "trainer.steps=10", "trainer.lengthen_schedule_at=[6]", *common
        )
    )
    run_in_process(tiny_overrides(synthetic_dataset, continued, "trainer.steps=6", *common))
    run_in_process(
        tiny_overrides(synthetic_dataset, continued, "trainer.steps=10", "trainer.resume=auto", *common)
    )
    staged_lrs = [r["lr"] for r in metrics(staged)]
    assert staged_lrs == [r["lr"] for r in metrics(continued)]
    assert staged_lrs[5] < staged_lrs[6] > staged_lrs[9]  # the warm restart after step 6
    assert losses(staged) == losses(continued)
    from safetensors.torch import load_file

    a, b = load_file(str(staged / "policy.safetensors")), load_file(str(continued / "policy.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_loss_stops_the_run_before_the_step(synthetic_dataset, tmp_path, monkeypatch) -> None:
    from vla.models.pi0 import Pi0Policy

    original = Pi0Policy.compute_loss
    calls = {"n": 0}

    seen: list[tuple[int, int]] = []

    def poisoned(self, batch, **kwargs):
        loss, metrics_ = original(self, batch, **kwargs)
        calls["n"] += 1
        if calls["n"] == 4:
            seen.extend(zip(batch.meta["episode_index"].tolist(), batch.meta["frame_index"].tolist()))
            return loss * float("nan"), metrics_
        return loss, metrics_

    monkeypatch.setattr(Pi0Policy, "compute_loss", poisoned)
    out = tmp_path / "stop"
    with pytest.raises(NonFiniteLossError, match=r"step 4: loss is nan.*nan_policy=skip") as info:
        run_in_process(
            tiny_overrides(synthetic_dataset, out, "trainer.steps=6", "trainer.checkpoint_every=2")
        )
    named = ", ".join(f"episode {e} frame {f}" for e, f in seen)
    assert f"Rank 0's batch held {named} of {synthetic_dataset}" in str(info.value)  # the very frames
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000002"
    ]  # nothing after the NaN

    calls["n"] = 0
    skipped = tmp_path / "skip"
    run_in_process(
        tiny_overrides(
            synthetic_dataset,
            skipped,
            "trainer.steps=6",
            "trainer.nan_policy=skip",
            "trainer.max_skipped_steps=1",
        )
    )
    assert len(losses(skipped)) == 5 and all(math.isfinite(x) for x in losses(skipped))


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(synthetic_dataset, tmp_path) -> None:
    out = tmp_path / "interrupted"
    # No validation during the run: a SIGINT landing in validation (every 50 steps by default, which a
    # fast child reaches while a loaded test polls) stops at once by design, without the checkpoint.
    overrides = tiny_overrides(
        synthetic_dataset,
        out,
        "trainer.steps=100000",
        "trainer.checkpoint_every=100000",
        "trainer.val_every=100000",
    )
    process = subprocess.Popen(
        [sys.executable, "train.py", *overrides],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or len(metrics(out)) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output  # stopped, not finished (vla.training.guards.EXIT_STOPPED)
    assert "interrupted: saved" in output
    saved = sorted((out / "checkpoints").iterdir())
    assert len(saved) == 1 and int(saved[0].name.split("_")[1]) == len(metrics(out))


def test_gradient_accumulation_matches_the_full_batch(synthetic_dataset, tmp_path) -> None:
    full, accumulated = tmp_path / "full", tmp_path / "accumulated"
    run_in_process(tiny_overrides(synthetic_dataset, full, "trainer.steps=4"))
    run_in_process(tiny_overrides(synthetic_dataset, accumulated, "trainer.steps=4", "trainer.grad_accum=2"))
    torch.testing.assert_close(
        torch.tensor(losses(accumulated)), torch.tensor(losses(full)), rtol=1e-5, atol=0
    )


def test_a_resume_with_other_gradient_accumulation_is_applied_not_announced_and_failed(
    synthetic_dataset, tmp_path
) -> None:
    common = ["trainer.checkpoint_every=2", "trainer.val_every=100"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_in_process(tiny_overrides(synthetic_dataset, straight, "trainer.steps=6", *common))
    run_in_process(tiny_overrides(synthetic_dataset, resumed, "trainer.steps=6", *common))
    # Re-run the last 2 steps from step 4 with the same global batch in 2 micro-batches.
    run_in_process(
        tiny_overrides(
            synthetic_dataset, resumed, "trainer.steps=6", *common, "trainer.grad_accum=2",
            f"trainer.resume={resumed / 'checkpoints' / 'step_00000004'}",
        )
    )  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(losses(resumed)), torch.tensor(losses(straight)), rtol=1e-5, atol=0
    )


def test_openvla_presets_run_end_to_end_with_defaults(synthetic_dataset, tmp_path) -> None:
    from vla.eval.policy_runner import load_exported_policy

    out = tmp_path / "openvla"
    result = run_in_process(tiny_overrides(synthetic_dataset, out, "model=openvla_tiny", "trainer.steps=2"))
    assert result.export and result.open_loop["samples"] > 0 and summary(out)["steps"] == 2
    policy = load_exported_policy(out / "policy.safetensors")
    processor = json.loads((out / "processor.json").read_text())
    assert policy.config.action_dim == processor["action_dim"] == 4  # the synthetic dataset's action dims


def test_outputs_go_where_hydra_says(synthetic_dataset, tmp_path) -> None:
    from _trainer_runs import TINY

    common = [*TINY, f"data.root={synthetic_dataset}", "trainer.steps=1", "trainer.open_loop_eval=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    sweep = tmp_path / "sweep"
    subprocess.run(
        [sys.executable, "train.py", "-m", *common, "optim=adamw,dmuon", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, check=True, capture_output=True, timeout=300, env=env,
    )  # fmt: skip
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    assert [summary(sweep / job)["output_dir"] for job in ("0", "1")] == [str(sweep / "0"), str(sweep / "1")]
    assert "run_name: pi0_tiny-adamw" in (sweep / "0" / "config.yaml").read_text()

    hydra_dir, explicit = tmp_path / "hydra", tmp_path / "explicit"
    subprocess.run(
        [sys.executable, "train.py", *common, f"hydra.run.dir={hydra_dir}", f"output_dir={explicit}"],
        cwd=ROOT, check=True, capture_output=True, timeout=300, env=env,
    )  # fmt: skip
    assert summary(explicit)["steps"] == 1 and not hydra_dir.exists()  # no empty directory left behind
