"""Simulated manipulation for closed-loop evaluation and demonstrations (MetaWorld v3).

Environment:     MetaWorldEnv (fast headless rendering, seeded episodes, scripted experts), SimStep,
                 FREE_VIEWS (camera views of our own, framed on the workspace)
Tasks:           available_tasks, parse_tasks, instruction, TASK_INSTRUCTIONS, DEFAULT_TASKS
Demonstrations:  DemoConfig, generate_sim_dataset, ensure_sim_dataset, training_seeds

MetaWorld itself is imported only when an environment is built (pip install -e '.[sim]').
This package never imports vla.models or vla.training.
"""

from vla.sim.demos import DemoConfig, ExpertStats, ensure_sim_dataset, generate_sim_dataset, training_seeds
from vla.sim.metaworld_env import (
    DEFAULT_TASKS,
    FREE_VIEWS,
    TASK_INSTRUCTIONS,
    FreeView,
    MetaWorldEnv,
    SimError,
    SimStep,
    available_tasks,
    instruction,
    parse_tasks,
)

__all__ = [
    "DEFAULT_TASKS",
    "FREE_VIEWS",
    "TASK_INSTRUCTIONS",
    "DemoConfig",
    "ExpertStats",
    "FreeView",
    "MetaWorldEnv",
    "SimError",
    "SimStep",
    "available_tasks",
    "ensure_sim_dataset",
    "generate_sim_dataset",
    "instruction",
    "parse_tasks",
    "training_seeds",
]
