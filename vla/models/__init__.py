"""Policies (nn.Modules and their configs only): pi0 and an OpenVLA-style policy on PaliGemma.

Entry points: `build_policy(name_or_config, **overrides)`, the `Policy` contract, configs and `PRESETS`;
checkpoint I/O lives in `vla.models.weights`.

Parameter names, for optimizer routing (Muon for hidden matrices, AdamW for the rest):
  inputs / outputs (AdamW): `embed_tokens` (also the OpenVLA LM head, tied), `patch_embedding`,
    `position_embedding`, `multi_modal_projector`, `state_proj`, `action_in_proj`, `action_time_mlp_in`,
    `action_time_mlp_out`, `action_out_proj`;
  norms and biases (AdamW): any name containing `norm` (`layernorm`, `layer_norm1/2`, `post_layernorm`,
    `vlm_norm`, `expert_norm`, OpenVLA's final `norm`) and every `.bias`;
  hidden matrices (Muon): the 2-D `.weight`s of `q_proj`, `k_proj`, `v_proj`, `o_proj` / `out_proj`,
    `gate_proj`, `up_proj`, `down_proj`, `fc1`, `fc2` inside `layers.*` (Gemma) and `encoder.layers.*`
    (SigLIP).
`vla.models.naming.parameter_role(name, param)` encodes exactly this rule.
"""

from vla.models.config import (
    PRESETS,
    GemmaSpec,
    OpenVLAConfig,
    Pi0Config,
    PolicyConfig,
    SiglipSpec,
    config_from_dict,
    get_preset,
)
from vla.models.contract import Policy
from vla.models.factory import build_policy, resolve_config
from vla.models.openvla import OpenVLAPolicy
from vla.models.pi0 import Pi0Policy

__all__ = [
    "PRESETS",
    "GemmaSpec",
    "OpenVLAConfig",
    "OpenVLAPolicy",
    "Pi0Config",
    "Pi0Policy",
    "Policy",
    "PolicyConfig",
    "SiglipSpec",
    "build_policy",
    "config_from_dict",
    "get_preset",
    "resolve_config",
]
