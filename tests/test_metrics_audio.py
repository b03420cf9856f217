"""Audio metrics: known answers and agreement with independent numpy / torchaudio computations."""

import math

import numpy as np
import pytest
import torch
from scipy.signal import get_window

from mmkv.metrics import audio_metrics, log_mel_mse, lsd_db, mel_filterbank, snr_db

SR = 24000


def _clip(rng, n=SR):
    # A few partials plus noise: a spectrum with structure, never zeros.
    t = np.arange(n) / SR
    x = sum(rng.uniform(0.1, 0.5) * np.sin(2 * np.pi * rng.uniform(80, 8000) * t) for _ in range(4))
    return (x + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _np_power(x, n_fft, hop, center):
    if center:
        x = np.pad(x, n_fft // 2, mode="reflect")
    n = 1 + (len(x) - n_fft) // hop
    frames = np.stack([x[i * hop : i * hop + n_fft] for i in range(n)])
    spec = np.fft.rfft(frames * get_window("hann", n_fft, fftbins=True), axis=1)
    return (np.abs(spec) ** 2).T  # [freq, frames]


def test_identical_signals_known_answers():
    rng = np.random.default_rng(1032)
    x = _clip(rng)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    lat = torch.randn(1, 8, 75, generator=g)
    tok = torch.randint(0, 1024, (455,), generator=g)
    s = audio_metrics(x, x.copy(), SR, lat, lat.clone(), tok, tok.clone())["summary"]
    assert s["lsd_db"] == 0.0 and s["log_mel_mse"] == 0.0
    assert s["snr_db"] == 120.0 and s["snr_at_cap"]
    assert s["latent_cosine"] == pytest.approx(1.0, abs=1e-12) and s["token_agreement"] == 1.0


def test_lsd_and_snr_match_numpy():
    rng = np.random.default_rng(1044)
    x = _clip(rng).astype(np.float64)
    y = x + rng.uniform(0.01, 0.3) * rng.standard_normal(x.size)
    px = np.maximum(_np_power(x, 2048, 512, True), 1e-8)
    py = np.maximum(_np_power(y, 2048, 512, True), 1e-8)
    want_lsd = 10 * np.mean(np.sqrt(np.mean((np.log10(py) - np.log10(px)) ** 2, axis=0)))
    want_snr = 10 * np.log10(np.sum(x**2) / np.sum((x - y) ** 2))
    assert lsd_db(x, y) == pytest.approx(want_lsd, abs=1e-5)
    assert snr_db(x, y) == pytest.approx(want_snr, abs=1e-5)
    assert snr_db(x, x + 1e-9 * rng.standard_normal(x.size)) == 120.0  # below the 1e-12 floor: capped


def test_log_mel_matches_numpy_with_torchaudio_filterbank():
    import torchaudio.functional as AF  # an independent Slaney filterbank

    fb = AF.melscale_fbanks(513, 0.0, SR / 2, 80, SR, norm="slaney", mel_scale="slaney").double().numpy().T
    assert np.allclose(mel_filterbank(SR, 1024, 80), fb, rtol=1e-4, atol=1e-7)
    rng = np.random.default_rng(1061)
    x = _clip(rng).astype(np.float64)
    y = x + 0.1 * rng.standard_normal(x.size)
    p = (1024 - 256) // 2

    def np_log_mel(s):
        return np.log10(np.maximum(fb @ _np_power(np.pad(s, p, mode="reflect"), 1024, 256, False), 1e-5))

    want = np.mean((np_log_mel(y) - np_log_mel(x)) ** 2)
    assert log_mel_mse(x, y, SR) == pytest.approx(want, rel=1e-4)


def test_metrics_move_the_right_way_with_noise():
    rng = np.random.default_rng(1074)
    x = _clip(rng)
    noise = rng.standard_normal(x.size).astype(np.float32)
    rows = [audio_metrics(x, x + s * noise, SR)["summary"] for s in (0.003, 0.03, 0.3)]
    assert 0 < rows[0]["lsd_db"] < rows[1]["lsd_db"] < rows[2]["lsd_db"]
    assert 0 < rows[0]["log_mel_mse"] < rows[1]["log_mel_mse"] < rows[2]["log_mel_mse"]
    assert 120 > rows[0]["snr_db"] > rows[1]["snr_db"] > rows[2]["snr_db"]


def test_bad_audio_is_refused_or_flagged():
    rng = np.random.default_rng(1084)
    x = _clip(rng)
    assert math.isnan(snr_db(np.zeros_like(x), x))  # silent reference: SNR undefined
    with pytest.raises(ValueError, match="same length"):
        audio_metrics(x, x[:-10], SR)
    with pytest.raises(ValueError, match="more than 1024 samples"):
        lsd_db(x[:900], x[:900])
    with pytest.raises(ValueError, match="float PCM"):
        snr_db((x * 1000).astype(np.int16), (x * 1000).astype(np.int16))
    stereo = np.stack([x, _clip(rng)], axis=1)  # soundfile layout [N, C]
    assert lsd_db(stereo, stereo) == 0.0
