"""A throwaway codec, as a newcomer would write one: one file with its config and its class, plus one registry line
(here `mmkv.codecs.registered(ToyCodec)` in tests/test_codec_registry.py, for a built-in one line of
`mmkv.codecs.registry.BUILTIN`). Per token: random channel signs (seeded, one vector per KV head), then symmetric
4-bit absmax quantisation with an fp16 scale; codes two to a byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mmkv.codecs import Codec, CodecConfig, Encoded, private_generator


@dataclass(frozen=True)
class ToyConfig(CodecConfig):
    name: ClassVar[str] = "toy-absmax"
    aliases: ClassVar[dict[str, str]] = {"b": "bits"}
    bits: int = 4

    def __post_init__(self) -> None:
        self.check_choice("bits", (4,))


class ToyCodec(Codec):
    config_class = ToyConfig
    display_name = "Toy"
    token_local = True  # each token encoded on its own

    def setup(self) -> None:
        g = private_generator(self.seed, "toy-absmax", self.layer)
        signs = torch.randint(0, 2, (self.num_heads, 1, self.head_dim), generator=g).float() * 2 - 1
        self.signs = signs if self.num_heads > 1 else signs[0, 0]
        self.qmax = (1 << (self.config.bits - 1)) - 1

    def _encode(self, x: torch.Tensor) -> Encoded:
        y = x * self.signs
        scale = (y.abs().amax(dim=-1, keepdim=True) / self.qmax).half()
        s = scale.float()
        codes = (torch.round(y / torch.where(s > 0, s, torch.ones_like(s))).clamp(-self.qmax, self.qmax) + self.qmax)
        codes = codes.to(torch.uint8)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        return Encoded(str(self.config), tuple(x.shape), x.dtype, {"codes": packed, "scale": scale.contiguous()})

    def _decode(self, enc: Encoded) -> torch.Tensor:
        packed = enc.tensors["codes"]
        codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float() - self.qmax
        return codes * enc.tensors["scale"].float() * self.signs
