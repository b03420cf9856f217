"""TurboQuant-MSE: norm, randomised Hadamard rotation, per-coordinate Lloyd-Max (TurboQuant paper, Algorithm 1).

A key x becomes its norm gamma = ||x|| (fp32 by default, fp16 optionally, never bf16) and the rotated unit vector
u = H(s * x/gamma) (one sign vector per layer and KV head; the paper's Haar rotation is replaced by the RHT, as in
every implementation, e.g. vLLM's TurboQuant). Each coordinate of u is quantised to the nearest centroid of the exact
Lloyd-Max codebook for the Lemma-1 Beta marginal of a rotated unit-vector coordinate (TurboQuant paper, Lemma 1).

Mixed precision (`hi`, docs/decisions.md): the first `hi` rotated coordinates get b+1 bits and the rest b bits. After
the rotation all coordinates share one marginal, so which ones are "hi" does not matter; this is the iso-rate
TurboQuant baseline (e.g. `turboquant-mse:b=2,hi=45` at d = 128 spends OCTOPUS b=2's 333 bits per key).

Stored per row of T tokens (each plane one dense bit stream over the row's T*n codes, `mmkv.codecs.packing`):
  `idx`     b-bit codes of the d-hi low-precision coordinates (absent when hi = d),
  `idx_hi`  (b+1)-bit codes of the first hi coordinates (absent when hi = 0),
  `norm`    ||x||, fp32 (default) or fp16.
Bits per key: b*d + hi + 32 (or + 16). Scores in the rotated domain: q.k_hat = <H(s*q), gamma * c[idx]> (OCTOPUS
paper, eq. 13); see `rotate_query` and `decode_rotated`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from mmkv.codecs import codebooks
from mmkv.codecs.base import Codec, CodecError, Encoded, private_generator
from mmkv.codecs.checks import check_or_defer
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.lloyd import lloyd_max_pdf
from mmkv.codecs.packing import pack_bits, unpack_bits
from mmkv.codecs.rotation import RandomizedHadamard

# ----------------------------------------------------------------------------------------------------------------
# Codebooks: exact Lloyd-Max on the Lemma-1 Beta density (TurboQuant paper, Lemma 1)

CODEBOOK_DIMS = (16, 32, 64, 128, 256)
CODEBOOK_BITS = (1, 2, 3, 4, 5, 6)
_KEY = re.compile(r"^d(\d+)_b(\d+)$")


def beta_pdf(d: int):
    """Lemma 1 density of one coordinate of a uniform point on S^{d-1}: Gamma(d/2)/(sqrt(pi) Gamma((d-1)/2)) *
    (1 - x^2)^((d-3)/2) on [-1, 1]."""
    log_c = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    return lambda x: np.exp(log_c + 0.5 * (d - 3) * np.log1p(-np.square(x)))


@codebooks.codebook_family("turboquant", keys=[f"d{d}_b{b}" for d in CODEBOOK_DIMS for b in CODEBOOK_BITS])
def turboquant_codebook(key: str) -> list[float]:
    """`d{d}_b{b}`: the 2**b sorted Lloyd-Max centroids for the Beta marginal at head dim d (float64).

    The density is symmetric and log-concave, so the optimal quantiser is unique, symmetric and has a boundary at 0:
    Lloyd-Max runs on the half density [0, 1] with 2**(b-1) levels and is mirrored, which makes the codebook exactly
    symmetric and keeps no grid point on the 0 boundary.
    """
    m = _KEY.match(key)
    if not m:
        raise KeyError(f"bad turboquant codebook key {key!r}; expected e.g. 'd128_b3'")
    d, b = int(m.group(1)), int(m.group(2))
    if d < 2 or not 1 <= b <= 8:
        raise KeyError(f"turboquant codebook key {key!r}: need d >= 2 and 1 <= b <= 8")
    half = lloyd_max_pdf(beta_pdf(d), 0.0, 1.0, 2 ** (b - 1), iters=100_000, tol=1e-13)
    return np.concatenate((-half[::-1], half)).tolist()


def codebook(d: int, b: int) -> torch.Tensor:
    """The float32 centroids for head dim d at b bits (shipped, or computed once for a d nobody shipped)."""
    return codebooks.load("turboquant", f"d{d}_b{b}")


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces (also used by TurboQuant-prod and QJL)


class ScalarQuantizer:
    """Nearest-centroid coding against one sorted codebook; tables cached per device."""

    def __init__(self, centroids: torch.Tensor):
        self.centroids = centroids.to(torch.float32)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            c = self.centroids.to(device)
            self._tables[device] = (c, 0.5 * (c[1:] + c[:-1]))  # cell boundaries t_i (TurboQuant paper, eq. 4)
        return self._tables[device]

    def encode(self, u: torch.Tensor) -> torch.Tensor:
        """u (fp32) -> int64 indices of the nearest centroid, ties to the lower index."""
        return torch.searchsorted(self._on(u.device)[1], u.contiguous())

    def decode(self, idx: torch.Tensor) -> torch.Tensor:
        return self._on(idx.device)[0][idx]


def pack_plane(codes: torch.Tensor, width: int) -> torch.Tensor:
    """codes[..., T, n] -> one dense bit stream per row, uint8[..., ceil(T*n*width/8)]."""
    return pack_bits(codes.flatten(-2), width)


def unpack_plane(packed: torch.Tensor, width: int, t: int, n: int) -> torch.Tensor:
    return unpack_bits(packed, width, t * n).unflatten(-1, (t, n))


_NORM_DTYPES = {32: torch.float32, 16: torch.float16}
_FP16_MAX = 65504.0


def fp16_norm_message(where: str, big: float) -> str:
    """The error for a norm (or gain) beyond fp16, `big` the largest one."""
    return f"{where}: a vector norm of {big:.4g} does not fit an fp16 norm (max {_FP16_MAX}); use norm=32"


def store_norm(norm: torch.Tensor, bits: int, where: str) -> torch.Tensor:
    """Norms in the stored dtype (fp32, or fp16 after checking they fit; never bf16: its 8-bit mantissa). The check is a
    host sync, or collected by the active `mmkv.codecs.checks.encode_scope`."""
    if bits == 16 and norm.numel():
        big = norm.max()
        check_or_defer(~(big <= _FP16_MAX), lambda: fp16_norm_message(where, float(big)))  # NaN counts as bad
    return norm.to(_NORM_DTYPES[bits]).contiguous()


def gaussian_sketch(m: int, d: int, *, num_heads: int, seed: int, layer: int, stream: str) -> torch.Tensor:
    """S[H, m, d] with i.i.d. N(0, 1) entries, one per (layer, KV head), from a private generator whose seed stream
    (`stream`) is independent of every rotation's (AmesianX's TurboQuant port: correlated seeds break QJL)."""
    mats = []
    for h in range(num_heads):
        g = private_generator(seed, "gaussian-sketch", stream, layer, h)
        mats.append(torch.randn(m, d, generator=g, dtype=torch.float32))
    return torch.stack(mats)


def check_heads(codec: Codec, q: torch.Tensor) -> None:
    """Per-head state (signs, sketches) broadcasts over dim -3, so a query must carry the codec's KV-head axis."""
    if q.shape[-1] != codec.head_dim:
        raise CodecError(f"codec {codec.config}: query head dim {q.shape[-1]} != head_dim {codec.head_dim}")
    if codec.num_heads > 1 and (q.dim() < 3 or q.shape[-3] != codec.num_heads):
        raise CodecError(
            f"codec {codec.config}: built for {codec.num_heads} KV heads, expected a query [..., {codec.num_heads}, "
            f"Tq, {codec.head_dim}] (fold each KV head's query group into Tq), got {tuple(q.shape)}"
        )


# ----------------------------------------------------------------------------------------------------------------
# The codec


@dataclass(frozen=True)
class TurboQuantMSEConfig(CodecConfig):
    """bits (1..6 per coordinate), norm (32 or 16 bits for ||x||), hi (0..d coordinates coded at bits+1, for an
    iso-rate baseline between two widths)."""

    name: ClassVar[str] = "turboquant-mse"
    aliases: ClassVar[dict[str, str]] = {"b": "bits"}
    printed: ClassVar[dict[str, str]] = {"bits": "b"}
    bits: int = 4
    norm: int = 32
    hi: int = 0

    def __post_init__(self) -> None:
        self.check_choice("bits", CODEBOOK_BITS)
        self.check_choice("norm", (32, 16))
        if not isinstance(self.hi, int) or isinstance(self.hi, bool) or self.hi < 0:
            self.fail(f"hi={self.hi!r} must be an int in 0..head_dim (coordinates at bits+1)")
        if self.hi and self.bits == CODEBOOK_BITS[-1]:
            top = CODEBOOK_BITS[-1]
            self.fail(f"hi > 0 needs bits <= {top - 1} (bits+1 is at most {top})")


class TurboQuantMSECodec(Codec):
    """TurboQuant-MSE keys (parameters: `TurboQuantMSEConfig`)."""

    config_class = TurboQuantMSEConfig
    display_name = "TurboQuant-MSE"
    token_local = True  # each token encoded on its own (CacheConfig.merge_units)
    bit_streams = ("idx", "idx_hi")
    requires_pow2 = True
    rotation_stream = "turboquant"

    def setup(self) -> None:
        cfg, d = self.config, self.head_dim
        self.b, self.norm_bits, self.hi = cfg.bits, cfg.norm, cfg.hi
        if self.hi > d:
            raise CodecError(f"codec {self.name!r}: hi={self.hi!r} must be an int in 0..{d} (coordinates at b+1 bits)")
        self.lo_q = ScalarQuantizer(codebook(d, self.b))
        self.hi_q = ScalarQuantizer(codebook(d, self.b + 1)) if self.hi else None
        self.rotation = RandomizedHadamard(
            d, num_heads=self.num_heads, seed=self.seed, layer=self.layer, stream=self.rotation_stream
        )

    @property
    def bits_per_vector(self) -> int:
        """Stored bits per key, side info included (docs/decisions.md, TurboQuant-MSE): b*d + hi + the norm."""
        return self.b * self.head_dim + self.hi + self.norm_bits

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """q' = H(s * q) per KV head (fp32); scores are <q', decode_rotated(enc)> (the rotation is orthogonal)."""
        check_heads(self, q)
        return self.rotation.forward(q.float())

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """s * H(y): back from the rotated domain, e.g. for values accumulated there (the rotation is linear)."""
        return self.rotation.inverse(y.float())

    def _encode(self, x: torch.Tensor) -> Encoded:
        norm = x.norm(dim=-1)
        # gamma = 0 gives u = 0, whose codes decode to gamma * c = 0.
        u = self.rotation.forward(x / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1))
        tensors = {}
        if self.hi < self.head_dim:
            tensors["idx"] = pack_plane(self.lo_q.encode(u[..., self.hi :]), self.b)
        if self.hi:
            tensors["idx_hi"] = pack_plane(self.hi_q.encode(u[..., : self.hi]), self.b + 1)
        tensors["norm"] = store_norm(norm, self.norm_bits, f"codec {self.config} (layer {self.layer})")
        return Encoded(str(self.config), tuple(x.shape), x.dtype, tensors)

    def decode_unit_rotated(self, enc: Encoded) -> torch.Tensor:
        """The quantised rotated unit vector c[idx], [..., T, D] fp32."""
        t, d = enc.shape[-2], self.head_dim
        parts = []
        if self.hi:
            parts.append(self.hi_q.decode(unpack_plane(enc.tensors["idx_hi"], self.b + 1, t, self.hi)))
        if self.hi < d:
            parts.append(self.lo_q.decode(unpack_plane(enc.tensors["idx"], self.b, t, d - self.hi)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def decode_rotated(self, enc: Encoded) -> torch.Tensor:
        """gamma * c[idx] in the rotated domain, [..., T, D] fp32."""
        return enc.tensors["norm"].float().unsqueeze(-1) * self.decode_unit_rotated(enc)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return self.rotation.inverse(self.decode_rotated(enc))  # x_hat = gamma * Pi^T c[idx] (Algorithm 1 step 7)
