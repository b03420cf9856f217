"""OScaR unpack + decode to the model dtype on the kernel (reference `mmkv/codecs/oscar.py`): the min-max decode
kernel of `kernels/groupquant_decode.py`, times the stored token norm for K, then H (self-inverse), cast once.
Bit-identical to the reference.
"""

from __future__ import annotations

import torch

from mmkv.kernels.groupquant_decode import minmax_decode
from mmkv.kernels.oscar_encode import supports  # noqa: F401  (same parameter range)


def decode(codec, enc, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for OScaR on the kernel."""
    norm = enc.tensors["norm"].contiguous() if codec.role == "k" else None
    heads = enc.shape[-3] if len(enc.shape) >= 3 else 1
    return minmax_decode(
        enc.tensors, enc.shape, dtype, bits=codec.bits, group=codec.group, axis=codec.axis, rotate=True, norm=norm,
        norm_heads=heads, out=out, units=codec.units(enc),
    )
