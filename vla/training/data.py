"""Datasets, processor and loaders for a run, from the `data` group and the policy's layout."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from vla.data.pipeline import DataPipeline, build_pipeline
from vla.data.processor import ProcessorConfig
from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset
from vla.training.config import DataConfig

# pi0 normalises state and action by mean/std; OpenVLA-style bins actions in [-1, 1] from quantiles.
DEFAULT_NORM_MODES = {
    "pi0": {"state": "MEAN_STD", "action": "MEAN_STD"},
    "openvla": {"state": "MEAN_STD", "action": "QUANTILES"},
}


def demo_config(cfg: DataConfig) -> Any:
    """The vla.sim.DemoConfig that data=metaworld records (and that closed-loop evaluation replays)."""
    from vla.sim.demos import DemoConfig

    m = cfg.metaworld
    return DemoConfig(
        tasks=list(m.tasks),
        episodes=m.episodes,
        resolution=m.resolution,
        cameras=list(m.cameras),
        seed=m.seed,
        max_episode_steps=m.max_episode_steps,
        codec=m.codec,
        crf=m.crf,
        action_noise=m.action_noise,
        hand_start_noise=m.hand_start_noise,
        steps_after_success=m.steps_after_success,
        expert_aims_tcp=m.expert_aims_tcp,
    )


def _generate(cfg: DataConfig, root: Path) -> None:
    if cfg.source == "metaworld":
        from vla.sim.demos import MARKER_PATH, auto_workers, ensure_sim_dataset

        fresh = not (root / MARKER_PATH).is_file()
        workers = cfg.metaworld.workers or auto_workers()
        if fresh:
            print(
                f"recording MetaWorld demonstrations into {root} (first use, {workers} process(es) rolling out "
                "the experts: data.metaworld.workers) ...",
                flush=True,
            )
        start = time.perf_counter()
        ensure_sim_dataset(root, demo_config(cfg), workers=workers)
        if fresh:
            m = cfg.metaworld
            print(
                f"recorded {m.episodes} episodes per task of {len(m.tasks)} task(s) in "
                f"{time.perf_counter() - start:.0f} s; later runs with these data.metaworld settings reuse it",
                flush=True,
            )
        return
    s = cfg.synthetic
    synthetic = SyntheticConfig(
        episodes=s.episodes,
        episode_length=s.episode_length,
        image_size=s.image_size,
        use_videos=s.use_videos,
        codec=s.codec,
        fps=s.fps,
        seed=s.seed,
    )
    from vla.data.synthetic import MARKER_PATH as SYNTHETIC_MARKER

    fresh = not (root / SYNTHETIC_MARKER).is_file()
    start = time.perf_counter()
    ensure_synthetic_dataset(root, synthetic)
    if fresh:
        print(
            f"generated the synthetic dataset in {root} ({s.episodes} episodes of {s.episode_length} frames, "
            f"{s.image_size} px, {time.perf_counter() - start:.0f} s); later runs with these data.synthetic "
            "settings reuse it",
            flush=True,
        )


def dataset_root(cfg: DataConfig, rank: int) -> Path:
    """The dataset directory; for generated sources rank 0 writes it on first use while others wait."""
    root = Path(cfg.root)
    if cfg.source == "lerobot":
        if not (root / "meta" / "info.json").is_file():
            raise FileNotFoundError(
                f"data.root={cfg.root!r} is not a LeRobot dataset (no meta/info.json there); point data.root "
                "at a local LeRobot v3.0 dataset, or use data=synthetic"
            )
        return root
    if rank == 0:
        _generate(cfg, root)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return root


def resolve_hub_dataset(cfg: DataConfig) -> None:
    """data.repo_id (a hub dataset) -> data.root = its snapshot in the Hugging Face cache (fetched if absent)."""
    if cfg.repo_id:
        from vla.data.hub import snapshot

        cfg.root = str(
            snapshot(cfg.repo_id, repo_type="dataset", revision=cfg.revision, config_key="data.repo_id")
        )


def resolve_weights(model: Any) -> str | None:
    """model.weights as a local path: a hub id becomes its snapshot (safetensors + JSON files) in the cache."""
    from vla.data.hub import looks_like_hub_id, snapshot

    weights = model.weights
    if not weights or Path(weights).exists() or not looks_like_hub_id(weights):
        return weights
    directory = snapshot(
        weights,
        repo_type="model",
        revision=model.weights_revision,
        allow_patterns=["*.safetensors", "*.json"],
        config_key="model.weights",
    )
    return str(directory)


def resolved_tokenizer_path(cfg: DataConfig, policy_config: Any) -> str:
    """data.tokenizer_path with null resolved to the model's own tokenizer (vla.data.tokenizer)."""
    from vla.data.tokenizer import BUILTIN, PALIGEMMA_TOKENIZER
    from vla.models.config import PALIGEMMA_VOCAB_SIZE

    if cfg.tokenizer_path not in (None, ""):
        return str(cfg.tokenizer_path)
    return PALIGEMMA_TOKENIZER if policy_config.vocab_size == PALIGEMMA_VOCAB_SIZE else BUILTIN


def check_tokenizer(cfg: DataConfig, policy_config: Any) -> Any:
    """Load the run's tokenizer (before the model is built) and check its vocabulary against the model's.

    Ids at or above the model's vocab_size would index past its embedding; a model with PaliGemma's
    vocabulary fed another tokenizer's ids trains on meaningless pretrained embeddings, so it is refused
    unless data.check_tokenizer_vocab=false.
    """
    from vla.data.tokenizer import is_builtin, load_tokenizer
    from vla.models.config import PALIGEMMA_VOCAB_SIZE

    path = resolved_tokenizer_path(cfg, policy_config)
    tokenizer = load_tokenizer(path)
    size = len(tokenizer)
    model_vocab = policy_config.vocab_size
    if size > model_vocab:
        raise ValueError(
            f"the tokenizer {path!r} (data.tokenizer_path) has {size} ids but the model's vocab_size is "
            f"{model_vocab}: its ids would index past the token embedding. Use a tokenizer of at most "
            f"{model_vocab} ids, or a model preset with a larger vocabulary."
        )
    if cfg.check_tokenizer_vocab and model_vocab == PALIGEMMA_VOCAB_SIZE and size != PALIGEMMA_VOCAB_SIZE:
        what = "the built-in tokenizer" if is_builtin(path) else f"the tokenizer {path!r}"
        raise ValueError(
            f"this model has PaliGemma's vocabulary ({PALIGEMMA_VOCAB_SIZE} ids) but {what} has {size}: "
            "its ids do not mean what PaliGemma's embeddings learnt. Set data.tokenizer_path to PaliGemma's "
            "tokenizer (google/paligemma-3b-pt-224 from the Hugging Face cache, or a local copy), or "
            "data.check_tokenizer_vocab=false to train with it anyway."
        )
    return tokenizer


def processor_config(cfg: DataConfig, policy_config: Any) -> ProcessorConfig:
    defaults = DEFAULT_NORM_MODES[policy_config.kind]
    norm_modes = {cfg.state_key: defaults["state"]} if cfg.state_key else {}
    norm_modes[cfg.action_key] = defaults["action"]
    norm_modes.update(cfg.norm_modes)  # data.norm_modes overrides the policy's defaults per feature
    if not cfg.camera_map:
        raise ValueError(
            "data.camera_map is empty: map the dataset's camera keys onto the model's cameras "
            f"{list(policy_config.cameras)}, e.g. 'data.camera_map={{observation.images.top: "
            f"{policy_config.cameras[0]}}}'"
        )
    return ProcessorConfig(
        camera_map=dict(cfg.camera_map),
        model_cameras=list(policy_config.cameras),
        image_size=policy_config.vision.image_size,
        max_state_dim=policy_config.max_state_dim,
        max_action_dim=policy_config.max_action_dim,
        action_horizon=policy_config.action_horizon,
        state_key=cfg.state_key,
        action_key=cfg.action_key,
        norm_modes=norm_modes,
        max_prompt_length=cfg.max_prompt_length,
        tokenizer_path=resolved_tokenizer_path(cfg, policy_config),
        uint8_images=cfg.uint8_transport,
    )


def build_data(
    cfg: DataConfig, policy_config: Any, *, micro_batch: int, seed: int, rank: int, world: int, device: Any
) -> DataPipeline:
    """Train / validation loaders (episodes split by `val_fraction`), each sharded over the ranks.

    micro_batch: samples per rank per forward. Every rank sees distinct samples of one global
    permutation, so the union of a step's batches is the same global batch at any world size.
    """
    return build_pipeline(
        dataset_root(cfg, rank),
        processor_config(cfg, policy_config),
        micro_batch,
        val_fraction=cfg.val_fraction,
        episodes=cfg.episodes,
        split_seed=seed,
        seed=seed,
        num_workers=cfg.num_workers,
        frame_cache_mb=cfg.frame_cache_mb,
        rank=rank,
        world_size=world,
        device=device,
        val_shuffle=True,  # validation reads only its first trainer.val_batches batches
        image_transforms=cfg.image_transforms,
        on_bad_frames=cfg.on_bad_frames,
        task_weights=dict(cfg.task_weights),
    )
