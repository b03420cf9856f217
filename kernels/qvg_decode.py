"""QVG decode to the model dtype in one pass, the kernel twin of `QVGCodec._decode` (the release's fused
`_nstage_accum_kernel`, `real/accumulate.py`): unpack the codes, (code - qmax) * s (or code * s + z) with the E4M3 scale
decoded by hand, add each stage's gathered bf16 centre in fp32 in stage order, cast once. The same operations in the
same order as the reference, so the output is bit-identical to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmkv.kernels.common import (
    LAUNCH, cast_to, cdiv, decode_out_rows, jit, next_power_of_2, out_row, token_block, unit_of, unit_starts,
)
from mmkv.kernels.packing import unpack_block
from mmkv.kernels.qvg_encode import block_tokens, supports  # noqa: F401  (same parameter range)


@triton.jit
def e4m3_value(b):
    """FP8 E4M3 bit patterns (int32 0..255, never NaN) -> fp32 values."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-10), e >= 1
    v = tl.where(e == 0, m * 0.001953125, (m + 8.0) * pow2)  # subnormal m 2^-9; normal (8 + m) 2^(e-10)
    return tl.where((b >> 7) == 1, -v, v)


@jit
def _decode_kernel(
    codes_ptr, scale_ptr, zero_ptr, ids_ptr, c_ptr, out_ptr, starts_ptr,
    N, K, KT, NU, P, row_bytes, N1, N2, S0, S1, S2,
    D: tl.constexpr, BT: tl.constexpr, BLK: tl.constexpr, BITS: tl.constexpr, ASYM: tl.constexpr,
    STAGES: tl.constexpr, UNITS: tl.constexpr, UP: tl.constexpr,
):
    NB: tl.constexpr = D // BLK
    _, p, t0, n_tok = token_block(N, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    tok = (t0 + tt).to(tl.int64)
    q = unpack_block(codes_ptr, p * row_bytes, t0, n_tok, BT, D, D, BITS, 0, 0, D).to(tl.float32)
    moff = p * N * NB + tok[:, None] * NB + tl.arange(0, NB)[None, :]
    s = e4m3_value(tl.load(scale_ptr + moff, mask=tmask[:, None], other=0).to(tl.int32))
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BT, NB, BLK)), (BT, D))
    if ASYM:
        z = e4m3_value(tl.load(zero_ptr + moff, mask=tmask[:, None], other=0).to(tl.int32))
        z = tl.reshape(tl.broadcast_to(z[:, :, None], (BT, NB, BLK)), (BT, D))
        acc = q * s + z
    else:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        acc = (q - QMAX) * s
    if UNITS:  # joined spans (`QVGCodec.join_units`): a token of span u reads the centres from u * K on
        cbase = unit_of(tok, starts_ptr, NU, UP).to(tl.int64) * K
    else:
        cbase = tok * 0
    for st in tl.static_range(STAGES):
        ids = tl.load(ids_ptr + (st * P + p) * N + tok, mask=tmask, other=0).to(tl.int64) + cbase
        c = tl.load(c_ptr + (st * P + p) * KT * D + ids[:, None] * D + jj[None, :], mask=tmask[:, None], other=0.0)
        acc = acc + c.to(tl.float32)
    tl.store(out_ptr + out_row(p, N1, N2, S0, S1, S2) + tok[:, None] * D + jj[None, :],
             cast_to(acc, out_ptr.dtype.element_ty),
             mask=tmask[:, None])


def decode(codec, enc, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for qvg on the kernel."""
    *lead, n, d = enc.shape
    t = enc.tensors
    dev = t["codes"].device
    kernel_dtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    if out is not None and kernel_dtype != dtype:
        return out.copy_(decode(codec, enc, dtype))
    out, rows_at = decode_out_rows(tuple(enc.shape), kernel_dtype, dev, out)  # a stack: straight into token order
    p = out.numel() // max(n * d, 1)
    if out.numel():
        stages = codec.stages
        ids = t["ids"].contiguous() if stages else t["codes"]
        cents = t["centroids"].contiguous() if stages else t["codes"]
        scales = t["scales"].contiguous().view(torch.uint8)
        zeros = t["zeros"].contiguous().view(torch.uint8) if codec.asymmetric else scales
        bt = block_tokens(d)
        units = codec.units(enc) if stages else None
        _decode_kernel[(cdiv(n, bt), p)](
            t["codes"].contiguous(), scales, zeros, ids, cents, out, unit_starts(units, dev) if units else scales,
            n, codec.centroids, codec.centroids * (len(units) if units else 1), len(units) if units else 0, p,
            t["codes"].shape[-1], *rows_at,
            D=d, BT=bt, BLK=codec.block, BITS=codec.bits, ASYM=codec.asymmetric, STAGES=stages,
            UNITS=bool(units), UP=next_power_of_2(len(units)) if units else 1,
            num_warps=4, **LAUNCH,
        )
    return out if kernel_dtype == dtype else out.to(dtype)
