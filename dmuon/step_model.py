"""Predicted seconds of a sharded dmuon step: the messages dmuon.comm sends, priced on a network and
replayed in dmuon.comm's issue order. A model, not a measurement; the planner uses it to choose
between plans and scripts/simulate_scaling.py prints it.

Network (per rank, alpha-beta): `alpha` seconds per message, `intra` / `inter` bytes per second per
rank and direction to a rank on the same / another node (full duplex), `gpus_per_node` ranks per node
(domain rank w on node w // gpus_per_node; 0: one node).

Transfers, one direction of one bucket (element bytes: 4, or the wire dtype's for results):
  flat       one ragged all-to-all over the shard group's P ranks: alpha (P - 1) plus, on its busiest
             rank, max(sent, received) of its intra-node bytes / intra + the same of its inter-node
             bytes / inter (the two kinds of link do not overlap within one collective); it holds
             the kinds of link it uses.
  two-level  (dmuon.exchange, a shard group of N nodes x L ranks) stage A over the N rail peers:
             alpha (N - 1) + busiest max(sent, received) / inter, on the inter-node link; stage B over
             the L node peers: alpha (L - 1) + busiest / intra, on the intra-node link.
  fan-out    (HSDP, buckets the replicas share) per shard rank s, over the R replicas, one broadcast
             per replica of the rows at s of the results it computed, relayed on a ring: alpha R +
             the busiest rank's max(sent, received) / inter; `padded` prices a plain all-gather of
             the largest replica's block instead: alpha (R - 1) + (R - 1) max / inter.
A bucket's compute is its slowest rank's plan.bucket_seconds[k] (split collectives included).

Schedule (`overlap=True`, what dmuon.comm.sharded_orthogonalize issues): a list scheduler over three
resources, the compute stream, the intra-node link and the inter-node link. Every operation is issued
in the code's order and starts once its inputs are ready and its resources are free (one operation at
a time per resource, in issue order: transfers in flight on one link add up). Packing and unpacking
run on the compute stream, so a transfer cannot start before the compute issued ahead of its pack has
finished. Per bucket k: the first stage of exchange k+1 is issued before compute k; the exchange of k
is completed (its stage B issued if still pending) and waited for; compute k; the first stage of the
return of k; stage B of the return of k-1; HSDP: the return of k-1 is waited for and its fan-out
issued; stage B of exchange k+1. At the end the remaining returns and all fan-outs are waited for.
So a fan-out leaves once compute k+1 has finished (its unpack is queued behind it on the compute
stream): buckets computed after the shared ones are what hides it.
`overlap=False` waits for every transfer at once (serial).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dmuon.exchange import NodeLayout, node_layout, send_matrix

if TYPE_CHECKING:
    from dmuon.planner import Plan

ELEMENT_BYTES = 4


@dataclass(frozen=True)
class Network:
    """alpha: seconds per message; intra / inter: bytes per second per rank and direction."""

    alpha: float
    intra: float
    inter: float
    gpus_per_node: int = 0

    def node(self, w: int) -> int:
        return w // self.gpus_per_node if self.gpus_per_node else 0

    def same_node(self, a: int, b: int) -> bool:
        return self.node(a) == self.node(b)

    def busiest_seconds(
        self, intra_bytes: list[tuple[int, int]], inter_bytes: list[tuple[int, int]]
    ) -> float:
        """The slowest rank's transfer time: max(sent, received) per link kind, the kinds added."""
        return max(
            (max(a) / self.intra + max(e) / self.inter for a, e in zip(intra_bytes, inter_bytes)),
            default=0.0,
        )


@dataclass
class Transfer:
    """One collective (or one stage of one): seconds, the resources it holds, bytes per domain rank."""

    seconds: float
    links: tuple[str, ...]
    moved: list[int] = field(default_factory=list)


def layout_of(plan: Plan, replica: int, net: Network, exchange: str) -> NodeLayout | None:
    """The node grid dmuon.comm runs replica `replica`'s all-to-alls on (domain ranks as global)."""
    if exchange == "flat":
        return None
    size = plan.ranks_per_replica
    layout = node_layout(range(replica * size, (replica + 1) * size), net.gpus_per_node or None)
    return layout if layout is not None and layout.two_level else None


def _computing_replicas(plan: Plan, k: int) -> list[int]:
    """Replicas that orthogonalise something of bucket k (a bucket every replica computes itself is
    priced on replica 0, its template: the others repeat it on their own ranks, in parallel)."""
    return sorted({plan.replica_of(i) for i in plan.buckets[k]})


def _matrix(plan: Plan, k: int, replica: int, transpose: bool) -> torch.Tensor:
    matrix = send_matrix(plan, k, replica)
    return matrix.T if transpose else matrix


def flat_transfer(plan: Plan, k: int, net: Network, *, element_bytes: int = ELEMENT_BYTES) -> Transfer:
    """One direction of bucket k's flat all-to-all in every replica at once (both directions move the
    same bytes per rank, so one price serves the exchange and the return)."""
    size, world = plan.ranks_per_replica, plan.world
    moved = [0] * world
    if size <= 1:
        return Transfer(0.0, (), moved)
    busiest = 0.0
    links: set[str] = set()
    for replica in _computing_replicas(plan, k):
        matrix = _matrix(plan, k, replica, False) * element_bytes
        base = replica * size
        nodes = torch.tensor([net.node(base + s) for s in range(size)])
        same = nodes[:, None] == nodes[None, :]
        off_diagonal = ~torch.eye(size, dtype=torch.bool)
        local = torch.where(same & off_diagonal, matrix, 0)
        remote = torch.where(~same, matrix, 0)
        seconds = (
            torch.maximum(local.sum(1), local.sum(0)).double() / net.intra
            + torch.maximum(remote.sum(1), remote.sum(0)).double() / net.inter
        )
        busiest = max(busiest, float(seconds.max()))
        links |= {"intra"} if bool(local.any()) else set()
        links |= {"inter"} if bool(remote.any()) else set()
        per_rank = (local.sum(1) + local.sum(0) + remote.sum(1) + remote.sum(0)).tolist()
        for s in range(size):
            moved[base + s] = int(per_rank[s])
    # It holds the kinds of link it uses (an HSDP shard group inside a node leaves the NIC free).
    return Transfer(net.alpha * (size - 1) + busiest, tuple(sorted(links)) or ("intra",), moved)


def two_level_transfers(
    plan: Plan, k: int, net: Network, layout: NodeLayout, *, element_bytes: int = ELEMENT_BYTES
) -> tuple[Transfer, Transfer]:
    """Stages A (rail, inter-node) and B (node, intra-node) of bucket k's two-level all-to-all."""
    size, world = plan.ranks_per_replica, plan.world
    nodes, per = layout.nodes, layout.per_node
    moved_a, moved_b = [0] * world, [0] * world
    busiest_a = busiest_b = 0.0
    for replica in _computing_replicas(plan, k):
        grid = (_matrix(plan, k, replica, False) * element_bytes).view(nodes, per, nodes, per)
        other_node = ~torch.eye(nodes, dtype=torch.bool)[:, None, :, None]  # n != n'
        cross = torch.where(other_node, grid, 0)
        sent_a = cross.sum(dim=(2, 3))  # [n, a]: everything (n, a) sends its rail peers
        recv_a = cross.sum(dim=(0, 3)).T  # [n', a]: everything (n', a) gets from its rail peers
        other_local = ~torch.eye(per, dtype=torch.bool)[None, :, None, :]  # a != b
        hop = torch.where(other_local, grid, 0)  # (n, a) -> (n', b) passes (n', a) -> (n', b)
        sent_b = hop.sum(dim=(0, 3)).T  # [n', a]
        recv_b = hop.sum(dim=(0, 1))  # [n', b]
        busiest_a = max(busiest_a, float(torch.maximum(sent_a, recv_a).max()) / net.inter)
        busiest_b = max(busiest_b, float(torch.maximum(sent_b, recv_b).max()) / net.intra)
        base = replica * size
        for s, (a_bytes, b_bytes) in enumerate(
            zip((sent_a + recv_a).reshape(-1).tolist(), (sent_b + recv_b).reshape(-1).tolist())
        ):
            moved_a[base + s] = int(a_bytes)
            moved_b[base + s] = int(b_bytes)
    return (
        Transfer(net.alpha * (nodes - 1) + busiest_a, ("inter",), moved_a),
        Transfer(net.alpha * (per - 1) + busiest_b, ("intra",), moved_b),
    )


def fan_out_transfer(
    plan: Plan, k: int, net: Network, *, padded: bool = False, element_bytes: int = ELEMENT_BYTES
) -> Transfer | None:
    """Bucket k's HSDP fan-out (None with one replica or a bucket every replica computes itself)."""
    replicas, size, world = plan.replicas, plan.ranks_per_replica, plan.world
    if replicas <= 1 or plan.sharing(k) == 1:
        return None
    contribution = [[0] * size for _ in range(replicas)]  # [replica][shard rank] bytes of results
    for i in plan.buckets[k]:
        spec, replica = plan.specs[i], plan.replica_of(i)
        for s, rows in enumerate(spec.rows or ()):
            contribution[replica][s] += rows * spec.n * element_bytes
    moved = [0] * world
    busiest = 0
    for s in range(size):
        column = [contribution[r][s] for r in range(replicas)]
        total, width = sum(column), max(column)
        for r in range(replicas):
            if padded:
                sent = received = (replicas - 1) * width
            else:  # a ring rank forwards every block but its successor's and receives all but its own
                sent, received = total - column[(r + 1) % replicas], total - column[r]
            moved[r * size + s] = sent + received
            busiest = max(busiest, sent, received)
    latency = net.alpha * (replicas - 1 if padded else replicas)  # one collective, or R broadcasts
    return Transfer(latency + busiest / net.inter, ("inter",), moved)


def bucket_transfers(
    plan: Plan,
    k: int,
    net: Network,
    *,
    exchange: str = "auto",
    input_bytes: int = ELEMENT_BYTES,
    result_bytes: int = ELEMENT_BYTES,
) -> tuple[list[Transfer], list[Transfer]]:
    """The stages of bucket k's exchange and of its return (one stage flat, two when two-level)."""
    layout = layout_of(plan, 0, net, exchange)

    def stages(element_bytes: int) -> list[Transfer]:
        if layout is None:
            return [flat_transfer(plan, k, net, element_bytes=element_bytes)]
        return list(two_level_transfers(plan, k, net, layout, element_bytes=element_bytes))

    forward = stages(input_bytes)
    # The return moves the same pieces back: one price serves both unless the wire differs.
    return forward, forward if result_bytes == input_bytes else stages(result_bytes)


class _Timeline:
    """A list scheduler: one operation at a time per resource, in issue order."""

    def __init__(self) -> None:
        self.free = {"compute": 0.0, "intra": 0.0, "inter": 0.0}
        self.end = 0.0

    def run(self, seconds: float, resources: tuple[str, ...], ready: float = 0.0) -> float:
        start = max([ready, *(self.free[r] for r in resources)])
        finish = start + seconds
        for r in resources:
            self.free[r] = finish
        self.end = max(self.end, finish)
        return finish

    def transfer(self, t: Transfer, ready: float) -> float:
        # Packing ran on the compute stream: the transfer waits for what was issued there before it.
        return self.run(t.seconds, t.links, max(ready, self.free["compute"]))

    def wait(self, done: float) -> None:
        """The compute stream waits for a transfer (a stream wait: the host does not block)."""
        self.free["compute"] = max(self.free["compute"], done)
        self.end = max(self.end, done)


def replay(
    compute: list[float],
    forward: list[list[Transfer]],
    back: list[list[Transfer]],
    fans: list[Transfer | None],
    *,
    overlap: bool = True,
) -> float:
    """Seconds of the step under dmuon.comm's schedule (see the module docstring)."""
    count = len(compute)
    if count == 0:
        return 0.0
    line = _Timeline()
    if not overlap:
        for k in range(count):
            for stage in forward[k]:
                line.wait(line.transfer(stage, 0.0))
            line.run(compute[k], ("compute",))
            for stage in back[k]:
                line.wait(line.transfer(stage, 0.0))
            if fans[k] is not None:
                line.wait(line.transfer(fans[k], 0.0))  # type: ignore[arg-type]
        return line.end
    fwd_done: list[list[float]] = [[] for _ in range(count)]
    ret_done: list[list[float]] = [[] for _ in range(count)]
    fan_done: list[float] = []

    def advance(stages: list[Transfer], done: list[float]) -> None:
        while len(done) < len(stages):
            done.append(line.transfer(stages[len(done)], done[-1] if done else 0.0))

    def finish_return(j: int) -> None:
        advance(back[j], ret_done[j])
        line.wait(ret_done[j][-1])
        if fans[j] is not None:
            fan_done.append(line.transfer(fans[j], ret_done[j][-1]))  # type: ignore[arg-type]

    fwd_done[0].append(line.transfer(forward[0][0], 0.0))
    pending: list[int] = []
    for k in range(count):
        if k + 1 < count:
            fwd_done[k + 1].append(line.transfer(forward[k + 1][0], 0.0))
        advance(forward[k], fwd_done[k])
        line.wait(fwd_done[k][-1])
        finished = line.run(compute[k], ("compute",))
        ret_done[k].append(line.transfer(back[k][0], finished))
        if pending:
            advance(back[pending[-1]], ret_done[pending[-1]])
            if any(f is not None for f in fans):
                finish_return(pending.pop())
        pending.append(k)
        if k + 1 < count:
            advance(forward[k + 1], fwd_done[k + 1])
    for j in pending:
        finish_return(j)
    for done in fan_done:
        line.wait(done)
    return line.end


def step_seconds(
    plan: Plan,
    net: Network,
    *,
    exchange: str = "auto",
    overlap: bool = True,
    input_bytes: int = ELEMENT_BYTES,
    result_bytes: int = ELEMENT_BYTES,
    padded_fan_out: bool = False,
) -> dict[str, float]:
    """The predicted step (dmuon_s) and its parts: serial sum, compute, exchange (forward stages
    summed), fan-out, the busiest rank's MiB per step (exchange, return, fan-out, split collectives)."""
    count = len(plan.buckets)
    compute = [max(loads) if loads else 0.0 for loads in plan.bucket_seconds] or [0.0] * count
    forward, back = [], []
    for k in range(count):
        f, b = bucket_transfers(
            plan, k, net, exchange=exchange, input_bytes=input_bytes, result_bytes=result_bytes
        )
        forward.append(f)
        back.append(b)
    fans = [
        fan_out_transfer(plan, k, net, padded=padded_fan_out, element_bytes=result_bytes)
        for k in range(count)
    ]
    per_rank = [0] * plan.world
    for k in range(count):
        for stage in (*forward[k], *back[k], *([fans[k]] if fans[k] is not None else [])):
            for w, nbytes in enumerate(stage.moved):
                per_rank[w] += nbytes
        for w, nbytes in enumerate(split_bytes(plan, plan.buckets[k])):
            per_rank[w] += nbytes
    fan_per_rank = [sum(f.moved[w] for f in fans if f is not None) for w in range(plan.world)]
    exchange_s = sum(t.seconds for stages in forward for t in stages)
    return_s = sum(t.seconds for stages in back for t in stages)
    fan_s = sum(f.seconds for f in fans if f is not None)
    return {
        "dmuon_s": replay(compute, forward, back, fans, overlap=overlap),
        "dmuon_serial_s": sum(compute) + exchange_s + return_s + fan_s,
        "dmuon_compute_s": sum(compute),
        "exchange_s": exchange_s,
        "return_s": return_s,
        "fan_s": fan_s,
        "fan_mb_per_rank": max(fan_per_rank, default=0) / 2**20,
        "max_mb_per_rank": max(per_rank, default=0) / 2**20,
        "two_level": float(layout_of(plan, 0, net, exchange) is not None),
    }


def split_bytes(plan: Plan, bucket: tuple[int, ...], element_bytes: int = ELEMENT_BYTES) -> list[int]:
    """Bytes sent + received per domain rank by split groups' m x m collectives (ring volumes, as in
    Plan.traffic); their time is already in plan.bucket_seconds."""
    per_rank = [0] * plan.world
    for i in bucket:
        group = plan.members[i]
        if len(group) > 1:
            volume = plan.specs[i].split_ring_bytes(len(group), element_bytes)
            for w in group:
                per_rank[w] += 2 * volume
    return per_rank
