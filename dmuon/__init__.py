"""dmuon: distributed Muon at near-AdamW cost, as a drop-in torch optimizer.

Depends on torch alone (scipy and triton are optional and imported lazily where used).

    opt = dmuon.Muon(dmuon.param_groups(model), lr=0.02, adamw_lr=3e-4)
"""

from dmuon.functional import NSConfig, update_scale
from dmuon.newton_schulz import (
    COEFFICIENT_SCHEDULES,
    choose_algorithm,
    coefficient_schedule,
    newton_schulz,
    ns_flops,
)
from dmuon.optimizer import Muon
from dmuon.routing import describe_param_groups, param_groups

__all__ = [
    "COEFFICIENT_SCHEDULES",
    "Muon",
    "NSConfig",
    "choose_algorithm",
    "coefficient_schedule",
    "describe_param_groups",
    "newton_schulz",
    "ns_flops",
    "param_groups",
    "update_scale",
]
__version__ = "0.1.0"
