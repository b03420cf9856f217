"""AAR / SAT re-implementation: released key layout, strict checkpoint round trips, readable load errors."""

from __future__ import annotations

import argparse

import pytest
import torch

from mmkv.pipelines.aar.loaders import (
    CheckpointError,
    check_pair,
    find_checkpoints,
    load_aar,
    load_models,
    load_sat,
    save_released_format,
)
from mmkv.pipelines.aar.model import AARConfig, build_aar
from mmkv.pipelines.aar.sample import rollout
from mmkv.pipelines.aar.sat import SATConfig, build_sat
from mmkv.pipelines.aar.tiny import build_tiny, random_condition, write_tiny_checkpoints


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def micro():
    return build_tiny("micro", seed=11)


def test_full_size_state_dict_has_the_released_layout():
    # 222 keys, 307,556,608 parameters (counted from AAR model/aar.py and modules/basic_var.py); built on the meta
    # device, so nothing is allocated.
    aar = build_aar(AARConfig())
    sd = aar.state_dict()
    assert len(sd) == 222
    assert sum(p.numel() for p in aar.parameters()) == 307_556_608
    shapes = {
        "word_embed.weight": (1024, 128), "class_emb.fc1.weight": (1024, 512), "class_emb.fc2.weight": (1024, 1024),
        "uncond_embedding": (1, 512), "pos_start": (1, 1, 1024), "pos_1LC": (1, 455, 1024),
        "lvl_embed.weight": (16, 1024), "blocks.15.attn.scale_mul_1H11": (1, 16, 1, 1),
        "blocks.0.attn.zero_k_bias": (1024,), "blocks.7.attn.mat_qkv.weight": (3072, 1024),
        "blocks.3.ffn.fc1.weight": (4096, 1024), "blocks.3.ada_lin.1.weight": (6144, 1024),
        "head_nm.ada_lin.1.weight": (2048, 1024), "head.weight": (1024, 1024), "lvl_1L": (1, 455),
        "attn_bias_for_masking": (1, 1, 455, 455),
    }
    for key, shape in shapes.items():
        assert tuple(sd[key].shape) == shape, key
    assert sd["lvl_1L"].dtype == torch.int64
    assert not any(k.startswith("shared_ada_lin") for k in sd)

    sat = build_sat(SATConfig()).state_dict()
    assert tuple(sat["encoder.model.12.conv.conv.weight_v"].shape) == (512, 256, 16)
    assert tuple(sat["encoder.model.12.conv.conv.weight_g"].shape) == (512, 1, 1)
    assert tuple(sat["decoder.model.3.convtr.convtr.weight_v"].shape) == (512, 256, 16)
    assert tuple(sat["decoder.model.3.convtr.convtr.weight_g"].shape) == (512, 1, 1)  # dim 0 = input channels
    assert tuple(sat["decoder.model.1.lstm.weight_ih_l1"].shape) == (2048, 512)
    assert tuple(sat["quantizer.vq.quant_resi.qresi_ls.5.weight"].shape) == (128, 128, 9)
    assert tuple(sat["quantizer.vq.layers.15._codebook.embed"].shape) == (1024, 128)
    assert not any("project_in" in k for k in sat)  # d128/lat128: identity projections
    sat64 = build_sat(SATConfig(dimension=1024, latent_dim=64)).state_dict()
    assert tuple(sat64["quantizer.vq.project_in.weight"].shape) == (64, 1024)


def test_phi_schedule_matches_the_spec():
    # argmin |tick - si/15| over ticks linspace(1/12, 11/12, 6) (AAR quantization/core_vq.py):
    # si 0-2 -> phi0, 3-5 -> phi1, 6-7 -> phi2, 8-10 -> phi3, 11-12 -> phi4, 13-15 -> phi5.
    vq = build_sat(SATConfig()).quantizer.vq
    assert [vq.phi_index(si) for si in range(16)] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 5]


@pytest.mark.parametrize("style", ["module-prefix", "wrapped", "bare", "safetensors"])
def test_checkpoint_round_trip_loads_strictly_and_reproduces(tmp_path, micro, style):
    aar, sat = micro
    if style == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in aar.state_dict().items()}, str(tmp_path / "AAR.safetensors"))
        save_file({k: v.contiguous() for k, v in sat.state_dict().items()}, str(tmp_path / "SAT.safetensors"))
    else:
        prefix = "module." if style == "module-prefix" else ""
        save_released_format(aar, tmp_path / "AAR_x.pth", prefix=prefix, bare=style == "bare")
        save_released_format(sat, tmp_path / "SAT_x.pth", prefix=prefix, bare=style == "bare")
    aar2, sat2, info = load_models(tmp_path)
    assert info["aar_config"]["patch_nums"] == [1, 2, 3, 5]
    for a, b in ((aar, aar2), (sat, sat2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    cond = random_condition(1, seed=4)
    r1 = rollout(aar, sat, cond, seed=9, key="c")
    r2 = rollout(aar2, sat2, cond, seed=9, key="c")
    assert torch.equal(r1.audio, r2.audio) and torch.equal(r1.tokens_flat, r2.tokens_flat)


def test_uncond_embedding_is_loaded_not_redrawn(tmp_path, micro):
    aar, _ = micro
    sd = {k: v.clone() for k, v in aar.state_dict().items()}
    stored = torch.randn(1, 512, generator=torch.Generator().manual_seed(5))
    sd["uncond_embedding"] = stored
    torch.save({"model_state_dict": sd}, tmp_path / "a.pth")
    before = torch.random.get_rng_state()
    loaded = load_aar(tmp_path / "a.pth")
    assert torch.equal(loaded.uncond_embedding, stored)
    assert torch.equal(torch.random.get_rng_state(), before)  # loading draws nothing from the global RNG


def test_missing_and_extra_keys_fail_with_a_list(tmp_path, micro):
    aar, sat = micro
    sd = {"module." + k: v for k, v in aar.state_dict().items()}
    del sd["module.blocks.1.attn.q_bias"], sd["module.head.bias"]
    sd["module.blocks.0.attn.extra_scale"] = torch.ones(3)
    torch.save({"model_state_dict": sd}, tmp_path / "a.pth")
    with pytest.raises(CheckpointError) as err:
        load_aar(tmp_path / "a.pth")
    msg = str(err.value)
    assert "a.pth" in msg and "missing keys (2)" in msg and "unexpected keys (1)" in msg
    assert "blocks.1.attn.q_bias" in msg and "head.bias" in msg and "blocks.0.attn.extra_scale" in msg

    ssd = dict(sat.state_dict())
    ssd["decoder.model.15.conv.conv.bias"] = torch.zeros(2)
    torch.save({"generator_state_dict": ssd}, tmp_path / "s.pth")
    with pytest.raises(CheckpointError, match=r"shape mismatches \(1\): decoder\.model\.15\.conv\.conv\.bias"):
        load_sat(tmp_path / "s.pth", multi_scale=(1, 2, 3, 5))


def test_weight_norm_key_styles_are_accepted(tmp_path, micro):
    _, sat = micro
    sd = sat.state_dict()
    modern, folded = {}, {}
    for k, v in sd.items():
        if k.endswith("weight_g"):
            modern[k[:-8] + "parametrizations.weight.original0"] = v
        elif k.endswith("weight_v"):
            modern[k[:-8] + "parametrizations.weight.original1"] = v
            g = sd[k[:-1] + "g"]
            folded[k[:-8] + "weight"] = torch._weight_norm(v, g, 0)
        else:
            modern[k] = folded[k] = v
    f = torch.randn(1, 16, 5, generator=torch.Generator().manual_seed(2))
    ref = sat.fhat_to_audio(f)
    for name, d in (("modern", modern), ("folded", folded)):
        torch.save({"generator_state_dict": d}, tmp_path / f"{name}.pth")
        got = load_sat(tmp_path / f"{name}.pth", multi_scale=(1, 2, 3, 5)).fhat_to_audio(f)
        if name == "modern":
            assert torch.equal(got, ref)
        else:  # g = ||w|| recomputed: equal up to rounding
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_pickled_objects_are_refused(tmp_path, micro):
    aar, _ = micro
    torch.save({"model_state_dict": aar.state_dict(), "hook": print}, tmp_path / "a.pth")
    with pytest.raises(CheckpointError, match=r"holds pickled objects other than tensors .*builtins\.print"):
        load_aar(tmp_path / "a.pth")
    torch.save({"model_state_dict": aar.state_dict(), "args": argparse.Namespace(lr=1.0)}, tmp_path / "b.pth")
    assert load_aar(tmp_path / "b.pth").depth == 2  # training arguments are data, read without running code


def test_mismatched_pair_and_ambiguous_directory(tmp_path):
    aar, _ = build_tiny("micro", seed=1)
    _, sat16 = build_tiny("tiny", seed=1)
    with pytest.raises(CheckpointError, match="do not belong together"):
        check_pair(aar, sat16)
    write_tiny_checkpoints(tmp_path, "micro", seed=1)
    (tmp_path / "AAR_other.pth").write_bytes((tmp_path / "AAR_micro.pth").read_bytes())
    with pytest.raises(CheckpointError, match="several AAR checkpoints"):
        find_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="no SAT checkpoint"):
        find_checkpoints(_only_aar(tmp_path))


def _only_aar(tmp_path):
    d = tmp_path / "only_aar"
    d.mkdir()
    (d / "AAR_d16_bs2048.pth").write_bytes((tmp_path / "AAR_micro.pth").read_bytes())
    return d


def test_building_tiny_models_leaves_the_global_rng_alone():
    before = torch.random.get_rng_state()
    a1, s1 = build_tiny("micro", seed=3)
    a2, _ = build_tiny("micro", seed=3)
    rollout(a1, s1, random_condition(1, 0), seed=1, key="k")
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(a1.state_dict().values(), a2.state_dict().values()))
    # The tiny re-init makes attention matter: gamma slots of ada_lin are not ~1e-5.
    assert a1.blocks[0].ada_lin[1].weight[: 2 * a1.C].abs().mean() > 1e-3
