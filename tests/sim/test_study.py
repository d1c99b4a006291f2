"""scripts/study_optimizers.py end to end on a tiny model and recording: sweep, seeds, report, reuse."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _sim_fixtures import SIM_DATA_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import study_optimizers  # noqa: E402


def test_collect_run_reads_curves_and_the_final_evaluation(tmp_path) -> None:
    records = [
        {"step": s, "split": "train", "loss": 1.0 / s, "step_s": t, "optimizer_s": t / 10}
        for s, t in enumerate([9.0, 1.0, 1.0, 3.0], 1)
    ]
    records += [{"step": 2, "split": "val", "loss": 0.5}, {"step": 4, "split": "val", "loss": 0.2}]
    records.append({"step": 4, "split": "val", "loss": 0.25})  # a resumed run re-logs a step: the last wins
    records.append(
        {"step": 4, "split": "eval", "success/a": 0.5, "success/mean": 0.5, "train_s": 14.0, "episodes": 2.0}
    )
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    final = {"mean_success": 0.5, "tasks": [{"task": "a", "successes": 1, "episodes": 2, "ci95": [0.1, 0.9]}]}
    (tmp_path / "closed_loop.json").write_text(json.dumps(final))
    run = study_optimizers.collect_run(tmp_path)
    assert run["val_steps"] == [2, 4] and run["val_loss"] == [0.5, 0.25]
    assert run["median_step_s"] == 2.0 and run["val_seconds"] == [4.0, 8.0]
    assert run["median_optimizer_s"] == pytest.approx(0.2)
    assert run["success_curve"]["steps"] == [4] and run["success_curve"]["seconds"] == [8.0]
    assert run["final"]["tasks"] == {"a": {"successes": 1, "episodes": 2, "ci95": [0.1, 0.9]}}


def test_lr_sensitivity_sets_dmuon_against_every_adamw_lr_of_the_first_seed() -> None:
    from argparse import Namespace

    def run(optimizer: str, lr: float, seed: int, successes: int, val: float) -> tuple[str, dict]:
        final = {"mean_success": successes / 10, "tasks": {"a": {"successes": successes, "episodes": 10}}}
        name = study_optimizers.run_name(optimizer, lr, seed)
        return name, {"optimizer": optimizer, "lr": lr, "seed": seed, "final": final, "val_loss": [val]}

    runs = dict(
        [run("adamw", 1e-3, 0, 3, 0.09), run("adamw", 5e-4, 0, 6, 0.10), run("dmuon", 0.01, 0, 6, 0.08),
         run("adamw", 1e-3, 1, 9, 0.05)]  # another seed: not part of the seed-0 comparison
    )  # fmt: skip
    args = Namespace(seeds=[0, 1], lrs={"adamw": [5e-4, 1e-3, 2e-3]}, resamples=500)
    sensitivity = study_optimizers.lr_sensitivity(args, runs, {"adamw": 1e-3, "dmuon": 0.01})
    rows = sensitivity["against_adamw_lr"]
    assert sensitivity["dmuon_lr"] == 0.01 and list(rows) == ["0.0005", "0.001"]  # 2e-3 never ran
    assert rows["0.001"]["chosen"] and not rows["0.0005"]["chosen"]
    assert rows["0.001"]["difference"]["difference"] == pytest.approx(0.3)
    assert rows["0.0005"]["difference"]["difference"] == pytest.approx(0.0)
    assert rows["0.0005"]["best_val_loss"] == 0.10 and rows["0.0005"]["adamw_success"] == 0.6
    assert study_optimizers.lr_sensitivity(args, runs, {"adamw": 1e-3}) == {}


def test_a_sensitivity_arm_replaces_its_optimizers_chosen_lr_in_the_difference() -> None:
    def final(successes: int) -> dict:
        return {"mean_success": successes / 10, "tasks": {"a": {"successes": successes, "episodes": 10}}}

    runs = {
        "adamw_lr0.0005_seed0": {"final": final(6)},
        "adamw_lr0.0005_seed1": {"final": final(4)},
        "adamw_lr0.001_seed0": {"final": final(2)},
        "dmuon_lr0.01_seed0": {"final": final(7)},
        "dmuon_lr0.01_seed1": {"final": final(7)},
        "dmuon_lr0.02_seed0": {"final": final(1)},  # seed 1 never finished: one seed only
    }
    args = study_optimizers.parse_args(["--seeds=0,1", "--also=adamw=5e-4, dmuon=0.02", "--resamples=500"])
    assert args.also_arms == [("adamw", 5e-4), ("dmuon", 0.02)]
    per = {
        "adamw": {"lr": 1e-3, "runs": ["adamw_lr0.001_seed0"]},
        "dmuon": {"lr": 0.01, "runs": ["dmuon_lr0.01_seed0", "dmuon_lr0.01_seed1"]},
    }
    arms = study_optimizers.sensitivity_arms(args, runs, per)
    adamw, dmuon = arms["adamw_lr0.0005"], arms["dmuon_lr0.02"]
    assert adamw["runs"] == ["adamw_lr0.0005_seed0", "adamw_lr0.0005_seed1"] and not adamw["chosen"]
    assert adamw["final_success"]["mean"] == pytest.approx(0.5)
    assert adamw["difference"]["difference"] == pytest.approx(0.7 - 0.5)  # chosen DMuon - this AdamW
    assert dmuon["runs"] == ["dmuon_lr0.02_seed0"] and dmuon["against"]["lr"] == 1e-3
    assert dmuon["difference"]["difference"] == pytest.approx(0.1 - 0.2)  # this DMuon - chosen AdamW
    with pytest.raises(SystemExit):
        study_optimizers.parse_args(["--also=sgd=0.1"])


def test_short_budgets_pair_each_seeds_short_dmuon_run_with_its_full_adamw_run() -> None:
    """A short-budget run reaches AdamW's best of the same seed, or does not; the ratio is a mean over
    seeds only when every seed reaches it, and the success difference is against AdamW's full runs."""

    def run(optimizer: str, seed: int, val: list[float], successes: int, budget: int | None = None):
        steps = [2 * (i + 1) for i in range(len(val))]
        final = {"mean_success": successes / 10, "tasks": {"a": {"successes": successes, "episodes": 10}}}
        lr = 1e-3 if optimizer == "adamw" else 0.01
        name = study_optimizers.run_name(optimizer, lr, seed, budget=budget)
        return name, {"seed": seed, "val_steps": steps, "val_loss": val, "final": final}

    runs = dict(
        [run("adamw", 0, [0.5, 0.3, 0.2, 0.25], 4), run("adamw", 1, [0.6, 0.4, 0.35, 0.3], 5),
         run("dmuon", 0, [0.4, 0.19], 6, budget=4), run("dmuon", 1, [0.45, 0.28], 7, budget=4),
         run("dmuon", 0, [0.3], 3, budget=2), run("dmuon", 1, [0.2], 3, budget=2)]
    )  # fmt: skip
    assert "dmuon_lr0.01_seed0_budget4" in runs
    args = study_optimizers.parse_args(["--seeds=0,1", "--budgets=0.5, 0.25", "--resamples=500"])
    args.budget = 8
    assert study_optimizers.budgets(args) == [2, 4]
    per = {
        "adamw": {"lr": 1e-3, "runs": ["adamw_lr0.001_seed0", "adamw_lr0.001_seed1"]},
        "dmuon": {"lr": 0.01, "runs": []},
    }
    rows = study_optimizers.short_budgets(args, runs, per)
    four, two = rows["4"], rows["2"]
    assert four["budget_ratio"] == 0.5 and four["reached"] == 2
    assert four["seeds"]["0"] == {
        "adamw_best_val_loss": 0.2, "adamw_step": 6, "dmuon_step": 4, "dmuon_final_val_loss": 0.19,
        "ratio": pytest.approx(4 / 6),
    }  # fmt: skip
    assert four["seeds"]["1"]["adamw_step"] == 8 and four["seeds"]["1"]["dmuon_step"] == 4
    assert four["ratio"] == pytest.approx((4 / 6 + 4 / 8) / 2)
    assert four["final_success"]["mean"] == pytest.approx(0.65)
    assert four["difference"]["difference"] == pytest.approx(0.65 - 0.45)
    assert four["against"]["runs"] == per["adamw"]["runs"]
    assert two["reached"] == 1 and two["ratio"] is None and two["seeds"]["0"]["dmuon_step"] is None
    assert two["seeds"]["1"]["ratio"] == pytest.approx(2 / 8)
    assert study_optimizers.short_budgets(args, runs, {"adamw": per["adamw"]}) == {}
    for bad in ("--budgets=1.0", "--budgets=0", "--budgets=x"):
        with pytest.raises(SystemExit):
            study_optimizers.parse_args([bad])


def test_a_reused_run_trained_with_other_settings_is_refused_naming_them(tmp_path, capsys) -> None:
    """The archive outlives the preset: a run archived before the recipe's cameras (or its evaluation
    seeds) changed must not be reported as if it ran with the new ones."""
    from omegaconf import OmegaConf

    from vla.training.cli import compose

    args = study_optimizers.parse_args(
        [f"--out={tmp_path}", f"--archive={tmp_path / 'archive'}", "--steps=4"]
    )
    args.budget = 4
    job = ("dmuon", 0.01, 0, None)
    archived = tmp_path / "archive" / study_optimizers.run_name(*job[:3])
    archived.mkdir(parents=True)
    overrides = study_optimizers.train_overrides(args, *job[:3], archived, None)
    cfg = compose([o for o in overrides if o != "trainer.resume=auto"])
    (archived / "summary.json").write_text(json.dumps({"steps": 4}))

    def archive_with(**changes: object) -> None:
        saved = OmegaConf.structured(cfg)
        for key, value in changes.items():
            OmegaConf.update(saved, key, value, merge=False)
        (archived / "config.yaml").write_text(OmegaConf.to_yaml(saved))

    harmless = {"data.root": "/elsewhere", "trainer.closed_loop.parallel_envs": 3}  # neither changes a result
    archive_with(**harmless)
    assert study_optimizers.launch(args, job) is None
    assert "archived in" in capsys.readouterr().out
    archive_with(**{"data.metaworld.cameras": ["corner2", "gripperPOV"], "trainer.closed_loop.seed": 2000})
    with pytest.raises(SystemExit) as refused:
        study_optimizers.launch(args, job)
    message = str(refused.value)
    assert str(archived) in message and "--train-arg" in message
    assert "data.metaworld.cameras: ['corner2', 'gripperPOV'] -> ['corner2', 'topview']" in message
    assert "trainer.closed_loop.seed: 2000 -> 1000" in message and "parallel_envs" not in message


@pytest.mark.slow
def test_study_sweeps_seeds_and_reports(tmp_path, sim_dataset) -> None:
    out = tmp_path / "study"
    train_args = [
        "model=pi0_tiny",
        "+model.overrides.cameras=[corner2,topview]",
        *SIM_DATA_OVERRIDES[1:],
        f"data.root={sim_dataset}",
        "data.num_workers=0",
        "data.val_fraction=0.25",
        "trainer.batch_size=4",
        "trainer.warmup_steps=1",
        "trainer.val_every=2",
        "trainer.val_batches=1",
        "trainer.checkpoint_every=2",
        "trainer.closed_loop.max_episode_steps=10",
        "trainer.closed_loop.parallel_envs=2",
    ]
    command = [sys.executable, str(ROOT / "scripts/study_optimizers.py"), f"--out={out}", "--steps=4",
               "--seeds=0,1", "--adamw-lrs=1e-3", "--dmuon-lrs=0.01,0.02", "--muon-steps=2", "--eval-every=2",
               "--curve-episodes=1", "--episodes=2", "--resamples=500", f"--archive={tmp_path / 'archive'}",
               "--also=dmuon=0.01,dmuon=0.02", "--budgets=0.5"]  # fmt: skip
    command += [f"--train-arg={a}" for a in train_args]
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    runs = study["runs"]
    sweep = {n: r for n, r in runs.items() if n.startswith("dmuon") and n.endswith("seed0")}
    best_dmuon = min(sweep.values(), key=lambda r: min(r["val_loss"]))["lr"]  # chosen on validation loss
    assert study["best_lr"] == {"adamw": 1e-3, "dmuon": best_dmuon}
    (other_dmuon,) = {0.01, 0.02} - {best_dmuon}
    assert set(runs) == {
        "adamw_lr0.001_seed0", "dmuon_lr0.01_seed0", "dmuon_lr0.02_seed0", "adamw_lr0.001_seed1",
        f"dmuon_lr{best_dmuon:g}_seed1", f"muon_lr{best_dmuon:g}_seed0_2steps", f"dmuon_lr{best_dmuon:g}_seed0_2steps",
        f"dmuon_lr{other_dmuon:g}_seed1",  # the --also arm that was not chosen: its other seed
        f"dmuon_lr{best_dmuon:g}_seed0_budget2", f"dmuon_lr{best_dmuon:g}_seed1_budget2",  # --budgets=0.5
    }  # fmt: skip
    for name, run in runs.items():
        if name.endswith("budget2"):  # its own 2-step schedule, evaluated at its end on the final episodes
            assert run["train_steps"] == [1, 2] and run["success_curve"]["steps"] == [2]
            assert all(t["episodes"] == 2 for t in run["final"]["tasks"].values())
            config = (out / "runs" / name / "config.yaml").read_text()
            assert "schedule_steps: 2\n" in config and "  steps: 2\n" in config
        elif "steps" not in name.rsplit("_", 1)[-1]:
            assert run["success_curve"]["steps"] == [2, 4] and run["success_curve"]["episodes"] == [1, 2]
            assert all(t["episodes"] == 2 for t in run["final"]["tasks"].values())
    # seeds 0 and 1 differ in initial weights and data order: other losses
    assert runs["adamw_lr0.001_seed0"]["train_loss"] != runs["adamw_lr0.001_seed1"]["train_loss"]
    per = study["optimizers"]
    assert per["adamw"]["runs"] == ["adamw_lr0.001_seed0", "adamw_lr0.001_seed1"]
    assert per["adamw"]["final_success"]["seeds"] == 2 and set(per["dmuon"]["tasks"]) == {
        "reach-v3",
        "button-press-topdown-v3",
    }
    # Steps to AdamW's best validation loss, paired by seed (each seed validates on its own episodes).
    paired = per["steps_to_adamw_best"]
    assert set(paired["seeds"]) == {"0", "1"}
    for seed, row in paired["seeds"].items():
        adamw = runs[f"adamw_lr0.001_seed{seed}"]
        assert row["adamw_best_val_loss"] == min(adamw["val_loss"])
        assert adamw["val_steps"][adamw["val_loss"].index(row["adamw_best_val_loss"])] == row["adamw_step"]
    if all(row["ratio"] is not None for row in paired["seeds"].values()):
        assert paired["ratio"] == pytest.approx(np.mean([row["ratio"] for row in paired["seeds"].values()]))
    difference = per["difference"]
    assert -1 <= difference["ci"][0] <= difference["difference"] <= difference["ci"][1] <= 1
    # naive Muon is the same update as DMuon: the same losses (Gram vs standard NS only), on the first
    # steps of the full runs' schedule
    assert study["muon_vs_dmuon"]["steps"] == 2 and study["muon_vs_dmuon"]["max_rel_loss_diff"] < 1e-4
    twin = runs[f"dmuon_lr{best_dmuon:g}_seed0_2steps"]["train_loss"]
    assert twin == runs[f"dmuon_lr{best_dmuon:g}_seed0"]["train_loss"][:2]
    assert set(study["layouts"]) == {"reach-v3", "button-press-topdown-v3"}
    for plot in ("val_loss.png", "success_curve.png", "success.png"):
        assert (out / plot).stat().st_size > 1000
    assert "DMuon - AdamW mean success" in first.stdout
    (row,) = study["lr_sensitivity"]["against_adamw_lr"].values()  # the one AdamW lr of this sweep
    assert row["chosen"] and row["adamw_lr"] == 1e-3 and "- AdamW at each lr of the sweep" in first.stdout
    arms = study["sensitivity_arms"]
    chosen, other = arms[f"dmuon_lr{best_dmuon:g}"], arms[f"dmuon_lr{other_dmuon:g}"]
    assert chosen["chosen"] and chosen["runs"] == per["dmuon"]["runs"]
    assert chosen["difference"]["difference"] == pytest.approx(difference["difference"])
    assert not other["chosen"] and other["runs"] == [f"dmuon_lr{other_dmuon:g}_seed{s}" for s in (0, 1)]
    assert "sensitivity arm" in first.stdout
    # --budgets: the short runs paired by seed with AdamW's full runs (AdamW's best, where they reach it).
    short = study["short_budgets"]["2"]
    assert short["budget_ratio"] == 0.5 and short["runs"] == [
        f"dmuon_lr{best_dmuon:g}_seed{s}_budget2" for s in (0, 1)
    ]
    for seed, row in short["seeds"].items():
        assert row["adamw_best_val_loss"] == paired["seeds"][seed]["adamw_best_val_loss"]
        val = runs[f"dmuon_lr{best_dmuon:g}_seed{seed}_budget2"]["val_loss"]
        assert row["dmuon_final_val_loss"] == val[-1]
        assert (row["dmuon_step"] is not None) == (min(val) <= row["adamw_best_val_loss"])
    assert -1 <= short["difference"]["ci"][0] <= short["difference"]["ci"][1] <= 1
    assert "DMuon with a 2-step schedule (0.50x the study's steps" in first.stdout
    # A second call reuses every finished run.
    second = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and second.stdout.count("finished earlier, reused") == 10
    assert "training ..." not in second.stdout
    # On a new machine (no run directories, no checkpoints) the archive's records are the study.
    archived = sorted(p.name for p in (tmp_path / "archive").iterdir())
    assert archived == sorted(runs) and not list((tmp_path / "archive").rglob("*.distcp"))
    runs_dir = out / "runs"
    runs_dir.rename(tmp_path / "old_runs")
    third = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert third.stdout.count("reused") == 10 and "training ..." not in third.stdout
    again = json.loads((out / "study.json").read_text())
    assert again["best_lr"] == study["best_lr"] and again["muon_vs_dmuon"] == study["muon_vs_dmuon"]
    for key in ("final_success", "tasks", "runs"):
        assert again["optimizers"]["dmuon"][key] == study["optimizers"]["dmuon"][key]
    assert again["optimizers"]["steps_to_adamw_best"] == paired
    assert again["optimizers"]["difference"]["difference"] == difference["difference"]
    assert again["layouts"] == study["layouts"] and again["short_budgets"] == study["short_budgets"]
    (tmp_path / "old_runs").rename(runs_dir)

    # scripts/diagnose_policy.py on one of these runs: both measurements come out, well-formed.
    report = tmp_path / "diagnosis.json"
    diagnose = [sys.executable, str(ROOT / "scripts/diagnose_policy.py"), str(out / "runs" / "adamw_lr0.001_seed0"),
                "--task=reach-v3", "--seeds=2", "--later=2", "--probe-train=6", "--follow-episodes=2",
                "--follow=reach-v3,push-v3", f"--json={report}"]  # fmt: skip
    result = subprocess.run(diagnose, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    diagnosis = json.loads(report.read_text())
    for seeds in ("training_seeds", "new_seeds"):
        checks = diagnosis["actions"][seeds]
        assert set(checks) == {"first_frame", "after_2_expert_steps"}
        assert all(len(c["corr"]) == 4 and len(c["mae"]) == 4 for c in checks.values())
    swapped = diagnosis["actions"]["new_seeds_swapped"]
    assert set(swapped) == {"later_images_first_state", "first_images_later_state"}
    assert all(len(c["corr"]) == 4 and len(c["mae"]) == 4 for c in swapped.values())
    probe = diagnosis["goal_probe"]
    assert probe["feature_dims"] > 0 and len(probe["6_new_layouts"]["r2_xyz"]) == 3
    assert "goal probe fitted on 6_new_layouts" in result.stdout
    told = diagnosis["instructions"]
    assert list(told) == ["reach-v3", "push-v3"]
    assert [row["instruction"] for row in told.values()] == ["reach the goal", "push the puck to the goal"]
    for row in told.values():
        assert row["episodes"] == 2 and 0.0 <= row["success_rate"] <= 1.0
        assert 0 < row["closest_tcp_goal_mm"] < 1000 and 0 < row["closest_tcp_object_mm"] < 1000
        assert row["object_moved_mm"] >= 0
        miss = row["failed_miss_at_closest_xyz_mm"]
        assert miss is None if row["success_rate"] == 1.0 else len(miss) == 3
    assert "reach-v3 told 'push the puck to the goal' (push-v3): success" in result.stdout
