"""Procedural clips, CLAP inputs and caption tokens for `mmkv train audio` (the data every stage draws)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from mmkv.pipelines.aar import clap, sounds
from mmkv.pipelines.wan.train import word_tokenizer

if TYPE_CHECKING:
    from mmkv.pipelines.aar.train import AudioTrainConfig

# The named attributes a caption can state (scored by retrieval and adherence).
ATTRIBUTES = ("kind", "note", "waveform", "envelope", "direction", "band", "count")


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
