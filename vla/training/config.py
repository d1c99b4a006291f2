"""The trainer's configuration: one typed schema per Hydra group, validated at start-up.

Hydra composes `configs/config.yaml` over these dataclasses (registered as `train_schema`), so an
unknown key or a wrong type fails while composing, naming the full key. `__post_init__` checks each
group's values; `validate(cfg, world_size)` checks combinations that span groups (fsdp2 on one
process, a batch that does not split over the ranks, ...). Every error names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any

from vla.data.augment import ImageTransformsConfig
from vla.data.mixture import check_task_weights
from vla.data.scan import ON_BAD_FRAMES

OPTIMIZERS = ("adamw", "muon", "dmuon")
PARALLEL_MODES = ("auto", "none", "ddp", "fsdp2", "hsdp")
DATA_SOURCES = ("synthetic", "lerobot", "metaworld")
TRACKERS = ("tensorboard", "wandb", "tensorboard+wandb", "none")
PRECISIONS = ("fp32", "bf16")
SCHEDULES = ("cosine", "constant", "linear")
NAN_POLICIES = ("stop", "skip")
NORM_MODES = ("MEAN_STD", "MIN_MAX", "QUANTILES", "IDENTITY")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(str(value), choices, n=1)
        fix = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(f"{key}={value!r} is not one of {list(choices)}{fix}")


def _finite(key: str, value: Any) -> None:
    """NaN/inf in a float setting fails here: comparisons with NaN are all False, so range checks
    alone let it through (and a NaN clip norm or lr silently turns the weights into NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value}; set {key} to a finite value")


def check_finite_fields(obj: Any, prefix: str) -> None:
    """Every float (also inside tuples, lists and dicts) of a config dataclass, recursively, is finite.

    Raises ValueError naming the full key (e.g. `optim.betas[1]`, `trainer.closed_loop.seed`).
    """

    def visit(key: str, value: Any) -> None:
        if isinstance(value, float):
            _finite(key, value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                visit(f"{key}.{f.name}", getattr(value, f.name))
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{key}[{k!r}]", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{key}[{i}]", v)

    for f in dataclasses.fields(obj):
        visit(f"{prefix}{f.name}", getattr(obj, f.name))


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    _finite(key, value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass
class ModelConfig:
    """Which policy to build (`vla.models.build_policy(preset, **overrides)`).

    overrides: any policy config field, nested ones as partial dicts (`{"vlm": {"depth": 4}}`);
        build_policy rejects unknown keys by name.
    weights: a checkpoint to start from: a local .safetensors file or directory of shards, or a hub id
        (`lerobot/pi0_base`, fetched through the Hugging Face cache; weights_revision picks a revision):
        LeRobot/openpi pi0, transformers PaliGemma (pi0: the prefix only) or a policy.safetensors of ours.
    weights_format: "auto" (detected from the keys), or force "lerobot_pi0" | "paligemma" | "vla"
        (this repository's own parameter names).
    """

    preset: str = "pi0_small"
    overrides: dict[str, Any] = field(default_factory=dict)
    freeze_vision_tower: bool = False
    train_expert_only: bool = False
    gradient_checkpointing: bool = False
    weights: str | None = None
    weights_revision: str | None = None
    weights_format: str = "auto"

    def __post_init__(self) -> None:
        check_finite_fields(self, "model.")
        _choice("model.weights_format", self.weights_format, ("auto", "lerobot_pi0", "paligemma", "vla"))

    def policy_overrides(self) -> dict[str, Any]:
        out = dict(self.overrides)
        if self.freeze_vision_tower:
            out["freeze_vision_tower"] = True
        if self.gradient_checkpointing:
            out["gradient_checkpointing"] = True
        if self.train_expert_only:
            out["train_expert_only"] = True
        return out


@dataclass
class OptimConfig:
    """The optimizer.

    name: "adamw" (torch AdamW on everything), "muon" (the naive baseline: every rank gathers and
        orthogonalises every matrix, standard NS, no batching) or "dmuon" (owners, Gram, batching,
        overlap). Muon/dmuon route hidden matrices to Muon and the rest to AdamW
        (`dmuon.param_groups` with `adamw_patterns` and `routing_rules`).
    lr / weight_decay: Muon's (or AdamW's when name=adamw).
    adamw_*: the AdamW side of muon/dmuon.
    """

    name: str = "dmuon"
    lr: float = 0.02
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.95
    nesterov: bool = True
    adjust_lr: str | None = "original"
    ns_algorithm: str = "auto"
    ns_coefficients: str = "jordan"
    ns_steps: int = 5
    adamw_lr: float = 1e-3
    adamw_weight_decay: float = 0.0
    planner: str = "lpt"
    cost_model: str = "flops"
    bucket_mb: float = 64.0
    overlap: bool = True
    split: str = "auto"  # dmuon.Muon(split=...): "auto", "off" or "always"
    # dmuon.Muon's distribution options (see its docstring): two-level all-to-alls across nodes, HSDP
    # sharing chosen per matrix, and the opt-in (inexact) bf16 wire for results ("all": momenta too).
    exchange: str = "auto"
    hsdp_replicas: str = "auto"
    wire_dtype: str | None = None
    wire_scope: str = "results"
    # Input/output maps of every tower go to AdamW (one regex; see vla.models.naming).
    adamw_patterns: str = (
        r"(embed_tokens|lm_head|patch_embedding|position_embedding|multi_modal_projector|state_proj"
        r"|action_in_proj|action_out_proj|action_time_mlp_in|action_time_mlp_out)"
    )
    routing_rules: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_finite_fields(self, "optim.")
        _choice("optim.name", self.name, OPTIMIZERS)
        _positive("optim.lr", self.lr, allow_zero=True)
        _positive("optim.adamw_lr", self.adamw_lr, allow_zero=True)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim.adamw_weight_decay", self.adamw_weight_decay, allow_zero=True)
        _positive("optim.eps", self.eps)
        _positive("optim.bucket_mb", self.bucket_mb)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optim.momentum must be in [0, 1), got {self.momentum}")
        _choice("optim.planner", self.planner, ("lpt", "milp"))
        _choice("optim.split", self.split, ("auto", "off", "always"))
        _choice("optim.exchange", self.exchange, ("auto", "flat", "two_level"))
        _choice("optim.hsdp_replicas", self.hsdp_replicas, ("auto", "share", "repeat"))
        _choice("optim.wire_scope", self.wire_scope, ("results", "all"))
        if self.wire_dtype is not None:
            _choice("optim.wire_dtype", self.wire_dtype, ("bfloat16", "float16"))
        _choice("optim.cost_model", self.cost_model, ("flops", "calibrated"))
        _choice("optim.ns_algorithm", self.ns_algorithm, ("standard", "gram", "auto"))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}")
        for i, rule in enumerate(self.routing_rules):
            if "pattern" not in rule:
                raise ValueError(f"optim.routing_rules[{i}] needs a 'pattern' key, got {dict(rule)}")


@dataclass
class SyntheticDataConfig:
    """The generated reach dataset (vla.data.synthetic), written under `root` on first use."""

    episodes: int = 40
    episode_length: int = 50
    image_size: int = 64
    use_videos: bool = True
    codec: str = "av1"
    fps: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        check_finite_fields(self, "data.synthetic.")
        _choice("data.synthetic.codec", self.codec, ("av1", "h264"))
        _positive("data.synthetic.episodes", self.episodes)
        _positive("data.synthetic.episode_length", self.episode_length)


@dataclass
class MetaWorldDataConfig:
    """Scripted-expert MetaWorld demonstrations (vla.sim.demos), recorded under `root` on first use.

    episodes: successful episodes per task; seeds seed, seed + 1, ... are tried per task.
    """

    tasks: list[str] = field(
        default_factory=lambda: [
            "reach-v3",
            "push-v3",
            "pick-place-v3",
            "drawer-open-v3",
            "button-press-topdown-v3",
        ]
    )
    episodes: int = 50
    resolution: int = 64
    cameras: list[str] = field(default_factory=lambda: ["corner2", "topview"])
    seed: int = 0
    max_episode_steps: int = 200
    codec: str = "h264"  # vla.sim.demos.DemoConfig says why not AV1, and why crf 18
    crf: int = 18
    action_noise: float = 0.0  # DART-style noise on the executed hand action; vla.sim.demos.DemoConfig
    hand_start_noise: float = 0.0  # metres; random hand starts in the recording; vla.sim.demos.DemoConfig
    steps_after_success: int = 0  # expert steps recorded past the first success; vla.sim.demos.DemoConfig
    expert_aims_tcp: bool = False  # reach experts aim the tcp at the goal; vla.sim.demos.DemoConfig
    # Processes rolling out the expert while recording (0: one per CPU, at most 8). Not a setting of the
    # recording: any number gives the same dataset, and a recording is reused whatever it was.
    workers: int = 0

    def __post_init__(self) -> None:
        check_finite_fields(self, "data.metaworld.")
        _positive("data.metaworld.workers", self.workers, allow_zero=True)
        if not 0 <= self.action_noise <= 1:
            raise ValueError(
                f"data.metaworld.action_noise must be in [0, 1] (action units), got {self.action_noise}"
            )
        # 0.2: vla.sim.demos.MAX_HAND_START_NOISE, not imported here (vla.sim picks the GL backend on import)
        if not 0 <= self.hand_start_noise <= 0.2:
            raise ValueError(
                f"data.metaworld.hand_start_noise must be in [0, 0.2] metres, got {self.hand_start_noise}"
            )
        _choice("data.metaworld.codec", self.codec, ("av1", "h264"))
        _positive("data.metaworld.steps_after_success", self.steps_after_success, allow_zero=True)
        if self.steps_after_success >= self.max_episode_steps:
            raise ValueError(
                f"data.metaworld.steps_after_success ({self.steps_after_success}) must be below "
                f"data.metaworld.max_episode_steps ({self.max_episode_steps})"
            )
        _positive("data.metaworld.episodes", self.episodes)
        _positive("data.metaworld.resolution", self.resolution)
        _positive("data.metaworld.max_episode_steps", self.max_episode_steps)
        _positive("data.metaworld.seed", self.seed, allow_zero=True)
        if not 0 <= self.crf <= 51:
            raise ValueError(f"data.metaworld.crf must be in [0, 51] (lower: better quality), got {self.crf}")
        if not self.tasks:
            raise ValueError(
                "data.metaworld.tasks is empty; list MetaWorld tasks such as [reach-v3, push-v3]"
            )
        if not self.cameras:
            raise ValueError(
                "data.metaworld.cameras is empty; list MetaWorld cameras such as [corner2, topview]"
            )


@dataclass
class DataConfig:
    """Where the LeRobot v3.0 dataset is and how its features map onto the policy.

    camera_map: dataset image key -> the model's camera name (see the model preset's cameras). Empty
        with source=metaworld: each recorded camera (data.metaworld.cameras), whose video the recorder
        names observation.images.<camera>, goes to the model camera of the same name.
    norm_modes: feature -> MEAN_STD | MIN_MAX | QUANTILES | IDENTITY; features not listed get the policy's
        default (pi0: MEAN_STD for state and action; OpenVLA-style: QUANTILES for action).
    """

    source: str = "synthetic"
    # required (the data group or the command line sets it), unless repo_id names a hub dataset: root is
    # then set to its snapshot in the Hugging Face cache
    root: str | None = "???"
    repo_id: str | None = None  # a LeRobot dataset on the hub (v3.0 or v2.1), e.g. lerobot/pusht
    revision: str | None = None  # of repo_id: a branch, tag (v3.0, v2.1) or commit
    episodes: list[int] | None = None
    val_fraction: float = 0.1
    camera_map: dict[str, str] = field(default_factory=dict)
    state_key: str | None = "observation.state"
    action_key: str = "action"
    norm_modes: dict[str, str] = field(default_factory=dict)
    # null: the model's own (PaliGemma's google/paligemma-3b-pt-224 for presets with its vocabulary, the
    # built-in one otherwise); `builtin`; a local directory; or a hub id (through the HF cache)
    tokenizer_path: str | None = None
    # A model with PaliGemma's vocabulary refuses a tokenizer of another size unless this is false
    check_tokenizer_vocab: bool = True
    max_prompt_length: int = 24
    num_workers: int = 2
    # Per-process budget (MB) of decoded frames kept in memory, in each DataLoader worker and the main
    # process; it fills only as frames are read. Where the dataset's decoded video frames fit, whole
    # episodes are decoded on a miss and later epochs read from memory (MetaWorld's 250 episodes at
    # 64 px: 390 MB); where they do not, only the frames asked for are decoded. 0 turns it off.
    frame_cache_mb: float = 1024.0
    on_bad_frames: str = "error"  # NaN/inf or empty tasks in a frame: error | drop_episode (vla.data.scan)
    # task (its text in meta/tasks) -> how often training draws its frames, relative to now (vla.data.mixture):
    # 2 twice as often, 0 never; tasks not named 1. Validation is unweighted.
    task_weights: dict[str, float] = field(default_factory=dict)
    uint8_transport: bool = True
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    metaworld: MetaWorldDataConfig = field(default_factory=MetaWorldDataConfig)
    # Training-only image augmentation (LeRobot's ImageTransformsConfig names; vla.data.augment)
    image_transforms: ImageTransformsConfig = field(default_factory=ImageTransformsConfig)

    def __post_init__(self) -> None:
        check_finite_fields(self, "data.")
        _choice("data.source", self.source, DATA_SOURCES)
        if self.source == "metaworld" and not self.camera_map:
            self.camera_map = {f"observation.images.{c}": c for c in self.metaworld.cameras}
        if self.repo_id is not None and self.source != "lerobot":
            raise ValueError(
                f"data.repo_id names a hub dataset, which needs data=lerobot (data.source is {self.source})"
            )
        if self.root is None and self.repo_id is None:
            raise ValueError(
                "data.root is not set: give a local LeRobot dataset (data.root=/path/to/dataset) or a hub id "
                "(data.repo_id=org/name)"
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        _positive("data.num_workers", self.num_workers, allow_zero=True)
        _positive("data.frame_cache_mb", self.frame_cache_mb, allow_zero=True)
        _choice("data.on_bad_frames", self.on_bad_frames, ON_BAD_FRAMES)
        _positive("data.max_prompt_length", self.max_prompt_length)
        for feature, mode in self.norm_modes.items():
            _choice(f"data.norm_modes[{feature!r}]", mode, NORM_MODES)
        check_task_weights(self.task_weights)


@dataclass
class ClosedLoopConfig:
    """Closed-loop evaluation in MetaWorld (vla.eval.closed_loop), for runs on data=metaworld.

    Runs at the end of training and, with every > 0, every `every` steps; success per task goes to
    metrics.jsonl / TensorBoard (eval/success/<task>, with eval/train_s: the training seconds so far,
    evaluation and validation excluded) and the summary: a curve of success against steps and seconds
    (vla.eval.curves). episodes=0 turns it off; final_episodes: the last evaluation's episodes per task
    (null: episodes), e.g. a cheap curve every K steps and a thorough final number.
    tasks: null evaluates the dataset's tasks. seed: episode e runs on seed + e; seeds the dataset was
    recorded on are refused. The episodes are split over the ranks.
    """

    episodes: int = 10
    final_episodes: int | None = None
    every: int = 0
    tasks: list[str] | None = None
    seed: int = 1000
    replan_every: int = 5
    max_episode_steps: int = 200
    parallel_envs: int = 10
    videos: int = 0

    def __post_init__(self) -> None:
        check_finite_fields(self, "trainer.closed_loop.")
        for key in ("episodes", "every", "seed", "videos"):
            _positive(f"trainer.closed_loop.{key}", getattr(self, key), allow_zero=True)
        if self.final_episodes is not None:
            _positive("trainer.closed_loop.final_episodes", self.final_episodes)
        for key in ("replan_every", "max_episode_steps", "parallel_envs"):
            _positive(f"trainer.closed_loop.{key}", getattr(self, key))


@dataclass
class TrainerConfig:
    """The fit loop. batch_size is global (split over ranks), per optimizer step.

    stop_grace_s: after SIGINT/SIGTERM inside a training step, how long to wait for the step to end
        (then a checkpoint is saved and the run stops); past it, or outside a step (building data,
        validation, evaluation), the run stops at once without saving (see vla.training.guards).
    warmup_steps: linear warmup; one as long as the run is shortened to 10% of it (with a log line).
    schedule_steps: the steps the lr schedule spans (null: trainer.steps); a run of fewer steps follows
        the first part of a longer run's schedule (e.g. a short check of a long run's first steps).
    lengthen_schedule_at: steps at which the schedule, planned to end there, is lengthened to the next
        one (the last: to schedule_steps / steps). `[4000]` with steps=10000 trains with the lrs of a
        4000-step run continued to 10000 with `trainer.resume=auto trainer.steps=10000` (the cosine
        restarts warm: its multiplier goes from min_lr_ratio back up to where a 10000-step cosine is at
        step 4000), in one run.
    """

    steps: int = 100
    batch_size: int = 8
    grad_accum: int = 1
    clip_grad_norm: float | None = 1.0
    schedule: str = "cosine"
    warmup_steps: int = 10
    schedule_steps: int | None = None
    lengthen_schedule_at: list[int] = field(default_factory=list)
    min_lr_ratio: float = 0.1
    seed: int = 0
    precision: str = "fp32"
    # torch.compile each shard unit (layer pair, vision block) before sharding, as torchtitan does;
    # compile_mode: null (inductor's default) | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    compile: bool = False
    compile_mode: str | None = None
    # EMA of the weights (validation, closed loop and export use it); warmed up as TensorFlow and diffusers
    # do: the n-th update uses min(ema_decay, (1 + n) / (10 + n)) (vla.training.ema)
    ema_decay: float | None = None
    log_every: int = 1
    val_every: int = 50
    val_batches: int = 4
    open_loop_eval: bool = True  # at the end: sampled chunks vs recorded actions on held-out episodes
    closed_loop: ClosedLoopConfig = field(default_factory=ClosedLoopConfig)
    checkpoint_every: int = 50
    keep_last: int = 2
    resume: str = "none"
    # A fresh run into a dir holding another run moves that run aside (vla.training.rundir).
    overwrite: bool = False
    # Refuse a run whose estimated memory exceeds the device's (vla.training.preflight).
    check_memory: bool = True
    export_safetensors: bool = True
    nan_policy: str = "stop"
    max_skipped_steps: int = 0
    save_on_interrupt: bool = True
    stop_grace_s: float = 120.0
    progress_bar: bool = True
    # Where metrics go besides metrics.jsonl: tensorboard | wandb | tensorboard+wandb | none
    tracker: str = "tensorboard"
    wandb_project: str = "vla"
    wandb_mode: str | None = None  # online | offline | disabled; null: wandb's own (WANDB_MODE, else online)

    def _check_lengthen_schedule_at(self) -> None:
        stages = list(self.lengthen_schedule_at)
        final = self.schedule_steps if self.schedule_steps is not None else self.steps
        if stages != sorted(set(stages)) or (
            stages and (stages[0] <= self.warmup_steps or stages[-1] >= final)
        ):
            raise ValueError(
                f"trainer.lengthen_schedule_at={stages} must rise strictly, start after the warmup "
                f"(trainer.warmup_steps={self.warmup_steps}) and end before the schedule does ({final} steps: "
                "trainer.schedule_steps, else trainer.steps)"
            )

    def __post_init__(self) -> None:
        check_finite_fields(self, "trainer.")
        _choice("trainer.tracker", self.tracker, TRACKERS)
        if self.wandb_mode is not None:
            _choice("trainer.wandb_mode", self.wandb_mode, ("online", "offline", "disabled"))
        for key in (
            "steps",
            "batch_size",
            "grad_accum",
            "log_every",
            "val_every",
            "checkpoint_every",
            "keep_last",
        ):
            _positive(f"trainer.{key}", getattr(self, key))
        _positive("trainer.warmup_steps", self.warmup_steps, allow_zero=True)
        if self.schedule_steps is not None and self.schedule_steps < self.steps:
            raise ValueError(
                f"trainer.schedule_steps={self.schedule_steps} is shorter than trainer.steps={self.steps}; the "
                "schedule must cover the run: raise it or leave it null"
            )
        self._check_lengthen_schedule_at()
        _positive("trainer.val_batches", self.val_batches, allow_zero=True)
        _positive("trainer.max_skipped_steps", self.max_skipped_steps, allow_zero=True)
        _positive("trainer.stop_grace_s", self.stop_grace_s)
        _choice("trainer.schedule", self.schedule, SCHEDULES)
        _choice("trainer.precision", self.precision, PRECISIONS)
        if self.compile_mode is not None:
            _choice(
                "trainer.compile_mode",
                self.compile_mode,
                ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
            )
        _choice("trainer.nan_policy", self.nan_policy, NAN_POLICIES)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip_grad_norm is not None:
            _positive("trainer.clip_grad_norm", self.clip_grad_norm)
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"trainer.ema_decay must be in (0, 1) or null, got {self.ema_decay}")


@dataclass
class ParallelConfig:
    """How ranks share the model. fsdp2 shards each policy unit (layer pairs, vision blocks); auto (the
    default): none on one process, fsdp2 on several (ddp for a policy without shard units). hsdp: FSDP2
    on a 2-D mesh, the model replicated `replicas` times and sharded within each replica (replicas
    null: one per node, WORLD_SIZE / LOCAL_WORLD_SIZE), so parameter all-gathers stay inside a node."""

    mode: str = "auto"
    replicas: int | None = None
    reshard_after_forward: bool = True
    backend: str | None = None  # default: nccl on CUDA, gloo on CPU
    timeout_s: int = 600

    def __post_init__(self) -> None:
        check_finite_fields(self, "parallel.")
        _choice("parallel.mode", self.mode, PARALLEL_MODES)
        _positive("parallel.timeout_s", self.timeout_s)
        if self.replicas is not None:
            _positive("parallel.replicas", self.replicas)


@dataclass
class TrainConfig:
    """The whole run; `output_dir` receives config.yaml, metrics.jsonl, tb/, checkpoints/."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output_dir: str = "outputs/run"
    run_name: str = "run"


def hsdp_replicas(parallel: ParallelConfig, world_size: int) -> int:
    """parallel.replicas, or one replica per node (torchrun's LOCAL_WORLD_SIZE processes each)."""
    if parallel.replicas is not None:
        return parallel.replicas
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(1, world_size // max(local, 1))


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Checks that span groups; raise ValueError naming the keys and the fix."""
    check_finite_fields(cfg, "")  # again: a config may have been changed after construction
    parallel = cfg.parallel.mode
    if parallel == "hsdp":
        replicas = hsdp_replicas(cfg.parallel, world_size)
        if replicas < 2 or world_size % replicas or world_size // replicas < 2:
            raise ValueError(
                f"parallel=hsdp needs replicas >= 2 that divide the {world_size} processes into shard groups of "
                f">= 2, got parallel.replicas={replicas}; set parallel.replicas (e.g. the number of nodes) or "
                "use parallel=fsdp2"
            )
    if parallel in ("ddp", "fsdp2") and world_size < 2:
        raise ValueError(
            f"parallel={parallel} needs several processes but this run has {world_size}; launch with "
            f"`torchrun --nproc_per_node N train.py parallel={parallel}` or use parallel=none"
        )
    if parallel == "none" and world_size > 1:
        raise ValueError(
            f"this run has {world_size} processes but parallel=none; pick parallel=ddp or parallel=fsdp2"
        )
    per_step = cfg.trainer.batch_size
    if per_step % (world_size * cfg.trainer.grad_accum):
        raise ValueError(
            f"trainer.batch_size={per_step} must divide by world size x grad_accum = {world_size} x "
            f"{cfg.trainer.grad_accum}; set trainer.batch_size to a multiple of {world_size * cfg.trainer.grad_accum}"
        )
    if cfg.model.train_expert_only and not cfg.model.preset.startswith("pi0"):
        raise ValueError(
            f"model.train_expert_only applies to pi0 presets only (there is no action expert in {cfg.model.preset!r})"
        )
    if cfg.data.source != "lerobot" and cfg.data.episodes is not None:
        raise ValueError(
            f"data.episodes selects episodes of a lerobot dataset; drop it for data={cfg.data.source}"
        )


def _reject_unknown_keys(node: Any, schema: type, prefix: str) -> None:
    """Keys added with Hydra's `+key=value` slip past the typed schema; name them and the known ones."""
    import dataclasses

    known = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        if key not in known:
            hint = difflib.get_close_matches(str(key), list(known), n=1)
            fix = f" (did you mean {prefix}{hint[0]}?)" if hint else ""
            raise ValueError(
                f"unknown config key {prefix}{key}{fix}; {prefix.rstrip('.') or 'the root'} has {sorted(known)}"
            )
        default = (
            known[key].default_factory() if known[key].default_factory is not dataclasses.MISSING else None
        )
        if dataclasses.is_dataclass(default):
            _reject_unknown_keys(node[key], type(default), f"{prefix}{key}.")


# `key: ${required:"key=<example>"}` in a config marks a value the command line must give. YAML's `???`
# cannot: OmegaConf's merge keeps the value beneath it (the schema's default, e.g. model.weights' None).
REQUIRED_RESOLVER = "required"


def required_value(example: str) -> Any:
    """The `${required:...}` resolver: reached only if a value marked required is read before
    to_train_config names it (its message then still says what to set)."""
    raise ValueError(f"a required config value is not set: give {example}")


def unset_required_values(cfg: Any) -> dict[str, str]:
    """{full key: example override} for every value still marked `${required:example}` in `cfg` (values
    of mappings; the marker is not looked for inside lists)."""
    from omegaconf import OmegaConf

    prefix = "${" + REQUIRED_RESOLVER + ":"
    found: dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}{key}.")
        elif isinstance(node, str) and node.startswith(prefix) and node.endswith("}"):
            found[path.rstrip(".")] = node[len(prefix) : -1].strip().strip("'\"")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return found


def to_train_config(cfg: Any) -> TrainConfig:
    """The composed DictConfig as a TrainConfig: runs every group's `__post_init__` checks."""
    from omegaconf import OmegaConf

    _reject_unknown_keys(cfg, TrainConfig, "")
    required = unset_required_values(cfg)
    # missing_keys reads every value, which would run the resolver of a required one: named above instead.
    missing = sorted(OmegaConf.missing_keys(cfg)) if not required else []
    if required or missing:
        # to_object would silently fall back to the dataclass defaults for these.
        raise ValueError(
            f"missing required config values: {sorted(required) + missing}; set them on the command line, "
            "e.g. "
            + " ".join([*(required[key] for key in sorted(required)), *(f"{key}=..." for key in missing)])
        )
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]
