"""TCQ encode: the tail-biting Viterbi search in one kernel, the twin of `mmkv.codecs.tcq.viterbi` (QTIP's bitshift
trellis; reference `mmkv/codecs/tcq.py`). The rotation is the Hadamard kernel (`unit_rotated`); the gain and the
bit packing around the search are the reference's torch code (`TCQCodec.unit_from_codes`, `_pack`).

One program walks `vectors` vectors (one by default) with their 2^L path costs each on chip, as a [vectors, 2^L]
tile (launches of at most `vectors_a_launch` vectors reuse one back-pointer scratch). A step of
k = K or K + 1 bits: the costs viewed as [2^K, 2^L / 2^K] are reduced over their first axis (min and argmin, the
lowest index on ties, as torch's `min`); a wide step folds the two halves of that result once more, which is the same
minimum over 2^(K+1) predecessors and keeps every shape constant. The back-pointers (k bits a state column and step)
go to a per-program scratch in global memory and are read back by the same program after a barrier. Pass one runs
on the steps rotated by half their number and backtracks to the first step's state; pass two is constrained to start
and end with its overlap bits, and its backtrack writes the codes. The squared distances are computed as the
reference does, (u0 - t0)^2 + (u1 - t1)^2 without fused multiply-adds (`LAUNCH`), so the path costs, and with them
the codes, are the reference's bit for bit wherever both see the same u.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.kernels.common import LAUNCH, device_tables, jit
from mmkv.kernels.rotation import rotate
from mmkv.kernels.tcq_decode import supports  # noqa: F401  (same range as the decoder)

# Vectors a launch. Each has its own back-pointer scratch (steps x 2^(L-k) int16: 2 KB at 2 bits, L = 8), and a
# launch takes as many as SCRATCH_BYTES hold: one Wan head group's 56,160 vectors go in one launch (115 MB of
# scratch at 2 bits). In launches of 4,096 (14 for that tensor, one after another) its encode took 3.83 ms
# against 3.16 ms in one launch, 10.06 against 9.14 ms at 4 bits (docs/perf.md, the TCQ launch variants).
SCRATCH_BYTES = 128 << 20
PROGRAMS: int | None = None  # a fixed count of vectors a launch instead (tests)


def vectors_a_launch(codec) -> int:
    if PROGRAMS is not None:
        return PROGRAMS
    return max(1, SCRATCH_BYTES // (codec.steps * ((1 << codec.L) >> codec.k) * 2))


@triton.jit
def _pair_costs(u0, u1, tab0, tab1):
    """Squared distances [NV, S] of each vector's pair (u0, u1) [NV] to every table row (no FMA: `LAUNCH`)."""
    d0 = u0[:, None] - tab0[None, :]
    d1 = u1[:, None] - tab1[None, :]
    return d0 * d0 + d1 * d1


@triton.jit
def _step_costs(u_ptr, ubase, valid, src, tab0, tab1):
    """Squared distances [NV, S] of each vector's step `src` to every table row."""
    u0 = tl.load(u_ptr + ubase + 2 * src, mask=valid, other=0.0)
    u1 = tl.load(u_ptr + ubase + 2 * src + 1, mask=valid, other=0.0)
    return _pair_costs(u0, u1, tab0, tab1)


@triton.jit
def _trellis_pass(u_ptr, ubase, valid, wide_ptr, bp_ptr, bbase, tab0, tab1, h, ROLL: tl.constexpr,
                  CONSTRAIN: tl.constexpr, STEPS: tl.constexpr, K: tl.constexpr, L: tl.constexpr,
                  WIDE: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr):
    """The path costs [NV, S] after every step (steps taken from (t - ROLL) mod STEPS), back-pointers stored.
    PREFETCH: each step's input pair is loaded one step ahead, so that its load is not on the step's critical path
    (the same values, so the same costs)."""
    S: tl.constexpr = 1 << L
    M: tl.constexpr = S >> K
    offs = tl.arange(0, S)
    src0 = (STEPS - ROLL) % STEPS
    cost = _step_costs(u_ptr, ubase, valid, src0, tab0, tab1)
    if CONSTRAIN:
        k0 = K + tl.load(wide_ptr + src0)
        cost = tl.where((offs[None, :] >> k0) == h[:, None], cost, float("inf"))
    cols = tl.arange(0, M)
    if PREFETCH:
        src1 = (1 + STEPS - ROLL) % STEPS
        n0 = tl.load(u_ptr + ubase + 2 * src1, mask=valid, other=0.0)
        n1 = tl.load(u_ptr + ubase + 2 * src1 + 1, mask=valid, other=0.0)
    for t in range(1, STEPS):
        src = (t + STEPS - ROLL) % STEPS
        if PREFETCH:  # this step's pair came a step ahead; the next step's load goes out now
            dist = _pair_costs(n0, n1, tab0, tab1)
            nxt = (t + 1 + STEPS - ROLL) % STEPS  # one load past the last step: in range, unused
            n0 = tl.load(u_ptr + ubase + 2 * nxt, mask=valid, other=0.0)
            n1 = tl.load(u_ptr + ubase + 2 * nxt + 1, mask=valid, other=0.0)
        else:
            dist = _step_costs(u_ptr, ubase, valid, src, tab0, tab1)
        c3 = tl.reshape(cost, (NV, 1 << K, M))
        best = tl.min(c3, axis=1)
        arg = tl.argmin(c3, axis=1, tie_break_left=True)
        if WIDE:  # a wide step: the minimum over 2^(K+1) predecessors is the lower of the two halves of `best`
            wide = tl.load(wide_ptr + src)
            lo_b, hi_b = tl.split(tl.permute(tl.reshape(best, (NV, 2, M // 2)), (0, 2, 1)))
            lo_a, hi_a = tl.split(tl.permute(tl.reshape(arg, (NV, 2, M // 2)), (0, 2, 1)))
            take_hi = (hi_b < lo_b) | ((hi_b == lo_b) & (2 * hi_a + 1 < 2 * lo_a))
            fold_b = tl.where(take_hi, hi_b, lo_b)
            fold_a = tl.where(take_hi, 2 * hi_a + 1, 2 * lo_a)
            best = tl.where(wide > 0, tl.reshape(tl.join(fold_b, fold_b), (NV, M)), best)
            arg = tl.where(wide > 0, tl.reshape(tl.join(fold_a, fold_a), (NV, M)), arg)
        tl.store(bp_ptr + bbase[:, None] + t * M + cols[None, :], arg.to(tl.int16))
        cost = tl.reshape(best[:, :, None] + tl.reshape(dist, (NV, M, 1 << K)), (NV, S))
    return cost


@triton.jit
def _backtrack(state, valid, wide_ptr, bp_ptr, bbase, codes_ptr, cbase, ROLL: tl.constexpr, STOP,
               WRITE: tl.constexpr, STEPS: tl.constexpr, K: tl.constexpr, L: tl.constexpr):
    """Walk the back-pointers from the last step's `state` [NV] down to step STOP; returns the states there.
    WRITE: store each step's code (its low k bits)."""
    M: tl.constexpr = (1 << L) >> K
    for r in range(0, STEPS - STOP):
        t = STEPS - 1 - r
        k = K + tl.load(wide_ptr + (t + STEPS - ROLL) % STEPS)
        if WRITE:
            tl.store(codes_ptr + cbase + t, state & ((1 << k) - 1), mask=valid)
        if t > STOP:
            j = tl.load(bp_ptr + bbase + t * M + (state >> K)).to(tl.int32)
            state = (j << (L - k)) | (state >> k)
    return state


@jit
def _tcq_viterbi_kernel(u_ptr, table_ptr, wide_ptr, bp_ptr, codes_ptr, first, n,
                        STEPS: tl.constexpr, K: tl.constexpr, L: tl.constexpr, WIDE: tl.constexpr,
                        NV: tl.constexpr, PREFETCH: tl.constexpr):
    S: tl.constexpr = 1 << L
    M: tl.constexpr = S >> K
    HALF: tl.constexpr = STEPS // 2
    pid = tl.program_id(0)
    offs = tl.arange(0, S)
    tab0 = tl.load(table_ptr + 2 * offs)
    tab1 = tl.load(table_ptr + 2 * offs + 1)
    slot = pid * NV + tl.arange(0, NV)  # this launch's vectors, one back-pointer scratch each
    vec = first + slot
    valid = vec < n
    bbase = slot.to(tl.int64) * STEPS * M
    k0 = K + tl.load(wide_ptr)
    low = (1 << (L - k0)) - 1
    ubase = vec.to(tl.int64) * (2 * STEPS)
    cbase = vec.to(tl.int64) * STEPS
    cost = _trellis_pass(u_ptr, ubase, valid, wide_ptr, bp_ptr, bbase, tab0, tab1, 0, HALF, False, STEPS, K, L,
                         WIDE, NV, PREFETCH)
    tl.debug_barrier()
    state = _backtrack(tl.argmin(cost, axis=1, tie_break_left=True).to(tl.int32), valid, wide_ptr, bp_ptr, bbase,
                       codes_ptr, cbase, HALF, HALF, False, STEPS, K, L)
    h = state >> k0
    tl.debug_barrier()
    cost = _trellis_pass(u_ptr, ubase, valid, wide_ptr, bp_ptr, bbase, tab0, tab1, h, 0, True, STEPS, K, L,
                         WIDE, NV, PREFETCH)
    cost = tl.where((offs[None, :] & low) == h[:, None], cost, float("inf"))
    tl.debug_barrier()
    _backtrack(tl.argmin(cost, axis=1, tie_break_left=True).to(tl.int32), valid, wide_ptr, bp_ptr, bbase, codes_ptr,
               cbase, 0, 0, True, STEPS, K, L)


def viterbi(codec, u: torch.Tensor, *, warps: int = 1, vectors: int = 1, prefetch: bool = False,
            programs: int | None = None) -> torch.Tensor:
    """`mmkv.codecs.tcq.viterbi` on the kernel: u [..., T, D] fp32 -> codes [..., T, steps] int64. Launch settings
    (the codes do not depend on them): `warps` a program; `vectors` (a power of two) a program, searched side by side
    as an [vectors, 2^L] tile; `prefetch`: each step's inputs loaded one step ahead; `programs`: vectors a launch
    (default `vectors_a_launch`), each with its own back-pointer scratch of steps x 2^(L-k) int16."""
    if vectors < 1 or vectors & (vectors - 1):
        raise ValueError(f"tcq_encode: vectors a program must be a power of two, got {vectors}")
    per = vectors_a_launch(codec) if programs is None else programs
    if isinstance(per, bool) or not isinstance(per, int) or per < 1:
        raise ValueError(f"tcq_encode: programs (vectors a launch) must be a positive int, got {programs!r}")
    flat = u.reshape(-1, codec.steps, 2).contiguous()
    n = flat.shape[0]
    codes = torch.zeros(n, codec.steps, dtype=torch.int32, device=u.device)
    if n:
        tab = device_tables(codec, u.device, "tcq-encode", lambda: {
            "table": codec.table.reshape(-1), "wide": codec.wide.to(torch.int32)})
        per_launch = min(n, per)
        back = torch.empty(triton.cdiv(per_launch, vectors) * vectors, codec.steps, (1 << codec.L) >> codec.k,
                           dtype=torch.int16, device=u.device)
        for first in range(0, n, per):  # the back-pointer scratch reused per launch
            _tcq_viterbi_kernel[(triton.cdiv(min(per, n - first), vectors),)](
                flat, tab["table"], tab["wide"], back, codes, first, min(n, first + per),
                STEPS=codec.steps, K=codec.k, L=codec.L, WIDE=codec.hi > 0, NV=vectors, PREFETCH=bool(prefetch),
                num_warps=warps, **LAUNCH,
            )
    return codes.to(torch.int64).view(*u.shape[:-1], codec.steps)


def unit_rotated(codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`codec.unit_rotated(x)` with the rotation H(s * x) in one launch (`mmkv.kernels.rotation.rotate`, the same
    butterfly, so bit-identical), where the torch butterfly takes three ops a stage."""
    signs = device_tables(codec, x.device, "tcq-signs", lambda: {"signs": codec.rotation.signs})["signs"]
    return codec.unit_rotated(x, rotate(x, signs))


def encode(codec, x: torch.Tensor, *, warps: int = 1, vectors: int = 1, prefetch: bool = False,
           programs: int | None = None) -> Encoded:
    """`codec.encode(x)` for TCQ with the search on the kernel: x[..., T, D] in any float dtype, already validated.
    `warps`, `vectors`, `prefetch`, `programs`: launch settings of `viterbi` (the codes do not depend on them)."""
    r, u = unit_rotated(codec, x.float())
    codes = viterbi(codec, u, warps=warps, vectors=vectors, prefetch=prefetch, programs=programs)
    u_hat = codec.unit_from_codes(codes)
    gain = (r * u_hat).sum(-1) / (u_hat * u_hat).sum(-1)
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, codec._pack(codes, gain))
