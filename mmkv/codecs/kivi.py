"""KIVI (Liu et al., arXiv 2402.02750; `jy-yuan/KIVI` `quant/new_pack.py`): asymmetric min-max quantisation, K
per-channel over groups of G tokens, V per-token over groups of G channels (oscar.md section 3).

Convention (KIVI's, oscar.md §9 #8): s = (max - min) / (2^b - 1), q = round(clamp((x - min) / s, 0, 2^b - 1)),
x^ = q s + min, with the float minimum itself as the offset (no integer zero point). Scale and minimum are stored as
fp16 (KIVI keeps them in the model dtype, fp16 for its models; `meta=fp32` is an option). KIVI has no guard for s = 0;
here a zero-range group stores s = 0 and decodes to its minimum exactly.

`role=k` (default) is the key codec; `role=v` the value codec; `value_config` maps one to the other with the same bits
and group, KIVI's recipe (KIVI-2 and KIVI-4 use one G for both). A unit whose token count T is not a multiple of G ends
in a ragged K group whose scale and minimum are stored and counted. KIVI's residual windows are the cache's business.
"""

from __future__ import annotations

import torch

from mmkv.codecs.base import Codec, CodecConfig, Encoded, register
from mmkv.codecs.groupquant import check_group, check_meta, check_role, decode_minmax, encode_minmax


@register
class KiviCodec(Codec):
    name = "kivi"
    defaults = {"bits": 2, "group": 32, "role": "k", "meta": "fp16"}
    aliases = {"b": "bits", "g": "group"}
    stackable = True  # rows (batch, head) decode independently: the store stacks equal units (stack_units)

    @classmethod
    def value_config(cls, config: CodecConfig, group: int = 32) -> CodecConfig:
        # KIVI quantises V per token with the key's own G and bits (KIVI-2/KIVI-4), not the harness's value group.
        return config.replace(role="v")

    def setup(self) -> None:
        # The paper's kernels do 2 and 4 bits (its Triton pack also 8); 3 is accepted for iso-bit comparisons.
        self.bits = self.check_bits(self.config["bits"], (2, 3, 4, 8))
        self.group = check_group(self, self.config["group"])
        self.meta_dtype = check_meta(self, self.config["meta"])
        self.axis = check_role(self, self.config["role"])
        self.token_local = self.axis == "token"  # V: per-token groups; K groups over tokens
        self.role = self.config["role"]

    def _encode(self, x: torch.Tensor) -> Encoded:
        tensors = encode_minmax(
            x, bits=self.bits, group=self.group, axis=self.axis, zero_point="min", meta_dtype=self.meta_dtype,
            where=f"codec {self.config} (layer {self.layer})",
        )
        return Encoded(self.name, tuple(x.shape), x.dtype, tensors)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return decode_minmax(enc.tensors, enc.shape, bits=self.bits, group=self.group, axis=self.axis)
