"""TurboQuant-prod unpack + decode to the model dtype, the kernel twin of `TurboQuantProdCodec._decode` (Algorithm 2
step 5; reference `mmkv/codecs/turboquant_prod.py`): x_hat = n * (s * H(c[idx]) + sqrt(pi/2)/d * gamma * S^T qjl).
The MSE part is the reference's butterfly; S^T qjl is an fp32 product in another summation order than torch's, so
decoded values agree to fp32 rounding (docs/decisions.md, "Codec kernels").
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from mmkv.kernels.common import LAUNCH, cast_to, cdiv, decode_out, head_count, jit, rows_of, token_block
from mmkv.kernels.packing import unpack_block
from mmkv.kernels.rotation import fwht
from mmkv.kernels.turboquant_prod_encode import SKETCH_PRECISION, _tables, supports  # noqa: F401


@jit
def _turboquant_prod_decode_kernel(
    idx_ptr, qjl_ptr, rnorm_ptr, norm_ptr, c_ptr, s_ptr, sk_ptr, out_ptr,
    T, NH, scale, qjl_scale, idx_row_bytes, qjl_row_bytes, ORS,
    D: tl.constexpr, BT: tl.constexpr, B: tl.constexpr, PREC: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    head = row % NH
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    idx = unpack_block(idx_ptr, row64 * idx_row_bytes, t0, n_tok, BT, D, D, B - 1, 0, 0, D)
    sigma = unpack_block(qjl_ptr, row64 * qjl_row_bytes, t0, n_tok, BT, D, D, 1, 0, 0, D).to(tl.float32) * 2 - 1
    s = tl.load(s_ptr + head * D + jj).to(tl.float32)
    mse = fwht(tl.load(c_ptr + idx), BT, D) * scale * s[None, :]
    sk = tl.load(sk_ptr + head.to(tl.int64) * D * D + jj[:, None] * D + jj[None, :])  # S [m, d]
    qjl = tl.dot(sigma, sk, input_precision=PREC)  # S^T qjl, per token
    rn = tl.load(rnorm_ptr + row64 * T + t0 + tt, mask=tmask, other=0.0).to(tl.float32)
    nm = tl.load(norm_ptr + row64 * T + t0 + tt, mask=tmask, other=0.0).to(tl.float32)
    y = nm[:, None] * (mse + (qjl_scale * rn)[:, None] * qjl)
    off = row64 * ORS + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :]
    tl.store(out_ptr + off, cast_to(y, out_ptr.dtype.element_ty), mask=tmask[:, None])


def decode(codec, enc, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for TurboQuant-prod on the kernel: [..., T, D] in `dtype`."""
    *lead, T, D = enc.shape
    t = enc.tensors
    dev = t["idx"].device
    tab = _tables(codec, dev)
    out, ors = decode_out(enc.shape, dtype, dev, out)
    rows = rows_of(out)
    if not rows or not T:
        return out
    idx, qjl = t["idx"].contiguous(), t["qjl"].contiguous()
    bt = 32 if D <= 64 else 16
    _turboquant_prod_decode_kernel[(cdiv(T, bt), rows)](
        idx, qjl, t["rnorm"].contiguous(), t["norm"].contiguous(), tab["c"], tab["signs"], tab["sketch"], out,
        T, head_count(codec), 1.0 / math.sqrt(D), codec.qjl_scale, idx.shape[-1], qjl.shape[-1], ors,
        D=D, BT=bt, B=codec.b, PREC=SKETCH_PRECISION, num_warps=4, **LAUNCH,
    )
    return out
