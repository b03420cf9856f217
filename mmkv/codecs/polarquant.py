"""PolarQuant-R (Han et al., arXiv 2502.02617): random preconditioning, then a recursive polar
transform of 16-coordinate blocks (depth L = 4) with Lloyd-Max angle codebooks and an fp16 radius per block.

Per block of 16 rotated coordinates u: level 1 has 8 angles atan2(u_2j, u_2j-1) in [0, 2pi) and radii r1; level l >= 2
has angles atan(r_2j / r_2j-1) in [0, pi/2] of the previous radii (4, 2, 1 of them); the last radius ||u_block|| is
stored as fp16. Angles are coded with the Lloyd-Max codebook of their level's exact density (PolarQuant paper, Lemma 2):
uniform for level 1, proportional to sin^(2^(l-1) - 1)(2 psi) for level l >= 2 (independent of d). Decoding runs the
tree top-down: (r cos theta, r sin theta), then the inverse rotation.

Presets: `polarquant:b=2` puts b bits on every level (docs/decisions.md; the paper-matched baseline of the OCTOPUS
comparison): (15b + 16)/16 bits a coordinate. `polarquant:levels=4222` is the paper's native configuration:
(32 + 8 + 4 + 2 + 16)/16 = 3.875 bits a coordinate; `levels` overrides `b`.

Preconditioning: a randomised Hadamard rotation (OCTOPUS eq. 2), one sign vector shared by K and V and by every layer
and head, as the paper shares its rotation; drawn from the private stream "polarquant" of the codec seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from mmkv.codecs import codebooks
from mmkv.codecs.base import Codec, CodecError, Encoded
from mmkv.codecs.codebooks import codebook_family
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.lloyd import lloyd_max_pdf
from mmkv.codecs.packing import pack_bits, unpack_bits
from mmkv.codecs.rotation import RandomizedHadamard

BLOCK = 16  # coordinates per polar block
DEPTH = 4  # recursion levels: log2(BLOCK)
MAX_BITS = 8
SHIPPED_BITS = (1, 2, 3, 4)


# ----------------------------------------------------------------------------------------------------------------
# Codebooks: family "polarquant", keys "level{l}_b{bits}" (radians).


def level_pdf(level: int):
    """The (unnormalised) density of a level-l angle for Gaussian input (PolarQuant paper, Lemma 2)."""
    power = 2 ** (level - 1) - 1
    return lambda psi: np.sin(2.0 * psi) ** power


def _parse_key(key: str) -> tuple[int, int]:
    try:
        lev, bits = key.split("_")
        level, nbits = int(lev.removeprefix("level")), int(bits.removeprefix("b"))
    except ValueError:
        raise KeyError(f"polarquant codebook key {key!r} is not of the form 'level<l>_b<bits>'") from None
    if not (1 <= level <= DEPTH and 1 <= nbits <= MAX_BITS):
        raise KeyError(f"polarquant codebook key {key!r}: level must be 1..{DEPTH}, bits 1..{MAX_BITS}")
    return level, nbits


@codebook_family("polarquant", [f"level{l}_b{b}" for l in range(1, DEPTH + 1) for b in SHIPPED_BITS])
def polarquant_codebook(key: str) -> list[float]:
    level, bits = _parse_key(key)
    n = 1 << bits
    if level == 1:
        # Lloyd-Max for the uniform density on the circle: the cell midpoints (2k + 1) pi / 2^b.
        return [(2 * k + 1) * math.pi / n for k in range(n)]
    return [float(c) for c in lloyd_max_pdf(level_pdf(level), 0.0, math.pi / 2, n)]


def angle_codebook(level: int, bits: int) -> torch.Tensor:
    return codebooks.load("polarquant", f"level{level}_b{bits}")


# ----------------------------------------------------------------------------------------------------------------


def _parse_levels(levels, where: str) -> tuple[int, ...] | None:
    if levels == 0:
        return None
    text = str(levels)
    if not isinstance(levels, int) or isinstance(levels, bool) or len(text) != DEPTH or not all(
        "1" <= c <= str(MAX_BITS) for c in text
    ):
        raise CodecError(
            f"{where}: levels must be {DEPTH} digits of bits per level (level 1 first), each 1..{MAX_BITS}, e.g. 4222 "
            f"(the paper's 3.875-bit configuration); got {levels!r}"
        )
    return tuple(int(c) for c in text)


@dataclass(frozen=True)
class PolarQuantConfig(CodecConfig):
    """bits per angle at every level, or `levels`: DEPTH digits of bits per level (0 = bits at every level)."""

    name: ClassVar[str] = "polarquant"
    aliases: ClassVar[dict[str, str]] = {"b": "bits"}
    printed: ClassVar[dict[str, str]] = {"bits": "b"}
    bits: int = 2
    levels: int = 0

    def __post_init__(self) -> None:
        if _parse_levels(self.levels, f"codec {self}") is None:
            self.check_choice("bits", tuple(range(1, MAX_BITS + 1)))

    @property
    def level_bits(self) -> tuple[int, ...]:
        """Bits per level, level 1 first."""
        return _parse_levels(self.levels, f"codec {self}") or (self.bits,) * DEPTH


class PolarQuantCodec(Codec):
    config_class = PolarQuantConfig
    display_name = "PolarQuant"
    token_local = True  # each token encoded on its own (CacheConfig.merge_units)
    requires_pow2 = True

    @classmethod
    def value_config(cls, config: CodecConfig, group: int = 32) -> CodecConfig:
        # Native preset: the paper codes V with PolarQuant too. The b-bit baseline (A14) serves the OCTOPUS comparison,
        # whose key codecs all pair with the A9 value codec at the key's bits.
        if config.levels:
            return config
        return CodecConfig.parse(f"groupquant:bits={int(config.bits)},group={group}")

    def setup(self) -> None:
        where = f"codec {self.config}"
        if self.head_dim < BLOCK:
            raise CodecError(f"{where}: PolarQuant codes {BLOCK}-coordinate blocks; head_dim {self.head_dim} < {BLOCK}")
        self.level_bits = self.config.level_bits
        self.bit_streams = tuple(f"angles{level}" for level in range(1, len(self.level_bits) + 1))
        self.rotation = RandomizedHadamard(self.head_dim, num_heads=1, seed=self.seed, layer=0, stream="polarquant")
        self._books: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _codebooks(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(centroids, decision thresholds) per level, on `device`."""
        if device not in self._books:
            books = []
            for level, bits in enumerate(self.level_bits, start=1):
                c = angle_codebook(level, bits).to(device)
                books.append((c, 0.5 * (c[1:] + c[:-1])))
            self._books[device] = books
        return self._books[device]

    # -- rotated-domain helpers (OCTOPUS paper, eq. 13) ---------------------------------------------------------------
    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        return self.rotation.forward(q.float())

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return self.rotation.inverse(y.float())

    def decode_rotated(self, enc: Encoded) -> torch.Tensor:
        """The reconstruction in the rotated domain (scores are <rotate_query(q), this>)."""
        if enc.codec != str(self.config):
            raise CodecError(f"cannot decode data encoded by {enc.codec!r} with codec {self.config}")
        *lead, t, d = enc.shape
        nb = d // BLOCK
        books = self._codebooks(enc.device)
        r = enc.tensors["radius"].float().reshape(*lead, t, nb, 1)
        for level in range(DEPTH, 0, -1):
            bits = self.level_bits[level - 1]
            m = BLOCK >> level  # angles per block at this level
            codes = unpack_bits(enc.tensors[f"angles{level}"], bits, t * nb * m).reshape(*lead, t, nb, m)
            theta = books[level - 1][0][codes]
            r = torch.stack((r * torch.cos(theta), r * torch.sin(theta)), dim=-1).reshape(*lead, t, nb, 2 * m)
        return r.reshape(*lead, t, d)

    # -- codec protocol -------------------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor) -> Encoded:
        *lead, t, d = x.shape
        nb = d // BLOCK
        books = self._codebooks(x.device)
        r = self.rotation.forward(x).reshape(*lead, t, nb, BLOCK)
        tensors: dict[str, torch.Tensor] = {}
        for level in range(1, DEPTH + 1):
            pairs = r.reshape(*lead, t, nb, BLOCK >> level, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            psi = torch.atan2(b, a)
            if level == 1:
                psi = torch.where(psi < 0, psi + 2 * math.pi, psi)  # [0, 2 pi)
            centroids, thresholds = books[level - 1]
            codes = torch.searchsorted(thresholds, psi.contiguous())  # nearest centroid
            tensors[f"angles{level}"] = pack_bits(codes.reshape(*lead, -1), self.level_bits[level - 1])
            r = torch.sqrt(a * a + b * b)
        radius = r.reshape(*lead, t, nb).to(torch.float16)
        if radius.numel() and not torch.isfinite(radius).all():
            raise CodecError(
                f"codec {self.config} (layer {self.layer}): a block radius exceeds the fp16 range "
                f"(max {float(r.max()):.4g}); PolarQuant stores fp16 radii"
            )
        tensors["radius"] = radius.contiguous()
        return Encoded(self.name, tuple(x.shape), x.dtype, tensors)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return self.rotation.inverse(self.decode_rotated(enc))
