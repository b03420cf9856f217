"""TurboQuant-prod: a (b-1)-bit TurboQuant-MSE stage plus a 1-bit QJL sketch of its residual (TurboQuant paper,
Algorithm 2), an unbiased inner-product quantiser.

For a key x with norm n = ||x|| and unit vector x1 = x/n:
  1. idx = Quant_mse(x1) at b-1 bits (the same rotation stream as `turboquant-mse`, so for one seed this stage is
     exactly `turboquant-mse:b=b-1`),
  2. r = x1 - DeQuant_mse(idx), in the original basis,
  3. qjl = sign(S r) with S in R^{d x d} i.i.d. N(0, 1) (m = d), one S per (layer, KV head) from a private generator
     on a seed stream independent of the rotation's (correlated seeds break QJL, as AmesianX's TurboQuant port found),
  4. gamma = ||r||.
DeQuant: x_hat = n * (DeQuant_mse(idx) + sqrt(pi/2)/d * gamma * S^T qjl)             (Algorithm 2 step 5)
Scores:  q.k ~= n * (<Pi q, c[idx]> + gamma * sqrt(pi/2)/d * <S q, qjl>)             (TurboQuant paper, Algorithm 2)
which is the same number as <q, x_hat>; `scores` computes it without rotating keys back. E[score] = q.x (Theorem 2).

Stored per row of T tokens: `idx` ((b-1)-bit codes, one dense bit stream over T*d codes), `qjl` (1-bit signs over
T*d, bit 1 = +1), `rnorm` (gamma) and `norm` (n), each fp32 (default) or fp16. Bits per key: b*d + 2*32 (or 2*16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from mmkv.codecs.base import Codec, Encoded
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.qjl import GaussianSketch
from mmkv.codecs.rotation import RandomizedHadamard
from mmkv.codecs.turboquant_mse import (
    ScalarQuantizer,
    check_heads,
    codebook,
    pack_plane,
    store_norm,
    unpack_plane,
)


@dataclass(frozen=True)
class TurboQuantProdConfig(CodecConfig):
    """bits (2..6 total per coordinate: bits-1 MSE + 1 QJL), norm (32 or 16 bits for both stored norms)."""

    name: ClassVar[str] = "turboquant-prod"
    aliases: ClassVar[dict[str, str]] = {"b": "bits"}
    printed: ClassVar[dict[str, str]] = {"bits": "b"}
    bits: int = 4
    norm: int = 32

    def __post_init__(self) -> None:
        self.check_choice("bits", (2, 3, 4, 5, 6))
        self.check_choice("norm", (32, 16))


class TurboQuantProdCodec(GaussianSketch, Codec):
    """TurboQuant-prod keys (parameters: `TurboQuantProdConfig`)."""

    config_class = TurboQuantProdConfig
    display_name = "TurboQuant-prod"
    # Not token_local: the reference projects with a matmul whose fp32 result depends on how many rows it gets
    # (a 1-token unit and the same token inside a run differ by ~1e-6), so a merged run would not decode bit
    # for bit like its units; and the score estimator re-unpacks a whole segment per query chunk.
    token_local = False
    requires_pow2 = True
    has_scores = True
    rotation_stream = "turboquant"  # shared with turboquant-mse: the MSE stage is that codec at b-1 bits
    sketch_stream = "turboquant-prod-qjl"

    def setup(self) -> None:
        cfg, d = self.config, self.head_dim
        self.b, self.norm_bits = cfg.bits, cfg.norm
        self.mse_q = ScalarQuantizer(codebook(d, self.b - 1))
        self.rotation = RandomizedHadamard(
            d, num_heads=self.num_heads, seed=self.seed, layer=self.layer, stream=self.rotation_stream
        )
        self.setup_sketch(d)  # Algorithm 2 uses a square sketch
        self.qjl_scale = math.sqrt(math.pi / 2) / self.m  # Lemma 3.2 / Algorithm 2 step 5

    @property
    def bits_per_vector(self) -> int:
        """(b-1)*d MSE bits + d QJL bits + two norms."""
        return self.b * self.head_dim + 2 * self.norm_bits

    # -- sketch S (`GaussianSketch`), one per KV head, broadcast over dim -3 -------------------------------------
    def _signs(self, enc: Encoded) -> torch.Tensor:
        z = unpack_plane(enc.tensors["qjl"], 1, enc.shape[-2], self.m)
        return z.to(torch.float32) * 2 - 1

    # -- codec ----------------------------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor) -> Encoded:
        where = f"codec {self.config} (layer {self.layer})"
        norm = x.norm(dim=-1)
        u = self.rotation.forward(x / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1))
        idx = self.mse_q.encode(u)  # step 1
        r = self.rotation.inverse(u - self.mse_q.decode(idx))  # step 2: x1 - Pi^T c[idx], by linearity of Pi^T
        signs = self.project(r) >= 0  # step 3, sign(0) = +1
        return Encoded(
            str(self.config),
            tuple(x.shape),
            x.dtype,
            {
                "idx": pack_plane(idx, self.b - 1),
                "qjl": pack_plane(signs.to(torch.int64), 1),
                "rnorm": store_norm(r.norm(dim=-1), self.norm_bits, where),  # step 4
                "norm": store_norm(norm, self.norm_bits, where),
            },
        )

    def _mse_rotated(self, enc: Encoded) -> torch.Tensor:
        return self.mse_q.decode(unpack_plane(enc.tensors["idx"], self.b - 1, enc.shape[-2], self.head_dim))

    def _decode(self, enc: Encoded) -> torch.Tensor:
        coef = (self.qjl_scale * enc.tensors["rnorm"].float()).unsqueeze(-1)
        qjl = torch.matmul(self._signs(enc), self._s(enc.device))  # S^T qjl
        unit = self.rotation.inverse(self._mse_rotated(enc)) + coef * qjl
        return enc.tensors["norm"].float().unsqueeze(-1) * unit

    def scores(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """The paper's estimator n * (<Pi q, c[idx]> + gamma sqrt(pi/2)/d <S q, qjl>): q[..., Tq, D] -> [..., Tq, T]."""
        check_heads(self, q)
        q = q.float()
        mse = torch.matmul(self.rotation.forward(q), self._mse_rotated(enc).transpose(-1, -2))
        qjl = torch.matmul(self.project(q), self._signs(enc).transpose(-1, -2))
        rnorm = enc.tensors["rnorm"].float().unsqueeze(-2)
        return enc.tensors["norm"].float().unsqueeze(-2) * (mse + self.qjl_scale * rnorm * qjl)
