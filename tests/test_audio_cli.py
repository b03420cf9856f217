"""`mmkv compare audio` end to end on tiny models, CLAP offline, clip decoding, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from mmkv.cli import main
from mmkv.pipelines.aar import clap
from mmkv.pipelines.aar.tiny import random_condition, write_tiny_checkpoints

CONTRACT_KEYS = {
    "kind", "item", "item_index", "text", "variant", "preset", "k_codec", "v_codec", "bits", "effective_bits",
    "kv_bytes", "bf16_kv_bytes", "kv_ratio", "peak_kv_bytes", "noise_sha256", "seed", "model", "residual_window",
    "sample_rate", "peak_memory_bytes", "rank", "files", "versions",
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_clap(tmp_path_factory):
    """A random transformers ClapModel with a 512-d projection, saved like laion/larger_clap_general."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

    audio = dict(patch_embeds_hidden_size=16, depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 4, 8], hidden_size=128,
                 projection_dim=512)
    text = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=1, intermediate_size=16,
                projection_dim=512, max_position_embeddings=32)
    with torch.random.fork_rng():  # transformers initialises from the global RNG; keep it out of other tests
        torch.manual_seed(0)
        model = ClapModel(ClapConfig(text_config=text, audio_config=audio, projection_dim=512)).eval()
    d = tmp_path_factory.mktemp("clap")
    model.save_pretrained(d)
    ClapFeatureExtractor(truncation="rand_trunc", padding="repeatpad").save_pretrained(d)
    return d, model


def _tone(seconds: float, sr: int, freq: float, channels: int = 1, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    rng = np.random.default_rng(seed)
    x = 0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.size)
    return np.stack([x * (0.5 + 0.5 * c) for c in range(channels)], axis=1).astype(np.float32)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio_cli")
    write_tiny_checkpoints(root / "models", "micro", seed=5)
    clips = root / "clips"
    (clips / "sub").mkdir(parents=True)
    sf.write(clips / "a_stereo44k.wav", _tone(2.5, 44_100, 440, channels=2), 44_100, subtype="PCM_16")
    sf.write(clips / "sub" / "b_long.FLAC", _tone(11.0, 48_000, 220, seed=1)[:, 0], 48_000, format="FLAC")
    sf.write(clips / "c_short.ogg", _tone(0.3, 16_000, 880, seed=2)[:, 0], 16_000, format="OGG")
    sf.write(clips / "d_silent.wav", np.zeros(24_000, np.float32), 24_000)
    (clips / "e_corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt " + bytes(range(200)))
    (clips / "f_empty.flac").write_bytes(b"")
    (clips / "notes.txt").write_text("not audio")
    return root


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_compare_audio_end_to_end_with_bad_clips_and_resume(workdir, tiny_clap, capsys):
    clap_dir, _ = tiny_clap
    run = workdir / "run"
    argv = ["compare", "audio", "--aar", str(workdir / "models"), "--clap", str(clap_dir), "--clips",
            str(workdir / "clips"), "--codecs", "identity,kivi:bits=2", "--seed", "3", "--out", str(run),
            "--device", "cpu"]
    rc, out, err = _run(argv, capsys)
    assert rc == 1  # two clips failed, the others finished
    assert "e_corrupt.wav" in out and "f_empty.flac" in out

    manifest = json.loads((run / "manifest.rank0.json").read_text())
    failed = {f["item"]: f["error"] for f in manifest["failures"]}
    assert set(failed) == {"e_corrupt", "f_empty"}
    assert "e_corrupt.wav" in failed["e_corrupt"] and "0 bytes" in failed["f_empty"]

    good = ["a_stereo44k", "b_long", "c_short", "d_silent"]
    variants = ["reference", "identity_dtypenative", "kivi_bits2_group32_metafp16_rolek"]
    records = {}
    for item in good:
        for v in variants:
            d = run / "rollouts" / item / v
            rec = json.loads((d / "rollout.json").read_text())
            assert CONTRACT_KEYS <= set(rec), CONTRACT_KEYS - set(rec)
            assert rec["kind"] == "audio" and rec["item"] == item and rec["variant"] == v
            assert all((d / f).is_file() for f in rec["files"].values())
            records[item, v] = rec
        ref, ident = records[item, variants[0]], records[item, variants[1]]
        kivi = records[item, variants[2]]
        assert ref["noise_sha256"] == ident["noise_sha256"] == kivi["noise_sha256"]
        assert ref["condition_sha256"] == kivi["condition_sha256"]
        assert ref["tokens_sha256"] == ident["tokens_sha256"]
        a_ref, sr = sf.read(run / "rollouts" / item / "reference" / "audio.wav", dtype="float32")
        a_id, _ = sf.read(run / "rollouts" / item / variants[1] / "audio.wav", dtype="float32")
        assert sr == 24_000 and a_ref.shape == (1600,) and np.array_equal(a_ref, a_id)
        assert kivi["kv_bytes"] < ident["kv_bytes"] and kivi["effective_bits"] < 32
        # bits are of the encoded elements only (the report's legend says so); KV× counts the native window too
        c = kivi["cache"]
        assert kivi["effective_bits"] == (c["k_effective_bits"] + c["v_effective_bits"]) / 2
        assert kivi["kv_ratio"] == kivi["bf16_kv_bytes"] / kivi["kv_bytes"]
    assert records["d_silent", "reference"]["condition"]["silent"] is True
    assert records["c_short", "reference"]["condition"]["shorter_than_clap_window"] is True
    assert records["b_long", "reference"]["condition"]["truncated"] is True
    assert records["a_stereo44k", "reference"]["condition"]["sample_rate"] == 44_100
    # Different clips give different conditions.
    assert len({records[i, "reference"]["condition_sha256"] for i in good}) == len(good)

    metrics = {(r["item"], r["variant"]): r["metrics"] for r in manifest["rollouts"]}
    for item in good:
        m = metrics[item, variants[1]]
        assert m["snr_db"] == 120.0 and m["lsd_db"] == 0.0 and m["token_agreement"] == 1.0
    assert "overall" in out and "SNR@cap" in out and "4/4" in out

    # Resume: nothing finished is redone, the same table comes out.
    stamps = {p: p.stat().st_mtime_ns for p in run.glob("rollouts/*/*/rollout.json")}
    rc2, out2, _ = _run(argv, capsys)
    assert rc2 == 1
    assert stamps == {p: p.stat().st_mtime_ns for p in run.glob("rollouts/*/*/rollout.json")}
    assert out2.split("overall")[1] == out.split("overall")[1]


def test_precomputed_embeddings_wrong_size_and_rank_sharding(workdir, capsys, monkeypatch):
    emb = workdir / "emb"
    emb.mkdir()
    vecs = random_condition(4, seed=2).numpy()
    for i in range(4):
        np.save(emb / f"clip{i}.npy", vecs[i])
    np.save(emb / "clip4.npy", np.ones(300, np.float32))  # wrong size
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = workdir / "run_emb"
    argv = ["compare", "audio", "--aar", str(workdir / "models"), "--embeddings", str(emb), "--codecs", "identity",
            "--out", str(run), "--device", "cpu"]
    rc, out, _ = _run(argv, capsys)
    assert rc == 1 and "clip4.npy" in out and "512-d" in out
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["clip0", "clip2"]  # rank 0 of 2: items 0, 2
    monkeypatch.setenv("RANK", "1")
    rc, _, _ = _run(argv, capsys)
    assert rc == 0 and (run / "manifest.rank1.json").is_file()
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["clip0", "clip1", "clip2", "clip3"]


def test_empty_folder_and_missing_conditioner_are_usage_errors(workdir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    base = ["compare", "audio", "--aar", str(workdir / "models"), "--codecs", "identity", "--out", str(tmp_path / "r")]
    rc, _, err = _run(base + ["--embeddings", str(workdir / "emb"), "--clips", str(tmp_path / "empty")], capsys)
    assert rc == 2 and "no audio files under" in err and "empty" in err
    rc, _, err = _run(base + ["--clips", str(workdir / "clips")], capsys)
    assert rc == 2 and "--clap" in err


def test_clap_embedding_equals_get_audio_features_and_is_deterministic(tiny_clap):
    clap_dir, model = tiny_clap
    embedder = clap.ClapEmbedder(clap_dir)
    wave = _tone(12.0, 48_000, 300, seed=4)[:, 0]
    e1 = embedder.embed_wave(wave[: clap.CLAP_MAX_SAMPLES])
    e2 = embedder.embed_wave(wave[: clap.CLAP_MAX_SAMPLES])
    assert e1.shape == (512,) and torch.equal(e1, e2)
    assert float(e1.norm()) == pytest.approx(1.0, abs=1e-6)
    feats = embedder.features(wave[: clap.CLAP_MAX_SAMPLES], sampling_rate=48_000, return_tensors="pt")
    with torch.no_grad():
        ref = model.get_audio_features(**feats).pooler_output[0]
    torch.testing.assert_close(e1, ref)
    with pytest.raises(clap.ClipError, match="more than the CLAP window"):
        embedder.embed_wave(wave)


def test_decoding_resamples_and_downmixes(workdir):
    x, sr = clap.load_audio(workdir / "clips" / "a_stereo44k.wav")
    assert sr == 44_100 and x.ndim == 1 and x.size == int(2.5 * 44_100)
    clip = clap.prepare_clip(workdir / "clips" / "a_stereo44k.wav")
    assert abs(clip.wave.size - 2.5 * 48_000) <= 2 and clip.info["resampler"] in ("soxr-HQ", "scipy-resample_poly")
    # A 440 Hz tone stays at 440 Hz after resampling.
    spec = np.abs(np.fft.rfft(clip.wave[:48_000]))
    assert abs(np.argmax(spec) - 440) <= 1


def test_ffmpeg_containers_decode(workdir, tmp_path):
    import imageio_ffmpeg

    src = workdir / "clips" / "sub" / "b_long.FLAC"
    m4a = tmp_path / "clip.m4a"
    proc = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(src), "-t", "1", "-c:a", "aac",
                           str(m4a)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"this ffmpeg cannot encode AAC: {proc.stderr[-200:]!r}")
    x, sr = clap.load_audio(m4a)
    assert sr == 48_000 and abs(x.size - 48_000) < 4_096 and np.abs(x).max() > 0.1
    (tmp_path / "bad.m4a").write_bytes(b"\x00" * 64)
    with pytest.raises(clap.ClipError, match="bad.m4a"):
        clap.load_audio(tmp_path / "bad.m4a")


def test_embedding_files_are_validated(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((1, 512), np.float32))
    np.save(tmp_path / "y.npy", np.full(512, np.nan, np.float32))
    np.save(tmp_path / "z.npy", np.ones(511, np.float32))
    src = clap.EmbeddingSource(tmp_path)
    assert src.lookup("x")[0].shape == (512,)
    with pytest.raises(clap.ClipError, match="y.npy.*NaN"):
        src.lookup("y")
    with pytest.raises(clap.ClipError, match=r"z.npy.*512-d.*\(511,\)"):
        src.lookup("z")
    with pytest.raises(clap.ClipError, match="no w.npy"):
        src.lookup("w")


def test_laion_clap_is_never_imported_eagerly(tmp_path):
    code = ("import sys, mmkv.pipelines.aar.clap, mmkv.pipelines.audio_cli; "
            "assert 'laion_clap' not in sys.modules, 'laion_clap imported at module import'")
    subprocess.run([sys.executable, "-c", code], check=True)
    ckpt = tmp_path / "music_speech_audioset_epoch_15_esc_89.98.pt"
    ckpt.write_bytes(b"x")
    try:
        import laion_clap  # noqa: F401
    except ImportError:
        with pytest.raises(clap.ClipError, match=r"mmkv\[clap\]"):
            clap.LaionClapEmbedder(ckpt)


def test_compare_audio_without_aar_uses_the_shipped_models_or_says_none_are(workdir, tiny_clap, tmp_path, capsys,
                                                                            monkeypatch):
    import shutil

    import mmkv.assets
    from mmkv.assets import record_sums

    monkeypatch.setattr(mmkv.assets, "AUDIO_ASSETS", tmp_path / "absent")
    argv = ["compare", "audio", "--clips", str(workdir / "clips" / "a_stereo44k.wav"), "--codecs", "identity",
            "--out", str(tmp_path / "run0"), "--device", "cpu"]
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and "give --aar DIR: no trained audio models are shipped" in err and "Traceback" not in err

    shipped = tmp_path / "audio"
    shutil.copytree(workdir / "models", shipped)
    shutil.copytree(tiny_clap[0], shipped / "clap")
    record_sums(shipped)
    monkeypatch.setattr(mmkv.assets, "AUDIO_ASSETS", shipped)
    argv[-3] = str(tmp_path / "run1")
    rc, out, err = _run(argv, capsys)
    assert rc == 0, out + err
    config = json.loads((tmp_path / "run1" / "manifest.rank0.json").read_text())["config"]
    assert Path(config["aar_checkpoint"]) == shipped / "AAR_micro.pth"
    assert Path(config["conditioner"]["path"]) == shipped / "clap"

    (shipped / "SAT_micro.pth").write_bytes(b"swapped")
    argv[-3] = str(tmp_path / "run2")
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and "SAT_micro.pth: SHA-256" in err and err.count("\n") == 1
