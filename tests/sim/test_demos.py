"""Expert demonstrations written as LeRobot v3.0 datasets, read back by our reader."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _sim_fixtures import sim_demos

from vla.data import DatasetError, DatasetMetadata, LeRobotDataset
from vla.sim import DemoConfig, MetaWorldEnv, ensure_sim_dataset, training_seeds


def test_dataset_has_the_declared_features_and_episodes(sim_dataset) -> None:
    meta = DatasetMetadata(sim_dataset)
    assert meta.camera_keys == ["observation.images.corner2", "observation.images.topview"]
    assert tuple(meta.shape("observation.state")) == (4,)
    assert tuple(meta.shape("action")) == (4,)
    assert meta.info["fps"] == 80 and meta.info["total_episodes"] == 4
    marker = json.loads((sim_dataset / "meta/metaworld.json").read_text())
    assert [e["task"] for e in marker["episodes"]] == ["reach-v3"] * 2 + ["button-press-topdown-v3"] * 2
    assert all(s["success_rate"] == 1.0 and s["kept"] == 2 for s in marker["expert"])
    assert training_seeds(sim_dataset) == {"reach-v3": {5, 6}, "button-press-topdown-v3": {5, 6}}
    assert meta.info["total_frames"] == sum(e["length"] for e in marker["episodes"])


def test_frames_replay_the_recorded_seed(sim_dataset) -> None:
    """Frame 0 of episode 0 is reset(seed) of its task; its action is the expert's."""
    dataset = LeRobotDataset(sim_dataset)
    item = dataset[0]
    marker = json.loads((sim_dataset / "meta/metaworld.json").read_text())
    assert item["task"] == "reach the goal"
    with MetaWorldEnv("reach-v3", ("corner2",), 32) as env:
        obs = env.reset(marker["episodes"][0]["seed"])
        np.testing.assert_allclose(item["observation.state"].numpy(), obs["observation.state"], atol=1e-6)
        np.testing.assert_allclose(item["action"].numpy(), env.expert_action(), atol=1e-6)
        decoded = (item["observation.images.corner2"].permute(1, 2, 0).numpy() * 255).astype(np.float32)
        assert (
            np.abs(decoded - obs["observation.images.corner2"]).mean() < 8
        )  # H.264 at crf 18 is lossy (mean error ~4 levels)


def test_other_settings_are_never_overwritten(sim_dataset) -> None:
    info = sim_dataset / "meta/info.json"
    stamp = info.stat().st_mtime_ns
    assert ensure_sim_dataset(sim_dataset, sim_demos()) == sim_dataset and info.stat().st_mtime_ns == stamp
    other = sim_demos()
    other.episodes = 3
    with pytest.raises(DatasetError, match=r"other settings \(episodes: 2 -> 3\).*refusing to overwrite"):
        ensure_sim_dataset(sim_dataset, other)
    assert info.stat().st_mtime_ns == stamp


def test_failed_expert_episodes_are_not_kept(tmp_path) -> None:
    """A step cap below what the expert needs: nothing succeeds, and the error says what to change."""
    from vla.sim import SimError

    config = DemoConfig(
        tasks=["drawer-open-v3"], episodes=1, resolution=32, cameras=["corner2"], max_episode_steps=5
    )
    with pytest.raises(SimError, match=r"succeeded on only 0 of 2 seeds.*max_episode_steps"):
        ensure_sim_dataset(tmp_path / "d", config)
    assert not (tmp_path / "d").exists()


def test_dart_noise_perturbs_the_executed_actions_and_keeps_clean_labels(tmp_path) -> None:
    """action_noise > 0: each frame's label is the expert's action at that (perturbed) state, the
    states leave the noiseless path, a seed replays the same episode, and noiseless settings keep their
    old JSON (so recordings made before the setting stay reusable)."""
    from vla.sim.demos import _rollout

    assert "action_noise" not in DemoConfig().to_json()
    assert DemoConfig(action_noise=0.3).to_json()["action_noise"] == 0.3
    with pytest.raises(Exception, match=r"action_noise must be in \[0, 1\]"):
        DemoConfig(action_noise=-0.1)
    with MetaWorldEnv("reach-v3", ("corner2",), 16) as env:
        clean, ok = _rollout(env, 3)
        noisy, ok_noisy = _rollout(env, 3, 0.3)
        again, _ = _rollout(env, 3, 0.3)
        assert ok and ok_noisy
        # Labels are the expert's clean action at the recorded state (replayed: reset, then the noisy steps).
        env.reset(3)
        rng = np.random.default_rng([3, 0xDA27])
        for frame in noisy[:10]:
            np.testing.assert_allclose(frame["observation.state"], env.state(), atol=1e-6)
            label = env.expert_action()
            np.testing.assert_array_equal(frame["action"], label)
            executed = label.copy()
            executed[:3] += rng.normal(0.0, 0.3, size=3).astype(np.float32)
            env.step(executed)
    states = lambda frames: np.stack([f["observation.state"] for f in frames[:10]])  # noqa: E731
    assert np.abs(states(noisy) - states(clean)).max() > 1e-3  # off the noiseless path
    np.testing.assert_array_equal(states(noisy), states(again))  # seeded
    assert len(noisy) != len(clean) or not np.array_equal(states(noisy), states(clean))


def test_random_hand_starts_move_the_first_frame_and_keep_the_layout(tmp_path) -> None:
    """hand_start_noise > 0: each episode's hand starts at its seeded offset from MetaWorld's start
    (x, y in [-r, r], z in [0, r]), the object and goal layout is the seed's own, the expert still
    succeeds, a seed replays, the next plain reset starts where MetaWorld does, and settings without it
    keep their old JSON."""
    from vla.sim.demos import _rollout, hand_start_offset

    assert hand_start_offset(4, 0.0) is None
    assert "hand_start_noise" not in DemoConfig().to_json()
    assert DemoConfig(hand_start_noise=0.1).to_json()["hand_start_noise"] == 0.1
    with pytest.raises(Exception, match=r"hand_start_noise must be in \[0, 0.2\]"):
        DemoConfig(hand_start_noise=0.5)
    offsets = np.stack([hand_start_offset(s, 0.1) for s in range(200)])
    assert (
        (np.abs(offsets[:, :2]) <= 0.1).all() and (offsets[:, 2] >= 0).all() and (offsets[:, 2] <= 0.1).all()
    )
    assert offsets.std(0).min() > 0.02  # spread over the box, not a constant
    with MetaWorldEnv("reach-v3", ("corner2",), 16) as env:
        home = env.reset(4)["observation.state"][:3]
        goal = env._raw[36:39].copy()
        frames, ok = _rollout(env, 4, hand_start_noise=0.1)
        again, _ = _rollout(env, 4, hand_start_noise=0.1)
        assert ok  # the expert starts from anywhere
        start = frames[0]["observation.state"][:3]
        # The hand reaches its offset start (the mocap pulls it there within a few mm).
        np.testing.assert_allclose(start - home, hand_start_offset(4, 0.1), atol=5e-3)
        np.testing.assert_array_equal(env._raw[36:39], goal)  # same goal as the plain reset of seed 4
        np.testing.assert_array_equal(
            frames[0]["observation.images.corner2"], again[0]["observation.images.corner2"]
        )
        assert len(frames) == len(again)
        np.testing.assert_array_equal(env.reset(4)["observation.state"][:3], home)  # the offset is not kept
        with pytest.raises(Exception, match="hand_offset must be 3 finite metres"):
            env.reset(4, np.array([0.0, np.nan, 0.0]))


def test_steps_after_success_extend_an_episode_past_its_success(tmp_path) -> None:
    """steps_after_success=N: the episode's first frames are those of the plain recording, then N more
    expert steps (every one still a success, and the expert's actions shrink: it settles at the goal);
    N is capped by max_episode_steps; settings without it keep their old JSON."""
    from vla.sim.demos import _rollout

    assert "steps_after_success" not in DemoConfig().to_json()
    assert DemoConfig(steps_after_success=20).to_json()["steps_after_success"] == 20
    for bad in (-1, 200, 1.5):
        with pytest.raises(Exception, match=r"steps_after_success must be"):
            DemoConfig(steps_after_success=bad)
    with MetaWorldEnv("reach-v3", ("corner2",), 16) as env:
        plain, ok = _rollout(env, 3)
        held, held_ok = _rollout(env, 3, steps_after_success=20)
        assert ok and held_ok and len(held) == len(plain) + 20
        for a, b in zip(plain, held):
            np.testing.assert_array_equal(a["action"], b["action"])
            np.testing.assert_array_equal(a["observation.images.corner2"], b["observation.images.corner2"])
        # after the first success the expert stays at the goal: still a success, ever smaller moves
        env.reset(3)
        for frame in held[: len(plain)]:
            env.step(frame["action"], observe=False)
        for frame in held[len(plain) :]:
            assert env.step(frame["action"], observe=False).success
        moves = np.abs(np.stack([f["action"][:3] for f in held[len(plain) - 1 :]])).max(1)
        assert moves[-1] < 0.5 * moves[0]
        capped, capped_ok = _rollout(env, 3, steps_after_success=199)
        assert capped_ok and len(capped) == env.max_episode_steps == 200


def test_expert_aims_tcp_is_a_recorded_setting_that_changes_reach_labels() -> None:
    """expert_aims_tcp: the reach labels are the tcp-aimed expert's (the episode reaches success sooner,
    as it heads for the middle of the success sphere); settings without it keep their old JSON."""
    from vla.sim.demos import _rollout

    assert "expert_aims_tcp" not in DemoConfig().to_json()
    assert DemoConfig(expert_aims_tcp=True).to_json()["expert_aims_tcp"] is True
    with pytest.raises(Exception, match=r"expert_aims_tcp must be true or false"):
        DemoConfig(expert_aims_tcp="yes")
    with MetaWorldEnv("reach-v3", ("corner2",), 16) as env:
        plain, ok = _rollout(env, 3)
        aimed, aimed_ok = _rollout(env, 3, expert_aims_tcp=True)
        assert ok and aimed_ok and len(aimed) < len(plain)
        np.testing.assert_array_equal(plain[0]["observation.state"], aimed[0]["observation.state"])
        env.reset(3)
        np.testing.assert_array_equal(aimed[0]["action"], env.expert_action(aim_tcp=True))
        assert not np.array_equal(aimed[0]["action"], plain[0]["action"])
