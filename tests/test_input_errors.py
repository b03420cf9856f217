"""Bad input gets a one-line error naming the problem and what is accepted, never a traceback; Self-Forcing checkpoints
load and roll out; prompts are always cleaned with ftfy.

Covers `mmkv generate video`, `mmkv compare audio` and `mmkv demo`: `--out` under a file or on a read-only folder,
`--device` that this machine lacks or that is not a device, a head dimension Wan's RoPE cannot rotate, checkpoint files
that are not checkpoints or that pickle code, truncated and over-full-scale WAV clips.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tomllib
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from mmkv.cli import main
from mmkv.pipelines import common
from mmkv.pipelines.aar import clap
from mmkv.pipelines.aar.loaders import CheckpointError, load_aar, read_state_dict
from mmkv.pipelines.aar.tiny import build_tiny, write_tiny_checkpoints
from mmkv.pipelines.wan import loaders
from mmkv.pipelines.wan.loaders import LoadError
from mmkv.pipelines.wan.loop import get_preset
from mmkv.pipelines.wan.tiny import (
    original_state_dict, tiny_tokenizer, tiny_transformer, write_causvid_checkpoint, write_self_forcing_checkpoint,
    write_tiny_base,
)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    root = tmp_path_factory.mktemp("input_errors_video")
    transformer = tiny_transformer(seed=9)
    prompts = root / "prompts.txt"
    prompts.write_text("A red fox runs through snow.\nWaves on black rocks at dusk.\n")
    # A base folder whose DiT config has dim 60 over 4 heads: head dimension 15, which diffusers' RoPE asserts on.
    odd = root / "base_dim60"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"dim": 60, "num_heads": 4, "num_layers": 2, "ffn_dim": 128,
                                                 "text_dim": 32, "text_len": 16}))
    return {
        "root": root,
        "transformer": transformer,
        "base": write_tiny_base(root / "base", "diffusers", seed=4),
        "causvid": write_causvid_checkpoint(transformer, root / "causvid" / "model.pt").parent,
        "self_forcing": write_self_forcing_checkpoint(transformer, root / "sf" / "self_forcing_dmd.pt", seed=9),
        "prompts": prompts,
        "base_dim60": odd,
    }


def video_argv(env, out, *extra, model="causvid", ckpt=None):
    return ["generate", "video", "--model", model, "--ckpt", str(ckpt or env["causvid"]), "--base", str(env["base"]),
            "--prompts", str(env["prompts"]), "--frames", "33", "--height", "32", "--width", "48",
            "--out", str(out), *extra]


def one_line_error(capsys, argv, expect: str) -> str:
    """Run `mmkv argv`; it must exit 2 with one error line holding `expect` and no traceback."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    assert expect in lines[0], lines[0]
    return lines[0]


def _read_only_under(monkeypatch, folder: Path) -> None:
    """Make `folder` (and what lies below it) look read-only, as on a read-only mount: os.access says no. Root
    ignores permission bits, so chmod cannot simulate it."""
    real = os.access
    folder = folder.resolve()

    def access(path, mode, *args, **kwargs):
        p = Path(path).resolve()
        if mode & os.W_OK and (p == folder or folder in p.parents):
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


# ----------------------------------------------------------------------------------------------------------------
# --out, --device, head dimension: `mmkv generate video`


@pytest.mark.parametrize("case,expect", [
    ("out_under_file", "cannot be created: "),
    ("out_is_file", "exists and is a file, not a directory"),
    ("out_read_only", "is read-only or not writable"),
    ("device_cuda_missing", "torch sees no CUDA GPU on this machine"),
    ("device_tpu", "'tpu' is not a device mmkv runs on; expected cpu, cuda or cuda:N"),
    ("device_cpu_index", "'cpu:1' is not a device mmkv runs on"),
    ("head_dim_15", "head dimension 15 (dim 60 / num_heads 4)"),
    ("ckpt_random_bytes", "junk.pt is not a PyTorch or safetensors file"),
])
def test_generate_video_bad_setup_is_one_line(video, tmp_path, capsys, monkeypatch, case, expect):
    out = tmp_path / "run"
    argv = video_argv(video, out)
    if case == "out_under_file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "sub"
        argv[argv.index("--out") + 1] = str(out)
    elif case == "out_is_file":
        out.write_text("x")
    elif case == "out_read_only":
        (tmp_path / "ro").mkdir()
        _read_only_under(monkeypatch, tmp_path / "ro")
        out = tmp_path / "ro" / "run"
        argv[argv.index("--out") + 1] = str(out)
    elif case == "device_cuda_missing":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        argv += ["--device", "cuda"]
    elif case == "device_tpu":
        argv += ["--device", "tpu"]
    elif case == "device_cpu_index":
        argv += ["--device", "cpu:1"]
    elif case == "head_dim_15":
        argv[argv.index("--base") + 1] = str(video["base_dim60"])
    elif case == "ckpt_random_bytes":
        (tmp_path / "junk.pt").write_bytes(np.random.default_rng(3).integers(1, 128, 2048, dtype=np.uint8).tobytes())
        argv[argv.index("--ckpt") + 1] = str(tmp_path / "junk.pt")
    line = one_line_error(capsys, argv, expect)
    if case == "out_under_file":
        assert f"{tmp_path / 'file'} is a file" in line
    if case == "head_dim_15":
        assert "even head dimension of at least 6" in line
    if case != "out_is_file":
        assert not out.exists()  # nothing is created before the setup is known to be good


def test_device_names_a_missing_gpu_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(common.RunError, match=r"has 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        common.parse_device("cuda:2")
    assert common.parse_device("cuda:1") == torch.device("cuda", 1)
    assert common.parse_device("cpu") == torch.device("cpu")


def test_head_dimension_is_checked_in_both_layouts(video, tmp_path):
    with pytest.raises(LoadError, match=r"head dimension 15 \(dim 60 / num_heads 4\)"):
        loaders.read_dit_config(video["base_dim60"], "original")
    cfg = json.loads((video["base"] / "transformer" / "config.json").read_text())
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**cfg, "attention_head_dim": 4}))
    with pytest.raises(LoadError, match=r"head dimension 4 \(attention_head_dim 4\).*even number >= 6"):
        loaders.read_dit_config(tmp_path, "diffusers")
    assert loaders.read_dit_config(video["base"], "diffusers")["attention_head_dim"] == 32


# ----------------------------------------------------------------------------------------------------------------
# --out, --device: `mmkv compare audio` (checked before the conditioner or any model is touched) and `mmkv demo`


@pytest.mark.parametrize("case,expect", [
    ("out_under_file", "is a file, not a directory"),
    ("out_read_only", "is read-only or not writable"),
    ("device_tpu", "'tpu' is not a device mmkv runs on"),
    ("device_cuda_missing", "torch sees no CUDA GPU"),
])
def test_compare_audio_and_demo_bad_setup_is_one_line(tmp_path, capsys, monkeypatch, case, expect):
    out, device = tmp_path / "run", "cpu"
    if case == "out_under_file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "sub"
    elif case == "out_read_only":
        (tmp_path / "ro").mkdir()
        _read_only_under(monkeypatch, tmp_path / "ro")
        out = tmp_path / "ro" / "run"
    elif case == "device_tpu":
        device = "tpu"
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        device = "cuda"
    audio = ["compare", "audio", "--aar", str(tmp_path / "models"), "--embeddings", str(tmp_path / "emb"),
             "--codecs", "identity", "--out", str(out), "--device", device]
    one_line_error(capsys, audio, expect)
    one_line_error(capsys, ["demo", "--quick", "--out", str(out), "--device", device], expect)
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint files: not a checkpoint at all vs. a pickle holding code; both pipelines


class _Payload:
    def __reduce__(self):  # would call print if unpickled without weights_only
        return (print, ("pwned",))


def _no_advice(message: str) -> None:
    for words in ("weights_only", "will likely succeed", "trusted", "add_safe_globals"):
        assert words not in message, message


@pytest.mark.parametrize("reader", ["video", "audio"])
def test_random_bytes_are_not_a_checkpoint(tmp_path, reader):
    rng = np.random.default_rng(7)
    junk = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert junk[:2] != b"PK" and junk[0] != 0x80  # neither a zip nor a pickle by accident
    (tmp_path / "random.pt").write_bytes(junk)
    (tmp_path / "notes.pth").write_text("these are not weights\n" * 40)
    for name in ("random.pt", "notes.pth"):
        with pytest.raises((LoadError, CheckpointError)) as err:
            if reader == "video":
                loaders.read_state_file(tmp_path / name)
            else:
                read_state_dict(tmp_path / name, "model_state_dict")
        msg = str(err.value)
        assert f"{name} is not a PyTorch or safetensors file" in msg and "torch.save file" in msg, msg
        assert "pickled objects" not in msg
        _no_advice(msg)


@pytest.mark.parametrize("reader", ["video", "audio"])
def test_pickled_code_is_refused_and_named_without_torch_advice(tmp_path, reader, capsys):
    key = "generator" if reader == "video" else "model_state_dict"
    torch.save({key: {"x": torch.zeros(1)}, "evil": _Payload()}, tmp_path / "evil.pt")
    torch.save({key: {"x": torch.zeros(1)}, "evil": _Payload()}, tmp_path / "legacy.pt",
               _use_new_zipfile_serialization=False)
    for name in ("evil.pt", "legacy.pt"):
        with pytest.raises((LoadError, CheckpointError)) as err:
            if reader == "video":
                loaders.read_state_file(tmp_path / name)
            else:
                read_state_dict(tmp_path / name, key)
        msg = str(err.value)
        assert f"{name} holds pickled objects other than tensors" in msg and "print" in msg, msg
        assert "refusing to execute pickled code" in msg
        _no_advice(msg)
    assert "pwned" not in capsys.readouterr().out


def test_data_only_pickles_beside_the_weights_load_in_both_pipelines(tmp_path):
    """Numpy scalars and an argparse.Namespace (what training scripts save beside the weights) are data: read them,
    without unpickling anything else."""
    aar, _ = build_tiny("micro", seed=1)
    torch.save({"model_state_dict": aar.state_dict(), "step": np.float64(12.0), "epoch": np.int64(3),
                "args": argparse.Namespace(lr=1e-4, depth=2)}, tmp_path / "a.pth")
    assert load_aar(tmp_path / "a.pth").depth == 2
    transformer = tiny_transformer(seed=2)
    torch.save({"generator": {"model." + k: v for k, v in original_state_dict(transformer).items()},
                "step": np.float64(5.0), "config": argparse.Namespace(lr=2e-6)}, tmp_path / "dit.pt")
    obj = loaders.read_state_file(tmp_path / "dit.pt")
    assert obj["step"] == 5.0 and obj["config"].lr == 2e-6


def test_checkpoint_format_is_read_off_the_content(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4.0)}, str(tmp_path / "weights.pt"))  # safetensors under a .pt name
    assert common.checkpoint_format(tmp_path / "weights.pt") == "safetensors"
    assert torch.equal(loaders.read_state_file(tmp_path / "weights.pt")["w"], torch.arange(4.0))
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert common.checkpoint_format(tmp_path / "legacy.pth") == "torch-pickle"
    assert torch.equal(read_state_dict(tmp_path / "legacy.pth", "model_state_dict")["w"], torch.ones(2))


# ----------------------------------------------------------------------------------------------------------------
# Self-Forcing


def test_self_forcing_preset_is_the_chunkwise_recipe():
    sf_preset, cf = get_preset("self-forcing"), get_preset("causal-forcing-chunk")
    assert (sf_preset.frames_per_block, sf_preset.steps, sf_preset.shift, sf_preset.warp) == (
        3, (1000, 750, 500, 250), 5.0, True)
    assert sf_preset.schedules() == cf.schedules()  # warped on the shift-5 grid: 1000, 937.5, 833.3, 625
    rest = sf_preset.schedules()[1]
    assert rest[0] == 1000.0 and rest == sorted(rest, reverse=True) and abs(rest[-1] - 625.0) < 1e-3


def test_self_forcing_checkpoint_loads_ema_by_default_and_generator_on_request(video):
    config = loaders.read_dit_config(video["base"], "diffusers")
    obj = torch.load(video["self_forcing"], weights_only=True, map_location="cpu")
    assert set(obj) == {"generator", "critic", "generator_ema"}
    expected = video["transformer"].state_dict()
    dit, info = loaders.load_causal_dit(video["self_forcing"].parent, config)  # the folder holding the one file
    assert info["entry"] == "generator_ema"
    got = dit.transformer.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    trained, info = loaders.load_causal_dit(video["self_forcing"], config, key="generator")
    assert info["entry"] == "generator"
    w = trained.transformer.blocks[0].attn1.to_q.weight
    assert not torch.equal(w, expected["blocks.0.attn1.to_q.weight"])
    torch.testing.assert_close(w, expected["blocks.0.attn1.to_q.weight"], atol=1e-2, rtol=0)


def test_generate_video_self_forcing_rolls_out_and_records_ftfy(video, tmp_path):
    import ftfy

    out = tmp_path / "sf_run"
    assert main(video_argv(video, out, "--max-prompts", "1", model="self-forcing", ckpt=video["self_forcing"])) == 0
    rec = json.loads((out / "rollouts" / "p0000" / "reference" / "rollout.json").read_text())
    timings = json.loads((out / "rollouts" / "p0000" / "reference" / "timings.json").read_text())
    assert rec["model"] == "self-forcing" and len(timings["per_block"]) == 3  # 9 latent frames, blocks of 3
    frames = np.load(out / "rollouts" / "p0000" / "reference" / "frames.npy")
    assert frames.shape == (33, 32, 48, 3) and frames.std() > 1
    manifest = json.loads((out / "manifest.rank0.json").read_text())
    assert manifest["checkpoints"]["dit"]["entry"] == "generator_ema"
    assert manifest["config"]["preset"]["timesteps"] == get_preset("self-forcing").to_dict()["timesteps"]
    assert manifest["config"]["prompt_cleaning"]["ftfy"] == ftfy.__version__


# ----------------------------------------------------------------------------------------------------------------
# Prompts: always cleaned with ftfy


@pytest.mark.parametrize("raw,clean", [
    ("\u201cA red fox\u201d runs, it\u2019s snowing", "\"A red fox\" runs, it's snowing"),  # curly quotes
    ("\u00e2\u20ac\u0153A red fox\u00e2\u20ac\u009d &amp;amp; snow", "\"A red fox\" & snow"),  # UTF-8 read as cp1252
])
def test_prompts_are_cleaned_with_ftfy_to_the_same_token_ids(raw, clean):
    from mmkv.pipelines.wan.pipeline import clean_prompt

    tok = tiny_tokenizer()
    ids = tok([clean_prompt(raw)], padding="max_length", max_length=32, truncation=True).input_ids
    assert clean_prompt(raw) == clean
    assert ids == tok([clean], padding="max_length", max_length=32, truncation=True).input_ids
    assert ids != tok([raw], padding="max_length", max_length=32, truncation=True).input_ids  # unk ids otherwise


def test_missing_ftfy_is_a_clear_error_and_ftfy_is_a_dependency(monkeypatch):
    import sys

    from mmkv.pipelines.wan.pipeline import clean_prompt, prompt_cleaning

    monkeypatch.setitem(sys.modules, "ftfy", None)  # `import ftfy` now raises ImportError
    with pytest.raises(common.RunError, match=r"cleaned with ftfy.*pip install 'ftfy~=6.3.1'"):
        clean_prompt("a fox")
    with pytest.raises(common.RunError, match="ftfy is not installed"):
        prompt_cleaning()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("ftfy~=6.3") for d in deps), deps


# ----------------------------------------------------------------------------------------------------------------
# Clips: truncated WAVs, samples beyond full scale


def _wav(path: Path, x: np.ndarray, sr: int = 16_000, subtype: str = "PCM_16") -> Path:
    sf.write(str(path), x, sr, subtype=subtype, format="WAV")
    return path


def _tone(n: int, amplitude: float = 0.3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (amplitude * np.sin(np.arange(n) / 7.0) + 0.01 * rng.standard_normal(n)).astype(np.float32)


def test_truncated_wav_is_refused_with_frames_declared_and_present(tmp_path):
    full = _wav(tmp_path / "full.wav", _tone(16_000))
    (tmp_path / "cut.wav").write_bytes(full.read_bytes()[:200])  # a valid 44-byte header, then 156 bytes of audio
    with pytest.raises(clap.ClipError, match=r"cut\.wav is truncated: its WAV header declares 16000 frames of audio "
                                             r"but the file holds only 78 frames \(200 bytes in all\)"):
        clap.load_audio(tmp_path / "cut.wav")
    wave, sr = clap.load_audio(full)
    assert wave.shape == (16_000,) and sr == 16_000
    # A WAV written as a stream declares an unknown length (0xFFFFFFFF): read as it is.
    data = bytearray(full.read_bytes())
    at = data.index(b"data") + 4
    data[at:at + 4] = struct.pack("<I", 0xFFFFFFFF)
    (tmp_path / "stream.wav").write_bytes(bytes(data))
    clap.check_wav_length(tmp_path / "stream.wav")


def test_clip_beyond_full_scale_gets_a_warning_naming_it_and_its_peak(tmp_path):
    from mmkv.pipelines.audio_cli import clip_warnings

    loud = _wav(tmp_path / "loud.wav", _tone(8_000, amplitude=5.0), subtype="FLOAT")
    info = clap.prepare_clip(loud).info
    assert 4.9 < info["peak"] < 5.1
    (warning,) = clip_warnings(loud, info)
    assert "loud.wav" in warning and "peaks at 5" in warning and "above full scale 1" in warning
    assert clip_warnings(loud, {"peak": 0.99}) == [] and clip_warnings(None, {}) == []


def test_compare_audio_warns_on_a_loud_clip_and_fails_a_truncated_one(tmp_path, capsys):
    from mmkv.demo import write_tiny_clap

    write_tiny_checkpoints(tmp_path / "models", "micro", seed=3)
    clips = tmp_path / "clips"
    clips.mkdir()
    _wav(clips / "loud.wav", _tone(12_000, amplitude=5.0), subtype="FLOAT")
    full = _wav(tmp_path / "full.wav", _tone(16_000, seed=1))
    (clips / "cut.wav").write_bytes(full.read_bytes()[:200])
    argv = ["compare", "audio", "--aar", str(tmp_path / "models"), "--clap", str(write_tiny_clap(tmp_path / "clap")),
            "--clips", str(clips), "--codecs", "identity", "--out", str(tmp_path / "run"), "--device", "cpu"]
    assert main(argv) == 1  # the truncated clip failed, the loud one finished
    out = capsys.readouterr().out
    assert "warning: clip" in out and "loud.wav peaks at 5" in out
    assert "cut.wav is truncated" in out
    manifest = json.loads((tmp_path / "run" / "manifest.rank0.json").read_text())
    assert [f["item"] for f in manifest["failures"]] == ["cut"]
    assert (tmp_path / "run" / "rollouts" / "loud" / "reference" / "rollout.json").is_file()
