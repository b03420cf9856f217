"""TCQ encode: the tail-biting Viterbi search in one kernel, the twin of `mmkv.codecs.tcq.viterbi` (QTIP's bitshift
trellis; reference `mmkv/codecs/tcq.py`). The rotation is the Hadamard kernel (`unit_rotated`); after the search one
more kernel (`finish`) rebuilds u_hat from the codes, takes the least-squares gain and packs the codes, where the
reference runs `TCQCodec.unit_from_codes`, the gain and `_pack` as some twenty torch ops (codecs with wide steps
still do).

One program walks `vectors` vectors (`vectors_a_program`: 4 at L <= 8, else 1) with their 2^L path costs each on chip,
as a [vectors, 2^L] tile (launches of at most `vectors_a_launch` vectors reuse one back-pointer scratch). A step of
k = K or K + 1 bits: the costs viewed as [2^K, 2^L / 2^K] are reduced over their first axis (min and argmin, the lowest
index on ties, as torch's `min`); a wide step folds the two halves of that result once more, which is the same minimum
over 2^(K+1) predecessors and keeps every shape constant. The back-pointers (k bits a state column and step) go to a
per-program scratch in global memory and are read back by the same program after a barrier. Pass one runs on the steps
around the first (`mmkv.codecs.tcq.pass_one_window`: 32 of 64 at d = 128) and backtracks to the first step's state;
pass two is constrained to start and end with its overlap bits, and its backtrack writes the codes. The squared
distances are computed as the reference does, (u0 - t0)^2 + (u1 - t1)^2 without fused multiply-adds (`LAUNCH`), so
the path costs, and with them the codes, are the reference's bit for bit wherever both see the same u. """

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.codecs.checks import check_or_defer
from mmkv.codecs.tcq import PASS_ONE_WINDOW, pass_one_window
from mmkv.codecs.turboquant_mse import fp16_norm_message
from mmkv.kernels.common import LAUNCH, device_tables, jit, rows_of, token_block
from mmkv.kernels.packing import pack_block
from mmkv.kernels.rotation import rotate
from mmkv.kernels.tcq_decode import supports, tables  # noqa: F401  (supports: the decoder's range)

# Vectors a launch. Each has its own back-pointer scratch (steps x 2^(L-k) int16: 2 KB at 2 bits, L = 8), and a
# launch takes as many as SCRATCH_BYTES hold: one Wan head group's 56,160 vectors go in one launch (115 MB of
# scratch at 2 bits). In launches of 4,096 (14 for that tensor, one after another) its encode took 3.83 ms
# against 3.16 ms in one launch, 10.06 against 9.14 ms at 4 bits (docs/perf.md, the TCQ launch variants).
SCRATCH_BYTES = 128 << 20
PROGRAMS: int | None = None  # a fixed count of vectors a launch instead (tests)
FINISH_TOKENS = 32  # vectors a program of the finishing kernel (a multiple of 8: whole bytes a block)


def vectors_a_program(codec) -> int:
    """The search's default vectors a program: 4 at L <= 8, where one vector's [2^L] path costs leave most of a
    warp's registers idle (the H200 check of 2026-12-03: 1.34 ms against 1.78 ms an encode of one Wan head group at
    2 bits, codes equal); 1 above, where 4 vectors a program were 2-3x slower (docs/perf.md, the TCQ launch
    variants)."""
    return 4 if codec.L <= 8 else 1


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
                  NSTEPS: tl.constexpr, CONSTRAIN: tl.constexpr, STEPS: tl.constexpr, K: tl.constexpr,
                  L: tl.constexpr, WIDE: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr):
    """The path costs [NV, S] after NSTEPS steps (step t taken from (t - ROLL) mod STEPS), back-pointers stored.
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
    for t in range(1, NSTEPS):
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
def _tcq_viterbi_kernel(u_ptr, table_ptr, wide_ptr, bp_ptr, codes_ptr, first, n,
                        STEPS: tl.constexpr, K: tl.constexpr, L: tl.constexpr, WIDE: tl.constexpr,
                        NV: tl.constexpr, PREFETCH: tl.constexpr, ROLL1: tl.constexpr, PASS1: tl.constexpr):
    """Tail-biting Viterbi (`mmkv.codecs.tcq.viterbi`) for NV vectors a program: pass one over PASS1 steps with the
    first step at position ROLL1 (`pass_one_window`), its state there gives h; pass two over all STEPS, from and to
    h."""
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
    cost = _trellis_pass(u_ptr, ubase, valid, wide_ptr, bp_ptr, bbase, tab0, tab1, 0, ROLL1, PASS1, False, STEPS, K, L,
                         WIDE, NV, PREFETCH)
    tl.debug_barrier()
    state = _backtrack(tl.argmin(cost, axis=1, tie_break_left=True).to(tl.int32), valid, wide_ptr, bp_ptr, bbase,
                       codes_ptr, cbase, ROLL1, PASS1, ROLL1, False, STEPS, K, L)
    h = state >> k0
    tl.debug_barrier()
    cost = _trellis_pass(u_ptr, ubase, valid, wide_ptr, bp_ptr, bbase, tab0, tab1, h, 0, STEPS, True, STEPS, K, L,
                         WIDE, NV, PREFETCH)
    cost = tl.where((offs[None, :] & low) == h[:, None], cost, float("inf"))
    tl.debug_barrier()
    _backtrack(tl.argmin(cost, axis=1, tie_break_left=True).to(tl.int32), valid, wide_ptr, bp_ptr, bbase, codes_ptr,
               cbase, 0, STEPS, 0, True, STEPS, K, L)


def viterbi(codec, u: torch.Tensor, *, warps: int = 1, vectors: int | None = None, prefetch: bool = True,
            programs: int | None = None, window: int | None = PASS_ONE_WINDOW) -> torch.Tensor:
    """`mmkv.codecs.tcq.viterbi` on the kernel: u [..., T, D] fp32 -> codes [..., T, steps] int64. Launch settings (the
    codes do not depend on them): `warps` a program; `vectors` (a power of two) a program, searched side by side as an
    [vectors, 2^L] tile (default `vectors_a_program`); `prefetch`: each step's inputs loaded one step ahead (the
    default since the H200 check of 2026-12-03, run L: 1.08 against 1.20 ms an encode at 2 bits with 4 vectors a
    program, 1.92 against 1.97 at 3 bits, codes equal); `programs`: vectors a launch (default `vectors_a_launch`),
    each with its own back-pointer scratch of steps x 2^(L-k) int16. `window`: pass one's steps either side of the
    first, as the reference's (None: all)."""
    return search(codec, u, warps=warps, vectors=vectors, prefetch=prefetch, programs=programs, window=window).to(
        torch.int64).view(*u.shape[:-1], codec.steps)


def search(codec, u: torch.Tensor, *, warps: int = 1, vectors: int | None = None, prefetch: bool = True,
           programs: int | None = None, window: int | None = PASS_ONE_WINDOW) -> torch.Tensor:
    """`viterbi`'s codes as the kernel writes them: int32 [vectors, steps], vectors in u's order."""
    vectors = vectors_a_program(codec) if vectors is None else vectors
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
        roll, length = pass_one_window(codec.steps, window)
        back = torch.empty(triton.cdiv(per_launch, vectors) * vectors, codec.steps, (1 << codec.L) >> codec.k,
                           dtype=torch.int16, device=u.device)
        for first in range(0, n, per):  # the back-pointer scratch reused per launch
            _tcq_viterbi_kernel[(triton.cdiv(min(per, n - first), vectors),)](
                flat, tab["table"], tab["wide"], back, codes, first, min(n, first + per),
                STEPS=codec.steps, K=codec.k, L=codec.L, WIDE=codec.hi > 0, NV=vectors, PREFETCH=bool(prefetch),
                ROLL1=roll, PASS1=length, num_warps=warps, **LAUNCH,
            )
    return codes


def unit_rotated(codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`codec.unit_rotated(x)` with the rotation H(s * x) in one launch (`mmkv.kernels.rotation.rotate`, the same
    butterfly, so bit-identical), where the torch butterfly takes three ops a stage."""
    signs = device_tables(codec, x.device, "tcq-signs", lambda: {"signs": codec.rotation.signs})["signs"]
    return codec.unit_rotated(x, rotate(x, signs))


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


def finish(codec, codes: torch.Tensor, r: torch.Tensor) -> dict[str, torch.Tensor]:
    """`codec._pack(codes, gain)` with u_hat and the gain from the search's int32 codes [vectors, steps] and the
    rotated r [..., T, D] fp32, in one launch (codecs without wide steps): the codes are packed as `_pack` packs
    them; the gain's sums run in the kernel's order, so a gain may differ from the reference's in its last bits
    (an fp16 gain then rounds the same way but near ties)."""
    *lead, T, D = r.shape
    rows = rows_of(r)
    dev = r.device
    row_bytes = (T * codec.steps * codec.k + 7) // 8
    packed = torch.empty(*lead, row_bytes, dtype=torch.uint8, device=dev)
    fp16 = codec.norm_bits == 16
    gain = torch.empty(*lead, T, dtype=torch.float16 if fp16 else torch.float32, device=dev)
    bt = FINISH_TOKENS
    bad = torch.zeros(rows * triton.cdiv(T, bt) if fp16 else 1, dtype=torch.int8, device=dev)
    if rows and T:
        tab = tables(codec, dev)  # the decode kernel's: table, lookback src and shift
        _tcq_finish_kernel[(triton.cdiv(T, bt), rows)](
            codes, r.contiguous(), tab["table"], tab["src"], tab["shift"], packed, gain, bad, T, row_bytes,
            D=D, STEPS=codec.steps, BT=bt, K=codec.k, L=codec.L, J=tab["src"].shape[0], FP16=fp16,
            num_warps=4, **LAUNCH,
        )
    if fp16 and gain.numel():
        where = f"codec {codec.config} (layer {codec.layer})"
        check_or_defer(bad.any(), lambda: fp16_norm_message(where, float(gain.float().max())))
    return {"code": packed, "gain": gain}


def encode(codec, x: torch.Tensor, *, warps: int = 1, vectors: int | None = None, prefetch: bool = True,
           programs: int | None = None, fused: bool = True, window: int | None = PASS_ONE_WINDOW) -> Encoded:
    """`codec.encode(x)` for TCQ with the search on the kernel: x[..., T, D] in any float dtype, already validated.
    `warps`, `vectors`, `prefetch`, `programs`: launch settings of `viterbi` (the codes do not depend on them);
    `window` is pass one's (the codes do: `mmkv.codecs.tcq.viterbi`, whose default the codec's encodings use).
    `fused` (codecs without wide steps): the states, gain and packing after the search in one kernel (`finish`);
    otherwise the reference's torch code, whose gains are the reference's bit for bit."""
    r, u = unit_rotated(codec, x.float())
    if fused and not codec.hi:
        codes = search(codec, u, warps=warps, vectors=vectors, prefetch=prefetch, programs=programs, window=window)
        return Encoded(str(codec.config), tuple(x.shape), x.dtype, finish(codec, codes, r))
    codes = viterbi(codec, u, warps=warps, vectors=vectors, prefetch=prefetch, programs=programs, window=window)
    u_hat = codec.unit_from_codes(codes)
    gain = (r * u_hat).sum(-1) / (u_hat * u_hat).sum(-1)
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, codec._pack(codes, gain))
