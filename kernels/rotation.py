"""Triton Walsh-Hadamard transforms, the kernel twin of `mmkv.codecs.rotation` (codecs.md 1.1).

`fwht` is the butterfly of `hadamard_transform` in the same order (pairs at distance 1, 2, 4, ...), so in fp32 it is
bit-identical to the reference; codec kernels call it on [BT, D] register blocks. `rows_dot` is the tensor-core form:
x @ M for a constant +-1 matrix M in bf16/fp16 with fp32 accumulation, exact products but another summation order
(an ulp or so off the butterfly), used where encode speed matters (docs/decisions.d/kernels_codec.md).

`rotate(x, signs, inverse)` is the standalone kernel: u = H(s * x) forward, x = s * H(u) inverse, one sign vector per
head on dim -3, exactly `RandomizedHadamard.forward/inverse` (signs=None: the plain normalised H, OScaR's rotation).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import CodecError
from mmkv.codecs.rotation import hadamard_matrix, is_pow2
from mmkv.kernels.common import LAUNCH, cast_to


@triton.jit
def _butterfly(y, BT: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    # One stage on [BT, D/(2H), 2, H]: (a, b) -> (a + b, a - b), as `hadamard_transform` stacks them. The pair axis is
    # reduced (a + b and a*1 + b*(-1), both exact) and broadcast back, which keeps the data in registers/shuffles.
    y4 = tl.reshape(y, (BT, D // (2 * H), 2, H))
    first = (tl.arange(0, 2) == 0)[None, None, :, None]
    plus = tl.sum(y4, axis=2)
    minus = tl.sum(tl.where(first, y4, -y4), axis=2)
    return tl.reshape(tl.where(first, plus[:, :, None, :], minus[:, :, None, :]), (BT, D))


@triton.jit
def fwht(y, BT: tl.constexpr, D: tl.constexpr):
    """Unnormalised Sylvester transform of each row of y[BT, D] (fp32), bit-identical to the reference butterfly."""
    for s in tl.static_range(16):
        if (1 << s) < D:
            y = _butterfly(y, BT, D, 1 << s)
    return y


@triton.jit
def rows_dot(x, m_ptr, K: tl.constexpr, NC: tl.constexpr, INTERP: tl.constexpr):
    """x[BT, K] @ M[K, NC] with M (row-major, x's dtype) read from m_ptr; fp32 accumulation on tensor cores."""
    m = tl.load(m_ptr + tl.arange(0, K)[:, None] * NC + tl.arange(0, NC)[None, :])
    if INTERP:
        return tl.dot(x.to(tl.float32), m.to(tl.float32))
    return tl.dot(x, m)


def hadamard_pm1(d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The unnormalised +-1 Sylvester matrix (symmetric), exact in every float dtype."""
    return torch.round(hadamard_matrix(d, torch.float64) * math.sqrt(d)).to(dtype)


@triton.jit
def _rotate_kernel(
    x_ptr, s_ptr, out_ptr, T, NH, scale,
    D: tl.constexpr, BT: tl.constexpr, SIGNS: tl.constexpr, INVERSE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    row = tl.program_id(1)
    t0 = pid_t * BT
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    mask = (t0 + tt < T)[:, None]
    off = row.to(tl.int64) * T * D + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :]
    y = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if SIGNS:
        s = tl.load(s_ptr + (row % NH) * D + jj).to(tl.float32)[None, :]
        if INVERSE:
            y = fwht(y, BT, D) * scale * s  # s * H(u)
        else:
            y = fwht(y * s, BT, D) * scale  # H(s * x)
    else:
        y = fwht(y, BT, D) * scale
    tl.store(out_ptr + off, cast_to(y, out_ptr.dtype.element_ty), mask=mask)


def rotate(x: torch.Tensor, signs: torch.Tensor | None = None, *, inverse: bool = False) -> torch.Tensor:
    """fp32 H(s * x) (or s * H(x) with inverse=True) along the last dim; signs [H, D] (+-1, one row per head on dim
    -3, or a single row for all) or None for the plain normalised H."""
    d = x.shape[-1]
    if not is_pow2(d) or d < 2:
        raise CodecError(f"Walsh-Hadamard kernel needs a power-of-two last dim >= 2, got {d}")
    if x.dim() < 2:
        raise CodecError(f"rotate expects x[..., T, D], got shape {tuple(x.shape)}")
    x = x.contiguous()
    T = x.shape[-2]
    rows = x.numel() // max(T * d, 1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out
    nh = 1
    if signs is not None:
        signs = signs.to(device=x.device).reshape(-1, d).contiguous()
        nh = signs.shape[0]
        if nh > 1 and (x.dim() < 3 or x.shape[-3] != nh):
            raise CodecError(f"{nh} sign vectors need x[..., {nh}, T, {d}], got {tuple(x.shape)}")
    bt = max(1, min(64, 4096 // d))
    grid = (triton.cdiv(T, bt), rows)
    _rotate_kernel[grid](
        x, signs if signs is not None else x, out, T, nh, 1.0 / math.sqrt(d),
        D=d, BT=bt, SIGNS=signs is not None, INVERSE=inverse, **LAUNCH,
    )
    return out
