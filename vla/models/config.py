"""Policy configurations: the sizes of each tower, the action/state layout, and the named presets.

Configs are frozen dataclasses validated in `__post_init__`, so a bad size fails at construction with a
message naming the field, not deep inside a forward pass. `config_from_dict` / `PolicyConfig.to_dict`
round-trip them through plain dicts (YAML, checkpoints).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

# Cameras of the openpi / LeRobot ALOHA-style setups that the full-size presets follow.
OPENPI_CAMERAS: tuple[str, ...] = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
# Cameras of the small presets; the synthetic dataset maps its cameras onto these names.
SMALL_CAMERAS: tuple[str, ...] = ("top", "wrist")

# PaliGemma keeps its last 128 token ids for special tokens; OpenVLA-style action bins sit right below them.
PALIGEMMA_RESERVED_TAIL_TOKENS = 128
# An OpenVLA-style vocabulary must leave at least this many ids for text below the action bins.
MIN_TEXT_TOKENS = 256


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_positive_ints(owner: str, **values: int) -> None:
    for name, value in values.items():
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            f"{owner}.{name} must be a positive int, got {value!r}",
        )


@dataclass(frozen=True)
class GemmaSpec:
    """Size of one Gemma decoder stack.

    width: hidden size; depth: number of decoder layers; mlp_dim: GeGLU hidden size;
    num_heads / num_kv_heads / head_dim: attention (multi-query when num_kv_heads == 1).
    """

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _require_positive_ints(
            "GemmaSpec",
            width=self.width,
            depth=self.depth,
            mlp_dim=self.mlp_dim,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"GemmaSpec.num_heads ({self.num_heads}) must be a multiple of "
            f"num_kv_heads ({self.num_kv_heads})",
        )
        _require(self.head_dim % 2 == 0, f"GemmaSpec.head_dim must be even for RoPE, got {self.head_dim}")


@dataclass(frozen=True)
class SiglipSpec:
    """Size of a SigLIP vision tower: a ViT over image_size^2 pixels cut into patch_size^2 patches."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    patch_size: int
    image_size: int

    def __post_init__(self) -> None:
        _require_positive_ints(
            "SiglipSpec",
            width=self.width,
            depth=self.depth,
            mlp_dim=self.mlp_dim,
            num_heads=self.num_heads,
            patch_size=self.patch_size,
            image_size=self.image_size,
        )
        _require(
            self.width % self.num_heads == 0,
            f"SiglipSpec.width ({self.width}) must be divisible by num_heads ({self.num_heads})",
        )
        _require(
            self.image_size % self.patch_size == 0,
            f"SiglipSpec.image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})",
        )

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


GEMMA_2B = GemmaSpec(width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1, head_dim=256)
GEMMA_300M = GemmaSpec(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256)
SIGLIP_SO400M_14_224 = SiglipSpec(
    width=1152, depth=27, mlp_dim=4304, num_heads=16, patch_size=14, image_size=224
)
PALIGEMMA_VOCAB_SIZE = 257152

# Small: Gemma-2B / gemma_300m aspect ratios (VLM mlp = 8 x width, expert mlp = 4 x width and half the VLM
# width, 8 query heads sharing one KV head), with matrices big enough (4096 x 512) that Newton-Schulz costs
# something. Depth and image tokens are cut so one pi0 forward+backward at batch 8 (2 cameras, horizon 50)
# takes about a second on 2 CPU cores: depth 6 at 64 tokens per image measured ~4 s.
GEMMA_SMALL = GemmaSpec(width=512, depth=3, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=64)
GEMMA_SMALL_EXPERT = GemmaSpec(width=256, depth=3, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=64)
SIGLIP_SMALL = SiglipSpec(width=384, depth=3, mlp_dim=1536, num_heads=6, patch_size=16, image_size=112)
# Tiny: for tests; builds in milliseconds.
GEMMA_TINY = GemmaSpec(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16)
GEMMA_TINY_EXPERT = GemmaSpec(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=16)
SIGLIP_TINY = SiglipSpec(width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=14, image_size=28)
# Sim: sized for closed-loop MetaWorld studies on 2 CPU cores: two 64-px cameras cut into 16-px patches
# (16 tokens each; 8-px patches cost 2.5x the step time), the VLM/expert aspect ratios of GEMMA_SMALL
# (Muon matrices 2048 x 256), a 16-step chunk (0.2 s of control at 80 Hz). A step at batch 32 takes
# ~0.3 s here.
GEMMA_SIM = GemmaSpec(width=256, depth=3, mlp_dim=2048, num_heads=8, num_kv_heads=1, head_dim=32)
GEMMA_SIM_EXPERT = GemmaSpec(width=128, depth=3, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32)
SIGLIP_SIM = SiglipSpec(width=192, depth=2, mlp_dim=768, num_heads=4, patch_size=16, image_size=64)
SIM_CAMERAS: tuple[str, ...] = ("corner2", "topview")  # MetaWorld camera names (vla.sim)
# Small vocabularies leave room for a built-in tokenizer (< 400 ids) below the OpenVLA action bins.
SMALL_VOCAB_SIZE = 1024


@dataclass(frozen=True)
class PolicyConfig:
    """Fields shared by every policy: the PaliGemma prefix and the padded state/action layout.

    vision / vlm: SigLIP tower and Gemma language model of the PaliGemma prefix.
    vocab_size: size of the Gemma token embedding (prompt token ids must be below it).
    cameras: camera names the policy expects in `Observation.images`, in prefix order.
    action_horizon: H, actions per predicted chunk.
    max_state_dim / max_action_dim: S / A, widths the data pipeline pads state and actions to.
    freeze_vision_tower: keep SigLIP fixed (requires_grad=False).
    gradient_checkpointing: recompute each decoder layer (and SigLIP layer) in backward.
    rope_theta / rms_norm_eps: Gemma's RoPE base and RMSNorm epsilon.
    """

    kind: ClassVar[str] = ""

    vision: SiglipSpec
    vlm: GemmaSpec
    vocab_size: int = PALIGEMMA_VOCAB_SIZE
    cameras: tuple[str, ...] = OPENPI_CAMERAS
    action_horizon: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    freeze_vision_tower: bool = False
    gradient_checkpointing: bool = False
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name, spec_type in (("vision", SiglipSpec), ("vlm", GemmaSpec)):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, _spec_from_dict(spec_type, value, f"{owner}.{name}"))
            elif not isinstance(value, spec_type):
                raise TypeError(f"{owner}.{name} must be a {spec_type.__name__} or a dict, got {type(value)}")
        if isinstance(self.cameras, str):
            raise TypeError(
                f"{owner}.cameras must be a sequence of camera names, got the string {self.cameras!r}"
            )
        object.__setattr__(self, "cameras", tuple(self.cameras))
        _require(len(self.cameras) > 0, f"{owner}.cameras must name at least one camera")
        _require(
            len(set(self.cameras)) == len(self.cameras), f"{owner}.cameras has duplicates: {self.cameras}"
        )
        _require(
            all(isinstance(c, str) and c for c in self.cameras),
            f"{owner}.cameras must be non-empty strings: {self.cameras}",
        )
        _require_positive_ints(
            owner,
            vocab_size=self.vocab_size,
            action_horizon=self.action_horizon,
            max_state_dim=self.max_state_dim,
            max_action_dim=self.max_action_dim,
        )
        _require(self.rope_theta > 0, f"{owner}.rope_theta must be > 0, got {self.rope_theta}")
        _require(self.rms_norm_eps > 0, f"{owner}.rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (nested specs as dicts, `kind` included); `config_from_dict` inverts it."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def replace(self, **overrides: Any) -> PolicyConfig:
        """A copy with `overrides` applied; nested spec fields accept partial dicts (`vlm={"depth": 4}`)."""
        return _apply_overrides(self, overrides)


@dataclass(frozen=True)
class Pi0Config(PolicyConfig):
    """pi0: PaliGemma prefix + a Gemma action expert trained by flow matching.

    expert: the action expert's Gemma stack; it must match the VLM in depth, heads, KV heads and head_dim
        because both streams meet in one attention per layer.
    num_inference_steps: Euler steps of `sample_actions` (t = 1 -> 0).
    time_beta_alpha / time_beta_beta / time_min: training times
        t = Beta(alpha, beta) * (1 - time_min) + time_min, so t = 1 is pure noise and t never reaches 0.
    time_min_period / time_max_period: periods of the sinusoidal time embedding.
    train_expert_only: freeze the whole PaliGemma prefix (vision, projector, embedding, VLM layers).
    use_state: read `observation.state` (pi0's default). False makes the state token state_proj's bias
        alone, whatever the state, with state_proj.weight held at zero and frozen, so that an export
        ignores the state in LeRobot's PI0Policy too. Against the copycat shortcut: where every
        demonstration starts from one hand pose, the hand's offset from it tells the direction of the
        motion, and a policy that learns to read that never learns to read the goal from its images.
    """

    kind: ClassVar[str] = "pi0"

    expert: GemmaSpec = GEMMA_300M
    num_inference_steps: int = 10
    time_beta_alpha: float = 1.5
    time_beta_beta: float = 1.0
    time_min: float = 0.001
    time_min_period: float = 4e-3
    time_max_period: float = 4.0
    train_expert_only: bool = False
    use_state: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.expert, dict):
            object.__setattr__(self, "expert", _spec_from_dict(GemmaSpec, self.expert, "Pi0Config.expert"))
        elif not isinstance(self.expert, GemmaSpec):
            raise TypeError(f"Pi0Config.expert must be a GemmaSpec or a dict, got {type(self.expert)}")
        super().__post_init__()
        for name in ("depth", "num_heads", "num_kv_heads", "head_dim"):
            vlm_value, expert_value = getattr(self.vlm, name), getattr(self.expert, name)
            _require(
                vlm_value == expert_value,
                f"Pi0Config: vlm.{name} ({vlm_value}) != expert.{name} ({expert_value}); the two streams "
                "share one attention per layer, so depth, num_heads, num_kv_heads and head_dim must match",
            )
        _require(
            self.expert.width % 2 == 0,
            f"Pi0Config.expert.width must be even (sin/cos time embedding), got {self.expert.width}",
        )
        _require_positive_ints("Pi0Config", num_inference_steps=self.num_inference_steps)
        _require(
            isinstance(self.use_state, bool),
            f"Pi0Config.use_state must be true or false, got {self.use_state!r}",
        )
        _require(
            self.time_beta_alpha > 0 and self.time_beta_beta > 0,
            f"Pi0Config.time_beta_alpha/beta must be > 0, got {self.time_beta_alpha}, {self.time_beta_beta}",
        )
        _require(0.0 <= self.time_min < 1.0, f"Pi0Config.time_min must be in [0, 1), got {self.time_min}")
        _require(
            0 < self.time_min_period < self.time_max_period,
            "Pi0Config needs 0 < time_min_period < time_max_period, got "
            f"{self.time_min_period}, {self.time_max_period}",
        )


@dataclass(frozen=True)
class OpenVLAConfig(PolicyConfig):
    """OpenVLA-style: PaliGemma that writes each real action dim of each step as one of 256 bin tokens.

    action_dim: number of real action dims (the first ones of the padded vector). None: training reads them
        from `Batch.action_dim_mask`; `sample_actions` on a bare Observation then needs this set.
    num_action_bins: uniform bins over [-1, 1] per action dim.
    reserved_tail_tokens: special ids at the end of the vocabulary that the bins skip (PaliGemma: 128).
    The proprioceptive state is not an input, as in OpenVLA.
    """

    kind: ClassVar[str] = "openvla"

    action_horizon: int = 8
    action_dim: int | None = None
    num_action_bins: int = 256
    reserved_tail_tokens: int = PALIGEMMA_RESERVED_TAIL_TOKENS

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive_ints("OpenVLAConfig", num_action_bins=self.num_action_bins)
        _require(
            isinstance(self.reserved_tail_tokens, int) and self.reserved_tail_tokens >= 0,
            f"OpenVLAConfig.reserved_tail_tokens must be an int >= 0, got {self.reserved_tail_tokens!r}",
        )
        if self.action_dim is not None:
            _require(
                isinstance(self.action_dim, int) and 0 < self.action_dim <= self.max_action_dim,
                f"OpenVLAConfig.action_dim must be in [1, max_action_dim={self.max_action_dim}], "
                f"got {self.action_dim!r}",
            )
        needed = MIN_TEXT_TOKENS + self.num_action_bins + self.reserved_tail_tokens
        _require(
            self.vocab_size >= needed,
            f"OpenVLAConfig.vocab_size ({self.vocab_size}) is too small: the {self.num_action_bins} "
            f"action bins and {self.reserved_tail_tokens} reserved tail ids must leave >= {MIN_TEXT_TOKENS} "
            "text ids, "
            f"so vocab_size must be >= {needed}",
        )

    @property
    def first_action_token_id(self) -> int:
        """Lowest token id used by an action bin; every prompt id must be below it."""
        return self.vocab_size - self.reserved_tail_tokens - self.num_action_bins


CONFIG_TYPES: dict[str, type[PolicyConfig]] = {"pi0": Pi0Config, "openvla": OpenVLAConfig}

PRESETS: dict[str, PolicyConfig] = {
    "pi0": Pi0Config(vision=SIGLIP_SO400M_14_224, vlm=GEMMA_2B, expert=GEMMA_300M),
    "pi0_small": Pi0Config(
        vision=SIGLIP_SMALL,
        vlm=GEMMA_SMALL,
        expert=GEMMA_SMALL_EXPERT,
        vocab_size=SMALL_VOCAB_SIZE,
        cameras=SMALL_CAMERAS,
    ),
    "pi0_sim": Pi0Config(
        vision=SIGLIP_SIM,
        vlm=GEMMA_SIM,
        expert=GEMMA_SIM_EXPERT,
        vocab_size=SMALL_VOCAB_SIZE,
        cameras=SIM_CAMERAS,
        action_horizon=16,
    ),
    "pi0_tiny": Pi0Config(
        vision=SIGLIP_TINY,
        vlm=GEMMA_TINY,
        expert=GEMMA_TINY_EXPERT,
        vocab_size=SMALL_VOCAB_SIZE,
        cameras=SMALL_CAMERAS,
        action_horizon=10,
    ),
    "openvla": OpenVLAConfig(vision=SIGLIP_SO400M_14_224, vlm=GEMMA_2B),
    "openvla_small": OpenVLAConfig(
        vision=SIGLIP_SMALL, vlm=GEMMA_SMALL, vocab_size=SMALL_VOCAB_SIZE, cameras=SMALL_CAMERAS
    ),
    "openvla_tiny": OpenVLAConfig(
        vision=SIGLIP_TINY,
        vlm=GEMMA_TINY,
        vocab_size=SMALL_VOCAB_SIZE,
        cameras=SMALL_CAMERAS,
        action_horizon=4,
    ),
}


def _spec_from_dict(spec_type: type, values: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(spec_type)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(names)}")
    missing = sorted(names - set(values))
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing} for {spec_type.__name__}")
    return spec_type(**values)


def _apply_overrides(config: PolicyConfig, overrides: dict[str, Any]) -> PolicyConfig:
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(
            f"unknown {type(config).__name__} override(s) {unknown}; valid keys: {sorted(names)}"
        )
    resolved: dict[str, Any] = {}
    for name, value in overrides.items():
        current = getattr(config, name)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            # A partial dict updates a nested spec: vlm={"depth": 4} keeps the other vlm sizes.
            spec_names = {f.name for f in dataclasses.fields(current)}
            unknown_nested = sorted(set(value) - spec_names)
            if unknown_nested:
                raise ValueError(
                    f"unknown {type(config).__name__}.{name} override(s) {unknown_nested}; "
                    f"valid keys: {sorted(spec_names)}"
                )
            value = dataclasses.replace(current, **value)
        resolved[name] = value
    return dataclasses.replace(config, **resolved)


def config_from_dict(values: dict[str, Any]) -> PolicyConfig:
    """Build a config from a dict: {"preset": name, **overrides} or {"kind": "pi0"|"openvla", **fields}.

    The second form is what `PolicyConfig.to_dict()` writes, so configs saved next to checkpoints round-trip.
    """
    values = dict(values)
    if "preset" in values:
        if "kind" in values:
            raise ValueError("a policy config dict takes either 'preset' or 'kind', not both")
        return _apply_overrides(get_preset(values.pop("preset")), values)
    if "kind" not in values:
        raise ValueError(
            "a policy config dict needs 'preset' (one of "
            f"{sorted(PRESETS)}) or 'kind' (one of {sorted(CONFIG_TYPES)}); got keys {sorted(values)}"
        )
    kind = values.pop("kind")
    if kind not in CONFIG_TYPES:
        raise ValueError(f"unknown policy kind {kind!r}; valid kinds: {sorted(CONFIG_TYPES)}")
    config_type = CONFIG_TYPES[kind]
    names = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {config_type.__name__} key(s) {unknown}; valid keys: {sorted(names)}")
    return config_type(**values)


def get_preset(name: str) -> PolicyConfig:
    """The preset config called `name`; an unknown name raises listing the valid ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown policy preset {name!r}; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]


__all__ = [
    "CONFIG_TYPES",
    "GEMMA_2B",
    "GEMMA_300M",
    "OPENPI_CAMERAS",
    "PALIGEMMA_VOCAB_SIZE",
    "PRESETS",
    "SIGLIP_SO400M_14_224",
    "SMALL_CAMERAS",
    "GemmaSpec",
    "OpenVLAConfig",
    "Pi0Config",
    "PolicyConfig",
    "SiglipSpec",
    "config_from_dict",
    "get_preset",
]
