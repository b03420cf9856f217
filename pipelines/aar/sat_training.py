"""The SAT pieces of `mmkv train audio`: EMA codebooks with k-means start and dead-code reset (upstream
`quantization/core_vq.py`, with two fixes), the multi-scale quantiser as inference runs it, the multi-resolution mel
loss, and held-out reconstruction scores."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from mmkv.codecs.base import private_generator
from mmkv.pipelines.aar import sounds
from mmkv.pipelines.aar.sat import SAT, SATConfig, WNConv1d, WNConvTranspose1d, build_sat
from mmkv.pipelines.aar.train_data import render_clips

if TYPE_CHECKING:
    from mmkv.pipelines.aar.train import AudioTrainConfig


@dataclass(frozen=True)
class CodebookTraining:
    """EMA codebook updates of upstream `quantization/core_vq.py` `EuclideanCodebook` (its `vq.py` defaults)."""

    decay: float = 0.99
    epsilon: float = 1e-5
    kmeans_iters: int = 50
    dead_code: float = 2.0  # EMA count below which a code is reset
    # With `dead_code_share` > 0, the bar is relative instead: a code is dead when its EMA count is below that share of
    # a uniform split of the step's rows (share x N / K), and a reset code restarts at the uniform split N / K. The
    # absolute bar assumes many rows a step: upstream's 2.0 lets at most N / 2 codes live, and a coarse scale of the
    # SAT sees one row a clip (32 a step), so nearly every code was reset every step and the codebook ended as copies
    # of the last batch (a 32-row stream of N(0, I) vectors: 34 of 1,024 codes in use, relative MSE 0.95; with share
    # 0.1: 528 codes, 0.75; docs/training.md). At decay d a code at its uniform rate dies after about
    # ln(1 / share) / (1 - d) steps without a row (230 at share 0.1, d 0.99), at every scale alike.
    dead_code_share: float = 0.0  # 0: the absolute `dead_code` (upstream)
    generator: torch.Generator = field(default_factory=torch.Generator, compare=False)
    inited: set = field(default_factory=set, compare=False)  # codebooks seen inited (saves a device sync a step)


def _sample_vectors(x: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    # core_vq.py `sample_vectors`: distinct rows when there are enough, else with replacement.
    idx = torch.randperm(x.shape[0], generator=gen)[:n] if x.shape[0] >= n else torch.randint(
        0, x.shape[0], (n,), generator=gen)
    return x[idx.to(x.device)]


def _nearest(x: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    dist = -(x.pow(2).sum(1, keepdim=True) - 2 * x @ embed.t() + embed.pow(2).sum(1)[None])
    return dist.max(dim=-1).indices


@torch.no_grad()
def kmeans_init_(codebook, x: torch.Tensor, iters: int, gen: torch.Generator) -> None:
    """core_vq.py `kmeans` on the first batch: centroids from sampled rows, empty clusters keep their centroid.
    `embed_avg` gets count x centroid: upstream copies the centroids themselves, which the EMA reads as sums, so its
    first update shrinks every code by about 1 / count."""
    k = codebook.codebook_size
    means = _sample_vectors(x, k, gen)
    bins = torch.zeros(k, device=x.device)
    for _ in range(iters):
        buckets = _nearest(x, means)
        bins = torch.bincount(buckets, minlength=k).to(x.dtype)
        sums = torch.zeros_like(means).index_add_(0, buckets, x)
        means = torch.where(bins[:, None] == 0, means, sums / bins.clamp(min=1)[:, None])
    codebook.embed.copy_(means)
    codebook.embed_avg.copy_(means * bins[:, None])
    codebook.cluster_size.copy_(bins)
    codebook.inited.fill_(1.0)


def codebook_step(codebook, x: torch.Tensor, train: CodebookTraining | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest codes of the rows of x [N, dim] and their vectors (from the codebook before this step's update); in
    training, then the dead-code reset and the EMA update (core_vq.py `EuclideanCodebook.forward`)."""
    if train is not None and id(codebook) not in train.inited:
        if not bool(codebook.inited):
            kmeans_init_(codebook, x.detach(), train.kmeans_iters, train.generator)
        train.inited.add(id(codebook))
    idx = _nearest(x.detach(), codebook.embed)
    q = F.embedding(idx, codebook.embed)
    if train is not None:
        with torch.no_grad():
            _expire_codes_(codebook, x.detach(), train)
            k, d = codebook.codebook_size, train.decay
            codebook.cluster_size.mul_(d).add_(torch.bincount(idx, minlength=k).to(x.dtype), alpha=1 - d)
            sums = torch.zeros_like(codebook.embed_avg).index_add_(0, idx, x.detach())
            codebook.embed_avg.mul_(d).add_(sums, alpha=1 - d)
            n = codebook.cluster_size.sum()
            smoothed = (codebook.cluster_size + train.epsilon) / (n + k * train.epsilon) * n  # Laplace smoothing
            codebook.embed.copy_(codebook.embed_avg / smoothed[:, None])
    return idx, q


def _expire_codes_(codebook, x: torch.Tensor, train: CodebookTraining) -> None:
    # core_vq.py `expire_codes_` replaces only `embed`, which the EMA step right after overwrites with
    # embed_avg / cluster_size; the reset also writes those statistics (as vector-quantize-pytorch does), so a dead
    # code really restarts at a vector of the batch.
    if train.dead_code_share > 0:
        restart = x.shape[0] / codebook.codebook_size
        bar = train.dead_code_share * restart
    else:
        bar = restart = train.dead_code
    if bar <= 0:
        return
    dead = (codebook.cluster_size < bar)[:, None]
    fresh = _sample_vectors(x, codebook.codebook_size, train.generator)
    codebook.embed.copy_(torch.where(dead, fresh, codebook.embed))
    codebook.embed_avg.copy_(torch.where(dead, fresh * restart, codebook.embed_avg))
    codebook.cluster_size.copy_(torch.where(dead[:, 0], restart, codebook.cluster_size))


def quantize(sat: SAT, z: torch.Tensor, train: CodebookTraining | None = None, commitment: float = 1.0
             ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Multi-scale residual VQ of the encoder output z [B, dimension, T] (core_vq.py
    `Multiscale_ResidualVectorQuantization.forward`).

    Scale si quantises the residual area-downsampled to its length; its code vectors h [B, latent, pn] add
    phi(upsample(h)) to the latent, exactly as `get_next_autoregressive_input` does at inference, and leave the
    residual. Returns (f_hat [B, latent, T], tokens per scale [B, pn], loss): in training f_hat passes the
    decoder's gradient straight through to z and the loss is the mean over scales of commitment
    ||x - sg(q)||^2 + the phi term ||q - sg(x)||^2; otherwise f_hat is the inference latent of the tokens, loss 0."""
    vq = sat.quantizer.vq
    residual = vq.project_in(z.transpose(1, 2)).transpose(1, 2)
    T, last = residual.shape[-1], len(vq.scale) - 1
    if T != vq.scale[-1]:
        raise ValueError(f"the encoder gave {T} latent frames; the SAT's last scale has {vq.scale[-1]}")
    f_hat = torch.zeros_like(residual)
    tokens, losses = [], []
    for si, pn in enumerate(vq.scale):
        x = residual
        down = F.interpolate(x, size=pn, mode="area") if pn != T else x
        flat = down.transpose(1, 2).reshape(-1, down.shape[1])
        idx, q_flat = codebook_step(vq.layers[si]._codebook, flat, train)
        h = q_flat.view(x.shape[0], pn, -1).permute(0, 2, 1)
        phi = vq.quant_resi[si / last]
        q = phi(F.interpolate(h, size=T, mode="linear")) if si != last else phi(h)
        if train is not None:
            losses.append(commitment * F.mse_loss(x, q.detach()) + F.mse_loss(q, x.detach()))
            f_hat = f_hat + (x + (q - x).detach())  # straight-through
        else:
            f_hat = f_hat + q
        residual = residual - q.detach()
        tokens.append(idx.view(x.shape[0], pn))
    loss = torch.stack(losses).mean() if losses else z.new_zeros(())
    return f_hat, tokens, loss


def init_sat(cfg: SATConfig, seed: int) -> SAT:
    """A SAT to train: `SAT.init_weights` draws (weights N(0, 1/fan_in)) with each weight-normed conv's gain set to
    ||v||, as `weight_norm` leaves a freshly built conv; empty codebooks that k-means fills on the first batch."""
    sat = build_sat(cfg, "meta").to_empty(device="cpu")
    sat.init_weights(private_generator(seed, "train-sat"))
    with torch.no_grad():
        for m in sat.modules():
            if isinstance(m, (WNConv1d, WNConvTranspose1d)):
                m.weight_g.copy_(m.weight_v.norm(dim=(1, 2), keepdim=True))
        for layer in sat.quantizer.vq.layers:
            cb = layer._codebook
            for buf in (cb.embed, cb.embed_avg, cb.cluster_size, cb.inited):
                buf.zero_()
    return sat


class MelLoss:
    """upstream `losses.py` l_f: for n_fft 2^5 .. 2^11 (hop n_fft / 4), L1 + L2 of the 64-band log10 mel
    spectrograms (`model/audio_to_mel.py`: reflect pad (n_fft - hop) / 2, no centring, Hann, power, Slaney mel,
    floor 1e-5), summed."""

    def __init__(self, sample_rate: int, device: torch.device, n_mels: int = 64, powers=range(5, 12)):
        from mmkv.metrics.audio import mel_filterbank

        self.ffts = [2 ** i for i in powers]
        self.banks = {n: torch.from_numpy(mel_filterbank(sample_rate, n, n_mels)).float().to(device) for n in self.ffts}
        self.windows = {n: torch.hann_window(n, device=device) for n in self.ffts}

    def log_mel(self, x: torch.Tensor, n_fft: int) -> torch.Tensor:
        hop = n_fft // 4
        p = (n_fft - hop) // 2
        x = F.pad(x.reshape(-1, 1, x.shape[-1]), (p, p), mode="reflect")[:, 0]
        spec = torch.stft(x, n_fft, hop_length=hop, window=self.windows[n_fft], center=False, return_complex=True)
        return torch.matmul(self.banks[n_fft], spec.abs() ** 2).clamp(min=1e-5).log10()

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = output.new_zeros(())
        for n in self.ffts:
            a, b = self.log_mel(target, n), self.log_mel(output, n)
            loss = loss + F.l1_loss(b, a) + F.mse_loss(b, a)
        return loss


def batch_si_snr_db(est: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Batch mean SI-SNR in dB of [B, N] signals (Le Roux et al. 2019, eq. 2 to 4), differentiable."""
    s, e = ref - ref.mean(-1, keepdim=True), est - est.mean(-1, keepdim=True)
    target = (e * s).sum(-1, keepdim=True) / (s * s).sum(-1, keepdim=True).clamp(min=1e-8) * s
    ratio = (target * target).sum(-1) / ((e - target) ** 2).sum(-1).clamp(min=1e-8)
    return (10 * torch.log10(ratio.clamp(min=1e-8))).mean()


def si_snr_db(ref: torch.Tensor, est: torch.Tensor) -> float:
    """`batch_si_snr_db` of one clip, in float64."""
    return float(batch_si_snr_db(est.double()[None], ref.double()[None]))


@torch.no_grad()
def evaluate_sat(sat: SAT, cfg: AudioTrainConfig, device: torch.device) -> dict[str, Any]:
    """Held-out reconstruction through the tokens (encode, quantise, decode the inference latent): SI-SNR, the SAT
    tokenizer's log-mel L1 (`mmkv.metrics.audio.log_mel`), and per scale the codes used and their perplexity.
    SI-SNR is also given per kind of sound: a noise burst's waveform cannot be coded at 455 tokens a second, so its
    SI-SNR says little, while a note's, chirp's or click's measures whether the phase is kept."""
    from mmkv.metrics.audio import log_mel

    held = [sounds.sample_sound(s) for s in sounds.held_out_seeds(cfg.sat_eval_clips)]
    wave = render_clips(held, cfg, device, torch.Generator().manual_seed(2))
    recon, tokens = [], []
    for i in range(0, len(held), cfg.encode_batch):
        w = wave[i:i + cfg.encode_batch, None]
        f_hat, toks, _ = quantize(sat, sat.encoder(w))
        recon.append(sat.fhat_to_audio(f_hat)[:, 0])
        tokens.append(toks)
    recon_all = torch.cat(recon).cpu()
    ref = wave.cpu()
    audible = [i for i in range(len(held)) if float(ref[i].abs().max()) > 0]
    si = [si_snr_db(ref[i], recon_all[i]) for i in audible]
    by_kind: dict[str, list[float]] = {}
    for i, v in zip(audible, si):
        by_kind.setdefault(held[i].kind, []).append(v)
    mel_l1 = [float((log_mel(recon_all[i].numpy(), cfg.sample_rate) - log_mel(ref[i].numpy(), cfg.sample_rate))
                    .abs().mean()) for i in range(len(held))]
    # Codebook use over more clips than the reconstruction scores: scale 0 codes one token a clip, so 128 clips
    # could use at most 128 of its 1024 codes.
    extra = [sounds.sample_sound(s) for s in sounds.held_out_seeds(cfg.sat_usage_clips)[len(held):]]
    for i in range(0, len(extra), cfg.encode_batch):
        w = render_clips(extra[i:i + cfg.encode_batch], cfg, device, torch.Generator().manual_seed(3 + i))
        tokens.append(quantize(sat, sat.encoder(w[:, None]))[1])
    usage = []
    bins = cfg.sat_config().bins
    for si_, pn in enumerate(cfg.sat_config().multi_scale):
        codes = torch.cat([t[si_].reshape(-1) for t in tokens]).cpu()
        p = torch.bincount(codes, minlength=bins).double() / codes.numel()
        perplexity = float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum()))
        usage.append({"scale": si_, "tokens": pn, "used": int((p > 0).sum()), "of": bins,
                      "perplexity": round(perplexity, 2)})
    return {"clips": len(held), "si_snr_db": round(float(np.mean(si)), 3) if si else None,
            "si_snr_clips": len(si),
            "si_snr_db_by_kind": {k: round(float(np.mean(v)), 3) for k, v in sorted(by_kind.items())},
            "log_mel_l1": round(float(np.mean(mel_l1)), 4), "usage_clips": max(len(held), cfg.sat_usage_clips),
            "codebook_usage": usage,
            "adherence": {"reconstructions": adherence_summary(recon_all.numpy(), held, cfg.sample_rate),
                          "originals": adherence_summary(ref.numpy(), held, cfg.sample_rate)}}


def adherence_summary(waves: np.ndarray, held: list[sounds.Sound], sample_rate: int,
                      thresholds: Any = None) -> dict[str, Any]:
    """`score_audio` of clips [N, samples] against their sounds' named attributes: the mean adherence and the share
    right per attribute. On a SAT's reconstructions it is the ceiling an AAR over its tokens can reach.
    `thresholds`: the detector's `Thresholds` (None: its defaults)."""
    from mmkv.metrics.audio_adherence import DEFAULT_THRESHOLDS, OK_FIELDS, score_audio

    th = DEFAULT_THRESHOLDS if thresholds is None else thresholds
    scores = [score_audio(waves[i], sample_rate, s.named, sounds.TABLES, th) for i, s in enumerate(held)]
    per_attr = {}
    for attr, ok_field in OK_FIELDS.items():
        oks = [sc[ok_field] for sc in scores if sc[ok_field] is not None]
        if oks:
            per_attr[attr] = {"ok": round(float(np.mean(oks)), 4), "clips": len(oks)}
    values = [sc["adherence"] for sc in scores if sc["adherence"] is not None]
    return {"clips": len(held), "found": sum(bool(sc["found"]) for sc in scores),
            "adherence": round(float(np.mean(values)), 4) if values else None, "per_attribute": per_attr}
