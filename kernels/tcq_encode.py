"""TCQ encode: the tail-biting Viterbi search in one kernel, the twin of `mmkv.codecs.tcq.viterbi` (QTIP's bitshift
trellis; reference `mmkv/codecs/tcq.py`). The rotation is the Hadamard kernel and the norm the reference's torch call
(`rotated`); the search reads r and ||x|| and forms the unit vector u as the reference rounds it (`_unit_scale`), so
that u is never written; u_hat is rebuilt from the codes, the least-squares gain taken and the codes packed, where the
reference runs `TCQCodec.unit_from_codes`, the gain and `_pack` as some twenty torch ops (codecs with wide steps still
do): by default in the lane search's last backtrack (`DEFAULT_FUSED`, `backtrack_fits`), else by one more kernel after
the search (`finish`).

One program walks `vectors` vectors (`vectors_a_program`: 4 at L <= 8, else 1) with their 2^L path costs each on chip,
as a [vectors, 2^L] tile (launches of at most `vectors_a_launch` vectors reuse one back-pointer scratch). A step of
k = K or K + 1 bits: the costs viewed as [2^K, 2^L / 2^K] are reduced over their first axis (min and argmin, the lowest
index on ties, as torch's `min`); a wide step folds the two halves of that result once more, which is the same minimum
over 2^(K+1) predecessors and keeps every shape constant. The back-pointers (k bits a state column and step) go to a
per-program scratch in global memory and are read back by the same program after a barrier. Pass one runs on the steps
around the first (`mmkv.codecs.tcq.pass_one_window`: 32 of 64 at d = 128) and backtracks to the first step's state;
pass two is constrained to start and end with its overlap bits, and its backtrack writes the codes. The squared
distances are computed as the reference does, (u0 - t0)^2 + (u1 - t1)^2 without fused multiply-adds (`LAUNCH`), so
the path costs, and with them the codes, are the reference's bit for bit wherever both see the same u.

Where L = 2k and no step is wide (the 2-bit default, L = 8, k = 4), a second search (`layout="lanes"`) lays the costs
out so that no step needs shared memory or a barrier: the 2^L costs of a vector, viewed as [2^k rows, 2^k columns]
(state = row * 2^k + column), go one column to a lane, the column's 2^k rows held by the lane as a tuple of
registers. A step's predecessors of the new states in row c are exactly column c, so the lane's min and argmin over
its rows is the step's reduction, with no exchange; the new cost of (row c, column c') is that minimum of lane c plus
the distance, which lane c' reads with one warp shuffle a row (`tl.gather` within a warp). The back-pointers are one
byte a lane and step; the backtracks load a step's back-pointers lane by lane and pick the state's column with a
shuffle, so that no load waits on the step before (`_lanes_backtrack`). Compiled for sm_90 a step is about 87
instructions a vector at L = 8 against about 103 for the [vectors, 2^L] tile, with no shared-memory traffic or
barrier (docs/perf.md). It is the default where it fits (`DEFAULT_LAYOUT`), timed faster than the tile on an H100;
the codes are the same either way.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.codecs.checks import check_or_defer
from mmkv.codecs.tcq import PASS_ONE_WINDOW, pass_one_window
from mmkv.codecs.turboquant_mse import fp16_norm_message
from mmkv.kernels.common import LAUNCH, cdiv, device_tables, jit, rows_of, token_block
from mmkv.kernels.packing import pack_block
from mmkv.kernels.rotation import rotate
from mmkv.kernels.tcq_decode import supports, tables  # noqa: F401  (supports: the decoder's range)

# Vectors a launch. Each has its own back-pointer scratch (steps x 2^(L-k) int16: 2 KB at 2 bits, L = 8; int8 in the
# lane layout), and a launch takes as many as SCRATCH_BYTES hold: one Wan head group's 56,160 vectors go in one
# launch (115 MB of scratch at 2 bits with int16). In launches of 4,096 (14 for that tensor, one after another) its
# encode took 3.83 ms against 3.16 ms in one launch, 10.06 against 9.14 ms at 4 bits (docs/perf.md, the TCQ launch
# variants).
SCRATCH_BYTES = 128 << 20
PROGRAMS: int | None = None  # a fixed count of vectors a launch instead (tests)
FINISH_TOKENS = 32  # vectors a program of the finishing kernel (a multiple of 8: whole bytes a block)


def vectors_a_program(codec, layout: str = "tile") -> int:
    """The search's default vectors a program. The tile: 4 at L <= 8, where one vector's [2^L] path costs leave most
    of a warp's registers idle (the H200 check of 2026-12-03: 1.34 ms against 1.78 ms an encode of one Wan head group
    at 2 bits, codes equal); 1 above, where 4 vectors a program were 2-3x slower (docs/perf.md, the TCQ launch
    variants). The lanes: two lanes a thread of a warp (4 vectors at k = 4; the H100 check of 2026-12-05: 0.874 ms
    an encode against 0.903 with 2 vectors, one lane a thread, and 1.457 with 1, codes equal)."""
    if layout == "lanes":
        return max(1, 64 >> codec.k)
    return 4 if codec.L <= 8 else 1


def vectors_a_launch(codec, layout: str = "tile") -> int:
    if PROGRAMS is not None:
        return PROGRAMS
    per = codec.steps * ((1 << codec.L) >> codec.k) * (1 if layout == "lanes" else 2)
    return max(1, SCRATCH_BYTES // per)


@triton.jit
def _pair_costs(u0, u1, tab0, tab1):
    """Squared distances [NV, S] of each vector's pair (u0, u1) [NV] to every table row (no FMA: `LAUNCH`)."""
    d0 = u0[:, None] - tab0[None, :]
    d1 = u1[:, None] - tab1[None, :]
    return d0 * d0 + d1 * d1


@triton.jit
def _step_costs(u_ptr, ubase, valid, src, tab0, tab1, scale):
    """Squared distances [NV, S] of each vector's step `src` (times `scale`, `_unit_scale`) to every table row."""
    u0 = tl.load(u_ptr + ubase + 2 * src, mask=valid, other=0.0) * scale
    u1 = tl.load(u_ptr + ubase + 2 * src + 1, mask=valid, other=0.0) * scale
    return _pair_costs(u0, u1, tab0, tab1)


@triton.jit
def _unit_scale(norm_ptr, vec, valid, c, SCALED: tl.constexpr):
    """What the search multiplies its inputs by: 1, or with SCALED (its inputs are r = H(s * x)) u's factor as
    `TCQCodec.unit_rotated` rounds it, sqrt(d) / ||x|| taken as reciprocal(||x||, or 1 where it is not > 0) * c
    (torch's `scalar / tensor` is `tensor.reciprocal() * scalar`), c = sqrt(d) in fp32: every step a correctly
    rounded fp32 op, so u = r * scale is the reference's u bit for bit."""
    if SCALED:
        n = tl.load(norm_ptr + vec, mask=valid, other=1.0)
        return tl.math.div_rn(1.0, tl.where(n > 0, n, 1.0)) * c
    return tl.full(vec.shape, 1.0, tl.float32)


@triton.jit
def _trellis_pass(u_ptr, ubase, valid, scale, wide_ptr, bp_ptr, bbase, tab0, tab1, h, ROLL: tl.constexpr,
                  NSTEPS: tl.constexpr, CONSTRAIN: tl.constexpr, STEPS: tl.constexpr, K: tl.constexpr,
                  L: tl.constexpr, WIDE: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr):
    """The path costs [NV, S] after NSTEPS steps (step t taken from (t - ROLL) mod STEPS), back-pointers stored.
    PREFETCH: each step's input pair is loaded one step ahead, so that its load is not on the step's critical path
    (the same values, so the same costs)."""
    S: tl.constexpr = 1 << L
    M: tl.constexpr = S >> K
    offs = tl.arange(0, S)
    src0 = (STEPS - ROLL) % STEPS
    cost = _step_costs(u_ptr, ubase, valid, src0, tab0, tab1, scale)
    if CONSTRAIN:
        k0 = K + tl.load(wide_ptr + src0)
        cost = tl.where((offs[None, :] >> k0) == h[:, None], cost, float("inf"))
    cols = tl.arange(0, M)
    if PREFETCH:
        src1 = (1 + STEPS - ROLL) % STEPS
        n0 = tl.load(u_ptr + ubase + 2 * src1, mask=valid, other=0.0) * scale
        n1 = tl.load(u_ptr + ubase + 2 * src1 + 1, mask=valid, other=0.0) * scale
    for t in range(1, NSTEPS):
        src = (t + STEPS - ROLL) % STEPS
        if PREFETCH:  # this step's pair came a step ahead; the next step's load goes out now
            dist = _pair_costs(n0, n1, tab0, tab1)
            nxt = (t + 1 + STEPS - ROLL) % STEPS  # one load past the last step: in range, unused
            n0 = tl.load(u_ptr + ubase + 2 * nxt, mask=valid, other=0.0) * scale
            n1 = tl.load(u_ptr + ubase + 2 * nxt + 1, mask=valid, other=0.0) * scale
        else:
            dist = _step_costs(u_ptr, ubase, valid, src, tab0, tab1, scale)
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
def _backtrack(state, valid, wide_ptr, bp_ptr, bbase, codes_ptr, cbase, ROLL: tl.constexpr, NSTEPS: tl.constexpr,
               STOP, WRITE: tl.constexpr, STEPS: tl.constexpr, K: tl.constexpr, L: tl.constexpr):
    """Walk the back-pointers from the last step's (NSTEPS - 1) `state` [NV] down to step STOP; returns the states
    there. WRITE: store each step's code (its low k bits)."""
    M: tl.constexpr = (1 << L) >> K
    for r in range(0, NSTEPS - STOP):
        t = NSTEPS - 1 - r
        k = K + tl.load(wide_ptr + (t + STEPS - ROLL) % STEPS)
        if WRITE:
            tl.store(codes_ptr + cbase + t, state & ((1 << k) - 1), mask=valid)
        if t > STOP:
            j = tl.load(bp_ptr + bbase + t * M + (state >> K)).to(tl.int32)
            state = (j << (L - k)) | (state >> k)
    return state


@jit
def _tcq_viterbi_kernel(u_ptr, norm_ptr, c, table_ptr, wide_ptr, bp_ptr, codes_ptr, first, n,
                        STEPS: tl.constexpr, K: tl.constexpr, L: tl.constexpr, WIDE: tl.constexpr,
                        NV: tl.constexpr, PREFETCH: tl.constexpr, ROLL1: tl.constexpr, PASS1: tl.constexpr,
                        SCALED: tl.constexpr):
    """Tail-biting Viterbi (`mmkv.codecs.tcq.viterbi`) for NV vectors a program: pass one over PASS1 steps with the
    first step at position ROLL1 (`pass_one_window`), its state there gives h; pass two over all STEPS, from and to
    h. SCALED: u_ptr holds r and norm_ptr ||x|| (`_unit_scale`)."""
    S: tl.constexpr = 1 << L
    M: tl.constexpr = S >> K
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
    scale = _unit_scale(norm_ptr, vec, valid, c, SCALED)
    cost = _trellis_pass(u_ptr, ubase, valid, scale, wide_ptr, bp_ptr, bbase, tab0, tab1, 0, ROLL1, PASS1, False,
                         STEPS, K, L, WIDE, NV, PREFETCH)
    tl.debug_barrier()
    state = _backtrack(tl.argmin(cost, axis=1, tie_break_left=True).to(tl.int32), valid, wide_ptr, bp_ptr, bbase,
                       codes_ptr, cbase, ROLL1, PASS1, ROLL1, False, STEPS, K, L)
    h = state >> k0
    tl.debug_barrier()
    cost = _trellis_pass(u_ptr, ubase, valid, scale, wide_ptr, bp_ptr, bbase, tab0, tab1, h, 0, STEPS, True,
                         STEPS, K, L, WIDE, NV, PREFETCH)
    cost = tl.where((offs[None, :] & low) == h[:, None], cost, float("inf"))
    tl.debug_barrier()
    _backtrack(tl.argmin(cost, axis=1, tie_break_left=True).to(tl.int32), valid, wide_ptr, bp_ptr, bbase, codes_ptr,
               cbase, 0, STEPS, 0, True, STEPS, K, L)


@triton.jit
def _lane_distances(u0, u1, t0, t1, R: tl.constexpr):
    """Each row's squared distance [NL] of the lanes' pairs (u0, u1) to their table rows t0[r], t1[r] (no FMA)."""
    d = ()
    for r in tl.static_range(R):
        e0 = u0 - t0[r]
        e1 = u1 - t1[r]
        d = d + (e0 * e0 + e1 * e1,)
    return d


@triton.jit
def _lane_min(cost, R: tl.constexpr):
    """The least of a lane's rows and its row (the lowest on ties, as torch's `min`)."""
    best = cost[0]
    arg = tl.zeros(best.shape, tl.int32)
    for r in tl.static_range(1, R):
        take = cost[r] < best
        best = tl.where(take, cost[r], best)
        arg = tl.where(take, r, arg)
    return best, arg


@triton.jit
def _lanes_pass(u_ptr, ulane, vvalid, scale, bp_ptr, blane, t0, t1, hl, ROLL: tl.constexpr, NSTEPS: tl.constexpr,
                CONSTRAIN: tl.constexpr, STEPS: tl.constexpr, K: tl.constexpr, NL: tl.constexpr):
    """`_trellis_pass` in the lane layout: the rows' costs (a tuple of R [NL] tensors, lane = vector * R + column)
    after NSTEPS steps, back-pointers (the row of each column's minimum) stored a byte a lane. Each step's input pair
    is loaded a step ahead. CONSTRAIN: the first state's row (its high k bits) must be the lane's `hl`."""
    R: tl.constexpr = 1 << K
    lane = tl.arange(0, NL)
    src0 = (STEPS - ROLL) % STEPS
    u0 = tl.load(u_ptr + ulane + 2 * src0, mask=vvalid, other=0.0) * scale
    u1 = tl.load(u_ptr + ulane + 2 * src0 + 1, mask=vvalid, other=0.0) * scale
    cost = _lane_distances(u0, u1, t0, t1, R)
    if CONSTRAIN:
        first = ()
        for r in tl.static_range(R):
            first = first + (tl.where(hl == r, cost[r], float("inf")),)
        cost = first
    src1 = (1 + STEPS - ROLL) % STEPS
    n0 = tl.load(u_ptr + ulane + 2 * src1, mask=vvalid, other=0.0) * scale
    n1 = tl.load(u_ptr + ulane + 2 * src1 + 1, mask=vvalid, other=0.0) * scale
    for t in range(1, NSTEPS):
        dist = _lane_distances(n0, n1, t0, t1, R)
        nxt = (t + 1 + STEPS - ROLL) % STEPS  # one load past the last step: in range, unused
        n0 = tl.load(u_ptr + ulane + 2 * nxt, mask=vvalid, other=0.0) * scale
        n1 = tl.load(u_ptr + ulane + 2 * nxt + 1, mask=vvalid, other=0.0) * scale
        best, arg = _lane_min(cost, R)  # column c's minimum: the predecessor of every new state in row c
        tl.store(bp_ptr + blane + t * R, arg.to(tl.int8))
        step = ()
        for r in tl.static_range(R):  # row r of the new costs: the minimum of the vector's lane (column) r
            step = step + (tl.gather(best, (lane // R) * R + r, 0) + dist[r],)
        cost = step
    return cost


@triton.jit
def _lanes_argmin(cost, barred, NV: tl.constexpr, R: tl.constexpr):
    """Each vector's state of least cost [NV] (the lowest state on ties, as torch's `argmin`); `barred` [NL]: lanes
    (columns) no path may end in."""
    best, row = _lane_min(cost, R)
    best = tl.reshape(tl.where(barred, float("inf"), best), (NV, R))
    state = tl.reshape(row * R + tl.arange(0, NV * R) % R, (NV, R))
    least = tl.min(best, axis=1)
    return tl.min(tl.where(best == least[:, None], state, 1 << 30), axis=1)


@triton.jit
def _to_lanes(v, NV: tl.constexpr, R: tl.constexpr):
    """[NV] -> [NV * R]: each vector's value in every lane of it."""
    return tl.reshape(tl.broadcast_to(v[:, None], (NV, R)), (NV * R,))


@triton.jit
def _lanes_backtrack(state, vvalid, bp_ptr, blane, codes_ptr, clane, NSTEPS: tl.constexpr, STOP: tl.constexpr,
                     WRITE: tl.constexpr, K: tl.constexpr, NL: tl.constexpr):
    """`_backtrack` for k-bit steps at L = 2k, in the lanes: `state` [NL] is each vector's state in every lane of
    it, and the predecessor of state s at step t is (bp[t, s >> k] << k) | (s >> k). Each lane loads its own
    column's back-pointer of the step, an address that does not depend on the state, and the state's column is
    read from its lane with one warp shuffle (`tl.gather`): no global load waits on the step before, where the
    tile's backtrack chains one dependent load a step."""
    R: tl.constexpr = 1 << K
    lane = tl.arange(0, NL)
    first = (lane // R) * R  # the vector's first lane
    for i in range(0, NSTEPS - STOP):
        t = NSTEPS - 1 - i
        if WRITE:  # one lane a vector writes its code
            tl.store(codes_ptr + clane + t, state & (R - 1), mask=vvalid & (lane == first))
        if t > STOP:
            column = tl.load(bp_ptr + blane + t * R).to(tl.int32)
            j = tl.gather(column, first + (state >> K), 0)
            state = (j << K) | (state >> K)
    return state


@triton.jit
def _lanes_backtrack_finish(state, vvalid, bp_ptr, blane, r_ptr, ulane, table_ptr, packed_ptr, vidx, gain_ptr,
                            bad_ptr, STEPS: tl.constexpr, K: tl.constexpr, NL: tl.constexpr, FP16: tl.constexpr):
    """The last backtrack with `finish`'s work folded in (`search(..., into=...)`): each step's state gives u_hat's
    pair from the table, the gain's two sums run over the steps, last to first, and the codes are packed as `_pack`
    packs them, eight codes (k bytes) at a time, one byte a lane: code t at bits [t k, t k + k) of the vector's
    little-endian bit stream, which starts at byte vidx * STEPS * k / 8 (STEPS a multiple of 8)."""
    R: tl.constexpr = 1 << K
    lane = tl.arange(0, NL)
    first = (lane // R) * R
    sub = lane - first  # the lane's place in its vector
    vb = vidx.to(tl.int64) * (STEPS * K // 8)
    bits = tl.zeros([NL], tl.int64)
    num = tl.zeros([NL], tl.float32)
    den = tl.zeros([NL], tl.float32)
    for i in range(0, STEPS):
        t = STEPS - 1 - i
        bits = ((bits << K) | (state & (R - 1)).to(tl.int64)) & ((1 << (8 * K)) - 1)  # codes t .. t + 7, t lowest
        if t % 8 == 0:
            tl.store(packed_ptr + vb + (t // 8) * K + sub, ((bits >> (8 * sub)) & 0xFF).to(tl.uint8),
                     mask=vvalid & (sub < K))
        u0 = tl.load(table_ptr + 2 * state)
        u1 = tl.load(table_ptr + 2 * state + 1)
        r0 = tl.load(r_ptr + ulane + 2 * t, mask=vvalid, other=0.0)
        r1 = tl.load(r_ptr + ulane + 2 * t + 1, mask=vvalid, other=0.0)
        num += r0 * u0 + r1 * u1
        den += u0 * u0 + u1 * u1
        if t > 0:
            column = tl.load(bp_ptr + blane + t * R).to(tl.int32)
            j = tl.gather(column, first + (state >> K), 0)
            state = (j << K) | (state >> K)
    gain = tl.math.div_rn(num, den)
    one = vvalid & (sub == 0)
    if FP16:
        tl.store(gain_ptr + vidx, gain.to(tl.float16), mask=one)
        tl.store(bad_ptr + vidx, tl.where(gain <= 65504.0, 0, 1).to(tl.int8), mask=one)
    else:
        tl.store(gain_ptr + vidx, gain, mask=one)


@jit
def _tcq_lanes_kernel(u_ptr, norm_ptr, c, table_ptr, bp_ptr, codes_ptr, first, n, packed_ptr, gain_ptr, bad_ptr,
                      STEPS: tl.constexpr, K: tl.constexpr, NV: tl.constexpr, ROLL1: tl.constexpr,
                      PASS1: tl.constexpr, SCALED: tl.constexpr, FINISH: tl.constexpr, FP16: tl.constexpr):
    """`_tcq_viterbi_kernel` for L = 2K without wide steps, in the lane layout (module docstring): NV vectors a
    program, 2^K lanes each; the same two passes, so the same codes. FINISH: the last backtrack packs the codes and
    writes the gains (`_lanes_backtrack_finish`) instead of writing int32 codes."""
    R: tl.constexpr = 1 << K
    NL: tl.constexpr = NV * R
    pid = tl.program_id(0)
    lane = tl.arange(0, NL)
    col = lane % R
    t0 = ()
    t1 = ()
    for r in tl.static_range(R):  # the lane's column of the table, row by row
        t0 = t0 + (tl.load(table_ptr + 2 * (r * R + col)),)
        t1 = t1 + (tl.load(table_ptr + 2 * (r * R + col) + 1),)
    lslot = pid * NV + lane // R  # each lane's vector: its back-pointer scratch, its input and its codes
    vvalid = first + lslot < n
    ulane = (first + lslot).to(tl.int64) * (2 * STEPS)
    scale = _unit_scale(norm_ptr, first + lslot, vvalid, c, SCALED)
    blane = lslot.to(tl.int64) * STEPS * R + col
    clane = (first + lslot).to(tl.int64) * STEPS
    cost = _lanes_pass(u_ptr, ulane, vvalid, scale, bp_ptr, blane, t0, t1, col, ROLL1, PASS1, False, STEPS, K, NL)
    end = _lanes_argmin(cost, col < 0, NV, R)
    tl.debug_barrier()
    hl = _lanes_backtrack(_to_lanes(end, NV, R), vvalid, bp_ptr, blane, codes_ptr, clane, PASS1, ROLL1, False, K,
                          NL) >> K
    tl.debug_barrier()
    cost = _lanes_pass(u_ptr, ulane, vvalid, scale, bp_ptr, blane, t0, t1, hl, 0, STEPS, True, STEPS, K, NL)
    end = _lanes_argmin(cost, col != hl, NV, R)  # the last state's low k bits must be h
    tl.debug_barrier()
    if FINISH:
        _lanes_backtrack_finish(_to_lanes(end, NV, R), vvalid, bp_ptr, blane, u_ptr, ulane, table_ptr, packed_ptr,
                                first + lslot, gain_ptr, bad_ptr, STEPS, K, NL, FP16)
    else:
        _lanes_backtrack(_to_lanes(end, NV, R), vvalid, bp_ptr, blane, codes_ptr, clane, STEPS, 0, True, K, NL)


def lanes_fit(codec) -> bool:
    """Whether the lane layout can search this codec: L = 2k, no wide steps, at most 32 rows a lane."""
    return not codec.hi and codec.L == 2 * codec.k and codec.k <= 5


LAYOUTS = ("tile", "lanes")
# The search's layout by default where it fits (`lanes_fit`): the lanes, measured faster than the tile on an H100
# (2026-12-05, kernels/gpu_check_codecs.py at the video shape, 2 bits: search 0.628 against 0.744 ms, encode 0.874
# against 0.929 ms, codes equal; docs/perf.md).
DEFAULT_LAYOUT = "lanes"


def layout_of(codec, layout: str | None) -> str:
    """The search's layout: `layout`, or `DEFAULT_LAYOUT` where it fits the codec (`lanes_fit`), else "tile"."""
    if layout is None:
        return DEFAULT_LAYOUT if DEFAULT_LAYOUT == "tile" or lanes_fit(codec) else "tile"
    if layout not in LAYOUTS:
        raise ValueError(f"tcq_encode: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "lanes" and not lanes_fit(codec):
        raise ValueError(f"tcq_encode: the lanes layout needs L = 2k <= 10 and no wide steps; {codec.config} has "
                         f"L = {codec.L}, k = {codec.k}, hi = {codec.hi} (use layout='tile')")
    return layout


def viterbi(codec, u: torch.Tensor, *, warps: int = 1, vectors: int | None = None, prefetch: bool = True,
            programs: int | None = None, window: int | None = PASS_ONE_WINDOW, layout: str | None = None,
            norm: torch.Tensor | None = None) -> torch.Tensor:
    """`mmkv.codecs.tcq.viterbi` on the kernel: u [..., T, D] fp32 -> codes [..., T, steps] int64. Launch settings (the
    codes do not depend on them): `layout` ("tile" or "lanes", `layout_of`); `warps` a program; `vectors` (a power of
    two) a program (default `vectors_a_program`), searched side by side as an [vectors, 2^L] tile or as 2^k lanes
    each; `prefetch` (the tile; the lanes always load a step ahead): each step's inputs loaded one step ahead (the
    default since the H200 check of 2026-12-03, run L: 1.08 against 1.20 ms an encode at 2 bits with 4 vectors a
    program, 1.92 against 1.97 at 3 bits, codes equal); `programs`: vectors a launch (default `vectors_a_launch`),
    each with its own back-pointer scratch of steps x 2^(L-k) int16 (int8 for the lanes). `window`: pass one's steps
    either side of the first, as the reference's (None: all). `norm` [..., T, 1]: u is r = H(s * x) and norm the
    reference's ||x||, from which the kernel forms u as `TCQCodec.unit_rotated` does (`_unit_scale`)."""
    return search(codec, u, warps=warps, vectors=vectors, prefetch=prefetch, programs=programs, window=window,
                  layout=layout, norm=norm).to(torch.int64).view(*u.shape[:-1], codec.steps)


def search(codec, u: torch.Tensor, *, warps: int = 1, vectors: int | None = None, prefetch: bool = True,
           programs: int | None = None, window: int | None = PASS_ONE_WINDOW, layout: str | None = None,
           norm: torch.Tensor | None = None, into: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
    """`viterbi`'s codes as the kernel writes them: int32 [vectors, steps], vectors in u's order (every step of
    every vector written by the last backtrack). With `into` (`finish_buffers`; the lanes, u given as r and its
    norm) the last backtrack packs the codes into `into["code"]` and writes the gains (`_lanes_backtrack_finish`)
    instead, and the int32 codes are not written (returns None)."""
    layout = layout_of(codec, layout)
    lanes = layout == "lanes"
    if into is not None and not (lanes and norm is not None and codec.steps % 8 == 0):
        raise ValueError("tcq_encode: the search finishes the encode only in the lanes layout, from r and its norm, "
                         f"with a multiple of 8 steps; got layout {layout!r}, norm "
                         f"{'given' if norm is not None else 'None'}, {codec.steps} steps")
    vectors = vectors_a_program(codec, layout) if vectors is None else vectors
    if vectors < 1 or vectors & (vectors - 1):
        raise ValueError(f"tcq_encode: vectors a program must be a power of two, got {vectors}")
    per = vectors_a_launch(codec, layout) if programs is None else programs
    if isinstance(per, bool) or not isinstance(per, int) or per < 1:
        raise ValueError(f"tcq_encode: programs (vectors a launch) must be a positive int, got {programs!r}")
    flat = u.reshape(-1, codec.steps, 2).contiguous()
    n = flat.shape[0]
    if norm is not None and norm.numel() != n:
        raise ValueError(f"tcq_encode: norm must hold one norm a vector ({n} here), got shape {tuple(norm.shape)}")
    norms = flat if norm is None else norm.reshape(n).to(torch.float32).contiguous()
    unit = math.sqrt(codec.head_dim)  # rounded to fp32 by the launch, as torch's `scalar / tensor` rounds it
    codes = torch.empty(0 if into else n, codec.steps, dtype=torch.int32, device=u.device)
    fin = into or {"code": codes, "gain": codes, "bad": codes}  # unused unless FINISH
    if n:
        tab = device_tables(codec, u.device, "tcq-encode", lambda: {
            "table": codec.table.reshape(-1), "wide": codec.wide.to(torch.int32)})
        per_launch = min(n, per)
        roll, length = pass_one_window(codec.steps, window)
        back = torch.empty(cdiv(per_launch, vectors) * vectors, codec.steps, (1 << codec.L) >> codec.k,
                           dtype=torch.int8 if lanes else torch.int16, device=u.device)
        for first in range(0, n, per):  # the back-pointer scratch reused per launch
            grid = (cdiv(min(per, n - first), vectors),)
            if lanes:
                _tcq_lanes_kernel[grid](flat, norms, unit, tab["table"], back, codes, first, min(n, first + per),
                                        fin["code"], fin["gain"], fin["bad"], STEPS=codec.steps, K=codec.k,
                                        NV=vectors, ROLL1=roll, PASS1=length, SCALED=norm is not None,
                                        FINISH=into is not None, FP16=fin["gain"].dtype == torch.float16,
                                        num_warps=warps, **LAUNCH)
                continue
            _tcq_viterbi_kernel[grid](
                flat, norms, unit, tab["table"], tab["wide"], back, codes, first, min(n, first + per),
                STEPS=codec.steps, K=codec.k, L=codec.L, WIDE=codec.hi > 0, NV=vectors, PREFETCH=bool(prefetch),
                ROLL1=roll, PASS1=length, SCALED=norm is not None, num_warps=warps, **LAUNCH,
            )
    return None if into else codes


def rotated(codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, ||x||) of `TCQCodec.unit_rotated(x)` (x fp32): the rotation H(s * x) in one launch
    (`mmkv.kernels.rotation.rotate`, the same butterfly, so bit-identical; the torch butterfly takes three ops a
    stage) and the norm by the reference's own torch call; the search forms u from them (`_unit_scale`)."""
    signs = device_tables(codec, x.device, "tcq-signs", lambda: {"signs": codec.rotation.signs})["signs"]
    return rotate(x, signs), x.norm(dim=-1, keepdim=True)


@jit
def _tcq_finish_kernel(codes_ptr, r_ptr, table_ptr, src_ptr, shift_ptr, packed_ptr, gain_ptr, bad_ptr,
                       T, row_bytes,
                       D: tl.constexpr, STEPS: tl.constexpr, BT: tl.constexpr, K: tl.constexpr, L: tl.constexpr,
                       J: tl.constexpr, FP16: tl.constexpr):
    """After the search, for BT vectors of one row: the states from the codes (`lookback`), u_hat from the table,
    the least-squares gain <r, u_hat> / <u_hat, u_hat> (stored in fp16 or fp32, with a flag where an fp16 gain
    overflows) and the codes packed into the row's bit stream: `unit_from_codes`, the gain and `_pack` in one pass."""
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    cols = tl.arange(0, STEPS)
    tmask = (tt < n_tok)[:, None]
    vec = row64 * T + t0 + tt
    codes = tl.load(codes_ptr + vec[:, None] * STEPS + cols[None, :], mask=tmask, other=0)
    state = tl.zeros((BT, STEPS), tl.int32)
    for j in tl.static_range(J):
        src = tl.load(src_ptr + j * STEPS + cols)[None, :]
        code = tl.load(codes_ptr + vec[:, None] * STEPS + src, mask=tmask, other=0)
        state |= code << tl.load(shift_ptr + j * STEPS + cols)[None, :]
    state &= (1 << L) - 1
    u = tl.reshape(tl.join(tl.load(table_ptr + 2 * state), tl.load(table_ptr + 2 * state + 1)), (BT, D))
    r = tl.load(r_ptr + vec[:, None] * D + tl.arange(0, D)[None, :], mask=tmask, other=0.0)
    gain = tl.math.div_rn(tl.sum(r * u, axis=1), tl.sum(u * u, axis=1))
    keep = tt < n_tok
    if FP16:
        tl.store(gain_ptr + vec, gain.to(tl.float16), mask=keep)
        tl.store(bad_ptr + row64 * tl.num_programs(0) + tl.program_id(0),
                 tl.max(tl.where(keep & ~(gain <= 65504.0), 1, 0), axis=0).to(tl.int8))
    else:
        tl.store(gain_ptr + vec, gain, mask=keep)
    pack_block(codes, packed_ptr, row64 * row_bytes, t0, n_tok, BT, STEPS, STEPS, K, 0, 0, STEPS)


def finish_buffers(codec, r: torch.Tensor, flags: int) -> dict[str, torch.Tensor]:
    """The encode's outputs, empty, for r [..., T, D]: the packed codes [..., row bytes], the gains [..., T] (fp16 or
    fp32, the codec's norm width) and, for an fp16 gain, `flags` overflow flags ("bad"), each of which the kernel
    writes."""
    *lead, T, _ = r.shape
    fp16 = codec.norm_bits == 16
    return {"code": torch.empty(*lead, (T * codec.steps * codec.k + 7) // 8, dtype=torch.uint8, device=r.device),
            "gain": torch.empty(*lead, T, dtype=torch.float16 if fp16 else torch.float32, device=r.device),
            "bad": torch.empty(flags if fp16 else 1, dtype=torch.int8, device=r.device)}


def _check_gain(codec, gain: torch.Tensor, bad: torch.Tensor) -> None:
    if gain.dtype == torch.float16 and gain.numel():
        where = f"codec {codec.config} (layer {codec.layer})"
        check_or_defer(bad.any(), lambda: fp16_norm_message(where, float(gain.float().max())))


def finish(codec, codes: torch.Tensor, r: torch.Tensor) -> dict[str, torch.Tensor]:
    """`codec._pack(codes, gain)` with u_hat and the gain from the search's int32 codes [vectors, steps] and the
    rotated r [..., T, D] fp32, in one launch (codecs without wide steps): the codes are packed as `_pack` packs
    them; the gain's sums run in the kernel's order, so a gain may differ from the reference's in its last bits
    (an fp16 gain then rounds the same way but near ties)."""
    T, D = r.shape[-2:]
    rows = rows_of(r)
    bt = FINISH_TOKENS
    out = finish_buffers(codec, r, rows * cdiv(T, bt))  # a flag a program
    packed, gain = out["code"], out["gain"]
    if rows and T:
        tab = tables(codec, r.device)  # the decode kernel's: table, lookback src and shift
        _tcq_finish_kernel[(cdiv(T, bt), rows)](
            codes, r.contiguous(), tab["table"], tab["src"], tab["shift"], packed, gain, out["bad"], T,
            packed.shape[-1], D=D, STEPS=codec.steps, BT=bt, K=codec.k, L=codec.L, J=tab["src"].shape[0],
            FP16=gain.dtype == torch.float16, num_warps=4, **LAUNCH,
        )
    _check_gain(codec, gain, out["bad"])
    return {"code": packed, "gain": gain}


# How the encode finishes after the search by default (`fused=None`): in the lane search's last backtrack where it
# can (`backtrack_fits`), timed faster on an H100 (2026-12-05, kernels/gpu_check_codecs.py at the video shape, 2 bits:
# 0.681 against 0.712 ms an encode with calls back to back, its kernels 0.644 against 0.677 ms of GPU time, codes
# equal; docs/perf.md), else the finishing kernel.
DEFAULT_FUSED = "backtrack"


def backtrack_fits(codec, layout: str | None = None) -> bool:
    """Whether the lane search can finish the encode in its last backtrack: the lanes and a multiple of 8 steps."""
    return layout_of(codec, layout) == "lanes" and codec.steps % 8 == 0


def encode(codec, x: torch.Tensor, *, warps: int = 1, vectors: int | None = None, prefetch: bool = True,
           programs: int | None = None, fused: bool | str | None = None, window: int | None = PASS_ONE_WINDOW,
           layout: str | None = None) -> Encoded:
    """`codec.encode(x)` for TCQ with the search on the kernel: x[..., T, D] in any float dtype, already validated.
    `warps`, `vectors`, `prefetch`, `programs`, `layout`: launch settings of `viterbi` (the codes do not depend on
    them); `window` is pass one's (the codes do: `mmkv.codecs.tcq.viterbi`, whose default the codec's encodings use).
    `fused` (codecs without wide steps): the states, gain and packing after the search in one kernel (`finish`);
    "backtrack": in the lane search's last backtrack instead (`search(..., into=...)`: no int32 codes written or
    read, one launch fewer; the lanes and a multiple of 8 steps only); False: the reference's torch code, whose
    gains are the reference's bit for bit; None (the default): `DEFAULT_FUSED` where `backtrack_fits`, else True.
    The search reads r and ||x||
    and forms u itself (`_unit_scale`: the reference's u bit for bit, without its four torch ops and tensor)."""
    if fused not in (None, True, False, "backtrack"):
        raise ValueError(f"tcq_encode: fused must be None, True, False or 'backtrack', got {fused!r}")
    if fused is None:
        fused = DEFAULT_FUSED if backtrack_fits(codec, layout) else True
    r, norm = rotated(codec, x.float())
    if fused == "backtrack":
        out = finish_buffers(codec, r, r[..., 0].numel())  # a flag a vector
        search(codec, r, warps=warps, vectors=vectors, programs=programs, window=window, layout=layout, norm=norm,
               into=out)
        _check_gain(codec, out["gain"], out["bad"])
        return Encoded(str(codec.config), tuple(x.shape), x.dtype, {"code": out["code"], "gain": out["gain"]})
    if fused and not codec.hi:
        codes = search(codec, r, warps=warps, vectors=vectors, prefetch=prefetch, programs=programs, window=window,
                       layout=layout, norm=norm)
        return Encoded(str(codec.config), tuple(x.shape), x.dtype, finish(codec, codes, r))
    codes = viterbi(codec, r, warps=warps, vectors=vectors, prefetch=prefetch, programs=programs, window=window,
                    layout=layout, norm=norm)
    u_hat = codec.unit_from_codes(codes)
    gain = (r * u_hat).sum(-1) / (u_hat * u_hat).sum(-1)
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, codec._pack(codes, gain))
