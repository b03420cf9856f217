"""Procedural captioned sound clips for training and scoring the tiny AAR-architecture audio models.

A clip holds one sound of four kinds, uniform: a note (one of 12 pitch classes in octaves 3-5, a band-limited sine,
square, sawtooth or triangle wave, plucked or sustained), a chirp (an exponential sine sweep, rising or falling), a
burst of band-passed noise (low, mid or high band) or 2-6 clicks. The caption names only those; what it leaves to the
model is when the sound starts (a random time in the first 0.3 s; click times random with at least CLICK_GAP between
them), how loud it is, its envelope timings, a chirp's end frequencies, a click's timbre, and for half the notes a
second quieter note (SECOND_NOTE_DB, another pitch class, same waveform and envelope) that starts later.
`mmkv.metrics.audio_adherence.score_audio` measures the named attributes and the onset times (pass it `TABLES`).
Installed as `mmkv.pipelines.aar.sounds`.

Conventions:

* Clips are mono float32 in [-1, 1], SAMPLE_RATE 24 kHz and SECONDS 1 s by default (AAR's 1 s, 455 tokens). Each
  clip is scaled so that its peak is the sound's `amplitude` (0.5-0.9) and fades out over the last 10 ms.
* Notes are additive: every harmonic of the waveform's series below Nyquist, so pitch trackers and harmonic ratios
  see the textbook spectra (square and triangle: odd harmonics at 1/n and 1/n^2; sawtooth: all at 1/n).
* A note's second voice starts SECOND_DELAY (0.3-0.5 s) after the first, so the first 0.3 s of a note hold one pitch.
* Seeds: training uses [0, TRAIN_SEED_END); `held_out_seeds(n)` returns n seeds from HELD_OUT_SEED_START = 10**7 up,
  which training never draws. `sample_sound(seed)` draws from a private CPU generator keyed by the seed, and a noise
  clip's phases come from another keyed by the same seed, so a seed gives the same clip on every machine and never
  touches the global RNG.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from mmkv.codecs.base import private_generator
from mmkv.pipelines.training import HELD_OUT_SEED_START, TRAIN_SEED_END, held_out_seeds  # noqa: F401
from mmkv.metrics.audio_adherence import SoundTables

SAMPLE_RATE = 24_000
SECONDS = 1.0

KINDS = ("note", "chirp", "noise", "clicks")
# Flat names keep each note one plain word ("eb4"), which a word-level tokenizer reads as one token.
PITCH_CLASSES = ("C", "Db", "D", "Eb", "E", "F", "Gb", "G", "Ab", "A", "Bb", "B")
OCTAVES = (3, 4, 5)
# Equal temperament, A4 = 440 Hz; MIDI number 12 (octave + 1) + pitch class.
NOTES: dict[str, float] = {f"{p}{o}": 440.0 * 2.0 ** ((12 * (o + 1) + i - 69) / 12)
                           for o in OCTAVES for i, p in enumerate(PITCH_CLASSES)}
WAVEFORMS = ("sine", "square", "sawtooth", "triangle")
ENVELOPES = ("pluck", "pad")
DIRECTIONS = ("rising", "falling")
# Hz. Three octaves or more apart, so a band's energy never spills into another's range.
BANDS: dict[str, tuple[float, float]] = {"low": (80.0, 500.0), "mid": (1000.0, 3000.0), "high": (5000.0, 10000.0)}
COUNTS = (2, 3, 4, 5, 6)

TABLES = SoundTables(notes=NOTES, bands=BANDS)

ONSET = (0.02, 0.3)  # s, uniform: when the (first) sound starts
AMPLITUDE = (0.5, 0.9)  # the clip's peak, uniform
END_FADE = 0.01  # s, linear fade at the end of every clip
PLUCK_ATTACK, PLUCK_DECAY = 0.005, (0.1, 0.3)  # s; the decay is an exponential time constant
PAD_ATTACK, PAD_DECAY, PAD_SUSTAIN = (0.08, 0.2), (0.05, 0.1), (0.6, 0.8)
PAD_HOLD, PAD_RELEASE = (0.3, 0.45), (0.1, 0.2)
SECOND_PROB, SECOND_NOTE_DB, SECOND_DELAY = 0.5, -12.0, (0.3, 0.5)
CHIRP_LOW, CHIRP_HIGH, CHIRP_DURATION, CHIRP_FADE = (200.0, 400.0), (1000.0, 2000.0), (0.3, 0.6), 0.01
NOISE_ATTACK, NOISE_HOLD, NOISE_RELEASE = (0.005, 0.02), (0.15, 0.4), (0.02, 0.05)
BAND_EDGE = 0.25  # octaves of raised-cosine roll-off outside a noise band's edges
CLICK_GAP, CLICK_LAST = 0.08, 0.95  # s: least time between clicks; latest click
CLICK_DECAY, CLICK_LENGTH, CLICK_FREQ, CLICK_GAIN = 0.0005, 0.008, (1500.0, 4000.0), (0.6, 1.0)
MIN_SAMPLE_RATE = 22_050  # the high noise band reaches 10 kHz
_TABLE_SIZE = 4096  # samples per period of a note's wavetable
_CHUNK = 32  # clips rendered together: larger float64 temporaries spill out of the caches

# Caption grammar: per kind, format strings over the named attributes, each with the words it uses for an attribute
# whose wording varies between templates; every other attribute is written as WORDS says.
WORDS: dict[str, dict] = {
    "note": {n: n for n in NOTES},
    "waveform": {w: w for w in WAVEFORMS},
    "band": {b: b for b in BANDS},
    "count": {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"},
}
TEMPLATES: dict[str, tuple[tuple[str, dict[str, dict[str, str]]], ...]] = {
    "note": (
        ("a {envelope} {waveform} note at {note}", {"envelope": {"pluck": "plucked", "pad": "sustained"}}),
        ("a {waveform} {envelope} playing {note}", {"envelope": {"pluck": "pluck", "pad": "pad"}}),
        ("{note} as a {envelope} {waveform} tone", {"envelope": {"pluck": "plucked", "pad": "held"}}),
    ),
    "chirp": (
        ("a {direction} chirp", {"direction": {"rising": "rising", "falling": "falling"}}),
        ("a tone sweeping {direction}", {"direction": {"rising": "up", "falling": "down"}}),
        ("a chirp that {direction}", {"direction": {"rising": "rises", "falling": "falls"}}),
    ),
    "noise": (
        ("a burst of {band} noise", {}),
        ("a short {band} noise burst", {}),
        ("noise in the {band} band", {}),
    ),
    "clicks": (
        ("{count} clicks", {}),
        ("{count} short clicks", {}),
        ("a sequence of {count} clicks", {}),
    ),
}
NAMED_FIELDS = {"note": ("note", "waveform", "envelope"), "chirp": ("direction",), "noise": ("band",),
                "clicks": ("count",)}


@dataclass(frozen=True)
class Envelope:
    """Amplitude over time after the onset: a linear rise over `attack` s to 1 and an exponential fall with time
    constant `decay` s towards `sustain`, the whole faded linearly to 0 over `release` s from `hold` s after the
    attack."""

    attack: float
    decay: float
    sustain: float
    hold: float
    release: float


@dataclass(frozen=True)
class Sound:
    """One clip. `kind` and the named fields of that kind (NAMED_FIELDS) are what a caption states; the named fields
    of other kinds are None. Everything after `count` is unnamed."""

    kind: str
    note: str | None = None  # note clips
    waveform: str | None = None
    envelope: str | None = None
    direction: str | None = None  # chirps
    band: str | None = None  # noise bursts
    count: int | None = None  # clicks
    onset: float = 0.1  # s, when the sound (or the first click) starts
    amplitude: float = 0.7  # the clip's peak
    shape: Envelope | None = None  # amplitude envelope (notes, chirps, noise)
    phase: float = 0.0  # a note's starting phase, in periods
    second: tuple[str, float] | None = None  # a note's quieter second voice: (note, onset s)
    sweep: tuple[float, float] | None = None  # a chirp's (start, end) Hz; it lasts the envelope's length
    click_times: tuple[float, ...] = ()  # s, from the onset up
    click_gains: tuple[float, ...] = ()
    click_freq: float = 2500.0  # Hz, ring of a click
    noise_seed: int = 0  # keys the random phases of a noise burst
    template: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Sound kind {self.kind!r} is not one of {', '.join(KINDS)}")
        allowed = {"note": tuple(NOTES), "waveform": WAVEFORMS, "envelope": ENVELOPES, "direction": DIRECTIONS,
                   "band": tuple(BANDS), "count": COUNTS}
        for field, options in allowed.items():
            value = getattr(self, field)
            if field in NAMED_FIELDS[self.kind]:
                if value not in options:
                    raise ValueError(f"Sound {field} {value!r} is not one of {', '.join(map(str, options))}")
            elif value is not None:
                raise ValueError(f"a {self.kind} Sound names no {field} (got {value!r}); leave it None")
        if not 0 <= self.template < len(TEMPLATES[self.kind]):
            raise ValueError(f"Sound template {self.template} is not in 0..{len(TEMPLATES[self.kind]) - 1}")
        if not (self.onset >= 0 and 0 < self.amplitude <= 1):
            raise ValueError(f"Sound onset must be >= 0 s and amplitude in (0, 1], got {self.onset}, "
                             f"{self.amplitude}")
        if self.kind != "clicks" and self.shape is None:
            raise ValueError(f"a {self.kind} Sound needs its amplitude envelope `shape`")
        if self.kind == "chirp" and (self.sweep is None or min(self.sweep) <= 0
                                     or (self.sweep[1] > self.sweep[0]) != (self.direction == "rising")):
            raise ValueError(f"a {self.direction} chirp needs a sweep (start Hz, end Hz) going that way, "
                             f"got {self.sweep!r}")
        if self.kind == "note" and self.second is not None and self.second[0] not in NOTES:
            raise ValueError(f"Sound second note {self.second[0]!r} is not one of {', '.join(NOTES)}")
        if self.kind == "clicks" and not len(self.click_times) == len(self.click_gains) == self.count:
            raise ValueError(f"{self.count} clicks need {self.count} click_times and click_gains, got "
                             f"{len(self.click_times)} and {len(self.click_gains)}")
        if self.kind == "clicks" and (self.click_times[0] != self.onset
                                      or any(b <= a for a, b in zip(self.click_times, self.click_times[1:]))):
            raise ValueError(f"click_times must rise from the onset {self.onset} s, got {self.click_times}")

    @property
    def named(self) -> dict:
        """The attributes a caption states (what `parse_caption` returns): kind and that kind's named fields."""
        return {"kind": self.kind, **{f: getattr(self, f) for f in NAMED_FIELDS[self.kind]}}


# ----------------------------------------------------------------------------------------------------------------
# Sampling


def sample_sound(seed: int) -> Sound:
    """The sound of one seed: uniform over the kinds and their named attributes, the rest as the module docstring
    says."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"sound seed must be a non-negative int, got {seed!r}")
    # One fixed-length draw keeps every attribute's value independent of how the others are used.
    u = iter(torch.rand(40, generator=private_generator(seed, "sounds"), dtype=torch.float64).tolist())

    def pick(options):
        return options[min(int(next(u) * len(options)), len(options) - 1)]

    def uniform(lo_hi):
        lo, hi = lo_hi
        return lo + (hi - lo) * next(u)

    kind = pick(KINDS)
    template = pick(tuple(range(len(TEMPLATES[kind]))))
    onset, amplitude = uniform(ONSET), uniform(AMPLITUDE)

    note, waveform, envelope, phase = pick(tuple(NOTES)), pick(WAVEFORMS), pick(ENVELOPES), next(u)
    pluck = Envelope(PLUCK_ATTACK, uniform(PLUCK_DECAY), 0.0, 4.0, 0.01)  # a pluck decays away, never released
    pad = Envelope(uniform(PAD_ATTACK), uniform(PAD_DECAY), uniform(PAD_SUSTAIN), uniform(PAD_HOLD),
                   uniform(PAD_RELEASE))
    midi = list(NOTES).index(note)
    # Another pitch class, within an octave either way.
    others = [n for k, n in enumerate(NOTES) if 2 <= abs(k - midi) <= 11]
    has_second, second_note, second_delay = next(u) < SECOND_PROB, pick(others), uniform(SECOND_DELAY)

    direction, low, high = pick(DIRECTIONS), uniform(CHIRP_LOW), uniform(CHIRP_HIGH)
    length = uniform(CHIRP_DURATION)
    sweep_shape = Envelope(CHIRP_FADE, 1.0, 1.0, length - 2 * CHIRP_FADE, CHIRP_FADE)

    band = pick(tuple(BANDS))
    burst = Envelope(uniform(NOISE_ATTACK), 1.0, 1.0, uniform(NOISE_HOLD), uniform(NOISE_RELEASE))

    count = pick(COUNTS)
    # Clicks after the first: sorted offsets in the room left once every gap has its CLICK_GAP.
    room = CLICK_LAST - onset - (max(COUNTS) - 1) * CLICK_GAP
    offsets = sorted(room * next(u) for _ in range(max(COUNTS) - 1))[:count - 1]
    times = (onset,) + tuple(onset + (k + 1) * CLICK_GAP + o for k, o in enumerate(offsets))
    gains = tuple(uniform(CLICK_GAIN) for _ in range(max(COUNTS)))[:count]
    click_freq = uniform(CLICK_FREQ)

    common = dict(kind=kind, onset=onset, amplitude=amplitude, template=template)
    if kind == "note":
        return Sound(**common, note=note, waveform=waveform, envelope=envelope, phase=phase,
                     shape=pluck if envelope == "pluck" else pad,
                     second=(second_note, onset + second_delay) if has_second else None)
    if kind == "chirp":
        return Sound(**common, direction=direction, shape=sweep_shape,
                     sweep=(low, high) if direction == "rising" else (high, low))
    if kind == "noise":
        return Sound(**common, band=band, shape=burst, noise_seed=seed)
    return Sound(**common, count=count, click_times=times, click_gains=gains, click_freq=click_freq)


# ----------------------------------------------------------------------------------------------------------------
# Captions


def _words(kind: str, template: int) -> dict[str, dict]:
    """field -> value -> word, for one template."""
    own = TEMPLATES[kind][template][1]
    return {f: own.get(f, WORDS.get(f)) for f in NAMED_FIELDS[kind]}


def caption(sound: Sound) -> str:
    """The sound's caption in its template, built from the named attributes only."""
    words = _words(sound.kind, sound.template)
    text = TEMPLATES[sound.kind][sound.template][0]
    return text.format(**{f: words[f][getattr(sound, f)] for f in NAMED_FIELDS[sound.kind]})


def _template_regex(text: str, words: dict[str, dict]) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", text)  # literal, field, literal, field, ...
    pattern = "".join(re.escape(p) if i % 2 == 0 else
                      f"(?P<{p}>{'|'.join(re.escape(w.lower()) for w in words[p].values())})"
                      for i, p in enumerate(parts))
    return re.compile(pattern)


_PARSERS = [(kind, _template_regex(text, _words(kind, t)),
             {f: {w.lower(): v for v, w in ws.items()} for f, ws in _words(kind, t).items()})
            for kind, templates in TEMPLATES.items() for t, (text, _) in enumerate(templates)]


def parse_caption(text: str) -> dict | None:
    """The named attributes of a caption `caption()` could have written (`Sound.named`: case, surrounding spaces,
    repeated spaces and a final full stop are ignored), or None for any other prompt."""
    if not isinstance(text, str):
        return None
    text = " ".join(text.lower().split()).removesuffix(".").strip()
    for kind, regex, value_of in _PARSERS:
        m = regex.fullmatch(text)
        if m:
            return {"kind": kind, **{f: value_of[f][w] for f, w in m.groupdict().items()}}
    return None


def vocabulary() -> list[str]:
    """Every word a caption can contain, lower-cased and sorted (a word-level tokenizer's vocabulary)."""
    words = set()
    for kind, templates in TEMPLATES.items():
        for t, (text, _) in enumerate(templates):
            words |= set(re.sub(r"\{\w+\}", " ", text).split())
            for ws in _words(kind, t).values():
                words |= {w.lower() for w in ws.values()}
    return sorted(words)


# ----------------------------------------------------------------------------------------------------------------
# Rendering (phases and FFTs in float64, the rest float32)


def _envelope(sounds: Sequence[Sound], onsets: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Envelope values [n, samples] (float32) of each sound's `shape`, started at `onsets` [n] (s), at times `t`
    [samples]: the decay curve, times the attack ramp, times the release ramp (1 until the release starts)."""
    def col(values):
        return torch.tensor(values, dtype=torch.float32, device=t.device)[:, None]

    shapes = [s.shape for s in sounds]
    tt = t.float()[None] - onsets.float()[:, None]
    sustain = col([e.sustain for e in shapes])
    env = (tt - col([e.attack for e in shapes])).clamp_(min=0).mul_(col([-1 / e.decay for e in shapes])).exp_()
    env.mul_(1 - sustain).add_(sustain)
    env.mul_((tt * col([1 / e.attack for e in shapes])).clamp_(0, 1))
    end = col([e.attack + e.hold + e.release for e in shapes])
    return env.mul_((end - tt).mul_(col([1 / e.release for e in shapes])).clamp_(0, 1))


def _harmonics(waveform: str, f0: float, sample_rate: int) -> torch.Tensor:
    """Amplitudes of harmonics 0..n of the band-limited waveform (every one below Nyquist), [_TABLE_SIZE // 2 + 1]."""
    amp = torch.zeros(_TABLE_SIZE // 2 + 1, dtype=torch.float64)
    top = min(_TABLE_SIZE // 2 - 1, math.ceil(sample_rate / 2 / f0) - 1)
    n = torch.arange(1, top + 1, dtype=torch.float64)
    odd = n % 2 == 1
    if waveform == "sine":
        amp[1] = 1.0
    elif waveform == "square":
        amp[1:top + 1] = torch.where(odd, 1 / n, 0.0)
    elif waveform == "sawtooth":
        amp[1:top + 1] = torch.where(odd, 1.0, -1.0) / n
    else:  # triangle: odd harmonics at 1/n^2 with alternating signs
        amp[1:top + 1] = torch.where(odd, torch.where(n % 4 == 1, 1.0, -1.0) / n ** 2, 0.0)
    return amp


def _notes(sounds: Sequence[Sound], t: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Note clips [n, samples]: a wavetable per voice (one period of the band-limited waveform, exact harmonics),
    read at the voice's phase (float64) with linear interpolation."""
    voices = [(i, s.note, s.onset, 1.0) for i, s in enumerate(sounds)]
    voices += [(i, s.second[0], s.second[1], 10 ** (SECOND_NOTE_DB / 20))
               for i, s in enumerate(sounds) if s.second is not None]
    device = t.device

    def col(values, dtype=torch.float64):
        return torch.tensor(values, dtype=dtype, device=device)

    amp = torch.stack([_harmonics(sounds[i].waveform, NOTES[note], sample_rate) for i, note, _, _ in voices])
    # irfft of -i (L/2) a_n at bin n is sum_n a_n sin(2 pi n j / L).
    tables = torch.fft.irfft(-0.5j * _TABLE_SIZE * amp, n=_TABLE_SIZE).float().to(device)
    start, f0 = col([v[2] for v in voices]), col([NOTES[v[1]] for v in voices])
    # Periods since the voice's onset plus its starting phase, f0 (t - onset) + phase, kept in [0, 1).
    offset = col([sounds[v[0]].phase for v in voices]) - f0 * start
    pos = torch.addcmul(offset[:, None], f0[:, None], t[None]).remainder_(1.0).mul_(_TABLE_SIZE)
    i0 = pos.floor().long().clamp_(max=_TABLE_SIZE - 1)
    w = (pos - i0).float()
    wave = torch.lerp(torch.gather(tables, 1, i0), torch.gather(tables, 1, (i0 + 1) % _TABLE_SIZE), w)
    # Each voice follows its note's envelope from its own onset.
    wave.mul_(_envelope([sounds[v[0]] for v in voices], start, t)).mul_(col([v[3] for v in voices],
                                                                            torch.float32)[:, None])
    out = torch.zeros(len(sounds), t.numel(), device=device)
    return out.index_add_(0, col([v[0] for v in voices], torch.long), wave)


def _chirps(sounds: Sequence[Sound], t: torch.Tensor) -> torch.Tensor:
    """Exponential sine sweeps [n, samples]: f(t) = f_start (f_end / f_start)^(t / T) over the envelope's length T."""
    def col(values):
        return torch.tensor(values, dtype=torch.float64, device=t.device)[:, None]

    onset = col([s.onset for s in sounds])
    f_start, ratio = col([s.sweep[0] for s in sounds]), col([s.sweep[1] / s.sweep[0] for s in sounds])
    length = col([s.shape.attack + s.shape.hold + s.shape.release for s in sounds])
    tt = (t[None] - onset).clamp(min=0).minimum(length)
    cycles = f_start * length / torch.log(ratio) * torch.expm1(tt * (torch.log(ratio) / length))  # integral of f
    wave = torch.sin(2 * math.pi * torch.remainder(cycles, 1.0).float())
    return wave.mul_(_envelope(sounds, onset[:, 0], t))


def _noise(sounds: Sequence[Sound], t: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Band-passed noise bursts [n, samples]: a spectrum of seeded random phases (drawn on the CPU) whose magnitude is
    the band with raised-cosine edges BAND_EDGE octaves wide, back to time, under the burst envelope."""
    device, samples = t.device, t.numel()
    bins = samples // 2 + 1
    phase = torch.stack([torch.rand(bins, generator=private_generator(s.noise_seed, "sounds-noise"),
                                    dtype=torch.float64) for s in sounds]).to(device)
    freqs = torch.fft.rfftfreq(samples, 1 / sample_rate, dtype=torch.float64, device=device).clamp(min=1e-3)
    edges = torch.tensor(list(BANDS.values()), dtype=torch.float64, device=device)
    # Octaves outside each band (0 inside), then a raised cosine down to 0 at BAND_EDGE: [bands, bins].
    out = ((torch.log2(edges[:, :1] / freqs).clamp(min=0) + torch.log2(freqs / edges[:, 1:]).clamp(min=0))
           / BAND_EDGE)
    gain = torch.where(out < 1, 0.5 + 0.5 * torch.cos(math.pi * out.clamp(max=1)), 0.0)
    band = torch.tensor([list(BANDS).index(s.band) for s in sounds], device=device)
    noise = torch.fft.irfft(torch.polar(gain[band], 2 * math.pi * phase), n=samples).float()
    onset = torch.tensor([s.onset for s in sounds], dtype=torch.float64, device=device)
    return noise.mul_(_envelope(sounds, onset, t))


def _clicks(sounds: Sequence[Sound], samples: int, sample_rate: int, device: torch.device) -> torch.Tensor:
    """Click trains [n, samples]: each click a damped sinusoid (CLICK_DECAY time constant) starting at its time."""
    n, most, k = len(sounds), max(COUNTS), math.ceil(CLICK_LENGTH * sample_rate)
    times = torch.zeros(n, most, dtype=torch.float64)
    gains = torch.zeros(n, most, dtype=torch.float64)  # unused slots add zeros
    for i, s in enumerate(sounds):
        times[i, :s.count] = torch.tensor(s.click_times, dtype=torch.float64)
        gains[i, :s.count] = torch.tensor(s.click_gains, dtype=torch.float64)
    times, gains = times.to(device), gains.to(device)
    first = torch.ceil(times * sample_rate).long()  # the first sample at or after each click time
    index = first[..., None] + torch.arange(k, device=device)  # [n, most, k]
    tt = index.double() / sample_rate - times[..., None]
    freq = torch.tensor([s.click_freq for s in sounds], dtype=torch.float64, device=device)[:, None, None]
    pulse = gains[..., None] * torch.exp(-tt / CLICK_DECAY) * torch.sin(2 * math.pi * freq * tt)
    out = torch.zeros(n, samples + index.max().item() + 1, device=device)
    # Clicks are CLICK_GAP apart, longer than a pulse, so no two write the same sample.
    out.scatter_add_(1, index.reshape(n, -1), pulse.float().reshape(n, -1))
    return out[:, :samples]


def _render_kind(kind: str, sounds: list[Sound], t: torch.Tensor, sample_rate: int) -> torch.Tensor:
    if kind == "note":
        return _notes(sounds, t, sample_rate)
    if kind == "chirp":
        return _chirps(sounds, t)
    if kind == "noise":
        return _noise(sounds, t, sample_rate)
    return _clicks(sounds, t.numel(), sample_rate, t.device)


def render(sounds: Sound | Sequence[Sound], sample_rate: int = SAMPLE_RATE, seconds: float = SECONDS,
           device: str | torch.device = "cpu") -> torch.Tensor:
    """Clips [B, round(seconds * sample_rate)], float32 in [-1, 1], of the given sounds (one Sound gives B = 1).

    Each clip's peak is its sound's amplitude (a clip whose sound starts after its end is silent). Parameters and
    noise phases are drawn on the CPU, phases and FFTs computed in float64 and everything else elementwise, so CPU
    and CUDA agree to float32 rounding."""
    if isinstance(sounds, Sound):
        sounds = [sounds]
    sounds = list(sounds)
    if not sounds or not all(isinstance(s, Sound) for s in sounds):
        raise ValueError("render needs a non-empty sequence of Sound objects (from sample_sound)")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < MIN_SAMPLE_RATE:
        raise ValueError(f"render sample_rate must be an int >= {MIN_SAMPLE_RATE} Hz (the high noise band reaches "
                         f"10 kHz), got {sample_rate!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds * sample_rate >= 1:
        raise ValueError(f"render seconds must be a number giving at least one sample, got {seconds!r}")
    device = torch.device(device)
    samples = int(round(seconds * sample_rate))
    t = torch.arange(samples, dtype=torch.float64, device=device) / sample_rate
    fade = ((samples / sample_rate - t) / END_FADE).clamp(max=1.0).float()
    out = torch.empty(len(sounds), samples, device=device)
    for kind in KINDS:
        rows = [i for i, s in enumerate(sounds) if s.kind == kind]
        for first in range(0, len(rows), _CHUNK):
            chunk = rows[first:first + _CHUNK]
            group = [sounds[i] for i in chunk]
            wave = _render_kind(kind, group, t, sample_rate).mul_(fade)
            peak = wave.abs().amax(1, keepdim=True)
            amplitude = torch.tensor([s.amplitude for s in group], device=device)[:, None]
            # A silent clip (its sound starts after the end) stays silent.
            wave.mul_(torch.where(peak > 0, amplitude / peak.clamp(min=1e-30), 0.0))
            out.index_copy_(0, torch.tensor(chunk, device=device), wave)
    return out
