"""What the codec kernels share: device functions of the scalar quantisers (round half to even, nearest centroid by
`searchsorted`), and the launchers' bookkeeping (rows of a [..., T, D] tensor, per-codec device tables).

Every codec kernel is launched with `enable_fp_fusion=False`: the torch references round each product before an add
(separate kernels), and a fused multiply-add would round once, so fusion would move decoded values and codes by an
ulp (docs/decisions.md, "Codec kernels").
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import os
import weakref
from typing import Callable

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import to_device_shared
from mmkv.kernels.launch import Kernel

# The interpreter (TRITON_INTERPRET=1, what CI runs on CPU) has no bf16/fp16 matrix product: dot operands go to fp32.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_INTERP = tl.constexpr(INTERPRET)
LAUNCH = {"enable_fp_fusion": False}
ROWS_WARPS = 4  # warps of a one-token-a-thread program: BT = 32 * ROWS_WARPS tokens

# Launch arguments that count or offset tokens, tiles or splits: they change with every unit, scale and cache length.
# Triton compiles a kernel again for every new combination of its integer arguments' "equals 1" and "divisible by
# 16" properties (its specialisation key), which in an AAR rollout (16 scales of 1 to 64 tokens a side) or a video
# rollout (a cache that grows by a frame) meant a compile every few calls. These only bound masks and loops, so they
# are passed unspecialised: one compile a kernel and constexpr set. Strides and row byte counts stay specialised,
# since their alignment lets loads and stores vectorise.
SIZE_ARGS = frozenset({"T", "N", "n", "NGT", "N1", "N2", "S", "first", "skip", "tile0", "tiles_per_split", "split0",
                       "S_total", "Tq", "GQ"})


def jit(fn=None, *, also: tuple[str, ...] = ()):
    """`triton.jit` for a launched kernel, with its `SIZE_ARGS` and the arguments named in `also` not specialised
    (`@jit` or `@jit(also=(...))`). Compiled kernels launch through `mmkv.kernels.launch.Kernel`."""
    if fn is None:
        return lambda f: jit(f, also=also)
    names = list(inspect.signature(fn).parameters)
    missing = [a for a in also if a not in names]
    if missing:
        raise ValueError(f"{fn.__name__} has no arguments {missing}")
    dont = [a for a in names if a in SIZE_ARGS or a in also]
    if INTERPRET:
        return triton.jit(fn, do_not_specialize=dont)
    return Kernel(fn, do_not_specialize=dont)  # triton.jit's kernel with a cheaper launch (kernels/launch.py)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (0 for 0): Triton's is a constexpr function whose host call unwraps
    its arguments and imports at every call, several microseconds a launch."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code (see `next_power_of_2`)."""
    return -(-a // b)


def rows_of(x: torch.Tensor) -> int:
    """Number of [T, D] rows in x[..., T, D]: every leading index is one row (one packed bit stream)."""
    return math.prod(x.shape[:-2])


def decode_out(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, out: torch.Tensor | None
               ) -> tuple[torch.Tensor, int]:
    """The tensor a decode kernel writes and its row stride in elements: a new contiguous [..., T, D] tensor, or the
    caller's `out` (e.g. a token slice of a contiguous [B, H, T_total, D] gather buffer, so the decode lands where
    attention reads it, with no copy). `out` must have the shape and dtype, unit channel stride, token stride D, and
    rows (the flattened leading indices) evenly strided; otherwise ValueError (the caller copies instead)."""
    out, (n1, n2, s0, _, _) = decode_out_rows(shape, dtype, device, out)
    if n1 > 1 or n2 > 1:
        raise ValueError(f"decode out rows are not evenly strided: strides {out.stride()}, shape {tuple(shape)}")
    return out, s0


def decode_out_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, out: torch.Tensor | None
                    ) -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """`decode_out` for kernels that address their output rows in up to three evenly strided levels: row
    r = (i0 * n1 + i1) * n2 + i2 starts at i0 * s0 + i1 * s1 + i2 * s2 (`out_row`). That takes a stack of units
    [B, n, H, T, D] written straight into token order, the view [B, H, n * T, D] -> [B, n, H, T, D] of a gather
    buffer slice that `mmkv.attention.gather` passes. Returns (out, (n1, n2, s0, s1, s2)); ValueError when `out`
    needs more levels, its rows overlap, or its token and channel strides are not D and 1."""
    t, d = shape[-2], shape[-1]
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device), (1, 1, t * d, 0, 0)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != torch.device(device):
        raise ValueError(f"decode out must be {tuple(shape)} {dtype} on {device}, got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    if out.numel() == 0:
        return out, (1, 1, t * d, 0, 0)
    return out, _row_levels(tuple(shape), out.stride())


@functools.lru_cache(maxsize=1024)
def _row_levels(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """`decode_out_rows`'s (n1, n2, s0, s1, s2) for a non-empty `out` of this shape and these strides (kept per
    layout: a rollout decodes into the same few gather-buffer layouts at every attention call)."""
    *lead, t, d = shape
    if (d > 1 and strides[-1] != 1) or (t > 1 and strides[-2] != d):
        raise ValueError(f"decode out needs token stride {d} and channel stride 1, got strides {strides}")
    levels: list[list[int]] = []  # [size, stride], outermost first, each level's dims merged when evenly strided
    for i in range(len(lead)):
        size, stride = shape[i], strides[i]
        if size == 1:
            continue
        if levels and levels[-1][1] == stride * size:
            levels[-1] = [levels[-1][0] * size, stride]
        else:
            levels.append([size, stride])
    if len(levels) > 3:
        raise ValueError(f"decode out rows need more than three strided levels: strides {strides}, shape {shape}")
    extent = t * d  # rows must not overlap: by increasing stride, each level steps over all the finer ones
    for size, stride in sorted(levels, key=lambda lv: lv[1]):
        if stride < extent:
            raise ValueError(f"decode out rows overlap: strides {strides}, shape {shape}")
        extent = stride * size
    if not levels:
        return (1, 1, t * d, 0, 0)
    (_, s0), (n1, s1), (n2, s2) = levels + [[1, 0]] * (3 - len(levels))
    return (n1, n2, s0, s1, s2)


@functools.lru_cache(maxsize=256)
def unit_starts(units: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Joined units' first tokens and the end: int32 [len(units) + 1] on `device`, made once per (units, device) and
    read only, so a decode launches no copy for it (`unit_of` reads it)."""
    return torch.tensor([0, *itertools.accumulate(units)], dtype=torch.int32, device=device)


@triton.jit
def unit_of(tok, starts_ptr, NU, UP: tl.constexpr):
    """The unit of each token of joined units (`unit_starts`: NU units, UP >= NU a power of two): int32, NU for a
    token past the last unit."""
    uu = tl.arange(0, UP)
    ends = tl.load(starts_ptr + 1 + uu, mask=uu < NU, other=2147483647)
    return tl.sum((tok[:, None] >= ends[None, :]).to(tl.int32), 1)


@triton.jit
def out_row(row64, N1, N2, S0, S1, S2):
    """Offset of output row `row64` under `decode_out_rows`'s levels (N1 = N2 = 1: plain row * S0)."""
    i2 = row64 % N2
    i1 = (row64 // N2) % N1
    return (row64 // (N1 * N2)) * S0 + i1 * S1 + i2 * S2


def head_count(codec) -> int:
    """Heads whose per-head state (rotation signs) alternates over rows: dim -3 is the KV-head axis when > 1."""
    return codec.num_heads if codec.num_heads > 1 else 1


def vector(dtype: torch.dtype) -> int:
    """Entries in a 16-byte access of `dtype`: the chunk width of `load_rows` / `store_rows`."""
    return 16 // dtype.itemsize


_TABLES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def device_tables(codec, device: torch.device, key: str, build: Callable[[], dict]) -> dict:
    """Tensors a kernel reads (signs, boundaries, LUTs, matrices), built once per (codec instance, device, key), and
    copied to the device once per distinct content (`to_device_shared`)."""
    per = _TABLES.setdefault(codec, {})
    k = (str(device), key)
    if k not in per:
        per[k] = to_device_shared(build(), device, key)
    return per[k]


def boundaries(centroids: torch.Tensor) -> torch.Tensor:
    """Cell boundaries t_i = (c_i + c_{i+1}) / 2 in fp32, computed exactly as the references do (TurboQuant eq. 4)."""
    c = centroids.to(torch.float32)
    return 0.5 * (c[1:] + c[:-1])


@triton.jit
def token_block(T, BT: tl.constexpr):
    """The block a program of a (cdiv(T, BT), rows) launch owns: (row, row as int64 for offsets, first token t0,
    tokens in the block n_tok = min(T - t0, BT)). Every codec kernel's grid has this shape."""
    pid_t = tl.program_id(0)
    row = tl.program_id(1)
    row64 = row.to(tl.int64)
    t0 = pid_t * BT
    return row, row64, t0, tl.minimum(T - t0, BT)


@triton.jit
def rint(v):
    """Round half to even (torch.round), exact for every fp32: |v| >= 2^23 is already an integer."""
    big = 8388608.0
    a = tl.abs(v)
    r = (a + big) - big
    r = tl.where(v < 0, -r, r)
    return tl.where(a < big, r, v)


def search_table(centroids: torch.Tensor, max_cells: int = 4096) -> dict[str, torch.Tensor]:
    """Tables for `search`: "t" = [lo, 1/w, -inf, t_0, ..., t_{NB-1}, +inf] (fp32 boundaries as `boundaries` gives
    them) and "n" (uint8) = for each of the equal cells [lo + k w, lo + (k+1) w) the number of boundaries below its left
    edge. Cells are a power of two in number and at most a third of the narrowest gap between boundaries wide, so the
    table stays a few cache lines. "n" has one entry (plain compares instead) below 8 levels."""
    t = boundaries(centroids)
    nb = t.numel()
    body = torch.cat([torch.tensor([float("-inf")]), t, torch.tensor([float("inf")])])
    if nb < 7:
        return {"t": torch.cat([torch.zeros(2), body]), "n": torch.zeros(1, dtype=torch.uint8)}
    t64 = t.double()
    span = float(t64[-1] - t64[0])
    gap = float((t64[1:] - t64[:-1]).min())
    lo, width = float(t64[0]) - span / 8 - 1e-6, span * 1.25 + 2e-6
    cells = 16
    while cells < max_cells and width / cells > gap / 3:
        cells *= 2
    w = width / cells
    if w > gap / 3:
        return {"t": torch.cat([torch.zeros(2), body]), "n": torch.zeros(1, dtype=torch.uint8)}
    edges = lo + w * torch.arange(cells, dtype=torch.float64)
    n = torch.searchsorted(t64, edges, right=False).to(torch.uint8)  # #{t_j < edge}
    head = torch.tensor([lo, 1.0 / w], dtype=torch.float64).float()
    return {"t": torch.cat([head, body]), "n": n}


def cells(table: dict[str, torch.Tensor]) -> int:
    """The CELLS constexpr of `search` for a `search_table` (0: plain compares)."""
    n = table["n"].numel()
    return n if n > 1 else 0


@triton.jit
def search(v, t_ptr, n_ptr, NB: tl.constexpr, CELLS: tl.constexpr):
    """torch.searchsorted(t, v) on a `search_table`: the cell of v gives the count n below its left edge, and since
    cells are much narrower than the gaps between boundaries, #{t_j < v} = n - 1 + [t_{n-1} < v] + [t_n < v] (v may
    even fall a cell off by rounding). Three gathered loads instead of NB compares. CELLS = 0: plain compares."""
    if CELLS == 0:
        return count_less(v, t_ptr + 3, NB)
    else:
        lo = tl.load(t_ptr)
        inv_w = tl.load(t_ptr + 1)
        f = tl.minimum(tl.maximum((v - lo) * inv_w, 0.0), CELLS - 1.0)
        # clamp again as an integer: a NaN survives the float clamp (the interpreter's maximum keeps it) and would
        # index outside the table; the store lets NaN reach the encoders and reads its own NaN flag afterwards
        i = tl.minimum(tl.maximum(f.to(tl.int32), 0), CELLS - 1)
        n = tl.load(n_ptr + i).to(tl.int32)
        tp = t_ptr + 2  # tp[i] = t_{i-1}, tp[0] = -inf, tp[NB + 1] = +inf
        return n - 1 + (tl.load(tp + n) < v).to(tl.int32) + (tl.load(tp + n + 1) < v).to(tl.int32)


@triton.jit
def count_less(v, t_ptr, NB: tl.constexpr):
    """torch.searchsorted(t, v) for sorted fp32 boundaries t[NB]: #{k: t_k < v}, i.e. the nearest centroid with
    ties to the lower index. Few boundaries: unrolled compares; many: binary lifting over gathered loads."""
    if NB <= 15:
        c = tl.zeros(v.shape, tl.int32)
        for k in tl.static_range(NB):
            c += (tl.load(t_ptr + k) < v).to(tl.int32)
    else:
        # NB = 2^b - 1: pos + step <= NB holds at every step, so no bound check is needed.
        c = tl.zeros(v.shape, tl.int32)
        step: tl.constexpr = (NB + 1) // 2
        for s in tl.static_range(16):
            if (step >> s) > 0:
                probe = c + (step >> s)
                c = tl.where(tl.load(t_ptr + probe - 1) < v, probe, c)
    return c


@triton.jit
def cast_to(y, dtype: tl.constexpr):
    """fp32 -> dtype with round-to-nearest-even (torch's `.to`). The interpreter truncates to bf16, so there bf16 is
    rounded by hand."""
    if _INTERP and dtype == tl.bfloat16:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(dtype)


# -- one token per thread ------------------------------------------------------------------------------------------
# Triton lays a [BT, D] load out for coalescing: 16-byte chunks of a row on neighbouring lanes, so a butterfly over
# the row needs shuffles or shared memory at most stages. These two functions instead address rows as
# [BT, D/V, V] chunks with a chunk stride `vr` (= V) that is a run-time argument: the compiler then only knows that
# chunks are V-aligned, keeps the 16-byte vectors, and puts the tokens, not the chunks, on the lanes. A whole row
# then lives in one thread, and the butterfly, norms, searches and bit packing are register work
# (docs/decisions.md, "Codec kernels").


@triton.jit
def load_rows(ptr, base, t0, n_tok, vr, BT: tl.constexpr, D: tl.constexpr, V: tl.constexpr):
    """Rows [t0, t0 + n_tok) of the [T, D] block at ptr + base as [BT, D] (zeros past n_tok), one row a thread."""
    tt = tl.arange(0, BT)[:, None, None]
    kv = tl.multiple_of(tl.arange(0, D // V)[None, :, None] * vr, [V, V, V])
    off = base + (t0 + tt).to(tl.int64) * D + kv + tl.arange(0, V)[None, None, :]
    return tl.reshape(tl.load(ptr + off, mask=tt < n_tok, other=0.0), (BT, D))


@triton.jit
def store_rows(ptr, base, t0, n_tok, y, vr, BT: tl.constexpr, D: tl.constexpr, V: tl.constexpr):
    """The inverse of `load_rows`: y[BT, D] (already in the output dtype) to rows [t0, t0 + n_tok)."""
    tt = tl.arange(0, BT)[:, None, None]
    kv = tl.multiple_of(tl.arange(0, D // V)[None, :, None] * vr, [V, V, V])
    off = base + (t0 + tt).to(tl.int64) * D + kv + tl.arange(0, V)[None, None, :]
    tl.store(ptr + off, tl.reshape(y, (BT, D // V, V)), mask=tt < n_tok)
