"""`dmuon.Muon`: Muon for hidden matrices and AdamW for the rest, as one drop-in torch optimizer.

Nothing about the parameters is cached at construction: Accelerate and FSDP2 replace the parameter
objects inside `param_groups` after the optimizer is built, so every step reads the live params,
their layout and their gradients afresh. State is created lazily in `step()` and keyed by the live
parameter (as torch's optimizers do), which is what `state_dict()`, DCP's
`get_optimizer_state_dict` and LR schedulers expect.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from dmuon import functional as F
from dmuon.functional import NSConfig
from dmuon.newton_schulz import ALGORITHMS, COEFFICIENT_SCHEDULES, DEFAULT_EPS, coefficient_schedule

OPTIMIZER_ALGORITHMS = ("muon", "adamw")
# Keys a param group may carry besides the optimizer's hyper-parameters.
_EXTRA_GROUP_KEYS = {"params", "param_names", "algorithm", "name", "initial_lr"}
_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class MuonWork:
    """One Muon matrix in one step.

    param:  the live parameter (a plain tensor, or a DTensor under FSDP2).
    update: the tensor to orthogonalise, as this rank holds it: the whole tensor for a plain
            parameter, the local rows of the shard under FSDP2. Shape: the local param shape.
    shape:  the global parameter shape; NS runs on the (shape[0], prod(shape[1:])) view.
    """

    name: str
    param: Tensor
    update: Tensor
    shape: tuple[int, ...]
    ns: NSConfig


def _as_dtype(value: Any, key: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.removeprefix("torch.") in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[value.removeprefix("torch.")]
    else:
        raise ValueError(
            f"{key} must be a floating torch.dtype or one of {sorted(_DTYPE_NAMES)}, got {value!r}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"{key} must be a floating dtype, got {dtype}")
    return dtype


def _check_number(
    group: dict, key: str, low: float, high: float = math.inf, *, high_open: bool = False
) -> None:
    value = group[key]
    if isinstance(value, Tensor):
        raise ValueError(f"{key} must be a Python float here, got a Tensor; pass float({key})")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    if value < low or value > high or (high_open and value >= high):
        bracket = ")" if high_open else "]"
        raise ValueError(f"{key} must be in [{low}, {high}{bracket}, got {value}")


class Muon(Optimizer):
    """Muon with an AdamW side, for single-process and (later) distributed training.

    Param groups pick their algorithm with `algorithm="muon"` (default) or `"adamw"`. Muon groups
    take params with ndim >= 2 (ndim > 2 is orthogonalised as (shape[0], -1)); use
    `dmuon.param_groups(model)` to route embeddings, heads, norms and biases to AdamW.

    Args:
        params: params or param groups (dicts; per-group values override the defaults below).
        lr: Muon learning rate.
        momentum: Muon momentum mu in [0, 1).
        nesterov: use g + mu * buf instead of buf.
        weight_decay: decoupled weight decay of Muon groups (W *= 1 - lr * wd).
        adjust_lr: lr scale per matrix shape: "original" sqrt(max(1, m/n)), "match_rms_adamw"
            0.2 sqrt(max(m, n)), "spectral" sqrt(m/n), or None.
        ns_algorithm: "standard", "gram" or "auto" (Gram where the FLOP model says it is cheaper).
        ns_coefficients: "jordan", "polar_express", "you", or explicit (a, b, c) rows.
        ns_steps: Newton-Schulz steps.
        ns_dtype: dtype NS runs in (fp32 default; bf16 only pays off on GPUs).
        ns_eps: eps of the Frobenius normalisation.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: defaults of AdamW groups (an AdamW
            group's own "lr" / "weight_decay" / "betas" / "eps" override them).
        adamw_foreach, adamw_fused: torch's AdamW implementation switches. None: fused where the
            params support it, foreach otherwise.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        adjust_lr: str | None = "original",
        ns_algorithm: str = "auto",
        ns_coefficients: str | list[tuple[float, float, float]] = "jordan",
        ns_steps: int = 5,
        ns_dtype: torch.dtype | str = torch.float32,
        ns_eps: float = DEFAULT_EPS,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        adamw_foreach: bool | None = None,
        adamw_fused: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "adjust_lr": adjust_lr,
            "ns_algorithm": ns_algorithm,
            "ns_coefficients": ns_coefficients,
            "ns_steps": ns_steps,
            "ns_dtype": ns_dtype,
            "ns_eps": ns_eps,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "foreach": adamw_foreach,
            "fused": adamw_fused,
        }
        # AdamW groups take these instead of the Muon lr / weight decay unless they set their own.
        self._adamw_defaults = {"lr": adamw_lr, "weight_decay": adamw_weight_decay}
        _validate_hyperparameters({**defaults, "algorithm": "muon"}, where="Muon()")
        _validate_hyperparameters({**defaults, **self._adamw_defaults, "algorithm": "adamw"}, where="Muon()")
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        known = set(self.defaults) | _EXTRA_GROUP_KEYS
        for key in group:
            if key not in known:
                hint = difflib.get_close_matches(key, sorted(known), n=1)
                fix = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ValueError(f"unknown param group key {key!r}{fix}; known keys: {sorted(known)}")
        algorithm = group.setdefault("algorithm", "muon")
        if algorithm == "adamw":
            for key, value in self._adamw_defaults.items():
                group.setdefault(key, value)
        super().add_param_group(group)
        group = self.param_groups[-1]
        group["ns_dtype"] = _as_dtype(group["ns_dtype"], "ns_dtype")
        group["betas"] = tuple(group["betas"])
        where = f"param group {len(self.param_groups) - 1}"
        _validate_hyperparameters(group, where=where)
        for index, p in enumerate(group["params"]):
            _validate_param(p, group, index, where)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step.

        Phase 1  momentum: buf <- mu buf + g on each rank's own rows (elementwise).
        Phase 2  orthogonalise: every Muon matrix is Newton-Schulz'ed once, as a whole matrix, with
                 same-shape matrices batched.
        Phase 3  apply: W <- W (1 - lr wd) - lr scale O on each rank's own rows.
        Phase 4  AdamW groups: torch's fused/foreach AdamW on each rank's own rows.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Phase 1: momentum, per Muon group (hyper-parameters are per group).
        work: list[MuonWork] = []
        group_slices: list[tuple[dict, int, int]] = []
        for group_index, group in enumerate(self.param_groups):
            if group["algorithm"] != "muon":
                continue
            start = len(work)
            work.extend(self._momentum_phase(group, group_index))
            group_slices.append((group, start, len(work)))

        # Phase 2: orthogonalise whole matrices.
        orthogonal = self._orthogonalize(work)

        # Phase 3: apply the updates, per group.
        for group, start, stop in group_slices:
            items = work[start:stop]
            F.apply_muon_update_(
                [_local(w.param) for w in items],
                orthogonal[start:stop],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                scales=[F.update_scale(w.shape, group["adjust_lr"]) for w in items],
            )

        # Phase 4: AdamW groups.
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_phase(group)
        return loss

    def _momentum_phase(self, group: dict, group_index: int) -> list[MuonWork]:
        names = group.get("param_names")
        ns = NSConfig.from_group(group)
        params, grads, bufs = [], [], []
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            _check_grad(p, group, index)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append((index, p))
            grads.append(_local(p.grad))
            bufs.append(_local(state["momentum_buffer"]))
        updates = F.muon_momentum_(bufs, grads, momentum=group["momentum"], nesterov=group["nesterov"])
        return [
            MuonWork(
                name=names[index] if names else f"group{group_index}.param{index}",
                param=p,
                update=u,
                shape=tuple(p.shape),
                ns=ns,
            )
            for (index, p), u in zip(params, updates, strict=True)
        ]

    def _orthogonalize(self, work: list[MuonWork]) -> list[Tensor]:
        """Orthogonalised updates of `work`, each in its item's local shape."""
        results: list[Tensor | None] = [None] * len(work)
        by_config: dict[NSConfig, list[int]] = {}
        for i, item in enumerate(work):
            by_config.setdefault(item.ns, []).append(i)
        for ns, indices in by_config.items():
            mats = [work[i].update.reshape(F.matrix_shape(work[i].shape)) for i in indices]
            for i, o in zip(indices, F.orthogonalize(mats, ns), strict=True):
                results[i] = o.view(work[i].update.shape)
        return results  # type: ignore[return-value]

    def _adamw_phase(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        fused = group["fused"]
        if fused is None and group["foreach"] is None:
            fused = all(_fused_supported(p) for p in group["params"])
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            _check_grad(p, group, index)
            state = self.state[p]
            if not state:
                # Same layout as torch.optim.AdamW's state, so state dicts interchange.
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(_local(p))
            grads.append(_local(p.grad))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        F.adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            steps,
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            foreach=group["foreach"] if not fused else False,
            fused=fused,
        )


def _local(t: Tensor) -> Tensor:
    """The tensor this rank computes on: the local shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _fused_supported(p: Tensor) -> bool:
    return p.device.type in ("cpu", "cuda") and p.dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
    )


def _param_label(group: dict, index: int) -> str:
    names = group.get("param_names")
    return repr(names[index]) if names else f"#{index}"


def _validate_param(p: Tensor, group: dict, index: int, where: str) -> None:
    label = _param_label(group, index)
    if not isinstance(p, Tensor):
        raise TypeError(f"{where}: param {label} is a {type(p).__name__}, not a Tensor")
    if p.is_complex():
        raise ValueError(f"{where}: param {label} is complex; dmuon supports real tensors only")
    if group["algorithm"] == "muon" and p.ndim < 2:
        raise ValueError(
            f"{where}: param {label} has shape {tuple(p.shape)} (ndim {p.ndim}); Muon orthogonalises "
            "matrices (ndim >= 2). Put biases, norms and scalars in a group with algorithm='adamw', "
            "or build the groups with dmuon.param_groups(model)"
        )


def _check_grad(p: Tensor, group: dict, index: int) -> None:
    if p.grad.is_sparse:
        raise ValueError(
            f"param {_param_label(group, index)} has a sparse gradient; dmuon needs dense gradients"
        )


def _validate_hyperparameters(group: dict, where: str) -> None:
    algorithm = group.get("algorithm")
    if algorithm not in OPTIMIZER_ALGORITHMS:
        raise ValueError(f"{where}: algorithm must be one of {OPTIMIZER_ALGORITHMS}, got {algorithm!r}")
    _check_number(group, "lr", 0.0)
    _check_number(group, "weight_decay", 0.0)
    if algorithm == "adamw":
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"{where}: betas must be two floats (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            _check_number({f"betas[{i}]": beta}, f"betas[{i}]", 0.0, 1.0, high_open=True)
        _check_number(group, "eps", 0.0)
        if group["eps"] <= 0:
            raise ValueError(f"{where}: eps must be > 0, got {group['eps']}")
        for key in ("foreach", "fused"):
            if group[key] not in (None, True, False):
                raise ValueError(f"{where}: {key} must be None, True or False, got {group[key]!r}")
        if group["foreach"] and group["fused"]:
            raise ValueError(f"{where}: foreach and fused are exclusive; set at most one of them")
        return
    _check_number(group, "momentum", 0.0, 1.0, high_open=True)
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"{where}: nesterov must be a bool, got {group['nesterov']!r}")
    if group["adjust_lr"] not in F.ADJUST_LR_CHOICES:
        raise ValueError(
            f"{where}: adjust_lr must be one of {F.ADJUST_LR_CHOICES}, got {group['adjust_lr']!r}"
        )
    if group["ns_algorithm"] not in ALGORITHMS:
        raise ValueError(f"{where}: ns_algorithm must be one of {ALGORITHMS}, got {group['ns_algorithm']!r}")
    steps = group["ns_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 100:
        raise ValueError(f"{where}: ns_steps must be an int in [1, 100], got {steps!r}")
    coefficients = group["ns_coefficients"]
    if isinstance(coefficients, str) and coefficients not in COEFFICIENT_SCHEDULES:
        raise ValueError(
            f"{where}: ns_coefficients must be one of {COEFFICIENT_SCHEDULES} or (a, b, c) rows, "
            f"got {coefficients!r}"
        )
    coefficient_schedule(coefficients, steps)  # raises on malformed rows
    _as_dtype(group["ns_dtype"], "ns_dtype")
    _check_number(group, "ns_eps", 0.0)
    if group["ns_eps"] <= 0:
        raise ValueError(f"{where}: ns_eps must be > 0, got {group['ns_eps']}")
