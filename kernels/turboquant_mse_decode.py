"""TurboQuant-MSE unpack + decode to the model dtype, the kernel twin of `TurboQuantMSECodec._decode` (Algorithm 1
step 7; reference `mmkv/codecs/turboquant_mse.py`): x_hat = s * H(norm * c[idx]) with the fp32 butterfly, the
reference's operations in its order, cast once to the output dtype.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from mmkv.kernels.common import (
    LAUNCH, ROWS_WARPS, cast_to, cdiv, decode_out, head_count, jit, rows_of, store_rows, token_block, vector,
)
from mmkv.kernels.packing import unpack_block, unpack_rows
from mmkv.kernels.rotation import fwht
from mmkv.kernels.turboquant_mse_encode import _tables, supports  # noqa: F401  (same parameter range)


@jit
def _turboquant_decode_kernel(
    idx_ptr, idx_hi_ptr, norm_ptr, lo_c_ptr, hi_c_ptr, s_ptr, out_ptr,
    T, NH, scale, lo_row_bytes, hi_row_bytes, vr, ORS,
    D: tl.constexpr, BT: tl.constexpr, V: tl.constexpr, B: tl.constexpr, HI: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    if HI == 0:
        val = tl.load(lo_c_ptr + unpack_rows(idx_ptr, row64 * T * (D * B // 8), t0, n_tok, vr, BT, D, B, V))
    else:
        val = tl.zeros((BT, D), tl.float32)
        if HI < D:
            lo = unpack_block(idx_ptr, row64 * lo_row_bytes, t0, n_tok, BT, D, D - HI, B, HI, 0, D - HI)
            val = tl.load(lo_c_ptr + lo)
        hi = unpack_block(idx_hi_ptr, row64 * hi_row_bytes, t0, n_tok, BT, D, HI, B + 1, 0, 0, HI)
        val = tl.where((jj < HI)[None, :], tl.load(hi_c_ptr + hi), val)
    norm = tl.load(norm_ptr + row64 * T + t0 + tt, mask=tt < n_tok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (row % NH) * D + jj).to(tl.float32)
    y = fwht(norm[:, None] * val, BT, D) * scale * s[None, :]
    store_rows(out_ptr, row64 * ORS, t0, n_tok, cast_to(y, out_ptr.dtype.element_ty), vr, BT, D, V)


def decode(
    codec, enc, dtype: torch.dtype, *, warps: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for TurboQuant-MSE on the kernel: [..., T, D] in `dtype`."""
    *lead, T, D = enc.shape
    t = enc.tensors
    norm = t["norm"].contiguous()
    dev = norm.device
    tab = _tables(codec, dev)
    out, ors = decode_out(enc.shape, dtype, dev, out)
    rows = rows_of(out)
    if not rows or not T:
        return out
    hi = codec.hi
    idx = t["idx"].contiguous() if hi < D else None
    idx_hi = t["idx_hi"].contiguous() if hi else None
    warps = warps or ROWS_WARPS
    bt = 32 * warps  # one token a thread
    v = min(vector(dtype), D)
    _turboquant_decode_kernel[(cdiv(T, bt), rows)](
        idx if idx is not None else idx_hi, idx_hi if idx_hi is not None else idx, norm,
        tab["lo_c"], tab["hi_c"], tab["signs"], out,
        T, head_count(codec), 1.0 / math.sqrt(D),
        idx.shape[-1] if idx is not None else 0, idx_hi.shape[-1] if idx_hi is not None else 0, v, ors,
        D=D, BT=bt, V=v, B=codec.b, HI=hi, num_warps=warps, **LAUNCH,
    )
    return out
