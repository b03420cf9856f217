"""What the codec kernels share: device functions of the scalar quantisers (round half to even, nearest centroid by
`searchsorted`), and the launchers' bookkeeping (rows of a [..., T, D] tensor, per-codec device tables).

Every codec kernel is launched with `enable_fp_fusion=False`: the torch references round each product before an add
(separate kernels), and a fused multiply-add would round once, so fusion would move decoded values and codes by an
ulp (docs/decisions.d/kernels_codec.md).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Callable

import torch
import triton
import triton.language as tl

# The interpreter (TRITON_INTERPRET=1, what CI runs on CPU) has no bf16/fp16 matrix product: dot operands go to fp32.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

LAUNCH = {"enable_fp_fusion": False}


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def rows_of(x: torch.Tensor) -> int:
    """Number of [T, D] rows in x[..., T, D]: every leading index is one row (one packed bit stream)."""
    return math.prod(x.shape[:-2])


def head_count(codec) -> int:
    """Heads whose per-head state (rotation signs) alternates over rows: dim -3 is the KV-head axis when > 1."""
    return codec.num_heads if codec.num_heads > 1 else 1


_TABLES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def device_tables(codec, device: torch.device, key: str, build: Callable[[], dict]) -> dict:
    """Tensors a kernel reads (signs, boundaries, LUTs, matrices), built once per (codec instance, device, key)."""
    per = _TABLES.setdefault(codec, {})
    k = (str(device), key)
    if k not in per:
        per[k] = {name: t.to(device).contiguous() for name, t in build().items()}
    return per[k]


def boundaries(centroids: torch.Tensor) -> torch.Tensor:
    """Cell boundaries t_i = (c_i + c_{i+1}) / 2 in fp32, computed exactly as the references do (codecs.md 1.2)."""
    c = centroids.to(torch.float32)
    return 0.5 * (c[1:] + c[:-1])


@triton.jit
def rint(v):
    """Round half to even (torch.round), exact for every fp32: |v| >= 2^23 is already an integer."""
    big = 8388608.0
    a = tl.abs(v)
    r = (a + big) - big
    r = tl.where(v < 0, -r, r)
    return tl.where(a < big, r, v)


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
    """fp32 -> dtype with round-to-nearest-even (torch's `.to`). bf16 is rounded by hand: the interpreter truncates."""
    if dtype == tl.bfloat16:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(dtype)
