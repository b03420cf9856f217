"""Loaders: both checkpoint wrappers, both base-directory layouts, strict key checks and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmkv.pipelines.wan import loaders
from mmkv.pipelines.wan.loaders import LoadError, load_wan
from mmkv.pipelines.wan.tiny import (
    TINY_DIT, original_state_dict, tiny_text_encoder, tiny_transformer, tiny_vae, write_causal_forcing_checkpoint,
    write_causvid_checkpoint, write_tiny_base,
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_loaders")
    transformer = tiny_transformer(seed=7)
    return {
        "root": root,
        "transformer": transformer,
        "causvid": write_causvid_checkpoint(transformer, root / "causvid" / "model.pt"),
        "cf_ema": write_causal_forcing_checkpoint(transformer, root / "cf" / "causal_forcing.pt", ema=True),
        "cf_plain": write_causal_forcing_checkpoint(transformer, root / "cf_plain" / "chunk.pt", ema=False),
        "diffusers": write_tiny_base(root / "base_diffusers", "diffusers", seed=2),
        "original": write_tiny_base(root / "base_original", "original", seed=2),
    }


def test_key_map_agrees_with_diffusers_converter():
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    transformer = tiny_transformer(seed=1)
    original = original_state_dict(transformer)
    assert len(original) == loaders.expected_original_keys(TINY_DIT["num_layers"]) == 27 * 2 + 15
    assert "blocks.1.norm3.weight" in original and "head.modulation" in original
    converted = convert_wan_transformer_to_diffusers(dict(original))
    assert set(converted) == set(transformer.state_dict())
    assert all(loaders.dit_key_to_diffusers(k) in converted for k in original)


def test_real_1_3b_config_has_825_tensors_and_1560_tokens_per_frame():
    from diffusers import WanTransformer3DModel

    from mmkv.pipelines.wan.model import CausalWan

    cfg = {k: v for k, v in loaders.WAN21_T2V_1_3B.items() if k != "text_len"}
    with torch.device("meta"):
        dit = CausalWan(WanTransformer3DModel(**cfg))
    sd = dit.transformer.state_dict()
    assert len(sd) == loaders.expected_original_keys(30) == 825  # 27 per block x 30 + 15 (CausVid causal_model.py)
    assert sum(v.numel() for v in sd.values()) == 1_418_996_800
    assert dit.tokens_per_frame(60, 104) == 1560 and dit.head_dim == 128 and dit.num_layers == 30


@pytest.mark.parametrize("which,entry", [("causvid", "generator"), ("cf_ema", "generator_ema"),
                                         ("cf_plain", "generator")])
def test_both_checkpoint_wrappers_load_the_same_weights(files, which, entry):
    config = loaders.read_dit_config(files["diffusers"], "diffusers")
    ckpt = files[which].parent  # a directory holding one checkpoint
    dit, info = loaders.load_causal_dit(ckpt, config)
    assert info["entry"] == entry and info["num_tensors"] == 27 * TINY_DIT["num_layers"] + 15
    assert len(info["sha256"]) == 64
    expected = files["transformer"].state_dict()
    got = dit.transformer.state_dict()
    assert set(got) == set(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_flat_safetensors_with_comfy_prefix_loads(files, tmp_path):
    from safetensors.torch import save_file

    sd = {"model.diffusion_model." + k: v.contiguous() for k, v in original_state_dict(files["transformer"]).items()}
    save_file(sd, str(tmp_path / "dit.safetensors"))
    config = loaders.read_dit_config(files["original"], "original")
    dit, info = loaders.load_causal_dit(tmp_path / "dit.safetensors", config)
    assert info["entry"] is None
    w = dit.transformer.blocks[1].attn1.to_k.weight
    assert torch.equal(w, files["transformer"].blocks[1].attn1.to_k.weight)


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_base_layouts_load_vae_text_encoder_and_tokenizer(files, layout):
    comps = load_wan(files["cf_ema"], files[layout], device="cpu")
    assert comps.layout == layout and comps.dtype == torch.float32 and comps.text_len == 16
    ref_vae, ref_t5 = tiny_vae(seed=2), tiny_text_encoder(seed=2)
    for k, v in ref_vae.state_dict().items():
        assert torch.equal(comps.vae.state_dict()[k], v), k
    ids = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(comps.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   ref_t5(input_ids=ids, attention_mask=mask).last_hidden_state)
    tok = comps.tokenizer(["a red fox"], padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    assert tok.input_ids.shape == (1, 16) and int(tok.attention_mask.sum()) == 7 + 1  # 7 characters + </s>
    assert comps.files["dit"]["sha256"] and comps.files["vae"]["files"][0]["sha256"]


def test_loaded_vae_convolves_through_onednn_on_the_cpu_and_agrees_with_the_default_path(files):
    """The loader routes the VAE's 3-D convolutions through oneDNN on the CPU (torch sends batch-1 5-D inputs to
    its one-thread slow_conv3d): its decode and encode agree with an unpatched copy's to float32 rounding, and with
    autograd on it is the default path exactly."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    comps = load_wan(files["cf_ema"], files["diffusers"], device="cpu")
    ref = tiny_vae(seed=2).eval()
    convs = [m for m in comps.vae.modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all("_conv_forward" in vars(m) for m in convs)
    assert not any("_conv_forward" in vars(m) for m in ref.modules())
    z = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, want = comps.vae.decode(z).sample, ref.decode(z).sample
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(comps.vae.encode(out).latent_dist.mean, ref.encode(out).latent_dist.mean,
                                   rtol=1e-4, atol=1e-5)
    conv = next(m for m in convs if m.kernel_size == (3, 3, 3))
    x = torch.randn(1, conv.in_channels, 4, 6, 8, generator=torch.Generator().manual_seed(2))
    with torch.enable_grad():
        assert torch.equal(conv._conv_forward(x, conv.weight, conv.bias),
                           torch.nn.Conv3d._conv_forward(conv, x, conv.weight, conv.bias))
    with torch.no_grad():
        torch.testing.assert_close(conv._conv_forward(x, conv.weight, conv.bias),
                                   torch.nn.Conv3d._conv_forward(conv, x, conv.weight, conv.bias),
                                   rtol=1e-4, atol=1e-5)


def test_loaded_vae_takes_its_rms_norms_as_a_sum_of_squares_on_the_cpu(files):
    """The loader's VAE computes each RMS norm's channel norm as the square root of a sum of squares on the CPU
    (float32, no autograd; `cpu_vae_paths_`): within float32 rounding of diffusers' `F.normalize`, and diffusers'
    own code exactly with autograd on."""
    comps = load_wan(files["cf_ema"], files["diffusers"], device="cpu")
    norms = [m for m in comps.vae.modules() if type(m).__name__ == "WanRMS_norm"]
    assert norms and all("forward" in vars(m) for m in norms)
    norm = next(m for m in norms if m.channel_first)
    with torch.no_grad():
        norm.gamma.copy_(torch.linspace(0.5, 1.5, norm.gamma.numel()).view_as(norm.gamma))
    x = torch.randn(1, norm.gamma.shape[0], 3, 5, 7, generator=torch.Generator().manual_seed(3)) * 4
    x[0, :, 0, 0, 0] = 0.0  # an all-zero channel vector: eps, not a division by zero
    with torch.no_grad():
        fast, want = norm(x), type(norm).forward(norm, x)
    assert not torch.isnan(fast).any()
    torch.testing.assert_close(fast, want, rtol=1e-6, atol=1e-6)
    with torch.enable_grad():
        assert torch.equal(norm(x), type(norm).forward(norm, x))


# ----------------------------------------------------------------------------------------------------------------
# Bad input


def test_missing_checkpoint(files, tmp_path):
    config = loaders.read_dit_config(files["diffusers"], "diffusers")
    with pytest.raises(LoadError, match=r"nowhere\.pt does not exist"):
        loaders.load_causal_dit(tmp_path / "nowhere.pt", config)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(LoadError, match="empty_dir holds no .pt"):
        loaders.load_causal_dit(tmp_path / "empty_dir", config)


def test_corrupt_and_truncated_checkpoints(files, tmp_path):
    config = loaders.read_dit_config(files["diffusers"], "diffusers")
    data = files["causvid"].read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match=r"truncated\.pt is corrupt or truncated"):
        loaders.load_causal_dit(tmp_path / "truncated.pt", config)
    (tmp_path / "garbage.safetensors").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(LoadError, match=r"garbage\.safetensors is not a readable safetensors file"):
        loaders.load_causal_dit(tmp_path / "garbage.safetensors", config)
    (tmp_path / "zero.pt").write_bytes(b"")
    with pytest.raises(LoadError, match=r"zero\.pt is empty"):
        loaders.load_causal_dit(tmp_path / "zero.pt", config)


class _Payload:
    def __reduce__(self):  # would run code if unpickled without weights_only
        return (print, ("pwned",))


def test_pickled_code_is_refused(files, tmp_path):
    config = loaders.read_dit_config(files["diffusers"], "diffusers")
    torch.save({"generator": {"model.x": torch.zeros(1)}, "evil": _Payload()}, tmp_path / "evil.pt")
    with pytest.raises(LoadError, match=r"evil\.pt holds pickled objects .* refusing to execute"):
        loaders.load_causal_dit(tmp_path / "evil.pt", config)


def test_wrong_key_layout_lists_missing_and_unexpected(files, tmp_path):
    config = loaders.read_dit_config(files["diffusers"], "diffusers")
    sd = original_state_dict(files["transformer"])
    sd.pop("blocks.1.self_attn.q.weight")
    sd["blocks.1.self_attn.q_proj.weight"] = torch.randn(64, 64)
    torch.save({"generator": {"model." + k: v for k, v in sd.items()}}, tmp_path / "renamed.pt")
    with pytest.raises(LoadError) as err:
        loaders.load_causal_dit(tmp_path / "renamed.pt", config)
    msg = str(err.value)
    assert "renamed.pt" in msg and "Missing keys (1): blocks.1.self_attn.q.weight" in msg
    assert "Unexpected keys (1): blocks.1.self_attn.q_proj.weight" in msg
    torch.save({"critic": {"model.x": torch.zeros(1)}}, tmp_path / "critic_only.pt")
    with pytest.raises(LoadError, match="neither 'generator_ema' nor 'generator'.*critic"):
        loaders.load_causal_dit(tmp_path / "critic_only.pt", config)
    # a checkpoint of another width: shapes are checked against the config
    sd = original_state_dict(files["transformer"])
    sd["blocks.0.ffn.0.weight"] = torch.randn(99, 64)
    torch.save({"generator": sd}, tmp_path / "wide.pt")
    with pytest.raises(LoadError, match=r"blocks\.0\.ffn\.0\.weight \(99, 64\) \(expected \(128, 64\)\)"):
        loaders.load_causal_dit(tmp_path / "wide.pt", config)


def test_bad_base_directory(files, tmp_path):
    with pytest.raises(LoadError, match="does not exist"):
        load_wan(files["causvid"], tmp_path / "no_base")
    (tmp_path / "junk").mkdir()
    with pytest.raises(LoadError, match="neither the original Wan2.1 layout"):
        load_wan(files["causvid"], tmp_path / "junk")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match=r"config\.json is not valid JSON"):
        load_wan(files["causvid"], broken)
    assert Path(files["original"], "Wan2.1_VAE.pth").is_file()


def test_tiny_checkpoint_writers_give_identical_bytes_for_the_same_model(tmp_path):
    """The demo's assets are part of an identical run's identical bytes: the CausVid and Self-Forcing writers draw
    their critic stand-ins from seeded generators, never the global RNG."""
    import hashlib

    from mmkv.pipelines.wan.tiny import write_causvid_checkpoint, write_self_forcing_checkpoint

    transformer = tiny_transformer(seed=0)
    for write in (write_causvid_checkpoint, write_self_forcing_checkpoint):
        digests = set()
        for i in range(2):
            torch.manual_seed(i)  # a different global RNG state each time must not matter
            path = write(transformer, tmp_path / f"{write.__name__}{i}" / "model.pt")
            digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
        assert len(digests) == 1, write.__name__
