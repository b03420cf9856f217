"""Asymmetric min-max group quantisation + pack, the kernel twin of `mmkv.codecs.groupquant.encode_minmax` (the one
quantiser of the min-max family: groupquant, KIVI, OScaR; after `amirzandieh/QJL`, OScaR's `qpack.h`).

One program takes BT tokens x D channels of one row: optionally OScaR's rotation H x and division by the token norm,
then per group (G channels of a token, or G tokens of a channel) min and max, s = (max - min)/(2^b - 1) rounded to the
meta dtype, offset = min (KIVI/QJL) or -z s with z = round(-min/s) (OScaR), codes round(clamp((x - o)/s, 0, 2^b - 1))
against the stored (rounded) s and o; a zero-range group stores (0, min). Min/max need no summation order and the
arithmetic is the reference's op by op, so codes, scales and offsets are bit-identical to the reference.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.codecs.checks import check_or_defer, collecting
from mmkv.kernels.common import LAUNCH, ROWS_WARPS, cdiv, jit, next_power_of_2, rint, rows_of, token_block
from mmkv.kernels.packing import pack_block
from mmkv.kernels.rotation import fwht_lanes


@jit
def _minmax_encode_kernel(
    x_ptr, norm_ptr, codes_ptr, scale_ptr, offset_ptr, bad_ptr,
    T, NH, rscale, row_bytes, NGT,
    D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
    CHANNEL: tl.constexpr, ROTATE: tl.constexpr, NORM: tl.constexpr, ROUNDED: tl.constexpr,
):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, DP)
    valid = (tt < n_tok)[:, None] & (jj < D)[None, :]
    x = tl.load(x_ptr + row64 * T * D + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :], mask=valid, other=0.0)
    x = x.to(tl.float32)
    if ROTATE:  # OScaR's canalized rotation, no signs (OScaR's `k_preprocess.cu`)
        x = fwht_lanes(x, BT, DP) * rscale
    if NORM:  # omni-token scaling: one norm per token over all KV heads (OScaR's `k_preprocess.cu`)
        n = tl.load(norm_ptr + (row // NH).to(tl.int64) * T + t0 + tt, mask=tt < n_tok, other=1.0)
        x = tl.math.div_rn(x, n[:, None])
    if CHANNEL:
        # groups of G tokens per channel: [BT/G, G, DP]
        x3 = tl.reshape(x, (BT // G, G, DP))
        v3 = tl.reshape(valid, (BT // G, G, DP))
        mn = tl.min(tl.where(v3, x3, float("inf")), axis=1)
        mx = tl.max(tl.where(v3, x3, float("-inf")), axis=1)
        nan = tl.max((v3 & (x3 != x3)).to(tl.int32), axis=1) > 0
    else:
        GK: tl.constexpr = G if G < DP else DP
        x3 = tl.reshape(x, (BT, DP // GK, GK))
        v3 = tl.reshape(valid, (BT, DP // GK, GK))
        mn = tl.min(tl.where(v3, x3, float("inf")), axis=2)
        mx = tl.max(tl.where(v3, x3, float("-inf")), axis=2)
        nan = tl.max((v3 & (x3 != x3)).to(tl.int32), axis=2) > 0
    # a NaN makes its group's scale NaN, as torch's amin / amax do (the GPU's min / max may drop it), so the
    # scale check below sees every NaN/Inf of the input (`nonfinite`)
    mx = tl.where(nan, float("nan"), mx)
    meta = scale_ptr.dtype.element_ty
    scale = tl.math.div_rn(mx - mn, LEVELS * 1.0).to(meta)
    s = scale.to(tl.float32)
    pos = s > 0
    if ROUNDED:
        z = rint(tl.math.div_rn(-mn, tl.where(pos, s, 1.0)))
        offset = tl.where(pos, -z * s, mn).to(meta)
    else:
        offset = mn.to(meta)
    o = offset.to(tl.float32)
    # The side information and this program's flag first: stored at the end, they kept s and o live through the
    # codes and the packing (ptxas sm_90, KIVI values at D 128: 218 registers, 167 in this order).
    if CHANNEL:  # [..., D, ceil(T/G)]: (channel j, token group g)
        gl = tl.arange(0, BT // G)
        g = t0 // G + gl
        off = row64 * D * NGT + jj[None, :] * NGT + g[:, None]
        m = (g < NGT)[:, None] & (jj < D)[None, :]
    else:  # [..., T, ceil(D/G)]
        NG: tl.constexpr = (D + G - 1) // G
        gi = tl.arange(0, DP // GK)
        off = row64 * T * NG + (t0 + tt).to(tl.int64)[:, None] * NG + gi[None, :]
        m = (tt < n_tok)[:, None] & (gi < NG)[None, :]
    tl.store(scale_ptr + off, scale, mask=m)
    tl.store(offset_ptr + off, offset, mask=m)
    # this program's flag: a stored scale or offset is NaN/Inf (the host reads any() of them, one reduction)
    bad = (s != s) | (tl.abs(s) == float("inf")) | (o != o) | (tl.abs(o) == float("inf"))
    tl.store(bad_ptr + row64 * tl.num_programs(0) + tl.program_id(0), tl.max(tl.where(m, bad, False).to(tl.int8)))
    if CHANNEL:
        s_el = tl.reshape(tl.broadcast_to(s[:, None, :], (BT // G, G, DP)), (BT, DP))
        o_el = tl.reshape(tl.broadcast_to(o[:, None, :], (BT // G, G, DP)), (BT, DP))
    else:
        s_el = tl.reshape(tl.broadcast_to(s[:, :, None], (BT, DP // GK, GK)), (BT, DP))
        o_el = tl.reshape(tl.broadcast_to(o[:, :, None], (BT, DP // GK, GK)), (BT, DP))
    y = tl.where(s_el > 0, tl.math.div_rn(x - o_el, tl.where(s_el > 0, s_el, 1.0)), 0.0)
    codes = rint(tl.minimum(tl.maximum(y, 0.0), LEVELS * 1.0)).to(tl.int32)
    codes = tl.where(valid, codes, 0)
    pack_block(codes, codes_ptr, row64 * row_bytes, t0, n_tok, BT, DP, D, BITS, 0, 0, D)


def supports_minmax(head_dim: int, group: int, bits: int) -> bool:
    return group >= 1 and (group & (group - 1)) == 0 and group <= 256 and 1 <= bits <= 8 and 1 <= head_dim <= 1024


def row_layout(d: int, bits: int, rotate: bool) -> bool:
    """Decode one token a thread (`store_rows`) when the row is rotated back (OScaR), D a power of two whose codes
    fill whole bytes; otherwise, and for every encode, Triton's coalesced layout, which measured faster there
    (docs/decisions.md, "Codec kernels")."""
    return rotate and d >= 8 and (d & (d - 1)) == 0 and d <= 256 and (d * bits) % 8 == 0


def block_tokens(group: int, dp: int, channel: bool, rows: bool = False) -> int:
    if rows:
        return max(32 * ROWS_WARPS, group) if channel else 32 * ROWS_WARPS
    bt = max(8, 4096 // dp)
    return max(bt, group) if channel else bt


def minmax_encode(
    x: torch.Tensor,
    *,
    bits: int,
    group: int,
    axis: str,
    zero_point: str,
    meta_dtype: torch.dtype,
    where: str,
    rotate: bool = False,
    norm: torch.Tensor | None = None,
    norm_heads: int = 1,
) -> dict[str, torch.Tensor]:
    """`encode_minmax` on the kernel (x[..., T, D] any float dtype, contiguous): {"codes", "scale", "offset"}.
    `rotate` applies the normalised H first and `norm` ([rows / norm_heads, T] fp32) divides each token by its norm
    (OScaR's K path)."""
    *lead, T, D = x.shape
    rows = rows_of(x)
    dev = x.device
    dp = next_power_of_2(D)
    channel = axis == "channel"
    ngt = -(-T // group)
    ng = -(-D // group)
    row_bytes = (T * D * bits + 7) // 8
    codes = torch.empty(*lead, row_bytes, dtype=torch.uint8, device=dev)
    meta_shape = (*lead, D, ngt) if channel else (*lead, T, ng)
    scale = torch.empty(meta_shape, dtype=meta_dtype, device=dev)
    offset = torch.empty(meta_shape, dtype=meta_dtype, device=dev)
    bt = block_tokens(group, dp, channel)
    flags = torch.empty(rows * cdiv(T, bt), dtype=torch.int8, device=dev)  # one a program
    if rows and T:
        _minmax_encode_kernel[(cdiv(T, bt), rows)](
            x, norm if norm is not None else x, codes, scale, offset, flags,
            T, norm_heads, 1.0 / math.sqrt(D), row_bytes, ngt,
            D=D, DP=dp, BT=bt, G=group, BITS=bits, CHANNEL=channel, ROTATE=rotate, NORM=norm is not None,
            ROUNDED=zero_point == "rounded", num_warps=4 if bt * dp <= 4096 else 8, **LAUNCH,
        )
    if scale.numel():  # one reduction; read now (a host sync) or with the caller's other checks (`encode_scope`)
        bad = flags.any()  # the programs' flags: isfinite(scale).all() & isfinite(offset).all(), negated
        what = f"{where}: group scale/offset overflow {meta_dtype}"
        hint = "use meta=fp32 for inputs beyond the fp16 range"
        if not collecting():
            check_or_defer(bad, lambda: f"{what} (largest |value| {float(x.float().abs().max()):.4g}); {hint}")
        else:  # a collected message must not keep x (a unit's K or V) alive until the caller reads the flags
            check_or_defer(bad, lambda: f"{what}; {hint}")
    return {"codes": codes, "scale": scale, "offset": offset}


def nonfinite(codec, enc: Encoded) -> None:
    """A NaN/Inf input makes its group's scale non-finite, which `minmax_encode`'s own check reads: nothing more
    to flag (see `mmkv.codecs.base.Codec._encode_checked`)."""
    return None


def supports(codec) -> bool:
    return supports_minmax(codec.head_dim, codec.group, codec.bits)


def encode(codec, x: torch.Tensor) -> Encoded:
    """`codec.encode(x)` for groupquant on the kernel: per-token groups of `group` channels, float-minimum offset."""
    x = x.contiguous()
    tensors = minmax_encode(
        x, bits=codec.bits, group=codec.group, axis="token", zero_point="min", meta_dtype=codec.meta_dtype,
        where=f"codec {codec.config} (layer {codec.layer})",
    )
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors)
