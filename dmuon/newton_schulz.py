"""Newton-Schulz orthogonalisation: coefficient schedules, the standard and Gram iterations, FLOP model.

`newton_schulz(G)` approximates the polar factor U V^T of G = U S V^T with a few odd-polynomial steps
X <- a X + b (X X^T) X + c (X X^T)^2 X, after scaling G so that its spectral norm is at most 1.

Two algebraically equal forms:

- "standard" iterates on X (m x n, m <= n after transposing tall inputs): per step one m x m Gram
  product, one m x m square and one (m x m) @ (m x n) product: 4 m^2 n + 2 m^3 FLOPs.
- "gram" iterates on the m x m Gram matrix R = X X^T only and applies the accumulated polynomial
  Q to X once at the end (and at restarts). Every step costs O(m^3) instead of O(m^2 n): it wins when
  n / m (the aspect ratio) is large. Because R, Q and the step polynomial Z are all polynomials in
  the initial R, they commute, which is what lets R be updated as (aI + Z) R (aI + Z). A restart
  re-forms X = Q X and R = X X^T from scratch, bounding the drift that accumulates in R in low
  precision (Dao AI Lab's gram-newton-schulz uses one restart in the middle of five steps).

Shapes: `G` is (m, n) or batched (B, m, n); every matrix of a batch is normalised on its own.

On CUDA with triton installed, the Gram form computes its symmetric products of the form Y Y^T
(R = X X^T at the start and at restarts, R @ R = R R^T since R is kept exactly symmetric) with the
SYRK kernel of `dmuon.kernels` (upper-triangle tiles only). Everywhere else, CPU included, it uses
torch matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from dmuon import kernels

Coefficients = tuple[float, float, float]
Algorithm = Literal["standard", "gram", "auto"]

# Keller Jordan's quintic, tuned for bf16: singular values land in roughly [0.7, 1.2] after 5 steps
# (steady-state oscillation about 1, not convergence to 1).
JORDAN: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

# Polar Express (Amsel et al., arXiv 2505.16932): per-step minimax-optimal polynomials for inputs
# whose singular values lie in [1e-3, 1]; after the tabulated rows the iteration continues with the
# Newton-Schulz steady state, which converges to 1 from below.
_POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
_POLAR_EXPRESS_TAIL: Coefficients = (1.875, -1.25, 0.375)

# You Jiacheng's six-step schedule (optimised with a stability loss): lands close to 1 in 6 steps.
YOU: tuple[Coefficients, ...] = (
    (3955 / 1024, -8306 / 1024, 5008 / 1024),
    (3735 / 1024, -6681 / 1024, 3463 / 1024),
    (3799 / 1024, -6499 / 1024, 3211 / 1024),
    (4019 / 1024, -6385 / 1024, 2906 / 1024),
    (2677 / 1024, -3029 / 1024, 1162 / 1024),
    (2172 / 1024, -1833 / 1024, 682 / 1024),
)

COEFFICIENT_SCHEDULES = ("jordan", "polar_express", "you")
ALGORITHMS = ("standard", "gram", "auto")
DEFAULT_EPS = 1e-7
DEFAULT_POLAR_EXPRESS_SAFETY = 1.05


def _with_safety(row: Coefficients, factor: float) -> Coefficients:
    """Coefficients of p(x / factor): a safety margin so that round-off cannot push singular values
    past the region where the polynomial maps them back below 1."""
    a, b, c = row
    return (a / factor, b / factor**3, c / factor**5)


def coefficient_schedule(
    coefficients: str | Sequence[Sequence[float]],
    steps: int,
    *,
    safety_factor: float = DEFAULT_POLAR_EXPRESS_SAFETY,
) -> list[Coefficients]:
    """The (a, b, c) row of every step, `steps` rows in all.

    `coefficients` is a schedule name from COEFFICIENT_SCHEDULES or an explicit list of (a, b, c)
    rows; a list shorter than `steps` repeats its last row. For "polar_express" the safety factor
    applies to every step but the last (the last step may land anywhere in its target band).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients == "jordan":
            return [JORDAN[0]] * steps
        if coefficients == "you":
            return [YOU[min(k, len(YOU) - 1)] for k in range(steps)]
        if coefficients == "polar_express":
            if safety_factor < 1.0:
                raise ValueError(f"polar_express safety_factor must be >= 1, got {safety_factor}")
            raw = [
                _POLAR_EXPRESS_RAW[k] if k < len(_POLAR_EXPRESS_RAW) else _POLAR_EXPRESS_TAIL
                for k in range(steps)
            ]
            return [_with_safety(r, safety_factor) for r in raw[:-1]] + [raw[-1]]
        raise ValueError(
            f"unknown ns_coefficients {coefficients!r}: use one of {COEFFICIENT_SCHEDULES} "
            "or an explicit list of (a, b, c) rows"
        )
    rows = list(coefficients)
    if not rows:
        raise ValueError("ns_coefficients must name a schedule or hold at least one (a, b, c) row")
    parsed: list[Coefficients] = []
    for i, row in enumerate(rows):
        values = tuple(row)
        if len(values) != 3 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise ValueError(f"ns_coefficients row {i} must be three finite numbers (a, b, c), got {row!r}")
        parsed.append((float(values[0]), float(values[1]), float(values[2])))
    return [parsed[min(k, len(parsed) - 1)] for k in range(steps)]


def default_restarts(steps: int) -> tuple[int, ...]:
    """Gram restart steps: one in the middle (before step 3 of 5), none for very short schedules."""
    return (steps // 2,) if steps >= 3 else ()


def _oriented_dims(shape: Sequence[int]) -> tuple[int, int]:
    """(short, long) side of the matrix view of a parameter shape (rows = shape[0])."""
    rows = int(shape[0])
    cols = math.prod(int(d) for d in shape[1:])
    return (rows, cols) if rows <= cols else (cols, rows)


def ns_flops(
    shape: Sequence[int],
    algorithm: Literal["standard", "gram"] = "standard",
    steps: int = 5,
    *,
    restarts: Sequence[int] | None = None,
    symmetric: bool = False,
) -> int:
    """Multiply-add FLOPs (2 per MAC) of one Newton-Schulz call on a matrix of `shape`.

    `shape` is a parameter shape; ndim > 2 is viewed as (shape[0], prod(shape[1:])). With m <= n the
    short and long sides:
      standard: steps * (4 m^2 n + 2 m^3)
      gram:     (2 + 4 * restarts) m^2 n             (X X^T, Q X; each restart one more of each)
                + 2 m^3 per step for R @ R
                + 2 m^3 per step whose Q is not the identity (Q @ Z)
                + 4 m^3 per step that updates R (not the last step, not right before a restart)
    `symmetric=True` counts products whose result is symmetric (X X^T, R @ R, R @ Z, Z @ RZ) at half
    cost, as a SYRK-style kernel computes them.
    Normalisation and elementwise terms are O(mn) and left out.
    """
    if algorithm not in ("standard", "gram"):
        raise ValueError(f"ns_flops algorithm must be 'standard' or 'gram', got {algorithm!r}")
    if len(shape) < 2:
        raise ValueError(f"ns_flops needs a matrix shape (ndim >= 2), got {tuple(shape)}")
    m, n = _oriented_dims(shape)
    half = 0.5 if symmetric else 1.0
    if algorithm == "standard":
        per_step = half * 2 * m * m * n + 2 * m * m * n + half * 2 * m**3
        return int(steps * per_step)
    restart_set = set(default_restarts(steps) if restarts is None else restarts) - {0}
    flops = half * 2 * m * m * n + 2 * m * m * n  # initial R = X X^T, final Q @ X
    flops += len(restart_set) * (2 * m * m * n + half * 2 * m * m * n)
    q_is_identity = True
    for k in range(steps):
        if k in restart_set:
            q_is_identity = True
        flops += half * 2 * m**3  # R @ R
        if not q_is_identity:
            flops += 2 * m**3  # Q @ Z
        q_is_identity = False
        if k < steps - 1 and (k + 1) not in restart_set:
            flops += half * 2 * m**3 + half * 2 * m**3  # R @ Z, Z @ RZ
    return int(flops)


def choose_algorithm(shape: Sequence[int], steps: int = 5, restarts: Sequence[int] | None = None) -> str:
    """'gram' where the FLOP model says it is cheaper than 'standard' for this shape, else 'standard'."""
    gram = ns_flops(shape, "gram", steps, restarts=restarts)
    standard = ns_flops(shape, "standard", steps)
    return "gram" if gram < standard else "standard"


def _validate(G: Tensor, algorithm: str, dtype: torch.dtype) -> None:
    if G.ndim not in (2, 3):
        raise ValueError(
            f"newton_schulz expects a (m, n) matrix or a (B, m, n) batch, got shape {tuple(G.shape)}; "
            "view conv kernels and other ndim > 2 weights as (shape[0], -1) first"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown ns algorithm {algorithm!r}: use one of {ALGORITHMS}")
    if not dtype.is_floating_point:
        raise ValueError(f"newton_schulz dtype must be a floating dtype, got {dtype}")
    if G.is_complex():
        raise ValueError("newton_schulz does not support complex matrices")


def _standard(X: Tensor, schedule: Sequence[Coefficients]) -> Tensor:
    # X: (B, m, n) with m <= n, spectral norm <= 1.
    for a, b, c in schedule:
        A = X @ X.mT  # (B, m, m)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)  # a X + B X
    return X


def _use_syrk(X: Tensor, syrk_mode: bool | None) -> bool:
    """Whether Gram NS on X takes the Triton SYRK kernel (see `newton_schulz`'s `syrk`)."""
    if syrk_mode is None:
        return X.is_cuda and kernels.syrk_backend(X) == "triton"
    if syrk_mode and kernels.syrk_backend(X) != "triton":
        raise ValueError(
            f"newton_schulz(syrk=True) needs the Triton SYRK kernel: triton installed and a "
            f"float32/bfloat16/float16 CUDA tensor (or TRITON_INTERPRET=1 on the CPU); got a "
            f"{X.dtype} tensor on {X.device}; pass syrk=None to fall back to torch matmuls"
        )
    return bool(syrk_mode)


def _gram(
    X: Tensor, schedule: Sequence[Coefficients], restarts: Sequence[int], *, use_syrk: bool = False
) -> Tensor:
    # X: (B, m, n) with m <= n. Invariant: the current iterate equals Q @ X, R = (Q X)(Q X)^T.
    # With use_syrk, R = X X^T and R @ R = R R^T come from the SYRK kernel, whose output is exactly
    # symmetric; the update below symmetrises R exactly too, so R R^T is R @ R throughout.
    restart_set = set(restarts) - {0}
    steps = len(schedule)
    R = kernels.syrk(X) if use_syrk else X @ X.mT  # (B, m, m)
    Q: Tensor | None = None  # None stands for the identity: saves one m^3 product per (re)start
    for k, (a, b, c) in enumerate(schedule):
        if k in restart_set:
            if Q is not None:
                X = Q @ X
            R = kernels.syrk(X) if use_syrk else X @ X.mT
            Q = None
        if use_syrk:
            Z = kernels.syrk(R).mul_(c).add_(R, alpha=b)  # b R + c R^2
        else:
            Z = torch.baddbmm(R, R, R, beta=b, alpha=c)  # b R + c R^2
        if Q is None:
            Q = Z + a * torch.eye(Z.shape[-1], dtype=Z.dtype, device=Z.device)
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a, alpha=1.0)  # Q (aI + Z)
        if k < steps - 1 and (k + 1) not in restart_set:
            RZ = torch.baddbmm(R, R, Z, beta=a, alpha=1.0)  # R (aI + Z)
            R = torch.baddbmm(RZ, Z, RZ, beta=a, alpha=1.0)  # (aI + Z) R (aI + Z)
            # Symmetrise: R is symmetric in exact arithmetic; round-off asymmetry would grow.
            R = 0.5 * (R + R.mT)
    assert Q is not None
    return Q @ X


def newton_schulz(
    G: Tensor,
    *,
    steps: int = 5,
    coefficients: str | Sequence[Sequence[float]] = "jordan",
    algorithm: Algorithm = "standard",
    dtype: torch.dtype = torch.float32,
    restarts: Sequence[int] | None = None,
    eps: float = DEFAULT_EPS,
    safety_factor: float = DEFAULT_POLAR_EXPRESS_SAFETY,
    syrk: bool | None = None,
) -> Tensor:
    """Orthogonalise `G` ((m, n) or (B, m, n)) with `steps` Newton-Schulz steps.

    Returns a tensor of G's shape and dtype whose singular values lie in the band the schedule
    promises (Jordan about [0.7, 1.2]; Polar Express and "you" close to 1) and whose singular vectors
    are G's. Tall matrices are transposed internally so that every product runs on the short side.
    `algorithm="auto"` picks "gram" where the FLOP model says it is cheaper (aspect ratio >~ 1.5).
    `restarts` (Gram only) lists the steps before which X and R are re-formed; default: one in the
    middle. Zero and rank-deficient inputs give finite outputs (zero directions stay zero).
    `syrk` (Gram only): None takes the Triton SYRK kernel for the symmetric products on CUDA when
    triton is installed and torch matmuls elsewhere; True requires the kernel (an error where it
    cannot run); False always uses torch matmuls.
    """
    _validate(G, algorithm, dtype)
    if syrk is not None and not isinstance(syrk, bool):
        raise ValueError(f"newton_schulz syrk must be None, True or False, got {syrk!r}")
    schedule = coefficient_schedule(coefficients, steps, safety_factor=safety_factor)
    batched = G.ndim == 3
    X = G.to(dtype) if batched else G.to(dtype).unsqueeze(0)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = X.mT
    if X.shape[-2] == 0 or X.shape[-1] == 0:
        return torch.zeros_like(G)
    if algorithm == "auto":
        algorithm = choose_algorithm(X.shape[-2:], steps, restarts)
    # Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1].
    X = X / (torch.linalg.matrix_norm(X, ord="fro", keepdim=True) + eps)
    if algorithm == "gram":
        restart_steps = default_restarts(steps) if restarts is None else restarts
        X = _gram(X, schedule, restart_steps, use_syrk=_use_syrk(X, syrk))
    else:
        X = _standard(X, schedule)
    if transposed:
        X = X.mT
    if not batched:
        X = X.squeeze(0)
    return X.to(G.dtype).contiguous()
