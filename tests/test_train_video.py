"""`mmkv train video` on the CPU: a micro configuration trains for a few steps per stage, its losses fall, and its
output is the release layout the loaders read unchanged."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from mmkv.pipelines.wan import scenes, train


def _run(stage: str, out, source=None, steps=None, init=None, seed=0, decoder_only=False, overrides=()):
    ns = argparse.Namespace(stage=stage, config="micro", source=str(source) if source else None, out=str(out),
                            seed=seed, budget=None, steps=steps, device="cpu", init=str(init) if init else None,
                            decoder_only=decoder_only, overrides=list(overrides))
    assert train.run(ns) == 0
    return json.loads((out / "train.json").read_text())


def _falls(curve, ratio):
    """The mean loss of the last third of the curve is below `ratio` x that of the first third."""
    k = max(1, len(curve) // 3)
    first = sum(v for _, v in curve[:k]) / k
    last = sum(v for _, v in curve[-k:]) / k
    return last < ratio * first


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    vae = _run("vae", root / "vae")
    dit = _run("dit", root / "dit", root / "vae")
    dist = _run("distill", root / "distill", root / "dit")
    return root, vae, dit, dist


def test_teacher_forcing_mask_is_block_causal_with_the_noisy_copy_seeing_only_earlier_clean_blocks():
    m = train.TeacherForcing(num_frames=6, frames_per_block=3, tokens_per_frame=2).mask()
    L = 12
    assert m.shape == (2 * L, 2 * L)
    clean = lambda f: slice(2 * f, 2 * f + 2)  # noqa: E731
    noisy = lambda f: slice(L + 2 * f, L + 2 * f + 2)  # noqa: E731
    assert m[clean(4), clean(1)].all() and not m[clean(1), clean(4)].any()  # clean: block-causal
    assert not m[clean(0), noisy(0)].any()  # clean never sees noise
    assert m[noisy(4), clean(2)].all() and not m[noisy(4), clean(3)].any()  # earlier clean blocks only
    assert m[noisy(4), noisy(3)].all() and not m[noisy(4), noisy(1)].any()  # its own noisy block only
    framewise = train.TeacherForcing(num_frames=6, frames_per_block=1, tokens_per_frame=2).mask()
    assert framewise[noisy(4), clean(3)].all() and not framewise[noisy(4), noisy(3)].any()


@pytest.mark.parametrize("frames, fpb", [(6, 3), (7, 3), (5, 1)])
def test_blockwise_teacher_forcing_attention_equals_the_masked_one(frames, fpb):
    """`TeacherForcing.attend` (unmasked SDPA a block) gives the masked SDPA's output and gradients, a last block
    shorter than the others included."""
    layout = train.TeacherForcing(frames, fpb, tokens_per_frame=5)
    q, k, v = (torch.randn(2, 3, 2 * frames * 5, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask())
    out = layout.attend(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="needs 2 x"):
        layout.attend(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:])


def test_a_framewise_share_of_the_batches_uses_one_frame_blocks():
    cfg = train.get_config("tiny")
    gen = torch.Generator().manual_seed(0)
    sizes = [train.block_size(cfg, gen) for _ in range(4000)]
    assert set(sizes) == {1, cfg.frames_per_block}
    assert abs(sizes.count(1) / len(sizes) - cfg.framewise) < 0.03


def test_noisy_copy_reuses_the_clean_rope_indices():
    """With frame_positions [0..F-1, 0..F-1] a noisy frame gets the same rotary table row as its clean frame."""
    dit = train.build_dit(train.get_config("micro"), seed=0)
    rope = dit.transformer.rope
    dit.state.frame_positions = torch.tensor([0, 1, 0, 1])
    cos, _ = rope(torch.zeros(1, 16, 4, 2, 2))
    dit.state.frame_positions = None
    per_frame = cos.view(4, 4, -1)  # [frames, tokens a frame (1x... grid of 1x2 tokens -> 1*1), dim]
    assert torch.equal(per_frame[0], per_frame[2]) and torch.equal(per_frame[1], per_frame[3])
    assert not torch.equal(per_frame[0], per_frame[1])


def test_positions_are_checked_on_the_host_and_kept():
    """Positions given on the CPU (teacher forcing's) are checked there and give the rows of the same positions given
    on the tables' device; out-of-range ones are refused with the range."""
    from mmkv.pipelines.wan.model import ModelError

    dit = train.build_dit(train.get_config("micro"), seed=0)
    rope = dit.transformer.rope
    x = torch.zeros(1, 16, 4, 2, 2)
    dit.state.frame_positions = torch.tensor([0, 1, 0, 1])
    cos_a, sin_a = rope(x)
    dit.state.frame_positions = torch.tensor([0, 1, 0, 1]).clone()  # a second tensor, the same values: the kept copy
    cos_b, sin_b = rope(x)
    assert torch.equal(cos_a, cos_b) and torch.equal(sin_a, sin_b)
    for bad in ([0, 1, 0, rope.max_seq_len], [0, -1, 0, 1], [0, 1, 0]):
        dit.state.frame_positions = torch.tensor(bad)
        with pytest.raises(ModelError, match="frame_positions must hold 4 indices"):
            rope(x)
    dit.state.frame_positions = None


def test_curve_reads_device_losses_back_once_a_window_with_python_float_sums():
    """Losses given as tensors (a training step's, never read back between windows) give the very curve that their
    Python floats give; a window's mean comes back when it closes, and a NaN inside a window stops `optimise`."""
    from mmkv.pipelines import training

    values = torch.randn(23, generator=torch.Generator().manual_seed(0)).abs() * 1e-3 + 0.1
    a, b = training.Curve(every=5), training.Curve(every=5)
    closed = []
    for i, v in enumerate(values):
        a.add(i, float(v))
        closed.append(b.add(i, v.clone()))
    a.flush(len(values))
    b.flush(len(values))
    assert a.points == b.points and len(b.points) == 5
    assert [c is not None for c in closed] == [(i + 1) % 5 == 0 for i in range(23)]

    w = torch.nn.Parameter(torch.ones(3))

    def loss_fn(step):
        return (w * w).sum() * (float("nan") if step == 12 else 1.0)

    with pytest.raises(RuntimeError, match="loss is nan over the window of steps up to step 15"):
        training.optimise([w], loss_fn, steps=50, lr=1e-3, warmup=1, budget_s=None, device=torch.device("cpu"),
                          log=lambda m: None, name="t")


def test_every_stage_lowers_its_loss_and_writes_weights_only(stages):
    root, vae, dit, dist = stages
    assert _falls(vae["loss_curve"], 0.75), vae["loss_curve"]
    assert _falls(dit["loss_curve"], 0.9), dit["loss_curve"]
    assert _falls(dist["loss_curve"], 0.9), dist["loss_curve"]
    for rec in (vae, dit, dist):
        assert rec["steps"] == rec["planned_steps"] and rec["ms_per_step"] > 0
    ckpt = torch.load(root / "distill" / "causvid" / "model.pt", weights_only=True, map_location="cpu")
    assert set(ckpt) == {"generator"}  # no optimizer state
    assert all(v.dtype == torch.bfloat16 for v in ckpt["generator"].values())
    for name, rec in (("dit", dit), ("distill", dist)):  # the release's bytes, as `mmkv ship video` counts them
        files = [p for d in ("base", "causvid") for p in (root / name / d).rglob("*") if p.is_file()]
        assert rec["release_bytes"] == sum(p.stat().st_size for p in files) > 0


def test_a_release_over_the_package_budget_is_noted_in_the_stage_log():
    from mmkv.pipelines.wan.release import VIDEO_PACKAGE_BYTES, note_release_size

    lines: list[str] = []
    note_release_size(VIDEO_PACKAGE_BYTES, lines.append)
    assert lines == []
    note_release_size(23_640_000, lines.append)
    assert len(lines) == 1 and "23.64 MB, over the 20 MB package-data budget" in lines[0]


def test_the_release_layout_loads_through_the_loaders_and_rolls_out(stages):
    from mmkv.pipelines.common import NoiseStream
    from mmkv.pipelines.wan.loaders import load_wan
    from mmkv.pipelines.wan.loop import get_preset
    from mmkv.pipelines.wan.pipeline import WanVideoPipeline

    root = stages[0] / "distill"
    comps = load_wan(root / "causvid", root / "base", device="cpu")
    cfg = train.get_config("micro")
    assert comps.vae.config.scale_factor_spatial == 4 and comps.dit.head_dim == cfg.dit["attention_head_dim"]
    pipe = WanVideoPipeline(comps, get_preset("causvid"))
    grid = pipe.grid(cfg.frames, cfg.height, cfg.width)
    store = pipe.make_store(None, residual_window=1)
    context = pipe.encode_text(["a small red circle moving left slowly"])
    res = pipe.generate(context, NoiseStream(0, 0), store, grid)
    frames = pipe.decode(res.latents)
    assert frames.shape == (1, cfg.frames, cfg.height, cfg.width, 3)
    assert torch.isfinite(res.latents).all()


def test_word_tokenizer_gives_one_id_a_word_and_lower_cases():
    tok = train.word_tokenizer(["a", "red", "circle"], text_len=8)
    ids = tok(["A red circle", "a red blob"], padding="max_length", max_length=8).input_ids
    assert ids[0][:4] == [3, 5, 4, 1] and ids[0][4:] == [0] * 4
    assert ids[1][2] == 2  # unknown word


def test_a_second_stage_into_the_same_folder_is_refused(stages, tmp_path):
    root = stages[0]
    with pytest.raises(ValueError, match="already holds"):
        _run("vae", root / "vae")
    with pytest.raises(ValueError, match="needs --from"):
        _run("dit", tmp_path / "x")


def test_init_continues_a_stage_from_its_weights_and_refuses_another_stage(stages, tmp_path):
    root, *_ = stages
    more = _run("dit", tmp_path / "dit2", root / "vae", steps=3, init=root / "dit", seed=1)
    assert more["init"] == str(root / "dit") and more["steps"] == 3
    # starting from the trained weights, the first loss is already near where the first run ended
    first_run = json.loads((root / "dit" / "train.json").read_text())["loss_curve"]
    assert more["loss_curve"][0][1] < first_run[0][1]
    with pytest.raises(ValueError, match="continues from the output of"):
        _run("dit", tmp_path / "dit3", root / "vae", steps=3, init=root / "vae")
    # a distill output holds a DiT too (its student): more teacher-forced steps may start from it
    student = _run("dit", tmp_path / "dit4", root / "vae", steps=3, init=root / "distill", seed=2)
    assert student["init"] == str(root / "distill")
    assert student["loss_curve"][0][1] < first_run[0][1]


def test_eval_scores_held_out_prompts_with_and_without_the_past(stages, tmp_path):
    from mmkv.cli import main
    from mmkv.pipelines.wan.evaluate import evaluate_preset
    from mmkv.pipelines.wan.loaders import load_wan

    root = stages[0] / "distill"
    cfg = train.get_config("micro")
    out = tmp_path / "eval.json"
    argv = ["eval", "video", "--ckpt", str(root / "causvid"), "--base", str(root / "base"), "-n", "2",
            "--presets", "causvid", "--frames", str(cfg.frames), "--height", str(cfg.height), "--width",
            str(cfg.width), "--no-past", "--random-dit", "--given-first-block", "--vae-clips", "1", "--out", str(out)]
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    assert [(r["model"], r["first_block"], r["no_past"]) for r in rec["runs"]] == [
        ("trained", "generated", False), ("trained", "generated", True), ("trained", "given", False),
        ("trained", "given", True), ("random DiT", "generated", False), ("random DiT", "given", False)]
    assert all(r["summary"]["clips"] == 2 and len(r["clips"]) == 2 for r in rec["runs"])
    assert rec["held_out_seeds"][0] >= 10_000_000 and "vae_held_out_psnr_db" in rec
    vae = rec["vae_held_out"]
    assert vae["clips"] == 1 and vae["psnr_db"] == rec["vae_held_out_psnr_db"]
    assert vae["object_psnr_db"] is not None and vae["detector"]["clips"] == 1
    # the no-past control really removes the past: same noise, other frames after block 1
    comps = load_wan(root / "causvid", root / "base", device="cpu")
    prompts = [(s, "a small red circle moving left slowly") for s in (10_000_000,)]
    shape = {"frames": cfg.frames, "height": cfg.height, "width": cfg.width, "seed": 0}
    with_past = evaluate_preset(comps, "causvid", prompts, keep_frames=1, **shape)["frames"][0]
    no_past = evaluate_preset(comps, "causvid", prompts, keep_frames=1, no_past=True, **shape)["frames"][0]
    assert (with_past[:9] == no_past[:9]).all() and not (with_past[9:] == no_past[9:]).all()
    # a given first block is the held-out clip's own latents: its frames are theirs decoded, not the model's
    from mmkv.pipelines.wan.evaluate import first_block_latents
    from mmkv.pipelines.wan.loop import get_preset
    from mmkv.pipelines.wan.pipeline import WanVideoPipeline

    given = evaluate_preset(comps, "causvid", prompts, keep_frames=1, given_first_block=True, **shape)["frames"][0]
    latents = first_block_latents(comps.vae, 10_000_000, height=cfg.height, width=cfg.width)
    own = WanVideoPipeline(comps, get_preset("causvid")).decode(latents.to(comps.dit.dtype))[0]
    assert np.abs(given[:9].astype(int) - own).max() <= 1  # the same decode, up to a convolution path's rounding


def test_eval_without_device_takes_the_gpu_where_there_is_one(monkeypatch):
    """`eval video` resolves a missing --device as every other command does (`parse_device(None)`: this rank's GPU,
    else the CPU); it used to fall back to the CPU even on a GPU machine."""
    from mmkv.cli import main
    from mmkv.pipelines.wan import evaluate

    asked = []

    def parse_device(text, rank=0):
        asked.append(text)
        raise RuntimeError("resolved")

    monkeypatch.setattr(evaluate, "parse_device", parse_device)
    with pytest.raises(RuntimeError, match="resolved"):
        main(["eval", "video", "--ckpt", "x", "--base", "y", "--out", "z.json"])
    assert asked == [None]


def test_a_killed_eval_continues_from_its_partial_file_and_refuses_other_settings(stages, tmp_path, capsys):
    from mmkv.cli import main

    root = stages[0] / "distill"
    cfg = train.get_config("micro")
    out = tmp_path / "eval.json"
    argv = ["eval", "video", "--ckpt", str(root / "causvid"), "--base", str(root / "base"), "-n", "1",
            "--presets", "causvid", "--frames", str(cfg.frames), "--height", str(cfg.height), "--width",
            str(cfg.width), "--no-past", "--random-dit", "--vae-clips", "0", "--out", str(out)]
    assert main(argv) == 0
    whole = json.loads(out.read_text())
    assert not out.with_name("eval.json.partial").exists()
    # what a kill after two of the three runs leaves: OUT.partial with those runs, no OUT; one row marked so that a
    # recomputation would show
    killed = {**whole, "runs": whole["runs"][:2]}
    killed["runs"][1] = {**killed["runs"][1], "seconds": -1.0}
    out.unlink()
    out.with_name("eval.json.partial").write_text(json.dumps(killed))
    assert main(argv) == 0
    resumed = json.loads(out.read_text())
    assert resumed["runs"][1]["seconds"] == -1.0  # taken from the partial file, not rolled out again
    drop = lambda rec: [{k: v for k, v in r.items() if k != "seconds"} for r in rec["runs"]]  # noqa: E731
    assert drop(resumed) == drop(whole) and not out.with_name("eval.json.partial").exists()
    # a partial file of other settings is refused, and left as it was
    other = {**killed, "seed": 1}
    out.unlink()
    out.with_name("eval.json.partial").write_text(json.dumps(other))
    assert main(argv) == 2
    assert "eval.json.partial holds runs of other settings (they differ in seed)" in capsys.readouterr().err
    assert json.loads(out.with_name("eval.json.partial").read_text()) == other and not out.exists()
    out.with_name("eval.json.partial").write_text(json.dumps(killed))  # the same runs, asked without a control
    assert main([a for a in argv if a != "--no-past"]) == 2
    assert "(they differ in controls)" in capsys.readouterr().err


@pytest.mark.parametrize("no_past, given", [(False, False), (True, True)])
def test_eval_in_batches_rolls_out_each_prompt_with_its_own_noise(stages, no_past, given):
    """Three prompts in batches of 2 (a full and a partial batch) give each prompt the frames it gets alone."""
    from mmkv.pipelines.wan.evaluate import evaluate_preset
    from mmkv.pipelines.wan.loaders import load_wan

    root = stages[0] / "distill"
    cfg = train.get_config("micro")
    comps = load_wan(root / "causvid", root / "base", device="cpu")
    prompts = [(s, scenes.caption(scenes.sample_scene(s))) for s in scenes.held_out_seeds(3)]
    kw = dict(frames=cfg.frames, height=cfg.height, width=cfg.width, seed=5, keep_frames=3, no_past=no_past,
              given_first_block=given)
    alone = evaluate_preset(comps, "causvid", prompts, **kw)
    together = evaluate_preset(comps, "causvid", prompts, batch=2, **kw)
    assert [c["seed"] for c in together["clips"]] == [s for s, _ in prompts]
    for a, b in zip(alone["frames"], together["frames"]):
        assert a.shape == b.shape and np.abs(a.astype(int) - b.astype(int)).max() <= 2  # batched kernels' rounding
    assert not (alone["frames"][0] == alone["frames"][1]).all()  # and the prompts' rollouts differ
    with pytest.raises(ValueError, match="batch must be >= 1"):
        evaluate_preset(comps, "causvid", prompts, batch=0, **kw)


def test_ship_video_copies_a_release_the_asset_check_and_the_loaders_accept(stages, tmp_path, capsys):
    from mmkv.assets import trained_video_assets
    from mmkv.cli import main
    from mmkv.pipelines.wan.loaders import load_wan

    root = stages[0]
    dest = tmp_path / "assets" / "video"
    assert main(["ship", "video", "--from", str(root / "distill"), "--out", str(dest)]) == 0
    assert "wrote" in capsys.readouterr().out
    shipped = trained_video_assets(dest)  # every file recorded and matching
    assert shipped is not None and (dest / "train.json").read_bytes() == (root / "distill" / "train.json").read_bytes()
    assert (dest / "causvid" / "model.pt").read_bytes() == (root / "distill" / "causvid" / "model.pt").read_bytes()
    load_wan(shipped["causvid"], shipped["base"], device="cpu")
    again = tmp_path / "again"
    main(["ship", "video", "--from", str(root / "distill"), "--out", str(again)])
    assert (again / "SHA256SUMS").read_bytes() == (dest / "SHA256SUMS").read_bytes()  # identical bytes
    # the shipped folder is an init the training commands accept (it holds the distill stage's train.json)
    assert json.loads((dest / "train.json").read_text())["stage"] == "distill"
    assert main(["ship", "video", "--from", str(root / "distill"), "--out", str(dest)]) == 2  # not empty
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["ship", "video", "--from", str(root / "vae"), "--out", str(tmp_path / "x")]) == 2
    assert "dit or distill stage" in capsys.readouterr().err and not (tmp_path / "x").exists()
    # over the package-data budget: refused before anything is written, with the size and the way out
    small = tmp_path / "small"
    assert main(["ship", "video", "--from", str(root / "distill"), "--out", str(small), "--max-mb", "0.01"]) == 2
    assert "over the 0.01 MB package-data budget" in capsys.readouterr().err and not small.exists()
    assert main(["ship", "video", "--from", str(root / "distill"), "--out", str(small), "--max-mb", "-1"]) == 2
    assert "--max-mb -1" in capsys.readouterr().err and not small.exists()


def test_summary_counts_a_missing_object_as_wrong():
    from mmkv.pipelines.wan.evaluate import summarize

    clip = {"found": True, "colour_ok": True, "shape_ok": False, "size_ok": True, "direction_ok": True,
            "speed_ok": None, "consistency": 0.5, "windows": [{}, {"background_psnr": 30.0}]}
    lost = {"found": False, "colour_ok": None, "shape_ok": None, "size_ok": None, "direction_ok": None,
            "speed_ok": None, "consistency": None, "windows": []}
    s = summarize([clip, lost])
    assert s["found_pct"] == 50.0 and s["colour_pct"] == 50.0 and s["shape_pct"] == 0.0
    assert s["consistency_pct"] == 50.0 and s["background_psnr_db"] == 30.0
    assert "shape_by_named" not in s  # no prompts, no table


def test_summary_says_which_named_shapes_are_missed_and_what_they_read_as():
    from mmkv.pipelines.wan.evaluate import summarize

    def clip(prompt, found, shape, ok):
        return {"prompt": prompt, "found": found, "shape": shape, "shape_ok": ok, "consistency": None, "windows": []}

    scores = [clip("a small red square drifts down fast", True, "circle", False),
              clip("the green square is large and moves down quickly", False, None, None),
              clip("a small red circle drifts right slow", True, "circle", True),
              clip("a small green cross moving down slowly", True, "cross", True),
              clip("not a caption of the scenes", True, "circle", None)]
    s = summarize(scores)
    assert s["shape_pct"] == 40.0
    assert s["shape_by_named"] == {
        "circle": {"clips": 1, "right": 1, "read_as": {"circle": 1}},
        "cross": {"clips": 1, "right": 1, "read_as": {"cross": 1}},
        "square": {"clips": 2, "right": 0, "read_as": {"circle": 1, "none": 1}}}


@pytest.mark.parametrize("fpb", [3, 1])
def test_teacher_forced_flow_equals_the_cached_rollouts_flow(fpb):
    """What the DiT learns in teacher forcing is what inference asks of it: the flow of a noisy block seeing the clean
    blocks before it through the mask equals the flow of the same block denoised after those clean blocks were
    committed to a KV cache (mode "commit" at t = 0), block by block; the first-block steps' flow equals block 1's."""
    from mmkv.cache import CacheConfig, KVStore

    cfg = train.get_config("micro")
    dit = train.build_dit(cfg, seed=3).eval()
    dit.state.cache_cross_attn = False
    f, h, w = 6, cfg.height // 4, cfg.width // 4
    gen = torch.Generator().manual_seed(0)
    clean = torch.randn(1, f, 16, h, w, generator=gen)
    noisy = torch.randn(1, f, 16, h, w, generator=gen)
    context = torch.randn(1, cfg.text_len, cfg.dit["text_dim"], generator=gen)
    t_blocks = [900.0, 650.0, 400.0, 250.0, 800.0, 120.0][: f // fpb]
    t = torch.tensor(t_blocks).repeat_interleave(fpb)[None]
    mask = train.TeacherForcing(f, fpb, dit.tokens_per_frame(h, w)).mask()
    with torch.no_grad():
        full = train.teacher_forced_flow(dit, clean, noisy, t, context, mask)
        blockwise = train.teacher_forced_flow(dit, clean, noisy, t, context,
                                              train.TeacherForcing(f, fpb, dit.tokens_per_frame(h, w)))
        torch.testing.assert_close(blockwise, full, rtol=1e-4, atol=1e-4)  # what training runs
        first = train.first_block_flow(dit, noisy[:, :fpb], t[:, :fpb], context)
        store = KVStore(CacheConfig(codec=None, residual_window=f), num_layers=dit.num_layers,
                        num_heads=dit.num_heads, head_dim=dit.head_dim)
        dit.reset()
        with store.attach(dit.transformer):
            for j, s in enumerate(range(0, f, fpb)):
                flow = dit(noisy[:, s:s + fpb], t_blocks[j], context, start_frame=s, mode="denoise")
                torch.testing.assert_close(flow, full[:, s:s + fpb], rtol=1e-4, atol=1e-4)
                if j == 0:  # the first-block steps' flow too
                    torch.testing.assert_close(flow, first, rtol=1e-4, atol=1e-4)
                dit(clean[:, s:s + fpb], 0.0, context, start_frame=s, mode="commit")


def test_vae_batches_mix_short_full_size_crops_and_long_windowed_ones():
    """A `vae_long_share` of the VAE batches are long crops of a spatial window (the causal caches' long-clip
    regime); the rest short full-size crops; all start on a chunk boundary and are reproducible from the seed."""
    cfg = train.get_config("micro")
    gen = torch.Generator().manual_seed(0)
    shapes = [tuple(train.vae_batch(cfg, gen, torch.device("cpu")).shape) for _ in range(12)]
    long = (cfg.vae_long_batch, 3, cfg.vae_long_frames, *cfg.vae_long_size)
    short = (cfg.vae_batch, 3, cfg.vae_frames, cfg.height, cfg.width)
    assert set(shapes) == {long, short}
    again = torch.Generator().manual_seed(0)
    torch.testing.assert_close(train.vae_batch(cfg, again, torch.device("cpu")),
                               train.vae_batch(cfg, torch.Generator().manual_seed(0), torch.device("cpu")))


def test_warm_reconstruct_gives_a_full_clips_frames_and_gradient_only_where_it_scores():
    """The warm-cache step: the frames after `context` chunks come out as the same frames of a full clip's encode
    and decode (the caches hold what they would), the scored latents reach the encoder's weights only when they
    are sampled, and bad context counts are refused."""
    cfg = train.get_config("micro")
    vae = train.build_vae(cfg, 0).eval()
    x, _ = train.render_clips([3, 4], cfg, torch.device("cpu"))
    with torch.no_grad():
        full = vae.decode(vae.encode(x).latent_dist.mode()).sample
        for context in (1, 3):
            rec, target, kl = train.warm_reconstruct(vae, x, context)
            start = 1 + 4 * (context - 1)
            assert rec.shape == target.shape == x[:, :, start:].shape
            torch.testing.assert_close(target, x[:, :, start:], rtol=0, atol=0)
            torch.testing.assert_close(rec, full[:, :, start:], rtol=1e-5, atol=1e-5)
            assert float(kl) == 0.0
    for noise in (None, torch.Generator().manual_seed(0)):
        vae.zero_grad(set_to_none=True)
        rec, target, kl = train.warm_reconstruct(vae, x[:, :, :13], 2, noise_gen=noise)
        (train.reconstruction_loss(rec, target, 0.0) + kl).backward()
        enc = [p.grad for p in vae.encoder.parameters()]
        assert all(g is None for g in enc) == (noise is None)
        assert all(p.grad is not None for p in vae.decoder.parameters())
    with pytest.raises(ValueError, match="at least 1 chunk"):
        train.warm_reconstruct(vae, x, 0)
    with pytest.raises(ValueError, match="more than 6 chunks"):
        train.warm_reconstruct(vae, x, 6)
    with pytest.raises(ValueError, match="leaves no context chunk"):
        train.vae_warm_batch(train.get_config("micro", vae_warm_chunks=6), torch.Generator(), torch.device("cpu"))
    x, context = train.vae_warm_batch(train.get_config("micro", vae_warm_context=2), torch.Generator().manual_seed(1),
                                      torch.device("cpu"))
    assert context in (1, 2) and x.shape[2] == 1 + 4 * (context + cfg.vae_warm_chunks - 1)
    assert x.shape[0] == cfg.vae_batch and x.shape[-2:] == (cfg.height, cfg.width)


def test_decoder_only_fine_tunes_the_decoder_of_a_release_and_keeps_its_latents(stages, tmp_path):
    """--decoder-only from a dit output (its base/vae): the encoder and the latent statistics the DiT learned on
    are unchanged, the decoder is not; without --init it is refused, and other stages refuse the flag."""
    from diffusers import AutoencoderKLWan

    root, *_ = stages
    rec = _run("vae", tmp_path / "vae2", steps=3, init=root / "dit", decoder_only=True)
    assert rec["decoder_only"] is True and rec["steps"] == 3
    old = AutoencoderKLWan.from_pretrained(root / "dit" / "base" / "vae", local_files_only=True)
    new = AutoencoderKLWan.from_pretrained(tmp_path / "vae2" / "vae", local_files_only=True)
    assert new.config.latents_mean == old.config.latents_mean and new.config.latents_std == old.config.latents_std
    o, n = old.state_dict(), new.state_dict()
    enc = [k for k in o if k.startswith(("encoder.", "quant_conv."))]
    dec = [k for k in o if k.startswith("decoder.")]
    assert enc and all(torch.equal(o[k], n[k].to(o[k].dtype)) for k in enc)
    assert any(not torch.equal(o[k], n[k].to(o[k].dtype)) for k in dec)
    with pytest.raises(ValueError, match="give --init"):
        _run("vae", tmp_path / "vae3", steps=2, decoder_only=True)
    with pytest.raises(ValueError, match="--stage vae only"):
        _run("dit", tmp_path / "dit4", root / "vae", steps=2, decoder_only=True)

    # vae_decoder_blend: the same training, then the decoder written part of the way from the init's
    half = _run("vae", tmp_path / "half", steps=3, init=root / "dit", decoder_only=True,
                overrides=["vae_decoder_blend=0.5"])
    assert half["held_out_trained_psnr_db"] == rec["held_out_psnr_db"]  # the same steps on the same draws
    h = AutoencoderKLWan.from_pretrained(tmp_path / "half" / "vae", local_files_only=True).state_dict()
    assert all(torch.equal(o[k], h[k].to(o[k].dtype)) for k in enc)
    moved = [k for k in dec if not torch.equal(o[k], n[k].to(o[k].dtype))]
    for k in moved:
        torch.testing.assert_close(h[k], 0.5 * (o[k].float() + n[k]), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="vae_decoder_blend=1.5: a number in"):
        _run("vae", tmp_path / "bad", steps=2, init=root / "dit", decoder_only=True, overrides=["vae_decoder_blend=1.5"])
    with pytest.raises(ValueError, match="give --decoder-only"):
        _run("vae", tmp_path / "bad2", steps=2, init=root / "dit", overrides=["vae_decoder_blend=0.5"])


def test_ema_warm_up_leaves_little_of_the_init_after_a_short_stage():
    """A stage cut to 644 steps by its budget must not write an EMA that is half its init (0.999^644 = 0.52)."""
    from mmkv.pipelines.training import ema_decay, ema_update

    assert ema_decay(0.999, 0) == pytest.approx(2 / 11)
    assert ema_decay(0.999, 20_000) == 0.999
    init, target = torch.nn.Linear(4, 4, bias=False).requires_grad_(False), torch.nn.Linear(4, 4, bias=False)
    torch.nn.init.zeros_(init.weight)
    torch.nn.init.ones_(target.weight)
    for step in range(644):
        ema_update(init, target, 0.999, step)
    assert float(init.weight.min()) > 0.99  # without the warm-up: 1 - 0.999^644 = 0.475


def test_budget_replans_when_steps_slow_down_after_the_probe(monkeypatch):
    """Steps of 1 s through the probe, then 3 s: a 200 s budget must stop near 200 s, not at the probe's plan."""
    from mmkv.pipelines import training

    clock = {"t": 0.0}
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock["t"])
    budget = training.Budget(10_000, 200.0, probe=50)
    done = 0
    while done < budget.steps:
        clock["t"] += 1.0 if done < 50 else 3.0
        done += 1
        budget.update(done)
        if done == 50:
            assert budget.steps == 200  # the probe's plan: 150 s left at 1 s a step
    assert budget.step_seconds == 1.0
    assert clock["t"] <= 215.0  # the plan alone would have run to 50 + 150 x 3 = 500 s


def test_budget_raises_its_plan_when_steps_speed_up_in_the_first_half(monkeypatch):
    """Steps of 3 s through the probe (another lane starting beside it), then 1 s: a 1000 s budget must be used
    (about 900 steps), not ended at the probe's plan of 333 steps and 500 s; never above the configured steps."""
    from mmkv.pipelines import training

    def run(cap: int, slow_until: int, budget_s: float) -> tuple[int, float]:
        clock = {"t": 0.0}
        monkeypatch.setattr(training.time, "perf_counter", lambda: clock["t"])
        budget = training.Budget(cap, budget_s, probe=50)
        done = 0
        while done < budget.steps:
            clock["t"] += 3.0 if done < slow_until else 1.0
            done += 1
            budget.update(done)
            if done == 50:
                assert budget.steps == min(cap, 50 + int((budget_s - 150.0) / 3.0))
        return done, clock["t"]

    done, t = run(10_000, 50, 1000.0)
    assert 880 <= done <= 910 and 980.0 <= t <= 1000.0
    assert run(600, 50, 1000.0)[0] == 600  # the configured steps stay the cap
    # Faster only after half of the plan: kept (raising it would restart the cosine decay); 333 steps, 799 s.
    done, t = run(10_000, 200, 1000.0)
    assert done == 333 and t == pytest.approx(200 * 3.0 + 133 * 1.0)


def test_a_step_plan_replays_a_budgeted_runs_schedule(monkeypatch):
    """The cosine schedule follows the plan of the moment, which a budget re-plans every 50 steps; a replay given
    the run's `history` (train.json's `step_plan`) sees the same plan at every step, whatever its own clock says,
    so its learning rates are the run's step for step (the final count alone gave other rates: 2026-12-04)."""
    from mmkv.pipelines import training

    def rates(budget: "training.Budget", pace) -> list[float]:
        clock = {"t": 0.0}
        monkeypatch.setattr(training.time, "perf_counter", lambda: clock["t"])
        budget.start = budget._warm_at = budget._last_at = 0.0
        out, done = [], 0
        while done < budget.steps:
            out.append(training.lr_at(done, budget.steps, 100, 1e-3))
            clock["t"] += pace(done)
            done += 1
            budget.update(done)
        return out

    run = training.Budget(3000, 300.0, probe=50)
    want = rates(run, lambda d: 0.30 if d < 120 else (0.27 if d < 400 else 0.33))  # a host whose pace moves
    assert len(run.history) >= 3 and run.history[0] == [0, 3000] and run.history[-1][1] == len(want)
    replay = training.Budget(3000, None, probe=50, plan=[tuple(x) for x in run.history])
    got = rates(replay, lambda d: 0.2)  # a faster machine: the clock no longer plans
    assert got == want and replay.history == run.history
    final_only = rates(training.Budget(len(want), None, probe=50), lambda d: 0.2)
    assert len(final_only) == len(want) and final_only != want


@pytest.mark.parametrize("text", ["50:900", "0:900,40:800,30:700", "0:900,x:1", "0:900,60:50", ""])
def test_step_plan_refuses_malformed_plans(text):
    from mmkv.pipelines.training import parse_step_plan

    with pytest.raises(ValueError, match="--step-plan .*expected DONE:STEPS pairs"):
        parse_step_plan(text)
    assert parse_step_plan("0:900,50:800") == [(0, 900), (50, 800)] and parse_step_plan(None) is None


def test_object_mask_is_the_named_object_only():
    """The VAE's object weight must land on the named object's pixels and nowhere else in rendered clips."""
    from mmkv.pipelines.wan import scenes

    seeds = scenes.held_out_seeds(6)
    px, _ = train.render_pixels(seeds, frames=5, height=64, width=96, device=torch.device("cpu"))
    mask = train.object_mask(px)[:, 0]
    for i, seed in enumerate(seeds):
        scene = scenes.sample_scene(seed)
        colour = torch.tensor(scenes.COLOURS[scene.colour], dtype=torch.float32) / 127.5 - 1
        near = (px[i] - colour.view(3, 1, 1, 1)).abs().amax(0) < 0.05  # the object's interior
        assert near.any() and bool(mask[i][near].all())
        assert float(mask[i].float().mean()) < 0.1  # an object, not the background
    rec = px + 0.1
    assert float(train.reconstruction_loss(rec, px, 0.0)) == pytest.approx(0.1 + 0.01, rel=1e-5)
    assert float(train.reconstruction_loss(rec, px, 4.0)) == pytest.approx(0.1 + 0.01, rel=1e-5)  # uniform error


def test_latent_object_mask_covers_the_objects_cells_on_the_latent_grid():
    """Latent cell (i, y, x) holds the object iff any pixel of its block does: frame 0 alone, then 4 frames a latent
    frame, 4 x 4 pixels a cell; the grid is the VAE's (encode_latents' shape)."""
    seeds = scenes.held_out_seeds(3)
    px, _ = train.render_pixels(seeds, frames=9, height=32, width=48, device=torch.device("cpu"))
    cells = train.latent_object_mask(px, 4, 4)
    assert cells.shape == (3, 3, 1, 8, 12) and cells.dtype == torch.bool
    pix = train.object_mask(px)[:, 0]  # [B, T, H, W]
    for b in range(3):
        for f, frames in enumerate([range(0, 1), range(1, 5), range(5, 9)]):
            for y in range(8):
                for x in range(12):
                    block = pix[b, frames.start:frames.stop, 4 * y:4 * y + 4, 4 * x:4 * x + 4]
                    assert bool(cells[b, f, 0, y, x]) == bool(block.any())
    assert 0 < float(cells.float().mean()) < 0.2  # an object's cells, not the frame


def test_object_weighted_mse_weights_the_objects_cells_only():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 3, 4, 5, 6, generator=g), torch.randn(2, 3, 4, 5, 6, generator=g)
    mask = torch.zeros(2, 3, 1, 5, 6, dtype=torch.bool)
    mask[:, :, :, 1:3, 2:4] = True
    plain = torch.nn.functional.mse_loss(pred, target)
    assert torch.equal(train.object_weighted_mse(pred, target, None, 0.0), plain)  # weight 0: the old loss exactly
    assert float(train.object_weighted_mse(target + 0.5, target, mask, 4.0)) == pytest.approx(0.25, rel=1e-6)
    on_object = target + 0.5 * mask  # the same error, only on the object's cells
    weighted = float(train.object_weighted_mse(on_object, target, mask, 4.0))
    assert weighted > 2 * float(torch.nn.functional.mse_loss(on_object, target))


def test_dit_stage_trains_with_an_object_weight(stages, tmp_path):
    root = stages[0]
    ns = argparse.Namespace(stage="dit", config="micro", source=str(root / "vae"), out=str(tmp_path / "dit"),
                            seed=0, budget=None, steps=6, device="cpu", init=None, decoder_only=False,
                            overrides=["dit_object_weight=4"])
    assert train.run(ns) == 0
    rec = json.loads((tmp_path / "dit" / "train.json").read_text())
    assert rec["config"]["dit_object_weight"] == 4 and rec["steps"] == 6
    assert all(np.isfinite(v) for _, v in rec["loss_curve"])


def test_deepen_keeps_the_function_and_refuses_a_shallower_depth():
    from mmkv.pipelines.wan.model import CausalWan

    cfg = train.get_config("micro", dit={**train.get_config("micro").dit, "num_layers": 2})
    dit = train.build_dit(cfg, seed=3).eval()
    deep = train.deepen(dit, 6)
    assert isinstance(deep, CausalWan) and deep.num_layers == 6 and deep.config.num_layers == 6
    assert len(deep.transformer.blocks) == 6 and not deep.training
    sd, deep_sd = dit.transformer.state_dict(), deep.transformer.state_dict()
    assert torch.equal(deep_sd["blocks.3.attn1.to_q.weight"], sd["blocks.1.attn1.to_q.weight"])
    assert torch.equal(deep_sd["blocks.3.ffn.net.2.weight"], sd["blocks.1.ffn.net.2.weight"])
    assert not deep_sd["blocks.4.ffn.net.2.weight"].any() and not deep_sd["blocks.5.attn2.to_out.0.bias"].any()
    assert deep_sd["blocks.4.attn1.to_k.weight"].abs().sum() > 0
    x = torch.randn(1, 2, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    t = torch.full((1, 2), 500.0)
    ctx = torch.randn(1, 5, cfg.dit["text_dim"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = train.first_block_flow(dit, x, t, ctx)
        b = train.first_block_flow(deep, x, t, ctx)
    assert torch.equal(a, b)  # each copy adds exact zeros to the residual stream
    assert train.deepen(dit, 2) is dit
    with pytest.raises(ValueError, match="dit_layers=1: the init's DiT has 2 layers; give at least 2"):
        train.deepen(dit, 1)
    odd = train.deepen(dit, 3)  # one extra block over two: block 1 gets the copy
    odd_sd = odd.transformer.state_dict()
    assert odd.num_layers == 3
    assert torch.equal(odd_sd["blocks.0.attn1.to_q.weight"], sd["blocks.0.attn1.to_q.weight"])
    assert torch.equal(odd_sd["blocks.1.attn1.to_q.weight"], sd["blocks.1.attn1.to_q.weight"])
    assert torch.equal(odd_sd["blocks.2.attn1.to_q.weight"], sd["blocks.1.attn1.to_q.weight"])
    assert odd_sd["blocks.1.ffn.net.2.weight"].any() and not odd_sd["blocks.2.ffn.net.2.weight"].any()
    with torch.no_grad():
        assert torch.equal(train.first_block_flow(odd, x, t, ctx), a)


def test_dit_stage_deepens_its_init_and_the_release_says_so(stages, tmp_path):
    from mmkv.pipelines.wan.loaders import load_wan

    root = stages[0]
    ns = argparse.Namespace(stage="dit", config="micro", source=str(root / "vae"), out=str(tmp_path / "dit"),
                            seed=4, budget=None, steps=3, device="cpu", init=str(root / "dit"), decoder_only=False,
                            overrides=["dit_layers=2"])
    assert train.run(ns) == 0
    rec = json.loads((tmp_path / "dit" / "train.json").read_text())
    assert rec["config"]["dit_layers"] == 2
    first_run = json.loads((root / "dit" / "train.json").read_text())["loss_curve"]
    assert rec["loss_curve"][0][1] < first_run[0][1]  # the deepened init starts where its init ended
    comps = load_wan(tmp_path / "dit" / "causvid", tmp_path / "dit" / "base", device="cpu")
    assert comps.dit.num_layers == 2
    assert json.loads((tmp_path / "dit" / "base" / "transformer" / "config.json").read_text())["num_layers"] == 2


def test_deterministic_kernels_name_the_ops_without_one_and_switch_back():
    """`--deterministic`: torch's deterministic algorithms on (warn-only), cuDNN and inductor without autotuning; an
    op that warns it has no deterministic kernel is collected once, by name; off again restores the defaults."""
    import warnings

    from mmkv.pipelines.training import deterministic_kernels

    try:
        assert deterministic_kernels(True, cuda=False) == [] and torch.backends.cuda.flash_sdp_enabled()  # a CPU stage
        seen = deterministic_kernels(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        import torch._inductor.config as inductor

        assert inductor.deterministic  # compiled blocks: no config chosen by timing it
        # attention on the math path alone: the fused kernels' backward passes are not deterministic under warn_only
        assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        for _ in range(2):
            warnings.warn("scatter_add_cuda_kernel does not have a deterministic implementation, but you set "
                          "'torch.use_deterministic_algorithms(True, warn_only=True)'.")
        warnings.warn("another warning")
        warnings.warn("cuDNN Attention defaults to a non-deterministic algorithm. To explicitly enable determinism "
                      "call torch.use_deterministic_algorithms(True, warn_only=False).")
        assert seen == ["scatter_add_cuda_kernel", "cuDNN Attention"]
    finally:
        deterministic_kernels(False)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert not inductor.deterministic
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()


def test_a_deterministic_stage_records_it_and_trains_the_same_weights_on_the_cpu(stages, tmp_path):
    """On the CPU every kernel is deterministic already: the flag changes no weight, and train.json says it ran
    with deterministic kernels and that no op lacked one."""
    root = stages[0]
    ns = argparse.Namespace(stage="vae", config="micro", source=None, out=str(tmp_path / "vae"), seed=0, budget=None,
                            steps=None, device="cpu", init=None, decoder_only=False, overrides=[], deterministic=True)
    try:
        assert train.run(ns) == 0
    finally:
        from mmkv.pipelines.training import deterministic_kernels

        deterministic_kernels(False)
    rec = json.loads((tmp_path / "vae" / "train.json").read_text())
    assert rec["deterministic"] == {"ops_without_a_deterministic_kernel": []}
    assert "deterministic" not in json.loads((root / "vae" / "train.json").read_text())
    made = sorted(p.relative_to(tmp_path / "vae") for p in (tmp_path / "vae").rglob("*.safetensors"))
    assert made and all((tmp_path / "vae" / p).read_bytes() == (root / "vae" / p).read_bytes() for p in made)


def test_dit_compile_compiles_the_trained_blocks_and_releases_the_uncompiled_ema(stages, tmp_path, monkeypatch):
    """`dit_compile`: the dit stage's DiT and the distillation's student train with each transformer block compiled
    in place, after their EMA copies are made, so that what a release writes is never a compiled module. Compiling
    takes half a minute on the CPU, so `nn.Module.compile` is replaced here by a recorder that marks the block."""
    from mmkv.pipelines.wan import distill, release

    compiled = []

    def record(self, *args, **kwargs):
        self.marked_compiled = True
        compiled.append(self)

    released = []

    def write(out, cfg, *, dit, **kwargs):
        released.append([getattr(b, "marked_compiled", False) for b in dit.transformer.blocks])
        return release.write_release(out, cfg, dit=dit, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", record)
    monkeypatch.setattr(train, "write_release", write)
    monkeypatch.setattr(distill, "write_release", write)
    root = stages[0]
    _run("dit", tmp_path / "plain", root / "vae", steps=2)
    assert compiled == [] and released == [[False]]  # off by default
    rec = _run("dit", tmp_path / "dit", root / "vae", steps=2, overrides=["dit_compile=true"])
    assert rec["config"]["dit_compile"] is True and len(compiled) == 1 and released[-1] == [False]
    _run("distill", tmp_path / "distill", tmp_path / "dit", steps=2, overrides=["dit_compile=true"])
    assert len(compiled) == 2 and released[-1] == [False]
    # compiled blocks do not replay across processes, so a deterministic run refuses them before writing anything
    ns = argparse.Namespace(stage="dit", config="micro", source=str(root / "vae"), out=str(tmp_path / "det"), seed=0,
                            budget=None, steps=2, device="cpu", init=None, decoder_only=False,
                            overrides=["dit_compile=true"], deterministic=True)
    with pytest.raises(ValueError, match="dit_compile=true with --deterministic: .*trains eager"):
        train.run(ns)
    assert len(compiled) == 2 and not (tmp_path / "det").exists()
