"""SYRK: x @ x.mT computing only the upper-triangle tiles, as a Triton kernel with a torch fallback.

`syrk(x)` takes a (m, n) matrix or a (b, m, n) batch and returns the symmetric (m, m) or (b, m, m)
product x x^T in x's dtype, accumulated in fp32. The Triton kernel launches one program per output
tile (i, j) with i <= j only (T (T + 1) / 2 of the T^2 tiles, about half the FLOPs of a GEMM),
stores the tile and its transpose (the mirror tile (j, i)) from the same accumulator, so the output
is exactly symmetric. Tile sizes are autotuned per (m, n); masks cover shapes that are not tile
multiples.

Backends (`syrk_backend(x)` tells which one a call takes):
- "triton": triton is installed, x is fp32 / bf16 / fp16, and x is on a CUDA device, or on the CPU
  with TRITON_INTERPRET=1 set (Triton's interpreter: how the tests run the kernel without a GPU).
- "torch": everything else (no triton, other dtypes, CPU tensors, a matrix or product with 2^31 or
  more elements): `x @ x.mT`.

triton is imported lazily on the first Triton call, so `import dmuon` never loads it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import time
from typing import Any, Literal

import torch
from torch import Tensor

Backend = Literal["triton", "torch"]
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _fits_int32_offsets(x: Tensor) -> bool:
    """Whether every element offset of one matrix of x, and of its m x m product, fits in int32
    (the kernel indexes within a matrix in int32; the batch offset is int64)."""
    m, n = x.shape[-2], x.shape[-1]
    reach = (m - 1) * abs(x.stride(-2)) + (n - 1) * abs(x.stride(-1)) if m and n else 0
    return max(reach, m * m) < 2**31


def syrk_backend(x: Tensor) -> Backend:
    """Which backend `syrk(x)` takes: "triton" (the kernel) or "torch" (x @ x.mT)."""
    if x.dtype not in SUPPORTED_DTYPES or not triton_available() or x.ndim not in (2, 3):
        return "torch"
    if not _fits_int32_offsets(x):
        return "torch"
    if x.is_cuda or (x.device.type == "cpu" and _interpret()):
        return "triton"
    return "torch"


def _check(x: Tensor) -> None:
    if x.ndim not in (2, 3):
        raise ValueError(f"syrk expects a (m, n) matrix or a (b, m, n) batch, got shape {tuple(x.shape)}")
    if x.is_complex():
        raise ValueError("syrk does not support complex tensors (x @ x.mT is not x @ x^H)")


def syrk(x: Tensor) -> Tensor:
    """x @ x.mT for a (m, n) or (b, m, n) tensor: symmetric, in x's dtype (fp32 accumulation)."""
    _check(x)
    if syrk_backend(x) == "torch":
        return x @ x.mT
    return _syrk_triton(x)


# ------------------------------------------------------------------------------------------------
# Triton kernel, built on first use. triton.jit decides at decoration time whether a kernel is
# compiled or interpreted (TRITON_INTERPRET), so one kernel is built per mode.

# (BLOCK_M, BLOCK_K, num_warps, num_stages): square BLOCK_M x BLOCK_M output tiles, BLOCK_K along n.
_GPU_CONFIGS = (
    (32, 32, 4, 4),
    (64, 32, 4, 4),
    (64, 64, 4, 3),
    (128, 32, 8, 3),
    (128, 64, 8, 3),
)
# Under the interpreter every program runs op by op in numpy, at a cost per op nearly independent
# of the tile size: large tiles keep the tests fast. Two configs, so that the autotuner's mechanics
# run too (tests also run every config above directly).
_INTERPRETER_CONFIGS = ((64, 64, 1, 1), (128, 64, 1, 1))
_MAX_GRID_Y = 65535


@functools.cache
def _build_kernel(interpret: bool) -> Any:
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bk, w, s in (_INTERPRETER_CONFIGS if interpret else _GPU_CONFIGS)
    ]

    @triton.jit
    def _syrk_kernel(
        x_ptr,
        out_ptr,
        M,
        N,
        stride_xb,
        stride_xm,
        stride_xn,
        stride_ob,
        stride_om,
        stride_on,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Program p of the T (T + 1) / 2 upper tiles, enumerated column by column:
        # p = j (j + 1) / 2 + i with 0 <= i <= j. Invert with a float sqrt, then fix off-by-one.
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        j = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
        j = tl.where((j + 1) * (j + 2) // 2 <= pid, j + 1, j)
        j = tl.where(j * (j + 1) // 2 > pid, j - 1, j)
        i = pid - j * (j + 1) // 2

        rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = j * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        x_base = x_ptr + batch * stride_xb
        a_ptrs = x_base + rows[:, None] * stride_xm + ks[None, :] * stride_xn  # x[rows, k]
        b_ptrs = x_base + cols[None, :] * stride_xm + ks[:, None] * stride_xn  # x[cols, k]^T
        row_ok = rows < M
        col_ok = cols < M

        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, N, BLOCK_K):
            k_ok = (k0 + ks) < N
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                # Exact: a product of two bf16 / fp16 numbers fits in fp32's mantissa.
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_xn
            b_ptrs += BLOCK_K * stride_xn

        out = acc.to(out_ptr.dtype.element_ty)
        o_base = out_ptr + batch * stride_ob
        # Upper part (row <= col) from the tile as computed ...
        upper = row_ok[:, None] & col_ok[None, :] & (rows[:, None] <= cols[None, :])
        tl.store(o_base + rows[:, None] * stride_om + cols[None, :] * stride_on, out, mask=upper)
        # ... and the strictly lower part from its transpose, so out[c, r] == out[r, c] bit for bit
        # (also inside diagonal tiles).
        out_t = tl.trans(out)
        lower = col_ok[:, None] & row_ok[None, :] & (cols[:, None] > rows[None, :])
        tl.store(o_base + cols[:, None] * stride_om + rows[None, :] * stride_on, out_t, mask=lower)

    # The interpreter has no GPU benchmarker: time each config once on the host instead (the
    # autotuner's choice then is arbitrary, its mechanics are what the tests exercise).
    bench = {"do_bench": _host_bench} if interpret else {}
    # Every launch overwrites the whole output, so benchmarking needs no reset or restore.
    tuned = triton.autotune(configs=configs, key=["M", "N", "IEEE", "UPCAST"], **bench)(_syrk_kernel)
    return tuned, _syrk_kernel


def _host_bench(kernel_call: Any, quantiles: Any) -> list[float]:
    start = time.perf_counter()
    kernel_call()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    return [elapsed_ms] * len(quantiles)


def _use_ieee(x: Tensor) -> bool:
    """fp32 products in full fp32 unless torch itself allows TF32 for CUDA matmuls."""
    if x.dtype != torch.float32:
        return False
    if x.is_cuda:
        return torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    return True


def _syrk_triton(x: Tensor, config: tuple[int, int] | None = None) -> Tensor:
    """The Triton path of `syrk`; `config=(BLOCK_M, BLOCK_K)` skips autotuning (tests run every
    config this way)."""
    batched = x.ndim == 3
    x3 = x if batched else x.unsqueeze(0)
    b, m, n = x3.shape
    out = torch.empty((b, m, m), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out if batched else out.squeeze(0)
    if n == 0:
        out.zero_()
        return out if batched else out.squeeze(0)
    tuned, raw = _build_kernel(_interpret() and not x.is_cuda)
    if config is None:
        kernel, meta = tuned, {}
    else:
        kernel, meta = raw, {"BLOCK_M": config[0], "BLOCK_K": config[1]}

    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        for start in range(0, b, _MAX_GRID_Y):  # grid axis 1 holds at most 65535 batch entries
            xs, outs = x3[start : start + _MAX_GRID_Y], out[start : start + _MAX_GRID_Y]

            def grid(meta: dict, chunk: int = xs.shape[0]) -> tuple[int, int]:
                tiles = -(-m // meta["BLOCK_M"])
                return (tiles * (tiles + 1) // 2, chunk)

            kernel[grid](
                xs,
                outs,
                m,
                n,
                xs.stride(0),
                xs.stride(1),
                xs.stride(2),
                outs.stride(0),
                outs.stride(1),
                outs.stride(2),
                IEEE=_use_ieee(x),
                # Triton's interpreter multiplies bf16 tiles as raw 16-bit integers (it converts
                # only fp8 before np.matmul): hand it fp32 tiles, the same fp32-accumulated result.
                UPCAST=not x.is_cuda and x.dtype != torch.float32,
                **meta,
            )
    return out if batched else out.squeeze(0)
