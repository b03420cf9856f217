"""KIVI (Liu et al., arXiv 2402.02750; `jy-yuan/KIVI` `quant/new_pack.py`): asymmetric min-max quantisation, K
per-channel over groups of G tokens, V per-token over groups of G channels (KIVI paper; upstream `quant/new_pack.py`).

Convention (KIVI's `quant/new_pack.py`): s = (max - min) / (2^b - 1), q = round(clamp((x - min) / s, 0, 2^b - 1)),
x^ = q s + min, with the float minimum itself as the offset (no integer zero point). Scale and minimum are stored as
fp16 (KIVI keeps them in the model dtype, fp16 for its models; `meta=fp32` is an option). KIVI has no guard for s = 0;
here a zero-range group stores s = 0 and decodes to its minimum exactly.

`role=k` (default) is the key codec; `role=v` the value codec; `value_config` maps one to the other with the same bits
and group, KIVI's recipe (KIVI-2 and KIVI-4 use one G for both). A unit whose token count T is not a multiple of G ends
in a ragged K group whose scale and minimum are stored and counted. KIVI's residual windows are the cache's business.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass
from typing import ClassVar

from mmkv.codecs.base import Encoded
from mmkv.codecs.groupquant import RoleCodec, RoleConfig, decode_minmax, encode_minmax


@dataclass(frozen=True)
class KiviConfig(RoleConfig):
    # The paper's kernels do 2 and 4 bits (its Triton pack also 8); 3 is accepted for iso-bit comparisons.
    name: ClassVar[str] = "kivi"
    allowed_bits: ClassVar[tuple[int, ...]] = (2, 3, 4, 8)


class KiviCodec(RoleCodec):
    """KIVI quantises V per token with the key's own G and bits (KIVI-2 / KIVI-4)."""

    config_class = KiviConfig
    display_name = "KIVI"

    def _encode(self, x: torch.Tensor) -> Encoded:
        tensors = encode_minmax(
            x, bits=self.bits, group=self.group, axis=self.axis, zero_point="min", meta_dtype=self.meta_dtype,
            where=f"codec {self.config} (layer {self.layer})",
        )
        return Encoded(self.name, tuple(x.shape), x.dtype, tensors)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return decode_minmax(enc.tensors, enc.shape, bits=self.bits, group=self.group, axis=self.axis,
                             units=self.units(enc))
