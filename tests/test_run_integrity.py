"""Run folders of `mmkv generate video` and `mmkv compare audio` can be trusted (tiny models, CPU): a resume refuses
other checkpoints, NaN weights and NaN rollouts never pass as results, files follow the umask, a failed write leaves
nothing in place, identical runs write identical bytes, a killed write leaves no temp file for good, and every
rollout is reported on stdout without a terminal."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmkv import io as mio
from mmkv.cli import main
from mmkv.pipelines import common, video_cli
from mmkv.pipelines.aar.tiny import random_condition, write_tiny_checkpoints
from mmkv.pipelines.wan.tiny import tiny_transformer, write_causvid_checkpoint, write_tiny_base

pytestmark = pytest.mark.usefixtures("one_thread")

LOSSY = "groupquant:bits=2,group=32"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    prompts = root / "prompts.txt"
    prompts.write_text("A red fox runs through snow.\nWaves on black rocks at dusk.\n")
    emb = root / "emb"
    emb.mkdir()
    for i, vec in enumerate(random_condition(2, seed=2).numpy()):
        np.save(emb / f"clip{i}.npy", vec)
    return {
        "root": root, "prompts": prompts, "emb": emb,
        "base": write_tiny_base(root / "base", "diffusers", seed=4),
        "ckpt": write_causvid_checkpoint(tiny_transformer(seed=5), root / "a" / "model.pt"),
        "ckpt_b": write_causvid_checkpoint(tiny_transformer(seed=6), root / "b" / "model.pt"),
        "aar": write_tiny_checkpoints(root / "aar", "micro", seed=5)[0].parent,
        "aar_b": write_tiny_checkpoints(root / "aar_b", "micro", seed=6)[0].parent,
    }


def video(a, out, *extra, ckpt=None, base=None, frames=9, codecs="identity"):
    return ["generate", "video", "--model", "causvid", "--ckpt", str(ckpt or a["ckpt"]), "--base",
            str(base or a["base"]), "--prompts", str(a["prompts"]), "--frames", str(frames), "--height", "32",
            "--width", "48", "--max-prompts", "1", "--codecs", codecs, "--out", str(out), *extra]


def audio(a, out, *extra, aar=None, emb=None, codecs="identity"):
    return ["compare", "audio", "--aar", str(aar or a["aar"]), "--embeddings", str(emb or a["emb"]), "--codecs",
            codecs, "--out", str(out), "--device", "cpu", *extra]


def run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("mmkv ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------------------------------------------
# A resume must use the same checkpoints


def test_video_resume_with_another_checkpoint_or_base_names_both_hashes(assets, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(video(assets, out), capsys)[0] == 0
    old, new = sha256(assets["ckpt"]), sha256(assets["ckpt_b"])
    manifest = json.loads((out / "manifest.rank0.json").read_text())
    record = json.loads((out / "rollouts" / "p0000" / "reference" / "rollout.json").read_text())
    assert manifest["config"]["ckpt_sha256"] == record["ckpt_sha256"] == old
    assert record["base_sha256"] == manifest["config"]["base_sha256"] and len(record["base_sha256"]) == 64
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("rollout.json")}

    rc, _, err = run(video(assets, out, ckpt=assets["ckpt_b"]), capsys)
    line = one_line_error(err)
    assert rc == 2 and old in line and new in line and "--ckpt checkpoint" in line and "--out" in line

    base_b = tmp_path / "base_b"  # one byte changed in a file the run reads
    shutil.copytree(assets["base"], base_b)
    (base_b / "vae" / "config.json").write_text((base_b / "vae" / "config.json").read_text() + " ")
    rc, _, err = run(video(assets, out, base=base_b), capsys)
    line = one_line_error(err)
    assert rc == 2 and manifest["config"]["base_sha256"] in line and "--base folder" in line

    # Without the manifest (e.g. another rank's earlier run), the finished rollouts' own records refuse it.
    (out / "manifest.rank0.json").unlink()
    rc, _, err = run(video(assets, out, ckpt=assets["ckpt_b"]), capsys)
    line = one_line_error(err)
    assert rc == 2 and "rollout.json" in line and old in line and new in line
    assert stamps == {p: p.stat().st_mtime_ns for p in out.rglob("rollout.json")}  # nothing was re-rendered


def test_audio_resume_with_another_checkpoint_or_conditioner_names_both_hashes(assets, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(audio(assets, out), capsys)[0] == 0
    old_aar = sha256(next(assets["aar"].glob("AAR_*")))
    new_aar = sha256(next(assets["aar_b"].glob("AAR_*")))
    record = json.loads((out / "rollouts" / "clip0" / "reference" / "rollout.json").read_text())
    assert record["aar_sha256"] == old_aar and len(record["sat_sha256"]) == 64
    assert len(record["conditioner_sha256"]) == 64

    rc, _, err = run(audio(assets, out, aar=assets["aar_b"]), capsys)
    line = one_line_error(err)
    assert rc == 2 and old_aar in line and new_aar in line and "AAR checkpoint" in line and "--out" in line

    emb_b = tmp_path / "emb_b"
    shutil.copytree(assets["emb"], emb_b)
    np.save(emb_b / "clip1.npy", random_condition(1, seed=9).numpy()[0])
    rc, _, err = run(audio(assets, out, emb=emb_b), capsys)
    line = one_line_error(err)
    assert rc == 2 and record["conditioner_sha256"] in line and "conditioner" in line


# ----------------------------------------------------------------------------------------------------------------
# NaN weights and NaN rollouts


def test_nan_weights_are_refused_at_load_naming_the_tensor(assets, tmp_path, capsys):
    transformer = tiny_transformer(seed=5)
    with torch.no_grad():
        transformer.blocks[0].attn1.to_q.weight[1, 2] = float("nan")
    ckpt = write_causvid_checkpoint(transformer, tmp_path / "nan" / "model.pt")
    rc, _, err = run(video(assets, tmp_path / "v", ckpt=ckpt), capsys)
    line = one_line_error(err)
    assert rc == 2 and "blocks.0.self_attn.q.weight" in line and "NaN" in line
    assert not list((tmp_path / "v").rglob("rollout.json"))

    aar_dir = tmp_path / "aar_nan"
    shutil.copytree(assets["aar"], aar_dir)
    path = next(aar_dir.glob("AAR_*"))
    obj = torch.load(path, weights_only=True)
    key = next(k for k in obj["model_state_dict"] if k.endswith("attn.proj.weight"))
    obj["model_state_dict"][key][0, 0] = float("inf")
    torch.save(obj, path)
    rc, _, err = run(audio(assets, tmp_path / "a", aar=aar_dir), capsys)
    line = one_line_error(err)
    assert rc == 2 and key.removeprefix("module.") in line and "non-finite" in line


def test_nonfinite_video_rollout_is_recorded_as_failed_and_retried(assets, tmp_path, capsys, monkeypatch):
    from mmkv.pipelines.wan.pipeline import WanVideoPipeline

    real = WanVideoPipeline.generate

    def nan_for_codecs(self, context, noise, store, grid, on_block=None):
        result = real(self, context, noise, store, grid, on_block)
        if store.config.codec is not None:
            result.latents[0, 0, 0, 0, 0] = float("nan")
        return result

    out = tmp_path / "run"
    monkeypatch.setattr(WanVideoPipeline, "generate", nan_for_codecs)
    rc, stdout, _ = run(video(assets, out, codecs=LOSSY), capsys)
    variant = next(p.name for p in (out / "rollouts" / "p0000").iterdir() if p.name != "reference")
    d = out / "rollouts" / "p0000" / variant
    assert rc == 1 and (out / "rollouts" / "p0000" / "reference" / "rollout.json").is_file()
    assert not (d / "rollout.json").exists() and not (d / "video.mp4").exists()
    failed = json.loads((d / "failed.json").read_text())
    assert failed["status"] == "failed" and failed["reason"] == "non-finite output"
    assert "latents: 1 of" in failed["error"] and failed["variant"] == variant
    manifest = json.loads((out / "manifest.rank0.json").read_text())
    assert [(f["item"], f["variant"]) for f in manifest["failures"]] == [("p0000", variant)]
    assert [r["variant"] for r in manifest["rollouts"]] == ["reference"]
    assert f"p0000 {variant}: failed" in stdout and "1 failed" in stdout

    monkeypatch.setattr(WanVideoPipeline, "generate", real)  # fixed: the rerun renders it and clears the failure
    assert run(video(assets, out, codecs=LOSSY), capsys)[0] == 0
    assert (d / "rollout.json").is_file() and not (d / "failed.json").exists()
    assert json.loads((out / "manifest.rank0.json").read_text())["failures"] == []


def test_nonfinite_audio_rollout_is_recorded_as_failed(assets, tmp_path, capsys, monkeypatch):
    from mmkv.pipelines.aar import sample

    real = sample.rollout

    def nan_for_codecs(*args, store=None, **kwargs):
        r = real(*args, store=store, **kwargs)
        if store.config.codec is not None:
            r.audio[..., 3] = float("nan")
        return r

    monkeypatch.setattr(sample, "rollout", nan_for_codecs)
    out = tmp_path / "run"
    rc, stdout, _ = run(audio(assets, out), capsys)
    assert rc == 1
    for clip in ("clip0", "clip1"):
        d = out / "rollouts" / clip / "identity_dtypenative"
        assert not (d / "rollout.json").exists() and (out / "rollouts" / clip / "reference" / "rollout.json").is_file()
        assert "waveform: 1 of" in json.loads((d / "failed.json").read_text())["error"]
    manifest = json.loads((out / "manifest.rank0.json").read_text())
    assert sorted((f["item"], f["variant"]) for f in manifest["failures"]) == [
        ("clip0", "identity_dtypenative"), ("clip1", "identity_dtypenative")]
    assert "clip0 identity_dtypenative: failed" in stdout


# ----------------------------------------------------------------------------------------------------------------
# Permissions and failed writes


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_output_files_follow_the_umask(assets, tmp_path, capsys, umask):
    old = os.umask(umask)
    try:
        assert run(video(assets, tmp_path / "v"), capsys)[0] == 0
        assert run(audio(assets, tmp_path / "a"), capsys)[0] == 0
        mio.atomic_write_json(tmp_path / "x.json", {"a": 1})
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} >= {".json", ".npy", ".safetensors", ".mp4", ".wav"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_model_folders_follow_the_umask(tmp_path, umask):
    """transformers 5 saves model.safetensors through a 0600 temp file; the project's writers fix the mode."""
    from mmkv.demo import write_tiny_clap
    from mmkv.pipelines.wan.tiny import write_tiny_base

    old = os.umask(umask)
    try:
        write_tiny_base(tmp_path / "base")
        write_tiny_clap(tmp_path / "clap")
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "diffusion_pytorch_model.safetensors", "tokenizer.json"}
    assert {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files} == {
        str(p.relative_to(tmp_path)): oct(0o666 & ~umask) for p in files}


@pytest.fixture
def disk_full(monkeypatch):
    """Temp files of the named outputs become links to /dev/full, where every write fails with ENOSPC."""
    real = mio._create_temp
    names: set[str] = set()

    def create(path):
        tmp = real(path)
        if path.name in names:
            tmp.unlink()
            tmp.symlink_to("/dev/full")
        return tmp

    monkeypatch.setattr(mio, "_create_temp", create)
    return names


def test_disk_full_is_a_one_line_error_and_nothing_unreadable_is_moved_into_place(assets, tmp_path, capsys,
                                                                                  disk_full):
    out = tmp_path / "run"
    d = out / "rollouts" / "p0000" / "reference"
    disk_full.add("video.mp4")
    rc, _, err = run(video(assets, out), capsys)
    line = one_line_error(err)
    assert rc == 2 and "video.mp4" in line and "No space left on device" in line
    assert not (d / "video.mp4").exists() and not (d / "video.mp4").is_symlink()
    assert not (d / "rollout.json").exists() and not [p for p in d.iterdir() if ".tmp" in p.name]

    disk_full.clear()
    disk_full.add("rollout.json")
    rc, _, err = run(video(assets, out), capsys)
    line = one_line_error(err)
    assert rc == 2 and "rollout.json" in line and "No space left on device" in line
    assert not (d / "rollout.json").exists()

    disk_full.clear()
    disk_full.add("audio.wav")
    rc, _, err = run(audio(assets, tmp_path / "audio"), capsys)
    assert rc == 2 and "audio.wav" in one_line_error(err)
    assert not list((tmp_path / "audio").rglob("audio.wav"))

    disk_full.clear()  # space again: the interrupted run resumes and completes
    assert run(video(assets, out), capsys)[0] == 0 and (d / "rollout.json").is_file()


def test_a_truncated_or_empty_mp4_is_refused(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (17, 32, 48, 3), dtype=np.uint8)
    good = tmp_path / "good.mp4"
    video_cli._write_mp4(good, frames)
    data = good.read_bytes()
    for cut, why in ((len(data) // 2, "holds"), (100, "cannot read"), (0, "empty")):
        bad = tmp_path / f"cut{cut}.mp4"
        bad.write_bytes(data[:cut])
        with pytest.raises(mio.WriteError, match=why):
            video_cli._check_mp4(bad, len(frames), tmp_path / "video.mp4")


# ----------------------------------------------------------------------------------------------------------------
# Identical runs, identical bytes

# The files that hold wall-clock times, and only those: they differ between any two runs.
WALL_TIME_FILES = ("timings.json", "timings.rank*.json")


def _fingerprint(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): sha256(p) for p in sorted(out.rglob("*"))
            if p.is_file() and not any(p.match(pattern) for pattern in WALL_TIME_FILES)}


def test_identical_runs_write_identical_bytes(assets, tmp_path, capsys):
    for name in ("v1", "v2"):  # 6 latent frames, 2 blocks: the lossy codec encodes the first
        assert run(video(assets, tmp_path / name, frames=21, codecs=LOSSY), capsys)[0] == 0
    for name in ("a1", "a2"):
        assert run(audio(assets, tmp_path / name, codecs="identity,kivi:bits=2"), capsys)[0] == 0
    for a, b in (("v1", "v2"), ("a1", "a2")):
        first, second = _fingerprint(tmp_path / a), _fingerprint(tmp_path / b)
        assert sorted(first) == sorted(second)
        assert [k for k in first if first[k] != second[k]] == []
        names = {Path(k).name for k in first}
        assert {"rollout.json", "manifest.rank0.json"} <= names  # the records are hashed, not skipped
        # the times are where the readers look for them, and nowhere else
        left_out = sorted(str(p.relative_to(tmp_path / a)) for p in (tmp_path / a).rglob("timings*.json"))
        assert left_out == sorted(["timings.rank0.json", *(str(Path(k).parent / "timings.json")
                                                           for k in first if k.endswith("rollout.json"))])
        for k in first:
            if k.endswith(".json"):
                assert not {"timings", "seconds", "started", "finished"} & set(_keys(json.loads(
                    (tmp_path / a / k).read_text()))), k
    assert {Path(k).name for k in first} >= {"audio.wav", "tokens.safetensors", "latent.safetensors"}
    assert b"PEAK" not in (tmp_path / "a1" / "rollouts" / "clip0" / "reference" / "audio.wav").read_bytes()


def _keys(obj) -> set[str]:
    """Every dict key anywhere in a JSON document."""
    if isinstance(obj, dict):
        return set(obj) | set().union(*map(_keys, obj.values()))
    if isinstance(obj, list):
        return set().union(*map(_keys, obj))
    return set()


def test_a_rollout_whose_timings_are_gone_is_still_complete(assets, tmp_path, capsys):
    out = tmp_path / "v"
    assert run(video(assets, out), capsys)[0] == 0
    d = out / "rollouts" / "p0000" / "reference"
    timings = json.loads((d / "timings.json").read_text())
    assert len(timings["per_block"]) == 1 and timings["total"] > 0  # 9 frames: 3 latent frames, one block
    rank = json.loads((out / "timings.rank0.json").read_text())
    assert rank["rollouts"]["p0000/reference"] == timings and rank["runs"][0]["run"] == 0
    assert {"started", "finished"} <= set(rank["runs"][0])
    (d / "timings.json").unlink()
    (out / "timings.rank0.json").unlink()
    stamp = (d / "rollout.json").stat().st_mtime_ns
    rc, stdout, _ = run(video(assets, out), capsys)
    assert rc == 0 and "already complete" in stdout and (d / "rollout.json").stat().st_mtime_ns == stamp
    assert not (d / "timings.json").exists()
    manifest = json.loads((out / "manifest.rank0.json").read_text())
    assert [r["variant"] for r in manifest["rollouts"]] == ["reference", "identity_dtypenative"]
    assert [r["pending"] for r in manifest["runs"]] == [2, 0]
    assert json.loads((out / "timings.rank0.json").read_text())["runs"][0]["run"] == 1

    a = tmp_path / "a"  # audio: the table shows '-' for the time it no longer knows
    rc, stdout, _ = run(audio(assets, a), capsys)
    rows = [line for line in stdout.splitlines() if line.startswith("| reference ")]
    assert rc == 0 and len(rows) == 2 and not any(row.rstrip(" |").endswith("-") for row in rows), rows
    for p in a.rglob("timings.json"):
        p.unlink()
    rc, stdout, _ = run(audio(assets, a), capsys)
    rows = [line for line in stdout.splitlines() if line.startswith("| reference ")]
    assert rc == 0 and "0 rollout(s) rendered" in stdout and len(rows) == 2
    assert all(row.rstrip(" |").endswith("-") for row in rows), rows


def test_a_manifest_with_inline_wall_times_moves_them_to_the_timings_file(tmp_path):
    """Run folders written before the timings files existed resume into the new layout."""
    folder = common.RunFolder(tmp_path / "run")
    folder.manifest_path.write_text(json.dumps({
        "config": {"seed": 0}, "runs": [{"started": "2025-01-01T10:00:00", "pending": 2}],
        "rollouts": [{"item": "p0000", "variant": "reference", "seconds": 1.5},
                     {"item": "clip0", "variant": "reference", "timings": {"total_s": 2.5}}]}))
    folder.open_manifest({"seed": 0}, identity_keys=("seed",)).save()
    manifest = json.loads(folder.manifest_path.read_text())
    assert manifest["runs"] == [{"pending": 2}]
    assert manifest["rollouts"] == [{"item": "p0000", "variant": "reference"},
                                    {"item": "clip0", "variant": "reference"}]
    timings = json.loads(folder.timings_path.read_text())
    assert timings == {"runs": [{"run": 0, "started": "2025-01-01T10:00:00"}],
                       "rollouts": {"p0000/reference": {"total": 1.5}, "clip0/reference": {"total_s": 2.5}}}


def test_safetensors_and_wav_bytes_depend_only_on_their_content(tmp_path):
    tensors = {"latents": torch.randn(3, 4), "scale_00": torch.arange(5), "half": torch.ones(2, dtype=torch.float16)}
    meta = {"layout": "F,C,H,W", "item": "p0000", "variant": "reference", "patch_nums": "[1, 2]"}
    blobs = {mio.atomic_save_safetensors(tmp_path / f"{i}.safetensors", tensors, meta).read_bytes() for i in range(8)}
    assert len(blobs) == 1
    from safetensors import safe_open

    with safe_open(str(tmp_path / "0.safetensors"), "pt") as f:
        assert f.metadata() == meta and all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())

    import soundfile as sf

    wave = np.random.default_rng(1).standard_normal(1001).astype(np.float32)
    path = mio.atomic_save_wav(tmp_path / "a.wav", wave, 24_000)
    read, sr = sf.read(str(path), dtype="float32")
    assert sr == 24_000 and np.array_equal(read, wave) and sf.info(str(path)).subtype == "FLOAT"
    assert b"PEAK" not in path.read_bytes()


# ----------------------------------------------------------------------------------------------------------------
# Killed writes and output without a terminal


def test_temp_file_of_a_killed_manifest_write_is_removed_by_the_next_run(assets, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    script = ("import os, signal, sys\nfrom mmkv.io import atomic_path\n"
              "with atomic_path(sys.argv[1]) as tmp:\n    tmp.write_text('{\"config\": ')\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    for rank in (0, 1):
        done = subprocess.run([sys.executable, "-c", script, str(out / f"manifest.rank{rank}.json")])
        assert done.returncode == -9
    left = sorted(p.name for p in out.iterdir())
    assert len(left) == 2 and all(name.endswith(".tmp.json") for name in left)
    assert run(video(assets, out), capsys)[0] == 0
    # rank 0 removed its own; rank 1's may be a write in progress by that rank, so it stays
    assert [p.name for p in out.glob(".manifest.*")] == [left[1]] and left[1].startswith(".manifest.rank1.")


def test_every_rollout_and_a_summary_are_printed_without_a_terminal(assets, tmp_path, capsys):
    assert not sys.stdout.isatty()
    rc, stdout, _ = run(video(assets, tmp_path / "v", codecs=f"identity,{LOSSY}"), capsys)
    lines = stdout.splitlines()
    assert rc == 0 and len([s for s in lines if s.startswith("p0000 ") and " s, KV " in s]) == 3
    assert any(s.startswith("rank 0: 3 rollout(s) rendered, 0 already complete, 0 failed") for s in lines)
    rc, stdout, _ = run(video(assets, tmp_path / "v", codecs=f"identity,{LOSSY}"), capsys)
    assert rc == 0 and "all 3 rollouts already complete" in stdout

    rc, stdout, _ = run(audio(assets, tmp_path / "a"), capsys)
    lines = stdout.splitlines()
    assert rc == 0 and len([s for s in lines if s.startswith("clip") and " s, KV " in s]) == 4
    assert any(s.startswith("rank 0: 4 rollout(s) rendered") for s in lines)


def test_run_folder_helpers(tmp_path):
    """sha256_file caches by (path, size, mtime) and sees a rewrite; check_finite lets masks hold -inf, not NaN."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    assert common.sha256_file(f) == hashlib.sha256(b"abc").hexdigest()
    f.write_bytes(b"abcd")
    assert common.sha256_file(f) == hashlib.sha256(b"abcd").hexdigest()
    mask = torch.tensor([0.0, float("-inf")])
    common.check_finite({"mask": mask}, "x", allow_inf=["mask"])
    with pytest.raises(common.RunError, match="'mask' holds 1 non-finite"):
        common.check_finite({"mask": mask}, "x")
    with pytest.raises(common.RunError, match="'mask' holds 1 non-finite"):
        common.check_finite({"mask": torch.tensor([float("nan")])}, "x", allow_inf=["mask"])
