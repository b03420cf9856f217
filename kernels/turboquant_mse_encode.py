"""TurboQuant-MSE encode + pack in one pass, the kernel twin of `TurboQuantMSECodec._encode` (TurboQuant
paper, Algorithm 1; reference `mmkv/codecs/turboquant_mse.py`).

One program codes BT tokens of one row: norm = ||x||, u = H(s * x/norm) (norm 0 divides by 1), each coordinate to the
nearest Lloyd-Max centroid (`searchsorted` on the cell boundaries, ties to the lower index), coordinates j < hi with
the (b+1)-bit codebook into `idx_hi` and the rest with the b-bit one into `idx`, packed from registers. 1/norm is
applied after the rotation (one division a token), so u can differ from the reference's by an ulp or two and a code
can move where u sits that close to a cell boundary (docs/decisions.md, "Codec kernels"). The norm is
written in fp32; the launcher applies the reference's fp16 check and rounding for norm=16.
One token a thread (`mmkv.kernels.common.load_rows`): the butterfly, searches and packing are register work.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.codecs.turboquant_mse import store_norm
from mmkv.kernels.common import (
    LAUNCH, ROWS_WARPS, cdiv, cells, device_tables, head_count, jit, load_rows, rows_of, search, search_table,
    token_block, vector,
)
from mmkv.kernels.packing import pack_block, pack_rows
from mmkv.kernels.rotation import fwht


@jit
def _turboquant_encode_kernel(
    x_ptr, s_ptr, lo_t_ptr, lo_n_ptr, hi_t_ptr, hi_n_ptr, idx_ptr, idx_hi_ptr, norm_ptr,
    T, NH, scale, lo_row_bytes, hi_row_bytes, vr,
    D: tl.constexpr, BT: tl.constexpr, V: tl.constexpr, B: tl.constexpr, HI: tl.constexpr,
    LO_CELLS: tl.constexpr, HI_CELLS: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    jj = tl.arange(0, D)
    x = load_rows(x_ptr, row64 * T * D, t0, n_tok, vr, BT, D, V)
    xf = x.to(tl.float32)
    norm = tl.sqrt_rn(tl.sum(xf * xf, axis=1))
    # gamma = 0 codes u = 0 and decodes to 0. 1/norm is applied after the rotation, one division a
    # token: u differs from the reference's H(s * x/norm) by an ulp or two.
    inv = tl.math.div_rn(scale, tl.where(norm > 0, norm, 1.0))[:, None]
    s = tl.load(s_ptr + (row % NH) * D + jj).to(tl.float32)
    u = fwht(xf * s[None, :], BT, D) * inv
    if HI == 0:
        pack_rows(search(u, lo_t_ptr, lo_n_ptr, (1 << B) - 1, LO_CELLS), idx_ptr, row64 * T * (D * B // 8), t0, n_tok,
                  vr, BT, D, B, V)
    else:
        if HI < D:
            lo = search(u, lo_t_ptr, lo_n_ptr, (1 << B) - 1, LO_CELLS)
            pack_block(lo, idx_ptr, row64 * lo_row_bytes, t0, n_tok, BT, D, D - HI, B, HI, 0, D - HI)
        hi = search(u, hi_t_ptr, hi_n_ptr, (2 << B) - 1, HI_CELLS)
        pack_block(hi, idx_hi_ptr, row64 * hi_row_bytes, t0, n_tok, BT, D, HI, B + 1, 0, 0, HI)
    tl.store(norm_ptr + row64 * T + t0 + tl.arange(0, BT), norm, mask=tl.arange(0, BT) < n_tok)


def supports(codec) -> bool:
    return 16 <= codec.head_dim <= 256


def nonfinite(codec, enc: Encoded) -> torch.Tensor | None:
    """Whether a token norm is NaN/Inf, as any NaN/Inf of the input makes it (a finite input only by overflowing
    fp32): the flag `mmkv.codecs.base.Codec._encode_checked` reads instead of scanning the input. fp16 norms are
    checked by `store_norm` already, NaN included."""
    return None if codec.norm_bits == 16 else ~torch.isfinite(enc.tensors["norm"]).all()


def _tables(codec, device: torch.device) -> dict:
    def build():
        lo = search_table(codec.lo_q.centroids)
        hi = search_table(codec.hi_q.centroids) if codec.hi_q is not None else lo
        return {
            "signs": codec.rotation.signs,
            "lo_t": lo["t"], "lo_n": lo["n"], "hi_t": hi["t"], "hi_n": hi["n"],
            "lo_c": codec.lo_q.centroids,
            "hi_c": codec.hi_q.centroids if codec.hi_q is not None else codec.lo_q.centroids,
        }

    return device_tables(codec, device, "turboquant", build)


def encode(codec, x: torch.Tensor, *, warps: int | None = None) -> Encoded:
    """`codec.encode(x)` for TurboQuant-MSE on the kernel: x[..., T, D] in any float dtype, already validated."""
    x = x.contiguous()
    *lead, T, D = x.shape
    rows = rows_of(x)
    dev = x.device
    tab = _tables(codec, dev)
    hi, b = codec.hi, codec.b
    lo_bytes = (T * (D - hi) * b + 7) // 8
    hi_bytes = (T * hi * (b + 1) + 7) // 8
    idx = torch.empty(*lead, lo_bytes, dtype=torch.uint8, device=dev)
    idx_hi = torch.empty(*lead, hi_bytes, dtype=torch.uint8, device=dev)
    norm = torch.empty(*lead, T, dtype=torch.float32, device=dev)
    warps = warps or ROWS_WARPS
    bt = 32 * warps  # one token a thread
    v = min(vector(x.dtype), D)
    if rows and T:
        _turboquant_encode_kernel[(cdiv(T, bt), rows)](
            x, tab["signs"], tab["lo_t"], tab["lo_n"], tab["hi_t"], tab["hi_n"], idx if hi < D else idx_hi,
            idx_hi if hi else idx, norm,
            T, head_count(codec), 1.0 / math.sqrt(D), lo_bytes, hi_bytes, v,
            D=D, BT=bt, V=v, B=b, HI=hi, LO_CELLS=cells({"n": tab["lo_n"]}), HI_CELLS=cells({"n": tab["hi_n"]}),
            num_warps=warps, **LAUNCH,
        )
    tensors = {}
    if hi < D:
        tensors["idx"] = idx
    if hi:
        tensors["idx_hi"] = idx_hi
    tensors["norm"] = store_norm(norm, codec.norm_bits, f"codec {codec.config} (layer {codec.layer})")
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors)
