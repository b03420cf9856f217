"""Audio prompt-adherence detector: near-perfect on rendered clips for every named attribute, onsets where the
sounds start, chance (or nothing found) on white noise and silence, and YIN accurate on pure tones."""

import dataclasses
import json

import numpy as np
import pytest

from mmkv.metrics.audio_adherence import SoundTables, Thresholds, score_audio, yin
from mmkv.pipelines.aar import sounds as S

pytestmark = pytest.mark.usefixtures("one_thread")

SR = S.SAMPLE_RATE
PER_KIND = 200
ATTRS = {"note": ("kind", "note", "waveform", "envelope"), "chirp": ("kind", "direction"), "noise": ("kind", "band"),
         "clicks": ("kind", "count")}
OK = {"kind": "kind_ok", "note": "pitch_ok", "waveform": "waveform_ok", "envelope": "envelope_ok",
      "direction": "direction_ok", "band": "band_ok", "count": "count_ok"}


@pytest.fixture(scope="module")
def scored():
    """PER_KIND fresh seeds of each kind, half from the held-out range, rendered and scored against their captions
    (a failure prints the seeds)."""
    rng = np.random.default_rng(1027)
    chosen = {k: [] for k in S.KINDS}
    while min(map(len, chosen.values())) < PER_KIND:
        for seed in np.concatenate([rng.integers(0, S.TRAIN_SEED_END, 200),
                                    S.HELD_OUT_SEED_START + rng.integers(0, 10**6, 200)]).tolist():
            s = S.sample_sound(seed)
            if len(chosen[s.kind]) < PER_KIND:
                chosen[s.kind].append((seed, s))
    pairs = [p for k in S.KINDS for p in chosen[k]]
    clips = S.render([s for _, s in pairs]).numpy()
    return [(seed, s, clip, score_audio(clip, SR, S.parse_caption(S.caption(s)), S.TABLES))
            for (seed, s), clip in zip(pairs, clips)]


def test_accuracy_on_rendered_clips(scored):
    for kind, attrs in ATTRS.items():
        rows = [r for r in scored if r[1].kind == kind]
        assert len(rows) >= 200
        for attr in attrs:
            wrong = [(seed, r[attr], getattr(s, attr)) for seed, s, _, r in rows if r[OK[attr]] is not True]
            assert len(wrong) <= 0.02 * len(rows), (kind, attr, wrong)
        # Attributes of other kinds are not named, so not scored.
        assert all(r[OK[a]] is None for *_, r in rows for a in OK if a not in attrs)
    assert np.mean([r["adherence"] for *_, r in scored]) >= 0.98


def test_pitch_is_within_a_few_cents_on_notes(scored):
    cents = [abs(r["pitch_cents"]) for _, s, _, r in scored if s.kind == "note" and r["pitch_cents"] is not None]
    assert len(cents) >= 0.98 * PER_KIND and np.percentile(cents, 98) < 10


def test_onset_times_match_the_sounds(scored):
    for seed, s, _, r in scored:
        if s.kind == "clicks":
            assert len(r["onset_times"]) == s.count, seed
            assert np.allclose(r["onset_times"], s.click_times, atol=0.003), seed
        else:
            assert abs(r["onset_times"][0] - s.onset) < 0.01, (seed, r["onset_times"], s.onset)


def test_a_wrong_caption_is_caught(scored):
    swap = {"direction": {"rising": "falling", "falling": "rising"}, "envelope": {"pluck": "pad", "pad": "pluck"}}
    for kind in S.KINDS:
        for _, s, clip, _ in [r for r in scored if r[1].kind == kind][:8]:
            other = {"kind": next(k for k in S.KINDS if k != kind)}
            if kind == "note":
                k = list(S.NOTES).index(s.note)
                other.update(note=list(S.NOTES)[k + 1 if k + 1 < len(S.NOTES) else k - 1],
                             waveform=next(w for w in S.WAVEFORMS if w != s.waveform),
                             envelope=swap["envelope"][s.envelope])
            elif kind == "chirp":
                other["direction"] = swap["direction"][s.direction]
            elif kind == "noise":
                other["band"] = next(b for b in S.BANDS if b != s.band)
            else:
                other["count"] = s.count + 1
            r = score_audio(clip, SR, other, S.TABLES)
            assert r["adherence"] == 0.0, (kind, other, {a: r[a] for a in other})


def _jittered_sweep(rng, rising: bool) -> np.ndarray:
    """A 0.5 s exponential sweep whose frequency jumps by a random 0.06 octave (sd) every 10 ms, as the finest
    scales of a generated chirp make its peak wander: heard as a rising or falling warble."""
    n = SR // 2
    t = np.arange(n) / SR
    lo, hi = rng.uniform(250, 400), rng.uniform(1000, 1800)
    start, end = (lo, hi) if rising else (hi, lo)
    log_f = np.log2(start) + np.log2(end / start) * t / 0.5 + rng.normal(0, 0.06, 50)[(t // 0.01).astype(int)]
    clip = np.zeros(SR)
    begin = int(rng.uniform(0.05, 0.3) * SR)
    clip[begin:begin + n] = 0.7 * np.sin(2 * np.pi * np.cumsum(2 ** log_f) / SR)
    return clip


def test_a_longer_glide_step_finds_a_jittered_sweep():
    rng = np.random.default_rng(1102)
    lagged = Thresholds(glide_lag=8)
    for k in range(8):
        direction = S.DIRECTIONS[k % 2]
        clip = _jittered_sweep(rng, direction == "rising")
        named = {"kind": "chirp", "direction": direction}
        assert score_audio(clip, SR, named, S.TABLES)["direction"] is None  # 10 ms steps: the jitter wins
        r = score_audio(clip, SR, named, S.TABLES, lagged)
        assert r["direction"] == direction and r["kind"] == "chirp", (direction, r["glide_oct_per_s"])


def test_a_longer_glide_step_keeps_rendered_clips_and_noise(scored):
    # The same 2% allowance as at lag 1 (test_accuracy_on_rendered_clips): a short noise burst can, rarely, show
    # a falling peak over 80 ms steps (seed 1767214, "a short low noise burst", 15 steps; 0 of 2,000 other noise
    # clips and 0 of 2,000 chirps were wrong at lag 8).
    lagged = Thresholds(glide_lag=8)
    for kind, attrs in ATTRS.items():
        rows = [r for r in scored if r[1].kind == kind][:100]
        wrong = []
        for seed, s, clip, _ in rows:
            r = score_audio(clip, SR, s.named, S.TABLES, lagged)
            if not ((all(r[OK[a]] for a in attrs) or kind == "note")
                    and (r["direction"] is not None) == (kind == "chirp")):
                wrong.append((seed, {a: r[a] for a in attrs}, r["glide_oct_per_s"]))
        assert len(wrong) <= 0.02 * len(rows), (kind, wrong)
    rng = np.random.default_rng(1127)
    for _ in range(10):
        r = score_audio((0.3 * rng.standard_normal(SR)).clip(-1, 1), SR, None, S.TABLES, lagged)
        assert r["kind"] == "noise" and r["direction"] is None


def test_an_octave_or_a_semitone_off_fails_pitch_ok():
    base = next(s for s in map(S.sample_sound, range(100)) if s.kind == "note")
    s = dataclasses.replace(base, note="A4", waveform="sine", second=None)
    clip = S.render(s)[0].numpy()
    for note, ok in (("A4", True), ("A3", False), ("A5", False), ("Bb4", False), ("Ab4", False)):
        assert score_audio(clip, SR, {"note": note}, S.TABLES)["pitch_ok"] is ok, note
    # The tolerance is in cents around the named note: 30 cents sharp still passes, 70 does not.
    t = np.arange(SR) / SR
    for cents, ok in ((30, True), (-30, True), (70, False), (-70, False)):
        tone = 0.5 * np.sin(2 * np.pi * 440 * 2 ** (cents / 1200) * t) * (t > 0.1)
        assert score_audio(tone, SR, {"note": "A4"}, S.TABLES)["pitch_ok"] is ok, cents


def test_white_noise_and_silence():
    rng = np.random.default_rng(1147)
    captions = [S.parse_caption(S.caption(S.sample_sound(s))) for s in rng.integers(0, S.TRAIN_SEED_END, 40).tolist()]
    adherence = []
    for named in captions:
        r = score_audio((0.3 * rng.standard_normal(SR)).clip(-1, 1), SR, named, S.TABLES)
        assert r["found"] and r["kind"] == "noise" and r["pitch_hz"] is None
        adherence.append(r["adherence"])
    assert np.mean(adherence) < 0.5  # near chance: only a noise caption naming the high band fits white noise
    for wave in (np.zeros(SR), 1e-6 * rng.standard_normal(SR)):
        r = score_audio(wave, SR, captions[0], S.TABLES)
        assert not r["found"] and r["adherence"] is None and r["onset_times"] == []
        assert all(r[f] is None for f in OK.values())


def test_yin_on_pure_tones_within_5_cents():
    rng = np.random.default_rng(1162)
    for f in rng.uniform(80, 2000, 12):
        t = np.arange(SR // 2) / SR
        x = rng.uniform(0.1, 1.0) * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
        _, f0, aperiodicity = yin(x, SR)
        assert np.abs(1200 * np.log2(f0 / f)).max() < 5, f
        assert aperiodicity.max() < 0.1


def test_windows_and_json():
    s = next(s for s in map(S.sample_sound, range(100)) if s.kind == "note")
    r = score_audio(S.render(s)[0].numpy(), SR, s.named, S.TABLES)
    assert [(w["start_s"], w["end_s"]) for w in r["windows"]] == [(0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)]
    first = int(s.onset // 0.25)
    assert r["windows"][first]["onsets"] >= 1 and r["windows"][first]["pitch_hz"] is not None
    json.dumps(r)  # plain values only, ready for a report


def test_score_audio_errors_name_the_problem():
    clip = np.zeros(SR, np.float32)
    with pytest.raises(ValueError, match=r"float waveform shaped \[samples\]"):
        score_audio(np.zeros((2, SR)), SR, None, S.TABLES)
    with pytest.raises(ValueError, match="float waveform"):
        score_audio(np.zeros(SR, np.int16), SR, None, S.TABLES)
    with pytest.raises(ValueError, match="NaN or inf"):
        score_audio(np.full(SR, np.nan), SR, None, S.TABLES)
    with pytest.raises(ValueError, match="sample_rate must be an int"):
        score_audio(clip, 24000.0, None, S.TABLES)
    with pytest.raises(ValueError, match="note 'H4' is not one of"):
        score_audio(clip, SR, {"kind": "note", "note": "H4"}, S.TABLES)
    with pytest.raises(ValueError, match="attribute 'colour' is not one of"):
        score_audio(clip, SR, {"colour": "red"}, S.TABLES)
    with pytest.raises(ValueError, match="SoundTables"):
        score_audio(clip, SR, None, {"notes": S.NOTES})
    with pytest.raises(ValueError, match="band 'low' must be"):
        SoundTables(notes=S.NOTES, bands={"low": (500.0, 80.0)})
    with pytest.raises(ValueError, match="fmin < fmax"):
        Thresholds(fmin=500.0, fmax=100.0)
    with pytest.raises(ValueError, match="glide_lag must be an int >= 1"):
        Thresholds(glide_lag=0)
