"""The AAR rollout through the KV store: determinism, identity == native bit for bit, common random numbers across
codecs, the hook is live, and the residual window counts scales."""

from __future__ import annotations

import pytest
import torch

from mmkv.cache import CacheConfig, KVStore
from mmkv.codecs import Codec, CodecConfig, Encoded, registered
from mmkv.metrics.audio import SNR_CAP_DB, audio_metrics
from mmkv.pipelines.aar.sample import (
    SamplingConfig,
    SamplingStream,
    inverse_cdf_sample,
    rollout,
    top_k_top_p_filter_,
)
from mmkv.pipelines.aar.tiny import build_tiny, random_condition


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def micro():
    return build_tiny("micro", seed=21)


def store_for(aar, codec, window: int = 1) -> KVStore:
    cfg = CacheConfig(codec=codec, value_group=16, residual_window=window, seed=0)
    return KVStore(cfg, num_layers=aar.depth, num_heads=aar.num_heads, head_dim=aar.config.head_dim)


@pytest.fixture
def zero_codec():
    """Decodes every stored scale to zeros ("zero everything older"): must change the rollout."""

    class ZeroPast(Codec):
        config_class = CodecConfig.named("test-zero-past")

        @classmethod
        def value_config(cls, config, group=32):
            return config

        def _encode(self, x):
            return Encoded(self.name, (), x.dtype, {"n": torch.zeros(1, dtype=torch.uint8)})

        def _decode(self, enc):
            return torch.zeros(enc.shape)

    with registered(ZeroPast):
        yield "test-zero-past"


def test_rollout_is_deterministic_given_the_seed(micro):
    aar, sat = micro
    cond = random_condition(1, seed=1)
    a = rollout(aar, sat, cond, seed=5, key="clip")
    b = rollout(aar, sat, cond, seed=5, key="clip")
    assert torch.equal(a.audio, b.audio) and torch.equal(a.latent, b.latent)
    assert a.noise_sha256 == b.noise_sha256 and a.tokens_sha256 == b.tokens_sha256
    c = rollout(aar, sat, cond, seed=6, key="clip")
    assert c.noise_sha256 != a.noise_sha256 and not torch.equal(c.tokens_flat, a.tokens_flat)
    d = rollout(aar, sat, cond, seed=5, key="other-clip")  # each clip has its own stream
    assert d.noise_sha256 != a.noise_sha256
    assert a.audio.shape == (1, 1, 1600) and a.latent.shape == (1, 16, 5) and a.tokens_flat.shape == (1, 11)


def test_native_store_and_identity_codec_reproduce_the_module_cache_bit_for_bit(micro):
    aar, sat = micro
    cond = random_condition(2, seed=2)  # B = 2: the CFG batch is 4 rows
    base = rollout(aar, sat, cond, seed=3, key="x")  # the model's own concatenating cache (upstream's path)
    for codec in (None, "identity"):
        store = store_for(aar, codec)
        r = rollout(aar, sat, cond, seed=3, key="x", store=store)
        assert torch.equal(r.audio, base.audio), codec
        assert torch.equal(r.latent, base.latent) and torch.equal(r.tokens_flat, base.tokens_flat)
        assert r.scale_logits_sha256 == base.scale_logits_sha256
        assert store.stats()["units_per_layer"] == [len(aar.patch_nums)] * aar.depth  # one unit per scale
    m = audio_metrics(base.audio[0, 0], r.audio[0, 0], 24_000, base.latent, r.latent, base.tokens_flat, r.tokens_flat)
    s = m["summary"]
    assert s["snr_db"] == SNR_CAP_DB and s["lsd_db"] == 0.0 and s["log_mel_mse"] == 0.0
    assert s["latent_cosine"] == pytest.approx(1.0, abs=1e-12) and s["token_agreement"] == 1.0


def test_codecs_draw_identical_random_bytes_and_diverge_only_after_their_logits_do(micro, zero_codec):
    aar, sat = micro
    cond = random_condition(1, seed=7)
    ref = rollout(aar, sat, cond, seed=1, key="clip", store=store_for(aar, None))
    for codec in ("kivi:bits=2", zero_codec):
        r = rollout(aar, sat, cond, seed=1, key="clip", store=store_for(aar, codec))
        assert r.noise_sha256 == ref.noise_sha256 and r.scale_noise_sha256 == ref.scale_noise_sha256
        same = [a == b for a, b in zip(r.scale_logits_sha256, ref.scale_logits_sha256)]
        assert same[0]  # scale 0 reads nothing from the compressed past
        first = same.index(False) if False in same else len(same)
        for si in range(first):  # identical logits + identical uniforms => identical tokens
            assert torch.equal(r.tokens[si], ref.tokens[si]), (codec, si)
    # The zeroing codec must move the logits: proof that attention reads the store.
    assert first < len(same)
    assert not torch.equal(r.audio, ref.audio)


def test_residual_window_counts_scales(micro, zero_codec):
    aar, sat = micro
    cond = random_condition(1, seed=8)
    ref = rollout(aar, sat, cond, seed=2, key="w")
    n = len(aar.patch_nums)
    # Every scale native (W = number of scales): nothing is ever encoded, so even the zeroing codec is harmless.
    store = store_for(aar, zero_codec, window=n)
    r = rollout(aar, sat, cond, seed=2, key="w", store=store)
    assert torch.equal(r.audio, ref.audio) and store.stats()["encodes_per_layer"] == [0] * aar.depth
    # W = n - 1: only scale 0 is ever compressed (when the last scale arrives), so only the last scale can differ.
    store = store_for(aar, zero_codec, window=n - 1)
    r = rollout(aar, sat, cond, seed=2, key="w", store=store)
    assert store.stats()["encodes_per_layer"] == [1] * aar.depth
    assert all(torch.equal(a, b) for a, b in zip(r.tokens[:-1], ref.tokens[:-1]))
    assert r.scale_logits_sha256[-1] != ref.scale_logits_sha256[-1]
    # W = 1 (default): the current scale native, every older scale encoded exactly once.
    store = store_for(aar, "kivi:bits=2", window=1)
    rollout(aar, sat, cond, seed=2, key="w", store=store)
    assert store.stats()["encodes_per_layer"] == [n - 1] * aar.depth


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zero_mass():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(8, generator=g)
    probs[[1, 5]] = 0
    probs /= probs.sum()
    stream = SamplingStream(0, "dist")
    idx = inverse_cdf_sample(probs.expand(40_000, 8), stream.uniform(40_000))
    freq = torch.bincount(idx, minlength=8).double() / idx.numel()
    assert freq[1] == 0 and freq[5] == 0
    assert torch.allclose(freq, probs.double(), atol=0.01)
    edge = inverse_cdf_sample(probs[None], torch.tensor([1 - 2**-53], dtype=torch.float64))
    assert probs[edge] > 0


def test_top_k_top_p_filter_keeps_the_head_of_the_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 50, generator=g)
    kept = top_k_top_p_filter_(logits.clone(), top_k=10, top_p=0.0).isfinite()
    assert (kept.sum(-1) == 10).all()
    assert torch.equal(kept, logits >= logits.topk(10, dim=-1).values[..., -1:])
    filt = top_k_top_p_filter_(logits.clone(), top_k=0, top_p=0.5)
    p = logits.softmax(-1)
    for row_p, row_f in zip(p.view(-1, 50), filt.view(-1, 50)):
        kept_mass = row_p[row_f.isfinite()].sum()
        assert kept_mass >= 0.5 - 1e-6  # what is kept covers at least p
        smallest_kept = row_p[row_f.isfinite()].min()
        assert kept_mass - smallest_kept < 0.5 + 1e-6  # and dropping its smallest entry would not


def test_sampling_rejects_a_wrong_condition_width(micro):
    aar, sat = micro
    with pytest.raises(ValueError, match=r"\(B, 512\)"):
        rollout(aar, sat, torch.randn(1, 256), seed=0, key="k")


def test_guidance_uses_the_stored_null_condition(micro):
    aar, sat = micro
    cond = random_condition(1, seed=9)
    a = rollout(aar, sat, cond, seed=4, key="g", sampling=SamplingConfig(cfg=4.0))
    saved = aar.uncond_embedding.clone()
    try:
        aar.uncond_embedding.copy_(torch.randn(1, 512, generator=torch.Generator().manual_seed(3)) / 512**0.5)
        b = rollout(aar, sat, cond, seed=4, key="g", sampling=SamplingConfig(cfg=4.0))
    finally:
        aar.uncond_embedding.copy_(saved)
    assert a.scale_logits_sha256[0] == b.scale_logits_sha256[0]  # guidance weight is 0 at the first scale
    assert a.scale_logits_sha256[1:] != b.scale_logits_sha256[1:]
