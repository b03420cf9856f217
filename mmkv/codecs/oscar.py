"""OScaR (Su et al., arXiv 2605.19660; `ZunhaiSu/OScaR-KV-Quant`): KIVI-style per-channel K quantisation after
Canalized Rotation and Omni-Token Scaling (OScaR paper; upstream `csrc/oscar`).

K path (`role=k`), on post-RoPE keys k[..., H, T, D] of one layer:
  1. Canalized Rotation: k~ = H k, the normalised Sylvester Walsh-Hadamard matrix, no random signs (`k_preprocess.cu`).
  2. Omni-Token Scaling: n_t = ||k~_t|| over ALL KV heads and head_dim of the layer, one fp32 scalar per token;
     n_t = 1 when it is <= 0 or not finite; k^ = k~ / n_t (division as OScaR's `k_preprocess.cu` does).
  3. Per channel, groups of G tokens: s = (max - min) / (2^b - 1), z = round(-min / s),
     q = clamp(round(k^ / s + z), 0, 2^b - 1), stored as fp16 (s, -z s) (`qpack.h`); a zero-range group stores
     (0, min) and is exact.
  Decode: k = H (deq(k^) n_t). Attention may instead score in the rotated domain, <H q, deq(k^_t)> n_t (upstream):
  `rotate_query`, `decode_normalized` (deq(k^)), `token_norms` (n_t), `decode_rotated` (deq(k^) n_t), `scores`.

V path (`role=v`): OScaR folds H into W_v / W_o offline. mmkv does no model surgery, so the same rotation is
applied online at encode (v~ = H v) and undone at decode (H is self-inverse): the stored tensor and its error are those
of the folded model. Then per token, groups of G channels, the same rounded-zero-point quantiser, fp16 (s, -z s).

Bits a value (T a multiple of G): K = b + 32/G + 32/(H D), V = b + 32/G. A ragged last token group adds its own
(s, -z s) row, which is counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mmkv.codecs.base import CodecError, Encoded
from mmkv.codecs.groupquant import RoleCodec, RoleConfig, decode_minmax, encode_minmax
from mmkv.codecs.rotation import hadamard_transform


@dataclass(frozen=True)
class OscarConfig(RoleConfig):
    # The paper's kernels do 2 and 4 bits; 3 is accepted for iso-bit comparisons with the other codecs.
    name: ClassVar[str] = "oscar"
    allowed_bits: ClassVar[tuple[int, ...]] = (2, 3, 4)


class OscarCodec(RoleCodec):
    """OScaR: keys scaled by their omni-token norm; its own V recipe is rotated V in per-token groups with the key's G
    (32 in the paper) and bits."""

    config_class = OscarConfig
    display_name = "OScaR"
    requires_pow2 = True

    def check_input(self, x: torch.Tensor, finite: bool = True) -> None:
        super().check_input(x, finite)
        # The omni-token norm spans every KV head of the layer, so the head axis must be the one the codec was built
        # for; with one head a 3-D input whose dim -3 is not 1 is ambiguous (heads or batch?) and is refused.
        if self.role == "k" and x.dim() >= 3 and x.shape[-3] != self.num_heads:
            raise CodecError(
                f"codec {self.config} (layer {self.layer}): built for {self.num_heads} KV head(s) but got shape "
                f"{tuple(x.shape)}; OScaR's token norm is taken over all KV heads of the layer, so pass "
                f"[..., H, T, D] and build the codec with num_heads=H"
            )

    # -- rotated-domain helpers -----------------------------------------------------------------------------------
    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """H q: the query in the basis the keys are stored in (OScaR's `flash_fwd_kernel.h`)."""
        return hadamard_transform(q.float())

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """H y: back from the rotated basis (H is symmetric and orthogonal, hence self-inverse)."""
        return hadamard_transform(y.float())

    def _check(self, enc: Encoded) -> None:
        if enc.codec != str(self.config):
            raise CodecError(f"cannot decode data encoded by {enc.codec!r} with codec {self.config}")

    def token_norms(self, enc: Encoded) -> torch.Tensor:
        """The fp32 omni-token norms n_t, shape [..., T] (leading dims without the head axis)."""
        self._check(enc)
        if self.role != "k":
            raise CodecError(f"codec {self.config}: only the key path (role=k) stores token norms")
        return enc.tensors["norm"]

    def decode_normalized(self, enc: Encoded) -> torch.Tensor:
        """deq(k^) for K (rotated and normalised: scale token t by n_t) or deq(H v) for V (rotated), fp32."""
        self._check(enc)
        return decode_minmax(enc.tensors, enc.shape, bits=self.bits, group=self.group, axis=self.axis,
                             units=self.units(enc))

    def decode_rotated(self, enc: Encoded) -> torch.Tensor:
        """The reconstruction in the rotated domain, deq(k^) n_t for K (deq(H v) for V), so that, as for the other
        rotation codecs, score = <rotate_query(q), decode_rotated(enc)> (OCTOPUS paper, eq. 13)."""
        y = self.decode_normalized(enc)
        if self.role == "k":
            y = y * self._norm_per_row(enc.tensors["norm"], len(enc.shape))
        return y

    def _norm_per_row(self, norm: torch.Tensor, ndim: int) -> torch.Tensor:
        # norm [..., T] -> broadcastable over [..., H, T, D] (or [T, D] for a 2-D unit).
        return norm.unsqueeze(-1) if ndim == 2 else norm.unsqueeze(-2).unsqueeze(-1)

    def scores(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """<H q, deq(k^_t)> n_t for every stored key: q[..., H, Tq, D] -> [..., H, Tq, T] (fp32), in the order of
        OScaR's kernel, which multiplies the fp32 score column by the token norm (`apply_token_norm`)."""
        if self.role != "k":
            self._check(enc)
            return super().scores(q, enc)
        s = torch.matmul(self.rotate_query(q), self.decode_normalized(enc).transpose(-1, -2))
        norm = enc.tensors["norm"]
        return s * (norm if len(enc.shape) == 2 else norm.unsqueeze(-2).unsqueeze(-2))

    # -- codec protocol -------------------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor) -> Encoded:
        where = f"codec {self.config} (layer {self.layer})"
        rotated = hadamard_transform(x)
        tensors = {}
        if self.role == "k":
            sq = rotated.square().sum(-1)  # [..., (H,) T]
            if x.dim() >= 3:
                sq = sq.sum(-2)  # over the KV heads: one norm per token per layer
            norm = sq.sqrt()
            norm = torch.where(torch.isfinite(norm) & (norm > 0), norm, torch.ones_like(norm))
            rotated = rotated / self._norm_per_row(norm, x.dim())
            tensors["norm"] = norm.to(torch.float32).contiguous()
        tensors.update(
            encode_minmax(
                rotated, bits=self.bits, group=self.group, axis=self.axis, zero_point="rounded",
                meta_dtype=self.meta_dtype, where=where,
            )
        )
        return Encoded(self.name, tuple(x.shape), x.dtype, tensors)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return hadamard_transform(self.decode_rotated(enc))
