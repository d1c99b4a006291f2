"""MetaWorld tasks as closed-loop environments for VLA policies, with their scripted experts.

One `MetaWorldEnv` wraps one MetaWorld v3 task (the goal-observable variant, which its expert needs):

    reset(seed) -> observation        step(action (4,)) -> SimStep(observation, success, done)

`step(action, observe=False)` skips the observation (None): rendering is ~97% of a step's cost here
(21 ms for two 64-px cameras against 0.5 ms of physics), and a chunked policy only looks at the frame
it replans from.

Observations are dicts keyed like the LeRobot datasets made from them (vla.sim.demos), so the data
processor turns them into a policy's input unchanged:
    "observation.state"            (4,) float32: hand x, y, z (metres) and gripper opening
    "observation.images.<camera>"  (R, R, 3) uint8, upright
    "task"                         the task's language instruction
Actions are (4,) in [-1, 1]: dx, dy, dz (about 1 cm per unit) and gripper effort (-1 open, +1 close);
anything outside is clipped, as MetaWorld's own experts slightly exceed the range.

Why not `env.render()`: MetaWorld's renderer multisamples 4x and draws a 4096-px shadow map, ~150 ms
a frame here at any resolution; our own `mujoco.Renderer` without multisampling, shadows or
reflections draws a 64x64 frame in ~7 ms (see shared/reference/sim.md).

First frame: MetaWorld 3.1.1's reset leaves the goal site and the task bodies where the previous reset
put them until the next `mj_forward`; `reset` runs one, so the first image and observation of an episode
show its own layout (datasets recorded before this fix carry the stale frame: vla.sim.demos versions them).

Reach's expert: MetaWorld's reach experts (TCP_GOAL_TASKS) drive the hand position of the observation
onto the goal, but success is the distance of the tool centre point (between the fingertips, 4.5 cm
below that hand position) to the goal, <= 5 cm: the expert settles 4.3 cm from the goal on average (at
most 4.7 cm, 10 seeds), just inside the radius, so its demonstrations show no margin.
`expert_action(aim_tcp=True)` steers the tool centre point onto the goal instead (measured: it settles
within 1 cm of it, tests/sim/test_metaworld_env.py).

Seeding: MetaWorld ignores `reset(seed=...)`, and goal-observable envs freeze object and goal positions
after construction. `reset(seed)` unfreezes them and seeds the env's generator, so one seed gives
bit-identical observations and images in any env instance, and different seeds different layouts.

This package never imports vla.models or vla.training; vla.eval joins policies and simulators.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

# Headless OpenGL (Mesa's software EGL on CPU machines); must be chosen before mujoco is imported.
os.environ.setdefault("MUJOCO_GL", "egl")

# The instruction a policy is given for each task (MetaWorld has none of its own).
TASK_INSTRUCTIONS: dict[str, str] = {
    "reach-v3": "reach the goal",
    "push-v3": "push the puck to the goal",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "drawer-open-v3": "open the drawer",
    "drawer-close-v3": "close the drawer",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-v3": "press the button",
    "door-open-v3": "open the door",
    "window-open-v3": "open the window",
    "window-close-v3": "close the window",
    "peg-insert-side-v3": "insert the peg into the hole",
}
DEFAULT_TASKS = ("reach-v3", "push-v3", "pick-place-v3", "drawer-open-v3", "button-press-topdown-v3")
METAWORLD_CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV")


@dataclass(frozen=True)
class FreeView:
    """A MuJoCo free camera (mjvCamera): it looks at `lookat` (metres, world frame) from `distance` metres,
    `azimuth` degrees around the vertical (-90: from +y, the far side of the table, towards the robot) and
    `elevation` degrees (negative: looking down), with the model's vertical field of view (45 degrees)."""

    lookat: tuple[float, float, float]
    distance: float
    azimuth: float
    elevation: float


# Views of our own, framed on the workspace. MetaWorld's cameras show the whole scene: at 64 px, corner2
# and topview spend about 2 cm on a pixel, so the goal marker of reach / push / pick-place is 1-2 px and
# the puck 2-3 px, and topview is mostly the arm. These frame the region the five default tasks use
# (x +-0.15, y 0.55-0.95, z 0-0.3 m: hand start, objects, goals, drawer, button) at about 1 cm a pixel,
# from the far side of the table, so the arm does not hide what is in front of it.
FREE_VIEWS: dict[str, FreeView] = {
    # from the far side, 45 degrees down: planar position and height, every task's object in view
    "workspace": FreeView(lookat=(0.0, 0.72, 0.1), distance=0.75, azimuth=-90.0, elevation=-45.0),
    # straight down over the table (1 degree off vertical, where azimuth is still defined)
    "workspace_top": FreeView(lookat=(0.0, 0.72, 0.05), distance=0.75, azimuth=-90.0, elevation=-89.0),
    # from the side (+x), 15 degrees down: a goal's height is its image row, which no other view gives
    # directly (height is the axis every goal probe reads worst from corner2 / topview / workspace)
    "workspace_side": FreeView(lookat=(0.0, 0.72, 0.12), distance=0.7, azimuth=180.0, elevation=-15.0),
}
CAMERAS = METAWORLD_CAMERAS + tuple(FREE_VIEWS)
# MetaWorld's corner cameras render upside down.
_UPSIDE_DOWN = frozenset({"corner", "corner2", "corner3", "corner4"})
STATE_NAMES = ["hand_x", "hand_y", "hand_z", "gripper"]
ACTION_NAMES = ["dx", "dy", "dz", "gripper"]
STATE_DIM, ACTION_DIM = len(STATE_NAMES), len(ACTION_NAMES)
MAX_PATH_LENGTH = 500  # MetaWorld's own episode cap
# Tasks whose success is the tool centre point within 5 cm of the goal and whose expert steers the
# hand onto the goal (module docstring, "Reach's expert").
TCP_GOAL_TASKS = ("reach-v3", "reach-wall-v3")
CONTROL_FPS = 80  # MetaWorld steps 5 x 2.5 ms of simulation per action


class SimError(RuntimeError):
    """A simulator problem the user can fix (unknown task or camera, metaworld not installed)."""


@dataclass
class SimStep:
    """What one `MetaWorldEnv.step` returns. done: success, or the episode cap was reached.
    observation: None when the step was asked not to observe. distance: MetaWorld's `obj_to_target` (m),
    the distance its success is measured on (reach: the tool centre point to the goal; push / pick-place:
    the puck to the goal; drawer-open: the handle to its open position; button-press: the button's travel
    left); NaN for a task whose info lacks it."""

    observation: dict[str, Any] | None
    success: bool
    done: bool
    distance: float = math.nan


def _preload_triton() -> None:
    """Load triton (when installed) before the first GL context: triton bundles its own LLVM, and loading
    it after Mesa's software renderer (llvmpipe, also LLVM) has started segfaults the process, e.g.
    when torch imports torch._dynamo lazily during an evaluation. The other order is safe."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        import triton  # noqa: F401


def _import_metaworld() -> tuple[Any, Any, Any]:
    _preload_triton()
    try:
        import mujoco
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE
        from metaworld.policies import ENV_POLICY_MAP
    except ImportError as exc:
        raise SimError(
            f"MetaWorld is not installed ({exc}); install the simulation extra: pip install -e '.[sim]'"
        ) from exc
    return mujoco, ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE, ENV_POLICY_MAP


def available_tasks() -> list[str]:
    """Every MetaWorld v3 task name that has an environment and a scripted expert."""
    _, envs, experts = _import_metaworld()
    return sorted(name for name in experts if f"{name}-goal-observable" in envs)


def instruction(task: str) -> str:
    """The language instruction of a task ('reach-v3' -> 'reach the goal'); a generic one if unlisted."""
    return TASK_INSTRUCTIONS.get(task, task.removesuffix("-v3").replace("-", " "))


def parse_tasks(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """'reach-v3,push-v3' or a list -> validated task names (error names the unknown ones)."""
    tasks = [t.strip() for t in spec.split(",")] if isinstance(spec, str) else [str(t) for t in spec]
    tasks = [t for t in tasks if t]
    if not tasks:
        raise SimError("no MetaWorld task given; pass e.g. --tasks reach-v3,push-v3")
    known = available_tasks()
    unknown = [t for t in tasks if t not in known]
    if unknown:
        import difflib

        hints = {t: difflib.get_close_matches(t, known, n=1) for t in unknown}
        fix = "; ".join(f"{t!r}: did you mean {h[0]!r}?" for t, h in hints.items() if h)
        raise SimError(f"unknown MetaWorld task(s) {unknown}. {fix} Known tasks: {', '.join(known)}")
    if len(set(tasks)) != len(tasks):
        raise SimError(f"a task is listed twice in {tasks}")
    return tasks


class MetaWorldEnv:
    """One MetaWorld v3 task with fast headless rendering and its scripted expert.

    task: e.g. "pick-place-v3" (see `available_tasks()`).
    cameras: cameras to render, each (resolution, resolution, 3) uint8: MetaWorld's own (METAWORLD_CAMERAS)
        or our workspace views (FREE_VIEWS).
    resolution: image height = width in pixels.
    max_episode_steps: `step` reports done after this many steps (at most MetaWorld's 500).

    `instruction` is the text observations carry as "task": the task's own (`instruction(task)`) unless
    replaced, e.g. to test whether a policy follows it (vla.eval.closed_loop.run_episodes).
    """

    def __init__(
        self,
        task: str,
        cameras: tuple[str, ...] | list[str] = ("corner2",),
        resolution: int = 64,
        max_episode_steps: int = 200,
    ) -> None:
        mujoco, envs, experts = _import_metaworld()
        parse_tasks([task])
        unknown = [c for c in cameras if c not in CAMERAS]
        if unknown or not cameras:
            raise SimError(
                f"unknown camera(s) {list(unknown) or '(none given)'}; MetaWorld has {list(METAWORLD_CAMERAS)}"
                f" and vla.sim adds the workspace views {list(FREE_VIEWS)}"
            )
        if not isinstance(resolution, int) or resolution < 8:
            raise SimError(f"resolution must be an int >= 8 pixels, got {resolution!r}")
        if not 1 <= max_episode_steps <= MAX_PATH_LENGTH:
            raise SimError(f"max_episode_steps must be in [1, {MAX_PATH_LENGTH}], got {max_episode_steps}")
        self.task = task
        self.instruction = instruction(task)
        self.cameras = tuple(cameras)
        self.resolution = resolution
        self.max_episode_steps = max_episode_steps
        self._mujoco = mujoco
        # MetaWorld seeds numpy's global generator while it builds an env; keep the caller's stream.
        state = np.random.get_state()
        try:
            self._env = envs[f"{task}-goal-observable"]()
        finally:
            np.random.set_state(state)
        self._env._freeze_rand_vec = False  # new object/goal positions at each reset ...
        self._env.seeded_rand_vec = True  # ... drawn from the env's own seeded generator
        self._expert = experts[task]()
        model = self._env.model
        model.vis.quality.offsamples = 0  # no multisampling; must precede the Renderer
        try:
            self._renderer = mujoco.Renderer(model, resolution, resolution)
        except mujoco.FatalError as exc:
            raise SimError(
                f"mujoco cannot render offscreen ({exc}); set MUJOCO_GL=egl (or osmesa) in the environment, "
                "or import vla.sim before mujoco/metaworld so it can choose EGL"
            ) from exc
        flags = self._renderer.scene.flags
        flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self._free_cameras = {name: _free_camera(mujoco, view) for name, view in FREE_VIEWS.items()}
        self._raw: np.ndarray | None = None
        self.steps = 0
        self.seed: int | None = None

    # -- episode ---------------------------------------------------------------------------------
    def reset(self, seed: int, hand_offset: np.ndarray | None = None) -> dict[str, Any]:
        """Start the episode of `seed` (object and goal positions follow from it alone).

        hand_offset: (3,) metres added to the task's hand start for this episode only (the recorder's
        random starts); None starts where MetaWorld does, as evaluation always does.
        """
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise SimError(f"reset needs a seed that is an int >= 0, got {seed!r}")
        self._env.seed(int(seed))
        if hand_offset is None:
            self._env.reset()
        else:
            offset = np.asarray(hand_offset, dtype=np.float64)
            if offset.shape != (3,) or not np.isfinite(offset).all():
                raise SimError(f"hand_offset must be 3 finite metres (x, y, z), got {hand_offset!r}")
            start = self._env.hand_init_pos
            self._env.hand_init_pos = np.asarray(start, dtype=np.float64) + offset
            try:
                self._env.reset()  # reset_model moves the hand to hand_init_pos (mocap, 50 sim steps)
            finally:
                self._env.hand_init_pos = start
        # MetaWorld's reset_model moves the goal site and task bodies (model.site_pos / body_pos, e.g. the
        # drawer) after its last mj_forward, so data.site_xpos and the body poses the renderer and the
        # observation read still hold the previous episode's layout until the next forward. Recompute
        # them, then rebuild the reset observation as reset() does (the current frame stacked twice).
        self._mujoco.mj_forward(self._env.model, self._env.data)
        self._env._prev_obs = self._env._get_curr_obs_combined_no_goal()
        self._raw = self._env._get_obs().astype(np.float64)
        self.steps = 0
        self.seed = int(seed)
        return self.observation()

    def layout(self, seed: int) -> np.ndarray:
        """The layout `reset(seed)` gives (object and goal positions as MetaWorld draws them), without
        rendering; the env is left reset to that seed."""
        self._env.seed(int(seed))
        self._env.reset()
        self._raw = None  # not a started episode: step() needs reset(seed)
        return np.array(self._env._last_rand_vec, dtype=np.float64)

    def step(self, action: np.ndarray, observe: bool = True) -> SimStep:
        """Apply one (4,) action (clipped to [-1, 1]); NaN/inf actions raise instead of corrupting the sim.

        observe=False leaves the observation out (no rendering); success and done are the same, and the
        next observation() is the one observe=True would have returned (rendering never moves the sim).
        """
        if self._raw is None:
            raise SimError("call reset(seed) before step()")
        if self.steps >= self.max_episode_steps:
            raise SimError(f"the episode already ended after {self.steps} steps; call reset(seed)")
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (ACTION_DIM,):
            raise SimError(f"action must have {ACTION_DIM} values (dx, dy, dz, gripper), got {action.shape}")
        if not np.isfinite(action).all():
            raise SimError(f"non-finite action {action.tolist()} at step {self.steps} of seed {self.seed}")
        self._raw, _, _, _, info = self._env.step(np.clip(action, -1.0, 1.0).astype(np.float32))
        self.steps += 1
        success = bool(info["success"])
        observation = self.observation() if observe else None
        distance = float(info.get("obj_to_target", math.nan))
        return SimStep(observation, success, success or self.steps >= self.max_episode_steps, distance)

    def expert_action(self, aim_tcp: bool = False) -> np.ndarray:
        """The scripted expert's (4,) float32 action for the current state, clipped to [-1, 1].

        aim_tcp: in the tasks of TCP_GOAL_TASKS, steer the tool centre point onto the goal instead of
        the hand (module docstring); no effect in other tasks.
        """
        if self._raw is None:
            raise SimError("call reset(seed) before expert_action()")
        raw = self._raw
        if aim_tcp and self.task in TCP_GOAL_TASKS:
            # The expert drives obs[:3] (the hand) to obs[-3:] (the goal): moving the goal it is shown by
            # hand - tcp makes the tcp, which success is measured on, end on the real goal.
            raw = raw.copy()
            raw[-3:] += raw[:3] - self._env.tcp_center
        with warnings.catch_warnings():  # experts exceed the action range and warn about it
            warnings.simplefilter("ignore")
            action = self._expert.get_action(raw)
        return np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)

    # -- observation -----------------------------------------------------------------------------
    def state(self) -> np.ndarray:
        """(4,) float32: hand position (x, y, z) and gripper opening."""
        assert self._raw is not None
        return self._raw[:STATE_DIM].astype(np.float32)

    def positions(self) -> dict[str, np.ndarray]:
        """World positions (3,) float64 in metres of the current state, for diagnosing a policy:
        "hand" (observation.state[:3]), "tcp" (the tool centre point between the fingertips, which
        reach's success is measured from), "object" (the task's first object as MetaWorld observes it:
        push's puck, drawer-open's handle) and "goal"."""
        if self._raw is None:
            raise SimError("call reset(seed) before positions()")
        return {
            "hand": self._raw[:3].copy(),
            "tcp": np.array(self._env.tcp_center, dtype=np.float64),
            "object": self._raw[4:7].copy(),
            "goal": self._raw[-3:].copy(),
        }

    def render(self, camera: str) -> np.ndarray:
        """(R, R, 3) uint8 upright image from one of this env's cameras."""
        self._renderer.update_scene(self._env.data, camera=self._free_cameras.get(camera, camera))
        image = self._renderer.render()
        if camera in _UPSIDE_DOWN:
            image = image[::-1, ::-1]
        return np.ascontiguousarray(image)

    def observation(self) -> dict[str, Any]:
        obs: dict[str, Any] = {"observation.state": self.state()}
        for camera in self.cameras:
            obs[f"observation.images.{camera}"] = self.render(camera)
        obs["task"] = self.instruction
        return obs

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the renderer's GL context (EGL complains at interpreter exit otherwise)."""
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None  # type: ignore[assignment]
        self._env.close()

    def __enter__(self) -> MetaWorldEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _free_camera(mujoco: Any, view: FreeView) -> Any:
    camera = mujoco.MjvCamera()
    camera.type = mujoco.mjtCamera.mjCAMERA_FREE
    camera.lookat[:] = view.lookat
    camera.distance = view.distance
    camera.azimuth = view.azimuth
    camera.elevation = view.elevation
    return camera


def sim_features(cameras: tuple[str, ...] | list[str], resolution: int) -> dict[str, dict[str, Any]]:
    """The LeRobot features of a dataset recorded from `MetaWorldEnv(cameras, resolution)`."""
    features: dict[str, dict[str, Any]] = {
        f"observation.images.{camera}": {
            "dtype": "video",
            "shape": [resolution, resolution, 3],
            "names": ["height", "width", "channels"],
        }
        for camera in cameras
    }
    features["observation.state"] = {"dtype": "float32", "shape": [STATE_DIM], "names": STATE_NAMES}
    features["action"] = {"dtype": "float32", "shape": [ACTION_DIM], "names": ACTION_NAMES}
    return features
