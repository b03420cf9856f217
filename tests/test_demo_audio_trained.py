"""Trained audio models shipped in the package: `ship_audio` writes the bf16 release the loaders read (checked by its
SHA256SUMS, refusing a non-empty folder), and `mmkv demo` runs its audio half on them, on held-out procedural clips
with their captions, in a folder no random run can share.

The stand-in for the shipped models: random models of `mmkv train audio`'s `micro` architectures (0.107 s clips, the
shortest the adherence score reads) and the demo's tiny random CLAP, shipped through `ship_audio`."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

import mmkv.assets
from mmkv import demo
from mmkv.assets import AssetError, read_sums, trained_audio_assets
from mmkv.cli import main
from mmkv.codecs.base import private_generator
from mmkv.pipelines.aar import sounds
from mmkv.pipelines.aar.loaders import (
    CheckpointError, EncoderLeftOut, fill_dropped, infer_sat_config, load_models, read_state_dict, release_drops,
    save_released_format,
)
from mmkv.pipelines.aar.model import build_aar
from mmkv.pipelines.aar.release import ship_audio
from mmkv.pipelines.aar.sat import build_sat
from mmkv.pipelines.common import RunError, sha256_file

pytestmark = pytest.mark.usefixtures("one_thread")


def write_trained_layout(root: Path) -> dict[str, Path]:
    """fp32 checkpoints of the micro architectures as `mmkv train audio` writes them, and a CLAP folder."""
    from mmkv.pipelines.aar import train

    cfg = train.get_config("micro")
    aar = build_aar(train.aar_config(cfg), "meta").to_empty(device="cpu")
    aar.init_weights(private_generator(5, "test-aar"), init_adaln=0.5, init_adaln_gamma=1.0, init_head=1.0)
    sat = build_sat(cfg.sat_config(), "meta").to_empty(device="cpu")
    sat.init_weights(private_generator(5, "test-sat"))
    with torch.no_grad():  # EMA state unlike what the loaders rebuild, so a test can tell them apart
        for layer in sat.quantizer.vq.layers:
            layer._codebook.cluster_size.fill_(3.0)
    return {"aar": save_released_format(aar.eval(), root / "aar" / "AAR_micro.pth"),
            "sat": save_released_format(sat.eval(), root / "sat" / "SAT_micro.pth", prefix="module."),
            "clap": demo.write_tiny_clap(root / "clap", seed=5)}


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_trained_layout(tmp_path_factory.mktemp("train_out"))


@pytest.fixture(scope="module")
def release(source, tmp_path_factory):
    return ship_audio(source["aar"], source["sat"], source["clap"], tmp_path_factory.mktemp("assets") / "audio")


@pytest.fixture(scope="module")
def trained(release, tmp_path_factory):
    """`mmkv demo --quick` with the release installed as the shipped audio models (random video: none shipped)."""
    out = tmp_path_factory.mktemp("demo") / "trained-audio"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mmkv.assets, "AUDIO_ASSETS", release)
        mp.setattr(mmkv.assets, "VIDEO_ASSETS", tmp_path_factory.mktemp("no_video"))
        rc, stdout, stderr = _cli("demo", "--quick", "--trained", "--seed", "2", "--out", str(out))
    assert rc == 0, stdout + stderr
    return out, stdout


# ----------------------------------------------------------------------------------------------------------------
# The release


def test_release_is_bf16_without_the_dropped_state_and_its_sums_check(source, release):
    assert sorted(p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file()) == [
        "AAR_micro.pth", "SAT_micro.pth", "SHA256SUMS", "clap/config.json", "clap/model.safetensors",
        "clap/preprocessor_config.json"]
    assert trained_audio_assets(release)["sums_sha256"]
    assert set(read_sums(release / "SHA256SUMS")) == {"AAR_micro.pth", "SAT_micro.pth", "clap/config.json",
                                                      "clap/model.safetensors", "clap/preprocessor_config.json"}
    for name, key, what in (("AAR_micro.pth", "model_state_dict", "AAR"), ("SAT_micro.pth", "generator_state_dict",
                                                                            "SAT")):
        full = read_state_dict(source[what.lower()], key)
        shipped = torch.load(release / name, weights_only=True)[key]
        assert set(shipped) == {k for k in full if not release_drops(k, what)} != set(full)
        for k, v in shipped.items():
            assert v.dtype == (torch.bfloat16 if full[k].is_floating_point() else full[k].dtype), k
            assert torch.equal(v, full[k].to(v.dtype)), k
    from safetensors.torch import load_file

    clap = load_file(release / "clap" / "model.safetensors")
    assert {v.dtype for v in clap.values() if v.is_floating_point()} == {torch.bfloat16}
    assert {v.dtype for v in clap.values() if not v.is_floating_point()} == {torch.int64}  # position ids kept


def test_loaders_read_the_release_as_the_rounded_full_checkpoint(source, release):
    aar, sat, info = load_models(release)
    full_aar, full_sat, full_info = load_models(source["aar"].parent, sat=source["sat"])
    assert info["aar_config"] == full_info["aar_config"] and info["sat_config"] == full_info["sat_config"]
    for model, full in ((aar, full_aar), (sat, full_sat)):
        full_sd = full.state_dict()
        for k, v in model.state_dict().items():
            assert v.dtype == full_sd[k].dtype, k  # loaded into fp32 like a full checkpoint
            if "embed_avg" in k or "cluster_size" in k:
                continue
            want = full_sd[k].to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else full_sd[k]
            assert torch.equal(v, want), k
    assert torch.equal(aar.attn_bias_for_masking, full_aar.attn_bias_for_masking)  # rebuilt exactly
    assert isinstance(sat.encoder, EncoderLeftOut)
    with pytest.raises(CheckpointError, match="without its encoder"):
        sat.encoder(torch.zeros(1, 1, 2560))


def test_a_full_checkpoint_loads_as_before(source):
    sd = read_state_dict(source["sat"], "generator_state_dict")
    filled = fill_dropped(sd, "SAT")
    assert filled.keys() == sd.keys() and all(filled[k] is sd[k] for k in sd)
    stripped = {k: v for k, v in sd.items() if not release_drops(k, "SAT")}
    scales = (1, 2, 4, 8)
    assert infer_sat_config(stripped, scales) == infer_sat_config(sd, scales)
    _, sat, _ = load_models(source["aar"].parent, sat=source["sat"])
    assert not isinstance(sat.encoder, EncoderLeftOut)
    assert float(sat.quantizer.vq.layers[0]._codebook.cluster_size[0]) == 3.0  # the file's, not the rebuilt 1


def test_ship_refuses_a_non_empty_folder_and_names_it(source, release, tmp_path):
    before = {p: sha256_file(p) for p in release.rglob("*") if p.is_file()}
    with pytest.raises(RunError, match="not an empty folder"):
        ship_audio(source["aar"], source["sat"], source["clap"], release)
    assert {p: sha256_file(p) for p in release.rglob("*") if p.is_file()} == before
    rc, _, err = _cli("ship", "audio", "--aar", str(source["aar"]), "--sat", str(source["sat"]),
                      "--clap", str(source["clap"]), "--out", str(release))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and str(release) in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = _cli("ship", "audio", "--aar", str(source["aar"]), "--sat", str(source["sat"]),
                        "--clap", str(source["clap"]), "--out", str(empty))
    assert rc == 0, err
    assert (empty / "SHA256SUMS").read_bytes() == (release / "SHA256SUMS").read_bytes()  # same bytes every time
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]  # no staging folder left


def test_ship_refuses_a_sat_of_another_aar(source, tmp_path):
    from mmkv.pipelines.aar.tiny import write_tiny_checkpoints

    _, other_sat = write_tiny_checkpoints(tmp_path / "other", "micro")
    with pytest.raises(CheckpointError):
        ship_audio(source["aar"], other_sat, source["clap"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------------
# The demo's audio half


def test_demo_audio_half_reads_the_shipped_models_and_held_out_clips(trained, release):
    out, stdout = trained
    manifest = json.loads((out / "runs" / "audio" / "manifest.rank0.json").read_text())["config"]
    assert Path(manifest["aar_checkpoint"]) == release / "AAR_micro.pth"
    assert manifest["aar_sha256"] == read_sums(release / "SHA256SUMS")["AAR_micro.pth"]
    assert manifest["sat_sha256"] == read_sums(release / "SHA256SUMS")["SAT_micro.pth"]
    seeds = sounds.held_out_seeds(demo.PLANS["quick"].clips)
    assert [Path(c).name for c in manifest["clips"]] == [f"heldout_{s}.wav" for s in seeds]
    import soundfile as sf

    for seed in seeds:
        rec = json.loads((out / "runs" / "audio" / "rollouts" / f"heldout_{seed}" / "reference" /
                          "rollout.json").read_text())
        assert rec["caption"] == sounds.caption(sounds.sample_sound(seed))
        info = sf.info(str(out / "assets" / "clips" / f"heldout_{seed}.wav"))
        assert (info.samplerate, info.frames) == (24_000, 2560)  # the micro SAT's rate and clip length
    assert "the trained tiny audio models" in stdout and str(release) in stdout


def test_demo_identity_names_the_audio_weights_and_folders_never_mix(trained, release, tmp_path):
    out, _ = trained
    shipped = trained_audio_assets(release)
    stored = json.loads((out / "demo.json").read_text())
    assert stored["audio_weights"] == shipped["sums_sha256"]
    plan = demo.PLANS["quick"]
    assert demo._identity(plan, 2, None, shipped) != demo._identity(plan, 2, None)
    assert "audio_weights" not in demo._identity(plan, 2, None)  # random folders stay as they were
    rc, _, err = _cli("demo", "--random", "--quick", "--seed", "2", "--out", str(out))
    assert rc == 2 and "holds a demo made with" in err
    random_dir = tmp_path / "random"
    random_dir.mkdir()
    demo._check_identity(random_dir, demo._identity(plan, 2, None))
    with pytest.raises(demo.UsageError, match="holds a demo made with"):
        demo._check_identity(random_dir, demo._identity(plan, 2, None, shipped))


def test_a_broken_shipped_audio_file_is_one_line(release, tmp_path, monkeypatch):
    broken = tmp_path / "audio"
    broken.mkdir()
    for p in release.rglob("*"):
        if p.is_file():
            (broken / p.relative_to(release)).parent.mkdir(parents=True, exist_ok=True)
            (broken / p.relative_to(release)).write_bytes(p.read_bytes())
    data = bytearray((broken / "SAT_micro.pth").read_bytes())
    data[-100] ^= 1
    (broken / "SAT_micro.pth").write_bytes(bytes(data))
    with pytest.raises(AssetError, match="SAT_micro.pth: SHA-256"):
        trained_audio_assets(broken)
    monkeypatch.setattr(mmkv.assets, "AUDIO_ASSETS", broken)
    monkeypatch.setattr(mmkv.assets, "VIDEO_ASSETS", tmp_path / "no_video")
    rc, stdout, err = _cli("demo", "--quick", "--out", str(tmp_path / "demo"))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("mmkv demo: error: ") and "SAT_micro.pth" in err


def test_held_out_sounds_are_rendered_at_the_given_rate_with_their_captions():
    clips = demo.held_out_sounds(3, 32_000, 16_000)
    seeds = sounds.held_out_seeds(3)
    assert [name for name, _, _ in clips] == [f"heldout_{s}" for s in seeds]
    assert [cap for _, _, cap in clips] == [sounds.caption(sounds.sample_sound(s)) for s in seeds]
    for (_, wave, _), seed in zip(clips, seeds):
        assert wave.shape == (16_000,) and wave.dtype.name == "float32"
        assert torch.equal(torch.from_numpy(wave), sounds.render(sounds.sample_sound(seed), 32_000, 0.5)[0])
