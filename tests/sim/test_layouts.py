"""Episode layouts per seed and their distance to the training layouts."""

from __future__ import annotations

import numpy as np

from vla.sim import MetaWorldEnv
from vla.sim.layouts import layout_report, layouts, nearest_distances, randomised_dims


def test_a_layout_is_a_function_of_the_seed_and_matches_the_episode() -> None:
    first = layouts("push-v3", [3, 4, 3])
    np.testing.assert_array_equal(first[0], first[2])
    assert not np.array_equal(first[0], first[1])
    with MetaWorldEnv("push-v3", ("corner2",), 8) as env:
        env.reset(4)
        np.testing.assert_array_equal(env._env._last_rand_vec, first[1])  # what reset(4) plays


def test_tasks_randomise_different_dimensions() -> None:
    assert randomised_dims(layouts("drawer-open-v3", range(6))) == 1
    assert randomised_dims(layouts("button-press-topdown-v3", range(6))) == 2
    assert randomised_dims(layouts("reach-v3", range(6))) >= 5


def test_nearest_distances_and_the_report() -> None:
    train = np.array([[0.0, 0.0], [1.0, 0.0]])
    evaluated = np.array([[0.1, 0.0], [1.0, 0.3], [0.5, 0.0]])
    np.testing.assert_allclose(nearest_distances(evaluated, train), [0.1, 0.3, 0.5])
    report = layout_report("drawer-open-v3", [100, 101], [0, 1, 2])
    near = report["nearest_training_layout_m"]
    assert report["randomised_dims"] == 1 and report["training_layouts"] == 3
    assert 0 <= near["min"] <= near["median"] <= near["max"] < 0.5
    assert layout_report("drawer-open-v3", [1], [0, 1])["nearest_training_layout_m"]["max"] == 0.0
