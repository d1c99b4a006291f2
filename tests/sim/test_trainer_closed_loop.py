"""data=metaworld in the trainer: closed-loop success at the end of a run and every K steps."""

from __future__ import annotations

import json

import pytest
from _sim_fixtures import SIM_DATA_OVERRIDES
from _trainer_runs import metrics, run_in_process, run_torchrun

TINY_SIM = [
    "model=pi0_tiny",
    "+model.overrides.cameras=[corner2,topview]",
    *SIM_DATA_OVERRIDES,
    "data.val_fraction=0.25",
    "data.num_workers=0",
    "trainer.batch_size=4",
    "trainer.warmup_steps=1",
    "trainer.progress_bar=false",
    "trainer.val_batches=1",
    "trainer.closed_loop.episodes=2",
    "trainer.closed_loop.max_episode_steps=10",
    "trainer.closed_loop.parallel_envs=2",
]


@pytest.mark.slow
def test_run_reports_closed_loop_success(tmp_path, sim_dataset, monkeypatch) -> None:
    from vla.data.augment import ImageAugmenter
    from vla.eval.curves import success_curve

    augmented: list[str] = []  # cameras of every augmented batch
    original = ImageAugmenter.augment

    def counting(self, images, camera, keys):
        augmented.append(camera)
        return original(self, images, camera, keys)

    monkeypatch.setattr(ImageAugmenter, "augment", counting)
    out = tmp_path / "run"
    summary = run_in_process(
        [*TINY_SIM, f"data.root={sim_dataset}", f"output_dir={out}", "trainer.steps=4", "trainer.closed_loop.every=2",
         "trainer.closed_loop.videos=1", "trainer.closed_loop.final_episodes=3", "image_transforms=openpi"]
    )  # fmt: skip
    # augmentation ran on the 4 training batches (2 cameras each) and nowhere else: not in validation,
    # the open-loop evaluation or the two closed-loop evaluations (num_workers=0: all in this process)
    assert sorted(augmented) == ["corner2"] * 4 + ["topview"] * 4
    report = summary.closed_loop
    assert [t["task"] for t in report["tasks"]] == ["reach-v3", "button-press-topdown-v3"]
    assert all(  # the final evaluation: final_episodes
        t["episodes"] == 3 and [r["seed"] for r in t["results"]] == [1000, 1001, 1002]
        for t in report["tasks"]
    )
    curve = success_curve(out / "metrics.jsonl")  # success over training: steps and training seconds
    assert curve.steps == [2, 4] and curve.episodes == [2, 3]
    assert 0 < curve.train_s[0] < curve.train_s[1]
    assert (
        set(curve.tasks) == {"reach-v3", "button-press-topdown-v3"}
        and curve.mean[-1] == report["mean_success"]
    )
    assert json.loads((out / "closed_loop.json").read_text())["tasks"] == json.loads(
        json.dumps(report["tasks"])
    )
    evals = [r for r in metrics(out, "eval") if "success/mean" in r]
    assert [r["step"] for r in evals] == [2, 4]  # every=2, then the end of the run
    assert set(evals[-1]) >= {"success/reach-v3", "success/button-press-topdown-v3", "success/mean"}
    assert len(list((out / "videos").glob("*.mp4"))) == 2  # one per task


def test_training_seeds_are_refused(tmp_path, sim_dataset) -> None:
    from vla.training.cli import compose
    from vla.training.closed_loop import closed_loop_evaluation

    cfg = compose([*TINY_SIM, f"data.root={sim_dataset}", "trainer.closed_loop.seed=4"])
    with pytest.raises(ValueError, match=r"seeds \[5\] of reach-v3 are training demonstrations.*seed >= 7"):
        closed_loop_evaluation(cfg, None, None, False, None)  # type: ignore[arg-type]


def test_training_seeds_are_refused_before_the_first_step(tmp_path, sim_dataset) -> None:
    """The trainer checks every evaluation's seeds (final_episodes too) when it starts, not at the first
    evaluation minutes in: the recording's reach seeds are 5 and 6."""
    from accelerate.state import AcceleratorState

    from vla.training.cli import compose
    from vla.training.closed_loop import check_closed_loop_seeds
    from vla.training.loop import Trainer

    base = [*TINY_SIM, f"data.root={sim_dataset}", "trainer.closed_loop.seed=3"]
    check_closed_loop_seeds(compose(base))  # seeds 3 and 4: unseen
    final = [*base, "trainer.closed_loop.final_episodes=3", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(ValueError, match=r"seed=3: seeds \[5\] of reach-v3 are training demonstrations"):
        check_closed_loop_seeds(compose(final))
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match=r"seed >= 7"):
        Trainer(compose(final))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step was taken


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_run_splits_episodes_and_matches_one_process(tmp_path, sim_dataset) -> None:
    """2 ranks (FSDP2) play half the episodes each; the gathered report equals a 1-process run's."""
    common = [*TINY_SIM, f"data.root={sim_dataset}", "trainer.steps=2", "trainer.closed_loop.episodes=3"]
    single = run_in_process([*common, f"output_dir={tmp_path / 'one'}"]).closed_loop
    run_torchrun([*common, f"output_dir={tmp_path / 'two'}", "parallel=fsdp2"], 2)
    double = json.loads((tmp_path / "two" / "closed_loop.json").read_text())
    for a, b in zip(single["tasks"], double["tasks"]):
        assert [r["seed"] for r in b["results"]] == [1000, 1001, 1002]
        assert [(r["success"], r["steps"]) for r in a["results"]] == [
            (r["success"], r["steps"]) for r in b["results"]
        ]


@pytest.mark.slow
def test_eval_sim_evaluates_a_checkpoint_as_the_run_evaluated_it(tmp_path, sim_dataset) -> None:
    """scripts/eval_sim.py --checkpoint: the last checkpoint, exported and evaluated on the run's seeds,
    plays every episode exactly as the run's own final evaluation; an earlier checkpoint plays its own
    weights (other distances), and a missing one is a one-line error."""
    import subprocess
    import sys

    from _trainer_runs import ROOT

    out = tmp_path / "run"
    run_in_process(
        [*TINY_SIM, f"data.root={sim_dataset}", f"output_dir={out}", "trainer.steps=4", "trainer.checkpoint_every=2",
         "trainer.keep_last=2"]
    )  # fmt: skip
    # the step limit (10) and the replan interval are the run's own, not given
    settings = ["--episodes", "2", "--seed", "1000", "--parallel-envs", "2"]

    def evaluate(checkpoint: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "scripts/eval_sim.py", str(out), "--checkpoint", checkpoint, *settings,
             "--json", str(tmp_path / f"{checkpoint}.json")],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    def episodes(path) -> list[tuple]:
        report = json.loads(path.read_text())
        return [(t["task"], r["seed"], r["success"], r["steps"], r["closest_m"], r["final_m"])
                for t in report["tasks"] for r in t["results"]]  # fmt: skip

    for checkpoint in ("step_00000004", "step_00000002"):
        result = evaluate(checkpoint)
        assert result.returncode == 0, result.stderr[-3000:]
        assert (out / "exports" / checkpoint / "policy.safetensors").is_file()
    run_eval = episodes(out / "closed_loop.json")
    assert episodes(tmp_path / "step_00000004.json") == run_eval
    assert json.loads((tmp_path / "step_00000004.json").read_text())["policy"] == "run@step_00000004"
    earlier = episodes(tmp_path / "step_00000002.json")
    assert [e[:2] for e in earlier] == [e[:2] for e in run_eval] and earlier != run_eval
    missing = evaluate("step_00000099")
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "step_00000099" in missing.stderr
