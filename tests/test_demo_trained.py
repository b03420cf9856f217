"""`mmkv demo` with trained video weights shipped in the package: the weights are checked against their SHA-256 sums,
trained mode is the default when they are there, it renders held-out scene captions and the report scores them for
adherence, and trained and random runs never share a folder.

The stand-in for the shipped weights is a randomly initialised model of `mmkv train video`'s `micro` configuration
in the release layout (`train.write_release`), run at its own clip size (21 x 32 x 48) to stay fast."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

import mmkv.assets
from mmkv import demo
from mmkv.assets import AssetError, read_sums, record_sums, trained_audio_assets, trained_video_assets
from mmkv.cli import main
from mmkv.pipelines.common import parse_codec_list

ROOT = Path(__file__).resolve().parents[1]
PLAN = demo.PLANS["trained-quick"]
MICRO_VIDEO = {"frames": 21, "height": 32, "width": 48}  # train.get_config("micro")'s clips


def write_standin(root: Path) -> Path:
    """A random `micro` model in the shipped layout (base/, causvid/model.pt) with its SHA256SUMS."""
    from mmkv.pipelines.wan import scenes, train

    cfg = train.get_config("micro")
    tokenizer = train.word_tokenizer(scenes.vocabulary(), cfg.text_len)
    train.write_release(root, cfg, vae=train.build_vae(cfg, 0), tokenizer=tokenizer,
                        encoder=train.build_text_encoder(cfg, len(tokenizer), 0), dit=train.build_dit(cfg, 0))
    record_sums(root)
    return root


def _demo(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["demo", *argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return write_standin(tmp_path_factory.mktemp("assets") / "video")


@pytest.fixture(scope="module")
def trained(standin, tmp_path_factory):
    """`mmkv demo --quick --trained` with the stand-in installed as the shipped weights (a random model: its scores
    are not the demo's bar's business here, `test_the_demo_uses_a_shipped_set_by_default_only_above_its_bar` is)."""
    out = tmp_path_factory.mktemp("demo") / "trained"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mmkv.assets, "VIDEO_ASSETS", standin)
        mp.setattr(mmkv.assets, "AUDIO_ASSETS", tmp_path_factory.mktemp("no_audio"))
        mp.setattr(demo, "TRAINED_VIDEO", MICRO_VIDEO)
        rc, stdout, stderr = _demo("--quick", "--trained", "--seed", "1", "--out", str(out))
    assert rc == 0, stdout + stderr
    return out, stdout


def test_sums_record_every_file_and_the_assets_check_out(standin):
    sums = read_sums(standin / "SHA256SUMS")
    assert "causvid/model.pt" in sums and "base/vae/diffusion_pytorch_model.safetensors" in sums
    assert len(sums) == sum(1 for p in standin.rglob("*") if p.is_file()) - 1
    found = trained_video_assets(standin)
    assert found["base"] == standin / "base" and found["causvid"] == standin / "causvid" / "model.pt"
    assert len(found["sums_sha256"]) == 64


def test_no_shipped_weights_is_none(tmp_path):
    assert trained_video_assets(tmp_path / "absent") is None
    assert trained_video_assets(tmp_path) is None  # the folder exists but holds nothing


def test_a_changed_file_is_a_one_line_error_naming_it_and_both_hashes(standin, tmp_path):
    root = shutil.copytree(standin, tmp_path / "video")
    ckpt = root / "causvid" / "model.pt"
    data = bytearray(ckpt.read_bytes())
    data[-100] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    want = read_sums(root / "SHA256SUMS")["causvid/model.pt"]
    with pytest.raises(AssetError) as err:
        trained_video_assets(root)
    msg = str(err.value)
    assert "\n" not in msg and str(ckpt) in msg and want in msg
    assert mmkv.assets.hashlib.sha256(bytes(data)).hexdigest() in msg

    # through the command: exit 2, that one line, no traceback, nothing rendered
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mmkv.assets, "VIDEO_ASSETS", root)
        rc, stdout, stderr = _demo("--quick", "--out", str(tmp_path / "out"))
    assert rc == 2 and stderr.count("\n") == 1 and want in stderr and "Traceback" not in stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["missing", "unrecorded", "no sums", "bad line"])
def test_an_incomplete_install_is_refused(standin, tmp_path, damage):
    root = shutil.copytree(standin, tmp_path / "video")
    if damage == "missing":
        (root / "base" / "tokenizer" / "tokenizer.json").unlink()
    elif damage == "unrecorded":
        (root / "base" / "extra.safetensors").write_bytes(b"x")
    elif damage == "no sums":
        (root / "SHA256SUMS").unlink()
    else:
        (root / "SHA256SUMS").write_text("not a sum line\n")
    with pytest.raises(AssetError, match={"missing": "tokenizer.json is recorded .* but missing",
                                          "unrecorded": "extra.safetensors is not recorded",
                                          "no sums": "no SHA256SUMS", "bad line": "SHA256SUMS:1: expected"}[damage]):
        trained_video_assets(root)


def test_package_data_ships_the_nested_asset_files():
    """The shipped layout is nested (base/vae/...): the package-data glob must reach every level."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert {"assets/video/**/*", "assets/audio/**/*"} <= set(cfg["tool"]["setuptools"]["package-data"]["mmkv"])


def test_trained_mode_runs_the_shipped_weights(trained, standin):
    out, stdout = trained
    assert "(trained-quick): the trained tiny video model" in stdout and "not installed" not in stdout
    record = json.loads((out / "demo.json").read_text())
    assert record["mode"] == "trained-quick"
    assert record["video_weights"] == trained_video_assets(standin)["sums_sha256"]
    assets = json.loads((out / "assets" / "assets.json").read_text())
    assert Path(assets["causvid"]) == standin / "causvid" / "model.pt" and Path(assets["wan_base"]) == standin / "base"
    assert not (out / "assets" / "wan").exists()  # no random video model was written
    # the prompts are the held-out scene captions, written to the run's prompt file
    assert Path(assets["prompts"]).read_text().splitlines() == demo.held_out_captions(PLAN.prompts)
    log = (out / "logs" / "generate_video_causvid.log").read_text()
    assert f"--ckpt {standin / 'causvid' / 'model.pt'}" in log and "--frames 21 --height 32 --width 48" in log
    assert "--reuse-decoded" in log  # bit-identical and faster; random runs keep decoding on every call
    assert "--reuse-decoded" not in (out / "logs" / "compare_audio.log").read_text()
    frames = np.load(next((out / "runs" / "causvid" / "rollouts").glob("*/reference/frames.npy")))
    assert frames.shape == (21, 32, 48, 3)


def test_trained_runs_hold_the_trained_codecs(trained):
    out, _ = trained
    (vm,) = PLAN.video
    want = {"reference"} | {s.variant for s in parse_codec_list(",".join(PLAN.video_codecs(vm)), value_group=32)}
    got = {p.parent.name for p in (out / "runs" / vm.preset).glob("rollouts/*/*/rollout.json")}
    assert got == want and any(v.startswith("qvg_") for v in got)


def test_the_report_scores_adherence_of_every_video_rollout(trained):
    out, stdout = trained
    table = json.loads((out / "report" / "table.json").read_text())
    keys = [c["key"] for c in table["columns"]]
    # (no consistency column: it needs a striped background in block 1, which a random model does not draw)
    assert {"causvid/adherence/min", "causvid/adherence/mean", "causvid/adherence/max"} <= set(keys), keys
    video_presets = {"reference"} | {s.preset for s in parse_codec_list(",".join(PLAN.video_codecs(PLAN.video[0])),
                                                                          value_group=32)}
    scored = {r["preset"]: r["causvid/adherence/mean"] for r in table["rows"]}
    assert all(0 <= scored[p] <= 1 for p in video_presets), scored  # the reference is scored too
    import csv

    with open(out / "report" / "rollouts.csv", newline="", encoding="utf-8") as f:
        video = [r for r in csv.DictReader(f) if r["kind"] == "video"]
    assert len(video) == PLAN.prompts * len(video_presets)
    for r in video:  # a score in [0, 1] for each rollout, the reference's too: every prompt is a procedural caption
        assert 0 <= float(r["adherence"]) <= 1, r
    assert "adherence" in stdout  # in the headline table too


def test_trained_and_random_runs_never_share_a_folder(trained, standin):
    out, _ = trained
    rc, _, stderr = _demo("--quick", "--random", "--seed", "1", "--out", str(out))
    assert rc == 2 and "holds a demo made with" in stderr and "'trained-quick'" in stderr


def test_prompts_are_for_the_random_models(standin, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mmkv.assets, "VIDEO_ASSETS", standin)
        rc, _, stderr = _demo("--quick", "--trained", "--prompts", str(ROOT / "prompts" / "prompts.txt"),
                              "--out", str(tmp_path / "out"))
    assert rc == 2 and "--prompts is for the random models" in stderr and not (tmp_path / "out").exists()


def test_audio_assets_are_checked_like_the_video_ones(tmp_path):
    root = tmp_path / "audio"
    assert trained_audio_assets(root) is None
    (root / "clap").mkdir(parents=True)
    for rel in ("AAR_tiny.pth", "SAT_tiny.pth", "clap/config.json", "clap/model.safetensors"):
        (root / rel).write_bytes(rel.encode())
    with pytest.raises(AssetError, match="no SHA256SUMS"):
        trained_audio_assets(root)
    record_sums(root)
    found = trained_audio_assets(root)
    assert found["aar"] == root and found["clap"] == root / "clap" and len(found["sums_sha256"]) == 64
    (root / "clap" / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(AssetError, match="model.safetensors: SHA-256 .* differs"):
        trained_audio_assets(root)
    (root / "SAT_tiny.pth").unlink()
    record_sums(root)
    want = r"must record AAR_\*.pth, SAT_\*.pth, clap/config.json; it lists \['AAR_tiny.pth'"
    with pytest.raises(AssetError, match=want):
        trained_audio_assets(root)


def _eval_record(colour_pct: float | None) -> dict:
    runs = [] if colour_pct is None else [
        {"model": "trained", "preset": "causvid", "first_block": "generated", "no_past": False,
         "summary": {"clips": 32, "colour_pct": colour_pct}},
        {"model": "trained", "preset": "causvid", "first_block": "generated", "no_past": True,  # not the one judged
         "summary": {"clips": 32, "colour_pct": 90.0}}]
    return {"runs": runs}


@pytest.mark.parametrize("colour, used", [(62.5, True), (15.62, False), (None, False)])
def test_the_demo_uses_a_shipped_set_by_default_only_above_its_bar(standin, tmp_path, capsys, colour, used):
    """Shipped weights whose own held-out free CausVid rollouts draw the named colour in under half the prompts (or
    that carry no scores) stay out of the default demo, with one line saying why; --trained takes them anyway."""
    import argparse

    root = shutil.copytree(standin, tmp_path / "video")
    if colour is not None:
        (root / "eval.json").write_text(json.dumps(_eval_record(colour)))
        record_sums(root)
    found = trained_video_assets(root)
    assert mmkv.assets.demo_ready("video", found)[0] is used
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mmkv.assets, "VIDEO_ASSETS", root)
        default = demo._choose_models(argparse.Namespace(random=False, trained=False, prompts=None))
        forced = demo._choose_models(argparse.Namespace(random=False, trained=True, prompts=None))
    line = capsys.readouterr().out
    assert forced == found and default == (found if used else None)
    if not used:
        assert line.count("\n") == 1 and "--trained" in line and "random" in line
        assert (f"colour {colour}%" if colour is not None else "no held-out scores") in line


@pytest.mark.parametrize("adherence, used", [(0.55, True), (0.3333, False)])
def test_the_audio_bar_reads_the_aar_stages_held_out_rollouts(tmp_path, adherence, used):
    record = {"stage": "aar", "heldout": {"rollouts": {"clips": 64, "adherence": adherence},
                                          "rollouts_random_aar": {"clips": 64, "adherence": 0.168}}}
    (tmp_path / "train.json").write_text(json.dumps(record))
    ready, score = mmkv.assets.demo_ready("audio", {"root": tmp_path})
    assert ready is used and f"adherence {adherence} on 64 held-out rollouts (a random AAR: 0.168)" in score
    (tmp_path / "train.json").unlink()
    assert mmkv.assets.demo_ready("audio", {"root": tmp_path})[0] is False


def test_a_video_run_as_two_single_threaded_ranks_renders_the_in_process_rollouts(trained, tmp_path):
    """`_mmkv_ranks` runs the demo's `generate video` command as two rank processes of one thread, one prompt each:
    their rollouts are the in-process run's up to float rounding (one thread's sums against two's), and `mmkv
    report` merges their manifests into the same rows."""
    import shlex

    out, _ = trained
    first = (out / "logs" / "generate_video_causvid.log").read_text().splitlines()[0]
    argv = shlex.split(first.removeprefix("$ mmkv "))
    run = tmp_path / "ranked"
    argv[argv.index("--out") + 1] = str(run)
    log = tmp_path / "logs" / "generate.log"
    with contextlib.redirect_stdout(io.StringIO()) as said:
        demo._mmkv_ranks(argv, 2, log, step="generate")
    assert "2 ranks)" in said.getvalue()
    assert sorted(p.name for p in run.glob("manifest*.json")) == ["manifest.rank0.json", "manifest.rank1.json"]
    for r in (0, 1):
        assert f"RANK={r} WORLD_SIZE=2 mmkv generate video" in (tmp_path / "logs" / f"generate.rank{r}.log").read_text()
    before = out / "runs" / "causvid"
    mine = sorted(p.relative_to(run) for p in run.glob("rollouts/*/*/frames.npy"))
    assert mine == sorted(p.relative_to(before) for p in before.glob("rollouts/*/*/frames.npy")) and mine
    for ref in [p for p in mine if p.parent.name == "reference"]:
        a, b = np.load(run / ref).astype(np.float64), np.load(before / ref).astype(np.float64)
        assert np.abs(a - b).max() <= 0.02 * (255 if a.max() > 1 else 1), ref
    assert main(["report", str(run), "--format", "json", "--no-plots", "--lpips", "off", "--out",
                 str(tmp_path / "report")]) == 0
    rows = json.loads((tmp_path / "report" / "table.json").read_text())["rows"]
    (vm,) = PLAN.video
    assert {r["preset"] for r in rows} == {"reference"} | {
        s.preset for s in parse_codec_list(",".join(PLAN.video_codecs(vm)), value_group=32)}


def test_a_failed_rank_fails_its_step_with_the_rank_log(tmp_path):
    from mmkv.cli import UsageError

    log = tmp_path / "logs" / "step.log"
    with pytest.raises(UsageError, match=r"step 'x' failed on rank 0 of 2 \(exit 2\)(.|\n)*required: --ckpt"):
        demo._mmkv_ranks(["generate", "video", "--model", "causvid", "--prompts", "p.txt", "--out", "o"], 2, log,
                         step="x")
    assert "2 ranks, one torch thread each" in log.read_text()
    assert (tmp_path / "logs" / "step.rank1.log").is_file()


def test_rank_processes_only_for_a_trained_cpu_run_of_many_codecs_and_several_threads():
    full = demo.PLANS["trained-full"]
    causvid, framewise = full.video  # every codec / OCTOPUS 2-bit alone
    assert demo._video_ranks(full, causvid, True, "cpu", 2) == 2
    assert demo._video_ranks(full, causvid, True, "cpu", 8) == full.prompts == 2  # at most one a prompt
    assert demo._video_ranks(full, causvid, True, "cpu", 1) == 1
    assert demo._video_ranks(full, causvid, True, "cpu", 0) == 1  # torch's default threads: one process
    assert demo._video_ranks(full, causvid, False, "cpu", 2) == 1  # the random models' runs are short
    assert demo._video_ranks(full, framewise, True, "cpu", 2) == 1  # too few rollouts to pay for starting a rank
