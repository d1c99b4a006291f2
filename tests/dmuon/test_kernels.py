"""dmuon.kernels.syrk: the Triton kernel (on a GPU when there is one, else on the CPU under Triton's
interpreter), the torch fallback, the backend choice, and Gram Newton-Schulz routed through it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dmuon import kernels, newton_schulz
from dmuon.kernels import syrk, syrk_backend

CUDA = torch.cuda.is_available()
# Not multiples of any tile size (32, 64, 128): one tile, partial tiles, several tile rows.
SHAPES = [(1, 1), (7, 33), (37, 129), (64, 64), (130, 70)]


def _import_triton_for_the_interpreter() -> str | None:
    """Import triton so that its kernels can run on the CPU; None on success, else why not.

    triton.jit decides at decoration time whether a function is compiled or interpreted, and
    triton.language decorates its own helpers (tl.zeros, ...) when it is imported: TRITON_INTERPRET=1
    must be set before that import. It is set for the import only and restored right after, so the
    rest of the session's environment is untouched; the tests that run kernels set it again (fixture).
    """
    if "triton" not in sys.modules:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import triton.language
        except ImportError:
            return "triton is not installed (it is in the dev extra)"
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 3):
        return f"triton {triton.__version__} is too old: autotuning under its interpreter needs 3.3+"

    if not isinstance(tl.zeros, InterpretedFunction):
        return (
            "triton was imported before TRITON_INTERPRET=1 could be set, so its kernels cannot run on "
            "the CPU in this process; run tests/dmuon/test_kernels.py in a process of its own"
        )
    return None


# On a GPU the kernel runs compiled; triton is then imported normally, never in interpreter mode.
NO_KERNEL_REASON = (
    (None if kernels.triton_available() else "triton is not installed (it is in the dev extra)")
    if CUDA
    else _import_triton_for_the_interpreter()
)


@pytest.fixture
def device(monkeypatch) -> str:
    """Where the Triton kernel runs: "cuda", or "cpu" under TRITON_INTERPRET=1 for this test only."""
    if NO_KERNEL_REASON is not None:
        pytest.skip(NO_KERNEL_REASON)
    if CUDA:
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


@pytest.fixture
def no_interpret(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


def _reference(x: torch.Tensor) -> torch.Tensor:
    """x x^T in float64 on the CPU."""
    x64 = x.double().cpu()
    return x64 @ x64.mT


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_fp32_matches_torch_and_is_exactly_symmetric(device, shape) -> None:
    x = _randn(*shape, device=device)
    assert syrk_backend(x) == "triton"
    out = syrk(x)
    assert out.shape == (shape[0], shape[0]) and out.dtype == torch.float32 and out.device == x.device
    assert torch.equal(out, out.mT)  # bit-exact mirror, diagonal tiles included
    assert _rel(out, _reference(x)) < 1e-5
    if device == "cpu":
        assert _rel(out, x @ x.mT) < 1e-5


TILE_CONFIGS = sorted({cfg[:2] for cfg in kernels._GPU_CONFIGS + kernels._INTERPRETER_CONFIGS})


@pytest.mark.parametrize("config", TILE_CONFIGS, ids=lambda c: f"{c[0]}x{c[1]}")
def test_every_tile_config_is_correct(device, config) -> None:
    """Each autotuning candidate (BLOCK_M, BLOCK_K) on its own, since the autotuner keeps only its
    pick: 130 rows make 2 to 5 tile rows (10 upper tiles at 32), 70 columns 2 or 3 K blocks, the
    last one partial."""
    x = _randn(130, 70, seed=8, device=device)
    out = kernels._syrk_triton(x, config=config)
    assert torch.equal(out, out.mT)
    assert _rel(out, _reference(x)) < 1e-5


def test_triton_batched_3d_equals_each_matrix(device) -> None:
    x = _randn(3, 37, 50, seed=1, device=device)
    out = syrk(x)
    assert out.shape == (3, 37, 37)
    assert torch.equal(out, out.mT)
    for i in range(3):  # every matrix of the batch on its own (grid axis 1 = batch index)
        assert _rel(out[i], _reference(x[i])) < 1e-5
    assert not torch.equal(out[0], out[1])


@pytest.mark.parametrize(
    ("dtype", "shape"), [(torch.bfloat16, (130, 70)), (torch.float16, (37, 129))], ids=["bf16", "fp16"]
)
def test_triton_half_precision_accumulates_in_fp32(device, dtype, shape) -> None:
    x = _randn(*shape, seed=2, dtype=dtype, device=device)
    out = syrk(x)
    assert out.dtype == dtype and torch.equal(out, out.mT)
    # fp32 accumulation, then one conversion to the output dtype: within one ulp of the exact
    # product (bf16 2^-7, fp16 2^-10 relative; one ulp, not half, because Triton's interpreter
    # truncates fp32 -> bf16 where a GPU rounds to nearest) plus fp32 round-off, elementwise.
    # Accumulating in the half dtype instead misses this by far on the cancelling off-diagonal sums.
    ref = _reference(x)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    err = (out.double().cpu() - ref).abs()
    bound = ulp * ref.abs() + 1e-6 * ref.abs().max()
    assert bool((err <= bound).all()), float((err - bound).max())


def test_triton_batch_beyond_one_grid_is_chunked(device, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_MAX_GRID_Y", 2)  # as if 65535 were 2: chunks of 2, 2, 1
    x = _randn(5, 9, 20, seed=9, device=device)
    out = syrk(x)
    for i in range(5):
        assert _rel(out[i], _reference(x[i])) < 1e-5


def test_offsets_past_int32_fall_back_to_torch() -> None:
    assert kernels._fits_int32_offsets(torch.empty(40000, 40000, device="meta"))
    assert not kernels._fits_int32_offsets(torch.empty(50000, 1000, device="meta"))  # 50000^2 output
    assert not kernels._fits_int32_offsets(torch.empty(1000, 3_000_000, device="meta"))  # input reach


def test_triton_non_contiguous_inputs(device) -> None:
    tall = _randn(70, 37, seed=3, device=device)
    view = tall.mT  # (37, 70), the transposed view Newton-Schulz passes for tall matrices
    assert not view.is_contiguous()
    out = syrk(view)
    assert torch.equal(out, out.mT) and _rel(out, _reference(view)) < 1e-5
    batch = _randn(4, 40, 90, seed=4, device=device)[::2, :, 5:80]  # strided batch, column slice
    out = syrk(batch)
    assert out.shape == (2, 40, 40) and _rel(out, _reference(batch)) < 1e-5


def test_triton_empty_shapes(device) -> None:
    assert syrk(torch.zeros(0, 5, device=device)).shape == (0, 0)
    assert syrk(torch.zeros(0, 3, 4, device=device)).shape == (0, 3, 3)
    out = syrk(torch.zeros(4, 0, device=device))
    assert torch.equal(out, torch.zeros(4, 4, device=device))


def test_torch_fallback_on_cpu_without_interpreter(no_interpret) -> None:
    x = _randn(37, 129)
    assert syrk_backend(x) == "torch"
    assert torch.equal(syrk(x), x @ x.mT)  # the fallback is x @ x.mT itself
    b = _randn(2, 5, 9)
    assert torch.equal(syrk(b), b @ b.mT)


def test_torch_fallback_for_unsupported_dtypes_and_without_triton(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x64 = _randn(7, 33).double()
    assert syrk_backend(x64) == "torch"
    assert torch.equal(syrk(x64), x64 @ x64.mT)
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    x = _randn(7, 33)
    assert syrk_backend(x) == "torch"
    assert torch.equal(syrk(x), x @ x.mT)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4, 5)])
def test_wrong_rank_input_raises(shape) -> None:
    with pytest.raises(ValueError, match=r"\(m, n\) matrix or a \(b, m, n\) batch"):
        syrk(torch.zeros(*shape))


def test_complex_input_raises() -> None:
    with pytest.raises(ValueError, match="complex"):
        syrk(torch.zeros(3, 4, dtype=torch.complex64))


def test_gram_ns_on_cpu_never_takes_the_kernel(monkeypatch) -> None:
    """The CPU path stays torch matmuls, bit for bit, even with the interpreter switched on."""
    G = _randn(24, 80, seed=5)
    before = newton_schulz(G, algorithm="gram")

    def fail(x):
        raise AssertionError("syrk called on the CPU path")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "syrk", fail)
    assert torch.equal(newton_schulz(G, algorithm="gram"), before)
    assert torch.equal(newton_schulz(G, algorithm="gram", syrk=False), before)
    assert torch.equal(newton_schulz(G, algorithm="standard", syrk=True), newton_schulz(G))


@pytest.mark.parametrize("shape", [(20, 50), (50, 20)], ids=["wide", "tall"])
def test_gram_ns_through_the_kernel_matches_torch_gram(device, monkeypatch, shape) -> None:
    calls = []
    real = kernels.syrk
    monkeypatch.setattr(kernels, "syrk", lambda x: calls.append(tuple(x.shape)) or real(x))
    G = torch.stack([_randn(*shape, seed=6), _randn(*shape, seed=7)]).to(device)
    torch_gram = newton_schulz(G, algorithm="gram", syrk=False)
    assert calls == []
    # syrk=None takes the kernel on CUDA only; syrk=True also under the interpreter.
    kernel_gram = newton_schulz(G, algorithm="gram", syrk=True if device == "cpu" else None)
    assert _rel(kernel_gram, torch_gram) < 1e-5
    xx, rr = (2, min(shape), max(shape)), (2, min(shape), min(shape))
    # 5 steps with the restart before step 2: X X^T at the start and the restart, R R^T every step.
    assert calls == [xx, rr, rr, xx, rr, rr, rr]


def test_gram_ns_syrk_argument_errors(no_interpret) -> None:
    G = _randn(8, 24)
    with pytest.raises(ValueError, match=r"syrk=True\) needs the Triton SYRK kernel"):
        newton_schulz(G, algorithm="gram", syrk=True)
    with pytest.raises(ValueError, match="syrk must be None, True or False"):
        newton_schulz(G, algorithm="gram", syrk="yes")
