"""The closed-loop harness: interval maths, the expert and baselines, a trained export, its JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vla.eval.closed_loop import (
    ClosedLoopSettings,
    ExpertPolicy,
    RandomPolicy,
    ZeroPolicy,
    evaluate_closed_loop,
    run_episodes,
    wilson_interval,
    write_report,
)
from vla.sim import MetaWorldEnv, SimError

SETTINGS = ClosedLoopSettings(
    cameras=("corner2",), resolution=32, max_episode_steps=120, replan_every=4, parallel_envs=2
)


def test_wilson_interval_matches_reference_values() -> None:
    # Reference values of the Wilson score interval at z = 1.959964 (e.g. statsmodels proportion_confint).
    np.testing.assert_allclose(wilson_interval(0, 10), (0.0, 0.27753), atol=1e-5)
    np.testing.assert_allclose(wilson_interval(10, 10), (0.72247, 1.0), atol=1e-5)
    np.testing.assert_allclose(wilson_interval(5, 10), (0.23659, 0.76341), atol=1e-5)
    np.testing.assert_allclose(wilson_interval(18, 20), (0.69897, 0.97214), atol=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low99, high99 = wilson_interval(5, 10, confidence=0.99)
    assert low99 < 0.23659 and high99 > 0.76341
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(3, 2)


def test_expert_and_baselines_through_the_same_harness(tmp_path) -> None:
    expert = evaluate_closed_loop(
        ExpertPolicy(), ["reach-v3"], 3, 1000, SETTINGS, videos=1, video_dir=tmp_path / "v"
    )
    zero = evaluate_closed_loop(ZeroPolicy(), ["reach-v3"], 2, 1000, SETTINGS)
    random = evaluate_closed_loop(RandomPolicy(0), ["reach-v3"], 2, 1000, SETTINGS)
    (task,) = expert.tasks
    assert task.successes == 3 and task.success_rate == 1.0 and task.episodes == 3
    assert [r.seed for r in task.results] == [1000, 1001, 1002]
    assert task.mean_steps_to_success == pytest.approx(np.mean([r.steps for r in task.results]))
    assert 20 < task.mean_steps_to_success < 120
    assert zero.tasks[0].success_rate == 0.0 and random.tasks[0].success_rate == 0.0
    assert all(r.steps == 120 for r in zero.tasks[0].results)  # ran to the cap
    # the distance success is measured on (reach: tool centre point to goal, success within 5 cm)
    for r in task.results:
        assert r.final_m == r.closest_m <= 0.05 < r.start_m  # it stopped at its first success
    assert task.median_closest_failed_m is None
    (still,) = zero.tasks
    for r in still.results:  # a hand given no motion settles by millimetres, far from the goal
        assert r.closest_m == pytest.approx(r.start_m, abs=1e-2) and r.final_m > 0.05
    assert still.median_closest_failed_m == pytest.approx(np.median([r.closest_m for r in still.results]))
    videos = sorted(p.name for p in (tmp_path / "v").iterdir())
    assert videos == ["reach-v3_seed1000_success.mp4"]
    write_report(expert, tmp_path / "r.json", tmp_path / "r.png")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["policy"] == "expert" and saved["mean_success"] == 1.0
    assert saved["tasks"][0]["ci95"] == pytest.approx(list(wilson_interval(3, 3)))
    assert saved["settings"]["replan_every"] == 4 and (tmp_path / "r.png").stat().st_size > 1000
    assert saved["tasks"][0]["results"][0]["closest_m"] == task.results[0].closest_m


def test_training_seeds_are_refused() -> None:
    with pytest.raises(SimError, match=r"seeds \[5, 6\] of reach-v3 were used for its training"):
        evaluate_closed_loop(
            ZeroPolicy(), ["reach-v3"], 3, 4, SETTINGS, exclude_seeds={"reach-v3": {5, 6, 9}}
        )


def test_trained_export_runs_in_closed_loop(tmp_path, sim_dataset) -> None:
    """A pi0_tiny export + processor.json, as a run writes them, loads and acts through the harness."""
    from vla.data import BatchProcessor, DatasetMetadata, ProcessorConfig
    from vla.eval.policy_runner import load_run_policy
    from vla.models import build_policy
    from vla.training.export import write_export

    policy = build_policy("pi0_tiny", cameras=["corner2"])
    run = tmp_path / "run"
    run.mkdir()
    write_export(policy.state_dict(), policy.config, run)
    processor = BatchProcessor.from_dataset(
        ProcessorConfig(
            camera_map={"observation.images.corner2": "corner2"},
            image_size=policy.config.vision.image_size,
            action_horizon=policy.config.action_horizon,
            uint8_images=True,
        ),
        DatasetMetadata(sim_dataset),
    )
    (run / "processor.json").write_text(json.dumps(processor.state_dict()))
    actor = load_run_policy(run, seed=3)
    for name, tensor in actor.policy.state_dict().items():
        torch.testing.assert_close(tensor, policy.state_dict()[name], rtol=0, atol=0)
    settings = ClosedLoopSettings(
        cameras=("corner2",), resolution=32, max_episode_steps=12, replan_every=5, parallel_envs=2
    )
    report = evaluate_closed_loop(actor, ["reach-v3"], 3, 1000, settings)
    (task,) = report.tasks
    assert (
        report.policy == "run" and task.episodes == 3 and [r.seed for r in task.results] == [1000, 1001, 1002]
    )
    assert all(r.steps == 12 for r in task.results if not r.success)
    # Actions are in env units, and the same episode gets the same actions however it is batched.
    with MetaWorldEnv("reach-v3", ("corner2",), 32) as env:
        obs = env.reset(1001)
        chunk = actor.act([env], [obs])
        assert chunk.shape == (1, policy.config.action_horizon, 4) and np.isfinite(chunk).all()
        np.testing.assert_allclose(actor.act([env], [obs]), chunk, rtol=1e-5, atol=1e-6)


def test_interval_contains_the_rate_and_plots_at_the_ends(tmp_path) -> None:
    from vla.eval.closed_loop import ClosedLoopReport, EpisodeResult, plot_success, task_report

    for n in range(1, 41):
        for k in (0, n):
            low, high = wilson_interval(k, n)
            assert low <= k / n <= high
    results = [EpisodeResult(1000 + i, True, 50) for i in range(20)]
    report = ClosedLoopReport("expert", 1000, SETTINGS, [task_report("reach-v3", results)])
    plot_success({"expert": report}, tmp_path / "s.png")  # 20/20: error bars of zero length, not negative
    assert (tmp_path / "s.png").stat().st_size > 1000


class _ImageDrivenPolicy:
    """Chunks that depend on every pixel it is shown; checks each frame it is given against a fresh
    render of its environment's current state (what it must see), and counts its calls."""

    name = "image-driven"

    def __init__(self) -> None:
        self.calls = 0
        self.stale = 0

    def act(self, envs, observations) -> np.ndarray:
        chunks = []
        for env, obs in zip(envs, observations):
            self.calls += 1
            image = obs["observation.images.corner2"]
            self.stale += not np.array_equal(image, env.render("corner2"))
            self.stale += not np.array_equal(obs["observation.state"], env.state())
            direction = np.array([image[..., 0].mean(), -image[..., 1].mean(), image[..., 2].mean()]) / 255
            chunks.append(np.tile(np.append(direction - 0.4, np.sin(image.sum() / 1e3)), (6, 1)))
        return np.stack(chunks).astype(np.float32)


def test_rendering_only_the_replanning_frame_changes_nothing(monkeypatch) -> None:
    """The harness renders only the frame each chunk is planned from: every chunk is planned from the
    current frame, outcomes equal rendering every step, and at most one frame is rendered per chunk."""
    renders = []
    original_step, original_render = MetaWorldEnv.step, MetaWorldEnv.render
    monkeypatch.setattr(
        MetaWorldEnv, "render", lambda self, camera: renders.append(camera) or original_render(self, camera)
    )
    lazy_policy = _ImageDrivenPolicy()
    lazy = evaluate_closed_loop(lazy_policy, ["push-v3"], 3, 1000, SETTINGS)
    lazy_renders = len(renders) - lazy_policy.calls  # the policy's own check renders once per call

    renders.clear()
    monkeypatch.setattr(MetaWorldEnv, "step", lambda self, action, observe=True: original_step(self, action))
    eager_policy = _ImageDrivenPolicy()
    eager = evaluate_closed_loop(eager_policy, ["push-v3"], 3, 1000, SETTINGS)

    assert lazy_policy.stale == 0 and lazy_policy.calls > 3
    assert [(r.seed, r.success, r.steps) for r in lazy.tasks[0].results] == [
        (r.seed, r.success, r.steps) for r in eager.tasks[0].results
    ]
    # eager: the 3 resets and every step; lazy: the resets and at most one frame per chunk played
    assert len(renders) - eager_policy.calls == sum(r.steps for r in eager.tasks[0].results) + 3
    assert lazy_renders <= lazy_policy.calls + 3 < (len(renders) - eager_policy.calls) / 3


class _ToldPolicy:
    """Moves toward the goal when told 'reach the goal', toward the object otherwise; logs what it was told."""

    name = "told"

    def __init__(self) -> None:
        self.told: list[str] = []

    def act(self, envs, observations) -> np.ndarray:
        chunks = []
        for env, observation in zip(envs, observations):
            self.told.append(observation["task"])
            where = env.positions()
            target = where["goal"] if observation["task"] == "reach the goal" else where["object"]
            direction = np.clip((target - where["tcp"]) * 100, -1, 1)
            chunks.append(np.tile(np.append(direction, -1.0), (4, 1)))
        return np.stack(chunks).astype(np.float32)


def test_run_episodes_gives_the_instruction_and_shows_every_step() -> None:
    """instruction= replaces the task's text in every observation; observer sees each reset and step."""
    settings = ClosedLoopSettings(cameras=("corner2",), resolution=16, max_episode_steps=40, replan_every=4)
    for text in ("reach the goal", "push the puck to the goal"):
        policy, seen = _ToldPolicy(), []

        def observe(env, seen=seen) -> None:
            where = env.positions()
            seen.append((env.seed, env.steps, np.linalg.norm(where["tcp"] - where["goal"]),
                         np.linalg.norm(where["tcp"] - where["object"])))  # fmt: skip

        results, _ = run_episodes(
            policy, "reach-v3", [1000, 1001], settings, instruction=text, observer=observe
        )
        assert set(policy.told) == {text}
        for r in results:  # steps 0 (the reset) .. the last, once each
            assert [s for seed, s, *_ in seen if seed == r.seed] == list(range(r.steps + 1))
        goal = {seed: [d for s2, _, d, _ in seen if s2 == seed] for seed in (1000, 1001)}
        obj = {seed: [d for s2, _, _, d in seen if s2 == seed] for seed in (1000, 1001)}
        if text == "reach the goal":  # toward the goal: success, the tcp within 5 cm of it at the end
            assert all(r.success for r in results)
            assert all(goal[s][-1] <= 0.05 < goal[s][0] for s in goal)
        else:  # toward the puck: the tcp ends within 3 cm of it, never within 5 cm of the goal here
            assert not any(r.success for r in results)
            assert all(obj[s][-1] < 0.03 < obj[s][0] for s in obj)
