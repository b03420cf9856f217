"""OScaR encode + pack on the kernel (OScaR's two steps; reference `mmkv/codecs/oscar.py`).

K (role=k): a first kernel rotates each token (k~ = H k, no signs), sums its squares over the channels and then over
the KV heads in head order, and takes the root (n_t = 1 when not finite or <= 0), as the reference does; the min-max
kernel of `kernels/groupquant_encode.py` then rotates again, divides by n_t and quantises per channel over groups of
G tokens with the rounded integer zero point. The channel sums run in another order than torch's, so n_t may differ
from the reference by an ulp, and a code may then differ where k^ sits within an ulp of a rounding boundary
(docs/decisions.md, "Codec kernels"). V (role=v): rotation, then per-token groups of G channels: bit-identical
under the interpreter; on an H200 the codes are the reference's and a few groups' fp16 scales one ulp off, as the
rotation's products round differently there (docs/perf.md, run I).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.kernels.common import LAUNCH, cdiv, jit, next_power_of_2, rows_of
from mmkv.kernels.groupquant_encode import minmax_encode, nonfinite, supports_minmax  # noqa: F401
from mmkv.kernels.rotation import fwht_lanes


@jit(also=("NH",))
def _token_norm_kernel(x_ptr, out_ptr, T, NH, rscale, D: tl.constexpr, BT: tl.constexpr):
    """n_t for BT tokens of one batch row: the heads' sums of squares of H k added in head order (as torch sums a
    [..., H, T] tensor over its head axis on the CPU), the root rounded to nearest, 1 where <= 0 or not finite."""
    pid_t = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    t0 = pid_t * BT
    n_tok = tl.minimum(T - t0, BT)
    tt = tl.arange(0, BT)
    dd = tl.arange(0, D)
    acc = tl.zeros((BT,), tl.float32)
    h = 0
    while h < NH:  # a loop, not unrolled: 12 unrolled heads took 51 s to compile for sm_90
        x = tl.load(x_ptr + (b64 * NH + h) * T * D + (t0 + tt).to(tl.int64)[:, None] * D + dd[None, :],
                    mask=(tt < n_tok)[:, None], other=0.0)
        r = fwht_lanes(x.to(tl.float32), BT, D) * rscale
        acc += tl.sum(r * r, axis=1)
        h += 1
    n = tl.sqrt_rn(acc)
    n = tl.where((n > 0) & (n < float("inf")), n, 1.0)  # NaN fails both
    tl.store(out_ptr + b64 * T + t0 + tt, n, mask=tt < n_tok)


def supports(codec) -> bool:
    return supports_minmax(codec.head_dim, codec.group, codec.bits) and 8 <= codec.head_dim <= 256


def token_norms(x: torch.Tensor) -> torch.Tensor:
    """n_t = ||H k_t|| over all KV heads (dim -3) and channels, fp32 [..., T]; 1 where <= 0 or not finite. One
    launch: the sums over the heads, the root and the fallback happen in the kernel."""
    *lead, T, D = x.shape
    heads = x.shape[-3] if x.dim() >= 3 else 1
    out_lead = lead[:-1] if x.dim() >= 3 else lead
    norm = torch.empty(*out_lead, T, dtype=torch.float32, device=x.device)
    batch = rows_of(x) // heads if heads else 0
    # Triton's coalesced layout, rows across lanes, 4096 values a program: one token a thread (128 tokens a program)
    # took 255 registers and 1,520 bytes of spills a thread at D 128 (ptxas sm_90) and gave a Wan frame's 1,560
    # tokens 13 programs; this takes 128 registers, no spills, and 49 programs
    bt = max(8, 4096 // next_power_of_2(D))
    if batch and T:
        _token_norm_kernel[(cdiv(T, bt), batch)](
            x, norm, T, heads, 1.0 / math.sqrt(D), D=D, BT=bt, num_warps=4, **LAUNCH
        )
    return norm


def encode(codec, x: torch.Tensor) -> Encoded:
    """`codec.encode(x)` for OScaR on the kernel: x[..., (H,) T, D] in any float dtype, already validated."""
    x = x.contiguous()
    where = f"codec {codec.config} (layer {codec.layer})"
    tensors = {}
    norm = None
    if codec.role == "k":
        norm = token_norms(x)
        tensors["norm"] = norm
    tensors.update(
        minmax_encode(
            x, bits=codec.bits, group=codec.group, axis=codec.axis, zero_point="rounded", meta_dtype=codec.meta_dtype,
            where=where, rotate=True, norm=norm, norm_heads=x.shape[-3] if x.dim() >= 3 else 1,
        )
    )
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors)
