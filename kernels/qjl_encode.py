"""QJL encode + pack, the kernel twin of `QJLCodec._encode` (QJL paper, Def. 3.1; reference
`mmkv/codecs/qjl.py`): per token the m = bits * d signs of S k (S the per-head i.i.d. Gaussian m x d matrix,
sign(0) = +1), produced up to 128 rows of S at a time and packed straight into the token's bytes, and nu = ||k||.
S k is an fp32 product in another summation order than torch's, so a sign may differ where S k is within rounding
of 0 (docs/decisions.md, "Codec kernels").
"""

from __future__ import annotations

import torch
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.codecs.turboquant_mse import store_norm
from mmkv.kernels.common import LAUNCH, cdiv, device_tables, head_count, jit, rows_of, token_block
from mmkv.kernels.packing import pack_block
from mmkv.kernels.turboquant_prod_encode import SKETCH_PRECISION


@jit
def _qjl_encode_kernel(
    x_ptr, sk_ptr, signs_ptr, norm_ptr, T, NH, row_bytes,
    D: tl.constexpr, M: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    kk = tl.arange(0, MB)
    tmask = tt < n_tok
    x = tl.load(x_ptr + row64 * T * D + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :], mask=tmask[:, None], other=0.0)
    x = x.to(tl.float32)
    sk_base = sk_ptr + (row % NH).to(tl.int64) * M * D
    for c in tl.static_range(M // MB):
        st = tl.load(sk_base + (c * MB + kk)[None, :] * D + jj[:, None])  # S^T chunk [d, MB]
        bits = (tl.dot(x, st, input_precision=PREC) >= 0).to(tl.int32)
        pack_block(bits, signs_ptr, row64 * row_bytes, t0, n_tok, BT, MB, M, 1, 0, c * MB, MB)
    tl.store(norm_ptr + row64 * T + t0 + tt, tl.sqrt_rn(tl.sum(x * x, axis=1)), mask=tmask)


def supports(codec) -> bool:
    return 16 <= codec.head_dim <= 256 and (codec.head_dim & (codec.head_dim - 1)) == 0


def _tables(codec, device: torch.device) -> dict:
    return device_tables(codec, device, "qjl", lambda: {"sketch": codec.sketch.float()})  # [H, m, d]


def encode(codec, x: torch.Tensor) -> Encoded:
    """`codec.encode(x)` for QJL on the kernel: x[..., T, D] in any float dtype, already validated."""
    x = x.contiguous()
    *lead, T, D = x.shape
    rows = rows_of(x)
    dev = x.device
    m = codec.m
    row_bytes = (T * m + 7) // 8
    signs = torch.empty(*lead, row_bytes, dtype=torch.uint8, device=dev)
    norm = torch.empty(*lead, T, dtype=torch.float32, device=dev)
    bt = 16
    if rows and T:
        _qjl_encode_kernel[(cdiv(T, bt), rows)](
            x, _tables(codec, dev)["sketch"], signs, norm, T, head_count(codec), row_bytes,
            D=D, M=m, MB=min(128, m & -m), BT=bt, PREC=SKETCH_PRECISION, num_warps=4, **LAUNCH,
        )
    where = f"codec {codec.config} (layer {codec.layer})"
    tensors = {"signs": signs, "norm": store_norm(norm, codec.norm_bits, where)}
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors)
