"""OCTOPUS-QJL unpack + decode to the model dtype on the kernel (reference `mmkv/codecs/octopus_qjl.py`): the
OCTOPUS decode kernel of `kernels/octopus_decode.py` with its QJL branch, which adds the residual
sqrt(pi/(2d)) gamma_r s' * H(sigma) to u_hat before the inverse rotation. Bit-identical to the reference.
"""

from __future__ import annotations

import torch

from mmkv.kernels import octopus_decode
from mmkv.kernels.octopus_encode import supports  # noqa: F401  (same parameter range)


def decode(codec, enc, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.decode(enc, dtype)` for OCTOPUS-QJL on the kernel."""
    return octopus_decode.decode(codec, enc, dtype, out=out)
