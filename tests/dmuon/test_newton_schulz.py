"""Newton-Schulz family: singular-value bands, Gram == standard, batching, precision, FLOP model."""

from __future__ import annotations

import pytest
import torch

from dmuon import choose_algorithm, coefficient_schedule, newton_schulz, ns_flops
from dmuon.newton_schulz import _POLAR_EXPRESS_RAW, JORDAN, YOU


def _with_spectrum(m: int, n: int, singular_values: torch.Tensor, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    k = min(m, n)
    return (U[:, :k] * singular_values.to(torch.float64)) @ V[:, :k].T


def _well(m: int, n: int) -> torch.Tensor:
    return _with_spectrum(m, n, torch.linspace(1.0, 0.05, min(m, n))).float()


def _ill(m: int, n: int) -> torch.Tensor:
    return _with_spectrum(m, n, torch.logspace(0, -6, min(m, n))).float()


def _svdvals(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize(
    ("coefficients", "steps", "low", "high"),
    [
        ("jordan", 5, 0.6, 1.25),  # Keller Jordan: oscillates about 1, roughly [0.7, 1.2]
        ("polar_express", 5, 0.85, 1.13),  # 5 minimax steps for sigma in [1e-3, 1]
        ("polar_express", 8, 0.995, 1.005),  # + steady-state steps converge to 1
        ("you", 6, 0.99, 1.001),
    ],
)
def test_singular_values_land_in_the_promised_band(algorithm, coefficients, steps, low, high) -> None:
    G = _well(48, 160)
    s = _svdvals(newton_schulz(G, coefficients=coefficients, steps=steps, algorithm=algorithm))
    assert low <= float(s.min()) and float(s.max()) <= high, (float(s.min()), float(s.max()))


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96), (32, 300), (16, 128)])
@pytest.mark.parametrize("conditioning", ["well", "ill"])
@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
def test_gram_matches_standard(shape, conditioning, coefficients) -> None:
    G = (_well if conditioning == "well" else _ill)(*shape)
    standard = newton_schulz(G, coefficients=coefficients, algorithm="standard")
    gram = newton_schulz(G, coefficients=coefficients, algorithm="gram")
    assert _rel(gram, standard) < 2e-4  # contract: 1e-3; measured <= 1e-4 in fp32


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_fp32_matches_float64_reference(algorithm) -> None:
    for G in (_well(64, 200), _ill(64, 200)):
        ref = newton_schulz(G.double(), algorithm="standard", dtype=torch.float64)
        out = newton_schulz(G, algorithm=algorithm, dtype=torch.float32)
        assert out.dtype == torch.float32
        assert _rel(out, ref) < 1e-4


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_batched_equals_loop_of_singles(algorithm) -> None:
    batch = torch.stack([_well(24, 80) * (i + 1) for i in range(4)] + [_ill(24, 80)])
    together = newton_schulz(batch, algorithm=algorithm)
    for i in range(batch.shape[0]):
        alone = newton_schulz(batch[i], algorithm=algorithm)
        torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["standard", "gram", "auto"])
def test_transposed_input_gives_transposed_output(algorithm) -> None:
    G = _well(40, 130)
    torch.testing.assert_close(
        newton_schulz(G.T, algorithm=algorithm), newton_schulz(G, algorithm=algorithm).T
    )


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_zero_and_rank_deficient_inputs_stay_finite(algorithm) -> None:
    zero = newton_schulz(torch.zeros(16, 64), algorithm=algorithm)
    assert torch.equal(zero, torch.zeros(16, 64))
    rank2 = torch.randn(32, 2) @ torch.randn(2, 96)
    out = newton_schulz(rank2, algorithm=algorithm)
    assert torch.isfinite(out).all()
    s = _svdvals(out)
    assert float(s[2:].max()) < 1e-3 and float(s[:2].min()) > 0.5  # zero directions stay zero


def test_output_keeps_input_dtype_shape_and_orientation() -> None:
    G = torch.randn(3, 20, 8, dtype=torch.float64)
    out = newton_schulz(G)
    assert out.shape == G.shape and out.dtype == torch.float64
    half = newton_schulz(torch.randn(8, 12).bfloat16())
    assert half.dtype == torch.bfloat16 and half.shape == (8, 12)


def test_singular_vectors_are_the_inputs() -> None:
    G = _well(20, 50)
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    out = newton_schulz(G, coefficients="polar_express", steps=8).double()
    torch.testing.assert_close(out, U @ Vh, rtol=0, atol=5e-3)


def test_explicit_rows_equal_named_schedule() -> None:
    G = _well(16, 40)
    named = newton_schulz(G, coefficients="jordan")
    explicit = newton_schulz(G, coefficients=[JORDAN[0]])
    assert torch.equal(named, explicit)


def test_coefficient_schedules() -> None:
    assert coefficient_schedule("jordan", 3) == [JORDAN[0]] * 3
    assert coefficient_schedule("you", 8)[:6] == list(YOU) and coefficient_schedule("you", 8)[7] == YOU[-1]
    pe = coefficient_schedule("polar_express", 5, safety_factor=1.05)
    a, b, c = _POLAR_EXPRESS_RAW[0]
    assert pe[0] == pytest.approx((a / 1.05, b / 1.05**3, c / 1.05**5))
    assert pe[-1] == _POLAR_EXPRESS_RAW[-1]  # the last step carries no safety factor
    assert coefficient_schedule("polar_express", 7)[-1] == (1.875, -1.25, 0.375)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "svd"}, "unknown ns algorithm"),
        ({"coefficients": "keller"}, "unknown ns_coefficients"),
        ({"coefficients": [(1.0, 2.0)]}, "three finite numbers"),
        ({"steps": 0}, "positive int"),
        ({"dtype": torch.int32}, "floating dtype"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.randn(4, 8), **kwargs)


@pytest.mark.parametrize("shape", [(8,), (2, 3, 4, 5)])
def test_wrong_rank_input_raises(shape) -> None:
    with pytest.raises(ValueError, match=r"\(shape\[0\], -1\)"):
        newton_schulz(torch.randn(*shape))


def test_flop_model_matches_hand_counts() -> None:
    m, n = 64, 256
    assert ns_flops((m, n), "standard", 5) == 5 * (4 * m * m * n + 2 * m**3)
    # Gram, 5 steps, one restart before step 3 (the reference count): 8 m^2 n + 28 m^3.
    assert ns_flops((m, n), "gram", 5) == 8 * m * m * n + 28 * m**3
    # No restart: X X^T + Q X = 4 m^2 n; R@R 5x, Q@Z 4x (first Q is I), R update 4x -> 2*5 + 2*4 + 4*4.
    assert ns_flops((m, n), "gram", 5, restarts=()) == 4 * m * m * n + (10 + 8 + 16) * m**3
    assert ns_flops((n, m), "gram", 5) == ns_flops((m, n), "gram", 5)  # tall = its transpose
    assert ns_flops((8, 4, 3, 3), "standard", 5) == ns_flops((8, 36), "standard", 5)  # conv view
    # Symmetric (SYRK-style) products at half cost: X X^T and A @ A halve, B @ X does not.
    assert ns_flops((m, n), "standard", 1, symmetric=True) == m * m * n + 2 * m * m * n + m**3
    with pytest.raises(ValueError, match="ndim >= 2"):
        ns_flops((5,))


def test_auto_picks_gram_for_wide_matrices_only() -> None:
    assert choose_algorithm((512, 512)) == "standard"
    assert choose_algorithm((256, 1024)) == "gram"
    assert choose_algorithm((1024, 256)) == "gram"
    ratio = ns_flops((256, 1024), "gram") / ns_flops((256, 1024), "standard")
    assert 0.6 < ratio < 0.75  # reference: 0.67x at aspect ratio 4
