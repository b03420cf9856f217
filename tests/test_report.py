"""`mmkv report` on synthetic run folders laid out exactly as the pipelines write them: tables (Table 3 shape, marks,
windows), shard merging, missing / partial rollouts, the metrics cache, plots, and the HTML gallery in Chromium."""

import csv
import io
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import save_file

from mmkv.cli import main as mmkv_main
from mmkv.report import tables as T
from mmkv.report.measure import LpipsChoice, Measurer, measure_all
from mmkv.report.runs import read_runs
from mmkv.report.summary import main_table, summarize, windows_table

FPS = 16
SR = 24000
# (preset, variant folder, nominal bits, noise sigma, KV×, effective bits): lower sigma = better codec
PRESETS = [
    ("identity", "identity", None, 0.0, 1.0, 16.0),
    ("turboquant-mse:b=4", "turboquant_b4", 4, 8.0, 2.4, 4.6),
    ("octopus:b=4,joint=1,norm=32", "octopus_b4_joint1_norm32", 4, 3.0, 2.3, 4.8),
    ("turboquant-mse:b=2", "turboquant_b2", 2, 24.0, 3.2, 2.7),
    ("polarquant:b=2", "polarquant_b2", 2, 16.0, 3.3, 2.6),
    ("octopus:b=2,joint=1,norm=32", "octopus_b2_joint1_norm32", 2, 10.0, 3.1, 2.9),
]
CAUSAL_FRAMES = 4  # the first chunk never reads the compressed cache: bit-identical frames


def _rollout_json(kind, item, index, variant, preset, bits, kv, eff, rank, files, seed):
    return {
        "kind": kind, "item": item, "item_index": index, "text": f"prompt {index}: a synthetic scene",
        "variant": variant, "preset": preset if variant != "reference" else None,
        "k_codec": preset, "v_codec": None, "bits": bits, "effective_bits": eff if variant != "reference" else 16.0,
        "kv_bytes": int(1e6 / kv), "bf16_kv_bytes": int(1e6), "kv_ratio": kv, "peak_kv_bytes": int(1.2e6 / kv),
        "noise_sha256": f"{seed:08x}{index:056x}", "seed": seed, "model": "causvid" if kind == "video" else "aar",
        "residual_window": 1, "sample_rate": SR if kind == "audio" else None, "timings": {"total_s": 1.0},
        "peak_memory_bytes": 123, "rank": rank, "files": files, "versions": {"mmkv": "test"},
    }


def make_run(shards, *, kind="video", seed=0, n_items=3, frames=36, size=(32, 48), presets=PRESETS, mp4=False,
             colours=None, config=None, texts=None, render=None, captions=None):
    """Write a run: `shards` is a list of (run folder, rank, world size); items go round-robin over the ranks, as
    torchrun sharding does. Same seed -> byte-identical content whatever the split. `config` joins each manifest's
    config (e.g. what the pipelines record of the rollouts a run renders). `texts`: each item's prompt; `captions`:
    each audio clip's caption (what `mmkv compare audio` records from a `<clip stem>.txt`); `render(item index,
    variant)`: a rollout's uint8 frames (video) or float waveform (audio) instead of noise around the reference."""
    ref_rng = np.random.default_rng(seed)
    items = []
    for i in range(n_items):
        name = f"p{i:04d}" if kind == "video" else f"clip_{chr(97 + i)}"
        if kind == "video":
            if render:
                ref = render(i, "reference")
            elif colours:
                ref = np.tile(np.array(colours[i][0], np.uint8), (frames, *size, 1))
            else:
                low = ref_rng.uniform(0, 255, (frames, size[0] // 8, size[1] // 8, 3))
                ref = np.clip(np.repeat(np.repeat(low, 8, 1), 8, 2) + ref_rng.normal(0, 8, (frames, *size, 3)),
                              0, 255).astype(np.uint8)
            latent = torch.from_numpy(ref_rng.standard_normal((frames // 4, 4, 6, 8)).astype(np.float32))
        elif render:
            ref = render(i, "reference")
            latent = torch.from_numpy(ref_rng.standard_normal((1, 8, 38)).astype(np.float32))
        else:
            t = np.arange(12000) / SR
            ref = sum(ref_rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * ref_rng.uniform(100, 6000) * t)
                      for _ in range(3)).astype(np.float32)
            latent = torch.from_numpy(ref_rng.standard_normal((1, 8, 38)).astype(np.float32))
        items.append((name, ref, latent))
    for run, rank, world in shards:
        run = Path(run)
        mine = [(i, it) for i, it in enumerate(items) if i % world == rank]
        entries = []
        for i, (name, ref, latent) in mine:
            rng = np.random.default_rng([seed, i])
            for v_index, (preset, variant, bits, sigma, kv, eff) in enumerate([(None, "reference", None, 0.0, 1.0,
                                                                               16.0)] + list(presets)):
                d = run / "rollouts" / name / variant
                d.mkdir(parents=True, exist_ok=True)
                if kind == "video":
                    if render:
                        x = render(i, variant)
                    elif colours:
                        x = np.tile(np.array(colours[i][v_index], np.uint8), (frames, *size, 1))
                        x = np.clip(x + rng.integers(-3, 4, x.shape), 0, 255).astype(np.uint8)
                    else:
                        x = ref.astype(np.float64)
                        x[CAUSAL_FRAMES:] += rng.normal(0, sigma, x[CAUSAL_FRAMES:].shape) if sigma else 0
                        x = np.clip(np.rint(x), 0, 255).astype(np.uint8)
                    np.save(d / "frames.npy", x)
                    save_file({"latents": latent + sigma / 40 * torch.from_numpy(
                        rng.standard_normal(tuple(latent.shape)).astype(np.float32))}, str(d / "latents.safetensors"))
                    files = {"frames": "frames.npy", "latents": "latents.safetensors"}
                    if mp4:
                        import imageio.v3 as iio

                        iio.imwrite(d / "video.mp4", x, fps=FPS, codec="libx264", macro_block_size=16)
                        files["video"] = "video.mp4"
                else:
                    y = render(i, variant) if render else ref + (sigma / 300 * rng.standard_normal(ref.shape)).astype(
                        np.float32)
                    sf.write(d / "audio.wav", y, SR, subtype="FLOAT")
                    save_file({"latent": latent + sigma / 40 * torch.from_numpy(
                        rng.standard_normal(tuple(latent.shape)).astype(np.float32))}, str(d / "latent.safetensors"))
                    tokens = torch.from_numpy(rng.integers(0, 1024, 455)) if sigma else torch.arange(455)
                    save_file({"tokens": tokens}, str(d / "tokens.safetensors"))
                    files = {"audio": "audio.wav", "latent": "latent.safetensors", "tokens": "tokens.safetensors"}
                info = _rollout_json(kind, name, i, variant, preset, bits, kv, eff, rank, files, seed)
                if texts:
                    info["text"] = texts[i]
                if captions:
                    info["caption"] = captions[i]
                (d / "rollout.json").write_text(json.dumps(info))
                entries.append({"item": name, "variant": variant})
        config_ = {"seed": seed, "world_size": world, **(config or {})}
        manifest = {"config": config_, "versions": {}, "rollouts": entries, "runs": []}
        run.mkdir(parents=True, exist_ok=True)
        (run / f"manifest.rank{rank}.json").write_text(json.dumps(manifest))
    return items


def _report(args, capsys):
    rc = mmkv_main(["report", *map(str, args)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _summary(runs, lpips="random"):
    rs = read_runs(runs)
    measured = measure_all(rs, Measurer(LpipsChoice(lpips, device="cpu"), device="cpu"))
    return rs, measured, summarize(measured)


@pytest.fixture(scope="module")
def seed():
    return int(np.random.default_rng(1148).integers(1 << 30))


@pytest.fixture(scope="module")
def video_run(tmp_path_factory, seed):
    run = tmp_path_factory.mktemp("video") / "run"
    make_run([(run, 0, 1)], seed=seed, n_items=2)
    return run


@pytest.fixture(scope="module")
def audio_run(tmp_path_factory, seed):
    run = tmp_path_factory.mktemp("audio") / "run"
    make_run([(run, 0, 1)], kind="audio", seed=seed, n_items=2)
    return run


def test_main_table_has_table3_shape_and_marks(video_run, audio_run):
    rs, measured, s = _summary([video_run, audio_run])
    assert not rs.problems and len(measured) == 2 * 2 * len(PRESETS)
    t = main_table(s)
    rows = {(r[t.index("bits")], r[t.index("codec")]): i for i, r in enumerate(t.rows)}
    # a row per (bits, codec), identity first, then bit widths descending, baselines before OCTOPUS
    assert [t.rows[i][0] for i in range(len(t.rows))] == [None, 4, 4, 2, 2, 2]
    assert list(rows)[3:] == [(2, "TurboQuant-MSE"), (2, "PolarQuant"), (2, "OCTOPUS")]
    marks = t.marks()
    for group in ("causvid", "aar"):
        first = "lpips" if group == "causvid" else "lsd_db"
        j = t.index(f"{group}/{first}/mean")
        assert marks[rows[(2, "OCTOPUS")]][j] == "best" and marks[rows[(2, "PolarQuant")]][j] == "second"
        assert marks[rows[(2, "TurboQuant-MSE")]][j] is None
        assert marks[rows[(4, "OCTOPUS")]][j] == "best" and marks[rows[(4, "TurboQuant-MSE")]][j] == "second"
        assert t.rows[rows[(2, "OCTOPUS")]][t.index(f"{group}/kv_ratio")] == pytest.approx(3.1)
        assert t.rows[rows[(2, "OCTOPUS")]][t.index(f"{group}/effective_bits")] == pytest.approx(2.9)
    # min / mean / max are over items of the per-rollout values cached in metrics.json
    octo = [m for m in measured if m.test.variant == "octopus_b2_joint1_norm32" and m.test.kind == "video"]
    vals = [m.metrics["summary"]["lpips"] for m in octo]
    cached = [json.loads((m.test.dir / "metrics.json").read_text())["summary"]["lpips"] for m in octo]
    assert vals == cached
    r = t.rows[rows[(2, "OCTOPUS")]]
    assert r[t.index("causvid/lpips/min")] == min(vals) and r[t.index("causvid/lpips/max")] == max(vals)
    assert r[t.index("causvid/lpips/mean")] == pytest.approx(np.mean(vals), rel=1e-12)
    # identity: identical outputs -> PSNR inf (shown as such), LSD 0, SNR 120 at the cap for every clip
    ident = t.rows[rows[(None, "Identity")]]
    assert ident[t.index("causvid/psnr/mean")] == math.inf and ident[t.index("causvid/ssim/min")] == 1.0
    assert ident[t.index("aar/lsd_db/max")] == 0.0 and ident[t.index("aar/snr_db/min")] == 120.0
    assert ident[t.index("aar/snr_db/at_cap")] == 1.0
    md = T.render(t, "md")
    assert "| inf |" in md and "**" in md and "<u>" in md and "LPIPS†" in md
    tex = T.render(t, "latex")
    assert r"\textbf{" in tex and r"\underline{" in tex and r"$\infty$" in tex and r"\multicolumn" in tex
    assert tex.count(r"\\") >= len(t.rows) + 3
    rec = json.loads(T.render(t, "json"))["rows"][rows[(None, "Identity")]]
    assert rec["causvid/psnr/mean"] == "inf"
    parsed = list(csv.DictReader(io.StringIO(T.render(t, "csv"))))
    assert parsed[rows[(2, "OCTOPUS")]]["causvid/lpips/mean:rank"] == "1"
    assert float(parsed[rows[(2, "OCTOPUS")]]["causvid/lpips/mean"]) == pytest.approx(np.mean(vals), rel=1e-12)


def test_windowed_means_are_item_means_of_per_frame_means(video_run):
    _, measured, s = _summary([video_run])
    t = windows_table(s)
    octo = sorted((m for m in measured if m.test.variant == "turboquant_b2"), key=lambda m: m.test.item)
    row = next(r for r in t.rows if r[t.index("preset")] == "turboquant-mse:b=2")
    for label, sl in (("0–2 s", slice(0, 32)), ("2–5 s", slice(32, 36))):
        for metric in ("ssim", "lpips"):
            want = np.mean([np.mean(m.metrics["per_frame"][metric][sl]) for m in octo])
            assert row[t.index(f"causvid/{metric}/{label}")] == pytest.approx(want, rel=1e-12)
        want_psnr = np.mean([10 * np.log10(255**2 / np.mean(m.metrics["per_frame"]["mse"][sl])) for m in octo])
        assert row[t.index(f"causvid/psnr/{label}")] == pytest.approx(want_psnr, rel=1e-12)


def test_sharded_runs_report_equal_unsplit(tmp_path, seed, capsys):
    kw = dict(seed=seed, n_items=3, presets=PRESETS[3:5], config=_video_config(3, PRESETS[3:5]))
    make_run([(tmp_path / "whole", 0, 1)], **kw)
    make_run([(tmp_path / "ranks", 0, 2), (tmp_path / "ranks", 1, 2)], **kw)  # one folder, two manifests
    make_run([(tmp_path / "shard0", 0, 2), (tmp_path / "shard1", 1, 2)], **kw)  # two run folders
    outs = {}
    for name, runs in (("whole", ["whole"]), ("ranks", ["ranks"]), ("folders", ["shard1", "shard0"])):
        rc, _, err = _report([*(tmp_path / r for r in runs), "--format", "md,csv,json,latex", "--out",
                              tmp_path / f"out_{name}", "--lpips", "random", "--device", "cpu", "--no-plots",
                              "--strict"], capsys)
        assert rc == 0 and "problem" not in err, err  # every rollout the configs expect is in one of the folders
        outs[name] = {f: (tmp_path / f"out_{name}" / f).read_text() for f in
                      ("table.md", "table.csv", "table.json", "table.tex", "windows.md", "windows.csv")}
    assert outs["whole"] == outs["ranks"] == outs["folders"]
    assert len(outs["whole"]["table.csv"].splitlines()) == 1 + 2
    assert "| 3 |" in outs["whole"]["table.md"]  # n = 3 items per codec, from both shards


def test_missing_and_partial_rollouts_are_named_and_the_rest_tabulated(tmp_path, seed, capsys):
    run = tmp_path / "run"
    make_run([(run, 0, 1)], seed=seed, n_items=3)
    (run / "rollouts/p0001/octopus_b2_joint1_norm32/rollout.json").unlink()  # stopped before finishing
    (run / "rollouts/p0002/turboquant_b4/frames.npy").unlink()  # listed file gone
    shutil.rmtree(run / "rollouts/p0000/polarquant_b2")  # listed in the manifest, folder gone
    shutil.rmtree(run / "rollouts/p0002/reference")  # nothing to compare p0002 with
    rj = run / "rollouts/p0000/turboquant_b2/rollout.json"
    rj.write_text(json.dumps({**json.loads(rj.read_text()), "noise_sha256": "f" * 64}))  # another rollout's noise
    rc, out, err = _report([run, "--format", "md", "--lpips", "off", "--device", "cpu"], capsys)
    assert rc == 0
    assert "run/rollouts/p0001/octopus_b2_joint1_norm32: partial rollout: rollout.json is missing" in err
    assert "files present: frames.npy, latents.safetensors" in err
    assert "run/rollouts/p0002/turboquant_b4: partial rollout: frames.npy missing" in err
    assert "run/rollouts/p0000/polarquant_b2: missing: listed in manifest.rank0.json" in err
    assert "run/rollouts/p0002/octopus_b4_joint1_norm32: no reference rollout for item p0002" in err
    assert "run/rollouts/p0000/turboquant_b2: noise_sha256 differs from run/rollouts/p0000/reference's" in err
    assert "**Problems**" in out and "p0001/octopus_b2_joint1_norm32" in out
    main = out.split("**Windowed means")[0]
    lines = {ln.split("|")[2].strip(): ln for ln in main.splitlines() if ln.startswith("| ")}
    # n per codec: 3 items minus what is missing; LPIPS is off so no LPIPS column at all
    n_col = [c.strip() for c in lines["codec"].split("|")].index("n")
    counts = [[c.strip() for c in ln.split("|")][n_col] for ln in main.splitlines() if "| OCTOPUS |" in ln]
    assert counts == ["2", "1"]  # b=4: p0002 has no reference; b=2: and p0001 is partial
    assert "LPIPS" not in lines["codec"]
    rc, _, _ = _report([run, "--format", "md", "--lpips", "off", "--device", "cpu", "--strict", "--no-plots",
                        "--out", tmp_path / "out"], capsys)
    assert rc == 1
    assert "p0002/turboquant_b4: partial rollout: frames.npy missing" in (tmp_path / "out/problems.txt").read_text()


def test_bad_command_lines_get_clear_errors(video_run, tmp_path, capsys):
    rc, _, err = _report([video_run, "--format", "pdf"], capsys)
    assert rc == 2 and "unknown report format 'pdf'" in err and "md, csv, json, latex, html" in err
    rc, _, err = _report([video_run, "--windows", "1,2"], capsys)
    assert rc == 2 and "start at 0" in err
    rc, _, err = _report([tmp_path / "nope", "--format", "md", "--lpips", "off"], capsys)
    assert rc == 1 and "not a directory" in err


def test_missing_lpips_trunk_says_where_to_put_it(tmp_path, seed, monkeypatch, capsys):
    run = tmp_path / "run"
    make_run([(run, 0, 1)], seed=seed, n_items=1, presets=PRESETS[:1])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    rc, _, err = _report([run, "--format", "md", "--device", "cpu"], capsys)
    assert rc == 2
    assert f"{tmp_path / 'torch' / 'hub' / 'checkpoints' / 'alexnet-owt-7be5be79.pth'}" in err
    assert "--lpips-weights" in err


def test_metrics_cache_reused_and_recomputed_when_inputs_change(tmp_path, seed, monkeypatch):
    run = tmp_path / "run"
    make_run([(run, 0, 1)], seed=seed, n_items=1, presets=PRESETS[2:3])
    _summary([run], lpips="off")
    cache = run / "rollouts/p0000/octopus_b4_joint1_norm32/metrics.json"
    first = cache.read_text()

    import mmkv.metrics

    def boom(*a, **k):
        raise AssertionError("recomputed although nothing changed")

    monkeypatch.setattr(mmkv.metrics, "video_metrics", boom)
    _summary([run], lpips="off")  # served from metrics.json
    monkeypatch.undo()
    frames = run / "rollouts/p0000/octopus_b4_joint1_norm32/frames.npy"
    x = np.load(frames)
    x[-1] = 255 - x[-1]
    np.save(frames, x)
    os.utime(frames, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    _, measured, _ = _summary([run], lpips="off")
    assert cache.read_text() != first
    assert measured[0].metrics["per_frame"]["mse"][-1] > json.loads(first)["per_frame"]["mse"][-1]


def test_plots_are_written(video_run, audio_run, tmp_path):
    from mmkv.report.plots import frame_curves, rate_quality

    _, _, s = _summary([video_run, audio_run])
    paths = rate_quality(s, tmp_path) + frame_curves(s, tmp_path)
    names = {p.name for p in paths}
    assert {"rate_causvid_lpips.png", "rate_causvid_psnr.png", "rate_aar_lsd_db.png", "rate_aar_snr_db.png",
            "frames_causvid_psnr.png", "frames_causvid_lpips.png"} <= names
    import imageio.v3 as iio

    img = iio.imread(tmp_path / "rate_causvid_lpips.png")
    assert img.shape[0] > 200 and img.shape[1] > 300 and img.std() > 5  # something was drawn


def test_audio_gallery_has_players_spectrograms_and_metrics(audio_run, tmp_path):
    import imageio.v3 as iio

    from mmkv.report.gallery import write_report

    rs, _, s = _summary([audio_run])
    page = write_report(tmp_path, s, rs, [T.render(main_table(s), "html")], [], []).read_text()
    n = 2 * (1 + len(PRESETS))
    assert page.count("<audio controls") == n and page.count('<img class="spec"') == n
    assert "../" + audio_run.parent.name + "/run/rollouts/clip_a/reference/audio.wav" in page
    assert "SNR 120.0" in page  # identity clips sit at the cap
    spec = iio.imread(tmp_path / "stills" / "aar" / "clip_a" / "reference.png")
    assert spec.shape[0] == 80 and spec.std() > 5


COLOURS = [  # per item: reference, codec A, codec B
    [(220, 30, 30), (30, 200, 40), (30, 60, 220)],
    [(230, 220, 30), (210, 40, 200), (30, 210, 210)],
]


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")
def test_gallery_renders_the_grid_in_chromium(tmp_path, seed, capsys):
    run = tmp_path / "run"
    presets = [PRESETS[3], PRESETS[5]]  # TurboQuant-MSE b=2, OCTOPUS b=2
    make_run([(run, 0, 1)], seed=seed, n_items=2, frames=20, size=(48, 64), presets=presets, mp4=True,
             colours=COLOURS)
    out = tmp_path / "out"
    rc, _, err = _report([run, "--format", "html", "--out", out, "--lpips", "random", "--device", "cpu"], capsys)
    assert rc == 0, err
    page = (out / "index.html").read_text()
    assert page.count('<video class="clip"') == 6 and "../run/rollouts/p0000/reference/video.mp4" in page
    assert page.count("LPIPS† ") >= 4 and '<table class="report"' in page and "plots/rate_causvid_lpips.png" in page
    shot = tmp_path / "shot.png"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000", f"--screenshot={shot}",
           "--window-size=1200,900", (out / "index.html").as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=90, check=False)
    assert shot.is_file(), "chromium wrote no screenshot"
    import imageio.v3 as iio

    img = iio.imread(shot)[..., :3].astype(int)
    centres = {}
    for i, row in enumerate(COLOURS):
        for j, colour in enumerate(row):
            mask = np.abs(img - np.array(colour)).max(axis=-1) < 40
            assert mask.sum() > 3000, f"item {i} column {j} ({colour}) is not on the page"
            ys, xs = np.nonzero(mask)
            centres[i, j] = (ys.mean(), xs.mean())
    for i in range(2):  # reference left of the codecs, codecs in table order, item 0 above item 1
        assert centres[i, 0][1] < centres[i, 1][1] < centres[i, 2][1]
        assert abs(centres[i, 0][0] - centres[i, 2][0]) < 30
    assert centres[0, 0][0] < centres[1, 0][0] - 50


# ----------------------------------------------------------------------------------------------------------------
# A half-finished sweep: what is missing, failed or unevenly covered is listed, and --strict fails on it


def _video_config(n_items, presets):
    """What `mmkv generate video` records of the rollouts a run renders: the prompt count and a window per variant."""
    return {"kind": "video", "model": "causvid", "residual_window": 1, "num_prompts": n_items,
            "windows": {v: {"window": None} for v in ["reference"] + [p[1] for p in presets]}}


def _fail(d: Path, error: str) -> None:
    """A finished rollout turned into one that ran and failed, as the pipelines record it (failed.json instead of
    rollout.json)."""
    (d / "rollout.json").unlink()
    (d / "failed.json").write_text(json.dumps({"kind": "video", "status": "failed", "item": d.parent.name,
                                               "variant": d.name, "reason": "non-finite output", "error": error}))


def _drop(run: Path, item: str, variant: str) -> None:
    """A rollout that never started: no folder, no manifest entry."""
    shutil.rmtree(run / "rollouts" / item / variant)
    m = run / "manifest.rank0.json"
    data = json.loads(m.read_text())
    data["rollouts"] = [e for e in data["rollouts"] if (e["item"], e["variant"]) != (item, variant)]
    m.write_text(json.dumps(data))


def test_half_finished_sweep_lists_every_missing_and_failed_rollout_and_strict_fails(tmp_path, seed, capsys):
    run = tmp_path / "run"
    presets = PRESETS[3:6]
    make_run([(run, 0, 2)], seed=seed, n_items=3, presets=presets, config=_video_config(3, presets))  # rank 1 never ran
    _drop(run, "p0002", "octopus_b2_joint1_norm32")  # killed before it started
    (run / "rollouts/p0002/polarquant_b2/rollout.json").unlink()  # killed while it ran
    _fail(run / "rollouts/p0000/turboquant_b2", "latents: 37 of 3456 values are NaN or Inf")
    args = [run, "--format", "md", "--lpips", "off", "--device", "cpu"]
    rc, out, err = _report(args, capsys)
    assert rc == 0
    lines = [ln.removeprefix("  - ") for ln in err.splitlines() if ln.startswith("  - ")]
    assert "run: no manifest from rank(s) 1 of world size 2 (causvid): those ranks never started" in err
    for variant in ("reference", "turboquant_b2", "polarquant_b2", "octopus_b2_joint1_norm32"):
        assert f"run/rollouts/p0001/{variant}: missing: never rendered (run/manifest.rank0.json's config" in err
    assert "run/rollouts/p0002/octopus_b2_joint1_norm32: missing: never rendered" in err
    assert "run/rollouts/p0002/polarquant_b2: partial rollout: rollout.json is missing" in err
    assert "run/rollouts/p0000/turboquant_b2: failed: latents: 37 of 3456 values are NaN or Inf" in lines
    for item, variant in (("p0001", "reference"), ("p0002", "octopus_b2_joint1_norm32"), ("p0002", "polarquant_b2"),
                          ("p0000", "turboquant_b2")):
        assert sum(f"rollouts/{item}/{variant}:" in ln for ln in lines) == 1, (item, variant)  # named once
    assert "**Problems**" in out and "p0001/reference: missing: never rendered" in out
    rc, _, _ = _report([*args, "--strict"], capsys)
    assert rc == 1


def test_a_clip_the_run_could_not_use_is_listed_as_failed(tmp_path, seed, capsys):
    from mmkv.pipelines.common import parse_codec

    run = tmp_path / "run"
    presets = [(p, parse_codec(p, 16).variant, b, sigma, kv, eff) for p, b, sigma, kv, eff in
               (("identity:dtype=native", None, 0.0, 1.0, 16.0), ("kivi:bits=2,group=32,meta=fp16,role=k", 2, 9.0,
                                                                   3.0, 5.0))]
    config = {"kind": "audio", "model": "aar", "residual_window": 1, "value_group": 16,
              "codecs": [p[0] for p in presets], "clips": [f"/data/clip_{c}.wav" for c in "abc"]}
    make_run([(run, 0, 1)], kind="audio", seed=seed, n_items=2, presets=presets, config=config)
    m = run / "manifest.rank0.json"
    data = json.loads(m.read_text())
    data["failures"] = [{"item": "clip_c", "item_index": 2, "variant": None, "path": "/data/clip_c.wav",
                         "reason": "unusable clip", "error": "clip /data/clip_c.wav cannot be decoded"}]
    m.write_text(json.dumps(data))
    rc, _, err = _report([run, "--format", "md", "--lpips", "off", "--device", "cpu", "--strict"], capsys)
    assert rc == 1
    assert ("run/rollouts/clip_c: failed: clip /data/clip_c.wav could not be used (clip /data/clip_c.wav cannot be "
            "decoded); none of its rollouts were rendered") in err
    assert "mmkv report: 1 problem(s)" in err  # the clip's line stands for its three rollouts
    data["failures"] = []
    m.write_text(json.dumps(data))
    rc, _, err = _report([run, "--format", "md", "--lpips", "off", "--device", "cpu", "--strict"], capsys)
    assert rc == 1 and "run/rollouts/clip_c/reference: missing: never rendered" in err


def test_codecs_with_different_items_are_compared_over_the_items_all_have(tmp_path, seed, capsys):
    run = tmp_path / "run"
    make_run([(run, 0, 1)], seed=seed, n_items=2, presets=PRESETS[3:6])
    _drop(run, "p0001", "turboquant_b2")
    _drop(run, "p0001", "polarquant_b2")  # n = 1, 1, 2: OCTOPUS alone has p0001
    out = tmp_path / "out"
    rc, _, err = _report([run, "--format", "md,csv,json,latex,html", "--out", out, "--lpips", "off", "--device",
                          "cpu", "--no-plots", "--strict"], capsys)
    assert rc == 1
    problem = ("causvid: codecs measured different items (n = 1, 1, 2): TurboQuant-MSE (b=2) lacks p0001; PolarQuant "
               "(b=2) lacks p0001; every statistic uses only the 1 item(s) all have (p0000)")
    assert problem in err and problem in (out / "problems.txt").read_text()
    octo = json.loads((run / "rollouts/p0000/octopus_b2_joint1_norm32/metrics.json").read_text())["summary"]
    table = json.loads((out / "table.json").read_text())
    row = next(r for r in table["rows"] if r["codec"] == "OCTOPUS")
    assert row["causvid/n"] == 1 and row["causvid/psnr/mean"] == pytest.approx(octo["psnr"], rel=1e-12)
    assert row["causvid/items"] == "p0000" and row["causvid/left_out"] == "p0001"
    csv_row = next(r for r in csv.DictReader(io.StringIO((out / "table.csv").read_text())) if r["codec"] == "OCTOPUS")
    assert csv_row["causvid/left_out"] == "p0001" and float(csv_row["causvid/ssim/max"]) == pytest.approx(octo["ssim"])
    note = "over the 1 item(s) all codecs have (p0000)"
    assert all(note in " ".join(t["notes"]) for t in [table, json.loads((out / "windows.json").read_text())])
    for name in ("table.md", "table.tex", "windows.md", "windows.tex"):
        assert note in (out / name).read_text(), name
    page = (out / "index.html").read_text()
    assert note in page and problem in page


def test_codecs_with_no_common_item_are_shown_unranked_and_marked(tmp_path, seed):
    run = tmp_path / "run"
    make_run([(run, 0, 1)], seed=seed, n_items=2, presets=PRESETS[3:6])
    _drop(run, "p0001", "turboquant_b2")
    _drop(run, "p0000", "octopus_b2_joint1_norm32")
    rs, _, s = _summary([run], lpips="off")
    for t in (main_table(s), windows_table(s)):
        assert not any(any(row) for row in t.marks())  # nothing ranked
        assert any("NOT COMPARABLE" in n for n in t.notes)
        assert "NOT COMPARABLE" in T.render(t, "md") and "NOT COMPARABLE" in T.render(t, "latex")
    assert "no item is common to all" in s.problems[0] and "OCTOPUS (b=2) lacks p0000" in s.problems[0]


def test_report_out_that_is_a_file_is_a_one_line_error(video_run, tmp_path, capsys):
    f = tmp_path / "table.md"
    f.write_text("an earlier table")
    for out, says in ((f, "exists and is not a directory"), (f / "sub", "cannot create the folder")):
        rc, _, err = _report([video_run, "--format", "md", "--lpips", "off", "--device", "cpu", "--out", out], capsys)
        assert rc == 2 and says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f.read_text() == "an earlier table"


def test_random_trunk_lpips_is_daggered_in_plots_and_gallery(tmp_path, seed, monkeypatch):
    from matplotlib.figure import Figure

    from mmkv.report import plots as P
    from mmkv.report.gallery import write_report

    footnote = "LPIPS†: a random AlexNet trunk, not the ImageNet weights"
    saved = {}
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: (saved.__setitem__(Path(path).name, fig),
                                                                     save(fig, path, **kw)))

    def texts(fig):
        ax = fig.axes[0]
        return [ax.get_ylabel(), ax.get_title(), fig.get_suptitle(), fig.get_supxlabel()]

    run = tmp_path / "run"
    make_run([(run, 0, 1)], seed=seed, n_items=2, frames=12, presets=PRESETS[3:5])
    rs, measured, s = _summary([run])
    P.rate_quality(s, tmp_path / "plots", {"video": ("lpips", "psnr")}), P.frame_curves(s, tmp_path / "plots")
    for name in ("rate_causvid_lpips.png", "frames_causvid_lpips.png"):
        t = texts(saved[name])
        assert any(x.startswith("LPIPS† (lower") for x in t) and footnote in t[-1], (name, t)
        assert not any("LPIPS " in x or "LPIPS (" in x for x in t), (name, t)
    assert not any("†" in x for x in texts(saved["rate_causvid_psnr.png"]))
    page = write_report(tmp_path / "g", s, rs, [], [], []).read_text()
    assert page.count("LPIPS† 0.") == 2 * 2 and "LPIPS 0." not in page and footnote in page

    for m in measured:  # the same numbers from the ImageNet trunk: no dagger, no footnote
        m.metrics["config"]["lpips_trunk"] = "alexnet sha256:0"
    s = summarize(measured)
    saved.clear()
    P.rate_quality(s, tmp_path / "plots2", {"video": ("lpips",)})
    assert not any("†" in x for x in texts(saved["rate_causvid_lpips.png"]))
    page = write_report(tmp_path / "g2", s, rs, [], [], []).read_text()
    assert page.count("LPIPS 0.") == 2 * 2 and "LPIPS†" not in page


def test_what_the_audio_pipeline_records_names_the_rollouts_a_missing_rank_owed(tmp_path, capsys, monkeypatch,
                                                                                 request):
    """The expected rollouts are derived from a real `mmkv compare audio` config (clip list, codec presets)."""
    from mmkv.pipelines.aar.tiny import random_condition, write_tiny_checkpoints

    write_tiny_checkpoints(tmp_path / "models", "micro", seed=5)
    (tmp_path / "emb").mkdir()
    (tmp_path / "clips").mkdir()
    for i, vec in enumerate(random_condition(3, seed=2).numpy()):
        np.save(tmp_path / "emb" / f"clip{i}.npy", vec)
        sf.write(tmp_path / "clips" / f"clip{i}.wav", np.full(2400, 0.01, np.float32), 24000)
    run = tmp_path / "run"
    argv = ["compare", "audio", "--aar", str(tmp_path / "models"), "--embeddings", str(tmp_path / "emb"), "--clips",
            str(tmp_path / "clips"), "--codecs", "identity,kivi:bits=2", "--out", str(run), "--device", "cpu"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    request.addfinalizer(lambda threads=torch.get_num_threads(): torch.set_num_threads(threads))
    torch.set_num_threads(1)  # tiny models: thread start-up costs more than it saves
    assert mmkv_main(argv) == 0
    capsys.readouterr()
    report = [run, "--format", "md", "--lpips", "off", "--device", "cpu", "--strict"]
    rc, _, err = _report(report, capsys)
    missing = sorted(ln.split(": ")[0].removeprefix("  - ") for ln in err.splitlines() if "never rendered" in ln)
    assert rc == 1 and missing == [f"run/rollouts/clip1/{v}" for v in ("identity_dtypenative",
                                                                      "kivi_bits2_group32_metafp16_rolek", "reference")]
    assert "run: no manifest from rank(s) 1 of world size 2" in err
    monkeypatch.setenv("RANK", "1")
    assert mmkv_main(argv) == 0
    capsys.readouterr()
    rc, _, err = _report(report, capsys)
    assert rc == 0 and "problem" not in err, err
