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
