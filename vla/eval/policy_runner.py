"""A trained policy as a closed-loop actor: environment observations in, action chunks (env units) out.

`load_run_policy(run_dir)` rebuilds what a training run exported: the policy from
`policy.safetensors` (its config is in the file's metadata) and the processor (normalisation stats,
camera map, prompt tokenizer) from `processor.json`. `PolicyActor` then turns a list of observation
dicts (as `vla.sim.MetaWorldEnv` or `vla.data.synthetic.ReachWorld` return them) into a batch, samples
an action chunk and maps it back to the dataset's units.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vla.data.processor import BatchProcessor

EXPORT_FILE = "policy.safetensors"
PROCESSOR_FILE = "processor.json"


class PolicyActor:
    """Samples (B, H, action_dim) chunks in dataset units for B observation dicts.

    Noise for the flow-matching sampler is drawn per environment from (seed, the env's episode seed, its
    step count) when the env has them (vla.sim.MetaWorldEnv), so an episode gets the same actions however
    episodes are batched or split over ranks; otherwise from one generator seeded with `seed`.
    num_steps: Euler steps (None: the policy config's).
    """

    def __init__(
        self,
        policy: nn.Module,
        processor: BatchProcessor,
        *,
        name: str = "policy",
        seed: int = 0,
        num_steps: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.policy = policy.eval()
        self.name = name
        self.device = torch.device(device)
        # Inference wants final float images straight from observation(): no uint8 transport.
        config = replace(processor.config, uint8_images=False, resize_on_finalize=False)
        self.processor = BatchProcessor(
            config,
            processor.normalizer,
            processor.state_dim,
            processor.action_dim,
            processor.prompts.tokenizer,
        )
        self.num_steps = num_steps
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)

    def _noise(self, envs: Sequence[Any] | None, batch: int) -> torch.Tensor:
        config = self.policy.config
        shape = (config.action_horizon, config.max_action_dim)
        keys = [(getattr(e, "seed", None), getattr(e, "steps", None)) for e in envs or []]
        if len(keys) != batch or any(seed is None or steps is None for seed, steps in keys):
            return torch.randn((batch, *shape), generator=self._generator)
        return torch.stack(
            [
                torch.randn(
                    shape, generator=torch.Generator().manual_seed(hash((self.seed, s, t)) & (2**62 - 1))
                )
                for s, t in keys
            ]
        )

    @torch.no_grad()
    def sample(
        self,
        observations: Sequence[Mapping[str, Any]],
        envs: Sequence[Any] | None = None,
        noise: torch.Tensor | None = None,
    ) -> np.ndarray:
        """(B, H, action_dim) float32 actions in dataset units for B observation dicts.

        noise: (B, H, max_action_dim), the flow-matching sampler's starting point (pi0 only), e.g. to
        compare with another implementation given the same draw; None draws it as described above."""
        observation = self.processor.observation(observations).to(self.device)
        kwargs: dict[str, Any] = {}
        if self.policy.config.kind == "pi0":
            if noise is None:
                noise = self._noise(envs, len(observations))
            kwargs["noise"] = noise.to(self.device)
            if self.num_steps is not None:
                kwargs["num_steps"] = self.num_steps
        actions = self.policy.sample_actions(observation, **kwargs)
        return self.processor.unnormalize_actions(actions.float().cpu()).numpy()

    def act(self, envs: Sequence[Any], observations: Sequence[Mapping[str, Any]]) -> np.ndarray:
        return self.sample(observations, envs)


def read_processor(path: Path | str) -> BatchProcessor:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {PROCESSOR_FILE} at {path}; it is written by every training run")
    try:
        return BatchProcessor.from_state_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a processor state written by a training run: {exc}") from exc


def read_export_config(path: Path | str) -> Any:
    """The PolicyConfig of an exported safetensors file (its "policy_config" metadata), bytes checked
    against its sidecar digest; no weights are read."""
    from vla.eval.exported import check_export_bytes, read_safetensors_metadata
    from vla.models.factory import resolve_config

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no exported policy at {path}; a run writes it at the end (trainer.export_safetensors=true)"
        )
    check_export_bytes(path)
    metadata = read_safetensors_metadata(path)
    if "policy_config" not in metadata:
        raise ValueError(
            f"{path} has no 'policy_config' in its metadata; it was not exported by vla.training (a LeRobot "
            "or PaliGemma checkpoint loads into a configured policy with train.py model.weights=...)"
        )
    return resolve_config(json.loads(metadata["policy_config"]))


def load_exported_policy(path: Path | str) -> nn.Module:
    """The policy in an exported safetensors file (the config comes from its "policy_config" metadata).

    Reads both export layouts: LeRobot's pi0 names (exports since the LeRobot-compatible export) and our own
    parameter names (older exports, and OpenVLA-style exports), detected from the keys.
    """
    from safetensors import SafetensorError

    from vla.eval.exported import DamagedExportError
    from vla.models import build_policy
    from vla.models.weights import load_weights

    policy = build_policy(read_export_config(path))
    try:
        load_weights(policy, path, "auto")
    except SafetensorError as exc:
        raise DamagedExportError(
            f"{path} cannot be read ({exc}): truncated or damaged; export it again"
        ) from exc
    return policy.eval()


def load_run_policy(
    run_dir: Path | str, export: Path | str | None = None, **actor_kwargs: Any
) -> PolicyActor:
    """A PolicyActor for the export (default: the run's policy.safetensors; or another export of its
    weights, e.g. of a checkpoint) and the processor of a training run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    actor_kwargs.setdefault("name", run_dir.name)
    return PolicyActor(
        load_exported_policy(export if export is not None else run_dir / EXPORT_FILE),
        read_processor(run_dir / PROCESSOR_FILE),
        **actor_kwargs,
    )


def _run_config(run_dir: Path | str) -> dict[str, Any]:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {run_dir} is not a training run directory")
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return config if isinstance(config, dict) else {}


def run_data_config(run_dir: Path | str) -> dict[str, Any]:
    """The `data` section of a run's saved config.yaml; FileNotFoundError naming the file if absent."""
    data = _run_config(run_dir).get("data") or {}
    return data if isinstance(data, dict) else {}


def run_closed_loop_setting(run_dir: Path | str, key: str, default: int) -> int:
    """A positive int setting of a run's own closed-loop evaluation (trainer.closed_loop.<key> of its
    config.yaml); `default`, the trainer's, where the config has none."""
    trainer = _run_config(run_dir).get("trainer") or {}
    closed_loop = trainer.get("closed_loop") if isinstance(trainer, dict) else None
    value = closed_loop.get(key) if isinstance(closed_loop, dict) else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def run_replan_every(run_dir: Path | str) -> int:
    """The actions a run's closed-loop evaluation played from each chunk before replanning
    (trainer.closed_loop.replan_every of its config.yaml; 5, the default, where it has none)."""
    return run_closed_loop_setting(run_dir, "replan_every", 5)


def run_max_episode_steps(run_dir: Path | str) -> int:
    """The step limit of a run's closed-loop episodes (trainer.closed_loop.max_episode_steps; 200)."""
    return run_closed_loop_setting(run_dir, "max_episode_steps", 200)


def _hydra_cwd(run_dir: Path) -> Path | None:
    """The working directory the run was launched from, when Hydra recorded it (.hydra/hydra.yaml)."""
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    cwd = (OmegaConf.load(path).get("hydra") or {}).get("runtime", {}).get("cwd")
    return Path(cwd) if cwd else None


def dataset_candidates(run_dir: Path | str, root: str | Path) -> list[Path]:
    """Where a run's data.root may be now: as given if absolute; else relative to the directory the run
    was launched from (Hydra's record), this process's working directory, and the repository root."""
    root, run_dir = Path(root), Path(run_dir)
    if root.is_absolute():
        return [root]
    bases = [_hydra_cwd(run_dir), Path.cwd(), Path(__file__).resolve().parents[2]]
    seen: list[Path] = []
    for base in bases:
        if base is not None and (candidate := (base / root).resolve()) not in seen:
            seen.append(candidate)
    return seen


def run_dataset_root(run_dir: Path | str, marker: str | None = None) -> Path | None:
    """The dataset a run trained on: the first of `dataset_candidates` holding meta/info.json (and
    `marker`, a file relative to the root, when given), or None."""
    try:
        root = run_data_config(run_dir).get("root")
    except FileNotFoundError:
        return None
    if not root:
        return None
    for candidate in dataset_candidates(run_dir, root):
        if (candidate / "meta" / "info.json").is_file() and (
            marker is None or (candidate / marker).is_file()
        ):
            return candidate
    return None
