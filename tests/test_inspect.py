"""`mmkv inspect kv`: the statistics on planted cases, the observer seam (reads only, sees what the cache stores), the
JSON layout on the tiny random DiT and AAR, determinism, and one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mmkv.cache import CacheConfig, KVStore
from mmkv.cli import main
from mmkv.inspect import KVObserver, channel_rms, first_block_mass, kmeans_residual, summarize, token_norms
from mmkv.pipelines.common import NoiseStream
from mmkv.pipelines.wan.loop import get_preset, rollout
from mmkv.pipelines.wan.tiny import TINY_DIT

pytestmark = pytest.mark.usefixtures("one_thread")
LAT_H, LAT_W = 4, 6
HEAD_KEYS = {"head", "key_pre_rope", "key", "value", "first_block_attention"}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------
# Statistics on planted cases


def test_channel_rms_finds_a_planted_outlier_channel():
    x = torch.randn(2000, 32, generator=gen(0))
    x[:, 7] *= 10
    s = channel_rms(x)
    assert 9 < s["rms_max_over_median"] < 11
    assert s["top_channels"][0] == 7 and len(s["top_channels"]) == 3
    assert 0.95 < channel_rms(torch.randn(2000, 32, generator=gen(1)))["rms_max_over_median"] < 1.2


def test_token_norms_spread_of_one_planted_token():
    x = torch.randn(1000, 64, generator=gen(2))
    x[123] *= 10
    s = token_norms(x)
    assert 8.5 < s["norm_max_over_median"] < 11.5
    assert 1 < s["norm_p99_over_median"] < 1.5  # one token in a thousand does not move p99


def test_kmeans_residual_is_zero_on_repeated_clusters_and_large_on_noise():
    centres = torch.randn(2, 4, 16, generator=gen(3)) * 3
    ids = torch.randint(0, 4, (2, 400), generator=gen(4))
    clustered = torch.gather(centres, 1, ids.unsqueeze(-1).expand(2, 400, 16))
    of_total, of_centred = kmeans_residual(clustered)
    assert of_total.shape == (2,) and (of_total < 1e-4).all() and (of_centred < 1e-4).all()
    noise, _ = kmeans_residual(torch.randn(2, 400, 16, generator=gen(5)))
    assert (noise > 0.4).all() and (noise < 1).all()
    assert torch.equal(kmeans_residual(clustered)[0], of_total)  # fixed seed: deterministic


def test_first_block_mass_on_planted_attention():
    d, first, total = 16, 12, 48
    u = torch.zeros(d)
    u[0] = 1.0
    k = torch.randn(2, total, d, generator=gen(6)) * 0.1
    k[:, :first] += 4 * u  # the first block's keys point along u ...
    q = (16 * u).expand(2, 20, d)  # ... and every query looks along u (logit 16 against ~0)
    mass = first_block_mass(q, k, first)
    assert mass.shape == (2,) and (mass > 0.999).all()
    # constant logits: the mass is the uniform share exactly; chunked queries give the same means
    zero_q = torch.zeros(2, 20, d)
    torch.testing.assert_close(first_block_mass(zero_q, k, first), torch.full((2,), first / total))
    torch.testing.assert_close(first_block_mass(q, k, first, max_elements=2 * total), mass)


def test_attach_requires_observable_layers_and_always_detaches():
    obs = KVObserver(2)
    with pytest.raises(ValueError, match="mmkv_layer"):
        with obs.attach(torch.nn.Linear(2, 2)):
            pass
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for i, m in enumerate(model):
        m.mmkv_layer = i
    with pytest.raises(RuntimeError, match="boom"):
        with obs.attach(model):
            assert model[1].mmkv_observer is obs
            raise RuntimeError("boom")
    assert not hasattr(model[0], "mmkv_observer") and not hasattr(model[1], "mmkv_observer")
    with pytest.raises(ValueError, match="nothing was committed"):
        summarize(obs)


# ----------------------------------------------------------------------------------------------------------------
# The observer on real rollouts


def native_store(num_layers=TINY_DIT["num_layers"], heads=TINY_DIT["num_attention_heads"],
                 head_dim=TINY_DIT["attention_head_dim"]):
    return KVStore(CacheConfig(codec=None, residual_window=1), num_layers=num_layers, num_heads=heads,
                   head_dim=head_dim)


def video_rollout(dit, context, store, observer=None):
    preset = get_preset("causvid")
    kwargs = dict(num_frames=9, latent_height=LAT_H, latent_width=LAT_W)
    with store.attach(dit.transformer):
        if observer is None:
            return rollout(dit, preset, context, NoiseStream(0, 0), **kwargs)
        with observer.attach(dit.transformer, blocks=dit.transformer.blocks):
            return rollout(dit, preset, context, NoiseStream(0, 0), **kwargs)


def test_observer_leaves_the_video_rollout_bit_identical_and_sees_what_the_cache_stores(dit, context):
    plain = video_rollout(dit, context, native_store())
    obs, store = KVObserver(TINY_DIT["num_layers"]), native_store()
    observed = video_rollout(dit, context, store, obs)
    assert torch.equal(plain.latents, observed.latents)
    assert not hasattr(dit.transformer.blocks[0].attn1, "mmkv_observer")
    tpf = dit.tokens_per_frame(LAT_H, LAT_W)
    for layer in range(store.num_layers):
        k_pre, k_post, v = obs.committed(layer)
        k_store, v_store = store.past(layer)
        assert torch.equal(k_post, k_store) and torch.equal(v, v_store)  # commit passes only, post-RoPE K
        assert k_pre.shape == k_post.shape == (1, 2, 9 * tpf, 32) and not torch.equal(k_pre, k_post)
        # RoPE rotates pairs of channels: per-token norms are kept
        torch.testing.assert_close(k_pre.norm(dim=-1), k_post.norm(dim=-1), atol=1e-5, rtol=1e-5)
        assert len(obs.mass[layer]) == 2 and len(obs.residual[layer]) == 3  # blocks 1, 2 / every commit

    stats = summarize(obs)
    assert [lay["layer"] for lay in stats["layers"]] == [0, 1]
    for lay in stats["layers"]:
        assert lay["tokens"] == 9 * tpf and lay["residual_stream"]["max_over_median"] > 1
        assert [h["head"] for h in lay["heads"]] == [0, 1]
        for h in lay["heads"]:
            assert set(h) == HEAD_KEYS
            assert h["key"]["rms_max_over_median"] >= 1 and len(h["key"]["top_channels"]) == 3
            assert 0 < h["value"]["kmeans_residual"] < 1
            fb = h["first_block_attention"]
            assert 0 < fb["mass"] < 1
            assert math.isclose(fb["uniform_share"], (1 / 2 + 1 / 3) / 2, rel_tol=1e-5)  # blocks 1 and 2
    assert stats["summary"]["key.rms_max_over_median"]["max"] >= stats["summary"]["key.rms_max_over_median"]["mean"]


def test_observer_on_aar_leaves_tokens_identical_and_covers_every_scale():
    from mmkv.inspect import inspect_aar
    from mmkv.pipelines.aar.sample import rollout as aar_rollout
    from mmkv.pipelines.aar.tiny import build_tiny, random_condition

    aar, sat = build_tiny("micro", seed=0)
    cond = random_condition(1, seed=0)
    plain = aar_rollout(aar, sat, cond, seed=3, key="c", store=native_store(2, 2, 64))
    stats, result = inspect_aar(aar, sat, cond, seed=3, key="c")
    assert result.tokens_sha256 == plain.tokens_sha256
    again = aar_rollout(aar, sat, cond, seed=3, key="c", store=native_store(2, 2, 64))
    assert plain.tokens_sha256 == again.tokens_sha256
    obs = KVObserver(2, scale=1.0)
    with obs.attach(aar, blocks=aar.blocks):
        observed = aar_rollout(aar, sat, cond, seed=3, key="c", store=native_store(2, 2, 64))
    assert observed.tokens_sha256 == plain.tokens_sha256 and torch.equal(observed.audio, plain.audio)
    assert len(stats["layers"]) == 2
    for lay in stats["layers"]:
        assert lay["tokens"] == 2 * sum(aar.patch_nums)  # CFG: conditional and null rows pooled per head
        assert len(lay["heads"]) == 2
        for h in lay["heads"]:
            assert set(h) == HEAD_KEYS | {"scales"}
            assert h["key_pre_rope"] == {**h["key"]}  # no RoPE in AAR
            assert [u["tokens"] for u in h["scales"]] == list(aar.patch_nums)
            # first scale = 1 token; later scales see 1 + 2, 1 + 2 + 3, 1 + 2 + 3 + 5 tokens
            assert math.isclose(h["first_block_attention"]["uniform_share"], (1 / 3 + 1 / 6 + 1 / 11) / 3,
                                rel_tol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# The command


def cli(out, *extra):
    return main(["inspect", "kv", "--model", "causal-forcing-frame", "--random-init", "--prompt", "A red fox",
                 "--frames", "9", "--out", str(out), *extra])


def test_cli_writes_json_and_plot_byte_identically(tmp_path, capsys):
    assert cli(tmp_path / "a") == 0
    assert cli(tmp_path / "b") == 0
    a = (tmp_path / "a" / "kv_stats.json").read_bytes()
    assert a == (tmp_path / "b" / "kv_stats.json").read_bytes()
    png = (tmp_path / "a" / "kv_stats.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    rec = json.loads(a)
    assert set(rec) == {"model", "rollout", "statistics", "layers", "summary"}
    assert rec["model"]["num_layers"] == TINY_DIT["num_layers"] and rec["model"]["weights"] == "random-init"
    assert rec["rollout"]["blocks"] == 3 and rec["rollout"]["grid"]["latent_frames"] == 3
    assert [len(lay["heads"]) for lay in rec["layers"]] == [TINY_DIT["num_attention_heads"]] * TINY_DIT["num_layers"]
    assert "kv_stats.json" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    ((), "give exactly one of --prompt TEXT or --prompts FILE"),
    (("--ckpt", "x.pt"), "--ckpt or --random-init, not both"),
    (("--prompts", "/nonexistent/prompts.txt"), "does not exist"),
    (("--kmeans-k", "0"), "--kmeans-k must be >= 1"),
    (("--device", "nodevice"), "not a torch device"),
])
def test_bad_flags_give_one_line_errors(tmp_path, capsys, extra, message):
    argv = ["inspect", "kv", "--model", "causvid", "--random-init", "--out", str(tmp_path / "o"), *extra]
    if extra and extra[0] in ("--ckpt", "--kmeans-k", "--device"):
        argv += ["--prompt", "p"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("mmkv inspect kv: error:")
    assert not (tmp_path / "o").exists()


def test_checkpoint_runs_need_ckpt_and_base(tmp_path, capsys):
    assert main(["inspect", "kv", "--model", "causvid", "--prompt", "p", "--out", str(tmp_path)]) == 2
    assert "--ckpt and --base are required" in capsys.readouterr().err
    assert main(["inspect", "kv", "--model", "causvid", "--ckpt", str(tmp_path / "none.pt"), "--base",
                 str(tmp_path), "--prompt", "p", "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def audio_cli(out, *extra):
    return main(["inspect", "kv", "--model", "aar", "--random-init", "--out", str(out), *extra])


def test_audio_cli_on_the_tiny_random_aar_writes_every_layer_head_and_scale_byte_identically(tmp_path, capsys):
    from mmkv.pipelines.aar.tiny import CONFIGS

    assert audio_cli(tmp_path / "a") == 0
    assert audio_cli(tmp_path / "b") == 0
    for name in ("kv_stats.json", "kv_stats.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "kv_stats.png").read_bytes().startswith(b"\x89PNG")
    rec = json.loads((tmp_path / "a" / "kv_stats.json").read_bytes())
    cfg = CONFIGS["tiny"][0]
    patch_nums = list(cfg.patch_nums)
    assert rec["model"]["weights"] == "random-init" and rec["model"]["patch_nums"] == patch_nums
    assert rec["rollout"]["seed"] == 42 and rec["rollout"]["scales"] == len(patch_nums) == 16
    assert [lay["layer"] for lay in rec["layers"]] == list(range(cfg.depth))
    seen = [sum(patch_nums[:i + 1]) for i in range(len(patch_nums))]
    for lay in rec["layers"]:
        assert [h["head"] for h in lay["heads"]] == list(range(cfg.num_heads))
        for h in lay["heads"]:
            assert [u["scale"] for u in h["scales"]] == list(range(16))
            assert [u["tokens"] for u in h["scales"]] == patch_nums
            assert h["scales"][0]["first_scale_attention"] is None and h["scales"][0]["uniform_share"] is None
            for u, n in zip(h["scales"][1:], seen[1:]):
                assert 0 < u["first_scale_attention"] < 1
                assert math.isclose(u["uniform_share"], patch_nums[0] / n, rel_tol=1e-5)
                # cosine attention caches unit-norm keys: RMS over channels is 1/sqrt(head_dim) at every scale
                assert math.isclose(u["key_rms"], cfg.head_dim ** -0.5, rel_tol=1e-4) and u["value_rms"] > 0
    assert [row["scale"] for row in rec["summary"]["scales"]] == list(range(16))
    assert "scale 15" in capsys.readouterr().out


def test_audio_cli_conditions_on_an_embeddings_entry_as_compare_audio(tmp_path):
    import numpy as np

    from mmkv.pipelines.aar.clap import embedding_sha256
    from mmkv.pipelines.aar.tiny import random_condition

    emb = random_condition(2, seed=5)
    np.savez(tmp_path / "emb.npz", first=emb[0].numpy(), second=emb[1].numpy())
    assert audio_cli(tmp_path / "o", "--embeddings", str(tmp_path / "emb.npz"), "--clip-index", "1") == 0
    rollout = json.loads((tmp_path / "o" / "kv_stats.json").read_bytes())["rollout"]
    assert rollout["item"] == "second" and rollout["condition_sha256"] == embedding_sha256(emb[1])


@pytest.mark.parametrize("extra,message", [
    (("--ckpt", "x.pt", "--aar", "d"), "give the video flags (--ckpt / --base) or the audio flags"),
    (("--base", "d", "--clip", "a.wav"), "not both (got --base, --clip)"),
    (("--model", "causvid", "--aar", "d"), "--model causvid is a video preset"),
    (("--random-init",), "give --model PRESET for video"),
    (("--model", "aar", "--random-init", "--prompt", "p"), "--prompt: video flag"),
    (("--model", "aar", "--random-init", "--clip", "a.wav"), "need --clap DIR or --embeddings PATH"),
    (("--aar", "d"), "give --clap DIR"),
])
def test_mixed_or_incomplete_audio_flags_give_one_line_errors(tmp_path, capsys, extra, message):
    assert main(["inspect", "kv", "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("mmkv inspect kv: error:")
    assert not (tmp_path / "o").exists()
