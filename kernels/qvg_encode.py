"""QVG encode: the last stage's centre subtraction fused with the block quantiser and the bit packing, the kernel twin
of `mmkv.codecs.qvg.subtract` + `quantize_residual` + `pack_bits` (the release's `minus_centroid` and
`_quant_pack_kernel` in `quant_videogen/real/`); `encode` runs the whole codec with `qvg_kmeans` for the k-means
(assignment and fp64 centre sums fused, two launches an iteration).

One program takes BT tokens x D channels of one (batch, head) problem: r = x - C[id] rounded to the residual dtype,
per block of BLK channels the absmax (or min and max), the scale divided in fp32 (`div_rn`, like torch), clamped to
[1e-10, 448] and rounded to FP8 E4M3 by hand (nearest even, subnormals included: both the interpreter's and the
hardware's conversions are avoided so the bytes equal torch's `.to(float8_e4m3fn)` everywhere), codes
round-half-away(r / s) against the rounded scale, then the project's little-endian bit stream. Every operation is the
reference's, in the same order, so codes and scales are bit-identical to it given the same ids and centres.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.kernels.common import LAUNCH, cast_to, cdiv, jit, rint, token_block
from mmkv.kernels.packing import pack_block
from mmkv.kernels.qvg_kmeans import kmeans, supports_shape


@triton.jit
def e4m3_round(v):
    """fp32 (|v| <= 448) -> (value rounded to FP8 E4M3, nearest even, as fp32; its 8-bit pattern as int32)."""
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals share 2^-6's quantum
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): 3 mantissa bits
    inv = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    r = tl.minimum(rint(a * inv) * quantum, 448.0)  # power-of-two products are exact
    rb = r.to(tl.int32, bitcast=True)
    normal = r >= 0.015625
    er = ((rb >> 23) & 0xFF) - 127
    code = tl.where(normal, ((er + 7) << 3) | ((rb >> 20) & 7), (r * 512.0).to(tl.int32))
    return tl.where(sign == 1, -r, r), code | (sign << 7)


@triton.jit
def round_half_away(y):
    a = tl.abs(y)
    t = tl.floor(a)
    q = t + (a - t >= 0.5).to(tl.float32)
    return tl.where(y < 0, -q, q)


@jit
def _quant_pack_kernel(
    r_ptr, c_ptr, ids_ptr, codes_ptr, scale_ptr, zero_ptr,
    N, K, row_bytes,
    D: tl.constexpr, BT: tl.constexpr, BLK: tl.constexpr, BITS: tl.constexpr, ASYM: tl.constexpr,
    SUBTRACT: tl.constexpr,
):
    NB: tl.constexpr = D // BLK
    _, p, t0, n_tok = token_block(N, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    tok = (t0 + tt).to(tl.int64)
    r = tl.load(r_ptr + p * N * D + tok[:, None] * D + jj[None, :], mask=tmask[:, None], other=0.0)
    if SUBTRACT:
        ids = tl.load(ids_ptr + p * N + tok, mask=tmask, other=0).to(tl.int64)
        c = tl.load(c_ptr + p * K * D + ids[:, None] * D + jj[None, :], mask=tmask[:, None], other=0.0)
        r = cast_to(r.to(tl.float32) - c.to(tl.float32), r_ptr.dtype.element_ty)  # the residual's own dtype
    x3 = tl.reshape(r.to(tl.float32), (BT, NB, BLK))
    if ASYM:
        LEVELS: tl.constexpr = (1 << BITS) - 1
        mn = tl.min(x3, axis=2)
        mx = tl.max(x3, axis=2)
        s, s_bits = e4m3_round(tl.minimum(tl.maximum(tl.math.div_rn(mx - mn, LEVELS * 1.0), 1e-10), 448.0))
        z, z_bits = e4m3_round(tl.minimum(tl.maximum(mn, -448.0), 448.0))
        s3 = tl.broadcast_to(s[:, :, None], (BT, NB, BLK))
        z3 = tl.broadcast_to(z[:, :, None], (BT, NB, BLK))
        y = tl.math.div_rn(x3 - z3, tl.where(s3 > 0, s3, 1.0))
        q = tl.minimum(tl.maximum(round_half_away(y), 0.0), LEVELS * 1.0)
        q = tl.where(s3 > 0, q, 0.0)
    else:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        absmax = tl.max(tl.abs(x3), axis=2)
        s, s_bits = e4m3_round(tl.minimum(tl.maximum(tl.math.div_rn(absmax, QMAX * 1.0), 1e-10), 448.0))
        s3 = tl.broadcast_to(s[:, :, None], (BT, NB, BLK))
        y = tl.math.div_rn(x3, tl.where(s3 > 0, s3, 1.0))
        q = tl.minimum(tl.maximum(round_half_away(y), -QMAX * 1.0), QMAX * 1.0)
        q = tl.where(s3 > 0, q, 0.0) + QMAX
    codes = tl.reshape(q.to(tl.int32), (BT, D))
    pack_block(codes, codes_ptr, p * row_bytes, t0, n_tok, BT, D, D, BITS, 0, 0, D)
    bb = tl.arange(0, NB)
    moff = p * N * NB + tok[:, None] * NB + bb[None, :]
    tl.store(scale_ptr + moff, s_bits.to(tl.uint8), mask=tmask[:, None])
    if ASYM:
        tl.store(zero_ptr + moff, z_bits.to(tl.uint8), mask=tmask[:, None])


def supports(codec) -> bool:
    d, blk = codec.head_dim, codec.block
    return (supports_shape(d, codec.centroids) and codec.bits in (2, 4) and (blk & (blk - 1)) == 0
            and blk <= d and d % blk == 0)


def block_tokens(d: int) -> int:
    return max(8, 4096 // d)


def quant_pack(codec, residual: torch.Tensor, last) -> dict[str, torch.Tensor]:
    """Codes, E4M3 scales (and zeros) of residual - C_last[id_last] (or of residual when there are no stages):
    residual [P, N, D] in the work dtype, last = (centres [P, K, D] bf16, ids [P, N] uint8 or int64) or None."""
    p, n, d = residual.shape
    dev = residual.device
    row_bytes = (n * d * codec.bits + 7) // 8
    codes = torch.empty(p, row_bytes, dtype=torch.uint8, device=dev)
    scales = torch.empty(p, n, d // codec.block, dtype=torch.float8_e4m3fn, device=dev)
    zeros = torch.empty_like(scales) if codec.asymmetric else None
    cents, ids = last if last is not None else (residual, residual)
    bt = block_tokens(d)
    if p and n:
        _quant_pack_kernel[(cdiv(n, bt), p)](
            residual.contiguous(), cents.contiguous(), ids.contiguous(), codes, scales.view(torch.uint8),
            (zeros if zeros is not None else scales).view(torch.uint8),
            n, cents.shape[1], row_bytes,
            D=d, BT=bt, BLK=codec.block, BITS=codec.bits, ASYM=codec.asymmetric, SUBTRACT=last is not None,
            num_warps=4, **LAUNCH,
        )
    out = {"codes": codes, "scales": scales}
    if zeros is not None:
        out["zeros"] = zeros
    return out


def encode(codec, x: torch.Tensor) -> Encoded:
    """`codec.encode(x)` for qvg on the kernels: the k-means kernels, then the fused subtract + quantise + pack of the
    last stage."""
    return codec.encode_with(x, lambda residual, last: quant_pack(codec, residual, last), kmeans)
