"""OCTOPUS-QJL encode + pack on the kernel (codecs.md 5.6; reference `mmkv/codecs/octopus_qjl.py`): the OCTOPUS
kernel of `kernels/octopus_encode.py` with its QJL branch, which also forms the rotated residual r = u - u_hat in
registers, packs sign(H(s' r)) and writes ||r|| in fp16. 
"""

from __future__ import annotations

import torch

from mmkv.codecs.base import Encoded
from mmkv.kernels import octopus_encode
from mmkv.kernels.octopus_encode import supports  # noqa: F401  (same parameter range)


def encode(codec, x: torch.Tensor, *, defer: list | None = None) -> Encoded:
    """`codec.encode(x)` for OCTOPUS-QJL on the kernel: x[..., T, D] in any float dtype, already validated."""
    return octopus_encode.encode(codec, x, defer=defer)
