"""TCQ unpack + decode to the model dtype, the kernel twin of `TCQCodec._decode` (QTIP's bitshift trellis: a state is
the last L bits of the code string; reference `mmkv/codecs/tcq.py`).

One token a thread. The state of step t is assembled from the codes of steps t, t-1, ... (circularly, J of them, each
shifted by the bits of the steps after it: host tables `src` and `shift`, or computed where every step has K bits),
its V = 2 values are read from the trellis table in one 8-byte load (`table_pairs`), and x_hat = s * H(gain * u_hat)
by the fp32 butterfly: the reference's operations in its order, cast once to the output dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmkv.codecs.tcq import lookback
from mmkv.kernels.common import (
    LAUNCH, ROWS_WARPS, cast_to, cdiv, decode_out, device_tables, head_count, jit, rows_of, store_rows, token_block,
    vector,
)
from mmkv.kernels.packing import unpack_at
from mmkv.kernels.rotation import fwht


def supports(codec) -> bool:
    return 16 <= codec.head_dim <= 256


def tables(codec, device: torch.device) -> dict:
    def build():
        src, shift = lookback(codec.widths, codec.L)
        wide = codec.wide.to(torch.int32)
        return {
            "table": codec.table.reshape(-1), "signs": codec.rotation.signs, "src": src, "shift": shift,
            "wide": wide, "rank": (torch.cumsum(wide, 0) - wide).to(torch.int32),  # a wide step's index in code_hi
        }

    return device_tables(codec, device, "tcq", build)


@triton.jit
def table_pairs(pairs_ptr, state):
    """The table's two values of each state, [..., 2] fp32, from the table viewed as one int64 a state (`pairs`):
    one 8-byte gather a state instead of two 4-byte ones, the same bits (little-endian: the first value low)."""
    pair = tl.load(pairs_ptr + state)
    lo = pair.to(tl.int32).to(tl.float32, bitcast=True)
    hi = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.join(lo, hi)


def pairs(table: torch.Tensor) -> torch.Tensor:
    """The fp32 table [2^L * 2] viewed as int64 [2^L], a state's two values in one element (`table_pairs`)."""
    return table.view(torch.int64)


@jit
def _tcq_decode_kernel(
    code_ptr, hi_ptr, gain_ptr, table_ptr, src_ptr, shift_ptr, wide_ptr, rank_ptr, s_ptr, out_ptr,
    T, NH, scale, code_row_bytes, hi_row_bytes, vr, ORS,
    D: tl.constexpr, STEPS: tl.constexpr, BT: tl.constexpr, V: tl.constexpr, K: tl.constexpr, HI: tl.constexpr,
    L: tl.constexpr, J: tl.constexpr,
):
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    cols = tl.arange(0, STEPS)
    tmask = (tt < n_tok)[:, None]
    tok = (t0 + tt)[:, None]
    state = tl.zeros((BT, STEPS), tl.int32)
    for j in tl.static_range(J):
        if HI > 0:  # steps of two widths: the lookback tables
            src = tl.load(src_ptr + j * STEPS + cols)[None, :]
            shift = tl.load(shift_ptr + j * STEPS + cols)[None, :]
        else:  # every step K bits: the tables are (t - j) mod STEPS and j K (`lookback`), computed, not loaded
            src = ((cols + (STEPS - j)) % STEPS)[None, :]
            shift = j * K
        code = unpack_at(code_ptr, row64 * code_row_bytes, tok * STEPS + src, tmask, K)
        if HI > 0:
            wide = tl.load(wide_ptr + src)
            rank = tl.load(rank_ptr + src)
            code |= unpack_at(hi_ptr, row64 * hi_row_bytes, tok * HI + rank, tmask & (wide > 0), 1) << K
        state |= code << shift
    state &= (1 << L) - 1
    u = tl.reshape(table_pairs(table_ptr, state), (BT, D))
    gain = tl.load(gain_ptr + row64 * T + t0 + tt, mask=tt < n_tok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (row % NH) * D + tl.arange(0, D)).to(tl.float32)
    y = fwht(gain[:, None] * u, BT, D) * scale * s[None, :]  # x_hat = s * H(gain * u_hat)
    store_rows(out_ptr, row64 * ORS, t0, n_tok, cast_to(y, out_ptr.dtype.element_ty), vr, BT, D, V)


def decode(codec, enc, dtype: torch.dtype, *, warps: int | None = None, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for TCQ on the kernel: [..., T, D] in `dtype`."""
    *lead, T, D = enc.shape
    t = enc.tensors
    gain = t["gain"].contiguous()
    dev = gain.device
    tab = tables(codec, dev)
    out, ors = decode_out(enc.shape, dtype, dev, out)
    rows = rows_of(out)
    if not rows or not T:
        return out
    code = t["code"].contiguous()
    code_hi = t["code_hi"].contiguous() if codec.hi else code
    warps = warps or ROWS_WARPS
    bt = 32 * warps  # one token a thread
    v = min(vector(dtype), D)
    _tcq_decode_kernel[(cdiv(T, bt), rows)](
        code, code_hi, gain, pairs(tab["table"]), tab["src"], tab["shift"], tab["wide"], tab["rank"], tab["signs"], out,
        T, head_count(codec), 1.0 / math.sqrt(D), code.shape[-1], code_hi.shape[-1] if codec.hi else 0, v, ors,
        D=D, STEPS=codec.steps, BT=bt, V=v, K=codec.k, HI=codec.hi, L=codec.L, J=tab["src"].shape[0],
        num_warps=warps, **LAUNCH,
    )
    return out
