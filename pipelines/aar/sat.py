"""SAT, the scale-level audio tokenizer of AAR: an EnCodec-style SEANet autoencoder plus multi-scale residual VQ.

Written for mmkv from the official architecture; module and attribute paths equal the official code's
(`qiuk2/AAR` at eaaf1bc: model/SAT.py, modules/seanet.py, modules/conv.py, quantization/core_vq.py), so the released
`SAT_d128_lat128.pth` loads strictly. Weight-normed convolutions keep the legacy `weight_g` / `weight_v` parameters
(torch.nn.utils.weight_norm's keys) and compute w = g * v / ||v|| (norm over every dim but 0) on each call.

Generation only needs the decoder and the quantizer's codebooks and phi convolutions; the encoder is here so the
checkpoint loads strictly (its forward works, but the released multi-scale `encode` is broken upstream: it reads an
unset `shared_codebook` in quantization/core_vq.py, and is not reproduced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# The 16-scale schedule of the released models (AAR config/inference/AAR.yaml); 75 latent frames = 1 s at 24 kHz
# (hop 320).
AAR_PATCH_NUMS: tuple[int, ...] = (1, 2, 4, 6, 9, 12, 16, 20, 25, 31, 37, 43, 50, 58, 66, 75)


@dataclass(frozen=True)
class SATConfig:
    """Constructor arguments of SAT (AAR model/SAT.py). Defaults are the AAR-paired `SAT_d128_lat128.pth`.

    `n_filters` is fixed at 32 upstream; it is exposed here only so that unit tests can build a smaller SEANet.
    """

    multi_scale: tuple[int, ...] = AAR_PATCH_NUMS
    phi_kernel: tuple[int, ...] = (9,) * 6
    dimension: int = 128
    latent_dim: int = 128
    ratios: tuple[int, ...] = (8, 5, 4, 2)
    n_residual_layers: int = 1
    lstm: int = 2
    n_filters: int = 32
    channels: int = 1
    bins: int = 1024
    causal: bool = False  # the class default upstream is True, but every script builds with False (inference_AAR.py)
    sample_rate: int = 24_000

    @property
    def hop_length(self) -> int:
        return int(np.prod(self.ratios))

    @property
    def num_samples(self) -> int:
        """Samples decoded from the last (full) scale: 75 frames x 320 = 24 000 for the released model."""
        return self.multi_scale[-1] * self.hop_length

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


# ----------------------------------------------------------------------------------------------------------------
# Weight-normed convolutions with the legacy parameter names


def _weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Legacy torch.nn.utils.weight_norm with dim=0: w = g * v / ||v||, the norm over every dim except 0. The fused op
    # it calls (`torch._weight_norm`) is used so decoded audio is bit-identical to the official code's.
    if hasattr(torch, "_weight_norm"):
        return torch._weight_norm(v, g, 0)
    return v * (g / v.norm(dim=tuple(range(1, v.dim())), keepdim=True))


class WNConv1d(nn.Module):
    """nn.Conv1d under legacy weight norm: parameters `weight_g` [out,1,1], `weight_v` [out,in,k], `bias` [out]."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation
        self.weight_g = nn.Parameter(torch.empty(out_channels, 1, 1))
        self.weight_v = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels))

    @property
    def weight(self) -> torch.Tensor:
        return _weight_norm(self.weight_g, self.weight_v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias, stride=self.stride, dilation=self.dilation)


class WNConvTranspose1d(nn.Module):
    """nn.ConvTranspose1d under legacy weight norm; dim 0 of its weight is the *input* channel axis (as in torch)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = kernel_size, stride
        self.weight_g = nn.Parameter(torch.empty(in_channels, 1, 1))
        self.weight_v = nn.Parameter(torch.empty(in_channels, out_channels, kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels))

    @property
    def weight(self) -> torch.Tensor:
        return _weight_norm(self.weight_g, self.weight_v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose1d(x, self.weight, self.bias, stride=self.stride)


class NormConv1d(nn.Module):
    """Holds the conv as `.conv` (key path `…conv.conv.weight_g`); the norm module upstream is an Identity."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.conv = WNConv1d(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class NormConvTranspose1d(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.convtr = WNConvTranspose1d(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convtr(x)


def _extra_padding(length: int, kernel_size: int, stride: int, padding_total: int) -> int:
    # Extra right padding so the last window is full (EnCodec `get_extra_padding_for_conv1d`).
    n_frames = (length - kernel_size + padding_total) / stride + 1
    ideal_length = (math.ceil(n_frames) - 1) * stride + (kernel_size - padding_total)
    return ideal_length - length


def _pad1d_reflect(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    # Reflect padding that also works on inputs shorter than the pad (zero-extend first, EnCodec `pad1d`).
    length = x.shape[-1]
    extra = max(left, right) - length + 1 if length <= max(left, right) else 0
    if extra:
        x = F.pad(x, (0, extra))
    padded = F.pad(x, (left, right), mode="reflect")
    return padded[..., : padded.shape[-1] - extra]


class SConv1d(nn.Module):
    """Conv1d with EnCodec's same-length padding (reflect; non-causal splits it left-heavy)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 causal: bool = False):
        super().__init__()
        self.conv = NormConv1d(in_channels, out_channels, kernel_size, stride, dilation)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv.conv
        kernel_size = (conv.kernel_size - 1) * conv.dilation + 1
        padding_total = kernel_size - conv.stride
        extra = _extra_padding(x.shape[-1], kernel_size, conv.stride, padding_total)
        if self.causal:
            x = _pad1d_reflect(x, padding_total, extra)
        else:
            right = padding_total // 2
            x = _pad1d_reflect(x, padding_total - right, right + extra)
        return self.conv(x)


class SConvTranspose1d(nn.Module):
    """ConvTranspose1d that trims the fixed padding (right-heavy trim when causal, trim_right_ratio 1)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, causal: bool = False):
        super().__init__()
        self.convtr = NormConvTranspose1d(in_channels, out_channels, kernel_size, stride)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        convtr = self.convtr.convtr
        padding_total = convtr.kernel_size - convtr.stride
        y = self.convtr(x)
        right = padding_total if self.causal else padding_total // 2
        left = padding_total - right
        return y[..., left: y.shape[-1] - right]


class SLSTM(nn.Module):
    """LSTM over time in conv layout (B, C, T) with a residual skip."""

    def __init__(self, dimension: int, num_layers: int = 2):
        super().__init__()
        self.lstm = nn.LSTM(dimension, dimension, num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(2, 0, 1)
        y, _ = self.lstm(x)
        return (y + x).permute(1, 2, 0)


class SEANetResnetBlock(nn.Module):
    """[ELU, conv dim->dim/2 k3, ELU, conv dim/2->dim k1] plus a 1x1-conv shortcut (true_skip=False)."""

    def __init__(self, dim: int, dilation: int = 1, causal: bool = False, compress: int = 2):
        super().__init__()
        hidden = dim // compress
        self.block = nn.Sequential(
            nn.ELU(alpha=1.0),
            SConv1d(dim, hidden, kernel_size=3, dilation=dilation, causal=causal),
            nn.ELU(alpha=1.0),
            SConv1d(hidden, dim, kernel_size=1, causal=causal),
        )
        self.shortcut = SConv1d(dim, dim, kernel_size=1, causal=causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shortcut(x) + self.block(x)


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: SATConfig):
        super().__init__()
        nf, mult = cfg.n_filters, 1
        model: list[nn.Module] = [SConv1d(cfg.channels, nf, 7, causal=cfg.causal)]
        for ratio in reversed(cfg.ratios):  # the encoder downsamples in the reverse order
            for j in range(cfg.n_residual_layers):
                model.append(SEANetResnetBlock(mult * nf, dilation=2**j, causal=cfg.causal))
            model += [nn.ELU(alpha=1.0),
                      SConv1d(mult * nf, mult * nf * 2, kernel_size=2 * ratio, stride=ratio, causal=cfg.causal)]
            mult *= 2
        if cfg.lstm:
            model.append(SLSTM(mult * nf, cfg.lstm))
        model += [nn.ELU(alpha=1.0), SConv1d(mult * nf, cfg.dimension, 7, causal=cfg.causal)]
        self.model = nn.Sequential(*model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class SEANetDecoder(nn.Module):
    def __init__(self, cfg: SATConfig):
        super().__init__()
        nf, mult = cfg.n_filters, 2 ** len(cfg.ratios)
        model: list[nn.Module] = [SConv1d(cfg.dimension, mult * nf, 7, causal=cfg.causal)]
        if cfg.lstm:
            model.append(SLSTM(mult * nf, cfg.lstm))
        for ratio in cfg.ratios:
            model += [nn.ELU(alpha=1.0),
                      SConvTranspose1d(mult * nf, mult * nf // 2, kernel_size=2 * ratio, stride=ratio,
                                       causal=cfg.causal)]
            for j in range(cfg.n_residual_layers):
                model.append(SEANetResnetBlock(mult * nf // 2, dilation=2**j, causal=cfg.causal))
            mult //= 2
        # No final activation: the decoded waveform is unbounded float (AAR modules/seanet.py).
        model += [nn.ELU(alpha=1.0), SConv1d(nf, cfg.channels, 7, causal=cfg.causal)]
        self.model = nn.Sequential(*model)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model(z)


# ----------------------------------------------------------------------------------------------------------------
# Multi-scale residual VQ (inference side)


class EuclideanCodebook(nn.Module):
    """Buffers `inited`, `cluster_size`, `embed` [bins, dim], `embed_avg`; lookup only (no EMA training here)."""

    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        self.codebook_size = codebook_size
        self.register_buffer("inited", torch.zeros(1))
        self.register_buffer("cluster_size", torch.zeros(codebook_size))
        self.register_buffer("embed", torch.zeros(codebook_size, dim))
        self.register_buffer("embed_avg", torch.zeros(codebook_size, dim))

    def decode(self, embed_ind: torch.Tensor) -> torch.Tensor:
        return F.embedding(embed_ind, self.embed)


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, codebook_size)
        self.codebook_size = codebook_size


class Phi(nn.Conv1d):
    """h -> (1 - r) h + r conv(h) with r = 0.5 (quantization/core_vq.py `Phi`)."""

    def __init__(self, embed_dim: int, quant_resi: float, ks: int):
        super().__init__(embed_dim, embed_dim, kernel_size=ks, stride=1, padding=ks // 2)
        self.resi_ratio = abs(quant_resi)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mul(1 - self.resi_ratio) + super().forward(h).mul_(self.resi_ratio)


class PhiPartiallyShared(nn.Module):
    """K phi convs shared across scales: scale si uses the one whose tick is nearest si/(S-1) (AAR
    quantization/core_vq.py)."""

    def __init__(self, qresi_ls: nn.ModuleList):
        super().__init__()
        self.qresi_ls = qresi_ls
        K = len(qresi_ls)
        self.ticks = np.linspace(1 / 3 / K, 1 - 1 / 3 / K, K) if K == 4 else np.linspace(1 / 2 / K, 1 - 1 / 2 / K, K)

    def index(self, at_from_0_to_1: float) -> int:
        return int(np.argmin(np.abs(self.ticks - at_from_0_to_1)))

    def __getitem__(self, at_from_0_to_1: float) -> Phi:
        return self.qresi_ls[self.index(at_from_0_to_1)]


class MultiscaleResidualVectorQuantization(nn.Module):
    """`quantizer.vq`: per-scale codebooks `layers[i]`, shared phi convs `quant_resi`, optional in/out projections."""

    def __init__(self, cfg: SATConfig):
        super().__init__()
        self.scale = tuple(cfg.multi_scale)
        self.dim = cfg.latent_dim
        # Projections exist only when dimension != latent_dim (absent from the AAR-paired d128/lat128 file).
        proj = cfg.dimension != cfg.latent_dim
        self.project_in = nn.Linear(cfg.dimension, cfg.latent_dim) if proj else nn.Identity()
        self.project_out = nn.Linear(cfg.latent_dim, cfg.dimension) if proj else nn.Identity()
        self.quant_resi = PhiPartiallyShared(nn.ModuleList([Phi(cfg.latent_dim, 0.5, ks) for ks in cfg.phi_kernel]))
        self.layers = nn.ModuleList([VectorQuantization(cfg.latent_dim, cfg.bins) for _ in cfg.multi_scale])

    def embedding(self, idx_Bl: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Codebook vectors of scale `layer_id`: idx (B, l) -> (B, latent, l)."""
        return self.layers[layer_id]._codebook.decode(idx_Bl).permute(0, 2, 1)

    def phi_index(self, si: int) -> int:
        return self.quant_resi.index(si / (len(self.scale) - 1))

    def get_next_autoregressive_input(self, si: int, f_hat: torch.Tensor, h_BCl: torch.Tensor):
        """f_hat += phi(upsample(h)); next input = area-downsample(f_hat) to the next scale (core_vq.py)."""
        H, SN = self.scale[-1], len(self.scale)
        phi = self.quant_resi[si / (SN - 1)]
        if si != SN - 1:
            f_hat.add_(phi(F.interpolate(h_BCl, size=H, mode="linear")))
            return f_hat, F.interpolate(f_hat, size=self.scale[si + 1], mode="area")
        f_hat.add_(phi(h_BCl))
        return f_hat, f_hat

    def post_conv(self, fhat_BLC: torch.Tensor) -> torch.Tensor:
        return self.project_out(fhat_BLC).permute(0, 2, 1)


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: SATConfig):
        super().__init__()
        self.n_q = len(cfg.multi_scale)
        self.bins = cfg.bins
        self.vq = MultiscaleResidualVectorQuantization(cfg)

    def embedding(self, idx_Bl: torch.Tensor, layer_id: int) -> torch.Tensor:
        return self.vq.embedding(idx_Bl, layer_id)

    def get_next_autoregressive_input(self, si: int, f_hat: torch.Tensor, h_BCl: torch.Tensor):
        return self.vq.get_next_autoregressive_input(si, f_hat, h_BCl)

    def post_conv(self, fhat_BLC: torch.Tensor) -> torch.Tensor:
        return self.vq.post_conv(fhat_BLC)


class SAT(nn.Module):
    """Scale-level audio tokenizer. `fhat_to_audio` maps the latent f_hat (B, latent, 75) to audio (B, 1, 24000)."""

    def __init__(self, cfg: SATConfig = SATConfig()):
        super().__init__()
        if len(cfg.multi_scale) < 2:
            raise ValueError(f"SAT needs at least 2 scales, got multi_scale={cfg.multi_scale}")
        self.config = cfg
        self.encoder = SEANetEncoder(cfg)
        self.decoder = SEANetDecoder(cfg)
        self.quantizer = ResidualVectorQuantizer(cfg)

    @property
    def latent_dim(self) -> int:
        return self.config.latent_dim

    @property
    def codebook_size(self) -> int:
        return self.config.bins

    def fhat_to_audio(self, fhat: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.quantizer.post_conv(fhat.permute(0, 2, 1)))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, codebook_std: float = 1.0) -> "SAT":
        """Random weights from a private generator (tests only; real use loads a checkpoint).

        Codebooks are N(0, codebook_std^2) and marked inited: the upstream k-means path initialises them to zeros,
        which would make the audio independent of the tokens (AAR quantization/core_vq.py `EuclideanCodebook`).
        """
        for name, p in self.named_parameters():
            if name.endswith("weight_g"):
                p.copy_(torch.rand(p.shape, generator=generator) * 0.5 + 0.75)
            elif p.dim() == 1:  # conv/LSTM biases
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
            else:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))
        for layer in self.quantizer.vq.layers:
            cb = layer._codebook
            cb.embed.copy_(torch.randn(cb.embed.shape, generator=generator) * codebook_std)
            cb.embed_avg.copy_(cb.embed)
            cb.cluster_size.fill_(1.0)
            cb.inited.fill_(1.0)
        return self


def build_sat(cfg: SATConfig, device: torch.device | str = "meta") -> SAT:
    """A SAT whose tensors live on `device`; the default `meta` allocates nothing (for `load_state_dict(assign=True)`)."""
    with torch.device(device):
        return SAT(cfg)
