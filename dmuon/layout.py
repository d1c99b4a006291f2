"""How a live parameter is laid out across ranks, read at step time.

Three layouts matter to Muon, which must orthogonalise whole matrices:

- "local":      a plain tensor and no process group (or `plain_tensors="local"`): the whole matrix
                is here and nobody else needs it.
- "replicated": a plain tensor under DDP (or a DTensor with Replicate() on a 1-D mesh): every rank
                holds the same whole matrix; owners share the NS work and broadcast results.
- "sharded":    a DTensor with Shard(0) over one mesh dimension (FSDP2; HSDP's shard dimension):
                rank r holds rows [offset_r, offset_r + rows_r) in torch.chunk order, possibly none.
                Under HSDP (a 2-D mesh, Replicate() on the other dimension) the domain is the whole
                (replicate x shard) mesh: the replicas hold identical rows after HSDP's gradient
                reduction, so every rank of every replica takes a share of the Newton-Schulz work
                and the results are fanned out over the replicate dimension.

Layouts are compared by value (`Domain`), never by param identity, because Accelerate and FSDP2
replace the param objects after the optimizer is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist
from torch import Tensor

LayoutKind = Literal["local", "replicated", "sharded"]


@dataclass(frozen=True)
class Domain:
    """A set of ranks that share the Muon work, and how matrices are spread over them.

    group:  the process group of the exchange: the shard group of this rank's replica (sharded),
            the DDP group (replicated), None (local).
    ranks:  global ranks of the domain in domain-rank order (the plan is keyed by domain rank):
            replica-major, so domain rank w is shard rank w % ranks_per_replica of replica
            w // ranks_per_replica. One replica unless HSDP.
    replicate_group: HSDP: this rank's group over the replicate dimension (same shard rank in every
            replica), in replica order; None with one replica.
    ranks_per_replica: ranks of one replica (the shard group's size); 0 means all of `ranks`.
    """

    kind: LayoutKind
    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    replicate_group: dist.ProcessGroup | None = None
    ranks_per_replica: int = 0

    @property
    def world(self) -> int:
        return len(self.ranks) if self.ranks else 1

    @property
    def replica_size(self) -> int:
        return self.ranks_per_replica or self.world

    @property
    def replicas(self) -> int:
        return self.world // self.replica_size

    @property
    def rank(self) -> int:
        """This process's rank inside the domain."""
        if self.group is None:
            return 0
        return self.ranks.index(dist.get_rank())

    def key(self) -> tuple:
        return (self.kind, self.ranks, self.replica_size)

    def collective_group(self) -> dist.ProcessGroup | None:
        """A group over all the domain's ranks (for plan agreement and broadcasts)."""
        if self.replicas == 1:
            return self.group
        return process_group_for(self.ranks)


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def process_group_for(ranks: tuple[int, ...] | list[int]) -> dist.ProcessGroup:
    """A process group over `ranks` (global), created once per process and cached.

    Only the members call this (use_local_synchronization): the group is named by its ranks, so
    members meet however many other groups each of them created before. Group ranks follow the
    sorted global ranks.
    """
    key = tuple(sorted(ranks))
    if key == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(list(key), use_local_synchronization=True)
        _GROUPS[key] = group
    return group


def chunk_rows(rows: int, world: int) -> tuple[int, ...]:
    """Rows per rank of Shard(0) in torch.chunk order: ceil(rows / world) each, the tail short or empty."""
    per = math.ceil(rows / world) if rows else 0
    return tuple(max(0, min(per, rows - r * per)) for r in range(world))


def _group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _describe(name: str, p: Tensor) -> str:
    placements = getattr(p, "placements", None)
    mesh = getattr(p, "device_mesh", None)
    return f"param {name!r} (shape {tuple(p.shape)}, placements {placements}, mesh {mesh})"


def detect_domain(
    p: Tensor,
    name: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    plain_tensors: Literal["replicated", "local"] = "replicated",
    replicate_across: bool = True,
) -> tuple[Domain, tuple[int, ...] | None]:
    """The exchange domain of `p` and, for sharded params, the rows each shard rank holds.

    `replicate_across=False` keeps an HSDP domain to the shard group (every replica repeats the
    Newton-Schulz work; the behaviour before replicas shared it).

    Raises ValueError for layouts Muon cannot serve exactly (Shard(1), tensor parallel, Partial),
    naming the param and what to change.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(p, DTensor):
        mesh, placements = p.device_mesh, p.placements
        shard_dims = [i for i, pl in enumerate(placements) if not isinstance(pl, Replicate)]
        if not shard_dims:
            group = mesh.get_group(0) if mesh.ndim == 1 else None
            if group is None:
                raise ValueError(f"{_describe(name, p)}: a fully replicated multi-dim mesh is not supported")
            return Domain("replicated", group, _group_ranks(group)), None
        if len(shard_dims) > 1:
            raise ValueError(
                f"{_describe(name, p)}: sharded over {len(shard_dims)} mesh dimensions (tensor parallel?). "
                "dmuon supports Shard(0) on one mesh dimension (FSDP2 / HSDP); gather TP shards first"
            )
        mesh_dim = shard_dims[0]
        placement = placements[mesh_dim]
        if not isinstance(placement, Shard) or placement.dim != 0:
            raise ValueError(
                f"{_describe(name, p)}: placement {placement} is not supported; dmuon needs Shard(0) "
                "(FSDP2's default). Use fully_shard without a custom shard_placement_fn for Muon params"
            )
        group = mesh.get_group(mesh_dim)
        world = mesh.size(mesh_dim)
        rows = chunk_rows(p.shape[0], world)
        local_rows = p.to_local().shape[0] if p.to_local().ndim else 0
        my = mesh.get_local_rank(mesh_dim)
        if local_rows != rows[my]:
            raise ValueError(
                f"{_describe(name, p)}: local shard has {local_rows} rows but Shard(0) in torch.chunk "
                f"order gives rank {my} {rows[my]}; uneven custom sharding is not supported"
            )
        if mesh.ndim == 2 and replicate_across:
            # HSDP: plan over the whole mesh, replica-major; fan results out over the other dim.
            replicate_dim = 1 - mesh_dim
            ranks = tuple(int(r) for r in mesh.mesh.permute(replicate_dim, mesh_dim).flatten().tolist())
            return (
                Domain(
                    "sharded",
                    group,
                    ranks,
                    replicate_group=mesh.get_group(replicate_dim),
                    ranks_per_replica=world,
                ),
                rows,
            )
        # FSDP2, or a mesh with several replicate dimensions: every replica repeats the shard group's work.
        return Domain("sharded", group, _group_ranks(group)), rows
    if plain_tensors == "local" or not (dist.is_available() and dist.is_initialized()):
        return Domain("local", None, ()), None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return Domain("local", None, ()), None
    return Domain("replicated", group, _group_ranks(group)), None


def local_tensor(t: Tensor) -> Tensor:
    """The tensor this rank computes on: a DTensor's local shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
