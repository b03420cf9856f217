"""Long videos at equal memory, on the tiny causal Wan (Self-Forcing's rolling cache with sinks; QVG's sink protection):
QVG rollouts draw the reference's noise, protected sink frames stay native bit for bit, a rolling window as long as the
rollout is the global cache bit for bit, a shorter one keeps the peak KV bytes flat as the video grows, and
`--kv-budget` gives each codec the longest window its measured bytes fit, never exceeding the budget.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmkv.cache import CacheConfig, KVStore
from mmkv.cli import main
from mmkv.pipelines.common import NoiseStream
from mmkv.pipelines.wan.loop import get_preset, rollout
from mmkv.pipelines.wan.pipeline import ResolutionError, local_attn_size, store_window
from mmkv.pipelines.wan.tiny import TINY_DIT, tiny_transformer, write_causvid_checkpoint, write_tiny_base

LAT_H, LAT_W = 4, 6  # 6 tokens a frame
TOKENS = 6
QVG = "qvg:centroids=4,block=16"  # a codebook sized for 18-token spans (the default 256 centres suit 4680)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_store(codec=None, **kw) -> KVStore:
    return KVStore(CacheConfig(codec=codec, **kw), num_layers=TINY_DIT["num_layers"],
                   num_heads=TINY_DIT["num_attention_heads"], head_dim=TINY_DIT["attention_head_dim"])


def run(dit, context, store, frames=9, preset="causvid", index=0):
    noise = NoiseStream(0, index)
    store.reset()
    with torch.no_grad(), store.attach(dit.transformer):
        result = rollout(dit, get_preset(preset), context, noise, num_frames=frames, latent_height=LAT_H,
                         latent_width=LAT_W)
    return result.latents, noise


# ----------------------------------------------------------------------------------------------------------------
# QVG rollouts: same noise as the reference; protected sink frames native bit for bit


def test_qvg_rollout_draws_the_reference_noise_and_protected_units_stay_native(dit, context):
    ref_store = make_store()
    ref, ref_noise = run(dit, context, ref_store, frames=12)
    state = torch.get_rng_state()
    for protected in (0, 3, 6):
        store = make_store(QVG, protected_units=protected)
        out, noise = run(dit, context, store, frames=12)
        assert noise.sha256 == ref_noise.sha256 and noise.count == ref_noise.count
        assert not torch.equal(out, ref)  # the codec is lossy and really used
        n = protected * TOKENS
        for layer in range(TINY_DIT["num_layers"]):
            k, v = store.past(layer)
            k_ref, v_ref = ref_store.past(layer)
            # the first N frames' K/V are the native ones, bit for bit (frames 3-5 too: their block attended a
            # native past); everything after them went through the codec
            assert torch.equal(k[:, :, :n], k_ref[:, :, :n]) and torch.equal(v[:, :, :n], v_ref[:, :, :n])
            assert not torch.equal(k[:, :, n:n + TOKENS], k_ref[:, :, n:n + TOKENS])
        assert store.stats()["encodes_per_layer"] == [12 - 1 - protected] * 2  # all but the residual frame
    assert torch.equal(torch.get_rng_state(), state)  # k-means init from a private generator only


# ----------------------------------------------------------------------------------------------------------------
# Rolling window with sinks


def test_self_forcing_window_maps_to_the_store_window():
    # local_attn_size counts the block being generated and the sinks (Self-Forcing wan/modules/causal_model.py)
    assert store_window(None, 0, 3) is None and store_window(12, 3, 3) == 6 and store_window(4, 0, 1) == 3
    assert local_attn_size(store_window(12, 3, 3), 3, 3) == 12
    with pytest.raises(ResolutionError, match="at least 7"):
        store_window(6, 3, 3)


@pytest.mark.parametrize("codec, sink", [(None, 3), ("groupquant:bits=2,group=16", 3), (QVG, 0)])
def test_window_as_long_as_the_rollout_is_the_global_cache_bit_for_bit(dit, context, codec, sink):
    frames = 12
    full, _ = run(dit, context, make_store(codec), frames=frames)
    window = store_window(frames, sink, 3)  # Self-Forcing window = the whole rollout
    rolled_store = make_store(codec, attention_window=window, sink_units=sink)
    rolled, _ = run(dit, context, rolled_store, frames=frames)
    assert torch.equal(rolled, full)
    shorter, _ = run(dit, context, make_store(codec, attention_window=2, sink_units=sink), frames=frames)
    assert not torch.equal(shorter, full)  # a window that evicts does change the video


@pytest.mark.parametrize("codec, preset, window, sink", [
    (None, "causvid", 9, 3), (QVG, "causvid", 9, 3), ("groupquant:bits=2,group=16", "causal-forcing-frame", 4, 1)])
def test_peak_kv_bytes_stay_flat_as_the_video_grows(dit, context, codec, preset, window, sink):
    fpb = get_preset(preset).frames_per_block
    peaks, global_peaks = [], []
    lengths = [4 * fpb, 8 * fpb, 12 * fpb]  # chunk-wise: 36 frames, past the 21-frame training length
    for frames in lengths:
        store = make_store(codec, attention_window=store_window(window, sink, fpb), sink_units=sink)
        run(dit, context, store, frames=frames, preset=preset)
        peaks.append(store.peak_nbytes)
        assert store.num_units(0) == window - fpb  # sinks + rolling past (the current block is attended, not stored)
        if frames < lengths[-1]:
            glob = make_store(codec)
            run(dit, context, glob, frames=frames, preset=preset)
            global_peaks.append(glob.peak_nbytes)
    assert peaks[0] == peaks[1] == peaks[2]
    assert global_peaks[0] < global_peaks[1] and peaks[2] < global_peaks[1]


# ----------------------------------------------------------------------------------------------------------------
# `mmkv generate video --window --sink --kv-budget`


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_long")
    prompts = root / "prompts.txt"
    prompts.write_text("A kite over a windy beach.\n")
    return {
        "root": root, "prompts": prompts,
        "base": write_tiny_base(root / "base", "diffusers", seed=4),
        "ckpt": write_causvid_checkpoint(tiny_transformer(seed=5), root / "causvid" / "model.pt").parent,
    }


def argv(env, out, *extra, frames=69):
    return ["generate", "video", "--model", "causvid", "--ckpt", str(env["ckpt"]), "--base", str(env["base"]),
            "--prompts", str(env["prompts"]), "--frames", str(frames), "--height", "32", "--width", "48",
            "--out", str(out), *extra]


def test_equal_memory_mode_fits_every_codec_in_the_budget(env):
    out = env["root"] / "budget"
    per_frame = 2 * 2 * TOKENS * 32 * 4 * 2  # fp32 K + V, 2 heads x 32, 2 layers (CPU runs the model in fp32)
    budget = 5 * per_frame
    codecs = f"identity,groupquant:bits=2,group=32,{QVG}"
    # 105 pixel frames = 27 latent frames, past the 21-frame training length
    assert main(argv(env, out, "--codecs", codecs, "--sink", "3", "--kv-budget", f"{budget}B", frames=105)) == 0
    recs = {p.parent.name.split("_")[0]: json.loads(p.read_text()) for p in out.glob("rollouts/p0000/*/rollout.json")}
    assert set(recs) == {"reference", "identity", "groupquant", "qvg"}
    ref = recs.pop("reference")
    assert ref["window"] is None and ref["latent_frames"] == 27 and ref["peak_kv_bytes"] == 27 * per_frame
    assert ref["within_budget"] is False  # the reference keeps --window (global here); it is only reported
    for rec in recs.values():
        assert rec["noise_sha256"] == ref["noise_sha256"]
        assert rec["kv_budget_bytes"] == budget and rec["within_budget"] is True
        assert rec["peak_kv_bytes"] == rec["planned_peak_kv_bytes"] <= budget  # measured, never over
    # identity holds what the native cache would: sinks + 2 frames. QVG's 2-bit spans fit 16 rolling frames beside the
    # sinks (its per-span codebooks are dear at 18-token spans); 2-bit groupquant holds the whole video: global.
    assert (recs["identity"]["attention_window"], recs["identity"]["sink"], recs["identity"]["window"]) == (2, 3, 8)
    assert recs["qvg"]["attention_window"] > 4 * recs["identity"]["attention_window"]
    assert recs["qvg"]["window"] == recs["qvg"]["attention_window"] + 3 + 3
    assert recs["groupquant"]["window"] is None and recs["groupquant"]["sink"] == 0
    manifest = json.loads((out / "manifest.rank0.json").read_text())
    assert manifest["config"]["kv_budget_bytes"] == budget
    planned = {v.split("_")[0]: w["window"] for v, w in manifest["config"]["windows"].items()}
    assert planned == {"reference": None, **{k: r["window"] for k, r in recs.items()}}
    assert {r["variant"].split("_")[0]: r["window"] for r in manifest["rollouts"]} == planned


def test_cli_window_as_long_as_the_rollout_renders_the_global_video(env):
    import numpy as np

    a, b = env["root"] / "global", env["root"] / "window9"
    assert main(argv(env, a, "--codec", QVG, frames=33)) == 0
    assert main(argv(env, b, "--codec", QVG, "--window", "9", "--sink", "3", frames=33)) == 0
    for variant in ("reference", "qvg"):
        da, db = (next((out / "rollouts" / "p0000").glob(f"{variant}*")) for out in (a, b))
        assert np.array_equal(np.load(da / "frames.npy"), np.load(db / "frames.npy"))
        rec = json.loads((db / "rollout.json").read_text())
        assert rec["window"] == 9 and rec["attention_window"] is None  # asked for 9 = the rollout: evicts nothing


@pytest.mark.parametrize("extra, expect", [
    (["--sink", "2"], "--sink needs a rolling window"),
    (["--window", "3"], "at least 4 latent frames"),
    (["--kv-budget", "2 parsecs"], "not a size"),
    (["--kv-budget", "100B", "--codec", "identity"], "below the .* smallest rolling window"),
])
def test_bad_window_options_fail_before_anything_is_written(env, tmp_path, capsys, extra, expect):
    import re

    out = tmp_path / "run"
    assert main(argv(env, out, *extra, frames=33)) == 2
    err = capsys.readouterr().err
    assert re.search(expect, err), err
    assert not out.exists()
