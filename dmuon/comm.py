"""Carry out a plan: move matrices to their owners, orthogonalise, move results back.

Sharded domain (FSDP2 / HSDP shard dimension), per bucket:
  1. pack:     this rank's rows of every bucket matrix, grouped by owner rank;
  2. exchange: one ragged all_to_all_single (split sizes per rank, no padding to the world size);
  3. assemble: the owner stacks the row blocks of each of its matrices in rank order;
  4. compute:  owner runs NS, same-shape matrices batched into one (B, m, n) call;
  5. return:   the reverse ragged all_to_all_single sends each rank its rows of every result.

Replicated domain (DDP), per bucket: owners orthogonalise their matrices, then one all-gather
(padded to the largest owner's bytes in the bucket) gives every rank every result.

Pipelining (overlap=True), sharded:

    time ->   exch(0) | exch(1)          | exch(2)          | ...
                      | ns(0) ret(0)..   | ns(1) ret(1)..   | ns(2) ...
    wait ret(*) at the end, then apply.

  The exchange of bucket k+1 is issued before bucket k is computed, and the return of bucket k is
  issued right after its compute, so both travel while the next bucket computes. Every rank issues
  the collectives in the same order (exch k+1, then ret k), which is what keeps them matched.
  Replicated: the all-gather of bucket k travels while bucket k+1 computes.
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

from dmuon.functional import orthogonalize, orthogonalize_batch
from dmuon.layout import Domain
from dmuon.planner import MatrixSpec, Plan


def _owned_in(bucket: Sequence[int], owners: Sequence[int], rank: int) -> list[int]:
    return [i for i in bucket if owners[i] == rank]


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


class _ShardedBucket:
    """Bookkeeping of one bucket of a sharded exchange, from this rank's point of view."""

    def __init__(self, plan: Plan, bucket: Sequence[int], rank: int, updates: Sequence[Tensor]) -> None:
        self.plan, self.bucket, self.rank = plan, list(bucket), rank
        specs, owners, world = plan.specs, plan.owners, plan.world
        self.by_owner = [[i for i in self.bucket if owners[i] == r] for r in range(world)]
        self.mine = self.by_owner[rank]
        # Forward: what I send to owner r (my rows of r's matrices), what I get from rank s.
        self.send_splits = [
            sum(specs[i].rows[rank] * specs[i].n for i in self.by_owner[r]) for r in range(world)
        ]
        self.recv_splits = [sum(specs[i].rows[s] * specs[i].n for i in self.mine) for s in range(world)]
        self.dtype = updates[self.bucket[0]].dtype if self.bucket else torch.float32
        self.device = updates[self.bucket[0]].device if self.bucket else torch.device("cpu")

    def pack(self, updates: Sequence[Tensor]) -> Tensor:
        parts = [updates[i].reshape(-1) for r in range(self.plan.world) for i in self.by_owner[r]]
        parts = [p for p in parts if p.numel()]
        if not parts:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat(parts).to(self.dtype)

    def assemble(self, received: Tensor) -> dict[int, Tensor]:
        specs = self.plan.specs
        fulls = {
            i: torch.empty(specs[i].m, specs[i].n, dtype=self.dtype, device=self.device) for i in self.mine
        }
        cursor = 0
        for s in range(self.plan.world):
            for i in self.mine:
                rows, n = specs[i].rows[s], specs[i].n
                if rows:
                    start = specs[i].offsets()[s]
                    fulls[i][start : start + rows] = received[cursor : cursor + rows * n].view(rows, n)
                    cursor += rows * n
        return fulls

    def pack_results(self, results: dict[int, Tensor]) -> Tensor:
        specs = self.plan.specs
        parts = []
        for s in range(self.plan.world):
            for i in self.mine:
                rows = specs[i].rows[s]
                if rows:
                    start = specs[i].offsets()[s]
                    parts.append(results[i][start : start + rows].reshape(-1).to(self.dtype))
        if not parts:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat(parts)

    def unpack_results(self, received: Tensor, updates: Sequence[Tensor], out: list[Tensor | None]) -> None:
        specs, cursor = self.plan.specs, 0
        for r in range(self.plan.world):
            for i in self.by_owner[r]:
                count = specs[i].rows[self.rank] * specs[i].n
                out[i] = received[cursor : cursor + count].view(updates[i].shape)
                cursor += count


# torch >= 2.10 names it all_gather_single; older releases only have all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def _all_to_all(
    send: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup, async_op: bool
) -> tuple[Tensor, dist.Work | None]:
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=async_op)
    return recv, work


def sharded_orthogonalize(
    plan: Plan,
    domain: Domain,
    updates: Sequence[Tensor],
    *,
    overlap: bool = True,
    stats: dict[str, float] | None = None,
) -> list[Tensor]:
    """Orthogonalised local rows for every spec of a sharded domain (see the module docstring).

    updates[i]: this rank's rows of spec i's update (shape = local param shape, possibly 0 rows).
    """
    rank, group = domain.rank, domain.group
    out: list[Tensor | None] = [None] * len(plan.specs)
    buckets = [_ShardedBucket(plan, b, rank, updates) for b in plan.buckets]
    if not buckets:
        return []
    exchanges: list[tuple[Tensor, dist.Work | None] | None] = [None] * len(buckets)
    returns: list[tuple[_ShardedBucket, Tensor, dist.Work | None]] = []

    def issue_exchange(k: int) -> None:
        b = buckets[k]
        with _exposed(stats, blocking=not overlap):
            exchanges[k] = _all_to_all(b.pack(updates), b.send_splits, b.recv_splits, group, overlap)

    issue_exchange(0)
    for k, b in enumerate(buckets):
        if overlap and k + 1 < len(buckets):
            issue_exchange(k + 1)  # in flight while bucket k computes
        received, work = exchanges[k]  # type: ignore[misc]
        _wait(work, stats)
        exchanges[k] = None
        results = _orthogonalize_owned(b.mine, b.assemble(received), plan.specs)
        with _exposed(stats, blocking=not overlap):
            back, back_work = _all_to_all(
                b.pack_results(results), b.recv_splits, b.send_splits, group, overlap
            )
        if not overlap and k + 1 < len(buckets):
            issue_exchange(k + 1)
        returns.append((b, back, back_work))
    for b, back, back_work in returns:
        _wait(back_work, stats)
        b.unpack_results(back, updates, out)
    return out  # type: ignore[return-value]


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
    specs, owners = plan.specs, plan.owners
    out: list[Tensor | None] = [None] * len(specs)
    pending: list[tuple[list[list[int]], Tensor, int, dist.Work | None]] = []
    for bucket in plan.buckets:
        by_owner = [_owned_in(bucket, owners, r) for r in range(world)]
        mine = by_owner[rank]
        fulls = {i: updates[i].reshape(specs[i].m, specs[i].n) for i in mine}
        results = _orthogonalize_owned(mine, fulls, specs)
        dtype, device = updates[bucket[0]].dtype, updates[bucket[0]].device
        sizes = [sum(specs[i].numel for i in by_owner[r]) for r in range(world)]
        width = max(sizes)
        send = torch.zeros(width, dtype=dtype, device=device)
        if mine:
            send[: sizes[rank]] = torch.cat([results[i].reshape(-1).to(dtype) for i in mine])
        gathered = torch.empty(world * width, dtype=dtype, device=device)
        with _exposed(stats, blocking=not overlap):
            work = _all_gather(gathered, send, group=group, async_op=overlap)
        pending.append((by_owner, gathered, width, work))
    for by_owner, gathered, width, work in pending:
        _wait(work, stats)
        for r in range(world):
            cursor = r * width
            for i in by_owner[r]:
                out[i] = gathered[cursor : cursor + specs[i].numel].view(updates[i].shape)
                cursor += specs[i].numel
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
        start = spec.offsets()[domain.rank]
        rows = spec.rows[domain.rank]
        out.append(o[start : start + rows].reshape(u.shape))
    return out
