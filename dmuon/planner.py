"""Who orthogonalises which matrix: owners or split groups, same-shape batching, pipeline buckets.

Every Muon matrix gets one owner rank in its domain, or (split) a group of k ranks that runs Newton-Schulz
on it together, each member on a column chunk (dmuon.split_ns). The plan is a pure function of the
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

Splitting (`split`): a domain of W ranks is `W / ranks_per_replica` replicas (HSDP; 1 for FSDP2 and
DDP) and a split group is an aligned block of k ranks inside one replica (k divides ranks_per_replica),
so that its members can gather their column chunks from their own shard group.
- "off":    owners only.
- "auto":   a matrix is split only if it alone costs more than the ideal per-rank load (the total work /
            W), which no owner-only plan can finish under; it goes to the smallest k whose per-member
            time (1/k of the FLOPs + the m x m all-reduces and all-gathers, alpha-beta) fits in that
            load, or the k that minimises it. Everything else keeps one owner. With no such matrix
            (the common case at small W) the plan is the owner-only plan; and a plan with splits is
            kept only if its predicted step (dmuon.step_model: the messages dmuon.comm sends, priced
            on the cost model's network, so a matrix whose owner's links set the step is split even
            where the compute alone would not gain) beats the owner-only plan's, so "auto" never
            predicts a slower step than "off".
- "always": every non-empty matrix is split over a whole replica (tests and benchmarks).
Jobs (owner: 1 rank, split: k ranks) are placed longest first on the least loaded rank or aligned
group (LPT generalised to gangs); MILP plans refine buckets that hold no split job.

Buckets are consecutive runs of the matrices in decreasing cost order (about `bucket_bytes` each);
jobs are balanced inside every bucket, since buckets run one after another.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dmuon.functional import NSConfig
from dmuon.newton_schulz import ns_flops
from dmuon.split_ns import chunk_sizes, split_collectives, split_message_elements
from dmuon.step_model import ELEMENT_BYTES, Network, step_seconds

STRATEGIES = ("lpt", "milp")
SPLIT_MODES = ("off", "auto", "always")
DEFAULT_FLOPS_PER_SECOND = 1e11  # nominal: only ratios matter for balance; calibration replaces it
DEFAULT_LATENCY_S = 20e-6  # per message of a collective (alpha)
DEFAULT_BANDWIDTH = 25e9  # bytes per second per rank (1 / beta)


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

    @property
    def tall(self) -> bool:
        """NS runs on the transpose (rows > cols): the columns of X are the rows of the parameter."""
        return self.m > self.n

    def offsets(self) -> tuple[int, ...]:
        """First row of each rank's shard (sharded specs only)."""
        assert self.rows is not None
        out, acc = [], 0
        for r in self.rows:
            out.append(acc)
            acc += r
        return tuple(out)

    def split_ring_bytes(self, members: int, element_size: int = 4) -> int:
        """Bytes each member sends (and receives) in the ring collectives of one split NS call."""
        reduces, gathers = split_collectives(self.ns.algorithm_for((self.m, self.n)), self.ns.steps)
        reduced, gathered = split_message_elements(min(self.m, self.n), members)
        return int((2 * reduces * reduced + gathers * gathered) * (members - 1) / members * element_size)

    def block(self, members: int, index: int) -> tuple[int, int, int, int]:
        """(row0, row1, col0, col1) of the (m, n) view that split member `index` of `members` works on.

        The members split X (the view, transposed when tall) by columns in torch.chunk order: a tall
        matrix by its rows, a wide one by its columns. One member (an owner) gets the whole matrix.
        """
        if members == 1:
            return (0, self.m, 0, self.n)
        sizes = chunk_sizes(max(self.m, self.n), members)
        start = sum(sizes[:index])
        stop = start + sizes[index]
        return (start, stop, 0, self.n) if self.tall else (0, self.m, start, stop)


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
    latency_s: float = DEFAULT_LATENCY_S
    bandwidth: float = DEFAULT_BANDWIDTH
    ranks_per_node: int = 0  # > 0: groups wider than a node run at inter_node_bandwidth
    inter_node_bandwidth: float = 0.0

    def network(self) -> Network:
        """The network these numbers describe, for dmuon.step_model."""
        return Network(
            alpha=self.latency_s,
            intra=self.bandwidth,
            inter=self.inter_node_bandwidth or self.bandwidth,
            gpus_per_node=self.ranks_per_node,
        )

    def collective_seconds(self, kind: str, nbytes: float, members: int) -> float:
        """Ring all-reduce or all-gather of `nbytes` (the whole result) over `members` aligned ranks."""
        if members <= 1:
            return 0.0
        steps = 2 * (members - 1) if kind == "all_reduce" else members - 1
        bandwidth = self.bandwidth
        if self.ranks_per_node and members > self.ranks_per_node and self.inter_node_bandwidth > 0:
            bandwidth = self.inter_node_bandwidth
        return steps * self.latency_s + steps / members * nbytes / bandwidth

    def split_comm_seconds(self, cls: tuple[int, int, NSConfig], batch: int, members: int) -> float:
        """The m x m collectives of one split NS call on a batch (m: the short side)."""
        m, n, ns = cls
        reduces, gathers = split_collectives(ns.algorithm_for((m, n)), ns.steps)
        reduced, gathered = split_message_elements(min(m, n), members)
        return reduces * self.collective_seconds("all_reduce", batch * reduced * 4, members) + gathers * (
            self.collective_seconds("all_gather", batch * gathered * 4, members)
        )

    def split_seconds(self, cls: tuple[int, int, NSConfig], batch: int, members: int) -> float:
        """Seconds each of `members` ranks spends on a batch split over them: 1/k of the work + comm."""
        if members == 1:
            return self.batch_seconds(cls, batch)
        return self.batch_seconds(cls, batch) / members + self.split_comm_seconds(cls, batch, members)

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
            flops_per_second=float(data.get("flops_per_second", DEFAULT_FLOPS_PER_SECOND)),
            profile=profile,
            latency_s=float(data.get("latency_s", DEFAULT_LATENCY_S)),
            bandwidth=float(data.get("bandwidth", DEFAULT_BANDWIDTH)),
            ranks_per_node=int(data.get("ranks_per_node", 0)),
            inter_node_bandwidth=float(data.get("inter_node_bandwidth", 0.0)),
        )

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "flops_per_second": self.flops_per_second,
                    "latency_s": self.latency_s,
                    "bandwidth": self.bandwidth,
                    "ranks_per_node": self.ranks_per_node,
                    "inter_node_bandwidth": self.inter_node_bandwidth,
                    "profile": self.profile,
                },
                indent=1,
            )
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
    """Owners or split groups, buckets and predicted per-rank work for one domain.

    members[i]:   domain ranks that orthogonalise specs[i]: one (its owner) or an aligned group of k
                  (a split); owners[i] is members[i][0].
    buckets:      matrix indices per pipeline stage, each in ascending index order.
    rank_seconds: predicted NS seconds per rank (batch-aware, split collectives included).
    ranks_per_replica: domain ranks per replica (HSDP: the shard group size; W otherwise). Domain
                  rank w is shard rank w % ranks_per_replica of replica w // ranks_per_replica.
    work_seconds: predicted NS seconds of all the work, without the split collectives.
    """

    world: int
    specs: tuple[MatrixSpec, ...]
    owners: tuple[int, ...]
    buckets: tuple[tuple[int, ...], ...]
    rank_seconds: tuple[float, ...]
    strategy: str
    bucket_seconds: tuple[tuple[float, ...], ...] = ()
    members: tuple[tuple[int, ...], ...] = ()
    ranks_per_replica: int = 0
    work_seconds: float = -1.0
    split: str = "off"
    bucket_replicas: tuple[int, ...] = ()  # replicas sharing each bucket's work: R (default) or 1
    # Memo of what every step derives from the plan alone (pieces(i), dmuon.comm's bucket routes).
    memo: dict[tuple, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.members:
            object.__setattr__(self, "members", tuple((o,) for o in self.owners))
        if not self.ranks_per_replica:
            object.__setattr__(self, "ranks_per_replica", self.world)
        if self.work_seconds < 0:
            object.__setattr__(self, "work_seconds", sum(self.rank_seconds))

    @property
    def replicas(self) -> int:
        return self.world // self.ranks_per_replica

    def replica_of(self, i: int) -> int:
        """The replica whose ranks orthogonalise specs[i] (0 for a bucket every replica computes)."""
        return self.members[i][0] // self.ranks_per_replica

    def replica_local(self) -> set[int]:
        """Matrices every HSDP replica computes itself (none with one replica)."""
        if self.replicas == 1:
            return set()
        return {i for k, bucket in enumerate(self.buckets) if self.sharing(k) == 1 for i in bucket}

    def sharing(self, k: int) -> int:
        """How many replicas share bucket k's work: all of them (its results are fanned out over the
        replicate dimension) or 1 (every replica computes the bucket on its own shard group, with
        the plan's members in replica 0 standing for the same ranks of every replica)."""
        return self.bucket_replicas[k] if self.bucket_replicas else self.replicas

    @property
    def split_indices(self) -> tuple[int, ...]:
        return tuple(i for i, group in enumerate(self.members) if len(group) > 1)

    @property
    def efficiency(self) -> float:
        """Balance efficiency: ideal per-rank cost (all work / W) over the slowest rank's; 1.0 is perfect.

        Split collectives count against it: they are time on the slowest rank, not useful work.
        """
        worst = max(self.rank_seconds) if self.rank_seconds else 0.0
        return (self.work_seconds / self.world) / worst if worst > 0 else 1.0

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

    @property
    def stage_seconds(self) -> float:
        """Predicted NS seconds of the step: buckets end in collectives, so their slowest ranks add up."""
        return sum(max(loads) for loads in self.bucket_seconds) if self.bucket_seconds else self.makespan

    def digest(self) -> str:
        payload = json.dumps(
            [
                self.world,
                self.ranks_per_replica,
                [(s.name, s.m, s.n, s.rows) for s in self.specs],
                self.members,
                self.buckets,
                self.bucket_replicas,
            ]
        )
        return hashlib.sha1(payload.encode()).hexdigest()

    def pieces(self, i: int) -> list[tuple[int, int, int, int, int, int]]:
        """The forward exchange of sharded specs[i]: (source shard rank, member index, row0, row1,
        col0, col1) of every non-empty piece of the (m, n) view a shard rank of the computing replica
        sends to a member (the reverse exchange sends the same pieces of the result back)."""
        if ("pieces", i) in self.memo:
            return self.memo[("pieces", i)]
        spec, group = self.specs[i], self.members[i]
        assert spec.rows is not None
        offsets = spec.offsets()
        out = []
        for j in range(len(group)):
            r0, r1, c0, c1 = spec.block(len(group), j)
            for s, rows in enumerate(spec.rows):
                lo, hi = max(r0, offsets[s]), min(r1, offsets[s] + rows)
                if hi > lo and c1 > c0:
                    out.append((s, j, lo, hi, c0, c1))
        self.memo[("pieces", i)] = out
        return out

    def traffic(self, element_size: int = 4) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) per rank for one step.

        Sharded: each piece of a shard travels to its owner or split member and the result travels
        back; with replicas (HSDP), each rank's result rows reach the same shard rank of every other
        replica. Replicated: each owner's (or member's) results reach every other rank. Split
        matrices add their m x m all-reduces and all-gathers (ring volumes).
        """
        sent = [0] * self.world
        received = [0] * self.world
        size = self.ranks_per_replica
        local = self.replica_local()
        for i, spec in enumerate(self.specs):
            group = self.members[i]
            if spec.rows is not None:
                base = self.replica_of(i) * size
                shifts = range(0, self.world, size) if i in local else (0,)
                for shift in shifts:
                    for s, j, lo, hi, c0, c1 in self.pieces(i):
                        src, dst = base + shift + s, group[j] + shift
                        if src == dst:
                            continue
                        nbytes = (hi - lo) * (c1 - c0) * element_size
                        sent[src] += nbytes  # the shard piece to the member
                        received[dst] += nbytes
                        sent[dst] += nbytes  # the result piece back
                        received[src] += nbytes
                for s, rows in enumerate(spec.rows if i not in local else ()):
                    nbytes = rows * spec.n * element_size
                    for replica in range(self.replicas):
                        if replica * size != base:
                            sent[base + s] += nbytes
                            received[replica * size + s] += nbytes
            else:
                for j, w in enumerate(group):
                    r0, r1, c0, c1 = spec.block(len(group), j)
                    nbytes = (r1 - r0) * (c1 - c0) * element_size
                    sent[w] += nbytes * (self.world - 1)
                    for r in range(self.world):
                        if r != w:
                            received[r] += nbytes
            if len(group) > 1:
                volume = spec.split_ring_bytes(len(group), element_size)
                for shift in range(0, self.world, size) if i in local else (0,):
                    for w in group:
                        sent[w + shift] += volume
                        received[w + shift] += volume
        return list(zip(sent, received))

    def rows(self) -> list[dict]:
        """Per-rank summary: matrices owned, split jobs joined, batched classes, seconds, bytes."""
        counts = [0] * self.world
        splits = [0] * self.world
        classes: list[set] = [set() for _ in range(self.world)]
        for spec, group in zip(self.specs, self.members):
            for r in group:
                if len(group) == 1:
                    counts[r] += 1
                else:
                    splits[r] += 1
                classes[r].add(spec.shape_class)
        return [
            {
                "rank": r,
                "matrices": counts[r],
                "split_jobs": splits[r],
                "shape_classes": len(classes[r]),
                "predicted_s": self.rank_seconds[r],
                "bytes_sent": sent,
                "bytes_received": received,
            }
            for r, (sent, received) in enumerate(self.traffic())
        ]

    def split_groups(self) -> list[dict]:
        """One row per (shape, group size) of the split matrices: how many, over which groups."""
        rows: dict[tuple[int, int, int], dict] = {}
        for i in self.split_indices:
            spec, group = self.specs[i], self.members[i]
            row = rows.setdefault(
                (spec.m, spec.n, len(group)),
                {"shape": (spec.m, spec.n), "ranks": len(group), "matrices": 0, "groups": set()},
            )
            row["matrices"] += 1
            row["groups"].add(group)
        return [
            {**row, "groups": sorted(row["groups"])}
            for _, row in sorted(rows.items(), key=lambda kv: (-kv[0][0] * kv[0][1], kv[0]))
        ]

    def table(self) -> str:
        replicas = f", {self.replicas} replicas x {self.ranks_per_replica}" if self.replicas > 1 else ""
        lines = [
            f"plan: {len(self.specs)} matrices on {self.world} ranks{replicas}, strategy {self.strategy}, "
            f"split {self.split} ({len(self.split_indices)} split), {len(self.buckets)} bucket(s), "
            f"balance efficiency {self.efficiency:.3f} (per bucket {self.stage_efficiency:.3f})",
            f"{'rank':>4} {'matrices':>8} {'split':>5} {'classes':>7} {'pred. ms':>9} {'sent MB':>8} "
            f"{'recv MB':>8}",
        ]
        for row in self.rows():
            lines.append(
                f"{row['rank']:>4} {row['matrices']:>8} {row['split_jobs']:>5} {row['shape_classes']:>7} "
                f"{row['predicted_s'] * 1e3:>9.2f} {row['bytes_sent'] / 2**20:>8.2f} "
                f"{row['bytes_received'] / 2**20:>8.2f}"
            )
        for row in self.split_groups():
            groups = row["groups"]
            shown = ", ".join(f"{g[0]}-{g[-1]}" for g in groups[:4]) + (", ..." if len(groups) > 4 else "")
            lines.append(
                f"split: {row['matrices']} x {row['shape'][0]}x{row['shape'][1]} over {row['ranks']} ranks "
                f"each, {len(groups)} group(s): {shown}"
            )
        return "\n".join(lines)


def _group_of(member: int | Sequence[int]) -> tuple[int, ...]:
    return (member,) if isinstance(member, int) else tuple(member)


def rank_loads(
    specs: Sequence[MatrixSpec],
    members: Sequence[int] | Sequence[Sequence[int]],
    world: int,
    cost: CostModel,
    *,
    comm: bool = True,
) -> tuple[float, ...]:
    """Batch-aware predicted seconds per rank: an owner batches all its matrices of one class, a split
    group all its split matrices of one class; `members[i]` is an owner rank or a group of ranks.
    `comm=False` leaves out the split collectives (the useful work only)."""
    counts: dict[tuple[tuple[int, ...], tuple], int] = defaultdict(int)
    for spec, member in zip(specs, members):
        counts[(_group_of(member), spec.shape_class)] += 1
    loads = [0.0] * world
    for (group, cls), count in counts.items():
        k = len(group)
        seconds = cost.batch_seconds(cls, count) / k
        if comm and k > 1:
            seconds += cost.split_comm_seconds(cls, count, k)
        for r in group:
            loads[r] += seconds
    return tuple(loads)


def _cost_order(specs: Sequence[MatrixSpec], cost: CostModel) -> list[int]:
    return sorted(
        range(len(specs)), key=lambda i: (-cost.matrix_seconds(specs[i].shape_class), specs[i].name)
    )


def node_link_rate(cost: CostModel, shard_group: int) -> tuple[int, float] | None:
    """(ranks per node L, seconds per byte a node owns) when a shard group of `shard_group` ranks spans
    nodes, else None. A matrix owned on a node arrives from the other nodes' shards over that node's L
    rail links, and its result leaves the same way (dmuon.exchange's inter-node stage), so each byte
    the node owns costs 2 (P - L) / P / (L x inter-node bandwidth) seconds of its rails."""
    per_node = cost.ranks_per_node
    if not per_node or shard_group <= per_node or shard_group % per_node:
        return None
    bandwidth = cost.inter_node_bandwidth or cost.bandwidth
    return per_node, 2 * (shard_group - per_node) / shard_group / (per_node * bandwidth)


def assign_jobs(
    specs: Sequence[MatrixSpec],
    sizes: Sequence[int],
    world: int,
    cost: CostModel,
    node_link: tuple[int, float] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """LPT over gangs: jobs longest first; a 1-rank job to the least loaded rank, a k-rank job to the
    aligned group of k whose busiest member is least loaded; ties by name, then lowest rank.

    node_link (`node_link_rate`): a rank's load also counts its node's rail seconds for the bytes the
    node owns, this job's included, so that no node's links set the step while ranks balance their
    Newton-Schulz seconds (at W=128 over 16 nodes, full pi0: 6.2 -> 5.9 ms predicted)."""
    loads = torch.zeros(world, dtype=torch.float64)
    per_node, rate = node_link or (world, 0.0)
    node_seconds = torch.zeros(max(1, world // per_node), dtype=torch.float64)
    members: list[tuple[int, ...]] = [()] * len(specs)
    for i in _cost_order(specs, cost):
        k = sizes[i]
        seconds = cost.split_seconds(specs[i].shape_class, 1, k)
        link = specs[i].numel * ELEMENT_BYTES * rate
        score = loads + (node_seconds + link).repeat_interleave(per_node) if rate else loads
        if k == 1:
            r = int(torch.argmin(score))  # the first minimum: lowest rank on ties
            group: tuple[int, ...] = (r,)
            loads[r] += seconds
        else:
            g = int(torch.argmin(score.view(-1, k).amax(dim=1)))
            group = tuple(range(g * k, (g + 1) * k))
            loads[g * k : (g + 1) * k] += seconds
        if rate:  # a group wider than a node shares the bytes among its nodes
            spanned = sorted({r // per_node for r in group})
            node_seconds[spanned] += link / len(spanned)
        members[i] = group
    return tuple(members)


def assign_lpt(specs: Sequence[MatrixSpec], world: int, cost: CostModel) -> tuple[int, ...]:
    """Longest processing time first; ties by name, then by lowest rank."""
    return tuple(group[0] for group in assign_jobs(specs, [1] * len(specs), world, cost))


def split_sizes(
    specs: Sequence[MatrixSpec], world: int, ranks_per_replica: int, cost: CostModel, mode: str
) -> tuple[int, ...]:
    """Ranks per matrix (1: one owner) under split `mode` (see the module docstring)."""
    if mode not in SPLIT_MODES:
        raise ValueError(f"split must be one of {SPLIT_MODES}, got {mode!r}")
    candidates = [k for k in range(2, ranks_per_replica + 1) if ranks_per_replica % k == 0]
    if mode == "off" or not candidates:
        return (1,) * len(specs)
    if mode == "always":
        return tuple(ranks_per_replica if s.numel else 1 for s in specs)
    ideal = sum(cost.matrix_seconds(s.shape_class) for s in specs) / world
    sizes = []
    for spec in specs:
        alone = cost.matrix_seconds(spec.shape_class)
        if not spec.numel or alone <= ideal:
            sizes.append(1)
            continue
        options = [(cost.split_seconds(spec.shape_class, 1, k), k) for k in candidates]
        fitting = [k for seconds, k in options if seconds <= ideal]
        k = min(fitting) if fitting else min(options)[1]
        sizes.append(k if cost.split_seconds(spec.shape_class, 1, k) < alone else 1)
    return tuple(sizes)


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


def _lpt_efficiency(
    members: Sequence[MatrixSpec], world: int, cost: CostModel, sizes: Sequence[int] | None = None
) -> float:
    sizes = sizes or [1] * len(members)
    loads = rank_loads(members, assign_jobs(members, sizes, world, cost), world, cost)
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
    sizes: Sequence[int] | None = None,
    min_slots: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Pipeline stages: consecutive runs of the matrices in decreasing cost (then name) order.

    A bucket may close once it holds `bucket_bytes` and jobs for at least `world` ranks (a split
    matrix fills `sizes[i]` of them), and does close as soon as its jobs balance to `min_efficiency`
    (or it grew `max_growth`-fold past that point). Every bucket ends in a collective all ranks join,
    so a stage's slowest rank sets its time: a stage that cannot be balanced (say 13 equal matrices
    on 8 ranks) grows until it can (16). Neighbours in cost order are mostly same-shape, so a
    bucket also batches well. `min_slots` (given by build_plan's tune_buckets) instead closes a
    bucket as soon as it holds `bucket_bytes` and `min_slots` jobs, balanced or not: a pipeline of
    small buckets that may leave ranks idle, kept only where that is predicted faster.
    """
    balance = min_slots is None
    min_slots = world if min_slots is None else min_slots
    sizes = list(sizes) if sizes is not None else [1] * len(specs)
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    slots = 0
    closable_at = 0  # the size at which the current bucket first could have closed
    checked_at = 0  # the size of the last balance check: re-check after 5% growth (large worlds)
    for i in _cost_order(specs, cost):
        current.append(i)
        size += specs[i].numel * element_size
        slots += sizes[i]
        if size < bucket_bytes or slots < min_slots or size < checked_at * 1.05:
            continue
        closable_at = closable_at or size
        checked_at = size
        if not balance:
            efficiency = 1.0
        else:
            efficiency = _lpt_efficiency(
                [specs[j] for j in current], world, cost, [sizes[j] for j in current]
            )
        if efficiency >= min_efficiency or size >= max_growth * closable_at:
            buckets.append(tuple(sorted(current)))
            current, size, slots, closable_at, checked_at = [], 0, 0, 0, 0
    if current:
        buckets.append(tuple(sorted(current)))
    return tuple(buckets)


SHARING_MODES = ("all", "auto")


def build_plan(
    specs: Sequence[MatrixSpec],
    world: int,
    *,
    strategy: str = "lpt",
    cost: CostModel | None = None,
    bucket_bytes: int = 64 << 20,
    milp_time_limit: float = 5.0,
    split: str = "off",
    ranks_per_replica: int | None = None,
    sharing: str = "all",
    tune_buckets: bool = False,
    exchange: str = "auto",
    result_bytes: int = 4,
) -> Plan:
    """The plan for `specs` on `world` ranks (pure; identical on every rank for LPT).

    Buckets run one after another (each ends in a collective every rank joins), so the step takes
    about the sum over buckets of the slowest rank's work: jobs are balanced per bucket.
    `ranks_per_replica` (default `world`) bounds split groups to one replica (see the module doc).

    sharing (HSDP, more than one replica): "all" (every bucket's work is spread over all replicas
    and its results fanned out) or "auto": which matrices every replica computes itself, in buckets
    of their own run after the shared ones, is chosen by the predicted step (dmuon.step_model, on
    the cost model's network): the candidates are the matrices cheapest per byte first, from none
    to all (sixteenths of the work, then finer around the best; the shared ones in one or two
    sets of buckets), so "auto" is never predicted slower than "all" or than every replica
    computing all.
    tune_buckets: also try 2, 3, 4, 6 and 8 equal buckets (a bucket may then leave ranks idle)
    and keep the bucketing with the fastest predicted step, `bucket_bytes` included.
    exchange / result_bytes: how dmuon.comm will send (two-level or flat, the wire's bytes per result
    element), for the predictions.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown planner strategy {strategy!r}: use one of {STRATEGIES}")
    if sharing not in SHARING_MODES:
        raise ValueError(f"sharing must be one of {SHARING_MODES}, got {sharing!r}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    per_replica = ranks_per_replica or world
    if per_replica < 1 or world % per_replica:
        raise ValueError(f"ranks_per_replica ({ranks_per_replica}) must divide the world size ({world})")
    cost = cost or CostModel()
    specs = tuple(specs)
    network = cost.network()

    def predicted(candidate: Plan) -> float:
        return step_seconds(candidate, network, exchange=exchange, result_bytes=result_bytes)["dmuon_s"]

    options = {
        "strategy": strategy,
        "cost": cost,
        "milp_time_limit": milp_time_limit,
        "split": split,
        "per_replica": per_replica,
        "judge": predicted,
    }
    plan = _plan(specs, world, bucket_bytes=bucket_bytes, local=frozenset(), **options)
    replicas = world // per_replica
    if not tune_buckets and (sharing == "all" or replicas == 1):
        return plan
    best, best_s, best_bytes = plan, predicted(plan), bucket_bytes
    if tune_buckets:
        total = sum(spec.numel for spec in specs) * 4
        for count in (2, 3, 4, 6, 8):
            size = max(1, -(-total // count))
            candidate = _plan(specs, world, bucket_bytes=size, local=frozenset(), min_slots=1, **options)
            seconds = predicted(candidate)
            if seconds < best_s:
                best, best_s, best_bytes = candidate, seconds, size
    if sharing == "auto" and replicas > 1:
        slots = 1 if best_bytes != bucket_bytes else None
        # Cheapest to compute per byte fanned out first: small matrices save the most fan-out per
        # second of Newton-Schulz a replica adds by computing them itself.
        order = sorted(
            range(len(specs)),
            key=lambda i: (cost.matrix_seconds(specs[i].shape_class) / max(1, specs[i].numel), specs[i].name),
        )
        work = [cost.matrix_seconds(specs[i].shape_class) for i in order]
        total_work = sum(work) or 1.0
        cuts, acc = [0], 0.0
        for position, seconds in enumerate(work):
            acc += seconds
            if acc / total_work >= len(cuts) / 16:
                cuts.append(position + 1)
        if cuts[-1] != len(order):
            cuts.append(len(order))
        tried: dict[int, float] = {}

        def try_cut(cut: int) -> None:
            nonlocal best, best_s
            if cut in tried:
                return
            local = frozenset(order[:cut])
            shared_bytes = sum(specs[i].numel for i in order[cut:]) * 4
            tried[cut] = float("inf")
            # The shared matrices also in 2 buckets: the first fan-outs leave sooner.
            for pieces in (None, 2):
                if pieces is not None and shared_bytes == 0:
                    continue
                candidate = _plan(
                    specs,
                    world,
                    bucket_bytes=best_bytes,
                    local=local,
                    min_slots=slots,
                    shared_bytes=None if pieces is None else max(1, -(-shared_bytes // pieces)),
                    **options,
                )
                seconds = predicted(candidate)
                tried[cut] = min(tried[cut], seconds)
                if seconds < best_s:
                    best, best_s = candidate, seconds

        for cut in cuts:  # coarse: sixteenths of the work
            try_cut(cut)
        at = min(tried, key=lambda c: (tried[c], c))
        position = cuts.index(at)
        low, high = cuts[max(0, position - 1)], cuts[min(len(cuts) - 1, position + 1)]
        for cut in range(low, high + 1, max(1, (high - low) // 16)):  # fine: around the best
            try_cut(cut)
    return best


def _plan(
    specs: tuple[MatrixSpec, ...],
    world: int,
    *,
    strategy: str,
    cost: CostModel,
    bucket_bytes: int,
    milp_time_limit: float,
    split: str,
    per_replica: int,
    local: frozenset[int],
    min_slots: int | None = None,
    shared_bytes: int | None = None,
    judge: Callable[[Plan], float] | None = None,
) -> Plan:
    """One plan: the matrices in `local` in buckets every replica computes on its own shard group
    (planned on replica 0's ranks), run after the buckets of the others, shared by all ranks
    (in buckets of `shared_bytes`, unbalanced, when given). `judge`: predicted step seconds of a
    plan, which decides whether split="auto" keeps its splits."""
    sizes = split_sizes(specs, world, per_replica, cost, split)
    shared = [i for i in range(len(specs)) if i not in local]
    groups: list[tuple[list[int], int, int, int | None]] = [
        (shared, world, shared_bytes or bucket_bytes, 1 if shared_bytes else min_slots)
    ]
    if local:
        groups.append((sorted(local), per_replica, bucket_bytes, min_slots))
    buckets: list[tuple[int, ...]] = []
    spans: list[int] = []  # ranks each bucket is planned over
    for indices, ranks, group_bytes, group_slots in groups:
        if not indices:
            continue
        sub = make_buckets(
            [specs[i] for i in indices],
            ranks,
            cost,
            bucket_bytes=group_bytes,
            sizes=[sizes[i] for i in indices],
            min_slots=group_slots,
        )
        for bucket in sub:
            buckets.append(tuple(sorted(indices[j] for j in bucket)))
            spans.append(ranks)
    members: list[tuple[int, ...]] = [()] * len(specs)
    notes: set[str] = set()
    for bucket, ranks in zip(buckets, spans):
        bucket_specs = [specs[i] for i in bucket]
        bucket_sizes = [sizes[i] for i in bucket]
        chosen = assign_jobs(bucket_specs, bucket_sizes, ranks, cost, node_link_rate(cost, per_replica))
        if strategy == "milp" and max(bucket_sizes) > 1:
            notes.add("lpt for buckets with split matrices")
        elif strategy == "milp":
            limit = max(0.05, milp_time_limit / len(buckets))
            milp_owners = assign_milp(bucket_specs, ranks, cost, time_limit=limit)
            if milp_owners is None:
                notes.add("milp found no solution or scipy is missing: lpt")
            elif max(rank_loads(bucket_specs, milp_owners, ranks, cost)) <= max(
                rank_loads(bucket_specs, chosen, ranks, cost)
            ):
                chosen = tuple((o,) for o in milp_owners)
            else:
                notes.add("lpt kept where milp was not better")
        for i, group in zip(bucket, chosen):
            members[i] = group

    def loads(bucket: tuple[int, ...], ranks: int, comm: bool = True) -> tuple[float, ...]:
        per = rank_loads([specs[i] for i in bucket], [members[i] for i in bucket], ranks, cost, comm=comm)
        return per * (world // ranks)  # a replica-local bucket: every replica carries the same load

    per_bucket = tuple(loads(bucket, ranks) for bucket, ranks in zip(buckets, spans))
    work = sum(sum(loads(bucket, ranks, comm=False)) for bucket, ranks in zip(buckets, spans))
    rank_totals = [sum(stage[r] for stage in per_bucket) for r in range(world)]
    replicas = world // per_replica
    bucket_replicas = tuple(1 if ranks < world else replicas for ranks in spans) if local else ()
    used = strategy + (f" ({'; '.join(sorted(notes))})" if notes else "")
    plan = Plan(
        world=world,
        specs=specs,
        owners=tuple(group[0] for group in members),
        buckets=tuple(buckets),
        rank_seconds=tuple(rank_totals),
        strategy=used,
        bucket_seconds=per_bucket,
        members=tuple(members),
        ranks_per_replica=per_replica,
        work_seconds=work,
        split=split,
        bucket_replicas=bucket_replicas,
    )
    if split == "auto" and max(sizes, default=1) > 1:
        # Never worse than owners only: keep the split plan only if its step is predicted faster, by
        # `judge` (dmuon.step_model: the messages priced on the network) or else by the stages alone
        # (stages add up; every bucket also pays the latency of its two all-to-alls).
        def stage_step(candidate: Plan) -> float:
            stages = candidate.bucket_seconds
            return sum(max(loads) for loads in stages) + len(stages) * 2 * cost.latency_s * (per_replica - 1)

        owners_only = _plan(
            specs,
            world,
            strategy=strategy,
            cost=cost,
            bucket_bytes=bucket_bytes,
            milp_time_limit=milp_time_limit,
            split="off",
            per_replica=per_replica,
            local=local,
            min_slots=min_slots,
            shared_bytes=shared_bytes,
        )
        predict = judge or stage_step
        if predict(owners_only) <= predict(plan):
            return replace(owners_only, split="auto (owners only: splitting was not faster)")
    return plan
