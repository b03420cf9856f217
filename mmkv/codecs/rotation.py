"""The one rotation module: normalised Walsh-Hadamard transforms, plain and randomised (OCTOPUS paper, eq. 2).

`RandomizedHadamard` is R = H_d diag(s) with one seeded sign vector per (layer, KV head), drawn from a private
generator, so building a codec never moves the global RNG stream. Forward: u = H_d (s * x); inverse: x = s * (H_d u).
"""

from __future__ import annotations

import math

import torch

from mmkv.codecs.base import CodecError, private_generator


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def hadamard_transform(x: torch.Tensor, normalized: bool = True) -> torch.Tensor:
    """Sylvester (natural order) Walsh-Hadamard transform along the last dim, O(d log d). Self-inverse if normalised."""
    d = x.shape[-1]
    if not is_pow2(d):
        raise CodecError(f"Walsh-Hadamard transform needs a power-of-two length, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(*lead, d)
    if normalized:
        y = y * (1.0 / math.sqrt(d))
    return y


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalised Sylvester matrix H_d (symmetric, orthogonal)."""
    return hadamard_transform(torch.eye(d, dtype=torch.float64)).to(dtype)


def random_signs(dim: int, seed: int, *keys) -> torch.Tensor:
    """A ±1 vector (int8) from a private generator seeded by (seed, *keys)."""
    g = private_generator(seed, "signs", *keys)
    return (torch.randint(0, 2, (dim,), generator=g, dtype=torch.int64) * 2 - 1).to(torch.int8)


_SIGNS_ON: dict = {}  # (dim, heads, seed, layer, stream, device, dtype) -> the signs there (read only)


class RandomizedHadamard:
    """R = H diag(s), one sign vector per head; `stream` separates independent rotations (e.g. QJL's R')."""

    def __init__(self, dim: int, *, num_heads: int = 1, seed: int = 0, layer: int = 0, stream: str = "rht"):
        if not is_pow2(dim):
            raise CodecError(f"randomised Hadamard rotation needs a power-of-two dim, got {dim}")
        self.dim = dim
        self.num_heads = num_heads
        self.signs = torch.stack([random_signs(dim, seed, stream, layer, h) for h in range(num_heads)])  # [H, D] int8
        self._key = (dim, num_heads, seed, layer, stream)

    def _s(self, x: torch.Tensor) -> torch.Tensor:
        # Copied to a device once a process for each rotation and dtype: a copy from host memory on every call is a
        # host sync on CUDA (420 a full-size TCQ CausVid rollout, `mmkv bench video --count-syncs`), and a store
        # builds its codecs (and their rotations) anew for every rollout.
        key = (*self._key, x.device, x.dtype)
        s = _SIGNS_ON.get(key)
        if s is None:
            s = self.signs.to(device=x.device, dtype=x.dtype)
            s = s[0] if self.num_heads == 1 else s.view(self.num_heads, 1, self.dim)  # broadcast over [..., H, T, D]
            _SIGNS_ON[key] = s
        return s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_transform(x * self._s(x))

    def inverse(self, u: torch.Tensor) -> torch.Tensor:
        return hadamard_transform(u) * self._s(u)

    __call__ = forward
