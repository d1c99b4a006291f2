"""The end-of-run policy export: a LeRobot pi0 checkpoint, plus what we need to rebuild the exact policy.

pi0 runs write
    policy.safetensors              LeRobot's PI0Policy names (`model.paligemma_with_expert...`, the keys its
                                    strict load requires, see vla.models.weights.lerobot_pi0_key_set), with
                                    our policy config as JSON in the header ("policy_config")
    pretrained_model/model.safetensors  the same file (a hard link), and
    pretrained_model/config.json    LeRobot's PI0Config, so `PI0Policy.from_pretrained(run/pretrained_model)`
                                    works as for LeRobot's own training outputs. Written when LeRobot can
                                    build the architecture: its PI0Config only knows the full-size towers
                                    (PaliGemma gemma_2b / gemma_300m, SigLIP So400m/14), so the small presets
                                    get the LeRobot-named policy.safetensors only (and a log line says why).
OpenVLA-style runs keep our own parameter names in policy.safetensors (LeRobot has no OpenVLA policy).
Both load back with `vla.eval.policy_runner.load_exported_policy` and as `model.weights=`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from vla.atomic import write_file_atomically
from vla.checksums import write_sidecar
from vla.models.config import (
    GEMMA_2B,
    GEMMA_300M,
    PALIGEMMA_VOCAB_SIZE,
    SIGLIP_SO400M_14_224,
    Pi0Config,
    PolicyConfig,
)
from vla.models.weights import pi0_lerobot_tensors, save_safetensors_reproducibly
from vla.training.checkpoint.errors import check_finite_tensors

EXPORT_FILE = "policy.safetensors"
LEROBOT_DIR = "pretrained_model"
LEROBOT_WEIGHTS = "model.safetensors"
LEROBOT_CONFIG = "config.json"
_GEMMA_VARIANTS = {"gemma_2b": GEMMA_2B, "gemma_300m": GEMMA_300M}


def lerobot_unsupported(config: PolicyConfig) -> str | None:
    """Why LeRobot's PI0Config cannot describe this policy, or None when it can."""
    if not isinstance(config, Pi0Config):
        return f"LeRobot has no {config.kind} policy"
    reasons = []
    for name, spec in (("vlm", config.vlm), ("expert", config.expert)):
        if spec not in _GEMMA_VARIANTS.values():
            reasons.append(f"{name} is not gemma_2b / gemma_300m")
    vision = config.vision
    if (vision.width, vision.depth, vision.mlp_dim, vision.num_heads, vision.patch_size) != (
        SIGLIP_SO400M_14_224.width,
        SIGLIP_SO400M_14_224.depth,
        SIGLIP_SO400M_14_224.mlp_dim,
        SIGLIP_SO400M_14_224.num_heads,
        SIGLIP_SO400M_14_224.patch_size,
    ):
        reasons.append("the vision tower is not SigLIP So400m/14")
    if config.vocab_size != PALIGEMMA_VOCAB_SIZE:
        reasons.append(f"vocab_size is {config.vocab_size}, not PaliGemma's {PALIGEMMA_VOCAB_SIZE}")
    if config.rope_theta != 10_000.0 or config.rms_norm_eps != 1e-6:
        reasons.append("rope_theta / rms_norm_eps differ from Gemma's")
    return "; ".join(reasons) or None


def _variant(spec: Any) -> str:
    return next(name for name, known in _GEMMA_VARIANTS.items() if known == spec)


def _visual_shape(feature: dict[str, Any]) -> list[int]:
    """LeRobot dataset image shape (H, W, C as `names` say) -> the policy feature's (C, H, W)."""
    shape = list(feature["shape"])
    names = list(feature.get("names") or [])
    if len(shape) == 3 and names[-1:] in (["channels"], ["channel"]):
        return [shape[2], shape[0], shape[1]]
    return shape


def lerobot_features(
    config: PolicyConfig,
    *,
    features: dict[str, dict[str, Any]],
    camera_map: dict[str, str],
    state_key: str | None,
    action_key: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(input_features, output_features) as LeRobot's PI0Config names them: cameras in the policy's
    camera order (those a dataset key maps to), then the state; the action."""
    by_camera = {camera: key for key, camera in camera_map.items()}
    inputs: dict[str, Any] = {}
    for camera in config.cameras:
        key = by_camera.get(camera)
        if key is not None:
            inputs[key] = {"type": "VISUAL", "shape": _visual_shape(features[key])}
    if state_key:
        inputs[state_key] = {"type": "STATE", "shape": list(features[state_key]["shape"])}
    outputs = {action_key: {"type": "ACTION", "shape": list(features[action_key]["shape"])}}
    return inputs, outputs


def lerobot_norm_map(state_key: str | None, action_key: str, norm_modes: dict[str, str]) -> dict[str, str]:
    """LeRobot's normalization_mapping (per feature type) from our per-feature modes."""
    return {
        "VISUAL": "IDENTITY",
        "STATE": norm_modes.get(state_key, "MEAN_STD") if state_key else "MEAN_STD",
        "ACTION": norm_modes.get(action_key, "MEAN_STD"),
    }


def lerobot_pi0_config(
    config: Pi0Config,
    *,
    features: dict[str, dict[str, Any]],
    camera_map: dict[str, str],
    state_key: str | None,
    action_key: str,
    norm_modes: dict[str, str],
    tokenizer_max_length: int,
    n_action_steps: int | None = None,
) -> dict[str, Any]:
    """LeRobot's PI0Config (the `config.json` of PI0Policy.from_pretrained) for a policy of this config.

    Only fields LeRobot's PI0Config has (0.4.x and later) are written; the rest keep LeRobot's defaults.
    Cameras appear in the policy's camera order; model cameras no dataset key maps to become
    `empty_cameras`. n_action_steps: actions LeRobot plays from each chunk before it samples the next
    (a run passes its closed-loop replan_every, so the deployed policy acts as the evaluated one did;
    capped at the chunk; None: the whole chunk). Raises ValueError when LeRobot cannot build the
    architecture (see lerobot_unsupported) or n_action_steps is below 1.
    """
    reason = lerobot_unsupported(config)
    if reason:
        raise ValueError(f"LeRobot's PI0Config cannot describe this policy: {reason}")
    if n_action_steps is not None and (isinstance(n_action_steps, bool) or n_action_steps < 1):
        raise ValueError(
            f"n_action_steps must be an int >= 1 (actions played per chunk), got {n_action_steps!r}"
        )
    by_camera = {camera: key for key, camera in camera_map.items()}
    inputs, outputs = lerobot_features(
        config, features=features, camera_map=camera_map, state_key=state_key, action_key=action_key
    )
    size = config.vision.image_size
    return {
        "type": "pi0",
        "n_obs_steps": 1,
        "input_features": inputs,
        "output_features": outputs,
        "device": None,
        "use_amp": False,
        "push_to_hub": False,
        "repo_id": None,
        "paligemma_variant": _variant(config.vlm),
        "action_expert_variant": _variant(config.expert),
        "dtype": "float32",
        "chunk_size": config.action_horizon,
        "n_action_steps": min(n_action_steps or config.action_horizon, config.action_horizon),
        "max_state_dim": config.max_state_dim,
        "max_action_dim": config.max_action_dim,
        "num_inference_steps": config.num_inference_steps,
        "time_sampling_beta_alpha": config.time_beta_alpha,
        "time_sampling_beta_beta": config.time_beta_beta,
        "time_sampling_scale": 1.0 - config.time_min,
        "time_sampling_offset": config.time_min,
        "min_period": config.time_min_period,
        "max_period": config.time_max_period,
        "image_resolution": [size, size],
        "empty_cameras": len(config.cameras) - sum(c in by_camera for c in config.cameras),
        "normalization_mapping": lerobot_norm_map(state_key, action_key, norm_modes),
        "gradient_checkpointing": config.gradient_checkpointing,
        "freeze_vision_encoder": config.freeze_vision_tower,
        "train_expert_only": config.train_expert_only,
        "tokenizer_max_length": tokenizer_max_length,
    }


def _link_or_copy(source: Path, target: Path) -> None:
    """`target` becomes a hard link to `source` (a copy where links fail), put in place by
    write_file_atomically's rename, so two exports of one checkpoint at once cannot collide."""

    def link(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:  # a filesystem without hard links
            shutil.copyfile(source, tmp)

    write_file_atomically(target, link)


def _write_lerobot_model(directory: Path, weights: Path, lerobot_config: dict[str, Any]) -> None:
    """PI0Policy.from_pretrained's files: model.safetensors (a link to `weights`) and config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    _link_or_copy(weights, directory / LEROBOT_WEIGHTS)
    text = json.dumps(lerobot_config, indent=4)
    write_file_atomically(directory / LEROBOT_CONFIG, lambda tmp: tmp.write_text(text))


def export_header(config: PolicyConfig, layout: str) -> dict[str, str]:
    """The safetensors header of an export: our policy config (to rebuild the exact policy) and the layout."""
    return {
        "format": "pt",
        "vla.layout": layout,
        "policy_config": json.dumps(config.to_dict(), sort_keys=True),
        "torch_version": torch.__version__,
    }


def write_safetensors(state: Mapping[str, Tensor], path: Path, header: dict[str, str]) -> Path:
    """Write a whole (unsharded) state dict as one safetensors file, atomically, with `header` as its
    metadata. Tied tensors (one tensor under two names) are stored once, the header's "tied" entry
    mapping each dropped name to the kept one (the loaders put them back). NaN/inf in any floating
    tensor refuses the write (NonFiniteWeightsError naming the tensor): nothing non-finite is saved."""
    check_finite_tensors(state, f"exporting {path}")
    tensors: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    views: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu")
        storage = tensor.untyped_storage().data_ptr()
        view = (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if tensor.numel() and view in views:
            tied[name] = views[view]
            continue
        views[view] = name
        # safetensors refuses tensors that are non-contiguous or overlap another stored tensor's memory
        # (views into one fused buffer): those are copied, the rest are written without a copy.
        if not tensor.is_contiguous() or (tensor.numel() and storage in storages):
            tensor = tensor.contiguous().clone()
        storages.add(storage)
        tensors[name] = tensor
    if tied:
        header = {**header, "tied": json.dumps(tied, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_safetensors_reproducibly(tensors, path, header)


def write_export(
    state: dict[str, torch.Tensor],
    config: PolicyConfig,
    output_dir: Path,
    lerobot_config: dict[str, Any] | None = None,
) -> Path:
    """Write a full (unsharded) state dict with our names as the export of `output_dir` (one process)."""
    path = output_dir / EXPORT_FILE
    if isinstance(config, Pi0Config):
        tensors = pi0_lerobot_tensors(state, config)
        write_safetensors(tensors, path, export_header(config, "lerobot_pi0"))
        if lerobot_config is not None:
            _write_lerobot_model(output_dir / LEROBOT_DIR, path, lerobot_config)
    else:
        write_safetensors(state, path, export_header(config, "vla"))
    write_sidecar(path)  # policy.safetensors.sha256: loaders check the bytes against it
    return path


def export_policy(
    model: nn.Module, output_dir: Path, *, rank: int, lerobot_config: dict[str, Any] | None
) -> Path:
    """Gather the full state dict (collective under FSDP2/DDP) and write the export from rank 0."""
    from vla.training.checkpoint import _agree, _capture, _first

    inner = getattr(model, "module", model)
    failed: list[BaseException] = []
    state: dict[str, torch.Tensor] = {}
    with _capture(failed):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _agree(_first(failed), f"exporting {output_dir / EXPORT_FILE}: gathering the full state dict")
    if rank == 0:
        with _capture(failed):
            write_export(state, inner.config, output_dir, lerobot_config)
    del state
    _agree(_first(failed), f"exporting {output_dir / EXPORT_FILE}: writing the files")
    return output_dir / EXPORT_FILE


def write_lerobot_processor_for(
    directory: Path,
    config: PolicyConfig,
    processor: Any,
    features: dict[str, dict[str, Any]],
    stats: dict[str, dict[str, Any]] | None = None,
) -> list[Path]:
    """LeRobot's processor files (vla.data.lerobot_processor) for a pi0 policy into `directory`.

    processor: the run's vla.data.BatchProcessor; features: the dataset's (meta/info.json);
    stats: the dataset's meta/stats.json, as LeRobot writes them (every feature), or None for the
    run's own normaliser statistics (the normalised features only: all LeRobot needs).
    A built-in tokenizer is saved to `directory`/tokenizer, and named by its absolute path.
    """
    from vla.data.lerobot_processor import write_lerobot_processor
    from vla.data.tokenizer import tokenizer_reference

    pc = processor.config
    inputs, outputs = lerobot_features(
        config,
        features=features,
        camera_map=dict(pc.camera_map),
        state_key=pc.state_key,
        action_key=pc.action_key,
    )
    if stats is None:
        stats = processor.normalizer.stats
    return write_lerobot_processor(
        directory,
        input_features=inputs,
        output_features=outputs,
        norm_map=lerobot_norm_map(pc.state_key, pc.action_key, dict(pc.norm_modes)),
        stats=stats,
        tokenizer_name=tokenizer_reference(
            pc.tokenizer_path, processor.prompts.tokenizer, directory / "tokenizer"
        ),
        max_length=pc.max_prompt_length,
        eps=processor.normalizer.eps,  # the run's: LeRobot's 1e-8, or 1e-6 for runs saved before it
    )


def _run_dataset(run_dir: Path) -> Any:
    """The run's dataset metadata (vla.data.DatasetMetadata) when its data.root can be found, else None."""
    from vla.data.metadata import DatasetMetadata
    from vla.eval.policy_runner import dataset_candidates, run_data_config

    root = run_data_config(run_dir).get("root")
    for candidate in dataset_candidates(run_dir, root) if root else []:
        if (candidate / "meta" / "info.json").is_file():
            return DatasetMetadata(candidate)
    return None


def _features_from_processor(processor: Any) -> dict[str, dict[str, Any]]:
    """Dataset-like features when the dataset is gone: cameras at the model's resolution (LeRobot resizes
    to it anyway), state and action dims from the processor."""
    pc = processor.config
    size = pc.image_size
    features = {
        key: {"shape": [size, size, 3], "names": ["height", "width", "channels"]} for key in pc.camera_map
    }
    if pc.state_key:
        features[pc.state_key] = {"shape": [processor.state_dim]}
    features[pc.action_key] = {"shape": [processor.action_dim]}
    return features


def _policy_from_checkpoint(run_dir: Path, checkpoint: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The run's policy (from its config.yaml) loaded from the checkpoint, and the state dict to export:
    the EMA weights when the run kept an EMA (as the run's own export does), else the weights."""
    from omegaconf import OmegaConf

    from vla.models import build_policy
    from vla.models.factory import resolve_config
    from vla.training.checkpoint import CheckpointManager
    from vla.training.config import TrainConfig
    from vla.training.ema import EMA

    saved = OmegaConf.load(run_dir / "config.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))
    policy = build_policy(resolve_config(cfg.model.preset, **cfg.model.policy_overrides()))
    manager = CheckpointManager(checkpoint.parent, keep_last=None)
    manifest = manager.verify(checkpoint)
    extra: dict[str, Any] = {}
    ema = None
    if "ema" in manifest.get("extra_state", []):
        ema = EMA(policy, cfg.trainer.ema_decay or 0.999)
        extra["ema"] = ema.state_dict()
    manager.load(checkpoint, policy, None, restore_rng=False, extra_state=extra or None)
    if ema is None:
        return policy, policy.state_dict()
    with ema.applied(policy):
        return policy, {k: v.detach().clone() for k, v in policy.state_dict().items()}


def _run_processor_and_features(run_dir: Path) -> tuple[Any, dict[str, dict[str, Any]], Any]:
    """The run's processor, its dataset's features (rebuilt from the processor when the dataset is gone)
    and the dataset's statistics (None when it is gone)."""
    from vla.eval.policy_runner import read_processor

    processor = read_processor(run_dir / "processor.json")
    meta = _run_dataset(run_dir)
    features = meta.features if meta is not None else _features_from_processor(processor)
    return processor, features, (meta.stats if meta is not None else None)


def _require_pi0(run_dir: Path, config: PolicyConfig) -> None:
    if not isinstance(config, Pi0Config):
        raise ValueError(
            f"{run_dir} trained a {config.kind} policy; LeRobot has no such policy to export for"
        )


def export_checkpoint(
    run_dir: Path | str,
    checkpoint: Path | str,
    *,
    out: Path | str | None = None,
    lerobot_only: bool = False,
) -> Path:
    """One checkpoint of a run exported as the run's end exports: `out` (default
    `run_dir/exports/<checkpoint name>`) gets policy.safetensors (the EMA weights when the run kept an EMA,
    as the run's own export) and, for pi0, LeRobot's pretrained_model/ (processor files; config.json where
    LeRobot can build the size). checkpoint: a name under run_dir/checkpoints/ or a path; its bytes are
    verified before use. lerobot_only: refuse a policy LeRobot has no class for. Returns the directory.
    One process."""
    from vla.eval.policy_runner import run_replan_every

    run_dir = Path(run_dir)
    processor, features, stats = _run_processor_and_features(run_dir)
    checkpoint = Path(checkpoint)
    if not checkpoint.is_absolute() and not checkpoint.exists():
        checkpoint = run_dir / "checkpoints" / checkpoint
    policy, state = _policy_from_checkpoint(run_dir, checkpoint)
    config = policy.config
    if lerobot_only:
        _require_pi0(run_dir, config)
    target = Path(out) if out is not None else run_dir / "exports" / checkpoint.name
    target.mkdir(parents=True, exist_ok=True)
    lerobot_config = lerobot_config_for(config, processor.config, features, run_replan_every(run_dir))
    write_export(state, config, target, lerobot_config)
    if isinstance(config, Pi0Config):
        write_lerobot_processor_for(target / LEROBOT_DIR, config, processor, features, stats)
    return target


def export_for_lerobot(
    run_dir: Path | str, *, checkpoint: Path | str | None = None, out: Path | str | None = None
) -> Path:
    """LeRobot's `pretrained_model/` for an existing run (from its export) or one of its checkpoints.

    Without a checkpoint: `run_dir/pretrained_model/` (processor files; config.json and model.safetensors,
    a link to the run's policy.safetensors, where LeRobot can build the size). With one: `out` (default
    `run_dir/exports/<checkpoint name>`) gets policy.safetensors and pretrained_model/ from its weights
    (`export_checkpoint`). Returns the pretrained_model directory. One process.
    """
    from vla.eval.policy_runner import read_export_config, run_replan_every

    run_dir = Path(run_dir)
    if checkpoint is not None:
        return export_checkpoint(run_dir, checkpoint, out=out, lerobot_only=True) / LEROBOT_DIR
    processor, features, stats = _run_processor_and_features(run_dir)
    config = read_export_config(run_dir / EXPORT_FILE)
    _require_pi0(run_dir, config)
    directory = (Path(out) if out is not None else run_dir) / LEROBOT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    lerobot_config = lerobot_config_for(config, processor.config, features, run_replan_every(run_dir))
    if lerobot_config is not None:
        _write_lerobot_model(directory, run_dir / EXPORT_FILE, lerobot_config)
    write_lerobot_processor_for(directory, config, processor, features, stats)
    return directory


def lerobot_config_for(
    config: PolicyConfig,
    processor_config: Any,
    features: dict[str, dict[str, Any]],
    n_action_steps: int | None = None,
) -> dict[str, Any] | None:
    """LeRobot's config.json for a policy trained through `processor_config` (vla.data.ProcessorConfig)
    on a dataset with `features`, or None if LeRobot cannot build it. n_action_steps: see lerobot_pi0_config."""
    if lerobot_unsupported(config) is not None:
        return None
    return lerobot_pi0_config(
        config,
        features=features,
        camera_map=dict(processor_config.camera_map),
        state_key=processor_config.state_key,
        action_key=processor_config.action_key,
        norm_modes=dict(processor_config.norm_modes),
        tokenizer_max_length=processor_config.max_prompt_length,
        n_action_steps=n_action_steps,
    )


def run_lerobot_config(config: PolicyConfig, data: Any, replan_every: int) -> dict[str, Any] | None:
    """LeRobot's config.json for a run (its policy config, DataPipeline and closed-loop replan_every), or
    None if LeRobot cannot build it."""
    return lerobot_config_for(config, data.processor.config, data.meta.features, replan_every)


__all__ = [
    "EXPORT_FILE",
    "LEROBOT_CONFIG",
    "LEROBOT_DIR",
    "export_checkpoint",
    "export_for_lerobot",
    "export_policy",
    "lerobot_config_for",
    "lerobot_features",
    "lerobot_norm_map",
    "lerobot_pi0_config",
    "lerobot_unsupported",
    "run_lerobot_config",
    "write_export",
    "write_lerobot_processor_for",
]
