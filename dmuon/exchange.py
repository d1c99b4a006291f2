"""Ragged all-to-alls inside a shard group: flat, or two-level across nodes; optional bf16 wire.

A bucket's exchange (and its return) inside one shard group of P ranks is a ragged all-to-all whose
sizes are fixed by the plan: `send_matrix(plan, k, replica)[s, t]` is the number of elements shard
rank s sends shard rank t. Every rank derives the same matrix, so no sizes are ever exchanged, and
`scripts/simulate_scaling.py` prices exactly these messages.

Flat: one `all_to_all_single` over the shard group: P - 1 messages per rank.

Two-level (shard group spread over N nodes of L shard ranks each, shard rank s = node * L + local,
global ranks increasing with s): messages per rank (N - 1) + (L - 1) instead of P - 1, which is
what keeps the latency of an exchange at 1024 ranks from growing with W.

    stage A (rail, inter-node): (n, a) -> (n', a)   everything (n, a) has for node n', for every b
    stage B (node, intra-node): (n', a) -> (n', b)  what arrived for (n', b), from every node n

Inter-node first: stage A, the slow part, is issued at once and travels while the previous bucket
computes; stage B (intra-node links, several times faster) follows when the result is needed, or
earlier at `advance()`. Inputs and outputs are laid out exactly as the flat all-to-all lays them out
(send buffer in destination order, received buffer in source order), so the two are interchangeable
and bit-identical.

Wire dtype (opt-in, e.g. torch.bfloat16): the buffer is cast before sending and cast back after
receiving. It halves the bytes and breaks exactness. dmuon.comm sends results (the return and the
HSDP fan-out) in it by default (wire_scope="results": each update rounds once, ~2^-9 relative) and
the momenta too only with wire_scope="all" (rounding before Newton-Schulz is amplified on the small
singular values: ~3e-2 on low-rank momenta; scripts/bench_wire.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

EXCHANGES = ("auto", "flat", "two_level")
WIRE_SCOPES = ("results", "all")  # what a wire dtype rounds: the results only, or the momenta too


@dataclass(frozen=True)
class NodeLayout:
    """A shard group of `nodes` x `per_node` ranks: shard rank s sits on node s // per_node."""

    nodes: int
    per_node: int

    @property
    def two_level(self) -> bool:
        """Two levels only pay where both have more than one rank."""
        return self.nodes > 1 and self.per_node > 1

    def messages(self) -> int:
        """Messages each rank sends per exchange (two-level when it applies, flat otherwise)."""
        if self.two_level:
            return (self.nodes - 1) + (self.per_node - 1)
        return self.nodes * self.per_node - 1


def node_layout(global_ranks: Sequence[int], ranks_per_node: int | None) -> NodeLayout | None:
    """The node grid of a shard group (its global ranks in shard order), or None when it is not one.

    Node of a global rank: rank // ranks_per_node (torchrun numbers ranks node by node). A grid needs
    every node to hold the same number of consecutive shard ranks, in increasing global rank order.
    None also when ranks_per_node is unknown.
    """
    size = len(global_ranks)
    if not ranks_per_node or ranks_per_node < 1 or size == 0:
        return None
    if list(global_ranks) != sorted(global_ranks):
        return None
    nodes = [g // ranks_per_node for g in global_ranks]
    blocks: list[int] = []
    for s, node in enumerate(nodes):
        if s == 0 or node != nodes[s - 1]:
            blocks.append(0)
        blocks[-1] += 1
    per_node = blocks[0]
    if any(b != per_node for b in blocks) or len(set(nodes)) != len(blocks):
        return None
    return NodeLayout(nodes=len(blocks), per_node=per_node)


def send_matrix(plan, k: int, replica: int) -> Tensor:
    """(P, P) int64: elements shard rank s of `replica` sends shard rank t in bucket k's exchange
    (the return sends the transpose). Memoised in the plan."""
    key = ("send_matrix", k, replica)
    if key in plan.memo:
        return plan.memo[key]
    size = plan.ranks_per_replica
    matrix = torch.zeros(size, size, dtype=torch.int64)
    for i in plan.buckets[k]:
        if plan.replica_of(i) != replica:
            continue
        members, spec = plan.members[i], plan.specs[i]
        if len(members) == 1:  # an owner gets every shard's rows: one column at once
            matrix[:, members[0] % size] += torch.tensor(spec.rows, dtype=torch.int64) * spec.n
            continue
        for s, j, lo, hi, c0, c1 in plan.pieces(i):
            matrix[s, members[j] % size] += (hi - lo) * (c1 - c0)
    plan.memo[key] = matrix
    return matrix


def _regroup(buffer: Tensor, sizes: Tensor) -> Tensor:
    """Chunks laid out row-major by `sizes` (X, Y), returned laid out column-major (y-major)."""
    flat = sizes.reshape(-1).tolist()
    offsets = [0]
    for n in flat:
        offsets.append(offsets[-1] + n)
    rows, cols = sizes.shape
    parts = [
        buffer[offsets[x * cols + y] : offsets[x * cols + y + 1]]
        for y in range(cols)
        for x in range(rows)
        if flat[x * cols + y]
    ]
    if not parts:
        return buffer[:0]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class Exchange:
    """One direction of one bucket's all-to-all, from this rank's point of view.

    matrix[s, t]: elements shard rank s sends shard rank t. group: the shard group (flat). layout:
    the node grid, or None for flat. ranks: the group's global ranks in shard order.
    """

    def __init__(
        self,
        matrix: Tensor,
        me: int,
        group: dist.ProcessGroup | None,
        ranks: Sequence[int],
        layout: NodeLayout | None,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.me, self.group, self.wire_dtype = me, group, wire_dtype
        self.send_splits = matrix[me].tolist()
        self.recv_splits = matrix[:, me].tolist()
        self.layout = layout if layout is not None and layout.two_level else None
        if self.layout is None:
            return
        nodes, per = self.layout.nodes, self.layout.per_node
        node, local = divmod(me, per)
        grid = matrix.view(nodes, per, nodes, per)  # [n, a, n', b]
        rail_ranks = [ranks[n * per + local] for n in range(nodes)]
        node_ranks = [ranks[node * per + b] for b in range(per)]
        from dmuon.layout import process_group_for

        self.rail_group = process_group_for(rail_ranks)
        self.node_group = process_group_for(node_ranks)
        # Stage A: my data for node n' (all its locals), from my rail peer on every node.
        self.a_send = grid[node, local].sum(dim=1).tolist()
        arriving = grid[:, local, node, :]  # [n, b]: from (n, local) for (node, b)
        self.a_recv = arriving.sum(dim=1).tolist()
        self.a_chunks = arriving  # stage A arrives n-major, stage B sends b-major
        # Stage B: to each node peer b, what came for it from every node; from each a, theirs for me.
        self.b_send = arriving.sum(dim=0).tolist()
        incoming = grid[:, :, node, local].T.contiguous()  # [a, n]: from (n, a), via (node, a)
        self.b_recv = incoming.sum(dim=1).tolist()
        self.b_chunks = incoming  # stage B arrives a-major; the result is in source order (n-major)

    def start(self, send: Tensor, *, async_op: bool) -> PendingExchange:
        """Issue the exchange of `send` (in destination order); wait() gives the received buffer."""
        return PendingExchange(self, send, async_op)


class PendingExchange:
    """An exchange in flight: `advance()` moves a two-level one to its second stage early."""

    def __init__(self, exchange: Exchange, send: Tensor, async_op: bool) -> None:
        self.exchange, self.async_op = exchange, async_op
        self.dtype = send.dtype
        wire = exchange.wire_dtype
        if wire is not None and wire != send.dtype:
            send = send.to(wire)
        ex = exchange
        if ex.layout is None:
            self._buffer, self._work = _all_to_all(send, ex.send_splits, ex.recv_splits, ex.group, async_op)
            self._stage = "last"
        else:
            self._buffer, self._work = _all_to_all(send, ex.a_send, ex.a_recv, ex.rail_group, async_op)
            self._stage = "A"

    def advance(self) -> None:
        """Two-level: wait for stage A and issue stage B (a no-op otherwise or when done)."""
        if self._stage != "A":
            return
        ex = self.exchange
        if self._work is not None:
            self._work.wait()
        regrouped = _regroup(self._buffer, ex.a_chunks)
        self._buffer, self._work = _all_to_all(regrouped, ex.b_send, ex.b_recv, ex.node_group, self.async_op)
        self._stage = "B"

    def wait(self) -> Tensor:
        """The received buffer in source order, in the sender's dtype."""
        self.advance()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._stage == "B":
            self._buffer = _regroup(self._buffer, self.exchange.b_chunks)
            self._stage = "last"
        return self._buffer.to(self.dtype) if self._buffer.dtype != self.dtype else self._buffer


def _all_to_all(
    send: Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> tuple[Tensor, dist.Work | None]:
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=async_op)
    return recv, work
