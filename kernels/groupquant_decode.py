"""Min-max group dequantisation to the model dtype, the kernel twin of `mmkv.codecs.groupquant.decode_minmax` (and
of OScaR's decode: times the token norm, then H): x^ = q * s + o per element (product rounded before the add, as the
reference), cast once to the output dtype. Bit-identical to the reference.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton.language as tl

from mmkv.codecs.groupquant import num_groups
from mmkv.kernels.common import (
    LAUNCH, cast_to, cdiv, decode_out_rows, jit, next_power_of_2, out_row, rows_of, store_rows, token_block, unit_of,
    vector,
)
from mmkv.kernels.groupquant_encode import block_tokens, row_layout, supports  # noqa: F401  (same parameter range)
from mmkv.kernels.packing import unpack_block, unpack_rows
from mmkv.kernels.rotation import fwht, fwht_lanes


@jit
def _minmax_decode_kernel(
    codes_ptr, scale_ptr, offset_ptr, norm_ptr, out_ptr, starts_ptr,
    T, NH, rscale, row_bytes, NGT, NU, vr, N1, N2, S0, S1, S2,
    D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
    CHANNEL: tl.constexpr, ROTATE: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr, V: tl.constexpr,
    UNITS: tl.constexpr, UP: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    orow = out_row(row64, N1, N2, S0, S1, S2)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, DP)
    valid = (tt < n_tok)[:, None] & (jj < D)[None, :]
    if ROWS:
        q = unpack_rows(codes_ptr, row64 * T * (D * BITS // 8), t0, n_tok, vr, BT, D, BITS, V)
    else:
        q = unpack_block(codes_ptr, row64 * row_bytes, t0, n_tok, BT, DP, D, BITS, 0, 0, D)
    NG: tl.constexpr = (D + G - 1) // G
    if CHANNEL and not UNITS and BT % G == 0 and D == DP:
        # a token group's D scales and offsets, loaded once and broadcast over its G tokens (t0 is a multiple of BT,
        # so the program's tokens are whole groups); loaded per element, one token a thread held D of each: 255
        # registers and spills for OScaR's K (ptxas sm_90)
        gl = tl.arange(0, BT // G)
        goff = row64 * D * NGT + jj[None, :] * NGT + (t0 // G + gl)[:, None]
        gmask = (t0 + gl * G < T)[:, None]
        s2 = tl.load(scale_ptr + goff, mask=gmask, other=0.0).to(tl.float32)
        o2 = tl.load(offset_ptr + goff, mask=gmask, other=0.0).to(tl.float32)
        q3 = tl.reshape(q.to(tl.float32), (BT // G, G, D))
        y = tl.reshape(q3 * s2[:, None, :] + o2[:, None, :], (BT, D))
    elif not CHANNEL and D == DP and G <= D:
        # a token's NG scales and offsets, loaded once and broadcast over their groups' channels (as above: OScaR's V)
        gi = tl.arange(0, NG)
        goff = row64 * T * NG + (t0 + tt).to(tl.int64)[:, None] * NG + gi[None, :]
        gmask = (tt < n_tok)[:, None]
        s2 = tl.load(scale_ptr + goff, mask=gmask, other=0.0).to(tl.float32)
        o2 = tl.load(offset_ptr + goff, mask=gmask, other=0.0).to(tl.float32)
        q3 = tl.reshape(q.to(tl.float32), (BT, NG, G))
        y = tl.reshape(q3 * s2[:, :, None] + o2[:, :, None], (BT, D))
    else:  # joined units, a row padded to a power of two, or groups wider than the row: a scale per element
        if CHANNEL:
            tok = t0 + tt
            if UNITS:  # joined units (`RoleCodec.join_units`): each unit's groups start at its first token
                u = unit_of(tok, starts_ptr, NU, UP)
                inside = u < NU
                first = tl.load(starts_ptr + u, mask=inside, other=0)
                base = tl.load(starts_ptr + NU + 1 + u, mask=inside, other=0)  # the unit's first group
                grp = base + (tok - first) // G
            else:
                grp = tok // G
            moff = row64 * D * NGT + jj[None, :] * NGT + grp[:, None]
        else:
            moff = row64 * T * NG + (t0 + tt).to(tl.int64)[:, None] * NG + (jj // G)[None, :]
        s = tl.load(scale_ptr + moff, mask=valid, other=0.0).to(tl.float32)
        o = tl.load(offset_ptr + moff, mask=valid, other=0.0).to(tl.float32)
        y = q.to(tl.float32) * s + o
    if NORM:
        n = tl.load(norm_ptr + (row // NH).to(tl.int64) * T + t0 + tt, mask=tt < n_tok, other=1.0)
        y = y * n[:, None]
    if ROTATE:
        y = fwht(y, BT, DP) * rscale if ROWS else fwht_lanes(y, BT, DP) * rscale
    if ROWS:
        store_rows(out_ptr, orow, t0, n_tok, cast_to(y, out_ptr.dtype.element_ty), vr, BT, D, V)
    else:
        off = orow + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :]
        tl.store(out_ptr + off, cast_to(y, out_ptr.dtype.element_ty), mask=valid)


def minmax_decode(
    tensors: dict[str, torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    bits: int,
    group: int,
    axis: str,
    rotate: bool = False,
    norm: torch.Tensor | None = None,
    norm_heads: int = 1,
    out: torch.Tensor | None = None,
    units: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """`decode_minmax` on the kernel, cast to `dtype`; `norm` multiplies each token and `rotate` applies H last.
    `out`: write there (see `decode_out_rows`: a stack of units may land straight in token order). `units`: the
    token counts of joined K units (`RoleCodec.join_units`), whose groups restart at each unit."""
    *lead, T, D = shape
    codes = tensors["codes"].contiguous()
    dev = codes.device
    out, rows_at = decode_out_rows(shape, dtype, dev, out)
    rows = rows_of(out)
    if not rows or not T:
        return out
    dp = next_power_of_2(D)
    channel = axis == "channel"
    by_rows = row_layout(D, bits, rotate)
    bt = block_tokens(group, dp, channel, by_rows)
    v = min(vector(dtype), D)
    scale = tensors["scale"].contiguous()
    ragged = channel and units is not None
    _minmax_decode_kernel[(cdiv(T, bt), rows)](
        codes, scale, tensors["offset"].contiguous(), norm if norm is not None else scale, out,
        unit_table(units, group, dev) if ragged else scale,
        T, norm_heads, 1.0 / math.sqrt(D), codes.shape[-1], scale.shape[-1] if channel else -(-T // group),
        len(units) if ragged else 0, v, *rows_at,
        D=D, DP=dp, BT=bt, G=group, BITS=bits, CHANNEL=channel, ROTATE=rotate, NORM=norm is not None,
        ROWS=by_rows, V=v, UNITS=ragged, UP=next_power_of_2(len(units)) if ragged else 1,
        num_warps=max(1, bt // 32) if by_rows else (4 if bt * dp <= 4096 else 8), **LAUNCH,
    )
    return out


@functools.lru_cache(maxsize=256)
def unit_table(units: tuple[int, ...], group: int, device: torch.device) -> torch.Tensor:
    """Joined units' first tokens and the end, then each unit's first group: int32 [2 len(units) + 1] on `device`,
    made once per (units, group, device) and read only, so a decode launches no copy for it."""
    groups = [num_groups(n, group) for n in units]
    return torch.tensor([0, *itertools.accumulate(units), 0, *itertools.accumulate(groups[:-1])], dtype=torch.int32,
                        device=device)


def decode(codec, enc, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for groupquant on the kernel."""
    return minmax_decode(enc.tensors, enc.shape, dtype, bits=codec.bits, group=codec.group, axis="token", out=out)
