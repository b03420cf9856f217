"""`mmkv generate video` end to end on tiny models: run-folder contract, identical noise, resume, sharding, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmkv.cli import main
from mmkv.pipelines import video_cli
from mmkv.pipelines.wan.tiny import tiny_transformer, write_causal_forcing_checkpoint, write_causvid_checkpoint
from mmkv.pipelines.wan.tiny import write_tiny_base

ROLLOUT_KEYS = {
    "kind", "item", "item_index", "text", "variant", "preset", "k_codec", "v_codec", "bits", "effective_bits",
    "kv_bytes", "bf16_kv_bytes", "kv_ratio", "peak_kv_bytes", "noise_sha256", "seed", "model", "residual_window",
    "peak_memory_bytes", "rank", "files", "versions",
}
LOSSY = "groupquant:bits=2,group=32"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_cli")
    transformer = tiny_transformer(seed=5)
    prompts = root / "prompts.txt"
    prompts.write_text("# tiny prompts\nA red fox runs through snow.\n\nWaves on black rocks at dusk.\n"
                       "A lighthouse in the fog.\n")
    return {
        "root": root,
        "base": write_tiny_base(root / "base", "diffusers", seed=4),
        "causvid": write_causvid_checkpoint(transformer, root / "causvid" / "model.pt").parent,
        "cf": write_causal_forcing_checkpoint(transformer, root / "cf" / "framewise.pt"),
        "prompts": prompts,
    }


def argv(env, out, *extra, model="causvid", frames=33):
    ckpt = env["causvid"] if model.startswith("causvid") else env["cf"]
    return ["generate", "video", "--model", model, "--ckpt", str(ckpt), "--base", str(env["base"]),
            "--prompts", str(env["prompts"]), "--frames", str(frames), "--height", "32", "--width", "48",
            "--out", str(out), *extra]


def records(out):
    return {(p.parent.parent.name, p.parent.name): json.loads(p.read_text())
            for p in sorted(out.glob("rollouts/*/*/rollout.json"))}


def test_generate_writes_the_run_folder_contract(env):
    out = env["root"] / "run"
    assert main(argv(env, out, "--codecs", f"identity,{LOSSY}", "--max-prompts", "2")) == 0
    recs = records(out)
    lossy_variant = next(v for _, v in recs if v.startswith("groupquant"))
    assert set(recs) == {(f"p000{i}", v) for i in range(2) for v in ("reference", "identity_dtypenative",
                                                                      lossy_variant)}
    for (item, variant), rec in recs.items():
        assert ROLLOUT_KEYS <= set(rec), ROLLOUT_KEYS - set(rec)
        assert rec["kind"] == "video" and rec["item"] == item and rec["variant"] == variant
        d = out / "rollouts" / item / variant
        frames = np.load(d / "frames.npy")
        assert frames.dtype == np.uint8 and frames.shape == (33, 32, 48, 3) and frames.std() > 1
        latents = load_file(str(d / "latents.safetensors"))["latents"]
        assert latents.dtype == torch.float32 and latents.shape == (9, 16, 4, 6)
        assert (d / "video.mp4").stat().st_size > 0
        timings = json.loads((d / "timings.json").read_text())  # wall times, kept out of rollout.json
        assert "timings" not in rec and len(timings["per_block"]) == 3 and timings["total"] > 0
    for i in range(2):
        ref, idt, lossy = (recs[(f"p000{i}", v)] for v in ("reference", "identity_dtypenative", lossy_variant))
        # identical noise for every variant of a prompt, recorded as SHA-256
        assert ref["noise_sha256"] == idt["noise_sha256"] == lossy["noise_sha256"]
        d = out / "rollouts" / f"p000{i}"
        assert np.array_equal(np.load(d / "reference" / "frames.npy"), np.load(d / "identity_dtypenative" /
                                                                               "frames.npy"))
        assert not np.array_equal(np.load(d / "reference" / "frames.npy"), np.load(d / lossy_variant /
                                                                                   "frames.npy"))
        assert ref["preset"] is None and ref["bits"] is None and ref["effective_bits"] == 32  # fp32 CPU reference, measured
        assert lossy["bits"] == 2 and 2 < lossy["effective_bits"] < 4  # 2-bit payload + fp16 scale/zero per 32
        assert lossy["kv_ratio"] > 1 and lossy["kv_bytes"] < ref["kv_bytes"]
        assert lossy["k_codec"].startswith("groupquant:bits=2") and lossy["v_codec"].startswith("groupquant")
    assert recs[("p0000", "reference")]["noise_sha256"] != recs[("p0001", "reference")]["noise_sha256"]
    manifest = json.loads((out / "manifest.rank0.json").read_text())
    assert len(manifest["rollouts"]) == 6 and manifest["config"]["codecs"][0] == "identity:dtype=native"
    dit = manifest["checkpoints"]["dit"]
    assert dit["entry"] == "generator" and len(dit["sha256"]) == 64
    # mp4 is playable and holds every frame (lossy: compare shapes only)
    import imageio.v2 as imageio

    video = np.stack(imageio.mimread(out / "rollouts" / "p0000" / "reference" / "video.mp4", format="FFMPEG"))
    assert video.shape == (33, 32, 48, 3)

    # a second run with another seed records other noise
    out2 = env["root"] / "run_seed1"
    assert main(argv(env, out2, "--max-prompts", "1", "--seed", "1")) == 0
    assert records(out2)[("p0000", "reference")]["noise_sha256"] != recs[("p0000", "reference")]["noise_sha256"]


def test_killed_sweep_resumes_without_loss_or_duplicates(env, monkeypatch):
    out = env["root"] / "resume"
    args = argv(env, out, "--codec", "identity", "--codec", LOSSY, "--max-prompts", "2", model="causal-forcing-frame",
                frames=17)
    real_write, calls = video_cli._write_mp4, []

    def crashing_write(path, frames):
        calls.append(path)
        if len(calls) == 4:  # the 4th rollout dies after writing frames and latents, before its mp4 and rollout.json
            raise KeyboardInterrupt("killed")
        real_write(path, frames)

    monkeypatch.setattr(video_cli, "_write_mp4", crashing_write)
    with pytest.raises(KeyboardInterrupt):
        main(args)
    done = records(out)
    assert len(done) == 3
    assert (out / "rollouts" / "p0001" / "reference" / "frames.npy").is_file()
    assert not (out / "rollouts" / "p0001" / "reference" / "rollout.json").exists()
    stamps = {k: (out / "rollouts" / k[0] / k[1] / "rollout.json").stat().st_mtime_ns for k in done}

    rendered = []
    real_render = video_cli._render

    def counting_render(pipe, folder, grid, a, index, prompt, spec, *rest):
        rendered.append((index, None if spec is None else spec.variant))
        return real_render(pipe, folder, grid, a, index, prompt, spec, *rest)

    monkeypatch.setattr(video_cli, "_write_mp4", real_write)
    monkeypatch.setattr(video_cli, "_render", counting_render)
    assert main(args) == 0
    assert len(rendered) == 3 and all(index == 1 for index, _ in rendered)  # only the unfinished prompt
    final = records(out)
    assert len(final) == 6
    for k, stamp in stamps.items():  # finished rollouts were not rewritten
        assert (out / "rollouts" / k[0] / k[1] / "rollout.json").stat().st_mtime_ns == stamp
    manifest = json.loads((out / "manifest.rank0.json").read_text())
    keys = [(r["item"], r["variant"]) for r in manifest["rollouts"]]
    assert sorted(keys) == sorted(final) and len(keys) == len(set(keys))
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    # a third run has nothing to do and does not load the models
    rendered.clear()
    assert main(args) == 0 and rendered == []
    # resuming with another seed into the same folder is refused
    assert main(args + ["--seed", "9"]) == 2


def test_ranks_shard_prompts_and_write_their_own_manifests(env, monkeypatch):
    out = env["root"] / "sharded"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        assert main(argv(env, out, "--max-prompts", "3")) == 0
    m0 = json.loads((out / "manifest.rank0.json").read_text())
    m1 = json.loads((out / "manifest.rank1.json").read_text())
    assert [r["item"] for r in m0["rollouts"]] == ["p0000", "p0002"]
    assert [r["item"] for r in m1["rollouts"]] == ["p0001"]
    assert {r["rank"] for k, r in records(out).items() if k[0] == "p0001"} == {1}


@pytest.mark.parametrize("case,expect", [
    ("empty_prompts", "has no prompts"),
    ("binary_prompts", "not UTF-8"),
    ("unknown_preset", "unknown video model preset 'causvid-xl'"),
    ("unknown_codec", "unknown codec 'zipkv'"),
    ("bad_height", "height 36 is not a positive multiple of 16"),
    ("bad_frames", "frame count 32 is not 1 \\+ 4k"),
    ("frames_vs_block", "not a multiple of the preset's 3 latent frames per block"),
    ("missing_ckpt", "nowhere.pt does not exist"),
])
def test_bad_input_gives_a_clear_error(env, tmp_path, capsys, case, expect):
    out = tmp_path / "run"
    args = argv(env, out)
    if case == "empty_prompts":
        (tmp_path / "p.txt").write_text("# nothing here\n\n")
        args[args.index("--prompts") + 1] = str(tmp_path / "p.txt")
    elif case == "binary_prompts":
        (tmp_path / "p.txt").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xd8")
        args[args.index("--prompts") + 1] = str(tmp_path / "p.txt")
    elif case == "unknown_preset":
        args[args.index("--model") + 1] = "causvid-xl"
    elif case == "unknown_codec":
        args += ["--codecs", "identity,zipkv:b=3"]
    elif case == "bad_height":
        args[args.index("--height") + 1] = "36"
    elif case == "bad_frames":
        args[args.index("--frames") + 1] = "32"
    elif case == "frames_vs_block":
        args[args.index("--frames") + 1] = "17"  # 5 latent frames, blocks of 3
    elif case == "missing_ckpt":
        args[args.index("--ckpt") + 1] = str(tmp_path / "nowhere.pt")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error:" in err
    import re

    assert re.search(expect, err), err
    if case in ("empty_prompts", "binary_prompts"):
        assert "p.txt" in err
    assert not out.exists()  # nothing is created before the input is known to be good


def test_reuse_decoded_renders_the_same_frames(env):
    """--reuse-decoded decodes each unit once per rollout: the frames and latents are bit-identical to decoding on
    every attention call, and the manifest says which mode ran."""
    runs = {}
    for flag in ((), ("--reuse-decoded",)):
        out = env["root"] / f"reuse{len(flag)}"
        assert main(argv(env, out, "--codecs", LOSSY, "--max-prompts", "1", *flag)) == 0
        runs[bool(flag)] = out
    (a,), (b,) = ([d for d in out.glob("rollouts/*/groupquant*")] for out in runs.values())
    assert np.array_equal(np.load(a / "frames.npy"), np.load(b / "frames.npy"))
    assert torch.equal(load_file(str(a / "latents.safetensors"))["latents"],
                       load_file(str(b / "latents.safetensors"))["latents"])
    cache_a, cache_b = (json.loads((d / "rollout.json").read_text())["cache"] for d in (a, b))
    assert (cache_a["reuse_decoded"], cache_b["reuse_decoded"]) == (False, True)
    assert cache_a["nbytes"] == cache_b["nbytes"] and cache_a["decoded_peak_nbytes"] == 0 < cache_b["decoded_peak_nbytes"]
