"""Triton device functions for the one bit-packing layout of `mmkv.codecs.packing`: a row's codes form one dense
little-endian bit stream, code i at bits [i*W, (i+1)*W), least significant bit first, the row padded to a byte at its
end only.

A plane stores N codes per token, so token t's codes are stream entries [t*N, (t+1)*N). Kernels hold codes as
[BT, NP] int32 arrays (NP a power of two >= the columns they hold); array column A0 + k is plane column P0 + k for
k < NV. A block of BT tokens (BT a multiple of 8) starts on a byte boundary, because 8 tokens hold N*W whole bytes,
so blocks never share a byte and need no atomics.

Two ways to pack: when every token's codes fill whole bytes and the array columns fall in aligned runs of 8 (the usual
case: N = D a power of two), 8 codes become W bytes through one int64; otherwise each output byte gathers the (at
most 8/W + 1) codes that touch it from the flattened array (`tl.gather`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmkv.kernels.common import load_rows, store_rows


@triton.jit
def pack_block(
    codes,
    out_ptr,
    row_base,
    t0,
    n_tok,
    BT: tl.constexpr,
    NP: tl.constexpr,
    N: tl.constexpr,
    W: tl.constexpr,
    A0: tl.constexpr,
    P0: tl.constexpr,
    NV: tl.constexpr,
):
    """Store the codes of tokens [t0, t0 + n_tok) (array [BT, NP] int32, each < 2^W) into a row's byte stream that
    starts at out_ptr + row_base. Tokens >= n_tok are not written (the last block's final byte is zero-padded)."""
    FAST: tl.constexpr = (
        (W <= 8) and (N % 8 == 0) and (NP % 8 == 0) and (A0 % 8 == 0) and (P0 % 8 == 0) and (NV % 8 == 0)
    )
    if W == 8 and P0 == 0 and NV == N:  # one byte a code
        tt = tl.arange(0, BT)[:, None]
        aa = tl.arange(0, NP)[None, :]
        off = row_base + (t0 + tt).to(tl.int64) * N + (aa - A0)
        tl.store(out_ptr + off, codes.to(tl.uint8), mask=(tt < n_tok) & (aa >= A0) & (aa < A0 + N))
    elif FAST:
        WP: tl.constexpr = 1 if W == 1 else (2 if W == 2 else (4 if W <= 4 else 8))
        tt = tl.arange(0, BT)
        ck = tl.arange(0, NP // 8)
        kk = tl.arange(0, 8)
        qq = tl.arange(0, WP)
        c3 = tl.reshape(codes, (BT, NP // 8, 8)).to(tl.int64)
        val = tl.sum(c3 << (kk * W).to(tl.int64)[None, None, :], axis=2)  # 8 codes -> W bytes, disjoint bits
        byte = (val[:, :, None] >> (qq * 8).to(tl.int64)[None, None, :]) & 0xFF
        tok_bytes: tl.constexpr = N * W // 8
        col = ((ck - A0 // 8 + P0 // 8) * W)[None, :, None] + qq[None, None, :]
        off = row_base + (t0 + tt).to(tl.int64)[:, None, None] * tok_bytes + col
        keep = (ck * 8 >= A0) & (ck * 8 < A0 + NV)
        mask = (tt < n_tok)[:, None, None] & keep[None, :, None] & (qq < W)[None, None, :]
        tl.store(out_ptr + off, byte.to(tl.uint8), mask=mask)
    else:
        tl.static_assert(P0 == 0 and NV == N, "gather packing needs each token's whole plane row in the array")
        tl.static_assert(W <= 16, "codes wider than 16 bits")
        NB: tl.constexpr = BT * N * W // 8
        NBP: tl.constexpr = triton.next_power_of_2(NB)
        K: tl.constexpr = triton.next_power_of_2((8 + W - 1) // W + 1)
        bi = tl.arange(0, NBP)
        rr = tl.arange(0, K)
        i = (bi[:, None] * 8) // W + rr[None, :]  # stream entries (within the block) that may touch byte bi
        shift = i * W - bi[:, None] * 8
        tok = i // N
        valid = (i * W < bi[:, None] * 8 + 8) & (tok < n_tok) & (bi[:, None] < NB)
        src = tl.where(valid, tok * NP + (i % N) + A0, 0)
        flat = tl.reshape(codes, (BT * NP,))
        v = tl.reshape(tl.gather(flat, tl.reshape(src, (NBP * K,)), axis=0), (NBP, K))
        piece = tl.where(shift >= 0, v << tl.maximum(shift, 0), v >> tl.maximum(-shift, 0)) & 0xFF
        byte = tl.sum(tl.where(valid, piece, 0), axis=1)
        n_bytes = (n_tok * (N * W) + 7) // 8
        tl.store(out_ptr + row_base + (t0 // 8) * (N * W) + bi, byte.to(tl.uint8), mask=bi < n_bytes)


@triton.jit
def unpack_at(in_ptr, row_base, idx, mask, W: tl.constexpr):
    """Codes (int32) at stream entries `idx` (any shape) of the row starting at in_ptr + row_base; 0 where ~mask.
    Reads the 1-3 bytes a code spans, never past the byte that holds its last bit."""
    bit = idx.to(tl.int64) * W
    byte = row_base + (bit >> 3)
    sh = (bit & 7).to(tl.int32)
    v = tl.load(in_ptr + byte, mask=mask, other=0).to(tl.int32)
    if 8 % W != 0:  # a width that divides 8 starts each code at a multiple of itself: never past its byte
        v |= tl.load(in_ptr + byte + 1, mask=mask & (sh + W > 8), other=0).to(tl.int32) << 8
    if W > 9:
        v |= tl.load(in_ptr + byte + 2, mask=mask & (sh + W > 16), other=0).to(tl.int32) << 16
    return (v >> sh) & ((1 << W) - 1)


@triton.jit
def unpack_block(
    in_ptr,
    row_base,
    t0,
    n_tok,
    BT: tl.constexpr,
    NP: tl.constexpr,
    N: tl.constexpr,
    W: tl.constexpr,
    A0: tl.constexpr,
    P0: tl.constexpr,
    NV: tl.constexpr,
):
    """The inverse of `pack_block`: codes [BT, NP] int32 of tokens [t0, t0 + n_tok); other entries 0."""
    FAST: tl.constexpr = (
        (W <= 8) and (N % 8 == 0) and (NP % 8 == 0) and (A0 % 8 == 0) and (P0 % 8 == 0) and (NV % 8 == 0)
    )
    tt = tl.arange(0, BT)
    if FAST:
        WP: tl.constexpr = 1 if W == 1 else (2 if W == 2 else (4 if W <= 4 else 8))
        ck = tl.arange(0, NP // 8)
        kk = tl.arange(0, 8)
        qq = tl.arange(0, WP)
        tok_bytes: tl.constexpr = N * W // 8
        col = ((ck - A0 // 8 + P0 // 8) * W)[None, :, None] + qq[None, None, :]
        off = row_base + (t0 + tt).to(tl.int64)[:, None, None] * tok_bytes + col
        keep = (ck * 8 >= A0) & (ck * 8 < A0 + NV)
        mask = (tt < n_tok)[:, None, None] & keep[None, :, None] & (qq < W)[None, None, :]
        b = tl.load(in_ptr + off, mask=mask, other=0).to(tl.int64)
        val = tl.sum(b << (qq * 8).to(tl.int64)[None, None, :], axis=2)  # [BT, NP/8]
        c3 = (val[:, :, None] >> (kk * W).to(tl.int64)[None, None, :]) & ((1 << W) - 1)
        return tl.reshape(c3, (BT, NP)).to(tl.int32)
    else:
        a = tl.arange(0, NP)
        keep = (a >= A0) & (a < A0 + NV)
        idx = (t0 + tt)[:, None] * N + (a - A0 + P0)[None, :]
        return unpack_at(in_ptr, row_base, idx, (tt < n_tok)[:, None] & keep[None, :], W)


# -- one token a thread (`mmkv.kernels.common.load_rows` layout) ---------------------------------------------------
# When a plane's N codes of W bits fill whole bytes (N*W % 8 == 0) and N is a power of two, token t's bytes are
# [t*N*W/8, (t+1)*N*W/8) of the row: each thread packs its own token in registers and writes 16-byte vectors.


@triton.jit
def pack_rows(codes, ptr, base, t0, n_tok, vr, BT: tl.constexpr, N: tl.constexpr, W: tl.constexpr,
              V: tl.constexpr):
    """codes [BT, N] int32 (< 2^W) of tokens [t0, t0 + n_tok) into the plane at ptr + base. `vr` is the run-time
    twin of V (the entries in a 16-byte vector of the rows this kernel loaded), see `load_rows`."""
    NBT: tl.constexpr = N * W // 8
    if 8 % W == 0:
        PER: tl.constexpr = 8 // W
        b = tl.sum(tl.reshape(codes, (BT, NBT, PER)) << (tl.arange(0, PER) * W)[None, None, :], axis=2)
        VB: tl.constexpr = 16 if NBT >= 16 else NBT
        store_rows(ptr, base, t0, n_tok, b.to(tl.uint8), vr * VB // V, BT, NBT, VB)
    else:
        WP: tl.constexpr = triton.next_power_of_2(W)
        c3 = tl.reshape(codes, (BT, N // 8, 8)).to(tl.int64)
        val = tl.sum(c3 << (tl.arange(0, 8) * W).to(tl.int64)[None, None, :], axis=2)  # 8 codes -> W bytes
        qq = tl.arange(0, WP)[None, None, :]
        b = (val[:, :, None] >> (qq * 8).to(tl.int64)) & 0xFF
        tt = tl.arange(0, BT)[:, None, None]
        off = base + (t0 + tt).to(tl.int64) * NBT + tl.arange(0, N // 8)[None, :, None] * W + qq
        tl.store(ptr + off, b.to(tl.uint8), mask=(tt < n_tok) & (qq < W))


@triton.jit
def unpack_rows(ptr, base, t0, n_tok, vr, BT: tl.constexpr, N: tl.constexpr, W: tl.constexpr, V: tl.constexpr):
    """The inverse of `pack_rows`: codes [BT, N] int32, one token a thread (0 past n_tok)."""
    NBT: tl.constexpr = N * W // 8
    if 8 % W == 0:
        PER: tl.constexpr = 8 // W
        VB: tl.constexpr = 16 if NBT >= 16 else NBT
        b = load_rows(ptr, base, t0, n_tok, vr * VB // V, BT, NBT, VB).to(tl.int32)
        c3 = (b[:, :, None] >> (tl.arange(0, PER) * W)[None, None, :]) & ((1 << W) - 1)
        return tl.reshape(c3, (BT, N))
    else:
        WP: tl.constexpr = triton.next_power_of_2(W)
        qq = tl.arange(0, WP)[None, None, :]
        tt = tl.arange(0, BT)[:, None, None]
        off = base + (t0 + tt).to(tl.int64) * NBT + tl.arange(0, N // 8)[None, :, None] * W + qq
        b = tl.load(ptr + off, mask=(tt < n_tok) & (qq < W), other=0).to(tl.int64)
        val = tl.sum(b << (qq * 8).to(tl.int64), axis=2)
        c3 = (val[:, :, None] >> (tl.arange(0, 8) * W).to(tl.int64)[None, None, :]) & ((1 << W) - 1)
        return tl.reshape(c3, (BT, N)).to(tl.int32)


@triton.jit
def pack_plane(codes, ptr, base, t0, n_tok, vr, BT: tl.constexpr, N: tl.constexpr, W: tl.constexpr, V: tl.constexpr):
    """codes [BT, N] (N a power of two, one token a thread) into a plane of N codes a token: `pack_rows` when tokens
    fill whole bytes, else `pack_block`. `base` = row * (plane bytes of a row)."""
    if (N * W) % 8 == 0 and (8 % W == 0 or N % 8 == 0):
        pack_rows(codes, ptr, base, t0, n_tok, vr, BT, N, W, V)
    else:
        pack_block(codes, ptr, base, t0, n_tok, BT, N, N, W, 0, 0, N)


@triton.jit
def unpack_plane(ptr, base, t0, n_tok, vr, BT: tl.constexpr, N: tl.constexpr, W: tl.constexpr, V: tl.constexpr):
    """The inverse of `pack_plane`."""
    if (N * W) % 8 == 0 and (8 % W == 0 or N % 8 == 0):
        return unpack_rows(ptr, base, t0, n_tok, vr, BT, N, W, V)
    else:
        return unpack_block(ptr, base, t0, n_tok, BT, N, N, W, 0, 0, N)
