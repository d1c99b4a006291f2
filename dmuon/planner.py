"""Who orthogonalises which matrix: owner assignment, same-shape batching, pipeline buckets.

Every Muon matrix gets exactly one owner rank in its domain. The plan is a pure function of the
matrix specs (names, shapes, NS settings, rows per rank), the world size and the cost model, so
every rank computes the same plan; ties break by matrix name. MILP plans are solved on one rank and
broadcast by the caller, since a time-limited solver need not stop at the same point everywhere.

Cost of a matrix: a predicted time in seconds. The default `CostModel` divides the Newton-Schulz
FLOP count by a nominal throughput; a calibrated model measures NS per (shape, algorithm, batch
size) on this device, which also captures how much cheaper batching same-shape matrices is.

Strategies:
- "lpt": longest processing time first: matrices by decreasing cost (then name) to the least
  loaded rank (ties: lowest rank). Within 4/3 of the optimum makespan.
- "milp": integer x[s, b, r] = number of size-b batches of shape class s on rank r; minimise the
  slowest rank's load z (+ a small weight on total work), subject to covering every matrix. Solved
  with scipy's HiGHS under a time limit; falls back to LPT if it fails or is not better.

Buckets are consecutive runs of the matrices in decreasing cost order (about `bucket_bytes` each);
owners are balanced inside every bucket, since buckets run one after another.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dmuon.functional import NSConfig
from dmuon.newton_schulz import ns_flops

STRATEGIES = ("lpt", "milp")
DEFAULT_FLOPS_PER_SECOND = 1e11  # nominal: only ratios matter for balance; calibration replaces it


@dataclass(frozen=True)
class MatrixSpec:
    """One Muon matrix as the planner sees it.

    m, n: the orthogonalised view (shape[0], prod(shape[1:])).
    rows: rows each domain rank holds (Shard(0) in chunk order), or None when every rank holds all.
    """

    name: str
    m: int
    n: int
    ns: NSConfig
    rows: tuple[int, ...] | None = None

    @property
    def shape_class(self) -> tuple[int, int, NSConfig]:
        """Matrices of one class can be orthogonalised in one batched call."""
        return (self.m, self.n, self.ns)

    @property
    def numel(self) -> int:
        return self.m * self.n

    def offsets(self) -> tuple[int, ...]:
        """First row of each rank's shard (sharded specs only)."""
        assert self.rows is not None
        out, acc = [], 0
        for r in self.rows:
            out.append(acc)
            acc += r
        return tuple(out)


def _class_key(cls: tuple[int, int, NSConfig]) -> str:
    m, n, ns = cls
    return f"{m}x{n}|{ns.algorithm_for((m, n))}|{ns.steps}|{str(ns.dtype).removeprefix('torch.')}"


@dataclass
class CostModel:
    """Predicted seconds of Newton-Schulz calls.

    profile: measured seconds of one call on a batch, keyed "MxN|algorithm|steps|dtype" -> {batch: s}.
    Unmeasured batch sizes interpolate per-matrix time between measured ones (and scale linearly
    past the largest); unmeasured shapes fall back to FLOPs / flops_per_second.
    """

    flops_per_second: float = DEFAULT_FLOPS_PER_SECOND
    profile: dict[str, dict[int, float]] = field(default_factory=dict)

    def batch_seconds(self, cls: tuple[int, int, NSConfig], batch: int) -> float:
        m, n, ns = cls
        measured = self.profile.get(_class_key(cls))
        if measured:
            sizes = sorted(measured)
            per = {b: measured[b] / b for b in sizes}
            if batch <= sizes[0]:
                return per[sizes[0]] * batch
            if batch >= sizes[-1]:
                return per[sizes[-1]] * batch
            hi = next(b for b in sizes if b >= batch)
            lo = max(b for b in sizes if b <= batch)
            if hi == lo:
                return measured[hi]
            w = (batch - lo) / (hi - lo)
            return ((1 - w) * per[lo] + w * per[hi]) * batch
        flops = ns_flops((m, n), ns.algorithm_for((m, n)), ns.steps)
        return batch * flops / self.flops_per_second

    def matrix_seconds(self, cls: tuple[int, int, NSConfig]) -> float:
        return self.batch_seconds(cls, 1)

    # -------------------------------------------------------------- calibration
    @staticmethod
    def default_cache_path(device: torch.device) -> Path:
        root = Path(os.environ.get("DMUON_CACHE", Path.home() / ".cache" / "dmuon"))
        tag = f"{device.type}-torch{torch.__version__.split('+')[0]}-t{torch.get_num_threads()}"
        return root / f"ns_profile-{tag}.json"

    @classmethod
    def load(cls, path: Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        profile = {k: {int(b): float(s) for b, s in v.items()} for k, v in data.get("profile", {}).items()}
        return cls(
            flops_per_second=float(data.get("flops_per_second", DEFAULT_FLOPS_PER_SECOND)), profile=profile
        )

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"flops_per_second": self.flops_per_second, "profile": self.profile}, indent=1)
        )
        tmp.replace(path)  # atomic: concurrent readers never see half a file

    def calibrate(
        self,
        classes: Sequence[tuple[int, int, NSConfig]],
        *,
        batch_sizes: Sequence[int] = (1, 2, 4, 8),
        max_batch: dict[tuple[int, int, NSConfig], int] | None = None,
        device: torch.device | str = "cpu",
        repeats: int = 3,
    ) -> CostModel:
        """Measure the classes not yet in the profile (batch sizes up to each class's count)."""
        from dmuon.functional import orthogonalize_batch
        from dmuon.profiling import measure

        device = torch.device(device)
        for c in classes:
            key = _class_key(c)
            limit = (max_batch or {}).get(c, max(batch_sizes))
            wanted = [b for b in batch_sizes if b <= max(1, limit)]
            have = self.profile.setdefault(key, {})
            for b in wanted:
                if b in have:
                    continue
                x = torch.randn(b, c[0], c[1], device=device)
                have[b] = measure(
                    lambda x=x, ns=c[2]: orthogonalize_batch(x, ns), repeats=repeats, device=device
                ).median
        return self


@dataclass(frozen=True)
class Plan:
    """Owners, buckets and predicted per-rank work for one domain.

    owners[i]:  domain rank that orthogonalises specs[i].
    buckets:    matrix indices per pipeline stage, each in ascending index order.
    rank_seconds: predicted NS seconds per rank (batch-aware).
    """

    world: int
    specs: tuple[MatrixSpec, ...]
    owners: tuple[int, ...]
    buckets: tuple[tuple[int, ...], ...]
    rank_seconds: tuple[float, ...]
    strategy: str
    bucket_seconds: tuple[tuple[float, ...], ...] = ()

    @property
    def efficiency(self) -> float:
        """Balance efficiency: ideal per-rank cost (mean) / slowest rank's cost; 1.0 is perfect."""
        worst = max(self.rank_seconds) if self.rank_seconds else 0.0
        return (sum(self.rank_seconds) / self.world) / worst if worst > 0 else 1.0

    @property
    def stage_efficiency(self) -> float:
        """Like `efficiency`, per bucket: sum over buckets of mean load / sum of the slowest rank's.

        Buckets end in collectives, so this is the balance the pipelined step actually sees.
        """
        mean = sum(sum(loads) / self.world for loads in self.bucket_seconds)
        worst = sum(max(loads) for loads in self.bucket_seconds)
        return mean / worst if worst > 0 else 1.0

    @property
    def makespan(self) -> float:
        """Predicted NS seconds of the slowest rank (buckets summed)."""
        return max(self.rank_seconds) if self.rank_seconds else 0.0

    def digest(self) -> str:
        payload = json.dumps(
            [self.world, [(s.name, s.m, s.n, s.rows) for s in self.specs], self.owners, self.buckets]
        )
        return hashlib.sha1(payload.encode()).hexdigest()

    def traffic(self, element_size: int = 4) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) per rank for one step, both directions of the exchange.

        Sharded: each shard row travels to its owner and the orthogonalised row travels back.
        Replicated: each owner's results reach every other rank (an all-gather, padding excluded).
        """
        sent = [0] * self.world
        received = [0] * self.world
        for spec, owner in zip(self.specs, self.owners):
            if spec.rows is not None:
                for r, rows in enumerate(spec.rows):
                    if r == owner or rows == 0:
                        continue
                    nbytes = rows * spec.n * element_size
                    sent[r] += nbytes  # shard to the owner
                    received[owner] += nbytes
                    sent[owner] += nbytes  # result rows back
                    received[r] += nbytes
            else:
                nbytes = spec.numel * element_size
                sent[owner] += nbytes * (self.world - 1)
                for r in range(self.world):
                    if r != owner:
                        received[r] += nbytes
        return list(zip(sent, received))

    def rows(self) -> list[dict]:
        """Per-rank summary: matrices owned, batched NS calls, predicted seconds, bytes."""
        counts = [0] * self.world
        classes: list[set] = [set() for _ in range(self.world)]
        for spec, owner in zip(self.specs, self.owners):
            counts[owner] += 1
            classes[owner].add(spec.shape_class)
        return [
            {
                "rank": r,
                "matrices": counts[r],
                "shape_classes": len(classes[r]),
                "predicted_s": self.rank_seconds[r],
                "bytes_sent": sent,
                "bytes_received": received,
            }
            for r, (sent, received) in enumerate(self.traffic())
        ]

    def table(self) -> str:
        lines = [
            f"plan: {len(self.specs)} matrices on {self.world} ranks, strategy {self.strategy}, "
            f"{len(self.buckets)} bucket(s), balance efficiency {self.efficiency:.3f} "
            f"(per bucket {self.stage_efficiency:.3f})",
            f"{'rank':>4} {'matrices':>8} {'classes':>7} {'pred. ms':>9} {'sent MB':>8} {'recv MB':>8}",
        ]
        for row in self.rows():
            lines.append(
                f"{row['rank']:>4} {row['matrices']:>8} {row['shape_classes']:>7} "
                f"{row['predicted_s'] * 1e3:>9.2f} {row['bytes_sent'] / 2**20:>8.2f} "
                f"{row['bytes_received'] / 2**20:>8.2f}"
            )
        return "\n".join(lines)


def rank_loads(
    specs: Sequence[MatrixSpec], owners: Sequence[int], world: int, cost: CostModel
) -> tuple[float, ...]:
    """Batch-aware predicted seconds per rank: a rank batches all its matrices of one class."""
    counts: dict[tuple[int, tuple], int] = defaultdict(int)
    for spec, owner in zip(specs, owners):
        counts[(owner, spec.shape_class)] += 1
    loads = [0.0] * world
    for (owner, cls), count in counts.items():
        loads[owner] += cost.batch_seconds(cls, count)
    return tuple(loads)


def assign_lpt(specs: Sequence[MatrixSpec], world: int, cost: CostModel) -> tuple[int, ...]:
    """Longest processing time first; ties by name, then by lowest rank."""
    order = sorted(
        range(len(specs)), key=lambda i: (-cost.matrix_seconds(specs[i].shape_class), specs[i].name)
    )
    loads = [0.0] * world
    owners = [0] * len(specs)
    for i in order:
        r = min(range(world), key=lambda k: (loads[k], k))
        owners[i] = r
        loads[r] += cost.matrix_seconds(specs[i].shape_class)
    return tuple(owners)


def _batch_options(count: int) -> list[int]:
    options = {1, count}
    b = 2
    while b < count:
        options.add(b)
        b *= 2
    return sorted(options)


def assign_milp(
    specs: Sequence[MatrixSpec], world: int, cost: CostModel, *, time_limit: float = 5.0
) -> tuple[int, ...] | None:
    """Owners from the batch-aware MILP, or None if scipy is missing or HiGHS finds no solution."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        return None
    by_class: dict[tuple, list[int]] = defaultdict(list)
    for i, spec in enumerate(specs):
        by_class[spec.shape_class].append(i)
    classes = sorted(by_class, key=_class_key)
    variables: list[tuple[int, int, int]] = []  # (class index, batch size, rank)
    for c, cls in enumerate(classes):
        for b in _batch_options(len(by_class[cls])):
            for r in range(world):
                variables.append((c, b, r))
    n = len(variables) + 1  # + makespan z
    seconds = np.array([cost.batch_seconds(classes[c], b) for c, b, _ in variables])
    scale = float(seconds.max()) if len(seconds) and seconds.max() > 0 else 1.0
    seconds = seconds / scale  # keep the LP well scaled
    objective = np.zeros(n)
    objective[-1] = 1.0
    objective[:-1] = 1e-3 * seconds / world  # tie-break towards less total work (bigger batches)
    # Sparse constraint matrix: large worlds have 10^5 variables.
    entries: list[tuple[int, int, float]] = []
    lower: list[float] = []
    upper: list[float] = []
    for v, (c, b, _) in enumerate(variables):  # every matrix of every class covered exactly once
        entries.append((c, v, float(b)))
    for cls in classes:
        lower.append(len(by_class[cls]))
        upper.append(len(by_class[cls]))
    load_row = len(classes)
    for v, (_, _, r) in enumerate(variables):  # load_r - z <= 0
        entries.append((load_row + r, v, float(seconds[v])))
    for r in range(world):
        entries.append((load_row + r, n - 1, -1.0))
        lower.append(-np.inf)
        upper.append(0.0)
    order_row = load_row + world
    for v, (_, _, r) in enumerate(variables):  # symmetry breaking: load_r >= load_{r+1}
        if r < world - 1:
            entries.append((order_row + r, v, float(seconds[v])))
        if r > 0:
            entries.append((order_row + r - 1, v, -float(seconds[v])))
    for _ in range(world - 1):
        lower.append(0.0)
        upper.append(np.inf)
    i_idx, j_idx, values = zip(*entries)
    matrix = coo_matrix((values, (i_idx, j_idx)), shape=(len(lower), n)).tocsr()
    integrality = np.ones(n)
    integrality[-1] = 0
    result = milp(
        objective,
        constraints=LinearConstraint(matrix, lower, upper),
        integrality=integrality,
        bounds=Bounds(np.zeros(n), np.full(n, np.inf)),
        options={"time_limit": time_limit, "mip_rel_gap": 0.01, "disp": False},
    )
    if result.x is None:
        return None
    counts = np.rint(result.x[:-1]).astype(int)
    owners = [0] * len(specs)
    for c, cls in enumerate(classes):
        members = sorted(by_class[cls], key=lambda i: specs[i].name)
        position = 0
        for v, (vc, b, r) in enumerate(variables):
            if vc != c:
                continue
            for _ in range(counts[v] * b):
                owners[members[position]] = r
                position += 1
        if position != len(members):
            return None  # rounding broke coverage: let the caller fall back
    return tuple(owners)


def _lpt_efficiency(members: Sequence[MatrixSpec], world: int, cost: CostModel) -> float:
    loads = rank_loads(members, assign_lpt(members, world, cost), world, cost)
    worst = max(loads)
    return sum(loads) / world / worst if worst > 0 else 1.0


def make_buckets(
    specs: Sequence[MatrixSpec],
    world: int,
    cost: CostModel,
    *,
    bucket_bytes: int,
    element_size: int = 4,
    min_efficiency: float = 0.95,
    max_growth: int = 4,
) -> tuple[tuple[int, ...], ...]:
    """Pipeline stages: consecutive runs of the matrices in decreasing cost (then name) order.

    A bucket may close once it holds `bucket_bytes` and at least `world` matrices, and does close
    as soon as LPT balances it to `min_efficiency` (or it grew `max_growth`-fold past that point).
    Every bucket ends in a collective all ranks join, so a stage's slowest rank sets its time: a
    stage that cannot be balanced (say 13 equal matrices on 8 ranks) grows until it can (16).
    Neighbours in cost order are mostly same-shape, so a bucket also batches well.
    """
    order = sorted(
        range(len(specs)), key=lambda i: (-cost.matrix_seconds(specs[i].shape_class), specs[i].name)
    )
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    closable_at = 0  # the size at which the current bucket first could have closed
    for i in order:
        current.append(i)
        size += specs[i].numel * element_size
        if size < bucket_bytes or len(current) < world:
            continue
        closable_at = closable_at or size
        balanced = _lpt_efficiency([specs[j] for j in current], world, cost) >= min_efficiency
        if balanced or size >= max_growth * closable_at:
            buckets.append(tuple(sorted(current)))
            current, size, closable_at = [], 0, 0
    if current:
        buckets.append(tuple(sorted(current)))
    return tuple(buckets)


def build_plan(
    specs: Sequence[MatrixSpec],
    world: int,
    *,
    strategy: str = "lpt",
    cost: CostModel | None = None,
    bucket_bytes: int = 64 << 20,
    milp_time_limit: float = 5.0,
) -> Plan:
    """The plan for `specs` on `world` ranks (pure; identical on every rank for LPT).

    Buckets run one after another (each ends in a collective every rank joins), so the step takes
    about the sum over buckets of the slowest rank's work: owners are balanced per bucket.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown planner strategy {strategy!r}: use one of {STRATEGIES}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    cost = cost or CostModel()
    specs = tuple(specs)
    buckets = make_buckets(specs, world, cost, bucket_bytes=bucket_bytes)
    owners = [0] * len(specs)
    notes: set[str] = set()
    for bucket in buckets:
        members = [specs[i] for i in bucket]
        chosen = assign_lpt(members, world, cost)
        if strategy == "milp":
            limit = max(0.05, milp_time_limit / len(buckets))
            milp_owners = assign_milp(members, world, cost, time_limit=limit)
            if milp_owners is None:
                notes.add("milp found no solution or scipy is missing: lpt")
            elif max(rank_loads(members, milp_owners, world, cost)) <= max(
                rank_loads(members, chosen, world, cost)
            ):
                chosen = milp_owners
            else:
                notes.add("lpt kept where milp was not better")
        for i, owner in zip(bucket, chosen):
            owners[i] = owner
    per_bucket = tuple(
        rank_loads([specs[i] for i in bucket], [owners[i] for i in bucket], world, cost) for bucket in buckets
    )
    loads = [sum(stage[r] for stage in per_bucket) for r in range(world)]
    used = strategy + (f" ({'; '.join(sorted(notes))})" if notes else "")
    return Plan(
        world=world,
        specs=specs,
        owners=tuple(owners),
        buckets=buckets,
        rank_seconds=tuple(loads),
        strategy=used,
        bucket_seconds=per_bucket,
    )
