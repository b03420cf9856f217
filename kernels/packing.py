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
    if FAST:
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
    if W > 1:
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
