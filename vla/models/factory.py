"""`build_policy`: preset name, config object or dict -> policy module."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from vla.models.config import OpenVLAConfig, Pi0Config, PolicyConfig, config_from_dict, get_preset
from vla.models.openvla import OpenVLAPolicy
from vla.models.pi0 import Pi0Policy

POLICY_TYPES: dict[type[PolicyConfig], type[nn.Module]] = {Pi0Config: Pi0Policy, OpenVLAConfig: OpenVLAPolicy}


def resolve_config(name_or_config: str | PolicyConfig | Mapping[str, Any], **overrides: Any) -> PolicyConfig:
    """The config `build_policy` would use: a preset name, a config, or a dict (see `config_from_dict`),
    with `overrides` applied on top (nested specs take partial dicts, e.g. vlm={"depth": 4})."""
    if isinstance(name_or_config, str):
        config = get_preset(name_or_config)
    elif isinstance(name_or_config, PolicyConfig):
        config = name_or_config
    elif isinstance(name_or_config, Mapping):
        config = config_from_dict(dict(name_or_config))
    else:
        raise TypeError(
            f"build_policy takes a preset name, a PolicyConfig or a dict, got {type(name_or_config).__name__}"
        )
    return config.replace(**overrides) if overrides else config


def build_policy(name_or_config: str | PolicyConfig | Mapping[str, Any], **overrides: Any) -> nn.Module:
    """Build a policy with freshly initialised weights, on the current default device.

    `with torch.device("meta"): build_policy("pi0")` builds the full model without allocating memory.
    Unknown preset names and unknown override keys raise ValueError listing the valid ones.
    """
    config = resolve_config(name_or_config, **overrides)
    return POLICY_TYPES[type(config)](config)
