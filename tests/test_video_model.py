"""The causal Wan DiT and the block loop on the tiny configuration, against their invariants: the identity codec is
bit-exact, the cached rollout equals a block-causal full recompute, and only commits encode."""

from __future__ import annotations

import pytest
import torch

from mmkv.cache import CacheConfig, KVStore
from mmkv.pipelines.common import NoiseStream
from mmkv.pipelines.wan.loop import PRESETS, FlowMatchScheduler, block_causal_mask, get_preset, rollout
from mmkv.pipelines.wan.model import ModelError
from mmkv.pipelines.wan.tiny import TINY_DIT, tiny_vae

LAT_H, LAT_W = 4, 6  # 2x3 tokens per frame: H != W


pytestmark = pytest.mark.usefixtures("one_thread")


def frames_for(preset) -> int:
    return 9 if preset.frames_per_block == 3 else 5


def make_store(codec, window=1, layers=TINY_DIT["num_layers"]):
    return KVStore(CacheConfig(codec=codec, residual_window=window), num_layers=layers,
                   num_heads=TINY_DIT["num_attention_heads"], head_dim=TINY_DIT["attention_head_dim"])


def run(dit, context, preset, store, seed=0, index=0, num_frames=None, prefix=None):
    noise = NoiseStream(seed, index)
    store.reset()
    with torch.no_grad(), store.attach(dit.transformer):
        result = rollout(dit, preset, context, noise, num_frames=num_frames or frames_for(preset),
                         latent_height=LAT_H, latent_width=LAT_W, prefix=prefix)
    return result, noise


def decode(vae, latents):
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents.permute(0, 2, 1, 3, 4) * std + mean).sample
    return ((video.clamp(-1, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# Scheduler and presets


def test_warped_schedules_match_the_published_values():
    # warped [1000, 750, 500, 250] (Causal Forcing pipeline/causal_inference.py:28-32):
    # shift 5 -> 1000, 937.5, 833.33, 625; shift 8 -> 1000, 960, 888.89, 727.27
    assert get_preset("causal-forcing-chunk").schedules()[1] == pytest.approx([1000, 937.5, 833.333, 625.0], abs=1e-3)
    assert get_preset("causvid-warp4").schedules()[1] == pytest.approx([1000, 960.0, 888.889, 727.273], abs=1e-3)
    first, rest = get_preset("causal-forcing-frame-2step").schedules()
    assert rest == pytest.approx([1000, 833.333], abs=1e-3) and len(first) == 4
    assert get_preset("causvid").schedules()[1] == [1000.0, 757.0, 522.0]


def test_scheduler_nearest_grid_sigma_and_x0_round_trip():
    sched = FlowMatchScheduler(8.0)
    # CausVid's unwarped 757 / 522 fall on grid points 756.76 / 521.74 (CausVid flow_match.py:19-39)
    assert float(sched.sigma(757)) == pytest.approx(0.7568, abs=1e-4)
    assert float(sched.sigma(522)) == pytest.approx(0.5217, abs=1e-4)
    g = torch.Generator().manual_seed(5)
    x0, eps = torch.randn(2, 3, 16, 4, 6, generator=g), torch.randn(2, 3, 16, 4, 6, generator=g)
    xt = sched.add_noise(x0, eps, 757)
    torch.testing.assert_close(sched.flow_to_x0(eps - x0, xt, 757), x0, atol=1e-5, rtol=1e-5)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown video model preset 'causvid-9step'.*causal-forcing-chunk"):
        get_preset("causvid-9step")


# ----------------------------------------------------------------------------------------------------------------
# Invariant 1: identity codec == native cache, bit-exact (latents and decoded frames), every preset


def test_identity_codec_is_bit_exact_with_the_native_cache_for_every_preset(dit, context):
    vae = tiny_vae(seed=1)
    for name, preset in PRESETS.items():
        ref, ref_noise = run(dit, context, preset, make_store(None))
        idt, idt_noise = run(dit, context, preset, make_store("identity"))
        assert ref.latents.abs().max() > 0.1 and torch.isfinite(ref.latents).all(), name
        assert torch.equal(ref.latents, idt.latents), name
        assert ref_noise.sha256 == idt_noise.sha256, name
        frames_ref, frames_idt = decode(vae, ref.latents), decode(vae, idt.latents)
        assert frames_ref.float().std() > 1, name  # real pictures, not a constant
        assert torch.equal(frames_ref, frames_idt), name


def test_a_lossy_codec_changes_the_rollout_with_the_same_noise(dit, context):
    preset = get_preset("causal-forcing-chunk")
    ref, ref_noise = run(dit, context, preset, make_store(None))
    lossy, lossy_noise = run(dit, context, preset, make_store("groupquant:bits=2,group=32"))
    assert ref_noise.sha256 == lossy_noise.sha256
    # block 0 never reads the cache; later blocks read compressed frames
    torch.testing.assert_close(lossy.latents[:, :3], ref.latents[:, :3], atol=0, rtol=0)
    assert (lossy.latents[:, 3:] - ref.latents[:, 3:]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------------------
# Invariant 2: cached AR output == full recompute with a block-causal mask


@pytest.mark.parametrize("name", ["causvid", "causal-forcing-frame"])
def test_cached_rollout_equals_block_causal_recompute(dit, context, name):
    preset = get_preset(name)
    calls = []
    original_forward = dit.forward

    def recording_forward(latents, timestep, ctx, **kw):
        out = original_forward(latents, timestep, ctx, **kw)
        calls.append((latents.clone(), float(timestep), kw.get("start_frame", 0), kw.get("mode"), out.clone()))
        return out

    dit.forward = recording_forward
    try:
        result, _ = run(dit, context, preset, make_store(None))
    finally:
        del dit.forward
    clean = result.latents
    fpb = preset.frames_per_block
    tpf = dit.tokens_per_frame(LAT_H, LAT_W)
    checked = 0
    for latents, t, start, mode, flow in calls:
        if mode != "denoise" or start == 0:
            continue
        full = torch.cat([clean[:, :start], latents], dim=1)
        steps = torch.tensor([[0.0] * start + [t] * fpb])
        n = start + fpb
        with torch.no_grad():
            masked = dit(full, steps, context, start_frame=0, mode="full",
                         attn_mask=block_causal_mask(n, fpb, tpf))
            unmasked = dit(full, steps, context, start_frame=0, mode="full")
        torch.testing.assert_close(masked[:, start:], flow, atol=2e-5, rtol=2e-5)
        # the mask matters: without it past tokens see the current block and the result moves
        assert (unmasked[:, start:] - flow).abs().max() > 1e-4
        checked += 1
    assert checked == (frames_for(preset) // fpb - 1) * len(preset.schedules()[1])


# ----------------------------------------------------------------------------------------------------------------
# Invariant 3: only commit passes encode; the native window holds exactly residual_window latent frames


@pytest.mark.parametrize("name,window", [("causal-forcing-chunk", 1), ("causal-forcing-frame", 2)])
def test_only_commits_encode_and_the_window_holds_residual_window_frames(dit, context, name, window):
    preset = get_preset(name)
    store = make_store("groupquant:bits=4,group=32", window=window)
    modes = []
    for layer in range(store.num_layers):
        for codec in (store.k_codec(layer), store.v_codec(layer)):
            encode = codec.encode

            def spy(x, _encode=encode, **kw):
                modes.append((dit.state.mode, x.shape[2]))
                return _encode(x, **kw)

            codec.encode = spy
    native_after_commit = []
    original_forward = dit.forward

    def forward(latents, timestep, ctx, **kw):
        out = original_forward(latents, timestep, ctx, **kw)
        if kw.get("mode") == "commit":
            native_after_commit.append(store.stats()["native_units_per_layer"])
        return out

    dit.forward = forward
    try:
        run(dit, context, preset, store)
    finally:
        del dit.forward
    frames = frames_for(preset)
    stats = store.stats()
    assert {mode for mode, _ in modes} == {"commit"}
    frame_tokens = store.num_tokens(0) // store.num_units(0)
    # K and V of every frame that left the window, each once (consecutive frames may share one call: merge_units)
    assert sum(t for _, t in modes) == 2 * store.num_layers * (frames - window) * frame_tokens
    assert stats["encodes_per_layer"] == [frames - window] * store.num_layers
    assert stats["native_units_per_layer"] == [window] * store.num_layers
    assert stats["units_per_layer"] == [frames] * store.num_layers
    committed = 0
    for native in native_after_commit:
        committed += preset.frames_per_block
        assert native == [min(window, committed)] * store.num_layers
    assert store.nbytes() < store.bf16_nbytes() * 2  # fp32 model, 4-bit codec: far below a native fp32 cache


# ----------------------------------------------------------------------------------------------------------------
# RoPE offset, cross-attention cache, bad input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_is_the_pairwise_form_bit_for_bit(dit, dtype):
    """`apply_rope`'s x * cos + swap(x) * sin_signed is x1 c - x2 s, x1 s + x2 c in float64 to the last bit."""
    from mmkv.pipelines.wan.model import apply_rope

    tables = dit.transformer.rope(torch.zeros(1, 16, 3, LAT_H, LAT_W))
    cos, sin = tables
    assert torch.equal(tables.sin_signed[..., 1::2], sin[..., 1::2])
    assert torch.equal(tables.sin_signed[..., 0::2], -sin[..., 0::2])
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, cos.shape[1], 2, cos.shape[-1], generator=g) * 3).to(dtype)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    want = torch.empty_like(x)
    want[..., 0::2] = x1 * c - x2 * s
    want[..., 1::2] = x1 * s + x2 * c
    got = apply_rope(x, cos, tables.sin_signed)
    assert got.dtype == dtype and torch.equal(got, want)


def test_offset_rope_starts_at_the_block_frame(dit):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    plain = WanRotaryPosEmbed(TINY_DIT["attention_head_dim"], TINY_DIT["patch_size"], TINY_DIT["rope_max_seq_len"])
    x = torch.zeros(1, 16, 7, LAT_H, LAT_W)
    cos_all, sin_all = plain(x)
    dit.state.start_frame = 4
    cos, sin = dit.transformer.rope(x[:, :, :3])
    dit.state.start_frame = 0
    tpf = dit.tokens_per_frame(LAT_H, LAT_W)
    torch.testing.assert_close(cos, cos_all[:, 4 * tpf:7 * tpf].double(), atol=1e-12, rtol=0)
    torch.testing.assert_close(sin, sin_all[:, 4 * tpf:7 * tpf].double(), atol=1e-12, rtol=0)


def test_cross_attention_cache_is_exact(dit, context):
    preset = get_preset("causvid")
    cached, _ = run(dit, context, preset, make_store(None))
    dit.state.cache_cross_attn = False
    try:
        fresh, _ = run(dit, context, preset, make_store(None))
    finally:
        dit.state.cache_cross_attn = True
    assert torch.equal(cached.latents, fresh.latents)
    # a new prompt really changes the output (the per-prompt cache is reset between rollouts); a permutation of the
    # same text states would not (cross-attention has no positions)
    other_text = torch.randn(context.shape, generator=torch.Generator().manual_seed(12))
    other, _ = run(dit, other_text, preset, make_store(None))
    assert (other.latents - cached.latents).abs().max() > 1e-3


def test_noise_depends_on_seed_and_prompt_index(dit, context):
    preset = get_preset("causvid")
    _, a = run(dit, context, preset, make_store(None), seed=0, index=0)
    _, b = run(dit, context, preset, make_store(None), seed=1, index=0)
    _, c = run(dit, context, preset, make_store(None), seed=0, index=1)
    assert len({a.sha256, b.sha256, c.sha256}) == 3


def test_bad_calls_raise_clear_errors(dit, context):
    preset = get_preset("causvid")
    with pytest.raises(ValueError, match="multiple"):
        run(dit, context, preset, make_store(None), num_frames=8)
    x = torch.randn(1, 3, 16, LAT_H, LAT_W)
    with pytest.raises(ModelError, match="KV store"):
        dit(x, 1000.0, context, mode="denoise")
    with pytest.raises(ModelError, match="RoPE positions out of range"):
        dit(x, 1000.0, context, start_frame=TINY_DIT["rope_max_seq_len"] - 1, mode="full")
    with pytest.raises(ModelError, match="channels"):
        dit(torch.randn(1, 3, 8, LAT_H, LAT_W), 1000.0, context, mode="full")
    with pytest.raises(ValueError, match="layers"):
        with make_store(None, layers=1).attach(dit.transformer):
            pass


@pytest.mark.parametrize("name", ["causvid", "causal-forcing-frame"])
def test_a_given_prefix_opens_the_video_and_later_blocks_read_it(dit, context, name):
    preset = get_preset(name)
    free, free_noise = run(dit, context, preset, make_store(None))
    # its own first block as the prefix: the same video, with the same noise draws
    p = 3 if preset.frames_per_block == 3 else 2
    again, again_noise = run(dit, context, preset, make_store(None), prefix=free.latents[:, :p].clone())
    assert torch.equal(again.latents, free.latents) and again_noise.sha256 == free_noise.sha256
    assert again.calls < free.calls  # the given block was committed, not denoised
    # another prefix: copied as given, and the blocks after it change (they attend to it through the cache)
    other = torch.randn(free.latents[:, :p].shape, generator=torch.Generator().manual_seed(5))
    moved, _ = run(dit, context, preset, make_store(None), prefix=other)
    assert torch.equal(moved.latents[:, :p], other.to(moved.latents.dtype))
    assert not torch.equal(moved.latents[:, p:], free.latents[:, p:])


def test_a_prefix_the_loop_cannot_use_is_named(dit, context):
    preset = get_preset("causvid")
    with pytest.raises(ValueError, match="positive multiple of the preset's 3-frame blocks"):
        run(dit, context, preset, make_store(None), prefix=torch.zeros(1, 2, 16, LAT_H, LAT_W))
    with pytest.raises(ValueError, match="shorter than the video's 9"):
        run(dit, context, preset, make_store(None), prefix=torch.zeros(1, 9, 16, LAT_H, LAT_W))
    with pytest.raises(ValueError, match=r"shaped \[1, P, 16, 4, 6\]"):
        run(dit, context, preset, make_store(None), prefix=torch.zeros(1, 3, 16, LAT_W, LAT_H))


@pytest.mark.parametrize("codec", ["octopus:b=2", "turboquant-mse:b=2", "oscar:bits=2,group=32"])
def test_merged_and_joined_segments_give_the_same_rollout(dit, context, codec):
    """merge_units (one encode per block, encoded past joined into one segment) changes how the past is held, not
    what attention reads: the rollout is bit-identical to unit-by-unit encoding."""
    preset = get_preset("causvid")
    out = {}
    for merge in (True, False):
        store = KVStore(CacheConfig(codec=codec, residual_window=1, merge_units=merge),
                        num_layers=TINY_DIT["num_layers"], num_heads=TINY_DIT["num_attention_heads"],
                        head_dim=TINY_DIT["attention_head_dim"])
        out[merge] = run(dit, context, preset, store)[0].latents
        segments = len(store.segments(0))
        # unit by unit: one segment a frame; merged: one a block, joined into one past segment (TurboQuant: whole
        # bytes a token; OCTOPUS at 6 tokens a frame: its rows end inside a byte, joined bit by bit); OScaR encodes
        # frame by frame and its encoded frames are stacked into one segment
        want = frames_for(preset) if not merge else 2
        assert segments == want, segments
    assert torch.equal(out[True], out[False])
