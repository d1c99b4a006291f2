"""The simulation tests' small MetaWorld recording, as a DemoConfig and as trainer overrides."""

from __future__ import annotations

from vla.sim import DemoConfig


def sim_demos() -> DemoConfig:
    """Two reach-v3 and two button-press-topdown-v3 expert episodes, data=metaworld's cameras at 32 px."""
    return DemoConfig(
        tasks=["reach-v3", "button-press-topdown-v3"],
        episodes=2,
        resolution=32,
        cameras=["corner2", "topview"],
        seed=5,
    )


# The same settings as trainer overrides (data=metaworld reuses the recording only if they match).
SIM_DATA_OVERRIDES = [
    "data=metaworld",
    "data.metaworld.tasks=[reach-v3,button-press-topdown-v3]",
    "data.metaworld.episodes=2",
    "data.metaworld.resolution=32",
    "data.metaworld.seed=5",
]
