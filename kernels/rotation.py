"""Triton Walsh-Hadamard transforms, the kernel twin of `mmkv.codecs.rotation` (OCTOPUS paper, eq. 2).

`fwht` is the butterfly of `hadamard_transform` in the same order (pairs at distance 1, 2, 4, ...), so in fp32 it is
bit-identical to the reference; codec kernels call it on [BT, D] register blocks that hold one token per thread
(`mmkv.kernels.common.load_rows`), where it costs one add an entry and stage and no data movement.

`rotate(x, signs, inverse)` is the standalone kernel: u = H(s * x) forward, x = s * H(u) inverse, one sign vector per
head on dim -3, exactly `RandomizedHadamard.forward/inverse` (signs=None: the plain normalised H, OScaR's rotation).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import CodecError
from mmkv.codecs.rotation import is_pow2
from mmkv.kernels.common import LAUNCH, ROWS_WARPS, cast_to, cdiv, jit, load_rows, store_rows, token_block, vector


@triton.jit
def fwht(y, BT: tl.constexpr, D: tl.constexpr):
    """Unnormalised Sylvester transform of each row of y[BT, D] (fp32), bit-identical to the reference butterfly:
    stage h splits the row into (a, b) halves of 2h-blocks and makes (a + b, a - b), as `hadamard_transform` stacks
    them. With a row in one thread (`load_rows`) every stage is register renaming plus one add an entry."""
    for s in tl.static_range(16):
        if (1 << s) < D:
            y4 = tl.reshape(y, (BT, D // (2 << s), 2, 1 << s))
            a, b = tl.split(tl.permute(y4, (0, 1, 3, 2)))
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BT, D))
    return y


@triton.jit
def _lanes_stage(y, BT: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    # One stage on [BT, D/(2H), 2, H]: (a, b) -> (a + b, a - b). The pair axis is reduced (a + b and a*1 + b*(-1),
    # both exact) and broadcast back, which stays in registers and warp shuffles when a row spans lanes.
    y4 = tl.reshape(y, (BT, D // (2 * H), 2, H))
    first = (tl.arange(0, 2) == 0)[None, None, :, None]
    plus = tl.sum(y4, axis=2)
    minus = tl.sum(tl.where(first, y4, -y4), axis=2)
    return tl.reshape(tl.where(first, plus[:, :, None, :], minus[:, :, None, :]), (BT, D))


@triton.jit
def fwht_lanes(y, BT: tl.constexpr, D: tl.constexpr):
    """`fwht` for rows spread over lanes (Triton's coalesced [BT, D] layout), also bit-identical to the reference.
    The min-max encoders keep that layout: their loads and stores are then coalesced, which measured faster there
    than one token a thread (docs/decisions.md, "Codec kernels")."""
    for s in tl.static_range(16):
        if (1 << s) < D:
            y = _lanes_stage(y, BT, D, 1 << s)
    return y


@jit
def _rotate_kernel(
    x_ptr, s_ptr, out_ptr, T, NH, scale, vr,
    D: tl.constexpr, BT: tl.constexpr, V: tl.constexpr, VO: tl.constexpr, SIGNS: tl.constexpr, INVERSE: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    base = row64 * T * D
    y = load_rows(x_ptr, base, t0, n_tok, vr, BT, D, V).to(tl.float32)
    if SIGNS:
        s = tl.load(s_ptr + (row % NH) * D + tl.arange(0, D)).to(tl.float32)[None, :]
        if INVERSE:
            y = fwht(y, BT, D) * scale * s  # s * H(u)
        else:
            y = fwht(y * s, BT, D) * scale  # H(s * x)
    else:
        y = fwht(y, BT, D) * scale
    store_rows(out_ptr, base, t0, n_tok, cast_to(y, out_ptr.dtype.element_ty), vr * VO // V, BT, D, VO)


def rotate(x: torch.Tensor, signs: torch.Tensor | None = None, *, inverse: bool = False) -> torch.Tensor:
    """fp32 H(s * x) (or s * H(x) with inverse=True) along the last dim; signs [H, D] (+-1, one row per head on dim
    -3, or a single row for all) or None for the plain normalised H."""
    d = x.shape[-1]
    if not is_pow2(d) or d < 2:
        raise CodecError(f"Walsh-Hadamard kernel needs a power-of-two last dim >= 2, got {d}")
    if x.dim() < 2:
        raise CodecError(f"rotate expects x[..., T, D], got shape {tuple(x.shape)}")
    x = x.contiguous()
    T = x.shape[-2]
    rows = x.numel() // max(T * d, 1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out
    nh = 1
    if signs is not None:
        signs = signs.to(device=x.device).reshape(-1, d).contiguous()
        nh = signs.shape[0]
        if nh > 1 and (x.dim() < 3 or x.shape[-3] != nh):
            raise CodecError(f"{nh} sign vectors need x[..., {nh}, T, {d}], got {tuple(x.shape)}")
    bt = 32 * ROWS_WARPS
    v, vo = min(vector(x.dtype), d), min(vector(out.dtype), d)
    _rotate_kernel[(cdiv(T, bt), rows)](
        x, signs if signs is not None else x, out, T, nh, 1.0 / math.sqrt(d), v,
        D=d, BT=bt, V=v, VO=vo, SIGNS=signs is not None, INVERSE=inverse, num_warps=ROWS_WARPS, **LAUNCH,
    )
    return out
