"""The MetaWorld wrapper: seeded determinism, observations, the experts, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

from vla.sim import MetaWorldEnv, SimError, available_tasks, instruction, parse_tasks


def _episode(env: MetaWorldEnv, seed: int, steps: int) -> list[dict]:
    observations = [env.reset(seed)]
    for _ in range(steps):
        observations.append(env.step(env.expert_action()).observation)
    return observations


def test_same_seed_same_episode_in_separate_instances() -> None:
    with (
        MetaWorldEnv("push-v3", ("corner2", "topview"), 32) as a,
        MetaWorldEnv("push-v3", ("corner2", "topview"), 32) as b,
    ):
        first, second = _episode(a, 7, 5), _episode(b, 7, 5)
        for x, y in zip(first, second):
            assert x.keys() == y.keys()
            np.testing.assert_array_equal(x["observation.state"], y["observation.state"])
            np.testing.assert_array_equal(x["observation.images.corner2"], y["observation.images.corner2"])
            np.testing.assert_array_equal(x["observation.images.topview"], y["observation.images.topview"])
        # Another seed moves the puck and the goal: the images differ.
        other = a.reset(8)
        assert not np.array_equal(other["observation.images.topview"], first[0]["observation.images.topview"])


def test_observation_layout_and_ranges() -> None:
    with MetaWorldEnv("reach-v3", ("corner2",), 48) as env:
        obs = env.reset(0)
        assert set(obs) == {"observation.state", "observation.images.corner2", "task"}
        assert obs["observation.state"].shape == (4,) and obs["observation.state"].dtype == np.float32
        image = obs["observation.images.corner2"]
        assert image.shape == (48, 48, 3) and image.dtype == np.uint8 and image.std() > 10
        assert obs["task"] == instruction("reach-v3") == "reach the goal"
        action = env.expert_action()
        assert action.shape == (4,) and action.dtype == np.float32 and np.abs(action).max() <= 1.0


def test_positions_name_what_metaworld_measures() -> None:
    """positions(): hand = the state's, tcp = MetaWorld's tcp (4-5 cm below the hand), object = the task's
    object (push's puck), goal = its target; copies, and refused before a reset."""
    with MetaWorldEnv("push-v3", ("corner2",), 16) as env:
        with pytest.raises(SimError, match="reset"):
            env.positions()
        obs = env.reset(7)
        where = env.positions()
        np.testing.assert_allclose(where["hand"], obs["observation.state"][:3], atol=1e-6)
        np.testing.assert_array_equal(where["tcp"], env._env.tcp_center)
        np.testing.assert_array_equal(where["object"], env._env._get_pos_objects())
        np.testing.assert_array_equal(where["goal"], env._env._target_pos)
        assert 0.03 < where["hand"][2] - where["tcp"][2] < 0.06
        assert np.abs(where["hand"][:2] - where["tcp"][:2]).max() < 0.01
        where["goal"][:] = 0
        np.testing.assert_array_equal(env.positions()["goal"], env._env._target_pos)  # a copy was changed
        for _ in range(5):
            env.step(np.array([0, 0, -1, 0], dtype=np.float32), observe=False)
        assert env.positions()["hand"][2] < obs["observation.state"][2] - 0.01  # it follows the state


def test_expert_succeeds_and_done_at_success() -> None:
    with MetaWorldEnv("reach-v3", ("corner2",), 32, max_episode_steps=150) as env:
        env.reset(3)
        step = None
        while step is None or not step.done:
            step = env.step(env.expert_action())
        assert step.success and env.steps < 150


@pytest.mark.parametrize("task", ["reach-v3", "reach-wall-v3"])
def test_reach_expert_aimed_at_the_tcp_settles_on_the_goal(task: str) -> None:
    """MetaWorld's reach expert settles with the hand on the goal, the tool centre point (what success
    measures) 4.4 cm off it, just inside the 5 cm radius; aim_tcp=True brings the tcp within 1 cm."""
    with MetaWorldEnv(task, ("corner2",), 16, max_episode_steps=150) as env:
        for seed in (3, 4):
            settled = {}
            for aim in (False, True):
                env.reset(seed)
                for _ in range(120):
                    env.step(env.expert_action(aim_tcp=aim), observe=False)
                settled[aim] = np.linalg.norm(env._env.tcp_center - env._env._target_pos)
            assert 0.035 < settled[False] <= 0.05 and settled[True] < 0.01


def test_aim_tcp_leaves_other_experts_alone() -> None:
    with MetaWorldEnv("push-v3", ("corner2",), 16) as env:
        env.reset(5)
        for _ in range(10):
            action = env.expert_action()
            np.testing.assert_array_equal(action, env.expert_action(aim_tcp=True))
            env.step(action, observe=False)


def test_cap_ends_episode_and_bad_actions_raise() -> None:
    with MetaWorldEnv("reach-v3", ("corner2",), 32, max_episode_steps=3) as env:
        with pytest.raises(SimError, match="reset"):
            env.step(np.zeros(4))
        env.reset(0)
        with pytest.raises(SimError, match="4 values"):
            env.step(np.zeros(3))
        with pytest.raises(SimError, match="non-finite action"):
            env.step(np.array([0.0, np.nan, 0.0, 0.0]))
        results = [env.step(np.zeros(4)) for _ in range(3)]
        assert [r.done for r in results] == [False, False, True] and not results[-1].success
        with pytest.raises(SimError, match="already ended"):
            env.step(np.zeros(4))


def test_unknown_names_are_named() -> None:
    assert "pick-place-v3" in available_tasks()
    with pytest.raises(SimError, match="did you mean 'reach-v3'"):
        parse_tasks("reach-v2")
    with pytest.raises(SimError, match="unknown camera"):
        MetaWorldEnv("reach-v3", ("front",))
    with pytest.raises(SimError, match="seed"):
        MetaWorldEnv("reach-v3", ("corner2",), 32).reset(-1)


def test_triton_loads_after_rendering_started() -> None:
    """triton's bundled LLVM segfaults when first loaded after Mesa's llvmpipe; the env preloads it."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = (
        "from vla.sim import MetaWorldEnv\n"
        "env = MetaWorldEnv('reach-v3', ('corner2',), 16)\n"
        "env.reset(0)\n"
        "import torch._dynamo\n"  # imports triton lazily, as an evaluation may
        "env.close()\n"
        "print('rendered then imported')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "rendered then imported" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("task", ["drawer-open-v3", "reach-v3"])
def test_first_frame_after_reset_shows_the_new_layout(task: str) -> None:
    """MetaWorld's reset moves the goal and the drawer after its last mj_forward; the first image and
    observation after reset(seed) must already show seed's layout (a re-render after a forward)."""
    import mujoco

    with MetaWorldEnv(task, ("corner2", "topview"), 48) as env:
        env.reset(5)  # another layout first: a stale frame would show this one
        first = env.reset(6)
        raw = env._raw.copy()
        mujoco.mj_forward(env._env.model, env._env.data)
        for camera in ("corner2", "topview"):
            np.testing.assert_array_equal(first[f"observation.images.{camera}"], env.render(camera))
        np.testing.assert_array_equal(raw[:18], env._env._get_curr_obs_combined_no_goal())
        np.testing.assert_array_equal(raw[18:36], raw[:18])  # reset stacks the current frame twice
    with MetaWorldEnv(task, ("corner2", "topview"), 48) as fresh:  # and equals a fresh env's frame
        np.testing.assert_array_equal(
            fresh.reset(6)["observation.images.topview"], first["observation.images.topview"]
        )


def _goal_pixels(image: np.ndarray, channel: int = 1) -> np.ndarray:
    """(H, W) mask of a goal marker of one pure colour: green (1) for push-v3, blue (2) for pick-place-v3;
    nothing else in those scenes is."""
    values = [image[..., i].astype(int) for i in range(3)]
    return (values[channel] > 150) & np.all([values[i] < 100 for i in range(3) if i != channel], axis=0)


def test_side_view_reads_the_goal_height_that_the_other_views_mix_up() -> None:
    """pick-place's goal floats 5-30 cm above the table. A linear map from the marker's pixel position to
    the goal's height, fitted on 30 seeds, predicts 10 others with R² 0.99 in workspace_side, and only 0.69
    in topview and 0.79 in workspace (measured; there image rows mix height with depth)."""
    cameras = ("topview", "workspace", "workspace_side")
    positions: dict[str, list[tuple[float, float, float]]] = {c: [] for c in cameras}
    heights = []
    with MetaWorldEnv("pick-place-v3", cameras, 64) as env:
        for seed in range(40):
            obs = env.reset(seed)
            heights.append(env.layout(seed)[-1])  # the layout ends with the goal's (x, y, z)
            for camera in cameras:
                rows, cols = np.nonzero(_goal_pixels(obs[f"observation.images.{camera}"], channel=2))
                assert len(rows) >= 2, (camera, seed)
                positions[camera].append((rows.mean(), cols.mean(), 1.0))
    z = np.asarray(heights)
    r2 = {}
    for camera in cameras:
        design = np.asarray(positions[camera])
        coef, *_ = np.linalg.lstsq(design[:30], z[:30], rcond=None)
        residual = design[30:] @ coef - z[30:]
        r2[camera] = 1 - (residual**2).sum() / ((z[30:] - z[30:].mean()) ** 2).sum()
    assert r2["workspace_side"] > 0.97, r2
    assert r2["topview"] < 0.9 and r2["workspace"] < 0.9, r2


def test_workspace_views_show_the_goal_many_times_larger_and_track_it() -> None:
    with MetaWorldEnv("push-v3", ("topview", "workspace", "workspace_top"), 64) as env:
        for seed in (0, 1):
            obs = env.reset(seed)
            pixels = {c: int(_goal_pixels(obs[f"observation.images.{c}"]).sum()) for c in env.cameras}
            # measured: topview 2-4 px, workspace 14-16, workspace_top 12-13 (seeds 0-4)
            assert 1 <= pixels["topview"] <= 5, pixels
            assert pixels["workspace"] >= 3 * pixels["topview"] and pixels["workspace"] >= 10, pixels
            assert pixels["workspace_top"] >= 3 * pixels["topview"] and pixels["workspace_top"] >= 10, pixels
        # Seed 0 and 1 put the goal ~20 px apart in the workspace view (same-seed frames are identical).
        columns = [
            np.nonzero(_goal_pixels(env.reset(s)["observation.images.workspace"]))[1].mean() for s in (0, 1)
        ]
        assert abs(columns[0] - columns[1]) > 10, columns
        np.testing.assert_array_equal(
            env.reset(1)["observation.images.workspace"], env.reset(1)["observation.images.workspace"]
        )
