"""scripts/diagnose_policy.py's copycat check routes the first frame's and the later inputs as it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from vla.sim import MetaWorldEnv

ROOT = Path(__file__).resolve().parents[2]


def _diagnose_module():
    spec = importlib.util.spec_from_file_location("diagnose_policy", ROOT / "scripts" / "diagnose_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Copycat:
    """Acts on the hand's offset from the start pose alone, as a copycat policy does."""

    def __init__(self, start: np.ndarray) -> None:
        self.start = start

    def act(self, envs, observations) -> np.ndarray:
        offset = observations[0]["observation.state"][:3] - self.start[:3]
        return np.concatenate([np.clip(offset * 50.0, -1, 1), [0.0]])[None, None]


def test_the_copycat_check_tells_a_policy_that_reads_the_state_alone() -> None:
    diagnose = _diagnose_module()
    with MetaWorldEnv("reach-v3", ("corner2",), 32) as env:
        actor = _Copycat(env.reset(0)["observation.state"].copy())
        result = diagnose.state_or_image(actor, env, list(range(1000, 1012)), later=10)
    assert set(result) == {"later_images_first_state", "first_images_later_state"}
    # With the later state it follows the expert in x and z; with the start state its action never varies.
    later_state = result["first_images_later_state"]["corr"]
    assert later_state[0] > 0.8 and later_state[2] > 0.8
    assert result["later_images_first_state"]["corr"] == [None, None, None, None]
    assert all(len(check["mae"]) == 4 for check in result.values())
