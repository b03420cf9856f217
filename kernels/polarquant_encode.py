"""PolarQuant-R encode + pack, the kernel twin of `PolarQuantCodec._encode` (PolarQuant paper, Algorithm 1; reference
`mmkv/codecs/polarquant.py`).

One program takes BT tokens of one row: u = H(s * x) (one sign vector for the whole model), then the recursive polar
transform of each 16-coordinate block in registers: level 1 angles atan2(u_2j+1, u_2j) in [0, 2 pi), levels 2-4
angles atan2 of the previous radii, each level's angles coded to the nearest Lloyd-Max centroid and packed into its
own plane; the last radius per block is written in fp32 and rounded to fp16 by the launcher after the reference's
overflow check. On the GPU atan2 is libdevice's atan2f (the function torch's CUDA atan2 calls); the interpreter has no
libdevice, so there a Cephes-style atan2 (about 2 ulp) stands in and an angle code may differ where psi sits within
that of a threshold (docs/decisions.md, "Codec kernels").
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mmkv.codecs.base import Encoded
from mmkv.codecs.checks import check_or_defer
from mmkv.codecs.polarquant import BLOCK, DEPTH, angle_codebook
from mmkv.kernels.common import (
    INTERPRET, LAUNCH, ROWS_WARPS, cdiv, device_tables, jit, load_rows, rows_of, search, search_table, token_block,
    vector,
)
from mmkv.kernels.packing import pack_plane
from mmkv.kernels.rotation import fwht

_LUT = 256  # entries per level in the packed centroid / threshold tables (bits <= 8)


@triton.jit
def _atan_01(a):
    # Cephes atanf on a >= 0: range reduction at tan(3 pi/8) and tan(pi/8), then an odd polynomial.
    big = a > 2.414213562373095
    mid = (a > 0.4142135623730950) & (~big)
    x = tl.where(big, -1.0 / tl.where(big, a, 1.0), tl.where(mid, (a - 1.0) / (a + 1.0), a))
    y0 = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = x * x
    p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * x + x
    return y0 + p


@triton.jit
def atan2(y, x, INTERP: tl.constexpr):
    """atan2(y, x) in fp32: libdevice on the GPU; a Cephes-style stand-in under the interpreter."""
    if INTERP:
        ax = tl.abs(x)
        ay = tl.abs(y)
        t = _atan_01(ay / tl.where(ax > 0, ax, 1.0))
        t = tl.where(ax > 0, t, tl.where(ay > 0, 1.5707963267948966, 0.0))
        t = tl.where(x < 0, 3.141592653589793 - t, t)
        return tl.where(y < 0, -t, t)
    else:
        return libdevice.atan2(y, x)


@triton.jit
def _level(r, t_ptr, n_ptr, out_ptr, row_base, t0, n_tok, vr, BT: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
           FIRST: tl.constexpr, INTERP: tl.constexpr, CELLS: tl.constexpr, V: tl.constexpr):
    # r [BT, 2N]: pairs (a, b) -> angle codes [BT, N] packed into this level's plane, radii [BT, N] returned.
    a, b = tl.split(tl.reshape(r, (BT, N, 2)))
    psi = atan2(b, a, INTERP)
    if FIRST:
        psi = tl.where(psi < 0, psi + 6.283185307179586, psi)  # [0, 2 pi)
    codes = search(psi, t_ptr, n_ptr, (1 << BITS) - 1, CELLS)
    pack_plane(codes, out_ptr, row_base, t0, n_tok, vr, BT, N, BITS, V)
    return tl.sqrt_rn(a * a + b * b)


@jit
def _polarquant_encode_kernel(
    x_ptr, s_ptr, t_ptr, n_ptr, a1_ptr, a2_ptr, a3_ptr, a4_ptr, radius_ptr,
    T, scale, rb1, rb2, rb3, rb4, vr,
    D: tl.constexpr, BT: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, B4: tl.constexpr,
    LUT: tl.constexpr, INTERP: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
    V: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    x = load_rows(x_ptr, row64 * T * D, t0, n_tok, vr, BT, D, V)  # one token a thread
    s = tl.load(s_ptr + jj).to(tl.float32)
    u = fwht(x.to(tl.float32) * s[None, :], BT, D) * scale
    TS: tl.constexpr = LUT + 4  # a level's search table: [lo, 1/w, -inf, t..., +inf], padded
    r = _level(u, t_ptr, n_ptr, a1_ptr, row64 * rb1, t0, n_tok, vr, BT, D // 2, B1, True, INTERP, C1, V)
    r = _level(r, t_ptr + TS, n_ptr + C1, a2_ptr, row64 * rb2, t0, n_tok, vr, BT, D // 4, B2, False, INTERP, C2, V)
    r = _level(r, t_ptr + 2 * TS, n_ptr + C1 + C2, a3_ptr, row64 * rb3, t0, n_tok, vr, BT, D // 8, B3, False, INTERP,
               C3, V)
    r = _level(r, t_ptr + 3 * TS, n_ptr + C1 + C2 + C3, a4_ptr, row64 * rb4, t0, n_tok, vr, BT, D // 16, B4, False,
               INTERP, C4, V)
    NB: tl.constexpr = D // 16
    kb = tl.arange(0, NB)
    tl.store(radius_ptr + row64 * T * NB + (t0 + tt).to(tl.int64)[:, None] * NB + kb[None, :], r, mask=tmask[:, None])


def supports(codec) -> bool:
    return 16 <= codec.head_dim <= 256


def _cells(codec) -> tuple[int, ...]:
    """The CELLS constexprs of the four levels, as Python ints (reading them from the device table was a sync)."""
    return tuple(int(c) for c in _tables(codec, torch.device("cpu"))["cells"])


def _tables(codec, device: torch.device) -> dict:
    def build():
        cent = torch.zeros(DEPTH, _LUT)
        thr = torch.full((DEPTH, _LUT + 4), float("inf"))
        counts, cells = [], []
        for level, bits in enumerate(codec.level_bits, start=1):
            c = angle_codebook(level, bits).float()
            cent[level - 1, : c.numel()] = c
            tab = search_table(c)
            thr[level - 1, : tab["t"].numel()] = tab["t"]
            counts.append(tab["n"])
            cells.append(tab["n"].numel() if tab["n"].numel() > 1 else 0)
        return {"signs": codec.rotation.signs[0], "cent": cent, "thr": thr, "n": torch.cat(counts),
                "cells": torch.tensor(cells)}

    return device_tables(codec, device, "polarquant", build)


def encode(codec, x: torch.Tensor) -> Encoded:
    """`codec.encode(x)` for PolarQuant on the kernel: x[..., T, D] in any float dtype, already validated."""
    x = x.contiguous()
    *lead, T, D = x.shape
    rows = rows_of(x)
    dev = x.device
    tab = _tables(codec, dev)
    nb = D // BLOCK
    planes, row_bytes = [], []
    for level, bits in enumerate(codec.level_bits, start=1):
        n = (T * (D >> level) * bits + 7) // 8
        planes.append(torch.empty(*lead, n, dtype=torch.uint8, device=dev))
        row_bytes.append(n)
    radius = torch.empty(*lead, T, nb, dtype=torch.float32, device=dev)
    bt = 32 * ROWS_WARPS  # one token a thread
    v = min(vector(x.dtype), D)
    if rows and T:
        b1, b2, b3, b4 = codec.level_bits
        _polarquant_encode_kernel[(cdiv(T, bt), rows)](
            x, tab["signs"], tab["thr"], tab["n"], *planes, radius, T, 1.0 / math.sqrt(D), *row_bytes, v,
            D=D, BT=bt, B1=b1, B2=b2, B3=b3, B4=b4, LUT=_LUT, INTERP=INTERPRET,
            **dict(zip(("C1", "C2", "C3", "C4"), _cells(codec))), V=v, num_warps=ROWS_WARPS,
            **LAUNCH,
        )
    tensors = {f"angles{level}": p for level, p in enumerate(planes, start=1)}
    r16 = radius.to(torch.float16)
    if r16.numel():
        check_or_defer(~torch.isfinite(r16).all(), lambda: (
            f"codec {codec.config} (layer {codec.layer}): a block radius exceeds the fp16 range "
            f"(max {float(radius.max()):.4g}); PolarQuant stores fp16 radii"))
    tensors["radius"] = r16.contiguous()
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors)
