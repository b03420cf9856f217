"""QJL: a 1-bit Johnson-Lindenstrauss sign sketch of each key with an asymmetric, unbiased score estimator
(QJL paper, Def. 3.1 and Algorithm 1).

Encode: z = sign(S k) in {+-1}^m with S in R^{m x d} i.i.d. N(0, 1), m = bits * d, one S per (layer, KV head) from a
private generator; store the packed signs and nu = ||k||.
Scores: q.k ~= sqrt(pi/2)/m * nu * <S q, z>, unbiased by Lemma 3.2 (E|g| = sigma sqrt(2/pi)). The query is never
quantised: sign-quantising both sides would estimate the angle, and its cosine is biased.
Decode: k_hat = sqrt(pi/2)/m * nu * S^T z, the one vector whose inner products are exactly the estimator
(<q, k_hat> = score), so the decode + SDPA path and the score path agree. As a reconstruction it is noisy by
design: E_S ||k_hat - k||^2 = ((pi/2) d - 1)/m * ||k||^2, about 0.78 ||k||^2 at m = 2d.

S is plain i.i.d. Gaussian (Def. 3.1), which makes the estimator exactly unbiased; the official code orthogonalises
S by QR in 128-row chunks and rescales rows to sqrt(d), which lowers variance but leaves an O(1/d) bias. The
outlier-channel split of the official code (`amirzandieh/QJL`) is not part of this codec
(docs/decisions.md).

Stored per row of T tokens: `signs` (1-bit, one dense bit stream over T*m signs, bit 1 = +1) and `norm` (fp32 by
default, fp16 optionally). Bits per key: m + 32 = bits*d + 32 (or + 16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from mmkv.codecs.base import Codec, Encoded
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.turboquant_mse import check_heads, gaussian_sketch, pack_plane, store_norm, unpack_plane


class GaussianSketch:
    """The per-KV-head i.i.d. Gaussian sketch S[H, m, d] of Def. 3.1, for a codec that sketches keys (QJL, and the
    residual stage of TurboQuant-prod): `setup_sketch` draws S on the codec's `sketch_stream`, `project` is S v."""

    sketch_stream: str

    def setup_sketch(self, m: int) -> None:
        self.m = m
        self.sketch = gaussian_sketch(
            m, self.head_dim, num_heads=self.num_heads, seed=self.seed, layer=self.layer, stream=self.sketch_stream
        )
        self._sketches: dict[torch.device, torch.Tensor] = {}

    def _s(self, device: torch.device) -> torch.Tensor:
        if device not in self._sketches:
            s = self.sketch.to(device)
            self._sketches[device] = s[0] if self.num_heads == 1 else s  # [H, m, d] meets [..., H, T, d]
        return self._sketches[device]

    def project(self, v: torch.Tensor) -> torch.Tensor:
        """S v for v[..., T, d] -> [..., T, m] (fp32)."""
        return torch.matmul(v, self._s(v.device).transpose(-1, -2))


@dataclass(frozen=True)
class QJLConfig(CodecConfig):
    """bits (1..8 sign bits per coordinate, i.e. sketch size m = bits * d), norm (32 or 16 bits for ||k||)."""

    name: ClassVar[str] = "qjl"
    aliases: ClassVar[dict[str, str]] = {"b": "bits"}
    bits: int = 2
    norm: int = 32

    def __post_init__(self) -> None:
        self.check_choice("bits", tuple(range(1, 9)))
        self.check_choice("norm", (32, 16))


class QJLCodec(GaussianSketch, Codec):
    """QJL keys (parameters: `QJLConfig`)."""

    config_class = QJLConfig
    display_name = "QJL"
    # Not token_local: the reference projects with a matmul whose fp32 result depends on how many rows it gets
    # (a 1-token unit and the same token inside a run differ by ~1e-6), so a merged run would not decode bit
    # for bit like its units; and the score estimator re-unpacks a whole segment per query chunk.
    token_local = False
    has_scores = True
    sketch_stream = "qjl"

    def setup(self) -> None:
        self.bits, self.norm_bits = self.config.bits, self.config.norm
        self.setup_sketch(self.bits * self.head_dim)
        self.scale = math.sqrt(math.pi / 2) / self.m  # Def. 3.1

    @property
    def bits_per_vector(self) -> int:
        return self.m + self.norm_bits

    def _signs(self, enc: Encoded) -> torch.Tensor:
        return unpack_plane(enc.tensors["signs"], 1, enc.shape[-2], self.m).to(torch.float32) * 2 - 1

    def _encode(self, x: torch.Tensor) -> Encoded:
        signs = self.project(x) >= 0  # sign(0) = +1; a zero key has nu = 0, so its signs never matter
        return Encoded(
            str(self.config),
            tuple(x.shape),
            x.dtype,
            {
                "signs": pack_plane(signs.to(torch.int64), 1),
                "norm": store_norm(x.norm(dim=-1), self.norm_bits, f"codec {self.config} (layer {self.layer})"),
            },
        )

    def _decode(self, enc: Encoded) -> torch.Tensor:
        coef = (self.scale * enc.tensors["norm"].float()).unsqueeze(-1)
        return coef * torch.matmul(self._signs(enc), self._s(enc.device))

    def scores(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """sqrt(pi/2)/m * nu * <S q, z>: q[..., Tq, D] -> [..., Tq, T] (fp32), the QJL paper's estimator."""
        check_heads(self, q)
        sq = self.project(q.float())
        inner = torch.matmul(sq, self._signs(enc).transpose(-1, -2))  # <S q, z>
        return self.scale * enc.tensors["norm"].float().unsqueeze(-2) * inner
