"""QVG k-means centre update, the kernel twin of `mmkv.codecs.qvg.update_centroids` (the release's
`quant_videogen/kmeans/kmeans_euclid.py` update step).

Two launches take the place of the reference's eleven torch ops and its fp64 [P, N, D + 1] staging copy of the points
(58 MB for one Wan head group's 4,680-token span):
1. `_sums_kernel`: one program takes BT points of one problem and adds each point's channels, in fp64, into its
   centre's row of `sums` [P, K, D], and a 1 into `counts` [P, K] (int32), with atomic adds. Their order does not
   matter where the reference's own argument holds: fp64 sums of bf16 / fp16 points (and of fp32 points of ordinary
   range) are exact, so the sums are the reference's bit for bit on any device; the reference's scatter on CUDA
   adds atomically too.
2. `_finish_kernel`: per centre, mean = sums / max(count, 1) in fp64, rounded to fp32 and then to bf16 as the
   reference does, or the old centre where the count is 0.
"""

from __future__ import annotations

import torch
import triton.language as tl

from mmkv.kernels.common import LAUNCH, cast_to, cdiv, jit


@jit
def _sums_kernel(x_ptr, ids_ptr, sums_ptr, counts_ptr, N, K, D: tl.constexpr, BT: tl.constexpr):
    pid = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < N
    dd = tl.arange(0, D)
    x = tl.load(x_ptr + p * N * D + rows.to(tl.int64)[:, None] * D + dd[None, :], mask=rmask[:, None], other=0.0)
    ids = tl.load(ids_ptr + p * N + rows, mask=rmask, other=0)
    centre = p * K + ids.to(tl.int64)
    tl.atomic_add(sums_ptr + centre[:, None] * D + dd[None, :], x.to(tl.float64), mask=rmask[:, None], sem="relaxed")
    tl.atomic_add(counts_ptr + centre, tl.full([BT], 1, tl.int32), mask=rmask, sem="relaxed")


@jit
def _finish_kernel(sums_ptr, counts_ptr, old_ptr, out_ptr, K, D: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    kk = pid * BK + tl.arange(0, BK)
    kmask = kk < K
    dd = tl.arange(0, D)
    off = (p * K + kk.to(tl.int64))[:, None] * D + dd[None, :]
    count = tl.load(counts_ptr + p * K + kk, mask=kmask, other=0)
    sums = tl.load(sums_ptr + off, mask=kmask[:, None], other=0.0)
    mean = sums / tl.maximum(count, 1).to(tl.float64)[:, None]  # fp64 division: IEEE, as torch's
    mean = cast_to(mean.to(tl.float32), tl.bfloat16)
    old = tl.load(old_ptr + off, mask=kmask[:, None], other=0.0)
    tl.store(out_ptr + off, tl.where(count[:, None] > 0, mean, old), mask=kmask[:, None])


def supports_shape(head_dim: int) -> bool:
    return head_dim >= 1 and (head_dim & (head_dim - 1)) == 0


def update(points: torch.Tensor, ids: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`update_centroids` on the kernels: points [P, N, D] (bf16/fp16/fp32), ids [P, N] int64, old centres
    [P, K, D] bf16 -> (new centres [P, K, D] bf16, counts [P, K] int32: the reference's int64 counts, not widened,
    as k-means only reads the centres)."""
    p, n, d = points.shape
    k = old.shape[1]
    dev = points.device
    # sums and counts share one zeroed buffer: one fill launch instead of two, at every k-means iteration
    buf = torch.zeros(p * k * d * 8 + p * k * 4, dtype=torch.uint8, device=dev)
    sums = buf[: p * k * d * 8].view(torch.float64).view(p, k, d)
    counts = buf[p * k * d * 8 :].view(torch.int32).view(p, k)
    new = torch.empty_like(old)
    if not p or not k:
        return new, counts
    bt = max(1, min(64, 8192 // d))
    if n:
        _sums_kernel[(cdiv(n, bt), p)](
            points.contiguous(), ids.contiguous(), sums, counts, n, k, D=d, BT=bt, num_warps=4, **LAUNCH,
        )
    bk = max(1, min(32, 4096 // d))
    _finish_kernel[(cdiv(k, bk), p)](sums, counts, old.contiguous(), new, k, D=d, BK=bk, num_warps=4, **LAUNCH)
    return new, counts
