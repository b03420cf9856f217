"""KIVI unpack + dequantise to the model dtype on the kernel (reference `mmkv/codecs/kivi.py`): the min-max decode
kernel of `kernels/groupquant_decode.py` along KIVI's axis (channel for K, token for V). Bit-identical.
"""

from __future__ import annotations

import torch

from mmkv.kernels.groupquant_decode import minmax_decode
from mmkv.kernels.kivi_encode import supports  # noqa: F401  (same parameter range)


def decode(codec, enc, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for KIVI on the kernel."""
    return minmax_decode(enc.tensors, enc.shape, dtype, bits=codec.bits, group=codec.group, axis=codec.axis, out=out,
                         units=codec.units(enc))
