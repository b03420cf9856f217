"""Prompt adherence of a generated sound clip, by hand-written rules with no learned parts (installed as
`mmkv.metrics.audio_adherence`).

The clips are those of `mmkv.pipelines.aar.sounds`: one note (a band-limited sine, square, sawtooth or triangle wave,
plucked or sustained, perhaps with a quieter second note later), chirp (exponential sweep, rising or falling), burst
of band-passed noise, or train of clicks, starting at an unnamed time. This module never imports the pipelines: the
caller passes the note and band tables (`sounds.TABLES`).

Every attribute is measured on every clip, from a float waveform [samples]:

* Energy envelope: mean square over `frame` (10 ms) windows every `hop` (2.5 ms), in dB, floored `floor_db` below
  its peak. A clip whose envelope peaks below `silence_db` dBFS is silent: nothing is found and every *_ok is None.
* Onsets: the envelope rises at least `onset_rise_db` above its maximum over the `onset_lookback` before the current
  window (so a slow attack or a fluctuating noise does not fire twice; the clip starts from silence), within
  `onset_floor_db` of the peak; the
  first such window after each `onset_gap` marks one, dated to the end of that window less half a hop. `count` is
  their number.
* Impulsiveness: the fraction of 2 ms windows within `active_db` of the clip's loudest one. Clicks (a few ms each)
  give at most 3%, the shortest note or burst 15%.
* Glide, from the STFT (Hann, n_fft 1024, hop 10 ms): the strongest bin of each frame within `active_db` of the
  loudest, refined by a parabola through the log magnitudes; the median step of log2 of that frequency between
  consecutive such frames. An exponential sweep moves it by a steady step (1.3-3.3 octaves over 0.3-0.6 s), a note
  not at all, noise at random. A glide of at least `glide_min` octaves a second that at least `glide_agreement` of
  the steps follow (within half the median step) gives `direction`. With `glide_lag` k > 1 each step spans k frames
  (divided by k), so frame-to-frame jitter of the peak, which a generated sweep can have, weighs k times less.
* Periodicity and pitch: YIN (de Cheveigne and Kawahara, 2002, steps 1-5: difference function, cumulative mean
  normalised difference d', absolute threshold, local minimum, parabolic interpolation of the difference function)
  in 20 ms windows every `yin_hop` from `fmin` to `fmax`, over the first sound: the first `pitch_window` after the
  first onset, and before the next one (a note's second voice starts later and would mix in a second period).
  `aperiodicity` is the median d' there, `pitch_hz` the median YIN f0 over its voiced windows (d' below
  `yin_threshold`).
* Waveform, from the harmonics of that pitch in the same stretch (Hann, peak magnitude within 3% of n f0):
  even = |h2, h4| / h1 and odd = |h3, h5| / h1. Sawtooth 0.56 and 0.39; square 0 and 0.39; triangle 0 and 0.12;
  sine 0 and 0. Sawtooth if even >= `saw_even`, else square if odd >= `square_odd`, else triangle if odd >=
  `triangle_odd`, else sine.
* Envelope: the time from the first onset to the envelope's maximum within `attack_window` after it. A pluck peaks
  within about 10 ms, a pad's attack takes 80-200 ms: pad when it exceeds `pad_attack`.
* Band: the table band holding the most energy of the mean power spectrum over the active frames.
* Kind: clicks when the impulsiveness is at most `impulsive_fraction`; else chirp when a direction is found; else
  note when the aperiodicity is at most `tonal_aperiodicity`; else noise.

`pitch_ok` holds when the pitch is within `pitch_tol_cents` of the named note (octave included); the other *_ok
compare the detected value with the named one, False when nothing was detected. `windows` gives per-window values
(level, spectral centroid and flatness, pitch, onsets) for the report, `onset_times` the onsets in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

KINDS = ("note", "chirp", "noise", "clicks")
WAVEFORMS = ("sine", "square", "sawtooth", "triangle")
ENVELOPES = ("pluck", "pad")
DIRECTIONS = ("rising", "falling")
# Named attribute -> the field saying whether the clip shows it.
OK_FIELDS = {"kind": "kind_ok", "note": "pitch_ok", "waveform": "waveform_ok", "envelope": "envelope_ok",
             "direction": "direction_ok", "band": "band_ok", "count": "count_ok"}
STFT_N_FFT, STFT_HOP = 1024, 0.010  # samples, s
_HANN = np.hanning(STFT_N_FFT)


@dataclass(frozen=True)
class SoundTables:
    """The named values the detector knows: note name -> fundamental in Hz, band name -> (low, high) Hz."""

    notes: Mapping[str, float]
    bands: Mapping[str, tuple[float, float]]

    def __post_init__(self):
        if not self.notes or not self.bands:
            raise ValueError("SoundTables needs at least one note and one band")
        for name, hz in self.notes.items():
            if not hz > 0:
                raise ValueError(f"SoundTables note {name!r} must have a positive frequency in Hz, got {hz!r}")
        for name, edges in self.bands.items():
            if len(edges) != 2 or not 0 < edges[0] < edges[1]:
                raise ValueError(f"SoundTables band {name!r} must be (low, high) Hz with 0 < low < high, got "
                                 f"{edges!r}")


@dataclass(frozen=True)
class Thresholds:
    """Every tolerance of the detector; the defaults are set for the sounds' synthesis (see the module docstring)."""

    frame: float = 0.010  # s
    hop: float = 0.0025  # s
    floor_db: float = 60.0
    silence_db: float = -60.0  # dBFS of the envelope's peak
    onset_rise_db: float = 9.0
    onset_lookback: float = 0.030  # s
    onset_gap: float = 0.040  # s
    onset_floor_db: float = 40.0
    active_db: float = 20.0
    impulsive_fraction: float = 0.06
    glide_min: float = 1.0  # octaves per second
    glide_agreement: float = 0.6
    min_glide_steps: int = 8
    # STFT frames between the two ends of a glide step (1: consecutive frames, 10 ms). A longer step lets a sweep
    # whose peak frequency jitters from frame to frame (a generated chirp) still agree: the glide grows with the
    # lag, the jitter does not.
    glide_lag: int = 1
    fmin: float = 60.0  # Hz
    fmax: float = 3000.0  # Hz
    yin_threshold: float = 0.12
    yin_hop: float = 0.02  # s
    tonal_aperiodicity: float = 0.2
    pitch_window: float = 0.25  # s
    pitch_tol_cents: float = 50.0
    saw_even: float = 0.25
    square_odd: float = 0.21
    triangle_odd: float = 0.035
    attack_window: float = 0.28  # s
    pad_attack: float = 0.04  # s
    window: float = 0.25  # s, per-window report

    def __post_init__(self):
        if not 0 < self.hop <= self.frame:
            raise ValueError(f"Thresholds need 0 < hop <= frame, got hop {self.hop}, frame {self.frame}")
        if not 0 < self.fmin < self.fmax:
            raise ValueError(f"Thresholds need 0 < fmin < fmax, got {self.fmin}, {self.fmax}")
        if isinstance(self.glide_lag, bool) or not isinstance(self.glide_lag, int) or self.glide_lag < 1:
            raise ValueError(f"Thresholds glide_lag must be an int >= 1 (STFT frames), got {self.glide_lag!r}")


DEFAULT_THRESHOLDS = Thresholds()


# ----------------------------------------------------------------------------------------------------------------
# Signal features


def _mean_square(x: np.ndarray, n: int, hop: int) -> np.ndarray:
    """Mean square of x over windows of n samples every hop samples (one window if x is shorter)."""
    n = min(n, len(x))
    c = np.concatenate([[0.0], np.cumsum(x * x)])
    starts = np.arange(0, len(x) - n + 1, hop)
    return (c[starts + n] - c[starts]) / n


def _db(power: np.ndarray) -> np.ndarray:
    return 10 * np.log10(np.maximum(power, 1e-20))


def yin_span(sample_rate: int, fmin: float = 60.0, frame: float = 0.02) -> int:
    """Samples one `yin` window reads: the integration window, the longest lag and one more for interpolation."""
    return max(1, round(frame * sample_rate)) + math.ceil(sample_rate / fmin) + 1


def yin(x: np.ndarray, sample_rate: int, fmin: float = 60.0, fmax: float = 3000.0, frame: float = 0.02,
        hop: float = 0.01, threshold: float = 0.12) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """YIN pitch track (de Cheveigne and Kawahara, 2002): (window start in samples, f0 Hz, aperiodicity) per window
    of `frame` s plus the longest lag, every `hop` s. Aperiodicity is d' at the chosen lag; a window is voiced when it
    is below `threshold`. Silent windows read aperiodicity 1 and f0 NaN."""
    x = np.asarray(x, dtype=np.float64)
    w = max(1, round(frame * sample_rate))
    tmax = math.ceil(sample_rate / fmin)
    tmin = max(2, math.floor(sample_rate / fmax))
    span = yin_span(sample_rate, fmin, frame)
    if len(x) < span:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    all_starts = np.arange(0, len(x) - span + 1, max(1, round(hop * sample_rate)))
    c = np.concatenate([[0.0], np.cumsum(x * x)])
    # Windows 100 dB or more below the loudest are silence (aperiodic, f0 NaN): no need to search them.
    loudness = c[all_starts + span] - c[all_starts]
    heard = loudness > 1e-10 * loudness.max() if loudness.max() > 0 else np.zeros(len(all_starts), bool)
    f0, aperiodicity = np.full(len(all_starts), np.nan), np.ones(len(all_starts))
    starts = all_starts[heard]
    if not len(starts):
        return all_starts, f0, aperiodicity
    seg = sliding_window_view(x, span)[starts]
    # Step 1, d(tau) = e(0) + e(tau) - 2 r(tau) with r the correlation of the first w samples with the window: an FFT
    # of at least `span` points never wraps for lags up to tmax.
    n = 1 << (span - 1).bit_length()
    r = np.fft.irfft(np.conj(np.fft.rfft(seg[:, :w], n)) * np.fft.rfft(seg, n), n)[:, :tmax + 1]
    lag_start = starts[:, None] + np.arange(tmax + 1)
    energy = c[lag_start + w] - c[lag_start]  # of x[start + tau : start + tau + w]
    d = np.maximum(energy[:, :1] + energy - 2 * r, 0.0)
    # Step 2, cumulative mean normalised difference.
    lags = np.arange(1, tmax + 1)
    dn = np.ones_like(d)
    cum = np.cumsum(d[:, 1:], 1)
    dn[:, 1:] = np.where(cum > 0, d[:, 1:] * lags / np.where(cum > 0, cum, 1.0), 1.0)  # silence is aperiodic
    # Steps 3-4: the first lag below the threshold, then on down to its local minimum; else the global minimum.
    sub = dn[:, tmin:tmax + 1]
    below = sub[:, :-1] < threshold
    first = np.where(below.any(1), below.argmax(1), sub.shape[1])
    rising = (sub[:, 1:] >= sub[:, :-1]) & (np.arange(sub.shape[1] - 1)[None] >= first[:, None])
    k = np.where(below.any(1), rising.argmax(1), sub[:, :-1].argmin(1))
    tau = tmin + k
    rows = np.arange(len(seg))
    aperiodicity[heard] = dn[rows, tau]
    # Step 5: parabolic interpolation of the raw difference function (d' would bias it).
    a, b, cc = d[rows, tau - 1], d[rows, tau], d[rows, tau + 1]
    curve = a - 2 * b + cc
    shift = np.where(curve > 0, 0.5 * (a - cc) / np.where(curve > 0, curve, 1.0), 0.0).clip(-1, 1)
    f0[heard] = sample_rate / (tau + shift)
    return all_starts, f0, aperiodicity


def _stft_power(x: np.ndarray, sample_rate: int) -> tuple[np.ndarray, np.ndarray]:
    """Power spectrogram [frames, bins] (Hann, STFT_N_FFT, STFT_HOP, zero-padded ends) and frame centres in s."""
    hop = round(STFT_HOP * sample_rate)
    padded = np.pad(x, (STFT_N_FFT // 2, STFT_N_FFT // 2))
    frames = sliding_window_view(padded, STFT_N_FFT)[::hop]
    spec = np.fft.rfft(frames * _HANN, axis=1)
    power = spec.real ** 2 + spec.imag ** 2
    return power, np.arange(len(frames)) * hop / sample_rate


def _peak_track(power: np.ndarray, sample_rate: int) -> np.ndarray:
    """Frequency (Hz) of each frame's strongest bin above 40 Hz, refined by a parabola through the log magnitudes."""
    lo = max(1, math.ceil(40 * STFT_N_FFT / sample_rate))
    k = lo + power[:, lo:-1].argmax(1)
    rows = np.arange(len(power))
    a, b, c = (0.5 * np.log(np.maximum(power[rows, k + j], 1e-30)) for j in (-1, 0, 1))
    curve = a - 2 * b + c
    shift = np.where(curve < 0, 0.5 * (a - c) / np.where(curve < 0, curve, -1.0), 0.0).clip(-0.5, 0.5)
    return (k + shift) * sample_rate / STFT_N_FFT


def _onsets(env_db: np.ndarray, th: Thresholds, hop: int, frame: int) -> list[int]:
    """Envelope windows where an onset is detected (see the module docstring)."""
    lag, look = math.ceil(frame / hop), max(1, round(th.onset_lookback / th.hop))
    floor = env_db.max() - th.floor_db  # before the clip: silence, so a sound there from the start is an onset
    padded = np.concatenate([np.full(lag + look - 1, floor), env_db])
    before = sliding_window_view(padded, look)[:len(env_db)].max(1)  # over windows t-lag-look+1 .. t-lag
    candidates = np.flatnonzero((env_db - before >= th.onset_rise_db)
                                & (env_db >= env_db.max() - th.onset_floor_db))
    onsets, gap = [], max(1, round(th.onset_gap / th.hop))
    for t in candidates:
        if not onsets or t - onsets[-1] >= gap:
            onsets.append(int(t))
    return onsets


def _harmonic_ratios(x: np.ndarray, sample_rate: int, f0: float) -> tuple[float, float]:
    """(|h2, h4| / h1, |h3, h5| / h1) of the windowed stretch x at fundamental f0."""
    n = 1 << (2 * len(x) - 1).bit_length()  # zero-padded to bins under half the Hann main lobe
    mag = np.abs(np.fft.rfft(x * np.hanning(len(x)), n))
    h = []
    for m in range(1, 6):
        f = m * f0
        if f >= sample_rate / 2:
            h.append(0.0)
            continue
        lo, hi = (int(f * s * n / sample_rate) for s in (0.97, 1.03))
        h.append(float(mag[lo:hi + 2].max()))
    if h[0] <= 0:
        return 0.0, 0.0
    return math.hypot(h[1], h[3]) / h[0], math.hypot(h[2], h[4]) / h[0]


def _waveform(even: float, odd: float, th: Thresholds) -> str:
    if even >= th.saw_even:
        return "sawtooth"
    if odd >= th.square_odd:
        return "square"
    return "triangle" if odd >= th.triangle_odd else "sine"


def _nearest_note(hz: float, tables: SoundTables) -> str:
    return min(tables.notes, key=lambda k: abs(math.log2(hz / tables.notes[k])))


def _cents(hz: float, ref: float) -> float:
    return 1200 * math.log2(hz / ref)


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def _check(wave, sample_rate, named, tables) -> tuple[np.ndarray, dict]:
    if not isinstance(wave, np.ndarray) or wave.dtype.kind != "f" or wave.ndim != 1:
        got = f"{type(wave).__name__} {getattr(wave, 'dtype', '')} {getattr(wave, 'shape', '')}"
        raise ValueError(f"score_audio needs a float waveform shaped [samples] (one mono clip), got {got}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 8000:
        raise ValueError(f"score_audio sample_rate must be an int >= 8000 Hz, got {sample_rate!r}")
    if len(wave) < round(0.1 * sample_rate) or not np.isfinite(wave).all():
        raise ValueError(f"score_audio needs at least 0.1 s of finite samples, got {len(wave)} samples"
                         f"{'' if np.isfinite(wave).all() else ' with NaN or inf'}")
    if not isinstance(tables, SoundTables):
        raise ValueError(f"score_audio needs SoundTables (sounds.TABLES), got {type(tables).__name__}")
    if named is not None and not isinstance(named, Mapping):
        raise ValueError(f"score_audio needs the caption's attributes as a dict (sounds.parse_caption(text)) or "
                         f"None, got {type(named).__name__}")
    named = {k: v for k, v in dict(named or {}).items() if v is not None}
    allowed = {"kind": KINDS, "note": tuple(tables.notes), "waveform": WAVEFORMS, "envelope": ENVELOPES,
               "direction": DIRECTIONS, "band": tuple(tables.bands)}
    for key, value in named.items():
        if key == "count":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"score_audio named count must be a positive int, got {value!r}")
        elif key not in allowed:
            raise ValueError(f"score_audio named attribute {key!r} is not one of {', '.join(OK_FIELDS)}")
        elif value not in allowed[key]:
            raise ValueError(f"score_audio named {key} {value!r} is not one of {', '.join(allowed[key])}")
    return wave.astype(np.float64), named


def score_audio(wave: np.ndarray, sample_rate: int, named: Mapping | None, tables: SoundTables,
                thresholds: Thresholds = DEFAULT_THRESHOLDS) -> dict:
    """Adherence of one mono clip to the named attributes, and its onset times.

    wave: float [samples]. named: the caption's attributes (`sounds.parse_caption`), any subset of kind, note,
    waveform, envelope, direction, band, count, or None. Returns the detected values ("kind", "pitch_hz", "note",
    "waveform", "envelope", "attack_s", "direction", "glide_oct_per_s", "band", "centroid_hz", "count",
    "onset_times", "found", "features"), "<attr>_ok" for each (`OK_FIELDS`; None when the clip is silent or the
    caption does not name it), "pitch_cents" (from the named note, else the nearest), "adherence" (fraction of the
    non-None *_ok that hold, or None) and "windows" (per-window values)."""
    x, named = _check(wave, sample_rate, named, tables)
    a = _analyse(x, sample_rate, thresholds)
    out = {"found": a.found, "kind": None, "pitch_hz": None, "note": None, "pitch_cents": None, "waveform": None,
           "envelope": None, "attack_s": None, "direction": None, "glide_oct_per_s": None, "band": None,
           "centroid_hz": None, "count": 0, "onset_times": [], "features": {}, "n_samples": len(x),
           "sample_rate": sample_rate}
    if a.found:
        out.update(_measure(a, tables, thresholds))
    for attr, field in OK_FIELDS.items():
        ok = None
        if a.found and attr in named:
            if attr == "note":
                ok = out["pitch_hz"] is not None and abs(
                    _cents(out["pitch_hz"], tables.notes[named["note"]])) <= thresholds.pitch_tol_cents
            else:
                ok = out[attr] == named[attr]
        out[field] = ok
    if out["pitch_hz"] is not None:
        ref = tables.notes[named["note"]] if "note" in named else tables.notes[out["note"]]
        out["pitch_cents"] = _cents(out["pitch_hz"], ref)
    oks = [out[f] for f in OK_FIELDS.values() if out[f] is not None]
    out["adherence"] = float(np.mean(oks)) if oks else None
    out["windows"] = _windows(a, out["onset_times"], thresholds)
    return out


@dataclass
class _Analysis:
    """The shared views of one clip: energy envelope, STFT and YIN track."""

    x: np.ndarray
    sr: int
    hop: int  # envelope hop and window, samples
    frame: int
    env_db: np.ndarray  # floored floor_db below its peak
    found: bool
    power: np.ndarray  # [frames, bins]
    centres: np.ndarray  # s
    yin_starts: np.ndarray  # samples
    span: int  # samples each YIN window reads
    f0: np.ndarray
    aperiodicity: np.ndarray


def _analyse(x: np.ndarray, sr: int, th: Thresholds) -> _Analysis:
    hop, frame = max(1, round(th.hop * sr)), max(1, round(th.frame * sr))
    env_db = _db(_mean_square(x, frame, hop))
    peak_db = float(env_db.max())
    power, centres = _stft_power(x, sr)
    starts, f0, aper = yin(x, sr, th.fmin, th.fmax, hop=th.yin_hop, threshold=th.yin_threshold)
    return _Analysis(x, sr, hop, frame, np.maximum(env_db, peak_db - th.floor_db), peak_db >= th.silence_db,
                     power, centres, starts, yin_span(sr, th.fmin), f0, aper)


def _measure(a: _Analysis, tables: SoundTables, th: Thresholds) -> dict:
    x, sr, hop, frame = a.x, a.sr, a.hop, a.frame
    out = {}
    onsets = _onsets(a.env_db, th, hop, frame)
    times = [(t * hop + frame - hop / 2) / sr for t in onsets]
    out["onset_times"], out["count"] = times, len(times)
    fine = _db(_mean_square(x, max(1, round(0.002 * sr)), max(1, round(0.001 * sr))))
    impulsive = float((fine >= fine.max() - th.active_db).mean())

    energy = a.power.sum(1)
    active = energy >= energy.max() * 10 ** (-th.active_db / 10)
    track = np.log2(_peak_track(a.power, sr))
    lag, steps = th.glide_lag, np.zeros(0)
    if len(track) > lag:  # steps over `lag` frames (all of them active), per frame
        steps = ((track[lag:] - track[:-lag]) / lag)[sliding_window_view(active, lag + 1).all(1)]
    glide = agreement = 0.0
    if len(steps) >= th.min_glide_steps:
        glide = float(np.median(steps))
        agreement = float((np.abs(steps - glide) <= 0.5 * abs(glide)).mean())
    out["glide_oct_per_s"] = glide / STFT_HOP
    if abs(glide) / STFT_HOP >= th.glide_min and agreement >= th.glide_agreement:
        out["direction"] = "rising" if glide > 0 else "falling"

    spectrum = a.power[active].mean(0)
    freqs = np.fft.rfftfreq(STFT_N_FFT, 1 / sr)
    out["centroid_hz"] = float((spectrum * freqs).sum() / max(spectrum.sum(), 1e-30))
    out["band"] = max(tables.bands, key=lambda b: spectrum[(freqs >= tables.bands[b][0])
                                                          & (freqs <= tables.bands[b][1])].sum())

    # Periodicity, pitch, harmonics and attack of the first sound: from its onset to the next one or pitch_window
    # later (a note's second voice would mix in a second period).
    first = times[0] if times else float(a.centres[np.flatnonzero(active)[0]])
    begin = first + 0.01
    end = min(begin + th.pitch_window, times[1] - 0.005 if len(times) > 1 else math.inf, len(x) / sr)
    inside = (a.yin_starts >= begin * sr) & (a.yin_starts + a.span <= end * sr)
    if not inside.any():  # a stretch shorter than one YIN window: the loud windows instead
        loud = a.env_db[np.minimum(a.yin_starts // hop, len(a.env_db) - 1)]  # the 10 ms starting there
        inside = loud >= loud.max() - th.active_db if len(loud) else inside
    aperiodicity = float(np.median(a.aperiodicity[inside])) if inside.any() else 1.0
    voiced = inside & (a.aperiodicity < th.yin_threshold)
    even = odd = None
    if voiced.sum() >= 3:
        out["pitch_hz"] = float(np.median(a.f0[voiced]))
        out["note"] = _nearest_note(out["pitch_hz"], tables)
        even, odd = _harmonic_ratios(x[int(begin * sr):int(end * sr)], sr, out["pitch_hz"])
        out["waveform"] = _waveform(even, odd, th)
    if onsets:
        t0 = onsets[0]
        peak = t0 + int(a.env_db[t0:t0 + max(1, round(th.attack_window / th.hop))].argmax())
        out["attack_s"] = (peak - t0) * hop / sr
        out["envelope"] = "pad" if out["attack_s"] > th.pad_attack else "pluck"

    if impulsive <= th.impulsive_fraction:
        out["kind"] = "clicks"
    elif "direction" in out:
        out["kind"] = "chirp"
    elif aperiodicity <= th.tonal_aperiodicity:
        out["kind"] = "note"
    else:
        out["kind"] = "noise"
    out["features"] = {"impulsive_fraction": impulsive, "glide_agreement": agreement, "aperiodicity": aperiodicity,
                       "even_harmonics": even, "odd_harmonics": odd}
    return out


def _windows(a: _Analysis, onset_times: list[float], th: Thresholds) -> list[dict]:
    """Per-window level, spectral centroid and flatness, YIN pitch (median over voiced frames) and onsets."""
    x, sr = a.x, a.sr
    n = max(1, round(th.window * sr))
    lo = np.arange(0, len(x), n)
    hi = np.minimum(lo + n, len(x))
    c = np.concatenate([[0.0], np.cumsum(x * x)])
    rms_db = _db((c[hi] - c[lo]) / (hi - lo))
    # STFT frames by the window holding their centre (frames are in time order).
    which = (a.centres * sr // n).astype(np.int64)
    keep = which < len(lo)
    counts = np.bincount(which[keep], minlength=len(lo))
    spec = np.zeros((len(lo), a.power.shape[1]))
    if keep.any():
        firsts = np.searchsorted(which[keep], np.arange(len(lo)))
        filled = counts > 0
        spec[filled] = np.add.reduceat(a.power[keep], firsts[filled], axis=0) / counts[filled, None]
    total = spec.sum(1)
    freqs = np.fft.rfftfreq(STFT_N_FFT, 1 / sr)
    centroid = spec @ freqs / np.where(total > 0, total, 1.0)
    flatness = np.exp(np.log(spec[:, 1:] + 1e-30).mean(1)) / np.where(total > 0, spec[:, 1:].mean(1), 1.0)
    voiced = a.aperiodicity < th.yin_threshold
    onsets = np.bincount(np.minimum((np.asarray(onset_times) * sr // n).astype(np.int64), len(lo) - 1),
                         minlength=len(lo))
    rows = []
    for k in range(len(lo)):
        pitched = voiced & (a.yin_starts >= lo[k]) & (a.yin_starts < hi[k])
        heard = bool(total[k] > 0)
        rows.append({"start_s": float(lo[k] / sr), "end_s": float(hi[k] / sr), "rms_db": float(rms_db[k]),
                     "centroid_hz": float(centroid[k]) if heard else None,
                     "flatness": float(flatness[k]) if heard else None,
                     "pitch_hz": float(np.median(a.f0[pitched])) if pitched.any() else None,
                     "onsets": int(onsets[k])})
    return rows
