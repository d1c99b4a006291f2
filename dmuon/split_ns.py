"""Newton-Schulz on matrices split by columns over a group of k ranks (exact, not approximate).

Member j of the group holds X_j, its column chunk of X = [X_0 | ... | X_{k-1}] (m x n, m <= n after
transposing tall matrices; chunks in torch.chunk order, possibly empty). Every product of Newton-Schulz
is one of three kinds, and each has an exact split form:

  Gram of X:         X X^T = sum_j X_j X_j^T                 -> one all-reduce of m x m;
  m x m @ m x m:     row block b of P @ S is P[rows_b] @ S    -> each member computes its row
                                                                 blocks, one all-gather gives
                                                                 everyone P @ S;
  m x m @ X:         (P @ X)_j = P @ X_j                      -> local to each member.

Every m x m matrix the iteration forms is symmetric (X X^T, and polynomials in it: A^2, Z, Q, the
R update), so only upper triangles are computed and moved: the all-reduce carries the packed upper
triangle, and for products m is cut into 2k row blocks of which member j computes blocks j and
2k-1-j, only right of the diagonal (zig-zag: every member's share of the triangle is about equal);
the all-gather moves those pieces and every member mirrors the rest from them (inside the 2k
diagonal blocks both halves are computed, and kept as computed). About half the bytes, and half the
FLOPs of the products whose inputs are whole.

So the split iteration is the single-process iteration (standard or Gram, dmuon.newton_schulz) with
only the summation order of X X^T changed, plus, in the Gram R update, R' = R(aI+Z)(aI+Z) computed in
place of (aI+Z)R(aI+Z): the factors commute (all are polynomials in the first R), and the row form of
the former needs no second all-gather. The Frobenius normalisation comes from the first all-reduce:
||X||_F^2 = trace(X X^T).

Per member: at most 1/k of the FLOPs of the whole call. Communication per call (an upper triangle
of m x m each):
  standard: `steps` all-reduces + `steps` all-gathers;
  gram:     (1 + restarts) all-reduces + one all-gather per step, per R update, per restart and one
            at the end.
`split_collectives` counts them for the planner's cost model.

Shapes: X_j is (B, m, n_j): a batch of same-shape matrices split alike, one collective per product
for the whole batch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.newton_schulz import Coefficients, default_restarts

# torch >= 2.10 names it all_gather_single; older releases only have all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def chunk_sizes(length: int, parts: int) -> tuple[int, ...]:
    """torch.chunk sizes: ceil(length / parts) each, the tail short or empty."""
    per = math.ceil(length / parts) if length else 0
    return tuple(max(0, min(per, length - r * per)) for r in range(parts))


def split_collectives(algorithm: str, steps: int, restarts: Sequence[int] | None = None) -> tuple[int, int]:
    """(all-reduces, all-gathers) of m x m matrices in one split Newton-Schulz call."""
    if algorithm == "standard":
        return steps, steps
    restart_set = set(default_restarts(steps) if restarts is None else restarts) - {0}
    reduces = 1 + len([k for k in restart_set if k < steps])
    gathers = 1  # Q at the end
    q_is_identity = True
    for k in range(steps):
        if k in restart_set:
            gathers += 0 if q_is_identity else 1  # Q before X = Q X
            q_is_identity = True
        gathers += 1  # Z
        q_is_identity = False
        if k < steps - 1 and (k + 1) not in restart_set:
            gathers += 1  # R'
    return reduces, gathers


@functools.lru_cache(maxsize=4096)
def split_message_elements(m: int, members: int) -> tuple[int, int]:
    """Elements of one split all-reduce and of one split all-gather's whole result, for an m x m
    symmetric matrix over `members` ranks (upper pieces of the 2k zig-zag row blocks; the gather pads
    every member to the largest share)."""
    sizes = chunk_sizes(m, 2 * members)
    starts = [0, *itertools.accumulate(sizes)][:-1]
    piece = [size * (m - start) for size, start in zip(sizes, starts)]
    largest = max((piece[j] + piece[2 * members - 1 - j] for j in range(members)), default=0)
    return sum(piece), members * largest


class _Triangle:
    """Zig-zag row blocks of symmetric m x m matrices over the group, and the all-gather of their upper
    triangles. Member j holds row blocks j and 2k-1-j of m cut into 2k in torch.chunk order."""

    def __init__(self, m: int, group: dist.ProcessGroup | None, members: int, index: int) -> None:
        self.m, self.group, self.members = m, group, members
        sizes = chunk_sizes(m, 2 * members)
        starts = [0, *itertools.accumulate(sizes)][:-1]
        self.all_blocks = [(starts[b], starts[b] + sizes[b]) for b in range(2 * members) if sizes[b]]

        def blocks_of(j: int) -> list[tuple[int, int]]:
            return [(starts[b], starts[b] + sizes[b]) for b in (j, 2 * members - 1 - j) if sizes[b]]

        self.blocks_by_member = [blocks_of(j) for j in range(members)]
        self.blocks = self.blocks_by_member[index]  # [(row0, row1)], ascending
        self.per = max(self._count(bs) for bs in self.blocks_by_member) if m else 0

    def _count(self, blocks: list[tuple[int, int]]) -> int:
        return sum((r1 - r0) * (self.m - r0) for r0, r1 in blocks)

    def rows(self, full: Tensor) -> list[Tensor]:
        """This member's row blocks of `full` (B, m, m): [(B, h_b, m)]."""
        return [full[:, r0:r1] for r0, r1 in self.blocks]

    def right(self, rows: list[Tensor]) -> list[Tensor]:
        """The part of each row block on and right of the diagonal: [(B, h_b, m - row0_b)]."""
        return [r[:, :, r0:] for r, (r0, _) in zip(rows, self.blocks)]

    def product(
        self, rows: list[Tensor], full: Tensor, beta: float, alpha: float, add: list[Tensor]
    ) -> list[Tensor]:
        """beta add_b + alpha rows_b @ full[:, :, row0_b:], the upper pieces of a symmetric product."""
        return [
            torch.baddbmm(a, r, full[:, :, r0:], beta=beta, alpha=alpha)
            for r, a, (r0, _) in zip(rows, add, self.blocks)
        ]

    def _unpack(self, flat: Tensor, blocks: list[tuple[int, int]], full: Tensor) -> None:
        """Place upper pieces (row blocks right of their first row) of `flat` (B, *) into `full`."""
        cursor = 0
        for r0, r1 in blocks:
            count = (r1 - r0) * (self.m - r0)
            full[:, r0:r1, r0:] = flat[:, cursor : cursor + count].view(-1, r1 - r0, self.m - r0)
            cursor += count

    def _mirror(self, full: Tensor) -> Tensor:
        """Fill the part below the diagonal blocks from the upper pieces (one pass over half the matrix)."""
        for r0, r1 in self.all_blocks:
            full[:, r1:, r0:r1] = full[:, r0:r1, r1:].mT
        return full

    def gather(self, pieces: list[Tensor], batch: int, like: Tensor) -> Tensor:
        """Every member's upper pieces -> the whole symmetric (B, m, m) on every member."""
        send = like.new_zeros(batch, self.per)
        if pieces:
            flat = torch.cat([p.reshape(batch, -1) for p in pieces], dim=1)
            send[:, : flat.shape[1]] = flat
        recv = like.new_empty(self.members * batch * self.per)
        _all_gather(recv, send.reshape(-1), group=self.group)
        recv = recv.view(self.members, batch, self.per)
        full = like.new_empty(batch, self.m, self.m)
        for j, blocks in enumerate(self.blocks_by_member):
            self._unpack(recv[j], blocks, full)
        return self._mirror(full)

    def all_reduce(self, full: Tensor) -> Tensor:
        """Sum a symmetric (B, m, m) over the group, moving the upper pieces of all its blocks only."""
        batch = full.shape[0]
        if not self.all_blocks:
            return full
        packed = torch.cat([full[:, r0:r1, r0:].reshape(batch, -1) for r0, r1 in self.all_blocks], dim=1)
        _all_reduce(packed, self.group)
        out = full.new_empty(full.shape)
        self._unpack(packed, self.all_blocks, out)
        return self._mirror(out)


def _all_reduce(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    dist.all_reduce(t, group=group)
    return t


def split_newton_schulz(
    X: Tensor,
    schedule: Sequence[Coefficients],
    *,
    algorithm: str,
    group: dist.ProcessGroup | None,
    members: int,
    index: int,
    m: int,
    eps: float,
    restarts: Sequence[int] | None = None,
) -> Tensor:
    """Orthogonalise the column-split batch whose chunk this member holds.

    X: (B, m, n_j) this member's columns (m <= n of the whole matrix), in the NS dtype.
    Returns (B, m, n_j): this member's columns of newton_schulz(whole X). Every member of `group`
    (group rank `index` of `members`) must call this with the same B, m, schedule and algorithm.
    """
    if algorithm not in ("standard", "gram"):
        raise ValueError(f"split Newton-Schulz needs 'standard' or 'gram', got {algorithm!r}")
    tri = _Triangle(m, group, members, index)
    batch = X.shape[0]
    eye_rows = tri.rows(torch.eye(m, dtype=X.dtype, device=X.device).expand(batch, m, m))
    A = tri.all_reduce(X @ X.mT)  # (B, m, m)
    norm = torch.diagonal(A, dim1=-2, dim2=-1).sum(-1).clamp_min(0).sqrt()  # ||X||_F per matrix
    scale = 1.0 / (norm + eps)
    X = X * scale[:, None, None]
    A = A * (scale * scale)[:, None, None]
    if algorithm == "standard":
        for step, (a, b, c) in enumerate(schedule):
            if step > 0:
                A = tri.all_reduce(X @ X.mT)
            rows = tri.rows(A)
            B = tri.gather(tri.product(rows, A, b, c, tri.right(rows)), batch, X)  # b A + c A^2
            X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)  # a X + B X
        return X
    restart_set = set(default_restarts(len(schedule)) if restarts is None else restarts) - {0}
    R = A
    Q: list[Tensor] | None = None  # this member's whole row blocks of Q; None stands for the identity
    for step, (a, b, c) in enumerate(schedule):
        if step in restart_set:
            if Q is not None:
                X = tri.gather(tri.right(Q), batch, X) @ X
            R = tri.all_reduce(X @ X.mT)
            Q = None
        rows = tri.rows(R)
        Z = tri.gather(tri.product(rows, R, b, c, tri.right(rows)), batch, X)  # b R + c R^2
        if Q is None:
            Q = [z + a * e for z, e in zip(tri.rows(Z), eye_rows)]
        else:
            Q = [torch.baddbmm(q, q, Z, beta=a, alpha=1.0) for q in Q]  # rows of Q (aI + Z)
        if step < len(schedule) - 1 and (step + 1) not in restart_set:
            RZ = [torch.baddbmm(r, r, Z, beta=a, alpha=1.0) for r in rows]  # rows of R (aI + Z)
            R = tri.gather(tri.product(RZ, Z, a, 1.0, tri.right(RZ)), batch, X)  # R (aI + Z)^2
    assert Q is not None
    return tri.gather(tri.right(Q), batch, X) @ X
