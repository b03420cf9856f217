"""What every fused decode-attention kernel (`kernels/<codec>_attn.py`) shares: split-K planning, the min-max value
tile, the online softmax, the log-sum-exp combine, rotations of the query and the output, and the fallbacks.

Design (oscar.md §4.1-4.2, ecosystem.md D2-D4, codecs.md §1.3). One program attends ONE query row of one (batch,
query head) over one split of one encoded segment's tokens, reading only packed bytes:

* keys are scored straight from their codes (in the rotated domain for the rotation codecs: the query is rotated once
  per call by a [D, D] matrix product, never the keys);
* values are min-max token groups (groupquant / KIVI V / OScaR V): the group scale is folded into the softmax weight,
  so a value costs one mask-or, one subtract and one FMA (`unit_values`); OScaR's rotated V is accumulated in the
  rotated domain and rotated back once per output row;
* key tiles are laid out [channels, tokens] (a token's channels in one thread: the score's sum over channels stays
  in-thread) and value tiles [tokens, channels] (the weighted sum over tokens stays in-thread); only the weight
  vector p [BLOCK_N] changes layout between the two;
* splits write (out, lse) partials; one combine launch merges splits and segments exactly by log-sum-exp.

Queries are CUDA-core GEMV work at decode (Lq = 1, no GQA group to fill a tensor-core tile); blocks of more than
`MAX_FUSED_QUERIES` rows are compute-bound and go through decode-to-bf16 + flash attention instead (ecosystem.md D4).

Packed code planes are dense little-endian bit streams per (batch, head) row (`mmkv.codecs.packing`). Widths that
divide 16 are read as int32 words of two half-words of 16 // w codes ("half" units); other widths <= 8 as w-byte
chunks of 8 codes. Measured speed and its limits (instruction issue, not bytes): docs/perf.md.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Sequence

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import to_device_shared

# Query rows above which the fused path loses to decode + flash attention (one program per row re-dequantises the
# tile for each row; flash attention is compute-bound at video chunk sizes, ecosystem.md D4).
MAX_FUSED_QUERIES = 4
LOG2E = 1.4426950408889634
# Programs to aim for per multiprocessor when choosing the split count (enough loads in flight to cover latency).
PROGRAMS_PER_SM = 8
# Fewest tiles a split is given, so that its epilogue (a D-wide store and one combine slot) stays amortised.
MIN_TILES_PER_SPLIT = 4


class KernelUnsupported(Exception):
    """The fused kernel does not handle this input; the caller uses the exact torch path instead."""


# ----------------------------------------------------------------------------------------------------------------
# Triton helpers shared by the kernels


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


@triton.jit
def _combine_kernel(out_part, lse_part, out, lse, S, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge S (out, lse) partials of one query row exactly: lse = log sum exp lse_s, out = sum exp(lse_s - lse) out_s
    (the Flash-Decoding reduction, ecosystem.md D2). Two passes over S in chunks of BLOCK_S."""
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
    _combine_kernel[(rows,)](out_part, lse_part, out, lse, splits, D=d, BLOCK_S=min(64, triton.next_power_of_2(splits)))
    return out, lse


# ----------------------------------------------------------------------------------------------------------------
# Host side


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keep a few splits so the combine is exercised


def plan_splits(programs: int, tiles: int, device: torch.device, splits: int | None = None) -> int:
    """Splits per segment: enough programs to fill the machine, each with at least MIN_TILES_PER_SPLIT tiles."""
    if splits is None:
        splits = max(1, round(PROGRAMS_PER_SM * num_sms(device) / max(programs, 1)))
        splits = min(splits, max(1, tiles // MIN_TILES_PER_SPLIT))
    return max(1, min(int(splits), tiles))


def half_units(w: int) -> bool:
    """Codes of w bits are read as half-words of 16 // w codes (in int32 words) when w divides 16, else as w-byte
    chunks of 8 codes."""
    return 16 % w == 0


def unit_shape(d: int, w: int) -> tuple[int, int]:
    """(units per token, codes per unit) of a token-major plane of d w-bit codes per token."""
    if half_units(w):
        if (d * w) % 32:
            raise KernelUnsupported(f"{d} codes of {w} bits are not a whole number of 32-bit words")
        return d * w // 16, 16 // w
    if w > 8:
        raise KernelUnsupported(f"{w}-bit codes are not supported (at most 8 bits)")
    return d // 8, 8


def code_plane(t: torch.Tensor, w: int) -> torch.Tensor:
    """A [B, H, nbytes] uint8 plane as the kernel reads it: int32 words for half-word units, bytes otherwise."""
    if t.dtype != torch.uint8 or t.dim() != 3 or t.stride(-1) != 1:
        raise KernelUnsupported(f"expected a [B, H, nbytes] uint8 plane with unit inner stride, got {tuple(t.shape)}")
    if not half_units(w):
        return t
    if t.shape[-1] % 4 or any(s % 4 for s in t.stride()[:-1]) or t.storage_offset() % 4:
        raise KernelUnsupported("a word plane needs byte counts, strides and offset divisible by 4")
    return t.view(torch.int32)


def value_layout(v_codec, d: int) -> dict:
    """Kernel constants of a min-max token-group value codec (NG groups of UPG units per token), or unsupported."""
    w, g = v_codec.bits, v_codec.group
    if getattr(v_codec, "axis", "token") != "token":
        raise KernelUnsupported(f"value codec {v_codec.config} is not per-token grouped")
    nu, su = unit_shape(d, w)
    g = min(g, d)  # one (ragged) group covers a whole token when the group is wider than the head
    if g & (g - 1) or g % su:
        raise KernelUnsupported(f"value group {g} is not a power-of-two multiple of the {su} codes of a unit")
    return dict(NG=d // g, UPG=g // su, VSU=su, VW=w, VHALF=half_units(w))


_MATRICES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def rotation_matrix(codec, which: str, device: torch.device) -> torch.Tensor:
    """[Hc, D, D] (or [D, D]) fp32 matrix M with codec.<which>(x) == x @ M for row vectors x, per KV head.

    Built by applying the codec's own function to the identity, so it is the codec's rotation by construction; one
    small matrix product then rotates all query rows (or output rows) of a call."""
    cache = _MATRICES.setdefault(codec, {})
    key = (which, device)
    if key not in cache:
        d, h = codec.head_dim, codec.num_heads
        eye = torch.eye(d, dtype=torch.float32)
        eye = eye.expand(h, d, d).contiguous() if h > 1 else eye
        m = getattr(codec, which)(eye).float()
        cache[key] = to_device_shared({"m": m}, torch.device(device), f"rotation:{which}")["m"]
    return cache[key]


def apply_rotation(x: torch.Tensor, m: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """x [B, Hq, T, D] @ the KV head's matrix (query head hq uses KV head hq // (Hq / Hkv)), fp32, contiguous."""
    b, hq, t, d = x.shape
    if m.dim() == 2:
        return torch.matmul(x.float(), m).contiguous()
    if m.shape[0] != kv_heads:
        raise KernelUnsupported(f"codec built for {m.shape[0]} heads, segment has {kv_heads}")
    y = torch.matmul(x.float().reshape(b, kv_heads, (hq // kv_heads) * t, d), m)
    return y.reshape(b, hq, t, d).contiguous()


class SplitKAttention:
    """The callable `mmkv.kernels.attention_kernel` returns: kernel(q, segments, scale) -> (out, lse), fp32.

    Subclasses provide `prepare(q, seg)` (the query as the kernel reads it), `launch(...)` (one segment's split-K
    kernel) and optionally `finish(out, seg)` (rotate the output back). Anything the kernel does not cover (a shape, a
    ragged parameter, more than MAX_FUSED_QUERIES rows) goes through an exact torch or flash-attention path, so the
    callable is always correct. `splits`, `block_n`, `num_warps` and `stages` (software-pipelining depth of the
    packed loads) override the defaults (benchmark sweeps).
    """

    name = "splitk"
    max_queries = MAX_FUSED_QUERIES  # `mmkv.attention.attend` sends longer query blocks down decode + one SDPA call

    def __init__(self, k_config, v_config, *, splits: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, stages: int = 3):
        self.k_config, self.v_config = k_config, v_config
        self.splits, self.block_n, self.num_warps, self.stages = splits, block_n, num_warps, stages
        self.last_path = None  # "fused", "flash" or "reference": which path the last call took (tests, bench)

    # -- to override -------------------------------------------------------------------------------------------
    def prepare(self, q: torch.Tensor, seg) -> torch.Tensor:
        raise NotImplementedError

    def launch(self, qk: torch.Tensor, seg, out_part: torch.Tensor, lse_part: torch.Tensor, split0: int, scale: float,
               tile0: int, tiles: int, splits: int) -> None:
        """Launch one segment's kernel: `splits` programs per query row over `tiles` tiles from `tile0`, writing
        partial slots [split0, split0 + splits) of out_part [B, Hq, Tq, S, D] and lse_part [B, Hq, Tq, S]."""
        raise NotImplementedError

    def num_tiles(self, seg) -> tuple[int, int]:
        """(first tile, number of tiles) of the visible tokens."""
        bn = self.tile_size(seg)
        t = seg.k_enc.shape[-2]
        first = seg.skip_tokens // bn
        return first, triton.cdiv(t, bn) - first

    default_block_n = 64
    default_warps = 4

    def tile_size(self, seg) -> int:
        return self.block_n or self.default_block_n

    def warps(self, seg) -> int:
        return self.num_warps or self.default_warps

    def finish(self, out: torch.Tensor, seg) -> torch.Tensor:
        return out

    def check(self, q: torch.Tensor, seg) -> None:
        """Raise KernelUnsupported for inputs the kernel does not cover."""

    # -- the protocol ------------------------------------------------------------------------------------------
    def __call__(self, q: torch.Tensor, segments: Sequence, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        segments = [s for s in segments if s.num_tokens > 0]
        if not segments:
            raise ValueError("fused attention needs at least one encoded segment with visible tokens")
        try:
            for seg in segments:
                self._check_common(q, seg)
                self.check(q, seg)
        except KernelUnsupported:
            self.last_path = "reference"
            return reference_lse(q, segments, scale)
        if q.shape[-2] > MAX_FUSED_QUERIES:
            self.last_path = "flash" if _flash_ok(q) else "reference"
            return decode_flash_lse(q, segments, scale)
        self.last_path = "fused"
        b, hq, tq, d = q.shape
        plans = []
        for seg in segments:
            tile0, tiles = self.num_tiles(seg)
            plans.append((tile0, tiles, plan_splits(b * hq * tq, tiles, q.device, self.splits)))
        total = sum(p[2] for p in plans)
        out_part = torch.empty(b, hq, tq, total, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(b, hq, tq, total, dtype=torch.float32, device=q.device)
        split0 = 0
        prepared: dict[int, torch.Tensor] = {}
        for seg, (tile0, tiles, splits) in zip(segments, plans):
            key = id(seg.k_codec)
            if key not in prepared:
                prepared[key] = self.prepare(q, seg)
            self.launch(prepared[key], seg, out_part, lse_part, split0, scale, tile0, tiles, splits)
            split0 += splits
        out, lse = combine(out_part, lse_part)
        return self.finish(out, segments[0]), lse

    def _check_common(self, q: torch.Tensor, seg) -> None:
        if not seg.encoded:
            raise KernelUnsupported("native segment")
        shape = seg.k_enc.shape
        if len(shape) != 4 or q.dim() != 4 or tuple(seg.v_enc.shape) != tuple(shape):
            raise KernelUnsupported(f"expected [B, H, T, D] segments and queries, got {shape} and {tuple(q.shape)}")
        b, h, _, d = shape
        if q.shape[0] != b or q.shape[-1] != d or q.shape[1] % h:
            raise KernelUnsupported(f"query {tuple(q.shape)} does not match segment {shape}")
        if d < 16 or d & (d - 1):
            raise KernelUnsupported(f"head dim {d} is not a power of two >= 16")
        if str(seg.k_codec.config) != str(self.k_config) or str(seg.v_codec.config) != str(self.v_config):
            raise KernelUnsupported("segment codecs differ from the kernel's configs")


def use_asm() -> bool:
    """Inline PTX is available except under the Triton interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("1", "true", "True")


def launch_grid(q: torch.Tensor, splits: int) -> tuple[int, int, int]:
    """(split, query head x row, batch): the splits of one row are neighbours, so they share L2 lines of q."""
    b, hq, tq, _ = q.shape
    return (splits, hq * tq, b)


# ----------------------------------------------------------------------------------------------------------------
# Exact fallbacks


def _repeat_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x if x.shape[1] == hq else x.repeat_interleave(hq // x.shape[1], dim=1)


def reference_lse(q: torch.Tensor, segments: Sequence, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode each segment to fp32 with the codec's torch reference and attend exactly (mmkv.attention)."""
    from mmkv import attention

    parts = []
    for seg in segments:
        k = seg.k_codec._decode(seg.k_enc)[..., seg.skip_tokens :, :]
        v = seg.v_codec._decode(seg.v_enc)[..., seg.skip_tokens :, :]
        hq = q.shape[1]
        parts.append(attention.attention_lse(q.float(), _repeat_heads(k, hq), _repeat_heads(v, hq), scale))
    return attention.merge_lse(parts)


def _flash_ok(q: torch.Tensor) -> bool:
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def decode_flash_lse(q: torch.Tensor, segments: Sequence, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Long query blocks: decode the past once into the query dtype (the codec's decode, Triton where registered)
    and run flash attention, which returns the LSE (ecosystem.md D4: the video chunk regime is compute-bound)."""
    from mmkv import attention

    if not _flash_ok(q):
        return reference_lse(q, segments, scale)
    k, v = attention.gather(segments, None, None, q.dtype)
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out.float(), lse.float()
