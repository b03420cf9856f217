"""`mmkv train audio`: the tiny audio models mmkv ships, trained on procedural captioned clips.

A CLAP, a SAT and an AAR, each of exactly the architecture `mmkv compare audio` loads (transformers `ClapModel`,
`mmkv.pipelines.aar.sat.SAT`, `mmkv.pipelines.aar.model.AAR`), trained on the clips of `mmkv.pipelines.aar.sounds`.
Three stages, each one command that reads the previous stage's folder and writes its own (weights only):

* `clap`: the demo's tiny `ClapModel` (512-d projections), contrastive (CLAP, Elizalde et al. 2023, section 2:
  symmetric InfoNCE with the learned logit scales `logit_scale_a` / `logit_scale_t`). Captions repeat (a chirp has
  six), so every pair of clips whose captions name the same attributes counts as a positive: the target of a row is
  uniform over them. Audio goes through the preprocessing of `mmkv.pipelines.aar.clap` (soxr resampling to 48 kHz,
  then the folder's `ClapFeatureExtractor`: repeat-pad, Slaney log-mel), computed in torch by `clap_features`,
  equal to the extractor's; text through a word-level tokenizer saved beside the weights. Writes `clap/`, a folder
  `ClapEmbedder` loads unchanged; scores text-to-audio retrieval per attribute on held-out clips.
* `sat`: SAT reconstruction (upstream `train_SAT_mpi.py` without its GAN: L1 / 10 + the 7-resolution log-mel L1 + L2
  of `losses.py` + the commitment loss), through the multi-scale residual VQ of upstream
  `quantization/core_vq.py`: each scale quantises the area-downsampled residual, its code vectors are upsampled
  (linear) and passed through the scale's phi convolution, exactly as `get_next_autoregressive_input` does at
  inference; the straight-through estimator carries the decoder's gradient to the encoder, phi learns from
  ||phi(q) - x||^2. Codebooks are EMA k-means (decay 0.99, Laplace smoothing), initialised by k-means on the first
  batch, with dead codes (EMA count < 2) reset to vectors of the batch. Writes `SAT_<config>.pth`
  (`generator_state_dict`) and copies `clap/`; scores held-out SI-SNR, log-mel L1 and per-scale codebook use.
* `aar`: next-scale prediction (upstream `train_AAR_mpi.py`): the SAT's tokens of a clip at every scale are the
  targets, the teacher-forcing inputs are what inference feeds (`teacher_inputs`: area-downsampled partial latents,
  `sample.py`'s loop), the condition is the trained CLAP's audio embedding of the same clip, replaced by the stored
  `uncond_embedding` in 10% of the rows; cross-entropy over all L tokens. Writes `AAR_<config>.pth`
  (`model_state_dict`, the EMA weights) beside copies of the SAT and `clap/`, the folder `mmkv compare audio --aar
  DIR --clap DIR/clap` reads; scores held-out teacher-forced cross-entropy (with and without the condition) and,
  optionally, the adherence of rollouts conditioned on held-out clips (`mmkv.metrics.audio_adherence`).

Every stage takes a wall-clock budget and `--init` (`mmkv.pipelines.training`); data, crops, k-means and condition
dropout draw from private generators seeded by `--seed`. All three train in fp32 (TF32 matmuls on CUDA): codebook
distances, STFT losses and cosine attention are kept out of bf16, and at these widths the steps are launch-bound.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from mmkv.codecs.base import private_generator
from mmkv.demo import TINY_CLAP_AUDIO, TINY_CLAP_TEXT
from mmkv.pipelines.aar import clap, sounds
from mmkv.pipelines.aar.loaders import load_aar, load_sat, save_released_format
from mmkv.pipelines.aar.model import AAR, AARConfig, build_aar
from mmkv.pipelines.aar.sat import AAR_PATCH_NUMS, SAT, SATConfig, WNConv1d, WNConvTranspose1d, build_sat
from mmkv.pipelines.training import (
    add_stage_arguments, ema_update, finish_stage, frozen_copy, optimise, pick_config, seeded, start_stage,
)
from mmkv.pipelines.wan.train import word_tokenizer

STAGES = ("clap", "sat", "aar")
ATTRIBUTES = ("kind", "note", "waveform", "envelope", "direction", "band", "count")


# ----------------------------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class AudioTrainConfig:
    """Model shapes and optimisation settings of one trained audio family (`tiny` ships; `micro` is the CPU smoke
    test's)."""

    name: str
    sat: dict[str, Any]  # SATConfig fields
    aar_depth: int  # width 64 x depth, heads = depth (the AAR builder's tie)
    clap_audio: dict[str, Any]
    clap_text: dict[str, Any]
    clap_window_s: int  # the feature extractor's window (larger_clap_general: 10 s)
    text_len: int
    # clap stage
    clap_clips: int  # clips rendered and featurised once, then drawn without replacement per batch
    clap_steps: int
    clap_batch: int
    clap_lr: float
    retrieval_clips: int  # held-out clips of the retrieval score
    # sat stage
    sat_clips: int
    sat_steps: int
    sat_batch: int
    sat_lr: float
    sat_eval_clips: int
    # aar stage
    aar_clips: int  # clips tokenised and embedded once
    aar_steps: int
    aar_batch: int
    aar_lr: float
    aar_eval_clips: int
    eval_rollouts: int  # held-out clips rolled out and scored for adherence (0: none)
    ema: float = 0.999
    cond_drop: float = 0.1
    codebook_decay: float = 0.99
    kmeans_iters: int = 50
    dead_code: float = 2.0
    commitment: float = 1.0
    warmup: int = 100
    encode_batch: int = 64

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sat_config(self) -> SATConfig:
        return SATConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.sat.items()})

    @property
    def clip_samples(self) -> int:
        """Samples of a training clip: what the SAT decodes from its last scale (1 s for `tiny`)."""
        return self.sat_config().num_samples

    @property
    def sample_rate(self) -> int:
        return self.sat_config().sample_rate


CONFIGS: dict[str, AudioTrainConfig] = {
    # 1 s at 24 kHz, AAR's 16 scales (455 tokens). SAT: n_filters 16, dimension = latent 32, 1024 codes a scale;
    # AAR: depth 4 (C 256, 4 heads of 64); CLAP: the demo's tiny towers with larger_clap_general's 10 s window.
    "tiny": AudioTrainConfig(
        name="tiny",
        sat={"multi_scale": list(AAR_PATCH_NUMS), "phi_kernel": [9] * 6, "dimension": 32, "latent_dim": 32,
             "n_filters": 16, "bins": 1024},
        aar_depth=4, clap_audio=dict(TINY_CLAP_AUDIO), clap_text=dict(TINY_CLAP_TEXT), clap_window_s=10,
        text_len=16,
        clap_clips=8192, clap_steps=3000, clap_batch=128, clap_lr=5e-4, retrieval_clips=512,
        sat_clips=8192, sat_steps=6000, sat_batch=32, sat_lr=6e-4, sat_eval_clips=128,
        aar_clips=8192, aar_steps=6000, aar_batch=64, aar_lr=5e-4, aar_eval_clips=256, eval_rollouts=64,
    ),
    # CPU smoke test: the same code on a few-second budget. Four scales to 8 latent frames: 2560 samples, the
    # shortest clip the adherence metric scores (0.1 s).
    "micro": AudioTrainConfig(
        name="micro",
        sat={"multi_scale": [1, 2, 4, 8], "phi_kernel": [9, 9], "dimension": 16, "latent_dim": 16,
             "n_filters": 8, "bins": 64},
        aar_depth=1, clap_audio={**TINY_CLAP_AUDIO, "spec_size": 128, "window_size": 4}, clap_text=dict(TINY_CLAP_TEXT),
        clap_window_s=1, text_len=16,
        clap_clips=8, clap_steps=12, clap_batch=8, clap_lr=2e-3, retrieval_clips=8,
        sat_clips=8, sat_steps=30, sat_batch=4, sat_lr=3e-3, sat_eval_clips=4,
        aar_clips=8, aar_steps=30, aar_batch=8, aar_lr=3e-3, aar_eval_clips=4, eval_rollouts=2,
        ema=0.9, kmeans_iters=5, warmup=5, encode_batch=8,
    ),
}


def get_config(name: str, **overrides: Any) -> AudioTrainConfig:
    return pick_config(CONFIGS, name, **overrides)


# ----------------------------------------------------------------------------------------------------------------
# Data


def draw_sounds(gen: torch.Generator, n: int) -> list[sounds.Sound]:
    """Sounds of training seeds: [0, sounds.TRAIN_SEED_END) only, so held-out seeds are never trained on."""
    return [sounds.sample_sound(s) for s in torch.randint(0, sounds.TRAIN_SEED_END, (n,), generator=gen).tolist()]


def render_clips(batch: list[sounds.Sound], cfg: AudioTrainConfig, device: torch.device,
                 gen: torch.Generator) -> torch.Tensor:
    """Clips [B, clip_samples] of 1 s renders, each cropped at a random offset when the SAT's clip is shorter."""
    wave = sounds.render(batch, sample_rate=cfg.sample_rate, seconds=1.0, device=device)
    return random_crop(wave, cfg.clip_samples, gen)


def random_crop(wave: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    if wave.shape[1] == n:
        return wave
    if wave.shape[1] < n:
        raise ValueError(f"clips of {wave.shape[1]} samples are shorter than the SAT's {n}")
    start = torch.randint(0, wave.shape[1] - n + 1, (wave.shape[0], 1), generator=gen).to(wave.device)
    return torch.gather(wave, 1, start + torch.arange(n, device=wave.device))


def clap_waves(wave: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """[B, samples] at `sample_rate` -> [B, samples'] float32 at 48 kHz, resampled as `clap.prepare_clip` does (soxr
    HQ, else scipy's polyphase filter) on the CPU, the clips as the channels of one signal."""
    x = clap.resample(wave.detach().float().cpu().numpy().T, sample_rate, clap.CLAP_SAMPLE_RATE)
    return torch.from_numpy(np.ascontiguousarray(x.T)).to(wave.device)


def feature_extractor(window_s: int):
    """larger_clap_general's preprocessor (rand_trunc + repeatpad; clips never exceed the window, so rand_trunc
    never crops), with the config's window."""
    from transformers import ClapFeatureExtractor

    return ClapFeatureExtractor(truncation="rand_trunc", padding="repeatpad", max_length_s=window_s)


def clap_features(wave48k: torch.Tensor, extractor) -> torch.Tensor:
    """`ClapFeatureExtractor(wave, truncation="rand_trunc", padding="repeatpad")["input_features"]` for a batch
    [B, samples] of 48 kHz clips no longer than its window, in torch on the clips' device: whole repeats then zeros
    to the window, a centred reflect-padded periodic-Hann STFT in float64 stored as complex64 (as
    `transformers.audio_utils.spectrogram` does), power, Slaney mel filters, 10 log10(max(., 1e-10)).
    Returns [B, 1, frames, mels] float32."""
    if extractor.truncation == "fusion" or extractor.padding != "repeatpad" or extractor.top_db is not None:
        raise ValueError("clap_features reproduces larger_clap_general's preprocessing (truncation rand_trunc, "
                         f"padding repeatpad, no top_db); this extractor has {extractor.truncation!r}, "
                         f"{extractor.padding!r}, top_db {extractor.top_db}")
    n_max, n = int(extractor.nb_max_samples), wave48k.shape[1]
    if n > n_max:
        raise ValueError(f"clips of {n} samples are longer than the CLAP window of {n_max}")
    x = wave48k.double()
    if n < n_max:
        x = F.pad(x.repeat(1, n_max // n), (0, n_max - (n_max // n) * n))
    window = torch.hann_window(extractor.fft_window_size, periodic=True, dtype=torch.float64, device=x.device)
    spec = torch.stft(x, extractor.fft_window_size, hop_length=extractor.hop_length, window=window, center=True,
                      pad_mode="reflect", return_complex=True)
    power = spec.to(torch.complex64).to(torch.complex128).abs() ** 2
    mel = torch.from_numpy(extractor.mel_filters_slaney).to(x.device)  # [bins, mels]
    db = 10 * torch.log10(torch.matmul(mel.T, power).clamp(min=1e-10))
    return db.float().transpose(1, 2)[:, None]


def clap_inputs(wave: torch.Tensor, cfg: AudioTrainConfig, extractor, device: torch.device) -> torch.Tensor:
    """CLAP input features [B, 1, frames, mels] (on `device`) of SAT-rate clips, `encode_batch` at a time."""
    out = []
    for i in range(0, wave.shape[0], cfg.encode_batch):
        out.append(clap_features(clap_waves(wave[i:i + cfg.encode_batch], cfg.sample_rate).to(device), extractor))
    return torch.cat(out)


def caption_tokenizer(text_len: int):
    """The video stage's word-level tokenizer over the caption vocabulary (pad 0, `</s>` 1, unk 2), with `</s>`
    also in front: CLAP's RoBERTa text tower pools its first token (`<s>` there), so every caption starts with the
    same one."""
    from tokenizers import processors

    tok = word_tokenizer(sounds.vocabulary(), text_len)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="</s> $A </s>",
                                                                         special_tokens=[("</s>", 1)])
    return tok


def tokenize(tokenizer, captions: list[str], text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(captions, padding="max_length", max_length=text_len, truncation=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def named_groups(batch: list[sounds.Sound]) -> torch.Tensor:
    """An id per clip, equal for clips whose captions name the same attributes (`Sound.named`)."""
    keys: dict[str, int] = {}
    return torch.tensor([keys.setdefault(repr(sorted(s.named.items())), len(keys)) for s in batch])


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: CLAP


def build_clap(cfg: AudioTrainConfig, vocab_size: int, seed: int):
    from transformers import ClapConfig, ClapModel

    # No dropout: it would draw from the global RNG; the data are endless and the captions short.
    text = {**cfg.clap_text, "vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1,
            "max_position_embeddings": max(cfg.clap_text.get("max_position_embeddings", 0), cfg.text_len + 2),
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    audio = {**cfg.clap_audio, "hidden_dropout_prob": 0.0}
    config = ClapConfig(text_config=text, audio_config=audio, projection_dim=clap.EMBED_DIM)
    return seeded(seed, lambda: ClapModel(config))


def audio_embeddings(model, features: torch.Tensor) -> torch.Tensor:
    """L2-normalised audio_projection(audio_model(...).pooler_output): `ClapEmbedder.embed_wave`'s embedding."""
    is_longer = torch.zeros(features.shape[0], 1, dtype=torch.bool, device=features.device)
    out = model.audio_model(input_features=features, is_longer=is_longer)
    return F.normalize(model.audio_projection(out.pooler_output), dim=-1)


def text_embeddings(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model.text_model(input_ids=ids, attention_mask=mask)
    return F.normalize(model.text_projection(out.pooler_output), dim=-1)


def contrastive_loss(model, audio: torch.Tensor, text: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE with CLAP's two learned temperatures; the targets of a row are uniform over the clips whose
    captions name the same attributes (a batch holds repeated captions)."""
    same = (groups[:, None] == groups[None, :]).float()
    target = same / same.sum(1, keepdim=True)
    per_text = text @ audio.T * model.logit_scale_t.exp()
    per_audio = audio @ text.T * model.logit_scale_a.exp()
    return 0.5 * (F.cross_entropy(per_text, target) + F.cross_entropy(per_audio, target))


def train_clap(cfg: AudioTrainConfig, out: Path, *, device: torch.device, seed: int, budget_s: float | None,
               init: Path | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    from transformers import ClapModel

    t_start = time.perf_counter()
    tokenizer = caption_tokenizer(cfg.text_len)
    extractor = feature_extractor(cfg.clap_window_s)
    if init is not None:
        model = ClapModel.from_pretrained(str(init / "clap"), local_files_only=True)
    else:
        model = build_clap(cfg, len(tokenizer), seed)
    model = model.to(device).train()
    gen = torch.Generator().manual_seed(seed + 30)
    t0 = time.perf_counter()
    batch = draw_sounds(gen, cfg.clap_clips)
    features = clap_inputs(render_clips(batch, cfg, device, gen), cfg, extractor, device)
    ids, mask = (t.to(device) for t in tokenize(tokenizer, [sounds.caption(s) for s in batch], cfg.text_len))
    groups = named_groups(batch).to(device)
    log(f"clap: {len(batch)} clips rendered and featurised in {time.perf_counter() - t0:.1f} s "
        f"({len(set(groups.tolist()))} distinct captions by meaning)")
    train_gen = torch.Generator().manual_seed(seed + 31)
    size = min(cfg.clap_batch, len(batch))

    def loss_fn(step: int) -> torch.Tensor:
        idx = torch.randperm(len(batch), generator=train_gen)[:size].to(device)
        return contrastive_loss(model, audio_embeddings(model, features[idx]),
                                text_embeddings(model, ids[idx], mask[idx]), groups[idx])

    @torch.no_grad()
    def clamp_scales(step: int) -> None:
        for p in (model.logit_scale_a, model.logit_scale_t):
            p.clamp_(0, math.log(100))  # CLIP's cap on the learned temperature

    remaining = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
    stats = optimise(list(model.parameters()), loss_fn, steps=cfg.clap_steps, lr=cfg.clap_lr, warmup=cfg.warmup,
                     budget_s=remaining, device=device, after_step=clamp_scales, log=log, name="clap", amp=False)
    model.eval()
    write_clap(out / "clap", model, extractor, tokenizer)
    stats["retrieval"] = retrieval(model, tokenizer, extractor, cfg, device)
    stats["logit_scales"] = {"audio": round(model.logit_scale_a.exp().item(), 3),
                             "text": round(model.logit_scale_t.exp().item(), 3)}
    log(f"clap: held-out text-to-audio top-1 {_summary(stats['retrieval'])}")
    return stats


def write_clap(folder: Path, model, extractor, tokenizer) -> None:
    """A local CLAP folder as `clap.ClapEmbedder` reads it: config.json + model.safetensors + the feature
    extractor, and the caption tokenizer for the text side."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    extractor.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


@torch.no_grad()
def retrieval(model, tokenizer, extractor, cfg: AudioTrainConfig, device: torch.device) -> dict[str, Any]:
    """Text-to-audio retrieval over held-out clips: for each clip's caption, is the top-1 clip's attribute the
    named one? Per attribute, against chance (the share of clips with that value)."""
    held = [sounds.sample_sound(s) for s in sounds.held_out_seeds(cfg.retrieval_clips)]
    wave = render_clips(held, cfg, device, torch.Generator().manual_seed(1))
    feats = clap_inputs(wave, cfg, extractor, device)
    audio = torch.cat([audio_embeddings(model, feats[i:i + cfg.encode_batch])
                       for i in range(0, len(held), cfg.encode_batch)])
    ids, mask = tokenize(tokenizer, [sounds.caption(s) for s in held], cfg.text_len)
    text = text_embeddings(model, ids.to(device), mask.to(device))
    top = (text @ audio.T).argmax(dim=1).tolist()
    named = [s.named for s in held]
    scores = {}
    for attr in ATTRIBUTES:
        queries = [i for i, n in enumerate(named) if attr in n]
        if not queries:
            continue
        hit = [named[top[i]].get(attr) == named[i][attr] for i in queries]
        chance = [np.mean([m.get(attr) == named[i][attr] for m in named]) for i in queries]
        scores[attr] = {"accuracy": round(float(np.mean(hit)), 4), "chance": round(float(np.mean(chance)), 4),
                        "queries": len(queries)}
    exact = [named[top[i]] == named[i] for i in range(len(held))]
    chance = [np.mean([m == n for m in named]) for n in named]
    scores["all_named"] = {"accuracy": round(float(np.mean(exact)), 4), "chance": round(float(np.mean(chance)), 4),
                           "queries": len(held)}
    return {"clips": len(held), "text_to_audio_top1": scores}


def _summary(scores: dict[str, Any]) -> str:
    top = scores["text_to_audio_top1"]
    return ", ".join(f"{a} {v['accuracy']:.2f} (chance {v['chance']:.2f})" for a, v in top.items())


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: SAT


@dataclass(frozen=True)
class CodebookTraining:
    """EMA codebook updates of upstream `quantization/core_vq.py` `EuclideanCodebook` (its `vq.py` defaults)."""

    decay: float = 0.99
    epsilon: float = 1e-5
    kmeans_iters: int = 50
    dead_code: float = 2.0  # EMA count below which a code is reset
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
    if train.dead_code <= 0:
        return
    dead = (codebook.cluster_size < train.dead_code)[:, None]
    fresh = _sample_vectors(x, codebook.codebook_size, train.generator)
    codebook.embed.copy_(torch.where(dead, fresh, codebook.embed))
    codebook.embed_avg.copy_(torch.where(dead, fresh * train.dead_code, codebook.embed_avg))
    codebook.cluster_size.copy_(torch.where(dead[:, 0], train.dead_code, codebook.cluster_size))


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


def sat_file(folder: Path, cfg: AudioTrainConfig) -> Path:
    return _stage_file(folder, f"SAT_{cfg.name}.pth", "SAT")


def _stage_file(folder: Path, name: str, what: str) -> Path:
    path = folder / name
    if not path.is_file():
        found = sorted(p.name for p in folder.glob(f"{what}_*.pth"))
        hint = f" (it holds {', '.join(found)}: trained with another --config?)" if found else ""
        raise FileNotFoundError(f"no {name} in {folder}{hint}")
    return path


def train_sat(cfg: AudioTrainConfig, source: Path, out: Path, *, device: torch.device, seed: int,
              budget_s: float | None, init: Path | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    t_start = time.perf_counter()
    if not (source / "clap" / "config.json").is_file():
        raise FileNotFoundError(f"--from {source} holds no clap/ folder: give the clap stage's output")
    scales = cfg.sat_config().multi_scale
    if init is not None:
        sat = load_sat(sat_file(init, cfg), multi_scale=scales)
    else:
        sat = init_sat(cfg.sat_config(), seed)
    sat = sat.to(device).train().requires_grad_(True)
    gen = torch.Generator().manual_seed(seed + 40)
    t0 = time.perf_counter()
    batch = draw_sounds(gen, cfg.sat_clips)
    pool = torch.cat([sounds.render(batch[i:i + cfg.encode_batch], sample_rate=cfg.sample_rate, device=device)
                      for i in range(0, len(batch), cfg.encode_batch)])
    log(f"sat: {len(batch)} clips rendered in {time.perf_counter() - t0:.1f} s")
    train_gen = torch.Generator().manual_seed(seed + 41)
    codebooks = CodebookTraining(cfg.codebook_decay, kmeans_iters=cfg.kmeans_iters, dead_code=cfg.dead_code,
                                 generator=torch.Generator().manual_seed(seed + 42))
    mel = MelLoss(cfg.sample_rate, device)
    parts: dict[str, list[torch.Tensor]] = {"l1": [], "mel": [], "commit": []}

    def loss_fn(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(batch), (cfg.sat_batch,), generator=train_gen).to(device)
        wave = random_crop(pool[idx], cfg.clip_samples, train_gen)[:, None]
        f_hat, _, commit = quantize(sat, sat.encoder(wave), codebooks, cfg.commitment)
        recon = sat.fhat_to_audio(f_hat)
        l1, lm = F.l1_loss(recon, wave), mel(recon, wave)
        for k, v in (("l1", l1), ("mel", lm), ("commit", commit)):
            parts[k].append(v.detach())
        return l1 / 10 + lm + commit

    remaining = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
    stats = optimise(list(sat.parameters()), loss_fn, steps=cfg.sat_steps, lr=cfg.sat_lr, warmup=cfg.warmup,
                     budget_s=remaining, device=device, log=log, name="sat", amp=False)
    sat.eval().requires_grad_(False)
    save_released_format(sat, out / f"SAT_{cfg.name}.pth")
    _copy_tree(source / "clap", out / "clap")
    tail = max(1, len(parts["l1"]) // 10)
    stats["loss_parts_last"] = {k: round(float(torch.stack(v[-tail:]).mean()), 6) for k, v in parts.items()}
    stats["heldout"] = evaluate_sat(sat, cfg, device)
    h = stats["heldout"]
    log(f"sat: held-out SI-SNR {h['si_snr_db']:.2f} dB, log-mel L1 {h['log_mel_l1']:.3f}, codes used per scale "
        f"{[u['used'] for u in h['codebook_usage']]}")
    return stats


def si_snr_db(ref: torch.Tensor, est: torch.Tensor) -> float:
    """Scale-invariant SNR (Le Roux et al. 2019, eq. 2 to 4) of zero-mean signals, float64."""
    s, e = ref.double() - ref.double().mean(), est.double() - est.double().mean()
    target = (e @ s) / (s @ s) * s
    return float(10 * torch.log10((target @ target) / ((e - target) @ (e - target)).clamp(min=1e-20)))


@torch.no_grad()
def evaluate_sat(sat: SAT, cfg: AudioTrainConfig, device: torch.device) -> dict[str, Any]:
    """Held-out reconstruction through the tokens (encode, quantise, decode the inference latent): SI-SNR, the SAT
    tokenizer's log-mel L1 (`mmkv.metrics.audio.log_mel`), and per scale the codes used and their perplexity."""
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
    mel_l1 = [float((log_mel(recon_all[i].numpy(), cfg.sample_rate) - log_mel(ref[i].numpy(), cfg.sample_rate))
                    .abs().mean()) for i in range(len(held))]
    usage = []
    bins = cfg.sat_config().bins
    for si_, pn in enumerate(cfg.sat_config().multi_scale):
        codes = torch.cat([t[si_].reshape(-1) for t in tokens]).cpu()
        p = torch.bincount(codes, minlength=bins).double() / codes.numel()
        perplexity = float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum()))
        usage.append({"scale": si_, "tokens": pn, "used": int((p > 0).sum()), "of": bins,
                      "perplexity": round(perplexity, 2)})
    return {"clips": len(held), "si_snr_db": round(float(np.mean(si)), 3) if si else None,
            "si_snr_clips": len(si), "log_mel_l1": round(float(np.mean(mel_l1)), 4), "codebook_usage": usage}


# ----------------------------------------------------------------------------------------------------------------
# Stage 3: AAR


@torch.no_grad()
def teacher_inputs(sat: SAT, tokens: list[torch.Tensor]) -> torch.Tensor:
    """AAR's teacher-forcing input [B, L - first_l, latent] for the tokens of every scale: after scale si the
    partial latent f_hat += phi(upsample(h_si)) is area-downsampled to scale si+1 (`sample.rollout`'s loop and
    upstream `idx_to_var_input`); the last scale's tokens feed nothing."""
    quant = sat.quantizer
    B, C, scales = tokens[0].shape[0], sat.latent_dim, sat.config.multi_scale
    f_hat = torch.zeros(B, C, scales[-1], device=tokens[0].device)
    inputs = []
    for si, pn in enumerate(scales[:-1]):
        h = quant.embedding(tokens[si], si).reshape(B, C, pn)
        f_hat, nxt = quant.get_next_autoregressive_input(si, f_hat, h)
        inputs.append(nxt.view(B, C, -1).transpose(1, 2))
    return torch.cat(inputs, dim=1)


def init_aar(cfg: AARConfig, seed: int) -> AAR:
    """upstream `build_aar`'s initialisation (init_adaln 0.5, init_adaln_gamma 1e-5, init_head 0.02), drawn from a
    private generator; it also draws the stored null condition `uncond_embedding`."""
    aar = build_aar(cfg, "meta").to_empty(device="cpu")
    return aar.init_weights(private_generator(seed, "train-aar"), init_adaln=0.5, init_adaln_gamma=1e-5,
                            init_head=0.02)


def aar_config(cfg: AudioTrainConfig) -> AARConfig:
    sat = cfg.sat_config()
    return AARConfig(depth=cfg.aar_depth, patch_nums=sat.multi_scale, cvae=sat.latent_dim, vocab_size=sat.bins)


@torch.no_grad()
def encode_clips(sat: SAT, clap_model, extractor, wave: torch.Tensor, cfg: AudioTrainConfig,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, L] of the SAT, CLAP audio embeddings [B, 512]) of clips [B, samples]."""
    tokens, conds = [], []
    for i in range(0, wave.shape[0], cfg.encode_batch):
        w = wave[i:i + cfg.encode_batch]
        tokens.append(torch.cat(quantize(sat, sat.encoder(w[:, None]))[1], dim=1))
        conds.append(audio_embeddings(clap_model, clap_inputs(w, cfg, extractor, device)))
    return torch.cat(tokens), torch.cat(conds)


def train_aar(cfg: AudioTrainConfig, source: Path, out: Path, *, device: torch.device, seed: int,
              budget_s: float | None, init: Path | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    from transformers import ClapFeatureExtractor, ClapModel

    t_start = time.perf_counter()
    sat_path = sat_file(source, cfg)
    sat = load_sat(sat_path, multi_scale=cfg.sat_config().multi_scale, device=device)
    clap_dir = source / "clap"
    clap_model = ClapModel.from_pretrained(str(clap_dir), local_files_only=True).to(device).eval()
    extractor = ClapFeatureExtractor.from_pretrained(str(clap_dir), local_files_only=True)
    gen = torch.Generator().manual_seed(seed + 50)
    t0 = time.perf_counter()
    batch = draw_sounds(gen, cfg.aar_clips)
    tokens, conds = encode_clips(sat, clap_model, extractor, render_clips(batch, cfg, device, gen), cfg, device)
    log(f"aar: {len(batch)} clips tokenised ({tokens.shape[1]} tokens) and CLAP-embedded in "
        f"{time.perf_counter() - t0:.1f} s")
    acfg = aar_config(cfg)
    aar = (load_aar(_stage_file(init, f"AAR_{cfg.name}.pth", "AAR")) if init is not None else init_aar(acfg, seed))
    aar = aar.to(device).train().requires_grad_(True)
    ema = frozen_copy(aar)
    train_gen = torch.Generator().manual_seed(seed + 51)
    splits = list(acfg.patch_nums)

    def loss_fn(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(batch), (cfg.aar_batch,), generator=train_gen).to(device)
        target = tokens[idx]
        drop = (torch.rand(cfg.aar_batch, 1, generator=train_gen) < cfg.cond_drop).to(device)
        cond = torch.where(drop, aar.uncond_embedding, conds[idx])  # upstream model/aar.py forward
        logits = aar(cond, teacher_inputs(sat, list(target.split(splits, dim=1))))
        return F.cross_entropy(logits.reshape(-1, aar.V), target.reshape(-1))

    remaining = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
    stats = optimise(list(aar.parameters()), loss_fn, steps=cfg.aar_steps, lr=cfg.aar_lr, warmup=cfg.warmup,
                     budget_s=remaining, device=device, after_step=lambda s: ema_update(ema, aar, cfg.ema), log=log,
                     name="aar", amp=False)
    ema.eval()
    save_released_format(ema, out / f"AAR_{cfg.name}.pth")
    if sat_path.resolve() != (out / sat_path.name).resolve():
        shutil.copy2(sat_path, out / sat_path.name)
    _copy_tree(clap_dir, out / "clap")
    stats["heldout"] = evaluate_aar(ema, sat, clap_model, extractor, cfg, device, seed)
    h = stats["heldout"]
    log(f"aar: held-out cross-entropy {h['ce_cond']:.3f} with the condition, {h['ce_uncond']:.3f} without"
        + (f"; rollout adherence {h['rollouts']['adherence']}" if h.get("rollouts") else ""))
    return stats


@torch.no_grad()
def evaluate_aar(aar: AAR, sat: SAT, clap_model, extractor, cfg: AudioTrainConfig, device: torch.device,
                 seed: int) -> dict[str, Any]:
    """Held-out teacher-forced cross-entropy and accuracy per scale, with each clip's CLAP embedding and with the
    null condition; then rollouts conditioned on held-out clips, scored by `mmkv.metrics.audio_adherence` against
    the clip's caption."""
    held = [sounds.sample_sound(s) for s in sounds.held_out_seeds(cfg.aar_eval_clips)]
    wave = render_clips(held, cfg, device, torch.Generator().manual_seed(3))
    tokens, conds = encode_clips(sat, clap_model, extractor, wave, cfg, device)
    splits = list(aar.patch_nums)
    result: dict[str, Any] = {"clips": len(held)}
    for name, cond in (("cond", conds), ("uncond", aar.uncond_embedding.expand_as(conds))):
        ce = torch.zeros(tokens.shape[1], device=device)
        right = torch.zeros(tokens.shape[1], device=device)
        for i in range(0, len(held), cfg.encode_batch):
            t = tokens[i:i + cfg.encode_batch]
            logits = aar(cond[i:i + cfg.encode_batch], teacher_inputs(sat, list(t.split(splits, dim=1))))
            ce += F.cross_entropy(logits.transpose(1, 2), t, reduction="none").sum(0)
            right += (logits.argmax(-1) == t).float().sum(0)
        result[f"ce_{name}"] = round(float(ce.sum() / tokens.numel()), 4)
        result[f"ce_{name}_per_scale"] = [round(float(c.mean() / len(held)), 4) for c in ce.split(splits)]
        result[f"accuracy_{name}_per_scale"] = [round(float(r.mean() / len(held)), 4) for r in right.split(splits)]
    if cfg.eval_rollouts:
        result["rollouts"] = rollout_adherence(aar, sat, conds[:cfg.eval_rollouts], held[:cfg.eval_rollouts], cfg,
                                               seed)
    return result


def rollout_adherence(aar: AAR, sat: SAT, conds: torch.Tensor, held: list[sounds.Sound], cfg: AudioTrainConfig,
                      seed: int) -> dict[str, Any]:
    """One rollout per held-out clip (native cache, the pipeline's sampling), scored against the clip's caption."""
    from mmkv.metrics.audio_adherence import OK_FIELDS, score_audio
    from mmkv.pipelines.aar.sample import rollout

    out = rollout(aar, sat, conds, seed=seed, key="train-heldout")
    scores = [score_audio(out.audio[i, 0].numpy(), cfg.sample_rate, s.named, sounds.TABLES)
              for i, s in enumerate(held)]
    per_attr = {}
    for attr, ok_field in OK_FIELDS.items():
        oks = [sc[ok_field] for sc in scores if sc[ok_field] is not None]
        if oks:
            per_attr[attr] = {"ok": round(float(np.mean(oks)), 4), "clips": len(oks)}
    values = [sc["adherence"] for sc in scores if sc["adherence"] is not None]
    return {"clips": len(held), "found": sum(bool(sc["found"]) for sc in scores),
            "adherence": round(float(np.mean(values)), 4) if values else None, "per_attribute": per_attr,
            "finite": bool(torch.isfinite(out.audio).all())}


def _copy_tree(src: Path, dst: Path) -> None:
    if src.resolve() == dst.resolve():
        return
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


# ----------------------------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, STAGES, CONFIGS,
                        "the previous stage's output folder (sat: the clap stage's; aar: the sat stage's)")


def run(args: argparse.Namespace) -> int:
    overrides = {f"{args.stage}_steps": args.steps} if args.steps is not None else {}
    cfg = get_config(args.config, **overrides)
    st = start_stage(args, first_stage="clap", previous={"sat": "clap", "aar": "sat"})
    common = dict(device=st.device, seed=args.seed, budget_s=args.budget, init=st.init, log=st.log)
    if args.stage == "clap":
        stats = train_clap(cfg, st.out, **common)
    elif args.stage == "sat":
        stats = train_sat(cfg, st.source, st.out, **common)
    else:
        stats = train_aar(cfg, st.source, st.out, **common)
    finish_stage(st, args, cfg.to_dict(), stats)
    return 0
