"""OCTOPUS (and OCTOPUS-QJL) unpack + decode to the model dtype, the kernel twin of `OctopusCodec._decode`
(OCTOPUS paper, eq. 6; reference `mmkv/codecs/octopus.py`, `mmkv/codecs/octopus_qjl.py`).

Per output coordinate j of BT tokens: triplet j // 3's direction code and rho code are read from the packed planes,
u_hat_j = DIR[code][j % 3] * C_rho[jr] (the reference's LUT, so the same fp32 values), plus for OCTOPUS-QJL the
residual sqrt(pi/(2d)) gamma_r * s' * H(sigma); then k_hat = s * H(gamma * u_hat) by the fp32 butterfly, i.e. the
reference's operations in the reference's order, cast once to the output dtype.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from mmkv.kernels.common import (
    LAUNCH, ROWS_WARPS, cast_to, cdiv, decode_out, head_count, jit, next_power_of_2, rows_of, store_rows, token_block,
    vector,
)
from mmkv.kernels.octopus_encode import _tables, from_triplets, supports  # noqa: F401  (same range as the encoder)
from mmkv.kernels.packing import unpack_at, unpack_rows
from mmkv.kernels.rotation import fwht


# OCTOPUS packs 2 x bits (and rho bits) a triplet, 42 triplets a token, so its row byte counts change their
# divisibility with the token count, and its codes are read at bit offsets: their alignment buys nothing.
@jit(also=("dir_row_bytes", "rho_row_bytes"))
def _octopus_decode_kernel(
    dir_ptr, rho_ptr, gamma_ptr, qjl_ptr, rnorm_ptr, lut_ptr, rho_c_ptr, s_ptr, sk_ptr, out_ptr,
    T, NH, scale, qjl_scale, dir_row_bytes, rho_row_bytes, vr, ORS,
    D: tl.constexpr, NT: tl.constexpr, NTP: tl.constexpr, BT: tl.constexpr, V: tl.constexpr,
    DIR_BITS: tl.constexpr, RHO_BITS: tl.constexpr, QJL: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    ii = tl.arange(0, NTP)
    tmask = tt < n_tok
    # per triplet: code, rho code, t_hat = DIR[code] * C_rho[jr] (the reference's LUT and product)
    mask = tmask[:, None] & (ii < NT)[None, :]
    idx = (t0 + tt)[:, None] * NT + ii[None, :]
    code = unpack_at(dir_ptr, row64 * dir_row_bytes, idx, mask, 2 * DIR_BITS)
    if RHO_BITS > 0:
        rc = tl.load(rho_c_ptr + unpack_at(rho_ptr, row64 * rho_row_bytes, idx, mask, RHO_BITS))
    else:
        rc = tl.load(rho_c_ptr + tl.zeros(code.shape, tl.int32))
    hx = tl.load(lut_ptr + code * 3) * rc
    hy = tl.load(lut_ptr + code * 3 + 1) * rc
    hz = tl.load(lut_ptr + code * 3 + 2) * rc
    u = from_triplets(hx, hy, hz, BT, D, NTP)  # back to coordinates j = 3i + c, padding dropped
    if QJL:
        bits = unpack_rows(qjl_ptr, row64 * T * (D // 8), t0, n_tok, vr, BT, D, 1, V)
        sigma = bits.to(tl.float32) * 2 - 1
        sk = tl.load(sk_ptr + (row % NH) * D + jj).to(tl.float32)
        coef = qjl_scale * tl.load(rnorm_ptr + row64 * T + t0 + tt, mask=tmask, other=0.0).to(tl.float32)
        u = u + coef[:, None] * (fwht(sigma, BT, D) * scale * sk[None, :])
    gamma = tl.load(gamma_ptr + row64 * T + t0 + tt, mask=tmask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (row % NH) * D + jj).to(tl.float32)
    y = fwht(gamma[:, None] * u, BT, D) * scale * s[None, :]  # k_hat = s * H(gamma u_hat)
    store_rows(out_ptr, row64 * ORS, t0, n_tok, cast_to(y, out_ptr.dtype.element_ty), vr, BT, D, V)


def decode(
    codec, enc, dtype: torch.dtype, *, warps: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for OCTOPUS / OCTOPUS-QJL on the kernel: [..., T, D] in `dtype`."""
    qjl = hasattr(codec, "sketch")
    *lead, T, D = enc.shape
    t = enc.tensors
    dev = t["dir"].device
    tab = _tables(codec, dev)
    out, ors = decode_out(enc.shape, dtype, dev, out)
    rows = rows_of(out)
    if not rows or not T:
        return out
    warps = warps or ROWS_WARPS
    bt = 32 * warps  # one token a thread
    v = min(vector(dtype), D)
    dir_p = t["dir"].contiguous()
    rho_p = t["rho"].contiguous() if codec.rho_bits else dir_p
    qjl_p = t["qjl"].contiguous() if qjl else dir_p
    rnorm = t["rnorm"].contiguous() if qjl else t["gamma"]
    _octopus_decode_kernel[(cdiv(T, bt), rows)](
        dir_p, rho_p, t["gamma"].contiguous(), qjl_p, rnorm, tab["lut"], tab["rho_c"], tab["signs"], tab["sketch"], out,
        T, head_count(codec), 1.0 / math.sqrt(D), getattr(codec, "qjl_scale", 0.0), dir_p.shape[-1], rho_p.shape[-1], v,
        ors,
        D=D, NT=codec.n_t, NTP=next_power_of_2(codec.n_t), BT=bt, V=v, DIR_BITS=codec.dir_bits, RHO_BITS=codec.rho_bits,
        QJL=qjl, num_warps=warps, **LAUNCH,
    )
    return out
