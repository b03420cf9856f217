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

from mmkv.codecs.base import Codec, CodecConfig, Encoded
from mmkv.codecs.groupquant import META_DTYPES, ROLES, RoleConfig, decode_minmax, encode_minmax


@dataclass(frozen=True)
class KiviConfig(RoleConfig):
    # The paper's kernels do 2 and 4 bits (its Triton pack also 8); 3 is accepted for iso-bit comparisons.
    name: ClassVar[str] = "kivi"
    allowed_bits: ClassVar[tuple[int, ...]] = (2, 3, 4, 8)


class KiviCodec(Codec):
    config_class = KiviConfig
    display_name = "KIVI"
    stackable = True  # rows (batch, head) decode independently: the store stacks equal units (stack_units)

    @classmethod
    def value_config(cls, config: CodecConfig, group: int = 32) -> CodecConfig:
        # KIVI quantises V per token with the key's own G and bits (KIVI-2/KIVI-4), not the harness's value group.
        return config.replace(role="v")

    def setup(self) -> None:
        self.bits, self.group, self.role = self.config.bits, self.config.group, self.config.role
        self.meta_dtype = META_DTYPES[self.config.meta]
        self.axis = ROLES[self.role]
        self.token_local = self.axis == "token"  # V: per-token groups; K groups over tokens

    def _encode(self, x: torch.Tensor) -> Encoded:
        tensors = encode_minmax(
            x, bits=self.bits, group=self.group, axis=self.axis, zero_point="min", meta_dtype=self.meta_dtype,
            where=f"codec {self.config} (layer {self.layer})",
        )
        return Encoded(self.name, tuple(x.shape), x.dtype, tensors)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return decode_minmax(enc.tensors, enc.shape, bits=self.bits, group=self.group, axis=self.axis)
