"""Why a MetaWorld policy fails a task: does it act on the goal, do its image tokens hold the goal, and does
it follow its instruction?

    python scripts/diagnose_policy.py RUN_DIR --task reach-v3 [--seeds 16] [--probe-train 300]
        [--follow-episodes 20] [--follow reach-v3,push-v3] [--json out.json]

Three measurements on one task, from the run's export:
1. Action against the expert, at the first frame of an episode and --later expert steps into it: per
   action dim, the correlation (and mean absolute error) of the policy's first action with the
   expert's, on the dataset's training seeds and on new seeds (from 1000). A policy that reads the
   goal matches at the first frame; one that only continues a motion it sees matches later only.
   Then which input that later match comes from (the copycat check): the later action again, once with the
   state of the first frame and the later images, once with the first frame's images and the later state.
   A policy that reads the direction off the hand's offset from its start pose (state) rather than off the
   goal in its images keeps the match with the later state alone and loses it with the first state.
2. A linear probe (ridge, standardised features) from the policy's image tokens in the first frame to
   the goal position, fitted on --probe-train new layouts or on the training layouts, scored (R² per
   axis, RMSE in mm) on 100 other new layouts. High R² from many layouts: the encoder carries the goal.
3. Instruction following: the task's episodes on --follow-episodes new layouts, played in closed loop
   once with each instruction of --follow (default: every task the run trained on). Per instruction:
   success, and medians over episodes of the tool centre point's closest approach to the goal and to
   the object, of how far the object moved, and (failed episodes) of the per-axis error at the closest
   approach to the goal. A policy that follows its instruction acts differently under each (under push's,
   it goes for the puck); one that does not acts the same whatever it is told. The axis errors say where
   a failing policy misses.

The run must have been trained on data=metaworld (its cameras and resolution are read from the
config). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vla.sim  # noqa: E402,F401  (chooses EGL before mujoco loads)
from vla.eval.closed_loop import ClosedLoopSettings, run_episodes  # noqa: E402
from vla.eval.policy_runner import load_run_policy, run_data_config, run_dataset_root  # noqa: E402
from vla.help_format import HelpFormatter  # noqa: E402
from vla.sim.demos import MARKER_PATH, training_seeds  # noqa: E402
from vla.sim.metaworld_env import MetaWorldEnv, instruction, parse_tasks  # noqa: E402

NEW_SEED = 1000


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--task", default="reach-v3")
    parser.add_argument("--seeds", type=int, default=16, help="episodes per seed set for the action check")
    parser.add_argument("--later", type=int, default=15, help="expert steps before the second action check")
    parser.add_argument("--probe-train", type=int, default=300, help="new layouts the probe is fitted on")
    parser.add_argument(
        "--follow-episodes",
        type=int,
        default=20,
        help="episodes per instruction in the instruction check (0: skip)",
    )
    parser.add_argument(
        "--follow",
        default=None,
        help="comma-separated tasks whose instructions are tried (default: the run's tasks)",
    )
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def _corr(a: np.ndarray, b: np.ndarray) -> float | None:
    if a.std() < 1e-9 or b.std() < 1e-9:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def _agreement(actions: list[np.ndarray], expert: list[np.ndarray]) -> dict[str, Any]:
    """Per action dim: correlation and mean absolute error of the policy's actions with the expert's."""
    p, e = np.array(actions), np.array(expert)
    return {
        "corr": [_corr(p[:, d], e[:, d]) for d in range(p.shape[1])],
        "mae": np.abs(p - e).mean(0).astype(float).round(3).tolist(),
    }


def action_agreement(actor: Any, env: MetaWorldEnv, seeds: list[int], later: int) -> dict[str, Any]:
    """Per dim: correlation and MAE of the policy's first action with the expert's, at frame 0 and later."""
    out: dict[str, Any] = {}
    for name, steps in (("first_frame", 0), (f"after_{later}_expert_steps", later)):
        policy, expert = [], []
        for seed in seeds:
            observation = env.reset(seed)
            for _ in range(steps):
                observation = env.step(env.expert_action()).observation
            expert.append(np.clip(env.expert_action(), -1, 1))
            policy.append(actor.act([env], [observation])[0][0])
        out[name] = _agreement(policy, expert)
    return out


def state_or_image(actor: Any, env: MetaWorldEnv, seeds: list[int], later: int) -> dict[str, Any]:
    """Per dim: correlation and MAE with the expert's action `later` steps in, of the policy's first
    action given that moment's images with the first frame's state, and the first frame's images with
    that moment's state."""
    swaps: dict[str, list[np.ndarray]] = {"later_images_first_state": [], "first_images_later_state": []}
    expert = []
    for seed in seeds:
        first = env.reset(seed)
        observation = first
        for _ in range(later):
            observation = env.step(env.expert_action()).observation
        expert.append(np.clip(env.expert_action(), -1, 1))
        state = "observation.state"
        swapped = {
            "later_images_first_state": {**observation, state: first[state]},
            "first_images_later_state": {**first, state: observation[state]},
        }
        for name, inputs in swapped.items():
            swaps[name].append(actor.act([env], [inputs])[0][0])
    return {name: _agreement(actions, expert) for name, actions in swaps.items()}


def _tokens(actor: Any, env: MetaWorldEnv, seeds: range | list[int]) -> tuple[np.ndarray, np.ndarray]:
    policy = actor.policy
    features, goals = [], []
    for seed in seeds:
        observation = env.reset(seed)
        batch = actor.processor.observation([observation])
        with torch.no_grad():
            prefix, _ = policy.prefix_embedder(batch, policy.config.cameras)
        vision = policy.config.vision
        images = (vision.image_size // vision.patch_size) ** 2 * len(policy.config.cameras)
        features.append(prefix[0, :images].flatten().numpy())
        goals.append(np.asarray(env._env._target_pos, dtype=np.float64).copy())
    return np.array(features), np.array(goals)


def _ridge(x: np.ndarray, y: np.ndarray, lam: float) -> Any:
    mean, std = x.mean(0), x.std(0) + 1e-6
    xn = (x - mean) / std
    weights = np.linalg.solve(xn.T @ xn + lam * np.eye(x.shape[1]), xn.T @ (y - y.mean(0)))
    return lambda z: ((z - mean) / std) @ weights + y.mean(0)


def goal_probe(actor: Any, env: MetaWorldEnv, train_seeds: list[int], fresh: int) -> dict[str, Any]:
    """R² and RMSE of ridge probes (best of a few lambdas on the test set, as a ceiling) per fit set."""
    test_x, test_y = _tokens(actor, env, range(NEW_SEED, NEW_SEED + 100))
    fits = {
        f"{fresh}_new_layouts": _tokens(actor, env, range(NEW_SEED + 1000, NEW_SEED + 1000 + fresh)),
        f"{len(train_seeds)}_training_layouts": _tokens(actor, env, train_seeds),
    }
    out: dict[str, Any] = {}
    for name, (x, y) in fits.items():
        best = None
        for lam in (10.0, 100.0, 1000.0):
            error = _ridge(x, y, lam)(test_x) - test_y
            r2 = 1 - (error**2).sum(0) / ((test_y - test_y.mean(0)) ** 2).sum(0)
            if best is None or r2.mean() > np.mean(best["r2_xyz"]):
                best = {
                    "lambda": lam,
                    "r2_xyz": r2.round(3).tolist(),
                    "rmse_mm": (np.sqrt((error**2).mean(0)) * 1e3).round(1).tolist(),
                }
        out[name] = best
    out["feature_dims"] = int(test_x.shape[1])
    return out


def _median_mm(values: list[float]) -> float | None:
    return round(float(np.median(values)) * 1e3, 1) if values else None


def instruction_following(
    actor: Any, task: str, settings: ClosedLoopSettings, instructions: dict[str, str], seeds: list[int]
) -> dict[str, Any]:
    """Per instruction (task name -> text): `task`'s episodes on `seeds` played with that text, where the tcp
    went (closest to goal and object), how far the object moved, and failures' per-axis miss (mm)."""
    out: dict[str, Any] = {}
    for name, text in instructions.items():
        tracks: dict[int, dict[str, Any]] = {}

        def observe(env: MetaWorldEnv, tracks: dict[int, dict[str, Any]] = tracks) -> None:
            where = env.positions()
            track = tracks.setdefault(
                env.seed, {"object0": where["object"], "moved": 0.0, "goal": [], "object": [], "miss": []}
            )
            miss = where["tcp"] - where["goal"]
            track["goal"].append(float(np.linalg.norm(miss)))
            track["object"].append(float(np.linalg.norm(where["tcp"] - where["object"])))
            track["miss"].append(np.abs(miss))
            track["moved"] = max(track["moved"], float(np.linalg.norm(where["object"] - track["object0"])))

        results, _ = run_episodes(actor, task, seeds, settings, instruction=text, observer=observe)
        episodes = [(r, tracks[r.seed]) for r in results]
        failed = [t["miss"][int(np.argmin(t["goal"]))] for r, t in episodes if not r.success]
        out[name] = {
            "instruction": text,
            "episodes": len(results),
            "success_rate": sum(r.success for r in results) / len(results),
            "closest_tcp_goal_mm": _median_mm([min(t["goal"]) for _, t in episodes]),
            "closest_tcp_object_mm": _median_mm([min(t["object"]) for _, t in episodes]),
            "object_moved_mm": _median_mm([t["moved"] for _, t in episodes]),
            "failed_miss_at_closest_xyz_mm": (np.median(failed, axis=0) * 1e3).round(1).tolist()
            if failed
            else None,
        }
    return out


def main() -> int:
    args = parse_args()
    data = run_data_config(args.run_dir)
    if data.get("source") != "metaworld":
        print(
            f"error: {args.run_dir} was not trained on MetaWorld (data.source={data.get('source')!r})",
            file=sys.stderr,
        )
        return 1
    root = run_dataset_root(args.run_dir, MARKER_PATH)
    if root is None:
        print(
            f"error: the dataset of {args.run_dir} (data.root={data.get('root')!r}) is not found",
            file=sys.stderr,
        )
        return 1
    torch.set_num_threads(1)
    trained = sorted(training_seeds(root).get(args.task, set()))
    if not trained:
        print(f"error: {args.task} is not among the tasks {args.run_dir} trained on", file=sys.stderr)
        return 1
    metaworld = data.get("metaworld") or {}
    actor = load_run_policy(args.run_dir)
    env = MetaWorldEnv(
        args.task,
        cameras=tuple(metaworld.get("cameras", ["corner2"])),
        resolution=int(metaworld.get("resolution", 64)),
    )
    try:
        result = {
            "run": str(args.run_dir),
            "task": args.task,
            "actions": {
                "training_seeds": action_agreement(actor, env, trained[: args.seeds], args.later),
                "new_seeds": action_agreement(
                    actor, env, list(range(NEW_SEED, NEW_SEED + args.seeds)), args.later
                ),
            },
            "goal_probe": goal_probe(actor, env, trained, args.probe_train),
        }
        result["actions"]["new_seeds_swapped"] = state_or_image(
            actor, env, list(range(NEW_SEED, NEW_SEED + args.seeds)), args.later
        )
    finally:
        env.close()
    if args.follow_episodes > 0:
        follow = parse_tasks(args.follow) if args.follow else list(training_seeds(root))
        settings = ClosedLoopSettings(cameras=env.cameras, resolution=env.resolution)
        seeds = list(range(NEW_SEED, NEW_SEED + args.follow_episodes))
        result["instructions"] = instruction_following(
            actor, args.task, settings, {t: instruction(t) for t in follow}, seeds
        )
    for seeds, checks in result["actions"].items():
        for when, values in checks.items():
            corr = ", ".join("-" if c is None else f"{c:.2f}" for c in values["corr"])
            print(f"{seeds:<17} {when:<26} corr with expert per dim [{corr}]  mae {values['mae']}")
    for fit, values in result["goal_probe"].items():
        if isinstance(values, dict):
            print(f"goal probe fitted on {fit:<22} R² xyz {values['r2_xyz']}  RMSE mm {values['rmse_mm']}")
    for name, row in result.get("instructions", {}).items():
        miss = row["failed_miss_at_closest_xyz_mm"]
        print(
            f"{args.task} told {row['instruction']!r} ({name}): success {row['success_rate']:.0%} of "
            f"{row['episodes']}, closest tcp-goal {row['closest_tcp_goal_mm']} mm, tcp-object "
            f"{row['closest_tcp_object_mm']} mm, object moved {row['object_moved_mm']} mm"
            + (f", failures miss x/y/z by {miss} mm at their closest" if miss else "")
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    from vla.training.user_errors import report_user_errors

    sys.exit(report_user_errors(main))
