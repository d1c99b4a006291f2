"""Roles of the policies' parameters, read from their names (for optimizer routing and reports).

Muon orthogonalises hidden weight matrices; embeddings, the input/output projections, norms and biases
belong with AdamW. The names are fixed by the modules (see the package docstring), so the role of every
parameter follows from its name and shape.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

ParameterRole = Literal["hidden_matrix", "input_output", "norm", "bias"]

# Parameters that map tokens/pixels/state into the residual stream or out of it.
INPUT_OUTPUT_NAMES: tuple[str, ...] = (
    "embed_tokens",
    "lm_head",
    "patch_embedding",
    "position_embedding",
    "multi_modal_projector",
    "state_proj",
    "action_in_proj",
    "action_out_proj",
    "action_time_mlp_in",
    "action_time_mlp_out",
)


def parameter_role(name: str, parameter: nn.Parameter) -> ParameterRole:
    """Role of one named parameter: hidden_matrix (Muon), or input_output / norm / bias (AdamW)."""
    parts = name.split(".")
    if any(part in INPUT_OUTPUT_NAMES for part in parts):
        return "input_output"
    if any("norm" in part for part in parts):
        return "norm"
    if parts[-1] == "bias" or parameter.ndim < 2:
        return "bias"
    if parameter.ndim == 2:
        return "hidden_matrix"
    raise ValueError(f"parameter {name!r} with shape {tuple(parameter.shape)} has no known role")


def parameters_by_role(module: nn.Module, *, trainable_only: bool = True) -> dict[ParameterRole, list[str]]:
    """Parameter names grouped by role (frozen ones left out when trainable_only)."""
    groups: dict[ParameterRole, list[str]] = {"hidden_matrix": [], "input_output": [], "norm": [], "bias": []}
    for name, parameter in module.named_parameters():
        if trainable_only and not parameter.requires_grad:
            continue
        groups[parameter_role(name, parameter)].append(name)
    return groups
