"""Closed-loop evaluation: a policy acts in simulation and we count the episodes it succeeds in.

A policy here is anything with `act(envs, observations) -> (B, H, 4)`: a chunk of H actions in the
environment's units for each of B environments. The harness runs the episodes of one task in lockstep
batches of `parallel_envs` environments (one policy call serves them all), plays the first
`replan_every` actions of every chunk, asks again, and stops an episode at its first success or at
`max_episode_steps`. The scripted expert and the zero / random baselines are policies of the same kind,
so every number comes out of the very same loop.

Episode e of a task runs on seed `seed + e`. Evaluation seeds must not be seeds the policy was trained
on: pass the training seeds as `exclude_seeds` and an overlap raises.

Per task the report gives the success rate with its 95% Wilson score interval, the mean number of
steps to success (over successful episodes) and the episodes run; per episode, besides success and
steps, the distance MetaWorld's success is measured on (`SimStep.distance`) after the first step, at
its closest and at the end (a failure that came within a centimetre of the threshold is then told
apart from one that never moved the puck); per task the median closest approach of the failed episodes.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from vla.sim.metaworld_env import ACTION_DIM, CONTROL_FPS, MetaWorldEnv, SimError


class ChunkPolicy(Protocol):
    """What the harness drives. act: (B envs, B observations) -> (B, H, ACTION_DIM) float actions."""

    name: str

    def act(self, envs: Sequence[MetaWorldEnv], observations: Sequence[Mapping[str, Any]]) -> np.ndarray: ...


class ExpertPolicy:
    """MetaWorld's scripted expert (one action per call: it re-reads the state every step)."""

    name = "expert"

    def act(self, envs: Sequence[MetaWorldEnv], observations: Sequence[Mapping[str, Any]]) -> np.ndarray:
        return np.stack([env.expert_action() for env in envs])[:, None, :]


class ZeroPolicy:
    """Never moves, never grips: the floor that shows how often a task is 'solved' by doing nothing."""

    name = "zero"

    def act(self, envs: Sequence[MetaWorldEnv], observations: Sequence[Mapping[str, Any]]) -> np.ndarray:
        return np.zeros((len(envs), 1, ACTION_DIM), dtype=np.float32)


class RandomPolicy:
    """Uniform actions in [-1, 1] from a seeded generator."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def act(self, envs: Sequence[MetaWorldEnv], observations: Sequence[Mapping[str, Any]]) -> np.ndarray:
        return self._rng.uniform(-1.0, 1.0, size=(len(envs), 1, ACTION_DIM)).astype(np.float32)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) for no trials.

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n successes.
    """
    if not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials, got {successes} of {trials}")
    if trials == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    # Rounding can put an end a hair on the wrong side of p at 0 or n successes; the interval holds p.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


@dataclass
class EpisodeResult:
    seed: int
    success: bool
    steps: int  # steps taken: to the first success, or the cap
    # SimStep.distance (m) after the first step, its minimum over the episode and after the last step;
    # None where unknown (reports written before these were kept, policies run outside MetaWorldEnv)
    start_m: float | None = None
    closest_m: float | None = None
    final_m: float | None = None


@dataclass
class TaskReport:
    task: str
    episodes: int
    successes: int
    success_rate: float
    ci95: tuple[float, float]
    mean_steps_to_success: float | None
    results: list[EpisodeResult] = field(default_factory=list)
    # median over the failed episodes of EpisodeResult.closest_m (None: no failure, or none measured)
    median_closest_failed_m: float | None = None
    # vla.sim.layouts.layout_report of the evaluated seeds against the training seeds, when known
    layout: dict[str, Any] | None = None


@dataclass
class ClosedLoopSettings:
    """How episodes are run. cameras / resolution must be what the policy was trained on."""

    cameras: tuple[str, ...] = ("corner2",)
    resolution: int = 64
    max_episode_steps: int = 200
    replan_every: int = 5
    parallel_envs: int = 10

    def __post_init__(self) -> None:
        self.cameras = tuple(self.cameras)
        for key in ("resolution", "max_episode_steps", "replan_every", "parallel_envs"):
            if getattr(self, key) < 1:
                raise SimError(f"closed-loop {key} must be >= 1, got {getattr(self, key)}")


@dataclass
class ClosedLoopReport:
    policy: str
    seed: int
    settings: ClosedLoopSettings
    tasks: list[TaskReport]

    @property
    def mean_success(self) -> float:
        return statistics.fmean(t.success_rate for t in self.tasks) if self.tasks else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["mean_success"] = self.mean_success
        return data

    def scalars(self) -> dict[str, float]:
        """Flat metrics for a tracker: success/<task> and success/mean."""
        out = {f"success/{t.task}": t.success_rate for t in self.tasks}
        out["success/mean"] = self.mean_success
        return out


def task_report(task: str, results: list[EpisodeResult]) -> TaskReport:
    successes = sum(r.success for r in results)
    lengths = [r.steps for r in results if r.success]
    closest_failed = [r.closest_m for r in results if not r.success and r.closest_m is not None]
    return TaskReport(
        task=task,
        episodes=len(results),
        successes=successes,
        success_rate=successes / len(results) if results else 0.0,
        ci95=wilson_interval(successes, len(results)),
        mean_steps_to_success=statistics.fmean(lengths) if lengths else None,
        results=results,
        median_closest_failed_m=statistics.median(closest_failed) if closest_failed else None,
    )


def run_episodes(
    policy: ChunkPolicy,
    task: str,
    seeds: Sequence[int],
    settings: ClosedLoopSettings,
    *,
    record: int = 0,
    instruction: str | None = None,
    observer: Callable[[MetaWorldEnv], None] | None = None,
) -> tuple[list[EpisodeResult], list[np.ndarray]]:
    """Run one task's episodes on `seeds`; also return the frames (T, R, C * R, 3) of the first `record`.

    instruction: the text the policy is given instead of the task's own (a diagnosis: does it follow it?).
    observer(env): called after every reset and every step of every episode; `env.seed` and `env.steps`
        say which episode and step, `env.positions()` where things are.
    """
    results: list[EpisodeResult] = []
    videos: list[np.ndarray] = []
    batch = max(1, min(settings.parallel_envs, len(seeds)))
    envs = [
        MetaWorldEnv(task, settings.cameras, settings.resolution, settings.max_episode_steps)
        for _ in range(batch)
    ]
    if instruction is not None:
        for env in envs:
            env.instruction = instruction
    try:
        for start in range(0, len(seeds), batch):
            group = list(seeds[start : start + batch])
            recorded = max(0, min(record - start, len(group)))
            group_results, group_videos = _run_group(
                policy, envs[: len(group)], group, recorded, settings.replan_every, observer
            )
            results += group_results
            videos += group_videos
    finally:
        for env in envs:
            env.close()
    return results, videos


def _frame(observation: Mapping[str, Any], cameras: Sequence[str]) -> np.ndarray:
    return np.concatenate([observation[f"observation.images.{c}"] for c in cameras], axis=1)


def _run_group(
    policy: ChunkPolicy,
    envs: list[MetaWorldEnv],
    seeds: list[int],
    record: int,
    replan_every: int,
    observer: Callable[[MetaWorldEnv], None] | None = None,
) -> tuple[list[EpisodeResult], list[np.ndarray]]:
    """Episodes on `seeds` in lockstep, one env each; every active env replans at the same step."""
    observations: list[Any] = [env.reset(seed) for env, seed in zip(envs, seeds)]
    if observer is not None:
        for env in envs:
            observer(env)
    frames: list[list[np.ndarray]] = [[_frame(o, env.cameras)] for o, env in zip(observations[:record], envs)]
    results: list[EpisodeResult | None] = [None] * len(envs)
    distances: list[list[float]] = [[] for _ in envs]
    while any(r is None for r in results):
        active = [i for i, r in enumerate(results) if r is None]
        chunk = np.asarray(policy.act([envs[i] for i in active], [observations[i] for i in active]))
        if chunk.ndim != 3 or chunk.shape[0] != len(active) or chunk.shape[2] != ACTION_DIM:
            raise SimError(
                f"policy {policy.name!r} returned actions of shape {chunk.shape}; expected "
                f"({len(active)}, H, {ACTION_DIM})"
            )
        played = min(chunk.shape[1], replan_every)
        for k in range(played):
            for row, i in enumerate(active):
                if results[i] is not None:
                    continue
                # only the frame the next chunk is planned from is rendered (and every frame of a recording)
                observe = k == played - 1 or i < record
                step = envs[i].step(chunk[row, k], observe=observe)
                if observer is not None:
                    observer(envs[i])
                if observe:
                    observations[i] = step.observation
                if i < record:
                    frames[i].append(_frame(step.observation, envs[i].cameras))
                if math.isfinite(step.distance):
                    distances[i].append(step.distance)
                if step.done:
                    seen = distances[i]
                    results[i] = EpisodeResult(
                        seeds[i],
                        step.success,
                        envs[i].steps,
                        *((seen[0], min(seen), seen[-1]) if seen else (None, None, None)),
                    )
    return [r for r in results if r is not None], [np.stack(f) for f in frames]


def evaluate_closed_loop(
    policy: ChunkPolicy,
    tasks: Sequence[str],
    episodes: int,
    seed: int,
    settings: ClosedLoopSettings,
    *,
    exclude_seeds: Mapping[str, set[int]] | None = None,
    videos: int = 0,
    video_dir: Path | str | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> ClosedLoopReport:
    """Run `episodes` episodes of every task (seeds seed .. seed + episodes - 1) and report success.

    exclude_seeds: task -> seeds the policy was trained on; any overlap raises SimError.
    videos / video_dir: the first `videos` episodes of each task are written as
        video_dir/<task>_seed<seed>_{success|failure}.mp4 (cameras side by side).
    progress(task, episodes_done): called after each task.
    """
    if episodes < 1:
        raise SimError(f"episodes must be >= 1, got {episodes}")
    seeds = list(range(seed, seed + episodes))
    for task in tasks:
        overlap = sorted(set(seeds) & set((exclude_seeds or {}).get(task, set())))
        if overlap:
            raise SimError(
                f"evaluation seeds {overlap[:5]}{'...' if len(overlap) > 5 else ''} of {task} were used for its "
                f"training demonstrations; evaluate on unseen seeds, e.g. --seed {max(max(exclude_seeds[task]) + 1, 1000)}"  # type: ignore[index]
            )
    reports = []
    for task in tasks:
        results, clips = run_episodes(policy, task, seeds, settings, record=videos if video_dir else 0)
        reports.append(task_report(task, results))
        if clips:
            write_rollouts(Path(video_dir), task, results, clips)  # type: ignore[arg-type]
        if progress is not None:
            progress(task, len(results))
    return ClosedLoopReport(policy=policy.name, seed=seed, settings=settings, tasks=reports)


def write_rollouts(
    video_dir: Path, task: str, results: Sequence[EpisodeResult], clips: Sequence[np.ndarray]
) -> None:
    """One mp4 per recorded episode: video_dir/<task>_seed<seed>_{success|failure}.mp4."""
    for clip, result in zip(clips, results):
        outcome = "success" if result.success else "failure"
        write_video(video_dir / f"{task}_seed{result.seed}_{outcome}.mp4", clip)


def write_video(path: Path, frames: np.ndarray, fps: int = CONTROL_FPS // 4) -> None:
    """(T, H, W, 3) uint8 frames as an H.264 mp4 (played at a quarter of the control rate)."""
    from vla.data.video import encode_video

    if frames.shape[1] % 2 or frames.shape[2] % 2:
        frames = frames[:, : frames.shape[1] // 2 * 2, : frames.shape[2] // 2 * 2]
    encode_video(path, frames, fps=fps, codec="h264", crf=20)


def write_report(report: ClosedLoopReport, json_path: Path | str, png_path: Path | str | None = None) -> None:
    """The report as JSON, and a bar chart of success per task with the 95% intervals."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report.to_dict(), indent=1))
    if png_path is not None:
        plot_success({report.policy: report}, png_path)


def plot_success(reports: Mapping[str, ClosedLoopReport], path: Path | str, title: str | None = None) -> None:
    """Grouped bars: success rate per task for each named report, with Wilson 95% error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(t.task for r in reports.values() for t in r.tasks))
    width = 0.8 / max(len(reports), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks)), 4))
    for k, (name, report) in enumerate(reports.items()):
        by_task = {t.task: t for t in report.tasks}
        xs = [i + (k - (len(reports) - 1) / 2) * width for i in range(len(tasks))]
        rates = [by_task[t].success_rate if t in by_task else 0.0 for t in tasks]
        low = [max(0.0, r - by_task[t].ci95[0]) if t in by_task else 0.0 for t, r in zip(tasks, rates)]
        high = [max(0.0, by_task[t].ci95[1] - r) if t in by_task else 0.0 for t, r in zip(tasks, rates)]
        ax.bar(
            xs, rates, width, yerr=[low, high], capsize=3, label=f"{name} (mean {report.mean_success:.0%})"
        )
    ax.set_xticks(range(len(tasks)), [t.removesuffix("-v3") for t in tasks], rotation=20, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success rate (95% Wilson interval)")
    episodes = {t.episodes for r in reports.values() for t in r.tasks}
    ax.set_title(title or f"closed-loop success, {'/'.join(map(str, sorted(episodes)))} episodes per task")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
