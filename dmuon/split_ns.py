"""Newton-Schulz on matrices split by columns over a group of k ranks (exact, not approximate).

Member j of the group holds X_j, its column chunk of X = [X_0 | ... | X_{k-1}] (m x n, m <= n after
transposing tall matrices; chunks in torch.chunk order, possibly empty). Every product of Newton-Schulz
is one of three kinds, and each has an exact split form:

  Gram of X:         X X^T = sum_j X_j X_j^T                 -> one all-reduce of m x m;
  m x m @ m x m:     row block j of P @ S is P[rows_j] @ S    -> each member computes its rows
                                                                 (rows_j: chunk_rows(m, k)), one
                                                                 all-gather gives everyone P @ S;
  m x m @ X:         (P @ X)_j = P @ X_j                      -> local to each member.

So the split iteration is the single-process iteration (standard or Gram, dmuon.newton_schulz) with
only the summation order of X X^T changed, plus, in the Gram R update, R' = R(aI+Z)(aI+Z) computed in
place of (aI+Z)R(aI+Z): the factors commute (all are polynomials in the first R), and the row form of
the former needs no second all-gather. The Frobenius normalisation comes from the first all-reduce:
||X||_F^2 = trace(X X^T).

Per member: 1/k of the FLOPs of the whole call. Communication per call (m x m each):
  standard: `steps` all-reduces + `steps` all-gathers;
  gram:     (1 + restarts) all-reduces + one all-gather per step, per R update, per restart and one
            at the end.
`split_collectives` counts them for the planner's cost model.

Shapes: X_j is (B, m, n_j): a batch of same-shape matrices split alike, one collective per product
for the whole batch.
"""

from __future__ import annotations

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


class _Rows:
    """Row blocks of m x m matrices over the group: this member's rows, and the all-gather of them."""

    def __init__(self, m: int, group: dist.ProcessGroup | None, members: int, index: int) -> None:
        self.group, self.members = group, members
        self.sizes = chunk_sizes(m, members)
        self.per = max(self.sizes) if m else 0
        self.start = sum(self.sizes[:index])
        self.stop = self.start + self.sizes[index]

    def mine(self, full: Tensor) -> Tensor:
        return full[:, self.start : self.stop]

    def gather(self, part: Tensor) -> Tensor:
        """(B, rows_j, m) on every member -> (B, m, m) on every member."""
        batch, _, width = part.shape
        send = part.new_zeros(batch, self.per, width)
        send[:, : part.shape[1]] = part
        recv = part.new_empty(self.members * batch * self.per * width)
        _all_gather(recv, send.reshape(-1), group=self.group)
        blocks = recv.view(self.members, batch, self.per, width)
        return torch.cat([blocks[r, :, : self.sizes[r]] for r in range(self.members)], dim=1)


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
    rows = _Rows(m, group, members, index)
    eye = torch.eye(m, dtype=X.dtype, device=X.device)
    A = _all_reduce(X @ X.mT, group)  # (B, m, m)
    norm = torch.diagonal(A, dim1=-2, dim2=-1).sum(-1).clamp_min(0).sqrt()  # ||X||_F per matrix
    scale = 1.0 / (norm + eps)
    X = X * scale[:, None, None]
    A = A * (scale * scale)[:, None, None]
    if algorithm == "standard":
        for step, (a, b, c) in enumerate(schedule):
            if step > 0:
                A = _all_reduce(X @ X.mT, group)
            mine = rows.mine(A)
            B = rows.gather(torch.baddbmm(mine, mine, A, beta=b, alpha=c))  # b A + c A^2
            X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)  # a X + B X
        return X
    restart_set = set(default_restarts(len(schedule)) if restarts is None else restarts) - {0}
    R = A
    Q: Tensor | None = None  # this member's rows of Q; None stands for the identity
    for step, (a, b, c) in enumerate(schedule):
        if step in restart_set:
            if Q is not None:
                X = rows.gather(Q) @ X
            R = _all_reduce(X @ X.mT, group)
            Q = None
        mine = rows.mine(R)
        Z_rows = torch.baddbmm(mine, mine, R, beta=b, alpha=c)  # rows of b R + c R^2
        Z = rows.gather(Z_rows)
        if Q is None:
            Q = Z_rows + a * eye[rows.start : rows.stop]
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a, alpha=1.0)  # rows of Q (aI + Z)
        if step < len(schedule) - 1 and (step + 1) not in restart_set:
            RZ = torch.baddbmm(mine, mine, Z, beta=a, alpha=1.0)  # rows of R (aI + Z)
            R = rows.gather(torch.baddbmm(RZ, RZ, Z, beta=a, alpha=1.0))  # rows of R (aI + Z)^2
            R = 0.5 * (R + R.mT)
    assert Q is not None
    return rows.gather(Q) @ X
