"""`mmkv demo --quick --random` end to end: assets in their release formats, the run folders, the report, the
gallery, the headline, and a resumed rerun that renders nothing again. `--random` wins over shipped trained weights,
and without them the demo falls back to the random models, saying so (tests/test_demo_trained.py: the trained
mode)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

import mmkv.assets
from mmkv.assets import record_sums
from mmkv.cli import main
from mmkv.demo import PLANS
from mmkv.pipelines.common import parse_codec_list

PLAN = PLANS["quick"]
VIDEO = PLAN.video[0].preset


def _demo(out: Path, *extra: str, assets: Path) -> tuple[int, str, float]:
    """`mmkv demo --quick` with `assets` as the folder of shipped trained video weights (and no audio ones)."""
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf), pytest.MonkeyPatch.context() as mp:
        mp.setattr(mmkv.assets, "VIDEO_ASSETS", assets)
        mp.setattr(mmkv.assets, "AUDIO_ASSETS", assets.parent / "no_audio")
        rc = main(["demo", "--quick", "--seed", "3", "--out", str(out), *extra])
    return rc, buf.getvalue(), time.perf_counter() - t0


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """--random beside shipped weights whose sums check out (placeholder bytes: rendering them would fail)."""
    shipped = tmp_path_factory.mktemp("assets") / "video"
    for name in ("base/transformer/config.json", "causvid/model.pt"):
        (shipped / name).parent.mkdir(parents=True, exist_ok=True)
        (shipped / name).write_text("not a model\n")
    record_sums(shipped)
    out = tmp_path_factory.mktemp("demo") / "tmp"
    rc, stdout, seconds = _demo(out, "--random", assets=shipped)
    assert rc == 0, stdout
    return out, stdout, seconds


def test_random_wins_over_shipped_weights(demo):
    out, stdout, _ = demo
    assert stdout.startswith("mmkv demo (quick): tiny random models") and "not installed" not in stdout
    assert json.loads((out / "demo.json").read_text())["video_weights"] == "random"


def _rollouts(run: Path) -> dict[tuple[str, str], dict]:
    return {(p.parent.parent.name, p.parent.name): json.loads(p.read_text())
            for p in sorted(run.glob("rollouts/*/*/rollout.json"))}


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_assets_are_in_release_formats(demo):
    out, _, _ = demo
    assets = json.loads((out / "assets" / "assets.json").read_text())
    base = Path(assets["wan_base"])
    for name in ("Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth", "config.json"):
        assert (base / name).is_file(), name
    causvid = torch.load(Path(assets["causvid"]) / "model.pt", weights_only=True, map_location="cpu")
    assert set(causvid) == {"generator", "critic"} and all(k.startswith("model.") for k in causvid["generator"])
    cf = torch.load(assets["causal_forcing"], weights_only=True, map_location="cpu")
    assert all(k.startswith("model._fsdp_wrapped_module.") for k in cf["generator_ema"])
    aar = torch.load(assets["aar"], weights_only=True, map_location="cpu")
    sat = torch.load(assets["sat"], weights_only=True, map_location="cpu")
    assert "model_state_dict" in aar and "generator_state_dict" in sat
    clap = {p.name for p in Path(assets["clap"]).iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= clap
    assert len(assets["clips"]) == PLAN.clips
    for clip in assets["clips"]:
        x, sr = sf.read(clip)
        assert x.shape[0] >= sr and np.abs(x).max() > 0.1  # seconds of real signal, not silence
    prompts = Path(assets["prompts"]).read_text().splitlines()
    assert len(prompts) == PLAN.prompts and len(set(prompts)) == PLAN.prompts


def test_runs_hold_reference_and_every_codec(demo):
    out, _, _ = demo
    variants = {"reference"} | {s.variant for s in parse_codec_list(",".join(PLAN.codecs), value_group=32)}
    video = _rollouts(out / "runs" / VIDEO)
    audio = _rollouts(out / "runs" / "audio")
    assert {v for _, v in video} == variants and len(video) == PLAN.prompts * len(variants)
    assert {v for _, v in audio} == variants and len(audio) == PLAN.clips * len(variants)
    for (item, variant), rec in video.items():  # common random numbers: every variant drew the reference's noise
        assert rec["noise_sha256"] == video[item, "reference"]["noise_sha256"]
        assert (out / "runs" / VIDEO / "rollouts" / item / variant / "video.mp4").stat().st_size > 1000
    for (item, variant), rec in audio.items():
        assert rec["noise_sha256"] == audio[item, "reference"]["noise_sha256"]


def test_tables_have_a_row_per_codec_preset(demo):
    out, stdout, _ = demo
    report = out / "report"
    for name in ("table.md", "table.csv", "table.json", "table.tex", "rollouts.csv", "frames.csv", "index.html"):
        assert (report / name).stat().st_size > 200, name
    assert len(list((report / "plots").glob("*.png"))) >= 4
    table = json.loads((report / "table.json").read_text())
    keys = [c["key"] for c in table["columns"]]
    rows = table["rows"]
    presets = {s.preset for s in parse_codec_list(",".join(PLAN.codecs), value_group=32)}
    assert sorted(r["preset"] for r in rows) == sorted(presets)
    video_n = [k for k in keys if k.endswith("/n") and k.startswith(VIDEO)]
    audio_n = [k for k in keys if k.endswith("/n") and k.startswith("AAR")]
    assert video_n and audio_n
    for r in rows:
        assert r[video_n[0]] == PLAN.prompts and r[audio_n[0]] == PLAN.clips, r
    # the headline printed: one Markdown table per modality, a row per codec, and where the gallery is
    assert str(report / "index.html") in stdout
    assert f"native-cache reference ({VIDEO})" in stdout and "native-cache reference (AAR_tiny+SAT_tiny)" in stdout
    for label in ("Identity", "OCTOPUS", "TurboQuant-MSE", "KIVI"):
        assert stdout.count(f"| {label} |") >= 2, label


def test_gallery_references_every_rollouts_media(demo):
    out, _, _ = demo
    page = (out / "report" / "index.html").read_text()
    for run, media in ((out / "runs" / VIDEO, "video.mp4"), (out / "runs" / "audio", "audio.wav")):
        for item, variant in _rollouts(run):
            assert f'src="../runs/{run.name}/rollouts/{item}/{variant}/{media}"' in page, (item, variant)
    stills = list((out / "report").glob("stills/**/*.png"))  # video posters and audio log-mel pictures
    assert len(stills) == PLAN.prompts * (len(PLAN.codecs) + 1) + PLAN.clips * (len(PLAN.codecs) + 1)
    for still in stills:
        assert f'="{still.relative_to(out / "report").as_posix()}"' in page


def test_identity_is_ideal_and_two_bits_is_not(demo):
    out, _, _ = demo
    rows = {(r["kind"], r["item"], r["variant"]): r for r in _rows(out / "report" / "rollouts.csv")}
    ident = [r for (k, _, v), r in rows.items() if v == "identity_dtypenative"]
    assert len(ident) == PLAN.prompts + PLAN.clips
    for r in ident:
        if r["kind"] == "video":
            assert r["psnr"] == "inf" and float(r["ssim"]) == 1 and float(r["lpips"]) == 0
            assert float(r["identical_frames"]) == float(r["n_frames"])
        else:
            assert float(r["snr_db"]) == 120 and r["snr_at_cap"] == "True" and float(r["lsd_db"]) == 0
            assert float(r["log_mel_mse"]) == 0 and float(r["token_agreement"]) == 1
        assert float(r["latent_cosine"]) == pytest.approx(1, abs=1e-6)

    two_bit = "octopus_b2_dirauto_joint1_norm32_rhoauto"
    run = out / "runs" / VIDEO / "rollouts"
    for (kind, item, variant), r in rows.items():
        if variant != two_bit:
            continue
        assert float(r["effective_bits"]) < 4 and float(r["kv_ratio"]) > 1.5  # measured bytes, not nominal
        assert float(r["latent_cosine"]) < 1
        if kind == "video":
            # the report's PSNR is the pooled-MSE PSNR of the lossless frames: recompute it here
            ref = np.load(run / item / "reference" / "frames.npy").astype(np.float64)
            test = np.load(run / item / variant / "frames.npy").astype(np.float64)
            mse = ((ref - test) ** 2).mean(axis=(1, 2, 3)).mean()
            assert mse > 0 and float(r["psnr"]) == pytest.approx(10 * math.log10(255**2 / mse), rel=1e-9)
            # the demo's DiT reads its cache (kv_sensitive): 2 bits must show (~28 dB measured; the plain tiny
            # init gave ~46 dB, a demo with nothing to see)
            assert math.isfinite(float(r["psnr"])) and float(r["psnr"]) < 40, r["psnr"]
        else:
            assert float(r["lsd_db"]) > 0 and float(r["snr_db"]) < 120 and r["snr_at_cap"] == "False"


def test_video_quality_falls_with_the_bits(demo):
    """More bits, closer to the reference: the drift follows the codec's error rather than a chaotic sensitivity that
    any perturbation would set off (measured: turboquant-mse:b=4 ~37 dB, octopus:b=2 ~28 dB)."""
    out, _, _ = demo
    assert {"octopus:b=2", "turboquant-mse:b=4"} <= set(PLAN.codecs)
    rows = [r for r in _rows(out / "report" / "rollouts.csv") if r["kind"] == "video"]
    psnr = {p: [float(r["psnr"]) for r in rows if r["variant"] == parse_codec_list(p, value_group=32)[0].variant]
            for p in ("octopus:b=2", "turboquant-mse:b=4")}
    assert all(len(v) == PLAN.prompts and np.isfinite(v).all() for v in psnr.values()), psnr
    assert np.mean(psnr["turboquant-mse:b=4"]) > np.mean(psnr["octopus:b=2"]) + 3, psnr


def test_rerun_resumes_and_other_settings_are_refused(demo, capsys, tmp_path):
    out, _, first = demo
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/rollouts/*/*/rollout.json")}
    assets = (out / "assets" / "assets.json").stat().st_mtime_ns
    # no --random, but no trained weights shipped: one line says so and the random demo resumes
    rc, stdout, seconds = _demo(out, assets=tmp_path / "none")
    assert rc == 0 and "| Identity |" in stdout
    first_lines = stdout.splitlines()[:2]
    assert "trained tiny video model is not installed" in first_lines[0] and "random" in first_lines[0]
    assert first_lines[1].startswith("mmkv demo (quick): tiny random models")
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/rollouts/*/*/rollout.json")} == stamps
    assert (out / "assets" / "assets.json").stat().st_mtime_ns == assets
    assert "already complete" in (out / "logs" / f"generate_video_{VIDEO}.log").read_text()
    assert seconds < first

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mmkv.assets, "VIDEO_ASSETS", tmp_path / "none")
        mp.setattr(mmkv.assets, "AUDIO_ASSETS", tmp_path / "none")
        assert main(["demo", "--seed", "3", "--out", str(out)]) == 2  # the full demo into the quick demo's folder
    assert "holds a demo made with" in capsys.readouterr().err


def test_thread_count_defaults_to_one_for_random_models_and_two_for_the_trained_one(monkeypatch):
    """`--threads` unset: 1 torch thread for the random models, `TRAINED_THREADS` (at most the CPUs there are) for
    the trained video model; a given count wins; a negative one is refused before anything runs."""
    import argparse

    from mmkv import demo as demo_mod
    from mmkv.cli import UsageError

    before = torch.get_num_threads()
    try:
        for cpus, trained, threads, want in ((8, False, None, 1), (8, True, None, demo_mod.TRAINED_THREADS),
                                              (1, True, None, 1), (8, True, 3, 3), (8, False, 2, 2)):
            monkeypatch.setattr("os.cpu_count", lambda: cpus)
            torch.set_num_threads(5)
            demo_mod._set_threads(argparse.Namespace(threads=threads), trained)
            assert torch.get_num_threads() == want, (cpus, trained, threads)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(UsageError, match="--threads must be >= 0"):
        demo_mod.run(argparse.Namespace(threads=-1))
