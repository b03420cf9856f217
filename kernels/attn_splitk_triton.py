"""The Triton helpers every fused decode-attention kernel (`kernels/<codec>_attn.py`) builds on: loading packed
units, unpacking codes and min-max values, the online softmax and value steps, the split bookkeeping, and the
log-sum-exp combine of the splits' partials; the design and the host side are in `kernels/attn_splitk.py`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmkv.kernels.common import jit, next_power_of_2


@triton.jit
def _load_chunks(ptrs, mask, W: tl.constexpr):
    """W-byte little-endian chunks of 8 W-bit codes (widths that do not divide 16)."""
    if W <= 3:
        x = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        for j in tl.static_range(1, W):
            x = x | (tl.load(ptrs + j, mask=mask, other=0).to(tl.int32) << (8 * j))
    else:
        x = tl.load(ptrs, mask=mask, other=0).to(tl.int64)
        for j in tl.static_range(1, W):
            x = x | (tl.load(ptrs + j, mask=mask, other=0).to(tl.int64) << (8 * j))
    return x


@triton.jit
def load_units(row_ptr, tok, tmask, NU: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr, KEYS: tl.constexpr):
    """The packed units of tokens `tok` [N] of one token-major code row: [NU, N] for keys (tokens last, so a token's
    codes stay in one thread and the score's sum over channels is in-thread), [N, NU] for values.

    HALF: a unit is a half-word of 16 // W codes, loaded as int32 words whose high half is shifted down once per word
    (so extracting a code is one mask-or, see `unit_values`). Else a unit is a W-byte chunk of 8 codes."""
    if HALF:
        NW: tl.constexpr = NU // 2
        w = tl.arange(0, NW)
        if KEYS:
            x = tl.load(row_ptr + tok[None, :] * NW + w[:, None], mask=tmask[None, :], other=0)
            x = tl.reshape(tl.permute(tl.join(x, x >> 16), (0, 2, 1)), [NU, tok.shape[0]])
        else:
            x = tl.load(row_ptr + tok[:, None] * NW + w[None, :], mask=tmask[:, None], other=0)
            x = tl.reshape(tl.join(x, x >> 16), [tok.shape[0], NU])
    else:
        u = tl.arange(0, NU)
        if KEYS:
            x = _load_chunks(row_ptr + tok[None, :] * (NU * W) + u[:, None] * W, tmask[None, :], W)
        else:
            x = _load_chunks(row_ptr + tok[:, None] * (NU * W) + u[None, :] * W, tmask[:, None], W)
    return x


@triton.jit
def unit_ints(x, SU: tl.constexpr, W: tl.constexpr, KEYS: tl.constexpr):
    """Integer codes of packed units (code k of a unit sits at bits [k W, (k+1) W)): [NU, SU, N] for keys
    ([NU, N] units), [N, NU, SU] for values ([N, NU] units)."""
    o = tl.arange(0, SU) * W
    if KEYS:
        c = (x[:, None, :] >> o[None, :, None]) & ((1 << W) - 1)
    else:
        c = (x[:, :, None] >> o[None, None, :]) & ((1 << W) - 1)
    return c.to(tl.int32)


@triton.jit
def unit_values(x, SU: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr, KEYS: tl.constexpr):
    """Codes of packed units as fp32 (shapes as `unit_ints`) without an int-to-float conversion (quarter rate).

    HALF: OR-ing the masked bits into the mantissa of 2^23 gives 2^23 + c 2^o exactly (o + W <= 16), so one subtract
    yields c 2^o and `unit_scale` (2^-o) is folded into the query or applied once per split. Else: c itself."""
    if HALF:
        o = tl.arange(0, SU) * W
        if KEYS:
            bits = (x[:, None, :] & (((1 << W) - 1) << o)[None, :, None]) | 0x4B000000
        else:
            bits = (x[:, :, None] & (((1 << W) - 1) << o)[None, None, :]) | 0x4B000000
    else:
        bits = unit_ints(x, SU, W, KEYS) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def unit_scale(SU: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr):
    """The factor [SU] that turns `unit_values` into codes: 2^-o for half units, 1 for byte chunks."""
    if HALF:
        return tl.exp2(-(tl.arange(0, SU) * W).to(tl.float32))
    else:
        return tl.full([SU], 1.0, tl.float32)


@triton.jit
def lookup(table_ptr, idx, ASM: tl.constexpr):
    """table[idx] for a small fp32 table (a codebook: one or two L1 lines, so a warp's lookups are one wavefront).

    ASM (compiled runs): an opaque `ld.global.nc`, so the software pipeliner does not turn the gather into
    per-element async copies staged through shared memory (and re-lay the tile around them); the interpreter, which
    cannot run PTX, uses tl.load."""
    if ASM:
        return tl.inline_asm_elementwise(
            "ld.global.nc.f32 $0, [$1];", "=r,l", [table_ptr + idx], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.load(table_ptr + idx)


@triton.jit
def softmax_step(s2, tmask, m_i, l_i):
    """Online softmax over one tile of scores s2 [N] (log2 units): (weights p [N], rescale alpha, m, l)."""
    s2 = tl.where(tmask, s2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s2, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no visible token adds nothing
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s2 - m_use)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 0)


@triton.jit
def value_step(acc, accm, alpha, p, tok, tmask, vc_row, vs_row, vo_row, vs_st,
               NG: tl.constexpr, UPG: tl.constexpr, VSU: tl.constexpr, VW: tl.constexpr, VHALF: tl.constexpr):
    """acc[NG, UPG, SU] = alpha acc + sum_t (p_t s_tg) c_t and accm[NG] = alpha accm + sum_t p_t m_tg for min-max
    token groups (x^ = c s + m; NG groups of UPG units per token, a unit never straddling groups).

    The tile is [tokens, groups, units, codes] with tokens in-thread, so the sum over tokens needs no cross-thread
    traffic; each (token, group) scale is loaded once and folded into the weight, so a code costs one FMA after
    `unit_values`."""
    x = tl.reshape(load_units(vc_row, tok, tmask, NG * UPG, VW, VHALF, False), [tok.shape[0], NG, UPG])
    o = tl.arange(0, VSU) * VW
    if VHALF:
        bits = (x[:, :, :, None] & (((1 << VW) - 1) << o)[None, None, None, :]) | 0x4B000000
    else:
        bits = (((x[:, :, :, None] >> o[None, None, None, :]) & ((1 << VW) - 1)).to(tl.int32)) | 0x4B000000
    vals = bits.to(tl.float32, bitcast=True) - 8388608.0  # [N, NG, UPG, SU]
    meta = tok[:, None] * vs_st + tl.arange(0, NG)[None, :]
    s = tl.load(vs_row + meta, mask=tmask[:, None], other=0.0).to(tl.float32)
    m = tl.load(vo_row + meta, mask=tmask[:, None], other=0.0).to(tl.float32)
    p = p[:, None]
    acc = acc * alpha + tl.sum((p * s)[:, :, None, None] * vals, 0)
    accm = accm * alpha + tl.sum(p * m, 0)
    return acc, accm


@triton.jit
def query_row(q_ptr, Tq, GQ, D: tl.constexpr):
    """This program's query row (axis 1 of the grid), batch b (axis 2), the KV head hk the row reads, and the pointer
    to the row's [D] query."""
    row = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (row // Tq) // GQ
    return row, b, hk, q_ptr + (b * tl.num_programs(1) + row) * D


@triton.jit
def value_rows(vc_ptr, vs_ptr, vo_ptr, b, hk, vc_sb, vc_sh, vs_sb, vs_sh):
    """(b, hk)'s V codes, scales and offsets, as `value_step` reads them (scales and offsets share strides)."""
    return vc_ptr + b * vc_sb + hk * vc_sh, vs_ptr + b * vs_sb + hk * vs_sh, vo_ptr + b * vs_sb + hk * vs_sh


@triton.jit
def empty_split(NG: tl.constexpr, UPG: tl.constexpr, VSU: tl.constexpr):
    """The online-softmax state before the first tile: (m_i, l_i, acc, accm) of `softmax_step` / `value_step`."""
    return (tl.full([], float("-inf"), tl.float32), tl.zeros([], tl.float32), tl.zeros([NG, UPG, VSU], tl.float32),
            tl.zeros([NG], tl.float32))


@triton.jit
def store_split(acc, accm, m_i, l_i, out_part, lse_part, b, row, S_total, split0, D: tl.constexpr, NG: tl.constexpr,
                UPG: tl.constexpr, VSU: tl.constexpr, VW: tl.constexpr, VHALF: tl.constexpr):
    """Write one split's normalised output [D] (natural channel order) and its natural-log LSE (-inf if empty) to
    this program's slot: split split0 + (grid axis 0) of query row (b, row), S_total splits a row."""
    slot = (b * tl.num_programs(1) + row) * S_total + split0 + tl.program_id(0)
    out_row = out_part + slot * D
    lse_pos = lse_part + slot
    o = acc * unit_scale(VSU, VW, VHALF)[None, None, :] + accm[:, None, None]
    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    u = tl.arange(0, NG)[:, None, None] * UPG + tl.arange(0, UPG)[None, :, None]
    tl.store(out_row + u * VSU + tl.arange(0, VSU)[None, None, :], o * inv)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_pos, lse)


@triton.jit
def split_tiles(tile0, tiles_per_split, T, BLOCK_N: tl.constexpr):
    """This program's [first, last) tile of the segment (tiles of BLOCK_N tokens counted from token 0)."""
    split = tl.program_id(0)
    lo = tile0 + split * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, tl.cdiv(T, BLOCK_N))
    return lo, hi


@jit
def _combine_kernel(out_part, lse_part, out, lse, S, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge S (out, lse) partials of one query row exactly: lse = log sum exp lse_s, out = sum exp(lse_s - lse) out_s
    (the Flash-Decoding reduction, Dao et al. 2023). Two passes over S in chunks of BLOCK_S."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    mx = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mx = tl.maximum(mx, tl.max(tl.load(lse_part + r * S + s, mask=s < S, other=float("-inf")), 0))
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        w = tl.exp(tl.load(lse_part + r * S + s, mask=s < S, other=float("-inf")) - ref)
        o = tl.load(out_part + (r * S + s)[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
        tot += tl.sum(w, 0)
        acc += tl.sum(w[:, None] * o, 0)
    tl.store(out + r * D + d, acc / tot)
    tl.store(lse + r, ref + tl.log(tot))


def combine(out_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, Tq, S, D] and [B, H, Tq, S] partials -> (out [B, H, Tq, D], lse [B, H, Tq]), fp32."""
    *lead, splits, d = out_part.shape
    out = torch.empty(*lead, d, dtype=torch.float32, device=out_part.device)
    lse = torch.empty(*lead, dtype=torch.float32, device=out_part.device)
    rows = math.prod(lead)
    _combine_kernel[(rows,)](out_part, lse_part, out, lse, splits, D=d, BLOCK_S=min(64, next_power_of_2(splits)))
    return out, lse
