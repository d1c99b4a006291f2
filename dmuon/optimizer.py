"""`dmuon.Muon`: Muon for hidden matrices and AdamW for the rest, as one drop-in torch optimizer.

Nothing about the parameters is cached at construction: Accelerate and FSDP2 replace the parameter
objects inside `param_groups` after the optimizer is built, so every step reads the live params,
their layout and their gradients afresh. State is created lazily in `step()` and keyed by the live
parameter (as torch's optimizers do), which is what `state_dict()`, DCP's
`get_optimizer_state_dict` and LR schedulers expect.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from dmuon import functional as F
from dmuon.comm import (
    local_orthogonalize,
    naive_orthogonalize,
    replicated_orthogonalize,
    sharded_orthogonalize,
)
from dmuon.exchange import EXCHANGES, WIRE_SCOPES
from dmuon.functional import NSConfig
from dmuon.layout import Domain, detect_domain, local_tensor
from dmuon.newton_schulz import ALGORITHMS, COEFFICIENT_SCHEDULES, DEFAULT_EPS, coefficient_schedule
from dmuon.planner import SPLIT_MODES, STRATEGIES, CostModel, MatrixSpec, Plan, build_plan

OPTIMIZER_ALGORITHMS = ("muon", "adamw")
DISTRIBUTIONS = ("owner", "naive")
COST_MODELS = ("flops", "calibrated")
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
    group: dict,
    key: str,
    low: float,
    high: float = math.inf,
    *,
    high_open: bool = False,
    where: str = "",
    hint: str = "",
) -> None:
    value = group[key]
    prefix = f"{where}: " if where else ""
    if isinstance(value, Tensor):
        raise ValueError(f"{prefix}{key} must be a Python float here, got a Tensor; pass float({key}){hint}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{prefix}{key} must be a finite number, got {value!r}{hint}")
    if value < low or value > high or (high_open and value >= high):
        bracket = ")" if high_open else "]"
        raise ValueError(f"{prefix}{key} must be in [{low}, {high}{bracket}, got {value}{hint}")


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

    Distribution (found from the live params at every step; see dmuon.layout):
        process_group: group over which plain (DDP-replicated) tensors are shared; default WORLD.
        device_mesh: if given, every DTensor param must live on this mesh (a pin against
            accidentally mixing meshes); by default each DTensor's own mesh is used.
        plain_tensors: "replicated" (default; plain tensors are identical on every rank, as under
            DDP) or "local" (each rank orthogonalises its own plain tensors; no communication).
        distribution: "owner" (each matrix orthogonalised once, by its owner rank) or "naive" (the
            vanilla baseline: every rank gathers and orthogonalises every matrix, one at a time).
        planner: "lpt" (greedy) or "milp" (HiGHS, time-limited, never worse than LPT).
        cost_model: "flops", "calibrated" (NS timings measured once per shape and batch size on
            this device, cached under ~/.cache/dmuon or $DMUON_CACHE) or a CostModel.
        bucket_mb: bytes of whole matrices per pipeline bucket, or "auto": also try 2-8 equal
            buckets and keep the bucketing with the fastest predicted step.
        overlap: pipeline buckets (exchange of k+1 and return of k travel while k computes).
        milp_time_limit: seconds HiGHS may spend on one plan.
        split: "auto" (the planner splits a matrix over a group of k ranks, each orthogonalising a
            column chunk with exact collectives (dmuon.split_ns), only where that matrix alone would
            outlast the ideal per-rank load: big matrices at large W), "off" (one owner per matrix),
            or "always" (every matrix split over a whole replica; for tests and benchmarks).
        hsdp_replicas: "auto" (HSDP: per matrix, by the predicted step on the cost model's network
            (dmuon.step_model): either every rank of every replica shares its work and the results
            are fanned out over the replicate dimension, or every replica computes it on its own
            shard group; never predicted slower than either extreme), "share" (all shared) or
            "repeat" (each replica repeats its shard group's work, planned per shard group).
        ranks_per_node: ranks per node (global rank // ranks_per_node is the node); None reads
            $LOCAL_WORLD_SIZE (torchrun sets it), absent means one node.
        exchange: "auto" (two-level all-to-alls, dmuon.exchange, where a shard group spans several
            nodes: (nodes - 1) + (ranks per node - 1) messages per rank instead of W - 1), "flat"
            (one all_to_all_single) or "two_level" (an error where the group is not a node grid).
            Either is exact; they move the same bytes.
        wire_dtype: None (default, exact) or a dtype such as torch.bfloat16 that results of sharded
            params (FSDP2 / HSDP) travel in (the return to the shard ranks and the HSDP fan-out): half their bytes, not exact (each
            update rounds once: 1.7e-3 relative in bf16); replicas stay identical.
        wire_scope: "results" (default) or "all" (the momenta travel in wire_dtype too: half the
            exchange's bytes as well, but Newton-Schulz amplifies that rounding: 3e-2 relative per
            update on low-rank momenta, scripts/bench_wire.py).
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
        *,
        process_group: dist.ProcessGroup | None = None,
        device_mesh: Any = None,
        plain_tensors: str = "replicated",
        distribution: str = "owner",
        planner: str = "lpt",
        cost_model: str | CostModel = "flops",
        bucket_mb: float | str = 64.0,
        overlap: bool = True,
        milp_time_limit: float = 5.0,
        split: str = "auto",
        hsdp_replicas: str = "auto",
        ranks_per_node: int | None = None,
        exchange: str = "auto",
        wire_dtype: torch.dtype | str | None = None,
        wire_scope: str = "results",
    ) -> None:
        _validate_distribution_options(
            plain_tensors, distribution, planner, cost_model, bucket_mb, milp_time_limit, split, hsdp_replicas
        )
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if ranks_per_node is None and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
            ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}")
        self._ranks_per_node = ranks_per_node
        self._exchange = exchange
        self._wire_dtype = None if wire_dtype is None else _as_dtype(wire_dtype, "wire_dtype")
        if wire_scope not in WIRE_SCOPES:
            raise ValueError(f"wire_scope must be one of {WIRE_SCOPES}, got {wire_scope!r}")
        self._wire_scope = wire_scope
        self._split = split
        self._share_replicas = hsdp_replicas != "repeat"
        self._sharing = "auto" if hsdp_replicas == "auto" else "all"
        self._tune_buckets = bucket_mb == "auto"
        if self._tune_buckets:
            bucket_mb = 64.0
        self._process_group = process_group
        self._device_mesh = device_mesh
        self._plain_tensors = plain_tensors
        self._distribution = distribution
        self._planner = planner
        self._cost_model_option = cost_model
        self._bucket_bytes = int(bucket_mb * 2**20)
        self._overlap = bool(overlap)
        self._milp_time_limit = milp_time_limit
        # Plans are keyed by value (domain ranks + matrix specs), never by param objects.
        self._plans: dict[tuple, Plan] = {}
        self._cost_models: dict[tuple, CostModel] = {}
        self._last_plans: list[tuple[Domain, Plan]] = []
        # Wall seconds of the last step's phases (CPU clock: on CUDA, launch time unless synced).
        self.last_step_stats: dict[str, float] = {}
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

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, after checking that the saved state fits these param groups.

        torch maps saved state to params by position only, so state saved with another param order,
        model or routing would load silently and fail (or corrupt) later. Checked first, each error
        naming the group and the param: group count and sizes, each group's algorithm, the shape of
        every saved state tensor against its param, and the saved hyper-parameters (finite, in
        range). Same-shape params under different names (a reorder or a rename) give a warning.
        """
        _check_state_fits(self.param_groups, state_dict)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["ns_dtype"] = _as_dtype(group["ns_dtype"], "ns_dtype")
            group["betas"] = tuple(group["betas"])

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step.

        Phase 1  momentum: buf <- mu buf + g on each rank's own rows (elementwise).
        Phase 2  orthogonalise: every Muon matrix is Newton-Schulz'ed once, by its owner rank as a
                 whole matrix or exactly by a split group of ranks (dmuon.split_ns), with
                 same-shape matrices batched.
        Phase 3  apply: W <- W (1 - lr wd) - lr scale O on each rank's own rows.
        Phase 4  AdamW groups: torch's fused/foreach AdamW on each rank's own rows.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group_index, group in enumerate(self.param_groups):
            _check_live_hyperparameters(group, group_index)
        stats: dict[str, float] = {"comm_wait_s": 0.0}
        clock = time.perf_counter()

        # Phase 1: momentum, per Muon group (hyper-parameters are per group).
        work: list[MuonWork] = []
        group_slices: list[tuple[dict, int, int]] = []
        for group_index, group in enumerate(self.param_groups):
            if group["algorithm"] != "muon":
                continue
            start = len(work)
            work.extend(self._momentum_phase(group, group_index))
            group_slices.append((group, start, len(work)))

        clock = _lap(stats, "momentum_s", clock)

        # Phase 2: orthogonalise whole matrices.
        orthogonal = self._orthogonalize(work, stats)
        clock = _lap(stats, "orthogonalize_s", clock)

        # Phase 3: apply the updates, per group.
        for group, start, stop in group_slices:
            items = work[start:stop]
            F.apply_muon_update_(
                [local_tensor(w.param) for w in items],
                orthogonal[start:stop],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                scales=[F.update_scale(w.shape, group["adjust_lr"]) for w in items],
            )

        clock = _lap(stats, "apply_s", clock)

        # Phase 4: AdamW groups.
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_phase(group)
        _lap(stats, "adamw_s", clock)
        self.last_step_stats = stats
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
            grads.append(local_tensor(p.grad))
            bufs.append(local_tensor(state["momentum_buffer"]))
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

    def _orthogonalize(self, work: list[MuonWork], stats: dict[str, float] | None = None) -> list[Tensor]:
        """Orthogonalised updates of `work`, each in its item's local shape.

        Items are split by domain (who holds which rows); each domain runs its own plan. Domains
        are visited in work order, which is the same on every rank.
        """
        domains: dict[tuple, tuple[Domain, list[int], list[MatrixSpec]]] = {}
        for i, item in enumerate(work):
            mesh = getattr(item.param, "device_mesh", None)
            if self._device_mesh is not None and mesh is not None and mesh != self._device_mesh:
                raise ValueError(
                    f"param {item.name!r} lives on {mesh}, but this optimizer was pinned to "
                    f"device_mesh={self._device_mesh}; shard it on that mesh or drop the pin"
                )
            domain, rows = detect_domain(
                item.param,
                item.name,
                process_group=self._process_group,
                plain_tensors=self._plain_tensors,
                replicate_across=self._share_replicas and self._distribution == "owner",
            )
            m, n = F.matrix_shape(item.shape)
            entry = domains.setdefault(domain.key(), (domain, [], []))
            entry[1].append(i)
            entry[2].append(MatrixSpec(item.name, m, n, item.ns, rows))
        results: list[Tensor | None] = [None] * len(work)
        self._last_plans = []
        for domain, indices, specs in domains.values():
            updates = [work[i].update for i in indices]
            if self._distribution == "naive":
                outs = naive_orthogonalize(specs, domain, [work[i].param for i in indices], updates, stats)
            elif domain.kind == "local":
                outs = local_orthogonalize(specs, updates)
            else:
                plan = self._plan_for(domain, specs)
                self._last_plans.append((domain, plan))
                if domain.kind == "sharded":
                    outs = sharded_orthogonalize(
                        plan,
                        domain,
                        updates,
                        overlap=self._overlap,
                        stats=stats,
                        ranks_per_node=self._ranks_per_node,
                        exchange=self._exchange,
                        wire_dtype=self._wire_dtype,
                        wire_scope=self._wire_scope,
                    )
                else:
                    outs = replicated_orthogonalize(plan, domain, updates, overlap=self._overlap, stats=stats)
            for i, o in zip(indices, outs, strict=True):
                results[i] = o
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ planning
    def _plan_for(self, domain: Domain, specs: list[MatrixSpec]) -> Plan:
        key = (domain.key(), tuple((s.name, s.m, s.n, s.rows, s.ns) for s in specs))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        cost = self._cost_model_for(domain, specs)
        if self._planner == "milp":
            # A time-limited solver need not stop at the same point on every rank: solve once, share.
            box: list[Plan | None] = [None]
            if domain.rank == 0:
                box[0] = self._build_plan(domain, specs, cost)
            dist.broadcast_object_list(box, src=domain.ranks[0], group=domain.collective_group())
            plan = box[0]
            assert plan is not None
        else:
            plan = self._build_plan(domain, specs, cost)
        _check_plans_agree(domain, plan)
        self._plans[key] = plan
        return plan

    def _build_plan(self, domain: Domain, specs: list[MatrixSpec], cost: CostModel) -> Plan:
        if not cost.ranks_per_node and self._ranks_per_node:
            cost = dataclasses.replace(cost, ranks_per_node=self._ranks_per_node)
        return build_plan(
            specs,
            domain.world,
            strategy=self._planner,
            cost=cost,
            bucket_bytes=self._bucket_bytes,
            milp_time_limit=self._milp_time_limit,
            split=self._split,
            ranks_per_replica=domain.replica_size,
            sharing=self._sharing,
            tune_buckets=self._tune_buckets,
            exchange=self._exchange,
            result_bytes=self._wire_dtype.itemsize if self._wire_dtype is not None else 4,
        )

    def _cost_model_for(self, domain: Domain, specs: list[MatrixSpec]) -> CostModel:
        option = self._cost_model_option
        if isinstance(option, CostModel):
            return option
        if option == "flops":
            return CostModel()
        key = domain.key()
        if key in self._cost_models:
            model = self._cost_models[key]
        else:
            model = CostModel()
        counts: dict[tuple, int] = {}
        for spec in specs:
            counts[spec.shape_class] = counts.get(spec.shape_class, 0) + 1
        # Measure on one rank and share, so every rank plans with the same numbers.
        box: list[CostModel | None] = [None]
        if domain.rank == 0:
            device = local_tensor(self.param_groups[0]["params"][0]).device
            path = CostModel.default_cache_path(device)
            if not model.profile and path.exists():
                model = CostModel.load(path)
            model.calibrate(list(counts), max_batch=counts, device=device)
            model.save(path)
            box[0] = model
        if domain.group is not None and domain.world > 1:
            dist.broadcast_object_list(box, src=domain.ranks[0], group=domain.collective_group())
        model = box[0]
        assert model is not None
        self._cost_models[key] = model
        return model

    def plan_summary(self) -> str:
        """Tables of the plans the last step ran (one per distributed domain)."""
        if not self._last_plans:
            return "no distributed plan: the last step ran on a single process (or none ran yet)"
        return "\n\n".join(
            f"domain {d.kind} over ranks {list(d.ranks)}\n{p.table()}" for d, p in self._last_plans
        )

    def plans(self) -> list[Plan]:
        """The plans the last step ran, one per distributed domain."""
        return [p for _, p in self._last_plans]

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
            params.append(local_tensor(p))
            grads.append(local_tensor(p.grad))
            exp_avgs.append(local_tensor(state["exp_avg"]))
            exp_avg_sqs.append(local_tensor(state["exp_avg_sq"]))
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


def _lap(stats: dict[str, float], key: str, since: float) -> float:
    now = time.perf_counter()
    stats[key] = now - since
    return now


def _check_plans_agree(domain: Domain, plan: Plan) -> None:
    """Fail fast, naming the ranks, if ranks built different plans (they would deadlock or corrupt)."""
    if domain.group is None or domain.world == 1:
        return
    digests: list[str | None] = [None] * domain.world
    dist.all_gather_object(digests, plan.digest(), group=domain.collective_group())
    if len(set(digests)) != 1:
        raise RuntimeError(
            f"dmuon: ranks {list(domain.ranks)} built different Muon plans (digests {digests}). Every rank "
            "must hold the same Muon params with gradients in the same groups and order"
        )


def _validate_distribution_options(
    plain_tensors: str,
    distribution: str,
    planner: str,
    cost_model: str | CostModel,
    bucket_mb: float,
    milp_time_limit: float,
    split: str,
    hsdp_replicas: str,
) -> None:
    if split not in SPLIT_MODES:
        raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
    if hsdp_replicas not in ("auto", "share", "repeat"):
        raise ValueError(f"hsdp_replicas must be 'auto', 'share' or 'repeat', got {hsdp_replicas!r}")
    if plain_tensors not in ("replicated", "local"):
        raise ValueError(f"plain_tensors must be 'replicated' or 'local', got {plain_tensors!r}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if planner not in STRATEGIES:
        raise ValueError(f"planner must be one of {STRATEGIES}, got {planner!r}")
    if not isinstance(cost_model, CostModel) and cost_model not in COST_MODELS:
        raise ValueError(
            f"cost_model must be one of {COST_MODELS} or a dmuon.planner.CostModel, got {cost_model!r}"
        )
    if bucket_mb != "auto" and (not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0):
        raise ValueError(f"bucket_mb must be > 0 or 'auto', got {bucket_mb!r}")
    if not isinstance(milp_time_limit, (int, float)) or not milp_time_limit > 0:
        raise ValueError(f"milp_time_limit must be > 0 seconds, got {milp_time_limit!r}")


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


# Prefixes wrappers add to parameter names (DDP, torch.compile, FSDP1, activation checkpointing).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _bare_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if f"{part}." not in _WRAPPER_PREFIXES)


def _check_state_fits(groups: list[dict], state_dict: dict[str, Any]) -> None:
    """Raise ValueError naming the group and param where `state_dict` does not fit `groups`."""
    fix = (
        "The optimizer state was saved for another model, param order or routing (dmuon.param_groups "
        "rules); build the optimizer the same way as the saved run, or start without its optimizer state."
    )
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(
            "Muon.load_state_dict expects a dict with 'state' and 'param_groups' (from "
            f"Muon.state_dict()), got {type(state_dict).__name__} with keys "
            f"{sorted(state_dict) if isinstance(state_dict, dict) else '-'}."
        )
    saved_groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"optimizer state has {len(saved_groups)} param group(s) of {saved_sizes} params, but this Muon "
            f"has {len(groups)} of {sizes}. {fix}"
        )
    saved_state = state_dict["state"]
    renamed: list[str] = []
    for index, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        where = _group_label(group, index)
        saved_algorithm = saved.get("algorithm", "muon")
        if saved_algorithm != group["algorithm"]:
            raise ValueError(
                f"{where}: the saved group {index} is a {saved_algorithm!r} group, this one is "
                f"{group['algorithm']!r}. {fix}"
            )
        merged = {**{k: v for k, v in group.items() if k != "params"}, **saved}
        _validate_hyperparameters(merged, where=f"saved {where}")
        names = group.get("param_names") or []
        saved_names = saved.get("param_names") or []
        for position, (p, key) in enumerate(zip(group["params"], saved["params"], strict=True)):
            name = repr(names[position]) if position < len(names) else f"#{position}"
            saved_name = saved_names[position] if position < len(saved_names) else None
            was = f" (saved as {saved_name!r})" if saved_name is not None else ""
            for entry, value in (saved_state.get(key) or {}).items():
                if isinstance(value, Tensor) and value.ndim > 0 and tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"{where}: param {position} {name} has shape {tuple(p.shape)}, but its saved "
                        f"{entry!r}{was} has shape {tuple(value.shape)}. {fix}"
                    )
            if (
                saved_name is not None
                and position < len(names)
                and _bare_name(saved_name) != _bare_name(names[position])
            ):
                renamed.append(f"group {index} param {position}: {saved_name!r} -> {names[position]!r}")
    if renamed:
        warnings.warn(
            f"Muon.load_state_dict: {len(renamed)} param(s) have other names than in the saved state "
            f"(shapes match, so their state loads by position): {'; '.join(renamed[:4])}. If the params were "
            "reordered rather than renamed, their momentum now belongs to another param.",
            stacklevel=3,
        )


def _group_label(group: dict, index: int) -> str:
    """'param group 1 (adamw: 'embed.weight', 'norm.weight', ...)' for error messages."""
    names = group.get("param_names") or []
    shown = ", ".join(repr(n) for n in names[:2]) + (", ..." if len(names) > 2 else "")
    title = f" {group['name']!r}" if group.get("name") else ""
    return f"param group {index}{title} ({group.get('algorithm', 'muon')}{': ' + shown if shown else ''})"


def _check_live_hyperparameters(group: dict, index: int) -> None:
    """At every step: the values an LR scheduler or user code may have changed since construction.

    A NaN or inf lr (or weight decay, momentum, betas, eps) would turn every weight of the group into
    NaN in one step without an error; checking a few floats per group costs nothing.
    """
    where = _group_label(group, index)
    hint = (
        "; it was changed after construction (an LR scheduler, or code setting optimizer.param_groups"
        f"[{index}][...]), so fix the schedule or the value set there"
    )
    _check_number(group, "lr", 0.0, where=where, hint=hint)
    _check_number(group, "weight_decay", 0.0, where=where, hint=hint)
    if group["algorithm"] == "muon":
        _check_number(group, "momentum", 0.0, 1.0, high_open=True, where=where, hint=hint)
        return
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be two floats (beta1, beta2), got {betas!r}{hint}")
    for i, beta in enumerate(betas):
        _check_number({f"betas[{i}]": beta}, f"betas[{i}]", 0.0, 1.0, high_open=True, where=where, hint=hint)
    _check_number(group, "eps", 0.0, where=where, hint=hint)
    if group["eps"] <= 0:
        raise ValueError(f"{where}: eps must be > 0, got {group['eps']}{hint}")


def _validate_hyperparameters(group: dict, where: str) -> None:
    algorithm = group.get("algorithm")
    if algorithm not in OPTIMIZER_ALGORITHMS:
        raise ValueError(f"{where}: algorithm must be one of {OPTIMIZER_ALGORITHMS}, got {algorithm!r}")
    _check_number(group, "lr", 0.0, where=where)
    _check_number(group, "weight_decay", 0.0, where=where)
    if algorithm == "adamw":
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"{where}: betas must be two floats (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            _check_number({f"betas[{i}]": beta}, f"betas[{i}]", 0.0, 1.0, high_open=True, where=where)
        _check_number(group, "eps", 0.0, where=where)
        if group["eps"] <= 0:
            raise ValueError(f"{where}: eps must be > 0, got {group['eps']}")
        for key in ("foreach", "fused"):
            if group[key] not in (None, True, False):
                raise ValueError(f"{where}: {key} must be None, True or False, got {group[key]!r}")
        if group["foreach"] and group["fused"]:
            raise ValueError(f"{where}: foreach and fused are exclusive; set at most one of them")
        return
    _check_number(group, "momentum", 0.0, 1.0, high_open=True, where=where)
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
    _check_number(group, "ns_eps", 0.0, where=where)
    if group["ns_eps"] <= 0:
        raise ValueError(f"{where}: ns_eps must be > 0, got {group['ns_eps']}")
