"""Run-folder utilities shared by the video and audio commands (`mmkv.pipelines.common`)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mmkv.pipelines import common
from mmkv.pipelines.common import RunError


def test_split_codec_list_keeps_commas_inside_presets():
    text = "kivi:bits=2,group=32,identity,octopus:b=3/groupquant:bits=2,group=16,identity:dtype=bf16"
    assert common.split_codec_list(text) == [
        "kivi:bits=2,group=32", "identity", "octopus:b=3/groupquant:bits=2,group=16", "identity:dtype=bf16",
    ]
    with pytest.raises(RunError, match="empty entry"):
        common.split_codec_list("identity,,kivi")
    with pytest.raises(RunError, match="empty codec list"):
        common.split_codec_list("  ")


def test_parse_codec_list_merges_lists_and_repeated_flags_and_names_folders():
    specs = common.parse_codec_list(["kivi:bits=2,group=32,identity"], ["groupquant:bits=4,group=32", "identity"],
                                    value_group=32)
    assert [s.variant for s in specs] == [
        specs[0].k.slug, "identity_dtypenative", specs[2].k.slug,
    ]  # the duplicate identity is dropped
    assert specs[0].nominal_bits == 2.0 and specs[1].nominal_bits is None
    assert str(specs[0].v).startswith("kivi:") and not specs[0].explicit_v
    explicit = common.parse_codec_list(None, ["identity/identity:dtype=bf16"])[0]
    assert explicit.variant == "identity_dtypenative__identity_dtypebf16" and explicit.explicit_v
    with pytest.raises(RunError, match="bad codec preset 'nosuchcodec:b=3'.*unknown codec"):
        common.parse_codec_list("nosuchcodec:b=3")
    with pytest.raises(RunError, match="no parameter"):
        common.parse_codec_list("kivi:bits=2,colour=red")


def test_read_prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("# header\n\n  a   red fox  \n#x\nthe sea\n", encoding="utf-8")
    assert common.read_prompts(path) == ["a red fox", "the sea"]
    path.write_text("# only comments\n\n   \n")
    with pytest.raises(RunError, match=r"p\.txt has no prompts"):
        common.read_prompts(path)
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(RunError, match=r"p\.txt is not UTF-8"):
        common.read_prompts(path)
    path.write_text("fine\nbin\x00ary\n")
    with pytest.raises(RunError, match=r"p\.txt, line 2: contains control characters"):
        common.read_prompts(path)
    with pytest.raises(RunError, match="does not exist"):
        common.read_prompts(tmp_path / "missing.txt")


def test_shipped_prompt_file_is_valid():
    from pathlib import Path

    prompts = common.read_prompts(Path(__file__).resolve().parent.parent / "prompts" / "prompts.txt")
    assert len(prompts) >= 20 and len(set(prompts)) == len(prompts)


def test_atomic_writes_leave_no_partial_file(tmp_path):
    target = tmp_path / "sub" / "x.json"
    common.atomic_write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    with pytest.raises(RuntimeError):
        with common.atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert json.loads(target.read_text()) == {"a": 1}  # the old file is intact
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]  # no temp file left
    arr = np.random.default_rng(0).integers(0, 255, (3, 4, 5), dtype=np.uint8)
    common.atomic_save_npy(tmp_path / "a.npy", arr)
    assert np.array_equal(np.load(tmp_path / "a.npy"), arr)


def test_noise_stream_is_private_and_hashed():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a, b = common.NoiseStream(3, 7), common.NoiseStream(3, 7)
    xa = [a.randn(2, 5), a.randn(4)]
    xb = [b.randn(2, 5), b.randn(4)]
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG never moved
    assert all(torch.equal(x, y) for x, y in zip(xa, xb)) and a.sha256 == b.sha256 and a.count == 14
    assert a.sha256 == common.sha256_tensors(xa)
    assert common.NoiseStream(4, 7).randn(2, 5).ne(xa[0]).any()
    c = common.NoiseStream(3, 8)
    c.randn(2, 5)
    c.randn(4)
    assert c.sha256 != a.sha256
    bf = common.NoiseStream(3, 7).randn(2, 5, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, xa[0].bfloat16())


def test_rank_info_and_shard(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert common.rank_info() == (1, 3)
    shards = [common.shard(10, r, 3) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10)) and shards[1] == [1, 4, 7]
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(RunError, match=r"RANK=3 is not in \[0, WORLD_SIZE=3\)"):
        common.rank_info()


def test_run_folder_completion_and_manifest_resume(tmp_path):
    folder = common.RunFolder(tmp_path / "run", rank=0)
    d = folder.rollout_dir("p0000", "reference")
    d.mkdir(parents=True)
    (d / "frames.npy").write_bytes(b"x")
    assert not folder.is_complete("p0000", "reference")
    folder.write_rollout("p0000", "reference", {"item": "p0000", "files": {"frames": "frames.npy",
                                                                           "video": "video.mp4"}})
    assert not folder.is_complete("p0000", "reference")  # a listed file is missing
    (d / "video.mp4").write_bytes(b"y")
    assert folder.is_complete("p0000", "reference")
    m = folder.open_manifest({"seed": 0, "model": "causvid"}, identity_keys=("seed",))
    m.add_rollout({"item": "p0000", "variant": "reference"})
    m.add_rollout({"item": "p0000", "variant": "reference"})
    m.save()
    again = folder.open_manifest({"seed": 0, "model": "causvid"}, identity_keys=("seed",))
    assert again["rollouts"] == [{"item": "p0000", "variant": "reference"}]
    with pytest.raises(RunError, match="made with seed=0, the command now asks for 1"):
        folder.open_manifest({"seed": 1}, identity_keys=("seed",))
    assert os.path.basename(folder.manifest_path) == "manifest.rank0.json"


def test_versions_name_the_commit_of_a_copy_without_git(monkeypatch):
    """An install from a working-tree copy has no .git to read (the device machine's): MMKV_GIT_COMMIT names it."""
    from mmkv.pipelines import files

    monkeypatch.setenv("MMKV_GIT_COMMIT", "0123abc")
    assert files.versions()["git_commit"] == "0123abc"
    monkeypatch.delenv("MMKV_GIT_COMMIT")
    assert files.versions()["git_commit"] != "0123abc"
