"""QVG k-means assignment, the kernel twin of `mmkv.codecs.qvg.assign_reference` (the release's
`_euclid_assign_kernel` in `quant_videogen/kmeans/`).

One program takes BN points of one problem (a (batch, head) pair of a span) and walks the centres in tiles of BK:
d = max((||x||^2 + ||c||^2) - 2 x.c, 0) with the cross term from `tl.dot` (bf16 operands, fp32 accumulation on GPU,
as released; fp32 operands with IEEE products for fp32/fp16 inputs and under the interpreter), a first-minimum argmin
inside a tile and a strictly-smaller update across tiles, so ties go to the lowest index like `torch.argmin`. The
squared norms come precomputed in fp32 (the reference's tensors), so ids can only differ from the reference where the
dot product's summation order moves a distance across a near-tie.
"""

from __future__ import annotations

import torch
import triton.language as tl

from mmkv.kernels.common import INTERPRET, LAUNCH, cdiv, jit


@jit
def _assign_kernel(
    x_ptr, c_ptr, xsq_ptr, csq_ptr, ids_ptr,
    N,
    K: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MMA: tl.constexpr,
):
    pid_n = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    dd = tl.arange(0, D)
    rmask = rows < N
    x = tl.load(x_ptr + p * N * D + rows.to(tl.int64)[:, None] * D + dd[None, :], mask=rmask[:, None], other=0.0)
    xsq = tl.load(xsq_ptr + p * N + rows, mask=rmask, other=0.0)
    if not MMA:
        x = x.to(tl.float32)
    best = tl.full([BN], float("inf"), tl.float32)
    best_id = tl.zeros([BN], tl.int32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        c = tl.load(c_ptr + p * K * D + kk.to(tl.int64)[:, None] * D + dd[None, :], mask=kmask[:, None], other=0.0)
        csq = tl.load(csq_ptr + p * K + kk, mask=kmask, other=0.0)
        if MMA:
            dot = tl.dot(x, tl.trans(c))
        else:
            dot = tl.dot(x, tl.trans(c.to(tl.float32)), input_precision="ieee")
        d = (xsq[:, None] + csq[None, :]) - 2.0 * dot
        d = tl.maximum(d, 0.0)
        d = tl.where(kmask[None, :], d, float("inf"))
        m = tl.min(d, axis=1)
        am = tl.argmin(d, axis=1, tie_break_left=True)
        upd = m < best
        best = tl.where(upd, m, best)
        best_id = tl.where(upd, am + k0, best_id)
    tl.store(ids_ptr + p * N + rows, best_id.to(tl.int64), mask=rmask)


def supports_shape(head_dim: int, centroids: int) -> bool:
    # tl.dot needs every dim >= 16 and power-of-two blocks; D is loaded whole
    return head_dim >= 16 and (head_dim & (head_dim - 1)) == 0 and head_dim <= 256 and centroids >= 1


def assign(points: torch.Tensor, centroids: torch.Tensor, x_sq: torch.Tensor, c_sq: torch.Tensor) -> torch.Tensor:
    """`assign_reference` on the kernel: points [P, N, D] (bf16/fp16/fp32), centroids [P, K, D] bf16, x_sq [P, N],
    c_sq [P, K] fp32 -> ids int64 [P, N]."""
    p, n, d = points.shape
    k = centroids.shape[1]
    ids = torch.empty(p, n, dtype=torch.int64, device=points.device)
    if not p or not n:
        return ids
    mma = points.dtype == torch.bfloat16 and not INTERPRET  # the interpreter has no bf16 matrix product
    bn, bk = (64, 64) if d <= 128 else (32, 32)
    _assign_kernel[(cdiv(n, bn), p)](
        points.contiguous(), centroids.contiguous(), x_sq.contiguous(), c_sq.contiguous(), ids,
        n, K=k, D=d, BN=bn, BK=bk, MMA=mma, num_warps=4, **LAUNCH,
    )
    return ids
