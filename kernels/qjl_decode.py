"""QJL unpack + decode to the model dtype, the kernel twin of `QJLCodec._decode` (reference `mmkv/codecs/qjl.py`):
k_hat = sqrt(pi/2)/m * nu * S^T z, the vector whose inner products are the QJL estimator. S^T z is an fp32 product
in another summation order than torch's, so values agree to fp32 rounding (docs/decisions.md, "Codec kernels").
"""

from __future__ import annotations

import torch
import triton.language as tl

from mmkv.kernels.common import LAUNCH, cast_to, cdiv, decode_out, head_count, jit, rows_of, token_block
from mmkv.kernels.packing import unpack_block
from mmkv.kernels.qjl_encode import _tables, supports  # noqa: F401  (same parameter range)
from mmkv.kernels.turboquant_prod_encode import SKETCH_PRECISION


@jit
def _qjl_decode_kernel(
    signs_ptr, norm_ptr, sk_ptr, out_ptr, T, NH, qscale, row_bytes, ORS,
    D: tl.constexpr, M: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    kk = tl.arange(0, MB)
    tmask = tt < n_tok
    sk_base = sk_ptr + (row % NH).to(tl.int64) * M * D
    acc = tl.zeros((BT, D), tl.float32)
    for c in tl.static_range(M // MB):
        z = unpack_block(signs_ptr, row64 * row_bytes, t0, n_tok, BT, MB, M, 1, 0, c * MB, MB).to(tl.float32) * 2 - 1
        sk = tl.load(sk_base + (c * MB + kk)[:, None] * D + jj[None, :])  # S chunk [MB, d]
        acc += tl.dot(z, sk, input_precision=PREC)
    nu = tl.load(norm_ptr + row64 * T + t0 + tt, mask=tmask, other=0.0).to(tl.float32)
    y = (qscale * nu)[:, None] * acc
    off = row64 * ORS + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :]
    tl.store(out_ptr + off, cast_to(y, out_ptr.dtype.element_ty), mask=tmask[:, None])


def decode(codec, enc, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for QJL on the kernel: [..., T, D] in `dtype`."""
    *lead, T, D = enc.shape
    signs = enc.tensors["signs"].contiguous()
    dev = signs.device
    out, ors = decode_out(enc.shape, dtype, dev, out)
    rows = rows_of(out)
    if not rows or not T:
        return out
    bt = 16
    _qjl_decode_kernel[(cdiv(T, bt), rows)](
        signs, enc.tensors["norm"].contiguous(), _tables(codec, dev)["sketch"], out, T, head_count(codec), codec.scale,
        signs.shape[-1], ors, D=D, M=codec.m, MB=min(128, codec.m & -codec.m), BT=bt, PREC=SKETCH_PRECISION,
        num_warps=4, **LAUNCH,
    )
    return out
