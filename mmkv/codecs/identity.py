"""The identity codec: stores the tensor as it is, in its own dtype (bf16 for the bf16 models on GPU).

It is the byte-exact baseline: through the cache it must reproduce the native rollout bit for bit, which a codec that
rounded fp32 CPU activations to bf16 could not. Use `identity:dtype=bf16` to force bf16 storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mmkv.codecs.base import Codec, CodecError, Encoded, check_out
from mmkv.codecs.checks import inputs_checked
from mmkv.codecs.config import CodecConfig

_DTYPES = {"native": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class IdentityConfig(CodecConfig):
    """`dtype`: the storage dtype, `native` (the input's own) or one of bf16, fp16, fp32."""

    name: ClassVar[str] = "identity"
    dtype: str = "native"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            self.fail(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")


class IdentityCodec(Codec):
    config_class = IdentityConfig
    display_name = "Identity"
    token_local = True  # each token encoded on its own (CacheConfig.merge_units)

    @classmethod
    def value_config(cls, config, group: int = 32):
        return config  # V is stored like K, unchanged

    def setup(self) -> None:
        self.store_dtype = _DTYPES[self.config.dtype]

    def encode(self, x: torch.Tensor) -> Encoded:
        self.check_input(x, finite=not inputs_checked())
        stored = x.detach().to(self.store_dtype or x.dtype).contiguous()
        if stored.data_ptr() == x.data_ptr():
            stored = stored.clone()
        return Encoded(str(self.config), tuple(x.shape), x.dtype, {"x": stored})

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return enc.tensors["x"].float()  # the protocol's reference decode is fp32 (scores() relies on it)

    def decode(self, enc: Encoded, dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        if enc.codec != str(self.config):
            raise CodecError(f"cannot decode data encoded by {enc.codec!r} with codec {self.config}")
        if out is None:
            return enc.tensors["x"].to(dtype or enc.dtype)
        check_out(self, enc, dtype or enc.dtype, out)
        return out.copy_(enc.tensors["x"])
