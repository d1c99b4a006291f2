"""Carry out a plan: move matrices to their owners or split groups, orthogonalise, move results back.

Sharded domain (FSDP2 / HSDP), per bucket, inside each replica (one unless HSDP):
  1. pack:     this rank's piece of every matrix its replica computes, per receiving rank: for an
               owner its rows, for a split member the part of its rows inside the member's column
               chunk of X (a tall matrix split over its own shard group moves nothing);
  2. exchange: a ragged all-to-all over the shard group (split sizes per rank, no padding), flat or
               two-level across nodes (dmuon.exchange: (N - 1) + (L - 1) messages per rank on N
               nodes of L ranks instead of W - 1);
  3. assemble: each owner / member stacks the pieces of its matrix or chunk in rank order;
  4. compute:  owners run NS with same-shape matrices batched into one (B, m, n) call; split groups
               run dmuon.split_ns on their chunks, batched per (group, shape);
  5. return:   the reverse all-to-all sends each rank its rows of every result (in the wire dtype
               when one is set: results only by default);
  6. fan-out:  HSDP only, for buckets the replicas share: over the replicate dimension, one
               broadcast per replica of the rows at this shard position of the results that
               replica computed, so every replica gets what the others computed. Exact sizes (no
               padding to the busiest replica), and a ring/tree broadcast (NCCL) relays the bytes
               instead of the source sending them to every replica itself. A bucket the plan
               marks replica-local (Plan.sharing(k) == 1) is computed by every replica on its own
               shard group instead (the plan's members are replica 0's ranks, shifted to each
               replica's) and fans nothing out; the planner picks which by predicted step.

Replicated domain (DDP), per bucket: owners orthogonalise their matrices and split members their
column chunks, then one all-gather (padded to the largest contribution in the bucket) gives every
rank every result.

Pipelining (overlap=True), sharded:

    time ->   exch(0) | exch(1)          | exch(2)          | ...
                      | ns(0) ret(0)..   | ns(1) ret(1)..   | ns(2) ...
                      |                  |  fan(0)..        |  fan(1) ...
    wait ret(*) and fan(*) at the end, then apply.

  The exchange of bucket k+1 is issued before bucket k is computed, and the return of bucket k is
  issued right after its compute, so both travel while the next bucket computes; the fan-out of
  bucket k leaves once its return has arrived. Two-level all-to-alls send their inter-node stage
  first and move to the intra-node stage after the next compute (`advance()`), so the slow stage
  is the one that overlaps. dmuon.step_model replays this order to price a plan. Every rank issues the collectives of each group in
  the same order, which is what keeps them matched; split groups lie inside one replica and run
  their matrices in plan order, and fan-outs are only waited for at the end, so no rank can wait on
  a replica that waits on it. Replicated: the all-gather of bucket k travels while k+1 computes.
  With overlap=False every collective is waited for right away (the reference schedule).

"naive" is the vanilla baseline of the DMuon paper: every rank gathers every full matrix and
orthogonalises all of them itself, one call per matrix.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.exchange import (
    EXCHANGES,
    WIRE_SCOPES,
    Exchange,
    NodeLayout,
    PendingExchange,
    node_layout,
    send_matrix,
)
from dmuon.functional import orthogonalize, orthogonalize_batch
from dmuon.layout import Domain, process_group_for
from dmuon.planner import MatrixSpec, Plan
from dmuon.split_ns import split_newton_schulz

# torch >= 2.10 names it all_gather_single; older releases only have all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _orthogonalize_owned(
    indices: Sequence[int], fulls: dict[int, Tensor], specs: Sequence[MatrixSpec]
) -> dict[int, Tensor]:
    """NS of this rank's whole matrices, batching same-class ones (one call per class)."""
    by_class: dict[tuple, list[int]] = defaultdict(list)
    for i in indices:
        by_class[specs[i].shape_class].append(i)
    out: dict[int, Tensor] = {}
    for (_, _, ns), members in by_class.items():
        for i, o in zip(members, orthogonalize([fulls[i] for i in members], ns)):
            out[i] = o
    return out


def split_group(domain: Domain, members: Sequence[int]) -> dist.ProcessGroup:
    """The process group of a split group of domain ranks (the exchange group when it is all of it)."""
    ranks = sorted(domain.ranks[w] for w in members)
    if domain.group is not None and ranks == sorted(dist.get_process_group_ranks(domain.group)):
        return domain.group
    return process_group_for(ranks)


def _orthogonalize_split(
    plan: Plan, domain: Domain, blocks: dict[int, Tensor], offset: int = 0
) -> dict[int, Tensor]:
    """Split NS of this rank's column chunks (blocks of the (m, n) view), batched per (group, class).

    Batches run in the order of their first matrix index, the same on every member, so that the
    collectives of overlapping groups can never wait on each other in a cycle. `offset`: domain
    ranks to add to the plan's members (a bucket each HSDP replica computes itself).
    """
    batches: dict[tuple, list[int]] = defaultdict(list)
    for i in sorted(blocks):
        batches[(plan.members[i], plan.specs[i].shape_class)].append(i)
    out: dict[int, Tensor] = {}
    for (members, (m, n, ns)), indices in sorted(batches.items(), key=lambda kv: kv[1][0]):
        group = split_group(domain, [w + offset for w in members])
        tall = m > n
        X = torch.stack([blocks[i].mT if tall else blocks[i] for i in indices]).to(ns.dtype)
        result = split_newton_schulz(
            X,
            ns.coefficients,
            algorithm=ns.algorithm_for((m, n)),
            group=group,
            members=len(members),
            index=dist.get_rank(group),
            m=min(m, n),
            eps=ns.eps,
        )
        for b, i in enumerate(indices):
            out[i] = (result[b].mT if tall else result[b]).to(blocks[i].dtype)
    return out


def _compute(plan: Plan, domain: Domain, blocks: dict[int, Tensor], offset: int = 0) -> dict[int, Tensor]:
    """NS of every block this rank holds: whole matrices it owns, column chunks of split ones."""
    owned = [i for i in sorted(blocks) if len(plan.members[i]) == 1]
    out = _orthogonalize_owned(owned, {i: blocks[i] for i in owned}, plan.specs)
    out.update(_orthogonalize_split(plan, domain, {i: b for i, b in blocks.items() if i not in out}, offset))
    return out


Piece = tuple[int, int, int, int, int, int]  # (source shard rank, member index, row0, row1, col0, col1)


class _ShardedBucket:
    """Bookkeeping of one bucket of a sharded exchange, from this rank's point of view.

    The routes (who sends which piece to whom) depend on the plan and the rank only: they are built
    at the first step and kept in the plan's memo.
    """

    def __init__(self, plan: Plan, k: int, domain: Domain, updates: Sequence[Tensor]) -> None:
        self.plan, self.k, self.bucket = plan, k, list(plan.buckets[k])
        self.me = domain.rank
        self.replica, self.shard = divmod(self.me, plan.ranks_per_replica)
        # A bucket every HSDP replica computes itself: the plan's members are replica 0's ranks, and
        # each replica runs the same jobs on its own ranks (`offset` domain ranks further on).
        self.local = plan.replicas > 1 and plan.sharing(k) == 1
        self.offset = self.replica * plan.ranks_per_replica if self.local else 0
        self.job_replica = 0 if self.local else self.replica
        self.me_in_plan = self.me - self.offset
        key = ("routes", k, self.me)
        if key not in plan.memo:
            plan.memo[key] = self._routes()
        self.jobs, self.sends, self.recvs, self.mine, self.first_row, self.row0 = plan.memo[key]
        first = updates[self.bucket[0]] if self.bucket else None
        self.dtype = first.dtype if first is not None else torch.float32
        self.device = first.device if first is not None else torch.device("cpu")

    def _routes(self) -> tuple:
        plan, size = self.plan, self.plan.ranks_per_replica
        # Matrices this replica computes, and what moves inside the shard group for them.
        jobs = [i for i in self.bucket if plan.replica_of(i) == self.job_replica]
        sends: list[list[tuple[int, Piece]]] = [[] for _ in range(size)]  # to shard rank t
        recvs: list[list[tuple[int, Piece]]] = [[] for _ in range(size)]  # from shard rank t
        mine: dict[int, int] = {}  # matrix -> my member index
        for i in jobs:
            members = plan.members[i]
            if self.me_in_plan in members:
                mine[i] = members.index(self.me_in_plan)
            for piece in plan.pieces(i):
                source, j = piece[0], piece[1]
                if source == self.shard:
                    sends[members[j] % size].append((i, piece))
                if members[j] == self.me_in_plan:
                    recvs[source].append((i, piece))
        first_row = {i: plan.specs[i].offsets()[self.shard] for i in jobs}  # my first row of matrix i
        row0 = {i: plan.specs[i].block(len(plan.members[i]), j)[0] for i, j in mine.items()}  # my block's
        return jobs, sends, recvs, mine, first_row, row0

    def exchanges(
        self,
        domain: Domain,
        layout: NodeLayout | None,
        inputs_wire: torch.dtype | None,
        results_wire: torch.dtype | None,
    ) -> tuple[Exchange, Exchange]:
        """The forward exchange and the return of this bucket inside my replica's shard group (built at
        the first step and kept in the plan's memo, like the routes)."""
        key = ("exchanges", self.k, self.me, layout, inputs_wire, results_wire)
        if key not in self.plan.memo:
            size = self.plan.ranks_per_replica
            matrix = send_matrix(self.plan, self.k, self.job_replica)
            ranks = domain.ranks[self.replica * size : (self.replica + 1) * size]
            forward = Exchange(matrix, self.shard, domain.group, ranks, layout, inputs_wire)
            back = Exchange(matrix.T.contiguous(), self.shard, domain.group, ranks, layout, results_wire)
            self.plan.memo[key] = (forward, back)
        return self.plan.memo[key]

    def _local(self, t: Tensor, i: int) -> Tensor:
        spec = self.plan.specs[i]
        return t.reshape(spec.rows[self.shard], spec.n)  # type: ignore[index]

    def pack(self, updates: Sequence[Tensor]) -> Tensor:
        parts = []
        for pieces in self.sends:
            for i, (_, _, lo, hi, c0, c1) in pieces:
                start = self.first_row[i]
                parts.append(self._local(updates[i], i)[lo - start : hi - start, c0:c1].reshape(-1))
        return self._cat(parts)

    def assemble(self, received: Tensor) -> dict[int, Tensor]:
        """The block (whole matrix or column chunk) of every matrix this rank computes."""
        blocks: dict[int, Tensor] = {}
        for i, j in self.mine.items():
            r0, r1, c0, c1 = self.plan.specs[i].block(len(self.plan.members[i]), j)
            blocks[i] = torch.empty(r1 - r0, c1 - c0, dtype=self.dtype, device=self.device)
        cursor = 0
        for pieces in self.recvs:
            for i, (_, _, lo, hi, c0, c1) in pieces:
                r0 = self.row0[i]
                count = (hi - lo) * (c1 - c0)
                blocks[i][lo - r0 : hi - r0] = received[cursor : cursor + count].view(hi - lo, c1 - c0)
                cursor += count
        return blocks

    def pack_results(self, results: dict[int, Tensor]) -> Tensor:
        parts = []
        for pieces in self.recvs:
            for i, (_, _, lo, hi, _, _) in pieces:
                r0 = self.row0[i]
                parts.append(results[i][lo - r0 : hi - r0].reshape(-1).to(self.dtype))
        return self._cat(parts)

    def unpack_results(self, received: Tensor, updates: Sequence[Tensor], out: list[Tensor | None]) -> None:
        """This rank's rows of every result its replica computed."""
        specs, cursor = self.plan.specs, 0
        for i in self.jobs:
            spec = specs[i]
            out[i] = torch.zeros(spec.rows[self.shard], spec.n, dtype=self.dtype, device=self.device)  # type: ignore[index]
        for pieces in self.sends:
            for i, (_, _, lo, hi, c0, c1) in pieces:
                count = (hi - lo) * (c1 - c0)
                data = received[cursor : cursor + count].view(hi - lo, c1 - c0)
                start = self.first_row[i]
                target = out[i]
                assert target is not None
                if hi - lo == target.shape[0] and c1 - c0 == target.shape[1]:
                    out[i] = data  # the whole of my rows came in one piece: no copy
                else:
                    target[lo - start : hi - start, c0:c1] = data
                cursor += count
        for i in self.jobs:
            out[i] = out[i].view(updates[i].shape)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ HSDP fan-out
    def fan_out_sizes(self) -> list[int]:
        """Elements of this shard rank's rows of the results each replica computed."""
        sizes = [0] * self.plan.replicas
        for i in self.bucket:
            spec = self.plan.specs[i]
            sizes[self.plan.replica_of(i)] += spec.rows[self.shard] * spec.n  # type: ignore[index]
        return sizes

    def pack_fan_out(self, out: list[Tensor | None], wire_dtype: torch.dtype | None = None) -> list[Tensor]:
        """One buffer per replica: this rank's rows of its own replica's results (the broadcast it
        sources), empty buffers of the right size for the others' (the broadcasts it receives);
        in `wire_dtype` when given."""
        sizes = self.fan_out_sizes()
        dtype = wire_dtype or self.dtype
        buffers = []
        for replica, size in enumerate(sizes):
            if replica == self.replica:
                parts = [out[i].reshape(-1) for i in self.jobs if out[i].numel()]  # type: ignore[union-attr]
                buffers.append(self._cat(parts).to(dtype))
            else:
                buffers.append(torch.empty(size, dtype=dtype, device=self.device))
        return buffers

    def unpack_fan_out(
        self,
        buffers: list[Tensor],
        updates: Sequence[Tensor],
        out: list[Tensor | None],
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        for replica, buffer in enumerate(buffers):
            if replica == self.replica:
                if wire_dtype is not None:  # my own results went out rounded: keep what the others got
                    cursor = 0
                    for i in self.jobs:
                        count = updates[i].numel()
                        out[i] = buffer[cursor : cursor + count].to(self.dtype).view(updates[i].shape)
                        cursor += count
                continue
            cursor = 0
            for i in self.bucket:
                if self.plan.replica_of(i) == replica:
                    count = updates[i].numel()
                    out[i] = buffer[cursor : cursor + count].to(self.dtype).view(updates[i].shape)
                    cursor += count

    def _cat(self, parts: list[Tensor]) -> Tensor:
        parts = [p for p in parts if p.numel()]
        if not parts:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat(parts).to(self.dtype)


@contextlib.contextmanager
def _exposed(stats: dict[str, float] | None, *, blocking: bool) -> Iterator[None]:
    """Count the seconds inside as exposed communication (when `blocking`: the caller waits them out)."""
    start = time.perf_counter()
    yield
    if stats is not None and blocking:
        stats["comm_wait_s"] = stats.get("comm_wait_s", 0.0) + time.perf_counter() - start


def _wait(work: dist.Work | None, stats: dict[str, float] | None) -> None:
    """Wait for an async collective, counting the blocked seconds as exposed communication."""
    if work is not None:
        with _exposed(stats, blocking=True):
            work.wait()


def sharded_orthogonalize(
    plan: Plan,
    domain: Domain,
    updates: Sequence[Tensor],
    *,
    overlap: bool = True,
    stats: dict[str, float] | None = None,
    ranks_per_node: int | None = None,
    exchange: str = "auto",
    wire_dtype: torch.dtype | None = None,
    wire_scope: str = "results",
) -> list[Tensor]:
    """Orthogonalised local rows for every spec of a sharded domain (see the module docstring).

    updates[i]: this rank's rows of spec i's update (shape = local param shape, possibly 0 rows).
    ranks_per_node / exchange: the all-to-alls run two-level (dmuon.exchange) when the shard group
    spans several nodes ("auto") or always ("two_level": an error where it is not a node grid);
    "flat" keeps one all_to_all_single. wire_dtype: the dtype results travel in (the return and the
    HSDP fan-out; with wire_scope="all" the forward exchange too); opt-in, inexact.
    """
    out: list[Tensor | None] = [None] * len(plan.specs)
    buckets = [_ShardedBucket(plan, k, domain, updates) for k in range(len(plan.buckets))]
    if not buckets:
        return []
    fan_out = plan.replicas > 1
    layout = shard_layout(plan, domain, ranks_per_node, exchange)
    if wire_scope not in WIRE_SCOPES:
        raise ValueError(f"wire_scope must be one of {WIRE_SCOPES}, got {wire_scope!r}")
    inputs_wire = wire_dtype if wire_scope == "all" else None
    forward = [b.exchanges(domain, layout, inputs_wire, wire_dtype) for b in buckets]
    exchanges: list[PendingExchange | None] = [None] * len(buckets)
    returns: list[tuple[_ShardedBucket, PendingExchange]] = []
    fans: list[tuple[_ShardedBucket, list[Tensor], list[dist.Work | None]]] = []

    def issue_exchange(k: int) -> None:
        with _exposed(stats, blocking=not overlap):
            exchanges[k] = forward[k][0].start(buckets[k].pack(updates), async_op=overlap)

    def finish_return(b: _ShardedBucket, back: PendingExchange) -> None:
        with _exposed(stats, blocking=True):
            received = back.wait()
        b.unpack_results(received, updates, out)
        if fan_out and not b.local:
            buffers = b.pack_fan_out(out, wire_dtype)
            works = []
            with _exposed(stats, blocking=not overlap):
                for replica, buffer in enumerate(buffers):  # the same order on every rank
                    if buffer.numel():
                        source = domain.ranks[replica * domain.replica_size + b.shard]
                        works.append(
                            dist.broadcast(buffer, src=source, group=domain.replicate_group, async_op=overlap)
                        )
            fans.append((b, buffers, works))

    issue_exchange(0)
    for k, b in enumerate(buckets):
        if overlap and k + 1 < len(buckets):
            issue_exchange(k + 1)  # in flight while bucket k computes
        pending = exchanges[k]
        assert pending is not None
        with _exposed(stats, blocking=True):
            received = pending.wait()
        exchanges[k] = None
        results = _compute(plan, domain, b.assemble(received), b.offset)
        with _exposed(stats, blocking=not overlap):
            back = forward[k][1].start(b.pack_results(results), async_op=overlap)
        if not overlap and k + 1 < len(buckets):
            issue_exchange(k + 1)
        if returns:
            returns[-1][1].advance()  # two-level: bucket k-1's return moves to its intra-node stage
        if returns and fan_out:
            finish_return(*returns.pop())  # bucket k-1: its fan-out travels while k+1 computes
        returns.append((b, back))
        if overlap and k + 1 < len(buckets):
            nxt = exchanges[k + 1]
            assert nxt is not None
            nxt.advance()  # its inter-node stage travelled while bucket k computed
    for b, back in returns:
        finish_return(b, back)
    for b, buffers, works in fans:
        for fan_work in works:
            _wait(fan_work, stats)
        b.unpack_fan_out(buffers, updates, out, wire_dtype)
    return out  # type: ignore[return-value]


def shard_layout(plan: Plan, domain: Domain, ranks_per_node: int | None, exchange: str) -> NodeLayout | None:
    """The node grid the all-to-alls of `domain`'s shard groups run on (None: flat)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if exchange == "flat":
        return None
    size = plan.ranks_per_replica
    replica = domain.rank // size
    ranks = domain.ranks[replica * size : (replica + 1) * size]
    layout = node_layout(ranks, ranks_per_node)
    if exchange == "two_level" and layout is None:
        raise ValueError(
            f"exchange='two_level' needs ranks_per_node and a shard group laid out node by node "
            f"(ranks {list(ranks)}, ranks_per_node {ranks_per_node}); use exchange='auto' or 'flat'"
        )
    return layout if layout is not None and layout.two_level else None


def replicated_orthogonalize(
    plan: Plan,
    domain: Domain,
    updates: Sequence[Tensor],
    *,
    overlap: bool = True,
    stats: dict[str, float] | None = None,
) -> list[Tensor]:
    """Whole orthogonalised matrices for every spec of a replicated domain.

    updates[i]: the whole update of spec i, identical on every rank (DDP all-reduced gradients).
    """
    rank, group, world = domain.rank, domain.group, plan.world
    specs, members = plan.specs, plan.members
    out: list[Tensor | None] = [None] * len(specs)
    pending: list[tuple[list[int], Tensor, int, dist.Work | None]] = []

    def block(i: int, r: int) -> tuple[int, int, int, int]:
        return specs[i].block(len(members[i]), members[i].index(r))

    for bucket in plan.buckets:
        bucket = list(bucket)
        blocks = {}
        for i in bucket:
            if rank in members[i]:
                r0, r1, c0, c1 = block(i, rank)
                blocks[i] = updates[i].reshape(specs[i].m, specs[i].n)[r0:r1, c0:c1]
        results = _compute(plan, domain, blocks)
        dtype, device = updates[bucket[0]].dtype, updates[bucket[0]].device
        sizes = [0] * world
        for i in bucket:
            for r in members[i]:
                r0, r1, c0, c1 = block(i, r)
                sizes[r] += (r1 - r0) * (c1 - c0)
        width = max(sizes)
        send = torch.zeros(width, dtype=dtype, device=device)
        parts = [results[i].reshape(-1).to(dtype) for i in bucket if i in results and results[i].numel()]
        if parts:
            send[: sizes[rank]] = torch.cat(parts)
        gathered = torch.empty(world * width, dtype=dtype, device=device)
        with _exposed(stats, blocking=not overlap):
            work = _all_gather(gathered, send, group=group, async_op=overlap)
        pending.append((bucket, gathered, width, work))
    for bucket, gathered, width, work in pending:
        _wait(work, stats)
        cursors = [r * width for r in range(world)]
        for i in bucket:
            spec = specs[i]
            if len(members[i]) == 1:
                r = members[i][0]
                out[i] = gathered[cursors[r] : cursors[r] + spec.numel].view(updates[i].shape)
                cursors[r] += spec.numel
                continue
            whole = torch.empty(spec.m, spec.n, dtype=gathered.dtype, device=gathered.device)
            for r in members[i]:
                r0, r1, c0, c1 = block(i, r)
                count = (r1 - r0) * (c1 - c0)
                whole[r0:r1, c0:c1] = gathered[cursors[r] : cursors[r] + count].view(r1 - r0, c1 - c0)
                cursors[r] += count
            out[i] = whole.view(updates[i].shape)
    return out  # type: ignore[return-value]


def local_orthogonalize(
    specs: Sequence[MatrixSpec], updates: Sequence[Tensor], *, batched: bool = True
) -> list[Tensor]:
    """Single process: whole matrices here; batch same-class ones unless `batched=False`."""
    out: list[Tensor | None] = [None] * len(specs)
    if batched:
        fulls = {i: updates[i].reshape(s.m, s.n) for i, s in enumerate(specs)}
        for i, o in _orthogonalize_owned(range(len(specs)), fulls, specs).items():
            out[i] = o.view(updates[i].shape)
    else:
        for i, s in enumerate(specs):
            out[i] = orthogonalize_batch(updates[i].reshape(1, s.m, s.n), s.ns)[0].view(updates[i].shape)
    return out  # type: ignore[return-value]


def naive_orthogonalize(
    specs: Sequence[MatrixSpec],
    domain: Domain,
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    stats: dict[str, float] | None = None,
) -> list[Tensor]:
    """The vanilla baseline: every rank rebuilds every whole matrix and orthogonalises all of them,
    one call per matrix; sharded params all-gather their update first and keep their own rows."""
    if domain.kind != "sharded":
        return local_orthogonalize(specs, updates, batched=False)
    from torch.distributed.tensor import DTensor

    out: list[Tensor] = []
    for spec, p, u in zip(specs, params, updates):
        with _exposed(stats, blocking=True):
            local = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            full = local.full_tensor()
            wait = getattr(full, "wait", None)  # functional collectives return lazily-waited tensors
            if wait is not None:
                full = wait()
        o = orthogonalize_batch(full.reshape(1, spec.m, spec.n), spec.ns)[0]
        shard = domain.rank % domain.replica_size
        start = spec.offsets()[shard]
        rows = spec.rows[shard]
        out.append(o[start : start + rows].reshape(u.shape))
    return out
