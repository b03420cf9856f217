"""Seeds derived from a run seed and keys, and private generators that never touch the global RNG stream."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def derive_seed(seed: int, *keys: Any) -> int:
    """A 63-bit seed derived from `seed` and any keys (stable across processes, platforms and Python versions)."""
    text = repr((int(seed),) + tuple(keys)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def private_generator(seed: int, *keys: Any) -> torch.Generator:
    """A CPU generator that never touches the global RNG stream."""
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(seed, *keys))
    return g
