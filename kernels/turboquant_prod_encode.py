"""TurboQuant-prod encode + pack in one pass, the kernel twin of `TurboQuantProdCodec._encode` (TurboQuant
paper, Algorithm 2; reference `mmkv/codecs/turboquant_prod.py`).

One program codes BT tokens of one row: n = ||x||, u = H(s * x) / n, (b-1)-bit nearest centroids, the residual
r = s * H(u - c[idx]) back in the original basis, its 1-bit sketch sign(S r) (S the per-head i.i.d. Gaussian d x d
matrix, sign(0) = +1) and gamma = ||r||. The MSE stage rounds like TurboQuant-MSE's kernel (a code can move where u is within an ulp
or two of a boundary); S r is an fp32 matrix product in another summation order than torch's, so a sign may differ where S r is within
rounding of 0 (docs/decisions.md, "Codec kernels").
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.codecs.turboquant_mse import store_norm
from mmkv.kernels.common import LAUNCH, cdiv, device_tables, head_count, jit, rows_of, search, search_table, token_block
from mmkv.kernels.packing import pack_block
from mmkv.kernels.rotation import fwht

# Products with the Gaussian sketch on tensor cores in three TF32 passes (about fp32 accuracy: a sign is only as
# good as S r is accurate near 0); the interpreter computes them in fp32.
SKETCH_PRECISION = "tf32x3"


@jit
def _turboquant_prod_encode_kernel(
    x_ptr, s_ptr, t_ptr, n_ptr, c_ptr, sk_ptr, idx_ptr, qjl_ptr, rnorm_ptr, norm_ptr,
    T, NH, scale, idx_row_bytes, qjl_row_bytes,
    D: tl.constexpr, BT: tl.constexpr, B: tl.constexpr,
    PREC: tl.constexpr, CELLS: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    head = row % NH
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    x = tl.load(x_ptr + row64 * T * D + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :], mask=tmask[:, None], other=0.0)
    xf = x.to(tl.float32)
    norm = tl.sqrt_rn(tl.sum(xf * xf, axis=1))
    inv = tl.math.div_rn(scale, tl.where(norm > 0, norm, 1.0))[:, None]  # 1/n after the rotation
    s = tl.load(s_ptr + head * D + jj).to(tl.float32)
    u = fwht(xf * s[None, :], BT, D) * inv
    idx = search(u, t_ptr, n_ptr, (1 << (B - 1)) - 1, CELLS)  # step 1
    r = fwht(u - tl.load(c_ptr + idx), BT, D) * scale * s[None, :]  # step 2: x1 - Pi^T c[idx]
    # step 3: sign(S r); S^T is read as [k, i] = S[i, k]
    st = tl.load(sk_ptr + head.to(tl.int64) * D * D + jj[None, :] * D + jj[:, None])
    proj = tl.dot(r, st, input_precision=PREC)
    pack_block(idx, idx_ptr, row64 * idx_row_bytes, t0, n_tok, BT, D, D, B - 1, 0, 0, D)
    pack_block((proj >= 0).to(tl.int32), qjl_ptr, row64 * qjl_row_bytes, t0, n_tok, BT, D, D, 1, 0, 0, D)
    tl.store(rnorm_ptr + row64 * T + t0 + tt, tl.sqrt_rn(tl.sum(r * r, axis=1)), mask=tmask)  # step 4
    tl.store(norm_ptr + row64 * T + t0 + tt, norm, mask=tmask)


def supports(codec) -> bool:
    return 16 <= codec.head_dim <= 128


def _tables(codec, device: torch.device) -> dict:
    return device_tables(
        codec, device, "turboquant-prod",
        lambda: {
            "signs": codec.rotation.signs,
            **search_table(codec.mse_q.centroids),
            "c": codec.mse_q.centroids,
            "sketch": codec.sketch.float(),  # [H, m = d, d]
        },
    )


def encode(codec, x: torch.Tensor) -> Encoded:
    """`codec.encode(x)` for TurboQuant-prod on the kernel: x[..., T, D] in any float dtype, already validated."""
    x = x.contiguous()
    *lead, T, D = x.shape
    rows = rows_of(x)
    dev = x.device
    tab = _tables(codec, dev)
    idx_bytes = (T * D * (codec.b - 1) + 7) // 8
    qjl_bytes = (T * D + 7) // 8
    idx = torch.empty(*lead, idx_bytes, dtype=torch.uint8, device=dev)
    qjl = torch.empty(*lead, qjl_bytes, dtype=torch.uint8, device=dev)
    rnorm = torch.empty(*lead, T, dtype=torch.float32, device=dev)
    norm = torch.empty(*lead, T, dtype=torch.float32, device=dev)
    bt = 32 if D <= 64 else 16
    if rows and T:
        _turboquant_prod_encode_kernel[(cdiv(T, bt), rows)](
            x, tab["signs"], tab["t"], tab["n"], tab["c"], tab["sketch"], idx, qjl, rnorm, norm,
            T, head_count(codec), 1.0 / math.sqrt(D), idx_bytes, qjl_bytes,
            D=D, BT=bt, B=codec.b, PREC=SKETCH_PRECISION,
            CELLS=tab["n"].numel() if tab["n"].numel() > 1 else 0, num_warps=4, **LAUNCH,
        )
    where = f"codec {codec.config} (layer {codec.layer})"
    return Encoded(
        str(codec.config), tuple(x.shape), x.dtype,
        {"idx": idx, "qjl": qjl, "rnorm": store_norm(rnorm, codec.norm_bits, where),
         "norm": store_norm(norm, codec.norm_bits, where)},
    )
