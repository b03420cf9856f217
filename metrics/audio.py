"""Audio metrics of a compressed-cache rollout x̂ against the bf16-cache reference x.

Both signals come from the same decoder with the same length; metrics use the raw float output (the float32 wav the
pipeline writes), before any clipping or int16 conversion. All arithmetic is float64 (docs/decisions.md, "Audio
metrics").

* LSD (NU-Wave's definition, maum-ai/nuwave lightning_model.py, reported in dB): P = |STFT|², Hann window,
  n_fft 2048, hop 512, center=True with reflect padding, P clamped at 1e-8;
  LSD = 10 · mean_t sqrt(mean_f (log10 P_x̂ − log10 P_x)²).
  The factor 10 turns log10-power ("bels") into dB, the unit of the OCTOPUS paper's Table 3.
* Log-mel MSE (the SAT tokenizer's own mel, AAR model/audio_to_mel.py): reflect-pad (n_fft − hop)/2 on both
  sides, STFT with center=False and a Hann window, power spectrum through a Slaney mel filterbank (librosa's
  defaults), log10(max(mel, 1e-5)); n_fft 1024, hop 256, 80 mels, 0 Hz to sr/2; MSE over mels × frames.
* SNR: 10·log10(Σx² / Σ(x − x̂)²) dB, capped at 120 dB (identical signals, or noise below 1e-12 of the
  signal energy, read as "bit-identical or below the floor"); NaN for a silent reference.
* Latent cosine of the SAT latent f_hat; token agreement: fraction of equal token ids.
Multi-channel input `[N, C]` (soundfile's layout) is scored per channel and averaged.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from mmkv.metrics.latent import latent_cosine

SNR_CAP_DB = 120.0
LSD_N_FFT, LSD_HOP, LSD_EPS = 2048, 512, 1e-8
MEL_N_FFT, MEL_HOP, MEL_N_MELS, MEL_FLOOR = 1024, 256, 80, 1e-5

AUDIO_METRIC_CONFIG = {
    "lsd_db": f"10*mean_t sqrt(mean_f (log10 P_test - log10 P_ref)^2), P=|STFT|^2 clamped at {LSD_EPS}, Hann, "
    f"n_fft={LSD_N_FFT}, hop={LSD_HOP}, center=True (reflect)",
    "log_mel_mse": f"mean (log10 max(mel, {MEL_FLOOR}))^2 difference; reflect pad (n_fft-hop)/2, center=False, Hann, "
    f"power, Slaney mel, n_fft={MEL_N_FFT}, hop={MEL_HOP}, n_mels={MEL_N_MELS}, 0..sr/2",
    "snr_db": f"10*log10(sum x^2 / sum (x - x_test)^2), capped at {SNR_CAP_DB} dB",
    "latent_cosine": "cosine of the flattened SAT latents f_hat, float64",
    "token_agreement": "fraction of equal token ids",
}


def _signal(x, name: str) -> torch.Tensor:
    """float64 [C, N] from a 1-D signal or a soundfile-style [N, C] array."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a waveform as a numpy array or torch.Tensor, got {type(x).__name__}")
    if not (x.is_floating_point()):
        raise ValueError(f"{name}: expected float PCM samples, got dtype {x.dtype}")
    x = x.detach().to("cpu", torch.float64)
    if x.dim() == 1:
        x = x[None]
    elif x.dim() == 2:
        x = x.T  # soundfile returns [frames, channels]
    else:
        raise ValueError(f"{name}: expected shape [N] or [N, channels], got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name}: waveform has NaN/Inf samples")
    return x.contiguous()


def _pair(ref, test) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _signal(ref, "reference audio"), _signal(test, "test audio")
    if a.shape != b.shape:
        raise ValueError(
            f"audio shapes differ: reference {tuple(a.shape[::-1])} vs test {tuple(b.shape[::-1])} "
            "(both rollouts come from the same decoder and must have the same length)"
        )
    return a, b


def _check_length(x: torch.Tensor, n_fft: int, what: str) -> None:
    if x.shape[-1] <= n_fft // 2:
        raise ValueError(f"{what} needs more than {n_fft // 2} samples (n_fft {n_fft}); got {x.shape[-1]}")


def power_spectrogram(x: torch.Tensor, n_fft: int, hop: int, *, center: bool) -> torch.Tensor:
    """|STFT|² with a periodic Hann window of length n_fft, float64: [C, n_fft//2 + 1, frames]."""
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    spec = torch.stft(x, n_fft, hop_length=hop, win_length=n_fft, window=window, center=center,
                      pad_mode="reflect", return_complex=True)
    return spec.real**2 + spec.imag**2


def lsd_db(ref, test, *, n_fft: int = LSD_N_FFT, hop: int = LSD_HOP, eps: float = LSD_EPS) -> float:
    """Log-spectral distance in dB (10 × NU-Wave's log10-power LSD); 0 for identical signals."""
    a, b = _pair(ref, test)
    _check_length(a, n_fft, "LSD")
    pa = power_spectrogram(a, n_fft, hop, center=True).clamp_min(eps).log10()
    pb = power_spectrogram(b, n_fft, hop, center=True).clamp_min(eps).log10()
    per_frame = ((pb - pa) ** 2).mean(dim=-2).sqrt()  # [C, frames]
    return float(10.0 * per_frame.mean(dim=-1).mean())


def _hz_to_mel(f):
    # Slaney's auditory-toolbox scale (librosa's htk=False): linear below 1 kHz, logarithmic above.
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, min_log_hz) / min_log_hz) / logstep, f / f_sp)


def _mel_to_hz(m):
    m = np.asarray(m, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, f_min: float = 0.0, f_max: float | None = None):
    """Slaney-scale, Slaney-normalised triangular mel filters [n_mels, n_fft//2 + 1] (librosa.filters.mel defaults)."""
    f_max = sample_rate / 2 if f_max is None else f_max
    if not 0 <= f_min < f_max <= sample_rate / 2:
        raise ValueError(f"mel range must satisfy 0 <= f_min < f_max <= sr/2; got {f_min}, {f_max}, sr {sample_rate}")
    fft_freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]  # Slaney norm: equal area per filter
    return weights


def _log_mel(sig: torch.Tensor, sample_rate: int, n_fft: int, hop: int, n_mels: int, floor: float) -> torch.Tensor:
    _check_length(sig, n_fft, "log-mel")
    p = (n_fft - hop) // 2
    padded = F.pad(sig[:, None], (p, p), mode="reflect")[:, 0]
    power = power_spectrogram(padded, n_fft, hop, center=False)
    fb = torch.from_numpy(mel_filterbank(sample_rate, n_fft, n_mels))
    return torch.matmul(fb, power).clamp_min(floor).log10()


def log_mel(x, sample_rate: int, *, n_fft: int = MEL_N_FFT, hop: int = MEL_HOP, n_mels: int = MEL_N_MELS,
            floor: float = MEL_FLOOR) -> torch.Tensor:
    """The SAT tokenizer's log10 mel spectrogram of `x` ([N] or [N, C]), float64 [C, n_mels, frames]."""
    return _log_mel(_signal(x, "audio"), sample_rate, n_fft, hop, n_mels, floor)


def log_mel_mse(ref, test, sample_rate: int, *, n_fft: int = MEL_N_FFT, hop: int = MEL_HOP,
                n_mels: int = MEL_N_MELS, floor: float = MEL_FLOOR) -> float:
    """Mean squared difference of the log10 mel spectrograms (AAR model/audio_to_mel.py)."""
    a, b = _pair(ref, test)
    ma = _log_mel(a, sample_rate, n_fft, hop, n_mels, floor)
    mb = _log_mel(b, sample_rate, n_fft, hop, n_mels, floor)
    return float(((mb - ma) ** 2).mean())


def snr_db(ref, test, *, cap: float = SNR_CAP_DB) -> float:
    """10·log10(Σx²/Σ(x−x̂)²) with the reference x as signal, at most `cap` dB; NaN if the reference is silent."""
    a, b = _pair(ref, test)
    signal = float((a * a).sum())
    noise = float(((a - b) ** 2).sum())
    if signal == 0.0:
        return math.nan
    if noise == 0.0:
        return float(cap)
    return float(min(10.0 * math.log10(signal / noise), cap))


def token_agreement(ref_tokens, test_tokens) -> float:
    a = torch.as_tensor(ref_tokens)
    b = torch.as_tensor(test_tokens)
    if a.shape != b.shape:
        raise ValueError(f"token shapes differ: reference {tuple(a.shape)} vs test {tuple(b.shape)}")
    if a.numel() == 0:
        return math.nan
    return float((a == b).double().mean())


def audio_metrics(ref_wav, test_wav, sample_rate: int, ref_latent=None, test_latent=None, ref_tokens=None,
                  test_tokens=None) -> dict:
    """Compare a rollout's waveform (and SAT latent / tokens) with the reference rollout's.

    Returns {"summary": {"lsd_db", "log_mel_mse", "snr_db", "snr_at_cap", "latent_cosine", "token_agreement",
    "n_samples"}, "sample_rate", "config"}; latent/token entries are None when not given.
    """
    if not isinstance(sample_rate, int) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive int, got {sample_rate!r}")
    a, b = _pair(ref_wav, test_wav)
    snr = snr_db(a.T, b.T)
    summary = {
        "lsd_db": lsd_db(a.T, b.T),
        "log_mel_mse": log_mel_mse(a.T, b.T, sample_rate),
        "snr_db": snr,
        "snr_at_cap": bool(snr >= SNR_CAP_DB),
        "latent_cosine": latent_cosine(ref_latent, test_latent)
        if ref_latent is not None and test_latent is not None else None,
        "token_agreement": token_agreement(ref_tokens, test_tokens)
        if ref_tokens is not None and test_tokens is not None else None,
        "n_samples": int(a.shape[-1]),
    }
    return {"kind": "audio", "sample_rate": sample_rate, "summary": summary, "config": dict(AUDIO_METRIC_CONFIG)}
