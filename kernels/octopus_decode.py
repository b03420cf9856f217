"""OCTOPUS (and OCTOPUS-QJL) unpack + decode to the model dtype, the kernel twin of `OctopusCodec._decode`
(codecs.md 5.3; reference `mmkv/codecs/octopus.py`, `mmkv/codecs/octopus_qjl.py`).

Per output coordinate j of BT tokens: triplet j // 3's direction code and rho code are read from the packed planes,
u_hat_j = DIR[code][j % 3] * C_rho[jr] (the reference's LUT, so the same fp32 values), plus for OCTOPUS-QJL the
residual sqrt(pi/(2d)) gamma_r * s' * H(sigma); then k_hat = s * H(gamma * u_hat) by the fp32 butterfly, i.e. the
reference's operations in the reference's order, cast once to the output dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmkv.kernels.common import LAUNCH, cast_to, head_count, rows_of
from mmkv.kernels.octopus_encode import _tables, supports  # noqa: F401  (same parameter range as the encoder)
from mmkv.kernels.packing import unpack_at, unpack_block
from mmkv.kernels.rotation import fwht


@triton.jit
def _octopus_decode_kernel(
    dir_ptr, rho_ptr, gamma_ptr, qjl_ptr, rnorm_ptr, lut_ptr, rho_c_ptr, s_ptr, sk_ptr, out_ptr,
    T, NH, scale, qjl_scale, dir_row_bytes, rho_row_bytes, qjl_row_bytes,
    D: tl.constexpr, NT: tl.constexpr, BT: tl.constexpr, DIR_BITS: tl.constexpr, RHO_BITS: tl.constexpr,
    QJL: tl.constexpr,
):
    pid_t = tl.program_id(0)
    row = tl.program_id(1)
    row64 = row.to(tl.int64)
    t0 = pid_t * BT
    n_tok = tl.minimum(T - t0, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    mask = tmask[:, None] & (jj < D)[None, :]
    idx = (t0 + tt)[:, None] * NT + (jj // 3)[None, :]
    code = unpack_at(dir_ptr, row64 * dir_row_bytes, idx, mask, 2 * DIR_BITS)
    if RHO_BITS > 0:
        jr = unpack_at(rho_ptr, row64 * rho_row_bytes, idx, mask, RHO_BITS)
    else:
        jr = tl.zeros(code.shape, tl.int32)
    u = tl.load(lut_ptr + code * 3 + (jj % 3)[None, :]) * tl.load(rho_c_ptr + jr)  # t_hat = DIR[code] * C_rho[jr]
    if QJL:
        bits = unpack_block(qjl_ptr, row64 * qjl_row_bytes, t0, n_tok, BT, D, D, 1, 0, 0, D)
        sigma = bits.to(tl.float32) * 2 - 1
        sk = tl.load(sk_ptr + (row % NH) * D + jj).to(tl.float32)
        coef = qjl_scale * tl.load(rnorm_ptr + row64 * T + t0 + tt, mask=tmask, other=0.0).to(tl.float32)
        u = u + coef[:, None] * (fwht(sigma, BT, D) * scale * sk[None, :])
    gamma = tl.load(gamma_ptr + row64 * T + t0 + tt, mask=tmask, other=0.0).to(tl.float32)
    y = gamma[:, None] * u
    s = tl.load(s_ptr + (row % NH) * D + jj).to(tl.float32)
    y = fwht(y, BT, D) * scale * s[None, :]  # k_hat = s * H(gamma u_hat)
    off = row64 * T * D + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :]
    tl.store(out_ptr + off, cast_to(y, out_ptr.dtype.element_ty), mask=mask)


def decode(codec, enc, dtype: torch.dtype, *, bt: int | None = None, warps: int = 4) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for OCTOPUS / OCTOPUS-QJL on the kernel: [..., T, D] in `dtype`."""
    qjl = hasattr(codec, "sketch")
    *lead, T, D = enc.shape
    t = enc.tensors
    dev = t["dir"].device
    tab = _tables(codec, dev)
    out = torch.empty(enc.shape, dtype=dtype, device=dev)
    rows = rows_of(out)
    if not rows or not T:
        return out
    n_t = codec.n_t
    bt = bt or (32 if D <= 128 else 16)
    dir_p = t["dir"].contiguous()
    rho_p = t["rho"].contiguous() if codec.rho_bits else dir_p
    qjl_p = t["qjl"].contiguous() if qjl else dir_p
    rnorm = t["rnorm"].contiguous() if qjl else t["gamma"]
    _octopus_decode_kernel[(triton.cdiv(T, bt), rows)](
        dir_p, rho_p, t["gamma"].contiguous(), qjl_p, rnorm, tab["lut"], tab["rho_c"], tab["signs"], tab["sketch"], out,
        T, head_count(codec), 1.0 / math.sqrt(D), getattr(codec, "qjl_scale", 0.0),
        dir_p.shape[-1], rho_p.shape[-1], qjl_p.shape[-1],
        D=D, NT=n_t, BT=bt, DIR_BITS=codec.dir_bits, RHO_BITS=codec.rho_bits, QJL=qjl, num_warps=warps, **LAUNCH,
    )
    return out
