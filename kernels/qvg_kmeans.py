"""QVG k-means on the kernels, the twin of `mmkv.codecs.qvg.kmeans` (the release's `quant_videogen/kmeans/`: the
`_euclid_assign_kernel` assignment and the `kmeans_euclid.py` centre update).

Two launches an iteration, where the reference runs about twenty torch ops (norms, distances, argmin, the fp64
scatter of the update, the early stop's count and choice):
1. `_step_kernel`: one program takes BN points of one problem (a (batch, head) pair of a span). It forms their fp32
   squared norms, walks the centres in tiles of BK (their norms formed by the previous iteration's finish, or for
   the first centres by `_norms_kernel`: formed in the loop they took twice the registers) for
   d = max((||x||^2 + ||c||^2) - 2 x.c, 0), the cross term from `tl.dot` (bf16 operands, fp32 accumulation on GPU, as
   released; fp32 operands with IEEE products for fp32/fp16 inputs and under the interpreter), a first-minimum argmin
   inside a tile and a strictly-smaller update across tiles, so ties go to the lowest index like `torch.argmin`.
   It stores the ids (uint8) and adds each point's channels in fp64 into its centre's row of `sums` and a 1 into
   `counts` with atomic adds (the update's sums, from the points already loaded), and from the second iteration on
   the number of ids that changed into one counter.
2. `_finish_kernel`: per centre, mean = sums / max(count, 1) in fp64, rounded to fp32 and then to bf16 as the
   reference does, or the old centre where the count is 0, and the new centres' norms; in the last iteration the
   early stop's choice between those means and the old centres (changed < `stop_limit`, the reference's rule as a
   count); then it zeroes its rows
   of `sums` and `counts` for the next iteration, so one zeroed buffer serves every iteration.

The fp64 sums of bf16 / fp16 points (and of fp32 points of ordinary range) are exact, so their atomic order does not
matter and the centres are the reference's means of the same ids on any device. The norms and the dot products sum
in another order than torch's, so ids can differ from the reference's only where that moves a distance across a
near-tie; every step is the algorithm's (tests/test_codec_qvg.py checks the trajectory step by step).
"""

from __future__ import annotations

import torch
import triton.language as tl

from mmkv.codecs.qvg import stop_limit
from mmkv.kernels.common import INTERPRET, LAUNCH, cast_to, cdiv, jit


@jit
def _step_kernel(
    x_ptr, c_ptr, csq_ptr, ids_ptr, prev_ptr, sums_ptr, counts_ptr, changed_ptr,
    N,
    K: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr, MMA: tl.constexpr,
    COMPARE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    dd = tl.arange(0, D)
    rmask = rows < N
    x = tl.load(x_ptr + p * N * D + rows.to(tl.int64)[:, None] * D + dd[None, :], mask=rmask[:, None], other=0.0)
    xf = x.to(tl.float32)
    xsq = tl.sum(xf * xf, axis=1)
    if not MMA:
        x = xf
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
    tl.store(ids_ptr + p * N + rows, best_id.to(tl.uint8), mask=rmask)
    tl.atomic_add(counts_ptr + p * K + best_id.to(tl.int64), tl.full([BN], 1, tl.int32), mask=rmask, sem="relaxed")
    # The update's sums, SUB points at a time, reading the points and their ids back (from L1 / L2: the ids were
    # just stored, the barrier makes them visible to the whole program): an fp64 [BN, D] operand at once would take
    # every register (255, with spills, in the separate sums kernel this replaced), a quarter of the occupancy.
    tl.debug_barrier()
    for r0 in range(0, BN, SUB):
        rs = pid_n * BN + r0 + tl.arange(0, SUB)
        smask = rs < N
        ids_s = tl.load(ids_ptr + p * N + rs, mask=smask, other=0).to(tl.int64)
        xs = tl.load(x_ptr + p * N * D + rs.to(tl.int64)[:, None] * D + dd[None, :], mask=smask[:, None], other=0.0)
        tl.atomic_add(sums_ptr + (p * K + ids_s)[:, None] * D + dd[None, :], xs.to(tl.float64), mask=smask[:, None],
                      sem="relaxed")
    if COMPARE:
        prev = tl.load(prev_ptr + p * N + rows, mask=rmask, other=0).to(tl.int32)
        tl.atomic_add(changed_ptr, tl.sum(((prev != best_id) & rmask).to(tl.int32)), sem="relaxed")


@jit
def _norms_kernel(c_ptr, csq_ptr, K, D: tl.constexpr, BK: tl.constexpr):
    """||c||^2 in fp32 of BK centres (the first iteration's; the finish kernel forms the later ones')."""
    pid = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    kk = pid * BK + tl.arange(0, BK)
    kmask = kk < K
    dd = tl.arange(0, D)
    c = tl.load(c_ptr + (p * K + kk.to(tl.int64))[:, None] * D + dd[None, :], mask=kmask[:, None], other=0.0)
    c = c.to(tl.float32)
    tl.store(csq_ptr + p * K + kk, tl.sum(c * c, axis=1), mask=kmask)


@jit(also=("limit",))  # the stop's count moves with the span's length (an AAR's scales): not a compile key
def _finish_kernel(
    sums_ptr, counts_ptr, old_ptr, out_ptr, csq_ptr, changed_ptr, limit, K,
    D: tl.constexpr, BK: tl.constexpr, SELECT: tl.constexpr, NORMS: tl.constexpr,
):
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
    new = tl.where(count[:, None] > 0, mean, old)
    if SELECT:  # the last iteration: an early stop keeps the centres its ids were assigned to
        new = tl.where(tl.load(changed_ptr) < limit, old, new)
    tl.store(out_ptr + off, new, mask=kmask[:, None])
    if NORMS:  # the next iteration's centre norms
        nf = new.to(tl.float32)
        tl.store(csq_ptr + p * K + kk, tl.sum(nf * nf, axis=1), mask=kmask)
    tl.store(sums_ptr + off, tl.zeros([BK, D], tl.float64), mask=kmask[:, None])
    tl.store(counts_ptr + p * K + kk, tl.zeros([BK], tl.int32), mask=kmask)


def supports_shape(head_dim: int, centroids: int) -> bool:
    # tl.dot needs every dim >= 16 and power-of-two blocks; D is loaded whole; ids are stored as uint8
    return head_dim >= 16 and (head_dim & (head_dim - 1)) == 0 and head_dim <= 256 and 1 <= centroids <= 256


def kmeans(points: torch.Tensor, init: torch.Tensor, iters: int, tol: float,
           trace: list | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`mmkv.codecs.qvg.kmeans` on the kernels: points [P, N, D] (bf16/fp16/fp32), init centres [P, K, D] bf16 ->
    (ids uint8 [P, N], centres bf16 [P, K, D], iterations run). One zeroed buffer (sums, counts and a changed-ids
    counter an iteration) is the only torch launch, and the first centres' norms one more kernel; no host sync
    unless `iters` > 2 (the early stop of an iteration before the last is read on the host, as the reference
    does)."""
    p, n, d = points.shape
    k = init.shape[1]
    dev = points.device
    points = points.contiguous()
    # sums [P, K, D] fp64, counts [P, K] int32 and one int32 counter an iteration, in one zeroed allocation
    buf = torch.zeros(p * k * d * 8 + p * k * 4 + 4 * iters, dtype=torch.uint8, device=dev)
    sums = buf[: p * k * d * 8].view(torch.float64).view(p, k, d)
    counts = buf[p * k * d * 8 : p * k * d * 8 + p * k * 4].view(torch.int32).view(p, k)
    changed = buf[p * k * d * 8 + p * k * 4 :].view(torch.int32)
    limit = stop_limit(p * n, tol)
    mma = points.dtype == torch.bfloat16 and not INTERPRET  # the interpreter has no bf16 matrix product
    # tiles that keep the step and the finish out of spills at D 128 (ptxas sm_90): 64 x 64 on the tensor cores
    # (128 registers); 32 x 16 for the fp32 products of fp16 / fp32 points (64 x 64 spilled 14 KB a thread); 8 centres
    # a finish program (32 spilled 156 bytes)
    bn, bk = ((64, 64) if d <= 128 else (32, 32)) if mma else (32, 16)
    bkf = max(1, min(8, 1024 // d))
    c = init.contiguous()
    csq = torch.empty(2, p, k, dtype=torch.float32, device=dev)  # this iteration's centre norms and the next's
    if p and k:
        _norms_kernel[(cdiv(k, bkf), p)](c, csq[0], k, D=d, BK=bkf, num_warps=4, **LAUNCH)
    prev = None
    for it in range(iters):
        ids = torch.empty(p, n, dtype=torch.uint8, device=dev)
        last = it + 1 == iters
        if p and n:
            _step_kernel[(cdiv(n, bn), p)](
                points, c, csq[it % 2], ids, prev if prev is not None else ids, sums, counts, changed[it:],
                n, K=k, D=d, BN=bn, BK=bk, SUB=min(bn, 2048 // d), MMA=mma, COMPARE=prev is not None,
                num_warps=4, **LAUNCH,
            )
        if trace is not None:
            trace.append((points, c, ids))
        new = torch.empty_like(c)
        if p and k:
            _finish_kernel[(cdiv(k, bkf), p)](
                sums, counts, c, new, csq[(it + 1) % 2], changed[it:], limit, k,
                D=d, BK=bkf, SELECT=last and prev is not None, NORMS=not last, num_warps=4, **LAUNCH,
            )
        if prev is not None and not last and int(changed[it].item()) < limit:
            return ids, c, it + 1
        if last:
            return ids, new, iters
        c, prev = new, ids
    return ids, c, iters
