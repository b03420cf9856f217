"""KIVI encode + pack on the kernel (KIVI's `quant/new_pack.py`; reference `mmkv/codecs/kivi.py`): the min-max kernel of
`kernels/groupquant_encode.py` with KIVI's layout, K per channel over groups of G tokens (role=k), V per token over
groups of G channels (role=v), float-minimum offsets. Bit-identical to the reference.
"""

from __future__ import annotations

import torch

from mmkv.codecs.base import Encoded
from mmkv.kernels.groupquant_encode import minmax_encode, nonfinite, supports_minmax  # noqa: F401


def supports(codec) -> bool:
    return supports_minmax(codec.head_dim, codec.group, codec.bits)


def encode(codec, x: torch.Tensor) -> Encoded:
    """`codec.encode(x)` for KIVI on the kernel: x[..., T, D] in any float dtype, already validated."""
    x = x.contiguous()
    tensors = minmax_encode(
        x, bits=codec.bits, group=codec.group, axis=codec.axis, zero_point="min", meta_dtype=codec.meta_dtype,
        where=f"codec {codec.config} (layer {codec.layer})",
    )
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors)
