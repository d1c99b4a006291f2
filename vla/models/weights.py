"""Checkpoint I/O: our parameter names <-> the LeRobot/openpi pi0 layout and transformers' PaliGemma layout.

The key maps live here, out of the modeling code. Each `KeyMap` says how one of our parameter names is
spelled in an external layout (regex rules, first match wins; no match = the layout does not hold it),
which other spellings of the same tensors exist (older transformers / LeRobot versions), which keys a
checkpoint may carry that we never read, and which tied copy can stand in for a missing key.

Loading is strict: every key the layout expects must be there with the right shape, and every key in the
file must be known; otherwise one `CheckpointMismatchError` lists all problems.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from vla.atomic import write_file_atomically
from vla.models.config import Pi0Config
from vla.models.openvla import OpenVLAPolicy
from vla.models.pi0 import Pi0Policy

_SHOWN_PER_LIST = 25


@dataclass(frozen=True)
class KeyMap:
    """How our parameter names are spelled in one external checkpoint layout.

    to_external: (regex on our name, replacement) pairs; first match wins; unmatched names are not part of
        this layout (e.g. the action expert in a PaliGemma checkpoint) and are left as initialised.
    aliases: (regex, replacement) pairs applied in order to every checkpoint key, mapping other spellings of
        the layout (older library versions, an extra wrapper prefix) onto the canonical one.
    unused: canonical keys a checkpoint may hold that we do not read -> why.
    substitutes: canonical key -> another key holding the same tensor (a tied weight), used when the first
        is absent.
    tied_copies: canonical key -> key it must equal when both are present (else the checkpoint is untied
        and this model, which ties them, cannot represent it).
    """

    name: str
    to_external: tuple[tuple[str, str], ...]
    aliases: tuple[tuple[str, str], ...] = ()
    unused: Mapping[str, str] = field(default_factory=dict)
    substitutes: Mapping[str, str] = field(default_factory=dict)
    tied_copies: Mapping[str, str] = field(default_factory=dict)

    def external_name(self, ours: str) -> str | None:
        for pattern, replacement in self.to_external:
            if re.match(pattern, ours):
                return re.sub(pattern, replacement, ours, count=1)
        return None

    def canonical(self, key: str) -> str:
        for pattern, replacement in self.aliases:
            key = re.sub(pattern, replacement, key, count=1)
        return key


_PALIGEMMA_IN_PI0 = "paligemma_with_expert.paligemma.model."
_EXPERT_IN_PI0 = "paligemma_with_expert.gemma_expert."

# openpi's PyTorch pi0 layout (PI0Pytorch.state_dict()); LeRobot's PI0Policy stores the same under "model.".
PI0_OPENPI_KEYS = KeyMap(
    name="LeRobot/openpi pi0",
    to_external=(
        (r"^prefix_embedder\.vision_tower\.", _PALIGEMMA_IN_PI0 + "vision_tower.vision_model."),
        (r"^prefix_embedder\.multi_modal_projector\.", _PALIGEMMA_IN_PI0 + "multi_modal_projector.linear."),
        (r"^prefix_embedder\.embed_tokens\.", _PALIGEMMA_IN_PI0 + "language_model.embed_tokens."),
        (r"^layers\.(\d+)\.vlm\.", _PALIGEMMA_IN_PI0 + r"language_model.layers.\1."),
        (r"^vlm_norm\.", _PALIGEMMA_IN_PI0 + "language_model.norm."),
        (r"^layers\.(\d+)\.expert\.", _EXPERT_IN_PI0 + r"model.layers.\1."),
        (r"^expert_norm\.", _EXPERT_IN_PI0 + "model.norm."),
        (r"^(state_proj|action_in_proj|action_out_proj|action_time_mlp_in|action_time_mlp_out)\.", r"\1."),
    ),
    aliases=(
        (r"^model\.", ""),  # LeRobot's PI0Policy wraps openpi's module as `model`
        # transformers < 4.52 nested PaliGemma differently.
        (
            r"^paligemma_with_expert\.paligemma\.language_model\.model\.",
            _PALIGEMMA_IN_PI0 + "language_model.",
        ),
        (
            r"^paligemma_with_expert\.paligemma\.language_model\.lm_head\.",
            "paligemma_with_expert.paligemma.lm_head.",
        ),
        (
            r"^paligemma_with_expert\.paligemma\.(vision_tower|multi_modal_projector)\.",
            _PALIGEMMA_IN_PI0 + r"\1.",
        ),
        # transformers >= 5 dropped SiglipVisionModel's inner `vision_model`.
        (r"^(paligemma_with_expert\.paligemma\.model\.vision_tower\.)(?!vision_model\.)", r"\1vision_model."),
        (r"^time_mlp_(in|out)\.", r"action_time_mlp_\1."),  # early openpi name of the action-time MLP
    ),
    unused={
        "paligemma_with_expert.paligemma.lm_head.weight": (
            "PaliGemma's text head (tied to embed_tokens); pi0 writes no text"
        ),
        _EXPERT_IN_PI0
        + "lm_head.weight": "the expert's vocabulary table: pi0 feeds the expert embeddings, never "
        "token ids (all zeros in converted checkpoints)",
        _EXPERT_IN_PI0 + "model.embed_tokens.weight": "the expert's vocabulary table (unused, see lm_head)",
    },
    substitutes={
        _PALIGEMMA_IN_PI0
        + "language_model.embed_tokens.weight": "paligemma_with_expert.paligemma.lm_head.weight"
    },
)
LEROBOT_PREFIX = "model."

_PALIGEMMA_ALIASES = (
    # Hub checkpoints and transformers < 4.52 keep the vision tower, projector and LM at the top level.
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^multi_modal_projector\.", "model.multi_modal_projector."),
    (r"^language_model\.model\.", "model.language_model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    # transformers < 5 had SiglipVisionModel's inner `vision_model`.
    (r"^model\.vision_tower\.vision_model\.", "model.vision_tower."),
)
_PALIGEMMA_PREFIX_RULES = (
    (r"^prefix_embedder\.vision_tower\.", "model.vision_tower."),
    (r"^prefix_embedder\.multi_modal_projector\.", "model.multi_modal_projector.linear."),
    (r"^prefix_embedder\.embed_tokens\.", "model.language_model.embed_tokens."),
)
_PALIGEMMA_SUBSTITUTES = {"model.language_model.embed_tokens.weight": "lm_head.weight"}

# transformers' PaliGemmaForConditionalGeneration (v5 names) as read by pi0: the VLM stream only.
PALIGEMMA_KEYS_FOR_PI0 = KeyMap(
    name="transformers PaliGemma (pi0 VLM stream)",
    to_external=(
        *_PALIGEMMA_PREFIX_RULES,
        (r"^layers\.(\d+)\.vlm\.", r"model.language_model.layers.\1."),
        (r"^vlm_norm\.", "model.language_model.norm."),
    ),
    aliases=_PALIGEMMA_ALIASES,
    unused={"lm_head.weight": "PaliGemma's text head (tied to embed_tokens); pi0 writes no text"},
    substitutes=_PALIGEMMA_SUBSTITUTES,
)
# The same layout as read by the OpenVLA-style policy: everything, with the LM head tied to embed_tokens.
PALIGEMMA_KEYS_FOR_OPENVLA = KeyMap(
    name="transformers PaliGemma (OpenVLA-style)",
    to_external=(
        *_PALIGEMMA_PREFIX_RULES,
        (r"^layers\.(\d+)\.", r"model.language_model.layers.\1."),
        (r"^norm\.", "model.language_model.norm."),
    ),
    aliases=_PALIGEMMA_ALIASES,
    substitutes=_PALIGEMMA_SUBSTITUTES,
    tied_copies={"lm_head.weight": "model.language_model.embed_tokens.weight"},
)


# This repository's own parameter names (a policy's state_dict(), as older `policy.safetensors` exports and
# the OpenVLA-style export hold them: LeRobot has no OpenVLA policy whose names we could use instead).
VLA_KEYS = KeyMap(name="vla (this repository's parameter names)", to_external=((r"^", ""),))

LAYOUTS = ("lerobot_pi0", "paligemma", "vla")
_LAYOUT_SIGNS = (
    ("lerobot_pi0", re.compile(r"^(model\.)?paligemma_with_expert\.")),
    ("vla", re.compile(r"^(prefix_embedder|layers\.\d+\.(vlm|expert)|vlm_norm|expert_norm)\.")),
    ("paligemma", re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|language_model)\.")),
)


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not fit the policy; lists every missing, unexpected and mis-shaped key."""

    def __init__(
        self,
        layout: str,
        source: str,
        missing: list[str],
        unexpected: list[str],
        shape_mismatches: list[str],
        other: list[str],
    ) -> None:
        self.missing = missing
        self.unexpected = unexpected
        self.shape_mismatches = shape_mismatches
        self.other = other
        lines = [f"checkpoint {source} does not fit the policy ({layout} layout):"]
        for title, items in (
            ("missing keys (canonical spelling, see the KeyMap aliases)", missing),
            ("unexpected keys (not part of this layout)", unexpected),
            (
                "shape mismatches (checkpoint vs policy; is the config the checkpoint's size?)",
                shape_mismatches,
            ),
            ("other problems", other),
        ):
            if items:
                lines.append(f"  {len(items)} {title}:")
                lines.extend(f"    {item}" for item in items[:_SHOWN_PER_LIST])
                if len(items) > _SHOWN_PER_LIST:
                    lines.append(f"    ... and {len(items) - _SHOWN_PER_LIST} more")
        super().__init__("\n".join(lines))


@dataclass
class LoadReport:
    """What a load did. loaded / left_initialised: our parameter names; ignored: checkpoint key -> reason."""

    loaded: list[str]
    left_initialised: list[str]
    ignored: dict[str, str]


def _checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in directory {path}")
        return files
    raise FileNotFoundError(
        f"checkpoint not found: {path} (expected a .safetensors file or a directory of them)"
    )


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a .safetensors file, or of every *.safetensors file in a directory (shards)."""
    tensors: dict[str, Tensor] = {}
    for file in _checkpoint_files(path):
        for key, value in load_file(str(file), device="cpu").items():
            if key in tensors:
                raise ValueError(f"key {key!r} appears in more than one shard of {path}")
            tensors[key] = value
    return tensors


def _load(policy: nn.Module, tensors: Mapping[str, Tensor], key_map: KeyMap, source: str) -> LoadReport:
    canonical: dict[str, Tensor] = {}
    spelled_as: dict[str, str] = {}
    other: list[str] = []
    for key, value in tensors.items():
        name = key_map.canonical(key)
        if name in canonical:
            other.append(f"{key!r} and {spelled_as[name]!r} are two spellings of the same tensor {name!r}")
        canonical[name], spelled_as[name] = value, key
    ignored = {spelled_as[k]: key_map.unused[k] for k in canonical if k in key_map.unused}
    for tied, original in key_map.tied_copies.items():
        if tied in canonical:
            if original in canonical and not torch.equal(canonical[tied], canonical[original]):
                other.append(
                    f"{spelled_as[tied]!r} differs from {spelled_as[original]!r}; this policy ties them"
                )
            ignored[spelled_as[tied]] = f"tied copy of {original}"

    ours = {name: tensor for name, tensor in policy.state_dict().items()}
    external_to_ours: dict[str, str] = {}
    left_initialised: list[str] = []
    for name in ours:
        external = key_map.external_name(name)
        if external is None:
            left_initialised.append(name)
        else:
            external_to_ours[external] = name
    for wanted, stand_in in key_map.substitutes.items():
        if wanted in external_to_ours and wanted not in canonical and stand_in in canonical:
            canonical[wanted], spelled_as[wanted] = canonical[stand_in], spelled_as[stand_in]
            ignored.pop(spelled_as[stand_in], None)

    missing = sorted(k for k in external_to_ours if k not in canonical)
    known = set(external_to_ours) | set(key_map.unused) | set(key_map.tied_copies)
    unexpected = sorted(spelled_as[k] for k in canonical if k not in known)
    mismatched = sorted(
        f"{spelled_as[k]}: {tuple(canonical[k].shape)} vs {tuple(ours[name].shape)} ({name})"
        for k, name in external_to_ours.items()
        if k in canonical and canonical[k].shape != ours[name].shape
    )
    if missing or unexpected or mismatched or other:
        raise CheckpointMismatchError(key_map.name, source, missing, unexpected, mismatched, other)

    state = {name: canonical[k].to(ours[name].dtype) for k, name in external_to_ours.items()}
    on_meta = any(t.is_meta for t in ours.values())
    with torch.no_grad():
        result = policy.load_state_dict(state, strict=False, assign=on_meta)
    if result.unexpected_keys:  # cannot happen: names come from policy.state_dict()
        raise RuntimeError(f"internal key-map error, unexpected keys {result.unexpected_keys}")
    return LoadReport(loaded=sorted(state), left_initialised=sorted(left_initialised), ignored=ignored)


def _require_policy(policy: nn.Module, policy_type: type | tuple[type, ...], function: str) -> None:
    if not isinstance(policy, policy_type):
        raise TypeError(f"{function} needs a {policy_type}, got {type(policy).__name__}")


def load_pi0_weights(policy: Pi0Policy, path: str | Path) -> LoadReport:
    """Load a pi0 checkpoint in the LeRobot layout (keys under `model.`) or openpi's PyTorch layout.

    Older spellings (transformers < 4.52 nesting, `time_mlp_*`) are accepted. Keys pi0 never reads
    (tied PaliGemma LM head, the expert's vocabulary table) are reported in LoadReport.ignored. Raises
    CheckpointMismatchError listing missing / unexpected / mis-shaped keys.
    """
    _require_policy(policy, Pi0Policy, "load_pi0_weights")
    return _load(policy, read_safetensors(path), PI0_OPENPI_KEYS, str(path))


def load_paligemma_weights(policy: Pi0Policy | OpenVLAPolicy, path: str | Path) -> LoadReport:
    """Load a transformers PaliGemmaForConditionalGeneration checkpoint (hub, v4 or v5 key names).

    pi0 takes the vision tower, projector, embedding and VLM layers from it; its action expert and action
    projections keep their initial values (LoadReport.left_initialised). The OpenVLA-style policy takes
    everything.
    """
    _require_policy(policy, (Pi0Policy, OpenVLAPolicy), "load_paligemma_weights")
    key_map = PALIGEMMA_KEYS_FOR_PI0 if isinstance(policy, Pi0Policy) else PALIGEMMA_KEYS_FOR_OPENVLA
    return _load(policy, read_safetensors(path), key_map, str(path))


def detect_layout(keys: list[str] | set[str], source: str = "the checkpoint") -> str:
    """Which of LAYOUTS a checkpoint's keys are spelled in (LeRobot/openpi pi0, transformers PaliGemma,
    or this repository's own names); raises ValueError naming a few keys when none fits."""
    for layout, sign in _LAYOUT_SIGNS:
        if any(sign.match(key) for key in keys):
            return layout
    shown = sorted(keys)[:5]
    raise ValueError(
        f"cannot tell the layout of {source} from its keys (e.g. {shown}): it is neither LeRobot/openpi pi0 "
        "(paligemma_with_expert.*), transformers PaliGemma (vision_tower.*, language_model.*) nor a vla export "
        "(prefix_embedder.*, layers.N.*); set model.weights_format to one of "
        f"{list(LAYOUTS)} if you know it"
    )


def _read_with_ties(path: str | Path) -> dict[str, Tensor]:
    """read_safetensors plus the tied names a vla export stored once (its "tied" metadata)."""
    tensors = read_safetensors(path)
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            tied = json.loads((handle.metadata() or {}).get("tied", "{}"))
        for name, kept in tied.items():
            tensors[name] = tensors[kept]
    return tensors


def load_weights(policy: Pi0Policy | OpenVLAPolicy, path: str | Path, layout: str = "auto") -> LoadReport:
    """Load any checkpoint this repository understands into `policy`, strictly (see `_load`).

    layout: "auto" (detected from the keys, see `detect_layout`), "lerobot_pi0" (LeRobot / openpi pi0,
    including our own pi0 exports), "paligemma" (transformers PaliGemma: the prefix of pi0, everything of
    the OpenVLA-style policy) or "vla" (our own parameter names: older exports, OpenVLA-style exports).
    """
    _require_policy(policy, (Pi0Policy, OpenVLAPolicy), "load_weights")
    if layout not in ("auto", *LAYOUTS):
        raise ValueError(f"unknown checkpoint layout {layout!r}; use 'auto' or one of {list(LAYOUTS)}")
    tensors = _read_with_ties(path)
    if layout == "auto":
        layout = detect_layout(set(tensors), str(path))
    if layout == "lerobot_pi0":
        if not isinstance(policy, Pi0Policy):
            raise ValueError(
                f"{path} is a LeRobot/openpi pi0 checkpoint; it cannot initialise the OpenVLA-style policy "
                f"{type(policy).__name__}: use a transformers PaliGemma checkpoint or a model=pi0* preset"
            )
        key_map = PI0_OPENPI_KEYS
    elif layout == "paligemma":
        key_map = PALIGEMMA_KEYS_FOR_PI0 if isinstance(policy, Pi0Policy) else PALIGEMMA_KEYS_FOR_OPENVLA
    else:
        key_map = VLA_KEYS
    return _load(policy, tensors, key_map, str(path))


def _output_file(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        return path
    path.mkdir(parents=True, exist_ok=True)
    return path / "model.safetensors"


def save_safetensors_reproducibly(
    tensors: Mapping[str, Tensor], file: Path, metadata: Mapping[str, str]
) -> Path:
    """`safetensors.torch.save_file`, written atomically and with its header sorted, so that the same
    tensors and metadata always give the same bytes (and sha256)."""

    def write(tmp: Path) -> None:
        save_file(dict(tensors), str(tmp), metadata=dict(metadata))
        sort_header_metadata(tmp)

    return write_file_atomically(file, write)


def sort_header_metadata(path: Path) -> None:
    """Rewrite a safetensors file's header in place with its `__metadata__` entries sorted by key.

    safetensors (0.8 and before) writes the metadata map in a random order per write (its issue #584),
    so two exports of the same weights differ in bytes and in sha256; a process verifying an export
    while another rewrites it (two evaluations of one checkpoint) then sees a digest of the other
    order. Sorted, the bytes are a function of the content. The entries and their compact JSON
    (json.dumps escapes as serde_json does, ensure_ascii=False) are unchanged, so the header keeps
    its length and every tensor its offset.
    """
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        if not header.get("__metadata__"):
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        canonical = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(canonical) > length:  # not seen: the same entries serialise to the same length
            raise ValueError(
                f"{path}: the sorted safetensors header ({len(canonical)} bytes) outgrew {length}"
            )
        f.seek(8)
        f.write(canonical.ljust(length, b" "))


def _external_state(policy: nn.Module, key_map: KeyMap, prefix: str = "") -> dict[str, Tensor]:
    out = {}
    for name, tensor in policy.state_dict().items():
        external = key_map.external_name(name)
        if external is not None:
            out[prefix + external] = tensor.detach().cpu().contiguous()
    return out


def pi0_lerobot_tensors(
    state: Mapping[str, Tensor],
    config: Pi0Config,
    *,
    lerobot_prefix: bool = True,
    write_unused_keys: bool = True,
) -> dict[str, Tensor]:
    """A pi0 state dict (our names, e.g. a gathered full state dict) renamed to the LeRobot pi0 layout.

    write_unused_keys adds the tensors LeRobot's PI0Policy holds but never uses (the tied PaliGemma LM
    head and a zero expert vocabulary table, vocab_size x expert width), so its strict load accepts it.
    Raises KeyError naming a parameter the layout needs that `state` lacks.
    """
    prefix = LEROBOT_PREFIX if lerobot_prefix else ""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        external = PI0_OPENPI_KEYS.external_name(name)
        if external is not None:
            out[prefix + external] = tensor.detach().cpu().contiguous()
    embed_key = "prefix_embedder.embed_tokens.weight"
    if embed_key not in state:
        raise KeyError(f"the pi0 state dict has no {embed_key!r}; pass the policy's full state_dict()")
    if write_unused_keys:
        embed = state[embed_key].detach().cpu()
        out[prefix + "paligemma_with_expert.paligemma.lm_head.weight"] = embed.clone()
        out[prefix + _EXPERT_IN_PI0 + "lm_head.weight"] = torch.zeros(
            config.vocab_size, config.expert.width, dtype=embed.dtype
        )
    return out


def lerobot_pi0_key_set(config: Pi0Config, *, lerobot_prefix: bool = True) -> set[str]:
    """Every key LeRobot's PI0Policy state dict holds for a policy of this config (its strict load needs
    exactly these): our parameters renamed, plus the tied LM head and the expert's vocabulary table."""
    with torch.device("meta"):
        names = list(Pi0Policy(config).state_dict())
    prefix = LEROBOT_PREFIX if lerobot_prefix else ""
    keys = {prefix + external for name in names if (external := PI0_OPENPI_KEYS.external_name(name))}
    return keys | {
        prefix + "paligemma_with_expert.paligemma.lm_head.weight",
        prefix + _EXPERT_IN_PI0 + "lm_head.weight",
    }


def save_pi0_weights(
    policy: Pi0Policy,
    path: str | Path,
    *,
    lerobot_prefix: bool = True,
    write_unused_keys: bool = True,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write `policy` in the LeRobot pi0 layout (openpi's when lerobot_prefix=False); returns the file.

    write_unused_keys adds the tensors LeRobot's PI0Policy holds but never uses (the tied PaliGemma LM head
    and a zero expert vocabulary table, vocab_size x expert width), so its strict load accepts the file.
    `path`: a .safetensors file, or a directory that gets model.safetensors. metadata: extra header entries.
    """
    _require_policy(policy, Pi0Policy, "save_pi0_weights")
    tensors = pi0_lerobot_tensors(
        policy.state_dict(), policy.config, lerobot_prefix=lerobot_prefix, write_unused_keys=write_unused_keys
    )
    return save_safetensors_reproducibly(tensors, _output_file(path), {"format": "pt", **(metadata or {})})


def save_paligemma_weights(policy: Pi0Policy | OpenVLAPolicy, path: str | Path) -> Path:
    """Write the PaliGemma part of `policy` with transformers v5 PaliGemmaForConditionalGeneration names.

    The LM head is tied to embed_tokens, so no lm_head.weight is written (transformers re-ties it).
    """
    _require_policy(policy, (Pi0Policy, OpenVLAPolicy), "save_paligemma_weights")
    key_map = PALIGEMMA_KEYS_FOR_PI0 if isinstance(policy, Pi0Policy) else PALIGEMMA_KEYS_FOR_OPENVLA
    return save_safetensors_reproducibly(
        _external_state(policy, key_map), _output_file(path), {"format": "pt"}
    )
