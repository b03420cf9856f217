"""The compressed KV store (`mmkv.cache`): one test per property of the contract, run over every registered codec."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import mmkv.codecs as codecs
from mmkv.cache import CacheConfig, Geometry, KVCacheError, KVStore, fit_attention_window, simulate_peak_nbytes
from mmkv.codecs import Codec, CodecConfig, Encoded, build, get_codec_class, kv_configs, registered
from mmkv.codecs.checks import inputs_checked

L, H, D = 3, 2, 32
BATCH = 2  # like AAR's cond/uncond rows
UNIT = 4  # tokens per unit
VALUE_GROUP = 16
# Every registered codec, at a preset sized for these 4-token units: a span codec amortises a per-span codebook over
# the span (QVG's default 256 bf16 centres cost 256 * 16 / N bits a value), which 4-12-token test
# spans cannot; its default preset is covered at realistic span lengths in test_codec_qvg.py.
SMALL_SPAN_PRESETS = {"qvg": "qvg:centroids=2,block=16"}
ALL_CODECS = [SMALL_SPAN_PRESETS.get(name, name) for name in codecs.names()]


pytestmark = pytest.mark.usefixtures("one_thread")


def rand(gen: torch.Generator, tokens: int, dtype=torch.float32, batch: int = BATCH) -> torch.Tensor:
    return torch.randn(batch, H, tokens, D, generator=gen).to(dtype)


def store_for(codec, **kw) -> KVStore:
    kw.setdefault("value_group", VALUE_GROUP)
    return KVStore(CacheConfig(codec=codec, **kw), num_layers=L, num_heads=H, head_dim=D)


def commit_schedule() -> list[int]:
    """Units per append: mixes single units (frame-wise video, audio scales) and blocks (chunk-wise video)."""
    return [1, 3, 1, 2, 3]


# ----------------------------------------------------------------------------------------------------------------
# Identity codec == native store == SDPA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 1, 2])
def test_identity_bit_exact_with_native_store_and_sdpa(dtype, window):
    gen = torch.Generator().manual_seed(1)
    native, ident = store_for(None, residual_window=window), store_for("identity", residual_window=window)
    ks, vs = [], []
    for n in commit_schedule():
        q, kc, vc = rand(gen, 5, dtype), rand(gen, UNIT * n, dtype), rand(gen, UNIT * n, dtype)
        out_native = native.attend(1, q, kc, vc)
        out_ident = ident.attend(1, q, kc, vc)
        out_sdpa = F.scaled_dot_product_attention(q, torch.cat(ks + [kc], 2), torch.cat(vs + [vc], 2))
        assert torch.equal(out_native, out_ident)
        assert torch.equal(out_ident, out_sdpa)
        # the commit pass: attend (above), then append the block
        native.append(1, kc, vc, num_units=n)
        ident.append(1, kc, vc, num_units=n)
        ks.append(kc)
        vs.append(vc)
    k_past, v_past = ident.past(1)
    assert torch.equal(k_past, torch.cat(ks, 2)) and torch.equal(v_past, torch.cat(vs, 2))
    q = rand(gen, 3, dtype)  # read with no current block (audio: the current scale was appended first)
    assert torch.equal(ident.attend(1, q, scale=0.3), F.scaled_dot_product_attention(q, k_past, v_past, scale=0.3))
    assert ident.stats()["encodes_per_layer"][1] == sum(commit_schedule()) - window


# ----------------------------------------------------------------------------------------------------------------
# Every codec through the store matches its reference decode


def _reference(codec: str, appends: list[tuple[torch.Tensor, torch.Tensor, int]], window: int, layer: int, seed: int):
    """Expected segments of one layer, built without the store: fresh codecs, each unit encoded once when it leaves."""
    k_cfg, v_cfg = kv_configs(codec, VALUE_GROUP)
    kc = build(k_cfg, head_dim=D, num_heads=H, layer=layer, seed=seed)
    vc = build(v_cfg, head_dim=D, num_heads=H, layer=layer, seed=seed)
    span = kc.span_codec or vc.span_codec
    units, segs, native = [], [], []
    for k, v, n in appends:
        per = k.shape[2] // n
        for i in range(n):
            native.append((k[:, :, i * per : (i + 1) * per], v[:, :, i * per : (i + 1) * per]))
        leaving = max(len(native) - window, 0)
        out, native = native[:leaving], native[leaving:]
        groups = [out] if span and out else [[u] for u in out]
        for g in groups:
            segs.append(("enc", kc.encode(torch.cat([u[0] for u in g], 2)), vc.encode(torch.cat([u[1] for u in g], 2))))
    segs += [("nat", k, v) for k, v in native]
    return kc, vc, segs


def _reference_attention(q, kc: Codec, vc: Codec, segs, dtype):
    scale = 1.0 / math.sqrt(D)
    if not kc.has_scores:
        ks = [kc.decode(a, dtype) if t == "enc" else a for t, a, _ in segs]
        vs = [vc.decode(b, dtype) if t == "enc" else b for t, _, b in segs]
        return F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2)), "exact"
    scores = [kc.scores(q, a).float() if t == "enc" else q.float() @ a.float().transpose(-1, -2) for t, a, _ in segs]
    vs = [vc.decode(b, torch.float32) if t == "enc" else b.float() for t, _, b in segs]
    p = torch.softmax(torch.cat(scores, -1) * scale, dim=-1)
    return (p @ torch.cat(vs, 2)).to(dtype), "close"


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_codec_through_store_matches_reference_decode(codec):
    gen = torch.Generator().manual_seed(2)
    window, seed, layer = 1, 7, 2
    store = store_for(codec, residual_window=window, seed=seed)
    appends = []
    for n in commit_schedule():
        k, v = rand(gen, UNIT * n), rand(gen, UNIT * n)
        store.append(layer, k, v, num_units=n)
        appends.append((k, v, n))
    kc, vc, segs = _reference(codec, appends, window, layer, seed)
    k_ref = torch.cat([kc.decode(a, torch.float32) if t == "enc" else a for t, a, _ in segs], 2)
    v_ref = torch.cat([vc.decode(b, torch.float32) if t == "enc" else b for t, _, b in segs], 2)
    k_past, v_past = store.past(layer)
    assert torch.equal(k_past, k_ref) and torch.equal(v_past, v_ref)
    q = rand(gen, 6)
    expected, how = _reference_attention(q, kc, vc, segs, torch.float32)
    out = store.attend(layer, q)
    if how == "exact":
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if codec != "identity":  # a lossy codec must actually change the keys it encoded
        assert not torch.equal(k_past, torch.cat([a for a, _, _ in appends], 2))


# ----------------------------------------------------------------------------------------------------------------
# Encode-once, window, protection


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_each_unit_is_encoded_exactly_once(codec):
    gen = torch.Generator().manual_seed(3)
    window = 2
    store = store_for(codec, residual_window=window)
    seen: list[int] = []
    for layer in range(L):
        for which in (store.k_codec(layer), store.v_codec(layer)):
            original = which.encode

            def counting(x, _orig=original, **kw):
                seen.append(x.shape[2])
                return _orig(x, **kw)

            which.encode = counting
    total = 0
    for n in commit_schedule():
        for layer in range(L):
            store.append(layer, rand(gen, UNIT * n), rand(gen, UNIT * n), num_units=n, first_unit=total)
        total += n
        # every unit older than the window has been encoded, once; none of the window has
        for layer in range(L):
            assert store.encoded_units(layer) == list(range(max(total - window, 0)))
    assert sum(seen) == 2 * L * (total - window) * UNIT  # K and V, every layer, each leaving unit once
    assert store.stats()["encodes_per_layer"] == [total - window] * L


@pytest.mark.parametrize("window", [0, 1, 3])
@pytest.mark.parametrize("units_per_append", [1, 2, 4])
def test_native_window_never_exceeds_residual_window(window, units_per_append):
    gen = torch.Generator().manual_seed(4)
    store = store_for("identity", residual_window=window)
    total = 0
    for _ in range(4):
        store.append(0, rand(gen, UNIT * units_per_append), rand(gen, UNIT * units_per_append), units_per_append)
        total += units_per_append
        assert store.num_native_units(0) == min(window, total)
        assert store.num_units(0) == total and store.num_tokens(0) == total * UNIT


def test_protected_layers_and_units_stay_native():
    gen = torch.Generator().manual_seed(5)
    cfg = dict(residual_window=1, protected_layers=(0, -1), protected_units=2)
    store, native = store_for("groupquant:bits=2,group=16", **cfg), store_for(None)
    assert store.protected_layers == (0, L - 1)
    assert store.k_codec(0) is None and store.v_codec(L - 1) is None and store.k_codec(1) is not None
    units = []
    for n in commit_schedule():
        for layer in range(L):
            k, v = rand(gen, UNIT * n), rand(gen, UNIT * n)
            store.append(layer, k, v, n)
            native.append(layer, k, v, n)
            if layer == 1:
                units.append(k)
    total = sum(commit_schedule())
    assert store.encoded_units(0) == [] and store.encoded_units(L - 1) == []
    assert store.encoded_units(1) == list(range(2, total - 1))
    q = rand(gen, 3)
    for layer in (0, L - 1):  # protected layers: bit-exact with the native store even with a 2-bit codec
        assert torch.equal(store.attend(layer, q), native.attend(layer, q))
    k_past, _ = store.past(1)
    k_true = torch.cat(units, 2)
    assert torch.equal(k_past[:, :, : 2 * UNIT], k_true[:, :, : 2 * UNIT])  # sink units untouched
    assert torch.equal(k_past[:, :, -UNIT:], k_true[:, :, -UNIT:])  # residual window untouched
    assert not torch.equal(k_past[:, :, 2 * UNIT : -UNIT], k_true[:, :, 2 * UNIT : -UNIT])


def test_k_and_v_may_use_different_codecs():
    gen = torch.Generator().manual_seed(6)
    store = store_for("identity/groupquant:bits=4,group=16", residual_window=0)
    assert store.k_codec(1).name == "identity" and store.v_codec(1).name == "groupquant"
    k, v = rand(gen, 2 * UNIT), rand(gen, 2 * UNIT)
    store.append(1, k, v, num_units=2)
    k_past, v_past = store.past(1)
    assert torch.equal(k_past, k)
    assert not torch.equal(v_past, v) and (v_past - v).abs().max() < 0.5
    stats = store.stats()
    assert stats["k_effective_bits"] == 32.0  # fp32 keys stored as they are
    assert stats["v_effective_bits"] == 4.0 + 32 / 16  # 4-bit codes + fp16 scale and min per 16 channels


# ----------------------------------------------------------------------------------------------------------------
# Bytes


def _held_bytes(store: KVStore) -> tuple[int, int]:
    held, tokens = 0, 0
    for layer in range(L):
        for seg in store.segments(layer):
            if seg.encoded:
                held += seg.k_enc.nbytes + seg.v_enc.nbytes
            else:
                held += seg.k.numel() * seg.k.element_size() + seg.v.numel() * seg.v.element_size()
            tokens += seg.num_tokens
    return held, tokens


@pytest.mark.parametrize("codec", ALL_CODECS + [None])
def test_nbytes_counts_what_is_held(codec):
    gen = torch.Generator().manual_seed(8)
    store = store_for(codec, residual_window=1)
    for n in commit_schedule():
        for layer in range(L):
            store.append(layer, rand(gen, UNIT * n, torch.bfloat16), rand(gen, UNIT * n, torch.bfloat16), n)
        held, tokens = _held_bytes(store)
        assert store.nbytes() == held
        assert store.bf16_nbytes() == 2 * 2 * BATCH * H * D * tokens
        assert store.kv_ratio == pytest.approx(store.bf16_nbytes() / held)
    stats = store.stats()
    assert stats["k_payload_nbytes"] + stats["v_payload_nbytes"] + stats["native_nbytes"] == store.nbytes()
    if codec in (None, "identity"):
        assert stats["codec_state_nbytes"] == 0  # nothing per layer besides the units themselves
    if codec is None:
        assert store.kv_ratio == 1.0  # bf16 in, bf16 held
    elif codec != "identity":
        assert store.kv_ratio > 1.0 and stats["k_effective_bits"] < 16


def test_peak_within_native_over_kv_ratio_plus_one_layer_scratch():
    gen = torch.Generator().manual_seed(9)
    native, store = store_for(None), store_for("groupquant:bits=2,group=16", residual_window=1)
    last = 0
    for n in commit_schedule():
        for layer in range(L):
            k, v = rand(gen, UNIT * n, torch.bfloat16), rand(gen, UNIT * n, torch.bfloat16)
            for s in (native, store):
                s.attend(layer, rand(gen, 2, torch.bfloat16), k, v)
                s.append(layer, k, v, n)
            assert store.peak_nbytes >= max(store.nbytes(), last)
            last = store.peak_nbytes
    assert native.peak_nbytes == native.nbytes()
    assert store.peak_nbytes <= native.nbytes() / store.kv_ratio + store.scratch_peak_nbytes
    # the scratch is one layer's past in the store dtype plus, on the torch reference path, the decode of its encoded
    # part (joined into one segment by merge_units): at most two layers' worth, not the whole model's
    assert store.scratch_peak_nbytes <= 2 * native.nbytes() / L + 2 * 2 * BATCH * H * D * 3 * UNIT


def test_reset_starts_a_new_rollout():
    gen = torch.Generator().manual_seed(10)
    store = store_for("groupquant:bits=3,group=16")
    data = [(rand(gen, UNIT * n), rand(gen, UNIT * n), n) for n in commit_schedule()]
    q = rand(gen, 4)

    def rollout():
        for k, v, n in data:
            store.append(0, k, v, n)
        return store.attend(0, q), store.stats()

    first, first_stats = rollout()
    store.reset()
    assert store.nbytes() == 0 and store.bf16_nbytes() == 0 and store.peak_nbytes == 0
    assert store.num_units(0) == 0 and store.encoded_units(0) == []
    with pytest.raises(KVCacheError, match="holds nothing"):
        store.attend(0, q)
    second, second_stats = rollout()
    assert torch.equal(first, second) and first_stats == second_stats


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_store_is_deterministic_and_leaves_global_rng_alone(codec):
    gen = torch.Generator().manual_seed(11)
    data = [(rand(gen, UNIT * n), rand(gen, UNIT * n), n) for n in commit_schedule()]
    q = rand(gen, 3)
    outs = []
    state = torch.get_rng_state()
    for _ in range(2):
        store = store_for(codec, seed=3)
        for k, v, n in data:
            store.append(1, k, v, n)
        outs.append(store.attend(1, q))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(outs[0], outs[1])


# ----------------------------------------------------------------------------------------------------------------
# Rolling window, sinks, span codecs


def test_rolling_window_keeps_sinks_and_newest_units():
    gen = torch.Generator().manual_seed(12)
    store = store_for("identity", residual_window=1, attention_window=2, sink_units=1)
    units = []
    for n in (1, 2, 3):
        k, v = rand(gen, UNIT * n), rand(gen, UNIT * n)
        store.append(0, k, v, n)
        units += list(k.split(UNIT, dim=2))
    assert store.num_units(0) == 3  # sink 0, then units 4 and 5
    k_past, _ = store.past(0)
    assert torch.equal(k_past, torch.cat([units[0], units[4], units[5]], 2))
    # units 1..3 were evicted; 2 and 3 arrived and left in the same append, so they were never encoded
    assert store.encoded_units(0) == [0, 1, 4]
    assert store.stats()["evicted_units_per_layer"][0] == 3
    held, _ = _held_bytes(store)
    assert store.nbytes() == held


@pytest.fixture
def span_codec():
    """A toy span codec (per-channel span mean in fp32 + bf16 residuals): its encoding of a unit depends on the
    other units of the span, like QVG's k-means."""

    class SpanMean(Codec):
        config_class = CodecConfig.named("test-span-mean")
        span_codec = True

        @classmethod
        def value_config(cls, config, group=32):
            return config

        def _encode(self, x):
            mean = x.mean(dim=-2, keepdim=True)
            return Encoded(self.name, (), x.dtype, {"mean": mean, "res": (x - mean).bfloat16()})

        def _decode(self, enc):
            return enc.tensors["res"].float() + enc.tensors["mean"]

    with registered(SpanMean):
        yield SpanMean


def test_span_codec_encodes_each_commit_jointly(span_codec):
    gen = torch.Generator().manual_seed(13)
    store = store_for("test-span-mean", residual_window=1)
    appends = []
    for n in (3, 3, 1, 2):
        k, v = rand(gen, UNIT * n), rand(gen, UNIT * n)
        store.append(0, k, v, n)
        appends.append((k, v, n))
    # commits release units {0,1}, {2,3,4}, {5}, {6,7}: one "commit span" each
    assert store.stats()["encode_calls_per_layer"][0] == 4
    assert [s.k_enc.shape[2] for s in store.segments(0) if s.encoded] == [2 * UNIT, 3 * UNIT, UNIT, 2 * UNIT]
    kc, vc, segs = _reference("test-span-mean", appends, 1, 0, 0)
    k_ref = torch.cat([kc.decode(a) if t == "enc" else a for t, a, _ in segs], 2)
    assert torch.equal(store.past(0)[0], k_ref)


def test_span_units_wait_native_and_rolling_window_trims_spans(span_codec):
    span_codec.span_units = 3
    gen = torch.Generator().manual_seed(14)
    store = store_for("test-span-mean", residual_window=1, attention_window=4)
    assert store.span_units == 3
    units = []
    for n in (1, 1, 1, 1, 1, 1):
        k, v = rand(gen, UNIT), rand(gen, UNIT)
        store.append(0, k, v, n)
        units.append(k)
    # units 0-2 left the window by the 4th append and were encoded as one span; 3, 4 wait for their span; 5 is the
    # window. The rolling window (4 units) hides units 0 and 1 while their span stays held for unit 2.
    assert store.encoded_units(0) == [0, 1, 2]
    assert store.num_units(0) == 4 and store.num_native_units(0) == 3
    k_past, _ = store.past(0)
    assert torch.equal(k_past[:, :, UNIT:], torch.cat(units[3:], 2))
    torch.testing.assert_close(k_past[:, :, :UNIT], units[2], atol=0.05, rtol=0)
    assert store.bf16_nbytes() == 2 * 2 * BATCH * H * D * 4 * UNIT


def test_qvg_spans_keep_protected_units_native_and_never_straddle_sinks():
    gen = torch.Generator().manual_seed(15)
    preset = "qvg:centroids=2,block=16"
    store = store_for(preset, residual_window=1, protected_units=2, attention_window=5, sink_units=3)
    ks = []
    for n in (3, 3, 3):
        k, v = rand(gen, UNIT * n), rand(gen, UNIT * n)
        store.append(0, k, v, n)
        ks += list(k.split(UNIT, dim=2))
    segs = store.segments(0)
    # units 0, 1 protected (native, bit-identical), unit 8 native in the residual window
    assert [s.encoded for s in segs[:2]] == [False, False]
    assert torch.equal(segs[0].k, ks[0]) and torch.equal(segs[1].k, ks[1])
    spans = [(s.k_enc.shape[2] // UNIT, s.skip_tokens // UNIT) for s in segs if s.encoded]
    # the commit of units 2-4 split at the sink boundary: {2} (a sink, never evicted) and {3, 4}, whose unit 3 the
    # window has since evicted (hidden, still held for unit 4); then the commit span {5, 6, 7}
    assert spans == [(1, 0), (2, 1), (3, 0)] and store.encoded_units(0) == [2, 3, 4, 5, 6, 7]
    assert store.num_units(0) == 3 + 5 and torch.equal(store.past(0)[0][:, :, -UNIT:], ks[-1])


@pytest.mark.parametrize(
    "codec, sinks", [(None, 1), ("groupquant:bits=2,group=16", 1), ("qvg:centroids=2,block=16", 0)]
)
def test_rolling_window_as_long_as_the_rollout_is_the_global_cache(codec, sinks):
    # (a span codec with sinks splits its spans at the sink boundary, see the test above, so it is compared without)
    gen = torch.Generator().manual_seed(16)
    data = [(rand(gen, UNIT * n), rand(gen, UNIT * n), n) for n in commit_schedule()]
    total = sum(commit_schedule())
    full, rolling = store_for(codec), store_for(codec, attention_window=total, sink_units=sinks)
    q = rand(gen, 3)
    for k, v, n in data:
        for s in (full, rolling):
            s.append(0, k, v, n)
        assert torch.equal(full.attend(0, q, k, v), rolling.attend(0, q, k, v))
    assert rolling.stats()["evicted_units_per_layer"][0] == 0 and rolling.nbytes() == full.nbytes()


# ----------------------------------------------------------------------------------------------------------------
# Equal-memory planning


def _rollout_peak(cfg: CacheConfig, schedule, seed: int) -> int:
    """A rollout's peak: each block attends to the past with its own K/V, then is committed."""
    gen = torch.Generator().manual_seed(seed)
    store = KVStore(cfg, num_layers=L, num_heads=H, head_dim=D)
    for n in schedule:
        for layer in range(L):
            k, v = rand(gen, UNIT * n, torch.bfloat16), rand(gen, UNIT * n, torch.bfloat16)
            store.attend(layer, rand(gen, UNIT * n, torch.bfloat16), k, v)
            store.append(layer, k, v, n)
    return store.peak_nbytes


@pytest.mark.parametrize("codec", [None, "identity", "groupquant:bits=2,group=16", "qvg:centroids=2,block=16",
                                   "octopus:b=2"])
@pytest.mark.parametrize("window, sinks, protected", [(None, 0, 0), (4, 0, 0), (3, 2, 2)])
def test_simulated_peak_equals_the_real_rollouts_and_stays_flat_with_a_window(codec, window, sinks, protected):
    cfg = CacheConfig(codec=codec, value_group=VALUE_GROUP, attention_window=window, sink_units=sinks,
                      protected_units=protected)
    peaks = []
    for blocks in (3, 6, 9):
        schedule = (3,) * blocks
        real = _rollout_peak(cfg, schedule, seed=blocks)
        geometry = Geometry(L, H, D, UNIT, schedule, batch=BATCH, dtype=torch.bfloat16)
        assert simulate_peak_nbytes(cfg, geometry) == real
        peaks.append(real)
    if window is None:
        assert peaks[0] < peaks[1] < peaks[2]  # a global cache grows with the rollout
    else:
        assert peaks[1] == peaks[2]  # a rolling window: flat once it is full


@pytest.mark.parametrize("codec", ["octopus:b=2", "qvg:centroids=2,block=16"])
def test_the_planner_leaves_the_codecs_untouched(codec, monkeypatch):
    """`simulate_peak_nbytes` measures bytes through `MeasuredCodec`, a wrapper: every codec its store builds keeps
    the attributes it was built with, nothing is set on it from outside (no instance `encode`; only the codec's own
    lazy caches may appear, filled by its real probe encodes), and the peak is still the real rollout's."""
    import mmkv.cache.store as store_mod

    real_build, built = store_mod.build, []

    def recording_build(*args, **kwargs):
        codec = real_build(*args, **kwargs)
        built.append((codec, dict(vars(codec))))
        return codec

    monkeypatch.setattr(store_mod, "build", recording_build)
    cfg = CacheConfig(codec=codec, value_group=VALUE_GROUP)
    geometry = Geometry(L, H, D, UNIT, (3, 1, 2), batch=BATCH, dtype=torch.bfloat16)
    peak = simulate_peak_nbytes(cfg, geometry)
    assert len(built) == 2 * L
    for c, attrs in built:
        assert all(vars(c)[k] is v for k, v in attrs.items())
        assert "encode" not in vars(c) and "decode" not in vars(c) and c.encode.__func__ is type(c).encode
    monkeypatch.undo()
    assert peak == _rollout_peak(cfg, (3, 1, 2), seed=5)


def test_fit_attention_window_gives_each_codec_the_longest_window_in_the_budget():
    schedule = (3,) * 8
    geometry = Geometry(L, H, D, UNIT, schedule, batch=BATCH, dtype=torch.bfloat16)
    per_unit = 2 * 2 * BATCH * H * D * UNIT * L  # bf16 K + V of one unit over all layers
    budget = 4 * per_unit
    windows = {}
    state = torch.get_rng_state()
    for codec in (None, "groupquant:bits=4,group=16", "groupquant:bits=2,group=16"):
        cfg = CacheConfig(codec=codec, value_group=VALUE_GROUP)
        fit = fit_attention_window(cfg, geometry, budget, sink_units=1)
        assert fit.attention_window is not None and fit.peak_nbytes <= budget
        fitted = dataclasses.replace(cfg, attention_window=fit.attention_window, sink_units=1)
        real = _rollout_peak(fitted, schedule, 1)
        assert real == fit.peak_nbytes <= budget  # measured bytes never exceed the budget
        longer = dataclasses.replace(fitted, attention_window=fit.attention_window + 1)
        assert _rollout_peak(longer, schedule, 1) > budget  # and one more unit would
        windows[codec] = fit.attention_window
    assert torch.equal(torch.get_rng_state(), state)
    assert windows[None] == 4 - 1  # native: 4 units of budget, one of them the sink
    assert windows[None] < windows["groupquant:bits=4,group=16"] < windows["groupquant:bits=2,group=16"]
    # the whole rollout fits: global attention
    assert fit_attention_window(CacheConfig(codec=None), geometry, 24 * per_unit).attention_window is None
    with pytest.raises(KVCacheError, match="smallest rolling window"):
        fit_attention_window(CacheConfig(codec=None), geometry, per_unit, sink_units=1)


def test_fit_attention_window_finds_the_longest_fit_past_a_span_bump():
    # span_units=3 with 3-unit commits and 2 sinks: at short windows units waiting native for their span are evicted
    # before it fills, so a 4-unit window peaks below a 3-unit one. The fit must still return the longest that fits.
    geometry = Geometry(2, H, D, 6, (3,) * 6, batch=1, dtype=torch.bfloat16)
    cfg = CacheConfig(codec="qvg:centroids=4,block=16,span_units=3", value_group=VALUE_GROUP)
    memo: dict = {}
    peaks = {w: simulate_peak_nbytes(dataclasses.replace(cfg, attention_window=w, sink_units=2), geometry, memo=memo)
             for w in range(1, 18)}
    assert any(peaks[w + 1] < peaks[w] for w in range(1, 17))  # the bump exists
    for budget in sorted(set(peaks.values()))[:4]:
        fit = fit_attention_window(cfg, geometry, budget, sink_units=2, memo=memo)
        assert fit.attention_window == max(w for w, p in peaks.items() if p <= budget)
        assert fit.peak_nbytes == peaks[fit.attention_window] <= budget


# ----------------------------------------------------------------------------------------------------------------
# Errors


def _written_store():
    store = store_for("identity")
    store.append(0, torch.randn(BATCH, H, UNIT, D), torch.randn(BATCH, H, UNIT, D))
    return store


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.append(0, torch.randn(BATCH, H, UNIT, D), torch.randn(BATCH, H, UNIT + 1, D)), "differs from k shape"),
        (lambda s: s.append(0, torch.randn(BATCH, H, UNIT, D), torch.randn(BATCH, H, UNIT, D).double()), "dtype"),
        (lambda s: s.append(0, torch.randn(BATCH, H, UNIT, D).half(), torch.randn(BATCH, H, UNIT, D).half()),
         "differs from the stored units' dtype"),
        (lambda s: s.append(0, torch.randn(1, H, UNIT, D), torch.randn(1, H, UNIT, D)), "batch 1 differs"),
        (lambda s: s.append(1, torch.randn(BATCH, UNIT, H, D), torch.randn(BATCH, UNIT, H, D)), "transpose"),
        (lambda s: s.append(1, torch.randn(BATCH, H, UNIT, D + 1), torch.randn(BATCH, H, UNIT, D + 1)), "must be"),
        (lambda s: s.append(1, torch.randn(BATCH, H, 5, D), torch.randn(BATCH, H, 5, D), num_units=2), "evenly"),
        (lambda s: s.append(1, torch.randn(BATCH, H, 4, D), torch.randn(BATCH, H, 4, D), num_units=0), "num_units"),
        (lambda s: s.append(0, torch.randn(BATCH, H, 4, D), torch.randn(BATCH, H, 4, D), first_unit=0), "out of order"),
        (lambda s: s.append(1, torch.randn(BATCH, H, 4, D), torch.randn(BATCH, H, 4, D), first_unit=3), "out of order"),
        (lambda s: s.append(L, torch.randn(BATCH, H, 4, D), torch.randn(BATCH, H, 4, D)), "layer must be"),
        (lambda s: s.attend(1, torch.randn(BATCH, H, 2, D)), "never written"),
        (lambda s: s.past(2), "never written"),
        (lambda s: s.attend(0, torch.randn(BATCH, H, 2, D + 1)), "q must be"),
        (lambda s: s.attend(0, torch.randn(BATCH, H, 2, D).double()), "q dtype"),
        (lambda s: s.attend(0, torch.randn(BATCH, H, 2, D), k_cur=torch.randn(BATCH, H, 2, D)), "both k_cur"),
        (lambda s: s.attend(0, torch.randn(BATCH, H, 2, D), scale=-1.0), "scale"),
    ],
)
def test_bad_input_gets_a_clear_error(call, match):
    with pytest.raises(KVCacheError, match=match):
        call(_written_store())


def test_failed_encode_leaves_the_store_unchanged():
    gen = torch.Generator().manual_seed(16)
    store = store_for("groupquant:bits=2,group=16", residual_window=0)
    store.append(0, rand(gen, UNIT), rand(gen, UNIT))
    before = (store.nbytes(), store.num_units(0), store.encoded_units(0), store.stats())
    k = rand(gen, UNIT)
    k[0, 1, 2, 3] = float("nan")
    with pytest.raises(KVCacheError, match=r"encoding units \[1\] failed; nothing was stored.*NaN"):
        store.append(0, k, rand(gen, UNIT))
    assert (store.nbytes(), store.num_units(0), store.encoded_units(0), store.stats()) == before
    store.append(0, rand(gen, UNIT), rand(gen, UNIT), first_unit=1)  # the rollout goes on from where it was
    assert store.encoded_units(0) == [0, 1]


def test_one_finiteness_scan_per_append_and_nan_still_named(monkeypatch):
    """The store scans the units it encodes for NaN/Inf once per append (one host sync on CUDA) and tells the codecs
    not to scan again; a NaN in a native unit that leaves the window later is still refused by name."""
    gen = torch.Generator().manual_seed(17)
    store = store_for("groupquant:bits=2,group=16", residual_window=1)
    flags: list[bool] = []
    for which in (store.k_codec(0), store.v_codec(0)):
        original = which.encode

        def spy(x, _orig=original):
            flags.append(inputs_checked())
            return _orig(x)

        which.encode = spy
    store.append(0, rand(gen, 3 * UNIT), rand(gen, 3 * UNIT), num_units=3)
    assert flags == [True] * 2  # units 0 and 1 left the window, one merged call for K and one for V, no scan
    v = rand(gen, UNIT)
    v[0, 0, 0, 0] = float("inf")
    store.append(0, rand(gen, UNIT), v)  # unit 3 stays native for now: nothing is encoded, nothing scanned
    with pytest.raises(KVCacheError, match=r"encoding units \[3\] failed; nothing was stored.*NaN/Inf"):
        store.append(0, rand(gen, UNIT), rand(gen, UNIT))
    assert flags[-1] is False  # the scan found it, and the codec's own check named it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finiteness_scan_flags_exactly_the_nonfinite(dtype):
    """`nonfinite` (a float64 sum a tensor): finite values at the dtype's largest magnitude never read as NaN/Inf,
    and one NaN, +inf or -inf (or +inf and -inf together, whose sum is NaN) in any tensor of any unit does."""
    from mmkv.cache.checks import nonfinite
    from mmkv.cache.segments import Seg

    big = torch.finfo(dtype).max
    k = torch.full((1, 2, 64, 32), big, dtype=dtype)
    v = torch.full((1, 2, 64, 32), -big, dtype=dtype)
    natives = {0: Seg(0, (64,), k=k, v=v)}
    assert not bool(nonfinite([0], natives, {}))
    assert not bool(nonfinite([0, 1, 2], natives, {1: (k, k), 2: (v, v)}))  # many tensors: stacked
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        w = v.clone()
        for i, x in enumerate(bad):
            w.view(-1)[7 + i] = x
        assert bool(nonfinite([0], {0: Seg(0, (64,), k=k, v=w)}, {})), bad
        assert bool(nonfinite([0, 1], natives, {1: (w, k)})), bad
    assert nonfinite([], natives, {}) is None


@pytest.mark.parametrize("codec", ["octopus:b=2", "turboquant-mse:b=2", "identity", "kivi:bits=2,group=32",
                                   "oscar:bits=2,group=32"])
def test_merged_units_decode_bit_identical_to_unit_by_unit(codec):
    """merge_units: a token-local codec encodes the run of units leaving the window in one call, and the past it
    serves is bit-identical to unit-by-unit encoding. Codecs grouping over tokens (KIVI / OScaR keys) encode unit by
    unit, and their encoded units are stacked (`stack_units`) into one segment decoded in one call per K and V."""
    gen = torch.Generator().manual_seed(18)
    unit = 8  # tokens: every packed row of a unit ends on a byte, so the encoded past can also be joined
    blocks = [(rand(gen, 3 * unit), rand(gen, 3 * unit)) for _ in range(4)]
    q = rand(gen, 2)
    stores = {m: store_for(codec, residual_window=1, merge_units=m) for m in (True, False)}
    for store in stores.values():
        for k, v in blocks:
            for layer in range(L):
                store.append(layer, k, v, num_units=3)
    merged, single = stores[True], stores[False]
    local = merged.k_codec(0).token_local and merged.v_codec(0).token_local
    assert local == (codec.split(":")[0] not in ("kivi", "oscar"))
    assert merged.stack == (not local) and not single.stack and not merged.merge == (not local)
    for layer in range(L):
        assert merged.encoded_units(layer) == single.encoded_units(layer) == list(range(11))
        # a run per append (token-local) or a unit each, joined into one encoded segment when attention reads them,
        # then the native frame
        assert len(merged._layers[layer].segs) == (4 + 1 if local else 12)
        segs = merged.segments(layer)
        assert len(segs) == 2 and segs[0].stack == (1 if local else 11)
        assert len(merged._layers[layer].segs) == 2
        assert len(single.segments(layer)) == 12
        for a, b in zip(merged.past(layer), single.past(layer)):
            assert torch.equal(a, b)
        assert torch.equal(merged.attend(layer, q), single.attend(layer, q))
    assert single.stats()["encode_calls_per_layer"] == [11] * L
    assert merged.stats()["encode_calls_per_layer"] == [4 if local else 11] * L
    # packed sizes may differ by a unit's byte padding, no more; joining segments never changes them
    assert abs(merged.nbytes() - single.nbytes()) <= L * 2 * 12 * BATCH * H
    if not local:
        assert merged.nbytes() == single.nbytes()  # the same unit-by-unit encodings, stacked
    assert merged.nbytes() == sum(s.nbytes for st in merged._layers for s in st.segs)


@pytest.mark.parametrize("codec", ["octopus:b=3", "tcq:bits=2,hi=5,norm=32"])
def test_units_whose_packed_rows_end_inside_a_byte_join_into_one_segment(codec, monkeypatch):
    """Scales of 1-5 tokens, as the AAR's (OCTOPUS b=3 keys: 11 triplets of 7 bits, 77 bits a token; TCQ with 5
    wide steps: 37 bits a token): attention still decodes the encoded past in one call per K and V, the join
    being what one encode of all those tokens stores, so the store then holds fewer bytes than unit by unit (the
    padding of each unit's last byte) and counts them; the past is bit-identical to unit-by-unit storage."""
    gen = torch.Generator().manual_seed(29)
    sizes = [1, 2, 3, 5, 4, 1]
    blocks = [(rand(gen, t), rand(gen, t)) for t in sizes]
    stores = {m: store_for(codec, residual_window=1, merge_units=m) for m in (True, False)}
    calls = []
    for codec_ in (stores[True].k_codec(0), stores[True].v_codec(0)):
        real = codec_.decode
        monkeypatch.setattr(codec_, "decode", lambda enc, *a, _r=real, **kw: calls.append(enc.shape) or _r(enc, *a, **kw))
    merged, single = stores[True], stores[False]
    for k, v in blocks:
        for layer in range(L):
            q = rand(gen, 2)
            before = len(calls)
            got = merged.attend(layer, q, k, v)
            if layer == 0 and merged.num_units(0) >= 3:  # two or more encoded units behind the native one
                assert len(calls) - before == 2  # the whole encoded past: one call for K, one for V
            assert torch.equal(got, single.attend(layer, q, k, v))
            for store in (merged, single):
                store.append(layer, k, v)
    for layer in range(L):
        assert len(merged.segments(layer)) == 2 and len(single.segments(layer)) == len(sizes)
        for a, b in zip(merged.past(layer), single.past(layer)):
            assert torch.equal(a, b)
    k_codec = merged.k_codec(0)
    past_tokens = torch.cat([k for k, _ in blocks[:-1]], 2)
    one_encode = k_codec.encode(past_tokens).nbytes
    assert merged._layers[0].segs[0].k_enc.nbytes == one_encode
    assert merged.nbytes() < single.nbytes()
    assert merged.nbytes() == sum(s.nbytes for st in merged._layers for s in st.segs)
    stats = merged.stats()
    assert stats["k_payload_nbytes"] == sum(s.k_nbytes for st in merged._layers for s in st.segs if s.encoded)
    assert stats["v_payload_nbytes"] == sum(s.v_nbytes for st in merged._layers for s in st.segs if s.encoded)


@pytest.mark.parametrize("codec", ["kivi:bits=2,group=32", "oscar:bits=2,group=32", "kivi:bits=4,group=2",
                                   "qvg:bits=2,centroids=2,block=16", "qvg:bits=4,centroids=3,block=16,stages=2"])
def test_grouped_keys_of_unequal_units_join_into_one_segment(codec, monkeypatch):
    """KIVI's and OScaR's keys group over each unit's tokens; units of unequal length (an AAR's scales) used to stay
    one segment each, decoded one call apiece. The store now stacks equal ones and joins the rest along the tokens
    (`join_units`): one decode call for K and one for V, the past and the attention bit for bit those of
    unit-by-unit storage, the same bytes held."""
    gen = torch.Generator().manual_seed(31)
    sizes = [2, 2, 1, 3, 5, 4, 1, 6]
    blocks = [(rand(gen, t), rand(gen, t)) for t in sizes]
    stores = {m: store_for(codec, residual_window=1, merge_units=m) for m in (True, False)}
    merged, single = stores[True], stores[False]
    assert merged.ragged and not single.ragged
    calls = []
    for codec_ in (merged.k_codec(0), merged.v_codec(0)):
        real = codec_.decode
        monkeypatch.setattr(codec_, "decode", lambda enc, *a, _r=real, **kw: calls.append(enc.shape) or _r(enc, *a, **kw))
    for k, v in blocks:
        for layer in range(L):
            q = rand(gen, 2)
            before = len(calls)
            got = merged.attend(layer, q, k, v)
            if layer == 0 and merged.num_units(0) >= 3:
                assert len(calls) - before == 2  # the whole encoded past: one call for K, one for V
            assert torch.equal(got, single.attend(layer, q, k, v))
            for store in (merged, single):
                store.append(layer, k, v)
    for layer in range(L):
        joined, native = merged.segments(layer)
        assert joined.stack == 1 and joined.k_enc.meta["units"] == tuple(sizes[:-1])
        for a, b in zip(merged.past(layer), single.past(layer)):
            assert torch.equal(a, b)
    assert merged.nbytes() == single.nbytes() == sum(s.nbytes for st in merged._layers for s in st.segs)
    assert store_for("qvg:bits=2,centroids=2,block=16", residual_window=1).ragged  # each span's centres in turn
    assert not store_for("qvg:bits=2,centroids=2,block=16,stages=0", residual_window=1).ragged  # nothing to tell


def test_joined_keys_of_unequal_units_skip_the_fused_kernels(monkeypatch):
    """A fused decode-attention kernel reads one unit's key groups; keys joined over unequal units go down the
    decode + SDPA path instead, while single units still reach the kernel."""
    import mmkv.attention as attention_mod

    used = []

    def fake_kernel(q, segments, scale):
        used.append(len(segments))
        k, v = attention_mod.gather(segments, None, None, torch.float32)
        return attention_mod.attention_lse(q, k, v, scale)

    monkeypatch.setattr(attention_mod, "find_kernel", lambda k, v, device: fake_kernel)
    store = store_for("kivi:bits=2,group=32", residual_window=1)
    gen = torch.Generator().manual_seed(37)
    for t in (3, 1, 2):
        k, v = rand(gen, t), rand(gen, t)
        store.attend(0, rand(gen, 1), k, v)
        store.append(0, k, v)
    assert used == [1]  # the second block saw one encoded unit; the third the joined units (1 and 3 tokens)
    assert store.segments(0)[0].k_enc.meta["units"] == (3, 1)


def test_stacked_units_decode_in_one_call_per_tensor(monkeypatch):
    """The point of stacking: attention over a KIVI past of 6 units makes one decode call for K and one for V,
    and a stacked segment split back into units (fused kernels, score paths) decodes to the same tokens."""
    from mmkv.attention import Segment

    store = store_for("oscar:bits=2,group=32", residual_window=1)
    gen = torch.Generator().manual_seed(23)
    for _ in range(2):
        store.append(0, rand(gen, 3 * UNIT), rand(gen, 3 * UNIT), num_units=3)
    calls = []
    for codec in (store.k_codec(0), store.v_codec(0)):
        real = codec.decode
        monkeypatch.setattr(codec, "decode", lambda enc, *a, _r=real, **kw: calls.append(enc.shape) or _r(enc, *a, **kw))
    k, v = store.past(0)
    assert len(calls) == 2 and all(shape[1] == 5 for shape in calls)  # [B, 5 units, H, T, D]
    (stacked, native) = store.segments(0)
    units = stacked.unstacked()
    assert len(units) == 5 and all(u.stack == 1 and u.num_tokens == UNIT for u in units)
    assert torch.equal(torch.cat([u.decode(k.dtype)[0] for u in units], 2), k[..., : 5 * UNIT, :])
    assert torch.equal(stacked.decode(k.dtype)[1], v[..., : 5 * UNIT, :])


@pytest.mark.parametrize("merge", [True, False])
def test_qvg_commit_spans_join_after_the_shorter_first(merge, monkeypatch):
    """QVG encodes each commit's leaving units as one span with its own centres; the first span is one unit shorter
    than the rest (the residual window), so the spans do not stack, and they join along the tokens
    (`QVGCodec.join_units`): attention decodes the encoded past in one call per tensor where it took one a span.
    The gathered past and the stored bytes equal those without merging, bit for bit."""
    gen = torch.Generator().manual_seed(31)
    blocks = [(rand(gen, 3 * UNIT), rand(gen, 3 * UNIT)) for _ in range(5)]

    def run(merge_units: bool):
        store = KVStore(CacheConfig(codec="qvg:bits=2,centroids=4,block=16", residual_window=1,
                                    merge_units=merge_units), num_layers=1, num_heads=H, head_dim=D)
        for k, v in blocks:
            store.append(0, k, v, num_units=3)
            store.past(0)  # attention reads the layer after each commit, as a rollout does
        return store

    store = run(merge)
    calls = []
    for codec in (store.k_codec(0), store.v_codec(0)):
        real = codec.decode
        monkeypatch.setattr(codec, "decode", lambda enc, *a, _r=real, **kw: calls.append(enc.shape) or _r(enc, *a, **kw))
    k, v = store.past(0)
    spans = [s.stack for s in store.segments(0) if s.encoded]
    assert spans == ([1] if merge else [1] * 5) and len(calls) == 2 * len(spans)
    if merge:
        assert store.segments(0)[0].k_enc.meta["units"] == (2 * UNIT, *[3 * UNIT] * 4)
    plain = run(False)
    assert all(torch.equal(a, b) for a, b in zip((k, v), plain.past(0)))
    assert store.nbytes() == plain.nbytes() == sum(s.nbytes for s in store._layers[0].segs)


def test_rolling_window_never_merges():
    store = store_for("octopus:b=2", residual_window=1, attention_window=6)
    gen = torch.Generator().manual_seed(19)
    for _ in range(3):
        store.append(0, rand(gen, 3 * UNIT), rand(gen, 3 * UNIT), num_units=3)
    assert len(store.segments(0)) == 6  # evicted unit by unit, so encoded unit by unit
    with pytest.raises(KVCacheError, match="merge_units must be True or False"):
        CacheConfig(merge_units=1)


def test_codec_whose_head_dim_the_layer_lacks():
    pow2 = [n for n in codecs.names() if get_codec_class(n).requires_pow2]
    assert pow2, "expected at least one codec with a Walsh-Hadamard rotation"
    with pytest.raises(KVCacheError, match=r"layer 0 .*head_dim=48.*power-of-two"):
        KVStore(CacheConfig(codec=pow2[0]), num_layers=2, num_heads=H, head_dim=48)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(codec="no-such-codec"), "unknown codec"),
        (dict(codec="groupquant:nonsense=1"), "no parameter"),
        (dict(residual_window=-1), "residual_window"),
        (dict(protected_units=1.5), "protected_units"),
        (dict(protected_layers=1), "protected_layers"),
        (dict(sink_units=2), "sink_units"),
        (dict(attention_window=0), "attention_window"),
        (dict(attention="flash"), "attention"),
    ],
)
def test_bad_config_gets_a_clear_error(kwargs, match):
    with pytest.raises(KVCacheError, match=match):
        CacheConfig(**kwargs)


def test_protected_layer_out_of_range():
    with pytest.raises(KVCacheError, match="protected layer 5 out of range"):
        store_for("identity", protected_layers=(5,))


# ----------------------------------------------------------------------------------------------------------------
# Attaching, manifest


class _Attn(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.mmkv_layer = layer


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Attn(i) for i in range(L)])
        self.other = torch.nn.Linear(2, 2)


def test_attach_sets_store_and_restores_even_on_error():
    model, store = _Model(), store_for("identity")
    sentinel = object()
    model.blocks[1].mmkv_store = sentinel
    with pytest.raises(RuntimeError, match="boom"):
        with store.attach(model) as attached:
            assert attached is store
            assert all(b.mmkv_store is store for b in model.blocks)
            assert not hasattr(model.other, "mmkv_store")
            raise RuntimeError("boom")
    assert model.blocks[1].mmkv_store is sentinel
    assert not hasattr(model.blocks[0], "mmkv_store") and not hasattr(model.blocks[2], "mmkv_store")


def test_attach_refuses_models_it_cannot_serve():
    store = store_for("identity")
    with pytest.raises(KVCacheError, match="no module"):
        with store.attach(torch.nn.Linear(2, 2)):
            pass
    model = _Model()
    model.blocks[2].mmkv_layer = L
    with pytest.raises(KVCacheError, match=f"mmkv_layer={L}"):
        with store.attach(model):
            pass
    assert not hasattr(model.blocks[0], "mmkv_store")


def test_manifest_is_json_and_records_the_setup():
    gen = torch.Generator().manual_seed(15)
    store = store_for("groupquant:bits=2,group=16", protected_layers=(-1,), protected_units=1)
    assert json.loads(json.dumps(store.manifest()))["kv_ratio"] is None  # empty store: no ratio yet
    for layer in range(L):
        store.append(layer, rand(gen, 3 * UNIT), rand(gen, 3 * UNIT), 3)
    m = json.loads(json.dumps(store.manifest()))
    assert m["k_codec"] == "groupquant:bits=2,group=16,meta=fp16" and m["v_codec"].startswith("groupquant:bits=2")
    assert m["residual_window"] == 1 and m["protected_layers"] == [L - 1] and m["protected_units"] == 1
    assert m["nbytes"] == store.nbytes() and m["kv_ratio"] == pytest.approx(store.kv_ratio)
    assert m["tokens_per_layer"] == [3 * UNIT] * L


# ----------------------------------------------------------------------------------------------------------------
# reuse_decoded: decode each unit once per rollout, same outputs


@pytest.mark.parametrize("codec", [c for c in ALL_CODECS if not get_codec_class(c.split(":")[0]).has_scores])
@pytest.mark.parametrize("attention_window", [None, 3])
def test_reuse_decoded_is_bit_identical_and_decodes_each_unit_once(codec, attention_window):
    gen = torch.Generator().manual_seed(11)
    plain = store_for(codec, residual_window=1, attention_window=attention_window)
    reuse = store_for(codec, residual_window=1, attention_window=attention_window, reuse_decoded=True)
    decodes: list[int] = []
    for layer in range(L):
        for which in (reuse.k_codec(layer), reuse.v_codec(layer)):
            original = which.decode

            def counting(enc, dtype=None, _orig=original):
                decodes.append(enc.shape[2])
                return _orig(enc, dtype)

            which.decode = counting
    total = 0
    for n in commit_schedule():
        for layer in range(L):
            k, v = rand(gen, UNIT * n), rand(gen, UNIT * n)
            for store in (plain, reuse):
                store.append(layer, k, v, num_units=n, first_unit=total)
        total += n
        for _ in range(3):  # denoising passes of one block read the same past
            q, kc, vc = rand(gen, UNIT), rand(gen, UNIT), rand(gen, UNIT)
            for layer in range(L):
                assert torch.equal(plain.attend(layer, q, kc, vc), reuse.attend(layer, q, kc, vc))
    # every encoded span was decoded once (K and V), however many passes read it
    encoded_tokens = sum(
        s.k_enc.shape[-2] for layer in range(L) for s in reuse._layers[layer].segs if s.encoded
    )
    assert sum(decodes) <= 2 * sum(len(reuse.encoded_units(l)) for l in range(L)) * UNIT
    assert sum(decodes) >= 2 * encoded_tokens
    stats = reuse.stats()
    assert plain.stats()["decoded_nbytes"] == 0 and stats["decoded_peak_nbytes"] >= stats["decoded_nbytes"] > 0
    assert reuse.nbytes() == plain.nbytes()  # the kept decodes are reported apart, not hidden in nbytes


def test_reuse_decoded_keeps_score_estimators():
    name = next(n for n in codecs.names() if get_codec_class(n).has_scores)
    gen = torch.Generator().manual_seed(12)
    stores = [store_for(name, residual_window=1, reuse_decoded=r) for r in (False, True)]
    for layer in range(L):
        k, v = rand(gen, UNIT * 3), rand(gen, UNIT * 3)
        for store in stores:
            store.append(layer, k, v, num_units=3)
    q = rand(gen, UNIT)
    assert torch.equal(stores[0].attend(0, q), stores[1].attend(0, q))
    assert stores[1].stats()["decoded_nbytes"] == 0


def test_reuse_decoded_must_be_a_bool():
    with pytest.raises(KVCacheError, match="reuse_decoded"):
        CacheConfig(reuse_decoded="yes")


def test_scratch_counts_the_decode_of_a_partly_evicted_span_even_with_kernels(monkeypatch):
    """With decode kernels the gather needs no per-segment temporary, except for a span the rolling window has partly
    evicted: it is decoded whole and its visible tokens copied, so that decode is scratch too."""
    import mmkv.cache.store as cache_mod

    def scratch(direct: bool) -> tuple[int, int]:
        if direct:  # what CUDA with kernels answers; attention itself still runs the reference here
            monkeypatch.setattr(cache_mod, "_kernel", lambda codec, op, device: (lambda *a, **k: None))
        else:
            monkeypatch.undo()
        gen = torch.Generator().manual_seed(21)
        store = store_for("qvg:bits=2,centroids=2,block=16", residual_window=1, attention_window=5)
        biggest = 0
        for _ in range(5):
            store.append(0, rand(gen, 3 * UNIT), rand(gen, 3 * UNIT), num_units=3)
            segs = store.segments(0)
            store.attend(0, rand(gen, 2))
            visible = sum(s.num_tokens for s in segs)
            skipped = max((s.k_enc.shape[-2] for s in segs if s.encoded and s.skip_tokens), default=0)
            biggest = max(biggest, visible + skipped)
        return store.scratch_peak_nbytes, 2 * BATCH * H * D * 4 * biggest

    for direct in (False, True):
        got, floor = scratch(direct)
        assert got >= floor, (direct, got, floor)


def test_score_estimator_keys_are_not_merged_on_their_own_path():
    """OCTOPUS-QJL keys are token-local, but their score estimator unpacks a whole segment per query chunk: merged or
    joined segments would make it quadratic in the past, so the store merges them only when attention decodes."""
    assert not store_for("octopus-qjl:b=2").merge
    assert store_for("octopus-qjl:b=2", attention="decode").merge
    assert store_for("octopus:b=2").merge
    assert not store_for("qjl:bits=2", attention="decode").merge  # its reference projection is not row-local


def test_fused_seam_sees_a_stacked_past_unit_by_unit(monkeypatch):
    """A fused kernel (short query blocks) attends segment by segment: a stacked KIVI past reaches it as one
    segment per unit (views of the stack), and the result equals decode + SDPA over the same past."""
    import mmkv.attention as attn

    store = store_for("kivi:bits=2,group=32", residual_window=1)
    gen = torch.Generator().manual_seed(29)
    for _ in range(2):
        store.append(0, rand(gen, 3 * UNIT), rand(gen, 3 * UNIT), num_units=3)
    seen = []

    def kernel(q, segments, scale):  # the seam's protocol, computed by the torch reference
        seen.append([(s.stack, s.num_tokens) for s in segments])
        k, v = attn.gather(segments, None, None, torch.float32)
        return attn.attention_lse(q.float(), k, v, scale)

    monkeypatch.setattr(attn, "find_kernel", lambda kc, vc, device: kernel)
    q = rand(gen, 2)
    out = store.attend(0, q)
    assert seen == [[(1, UNIT)] * 5]  # 5 encoded units; the newest stays native
    ref = attn.sdpa(q, *store.past(0))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_encode_scope_collects_checks_and_plain_encode_reads_them_at_once():
    """The codec protocol carries no host-sync plumbing: a plain `encode` is fully checked, and the store's scope
    (inputs scanned by the store, device checks collected) applies only inside it and is undone after."""
    from mmkv.codecs.checks import check_or_defer, collecting, encode_scope

    codec = build("turboquant-mse:b=2,norm=16", layer=0, head_dim=32, num_heads=1)
    big = torch.full((1, 4, 32), 1e6)
    with pytest.raises(codecs.CodecError, match="fp16"):
        codec.encode(big)  # the fp16 norm overflow is read at once
    with encode_scope(inputs_checked=True, collect=True) as pending:
        assert inputs_checked() and collecting()
        codec.encode(big)  # collected, not raised
        check_or_defer(torch.tensor(True), lambda: "late")
    assert [m() for _, m in pending][-1] == "late" and len(pending) == 2 and bool(pending[0][0])
    assert not inputs_checked() and not collecting()
    nan = torch.zeros(1, 4, 32)
    nan[0, 0, 0] = float("nan")
    with pytest.raises(codecs.CodecError, match="NaN"):
        codec.encode(nan)  # outside the scope the input scan runs again
