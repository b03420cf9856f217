"""What a codec stores for one span of vectors (`Encoded`), and the float dtypes a codec accepts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class Encoded:
    """What a codec stores for one span of vectors: packed payload and side information, all real tensors.

    `tensors` holds every stored tensor (and only those); `meta` holds small Python facts needed to decode (original
    shape, dtype, token count), which a real cache keeps once per layer rather than per unit.
    """

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def effective_bits(self) -> float:
        """Stored bits per encoded value, measured from the bytes really held."""
        return 8.0 * self.nbytes / max(self.numel, 1)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def to(self, device: torch.device | str) -> "Encoded":
        return dataclasses.replace(self, tensors={k: t.to(device) for k, t in self.tensors.items()})
