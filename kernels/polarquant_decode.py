"""PolarQuant-R unpack + decode to the model dtype, the kernel twin of `PolarQuantCodec._decode` (reference
`mmkv/codecs/polarquant.py`): the polar tree top-down, (r cos theta, r sin theta) per angle from level 4 to level 1,
then the inverse rotation s * H(.) with the fp32 butterfly, cast once. On the GPU cos/sin are libdevice's cosf/sinf
(what torch's CUDA kernels call); under the interpreter they are numpy's, which may differ from torch's CPU functions
by an ulp (docs/decisions.md, "Codec kernels").
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mmkv.kernels.common import (
    INTERPRET, LAUNCH, ROWS_WARPS, cast_to, cdiv, decode_out, jit, rows_of, store_rows, token_block, vector,
)
from mmkv.kernels.packing import unpack_plane
from mmkv.kernels.polarquant_encode import _LUT, _tables, supports  # noqa: F401  (same parameter range)
from mmkv.kernels.rotation import fwht


@triton.jit
def _unfold(r, c_ptr, in_ptr, row_base, t0, n_tok, vr, BT: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
            INTERP: tl.constexpr, V: tl.constexpr):
    # r [BT, N] radii, N angles of this level -> [BT, 2N] = interleaved (r cos theta, r sin theta)
    theta = tl.load(c_ptr + unpack_plane(in_ptr, row_base, t0, n_tok, vr, BT, N, BITS, V))
    if INTERP:
        cos = tl.cos(theta)
        sin = tl.sin(theta)
    else:
        cos = libdevice.cos(theta)
        sin = libdevice.sin(theta)
    return tl.reshape(tl.join(r * cos, r * sin), (BT, 2 * N))


@jit
def _polarquant_decode_kernel(
    a1_ptr, a2_ptr, a3_ptr, a4_ptr, radius_ptr, c_ptr, s_ptr, out_ptr,
    T, scale, rb1, rb2, rb3, rb4, vr, ORS,
    D: tl.constexpr, BT: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, B4: tl.constexpr,
    LUT: tl.constexpr, INTERP: tl.constexpr, V: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    NB: tl.constexpr = D // 16
    kb = tl.arange(0, NB)
    r = tl.load(radius_ptr + row64 * T * NB + (t0 + tt).to(tl.int64)[:, None] * NB + kb[None, :],
                mask=tmask[:, None], other=0.0).to(tl.float32)
    r = _unfold(r, c_ptr + 3 * LUT, a4_ptr, row64 * rb4, t0, n_tok, vr, BT, D // 16, B4, INTERP, V)
    r = _unfold(r, c_ptr + 2 * LUT, a3_ptr, row64 * rb3, t0, n_tok, vr, BT, D // 8, B3, INTERP, V)
    r = _unfold(r, c_ptr + LUT, a2_ptr, row64 * rb2, t0, n_tok, vr, BT, D // 4, B2, INTERP, V)
    r = _unfold(r, c_ptr, a1_ptr, row64 * rb1, t0, n_tok, vr, BT, D // 2, B1, INTERP, V)
    s = tl.load(s_ptr + jj).to(tl.float32)
    y = fwht(r, BT, D) * scale * s[None, :]
    store_rows(out_ptr, row64 * ORS, t0, n_tok, cast_to(y, out_ptr.dtype.element_ty), vr, BT, D, V)


def decode(codec, enc, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for PolarQuant on the kernel: [..., T, D] in `dtype`."""
    *lead, T, D = enc.shape
    t = enc.tensors
    dev = t["radius"].device
    tab = _tables(codec, dev)
    out, ors = decode_out(enc.shape, dtype, dev, out)
    rows = rows_of(out)
    if not rows or not T:
        return out
    planes = [t[f"angles{level}"].contiguous() for level in range(1, 5)]
    bt = 32 * ROWS_WARPS  # one token a thread
    v = min(vector(dtype), D)
    b1, b2, b3, b4 = codec.level_bits
    _polarquant_decode_kernel[(cdiv(T, bt), rows)](
        *planes, t["radius"].contiguous(), tab["cent"], tab["signs"], out,
        T, 1.0 / math.sqrt(D), *[p.shape[-1] for p in planes], v, ors,
        D=D, BT=bt, B1=b1, B2=b2, B3=b3, B4=b4, LUT=_LUT, INTERP=INTERPRET, V=v, num_warps=ROWS_WARPS, **LAUNCH,
    )
    return out
