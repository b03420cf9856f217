"""TurboQuant-MSE encode + pack in one pass, the kernel twin of `TurboQuantMSECodec._encode` (codecs.md 2.2,
Algorithm 1; reference `mmkv/codecs/turboquant_mse.py`).

One program codes BT tokens of one row: norm = ||x||, u = H(s * x/norm) (norm 0 divides by 1), each coordinate to the
nearest Lloyd-Max centroid (`searchsorted` on the cell boundaries, ties to the lower index), coordinates j < hi with
the (b+1)-bit codebook into `idx_hi` and the rest with the b-bit one into `idx`, packed from registers. The norm is
written in fp32; the launcher applies the reference's fp16 check and rounding for norm=16.
Rotation as in `kernels/octopus_encode.py`: fp32 butterfly (bit-identical u) or, for bf16/fp16 keys, one
tensor-core product with the +-1 Hadamard matrix.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.codecs.turboquant_mse import store_norm
from mmkv.kernels.common import INTERPRET, LAUNCH, boundaries, count_less, device_tables, head_count, rows_of
from mmkv.kernels.octopus_encode import rotation_mode
from mmkv.kernels.packing import pack_block
from mmkv.kernels.rotation import fwht, hadamard_pm1, rows_dot


@triton.jit
def _turboquant_encode_kernel(
    x_ptr, s_ptr, mat_ptr, lo_t_ptr, hi_t_ptr, idx_ptr, idx_hi_ptr, norm_ptr,
    T, NH, scale, lo_row_bytes, hi_row_bytes,
    D: tl.constexpr, BT: tl.constexpr, B: tl.constexpr, HI: tl.constexpr, MMA: tl.constexpr, INTERP: tl.constexpr,
):
    pid_t = tl.program_id(0)
    row = tl.program_id(1)
    row64 = row.to(tl.int64)
    t0 = pid_t * BT
    n_tok = tl.minimum(T - t0, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    x = tl.load(x_ptr + row64 * T * D + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :], mask=tmask[:, None], other=0.0)
    xf = x.to(tl.float32)
    norm = tl.sqrt_rn(tl.sum(xf * xf, axis=1))
    safe = tl.where(norm > 0, norm, 1.0)[:, None]  # gamma = 0 codes u = 0 and decodes to 0 (codecs.md A20)
    s = tl.load(s_ptr + (row % NH) * D + jj).to(tl.float32)
    if MMA:
        xs = (xf * s[None, :]).to(x.dtype)  # exact: a sign flip
        u = tl.math.div_rn(rows_dot(xs, mat_ptr, D, D, INTERP) * scale, safe)
    else:
        u = fwht(tl.math.div_rn(xf, safe) * s[None, :], BT, D) * scale
    if HI < D:
        lo = count_less(u, lo_t_ptr, (1 << B) - 1)
        pack_block(lo, idx_ptr, row64 * lo_row_bytes, t0, n_tok, BT, D, D - HI, B, HI, 0, D - HI)
    if HI > 0:
        hi = count_less(u, hi_t_ptr, (2 << B) - 1)
        pack_block(hi, idx_hi_ptr, row64 * hi_row_bytes, t0, n_tok, BT, D, HI, B + 1, 0, 0, HI)
    tl.store(norm_ptr + row64 * T + t0 + tt, norm, mask=tmask)


def supports(codec) -> bool:
    return 16 <= codec.head_dim <= 256


def _tables(codec, device: torch.device) -> dict:
    def build():
        lo_t = boundaries(codec.lo_q.centroids)
        return {
            "signs": codec.rotation.signs,
            "lo_t": lo_t,
            "hi_t": boundaries(codec.hi_q.centroids) if codec.hi_q is not None else lo_t,
            "lo_c": codec.lo_q.centroids,
            "hi_c": codec.hi_q.centroids if codec.hi_q is not None else codec.lo_q.centroids,
        }

    return device_tables(codec, device, "turboquant", build)


def _hmat(codec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return device_tables(codec, device, f"hadamard-{dtype}", lambda: {"h": hadamard_pm1(codec.head_dim, dtype)})["h"]


def encode(
    codec, x: torch.Tensor, *, rotation: str | None = None, bt: int | None = None, warps: int = 4
) -> Encoded:
    """`codec.encode(x)` for TurboQuant-MSE on the kernel: x[..., T, D] in any float dtype, already validated."""
    x = x.contiguous()
    *lead, T, D = x.shape
    rows = rows_of(x)
    dev = x.device
    tab = _tables(codec, dev)
    hi, b = codec.hi, codec.b
    mma = (rotation or rotation_mode(x.dtype)) == "mma" and x.dtype in (torch.bfloat16, torch.float16)
    mat = _hmat(codec, dev, x.dtype) if mma else x
    lo_bytes = (T * (D - hi) * b + 7) // 8
    hi_bytes = (T * hi * (b + 1) + 7) // 8
    idx = torch.empty(*lead, lo_bytes, dtype=torch.uint8, device=dev)
    idx_hi = torch.empty(*lead, hi_bytes, dtype=torch.uint8, device=dev)
    norm = torch.empty(*lead, T, dtype=torch.float32, device=dev)
    bt = bt or (32 if D <= 128 else 16)
    if rows and T:
        _turboquant_encode_kernel[(triton.cdiv(T, bt), rows)](
            x, tab["signs"], mat, tab["lo_t"], tab["hi_t"], idx if hi < D else idx_hi, idx_hi if hi else idx, norm,
            T, head_count(codec), 1.0 / math.sqrt(D), lo_bytes, hi_bytes,
            D=D, BT=bt, B=b, HI=hi, MMA=mma, INTERP=INTERPRET, num_warps=warps, **LAUNCH,
        )
    tensors = {}
    if hi < D:
        tensors["idx"] = idx
    if hi:
        tensors["idx_hi"] = idx_hi
    tensors["norm"] = store_norm(norm, codec.norm_bits, f"codec {codec.config} (layer {codec.layer})")
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors)
