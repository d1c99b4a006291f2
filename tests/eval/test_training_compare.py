"""Two arms of training runs compared by seed: steps to the baseline's best loss, success with intervals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vla.eval.curves import read_metrics
from vla.eval.training_compare import RunError, compare_training, format_report, load_run, outcomes_at

TASKS = ("reach-v3", "push-v3")


def _report(successes: dict[str, list[bool]], first_seed: int = 1000) -> dict:
    return {
        "tasks": [
            {"task": t, "results": [{"seed": first_seed + i, "success": s} for i, s in enumerate(outcomes)]}
            for t, outcomes in successes.items()
        ]
    }


def _run(
    root: Path,
    name: str,
    val: dict[int, float],
    evals: dict[int, dict[str, float]],
    final: dict[str, list[bool]] | None,
    steps: int = 400,
) -> Path:
    """A run directory as the trainer leaves it: metrics.jsonl, summary.json, closed_loop.json."""
    run = root / name
    run.mkdir()
    rows = [
        {"step": s, "split": "train", "loss": 1.0, "step_s": 0.5 + s / 1e4} for s in range(50, steps + 1, 50)
    ]
    rows += [{"step": s, "split": "val", "loss": v} for s, v in val.items()]
    for step, rates in evals.items():
        rows.append(
            {"step": step, "split": "eval", "episodes": 20, "success/mean": sum(rates.values()) / len(rates)}
            | {f"success/{t}": r for t, r in rates.items()}
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if final is not None:
        (run / "summary.json").write_text(json.dumps({"steps": steps}))
        (run / "closed_loop.json").write_text(json.dumps(_report(final)))
    return run


@pytest.fixture
def arms(tmp_path: Path) -> tuple[list[Path], list[Path]]:
    # a (the baseline) has its best validation loss 0.5 at step 300 in both seeds; b reaches 0.5 at 150 in
    # seed 0 and at 300 in seed 1; after step 400 (beyond --up-to) b's seed 1 would look better than it is.
    a_val = {100: 0.9, 200: 0.6, 300: 0.5, 400: 0.55}
    a = [
        _run(
            tmp_path,
            f"a{s}",
            a_val,
            {200: {"reach-v3": 0.25, "push-v3": 0.5}},
            {t: [True, False] * 15 for t in TASKS},
        )
        for s in range(2)
    ]
    b = [
        _run(
            tmp_path,
            "b0",
            {100: 0.7, 150: 0.5, 400: 0.4},
            {200: {"reach-v3": 0.5, "push-v3": 0.75}},
            {t: [True] * 20 + [False] * 10 for t in TASKS},
        ),
        _run(
            tmp_path,
            "b1",
            {100: 0.7, 300: 0.45, 400: 0.44, 500: 0.1},
            {200: {"reach-v3": 0.5, "push-v3": 0.75}},
            {t: [True] * 20 + [False] * 10 for t in TASKS},
            steps=500,
        ),
    ]
    return a, b


def test_steps_to_the_baseline_best_are_paired_by_seed_and_cut_at_the_step(arms) -> None:
    a, b = arms
    report = compare_training(a, b, 400, names=("adamw", "dmuon"), seeds=[0, 1], resamples=500)
    v0, v1 = report["validation"]["0"], report["validation"]["1"]
    assert (v0["adamw_best_val_loss"], v0["adamw_step"], v0["dmuon_step"], v0["ratio"]) == (
        0.5,
        300,
        150,
        0.5,
    )
    assert (v1["dmuon_step"], v1["ratio"], v1["dmuon_best_val_loss"]) == (300, 1.0, 0.44)  # step 500 cut
    assert report["mean_ratio"] == pytest.approx(0.75)
    assert report["median_step_s"]["adamw"]["0"] == pytest.approx(0.5 + 225 / 1e4)  # median of steps 50-400


def test_success_at_each_step_from_the_eval_records_and_the_final_reports(arms) -> None:
    a, b = arms
    report = compare_training(a, b, 400, names=("adamw", "dmuon"), seeds=[0, 1], resamples=2000)
    # step 200: rates x 20 episodes; a 37.5%, b 62.5%. Step 400: a's final reports (15 of 30 per task);
    # b's seed 1 ends at step 500, so only seed 0 gives b at step 400.
    assert list(report["success"]) == ["200", "400"]
    at200 = report["success"]["200"]
    assert at200["adamw"]["runs"] == {"0": 0.375, "1": 0.375}
    assert at200["dmuon"]["tasks"] == {"push-v3": 0.75, "reach-v3": 0.5}
    assert at200["difference"]["difference"] == pytest.approx(0.25)
    low, high = at200["difference"]["ci"]
    assert 0 < low < 0.25 < high
    at400 = report["success"]["400"]
    assert at400["adamw"]["runs"] == {"0": 0.5, "1": 0.5}
    assert at400["dmuon"]["runs"] == pytest.approx({"0": 2 / 3})
    assert at400["dmuon"]["episodes"] == {"0": [30]}
    table = format_report(report)
    assert "| 0 | 0.5000 (300) | 150 | 0.50x | 0.4000 |" in table
    assert "+25.0 [" in table


def test_episodes_cut_the_final_reports_to_the_same_episode_seeds(arms) -> None:
    _, b = arms
    run = load_run(b[0])
    assert outcomes_at(run, 400) == {t: (20, 30) for t in TASKS}
    assert outcomes_at(run, 400, episodes=20) == {t: (20, 20) for t in TASKS}  # seeds 1000-1019 all succeed
    assert outcomes_at(run, 300) is None
    assert outcomes_at(run, 200, episodes=20) == {"reach-v3": (10, 20), "push-v3": (15, 20)}
    with pytest.raises(RunError, match="cannot be cut to 10"):
        outcomes_at(run, 200, episodes=10)  # rates over 20 episodes say nothing of the first 10


def test_an_archived_run_with_only_a_summary_gives_its_final_outcomes(arms, tmp_path: Path) -> None:
    a, b = arms
    archived = tmp_path / "archived"
    archived.mkdir()
    (archived / "summary.json").write_text(
        json.dumps({"steps": 400, "closed_loop": _report({t: [False] * 30 for t in TASKS})})
    )
    report = compare_training(a, [archived, b[1]], 400, resamples=500)
    assert report["validation"]["0"] == {"note": "no validation curve in one of the runs"}
    assert report["mean_ratio"] == 1.0  # seed 1 alone
    assert report["success"]["400"]["b"]["runs"] == {"0": 0.0}
    assert report["success"]["200"]["b"]["runs"] == {"1": 0.625}  # the archived run has no step 200
    with pytest.raises(RunError, match="same number of runs"):
        compare_training(a, b[:1], 400)
    with pytest.raises(RunError, match="no such run directory"):
        compare_training(a, [b[0], tmp_path / "missing"], 400)
    (archived / "summary.json").write_text('{"steps": 400, "closed_loop": {"tasks": [{"task": "reach-v3"}]}}')
    with pytest.raises(RunError, match="not a closed-loop report"):
        load_run(archived)
    (archived / "summary.json").write_text("{torn")
    with pytest.raises(RunError, match=r"summary.json: not JSON"):
        load_run(archived)


def test_the_script_writes_the_json_and_the_plot_and_names_a_bad_run(arms, tmp_path: Path) -> None:
    import subprocess
    import sys

    a, b = arms
    script = Path(__file__).resolve().parents[2] / "scripts" / "compare_training.py"
    out = tmp_path / "out"
    runs = [x for pair in zip(("--a", "--a", "--b", "--b"), [*a, *b]) for x in pair]
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--names",
            "adamw,dmuon",
            "--up-to",
            "400",
            "--resamples",
            "500",
            *runs,
            "--json",
            str(out / "c.json"),
            "--plot",
            str(out / "c.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "| 0 | 0.5000 (300) | 150 | 0.50x | 0.4000 |" in done.stdout
    assert json.loads((out / "c.json").read_text())["mean_ratio"] == pytest.approx(0.75)
    assert (out / "c.png").read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run(
        [sys.executable, str(script), "--up-to", "400", "--a", str(a[0]), "--b", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "no such run directory" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_committed_long_recipe_comparisons_are_what_their_records_give() -> None:
    # docs/study/long4000: AdamW vs DMuon over the first 4000 steps of experiment=metaworld_long (README, "AdamW
    # vs DMuon on the recipe that works"): AdamW 1e-3 on training seeds 0-2 against DMuon's re-runs, on 50
    # episodes per task at step 4000 (compare.json) and on 20 (as first reported), and with DMuon seed 0 as first
    # trained (its archived 4000-step run, summary only); AdamW 5e-4 the same; the bootstrap is seeded, so the
    # same records give the same intervals.
    root = Path(__file__).resolve().parents[2]
    long4000 = root / "docs" / "study" / "long4000"
    dmuon = [long4000 / f"dmuon_seed{s}" for s in (0, 1, 2)]
    archived = root / "docs" / "ablations" / "tgs400_start_nostate_steps4000"
    cases = (
        ("compare.json", "adamw", dmuon, 50),
        ("compare_20_episodes.json", "adamw", dmuon, 20),
        ("compare_dmuon_seed0_archived.json", "adamw", [archived, *dmuon[1:]], 20),
        ("compare_lr5e-4.json", "adamw5e-4", dmuon, 50),
        ("compare_lr5e-4_20_episodes.json", "adamw5e-4", dmuon, 20),
    )
    seeds = [0, 1, 2]
    for name, a_name, b_runs, episodes in cases:
        committed = json.loads((long4000 / name).read_text())
        a_runs = [long4000 / f"{a_name}_seed{s}" for s in seeds]
        report = compare_training(
            a_runs, b_runs, 4000, names=(a_name, "dmuon"), seeds=seeds, episodes=episodes, resamples=20000
        )
        report = json.loads(json.dumps(report))  # tuples as the committed JSON holds them
        assert report["validation"] == committed["validation"], name
        assert report["success"] == committed["success"], name
        assert report["mean_ratio"] == pytest.approx(committed["mean_ratio"]), name


def test_the_16000_step_adamw_run_begins_as_the_4000_step_run() -> None:
    # docs/study/long16000: the recipe's first cosine ends at step 4000, so the first 4000 steps of a 16000-step
    # run are a 4000-step run's, bit for bit (as that folder's README says of AdamW seed 0): every training and
    # validation loss equal, and the closed loop at step 4000 (20 episodes per task there) equal to the first
    # 20 episodes per task of the 4000-step run's final evaluation (50 per task).
    root = Path(__file__).resolve().parents[2] / "docs" / "study"
    full, short = root / "long16000" / "adamw_seed0", root / "long4000" / "adamw_seed0"

    def losses(run: Path) -> dict[tuple[str, int], float]:
        return {
            (r["split"], r["step"]): r["loss"]
            for r in read_metrics(run / "metrics.jsonl")
            if r.get("split") in ("train", "val") and "loss" in r and r["step"] <= 4000
        }

    full_losses = losses(full)
    assert full_losses == losses(short)
    assert len(full_losses) == 880  # 800 training records (every 5 steps) and 80 validations
    full_run, short_run = load_run(full), load_run(short)
    assert full_run.success[2000] == short_run.success[2000]
    assert full_run.success[4000] == outcomes_at(short_run, 4000, episodes=20)
    assert full_run.success[4000]["reach-v3"] == (5, 20)
