"""`mmkv train audio` on the CPU: a micro configuration trains each stage for a few steps, its losses fall, it writes
weights only, and its output loads through the released-format loaders and the CLAP embedder and rolls out; the
pieces (CLAP features, the training quantiser, the teacher-forcing inputs) equal what inference computes."""

from __future__ import annotations

import argparse
import copy
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmkv.pipelines.aar import clap, sounds, train
from mmkv.pipelines.aar.sat import EuclideanCodebook

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = train.get_config("micro")


def _run(stage: str, out, source=None, steps=None, init=None, seed=0, overrides=()):
    ns = argparse.Namespace(stage=stage, config="micro", source=str(source) if source else None, out=str(out),
                            seed=seed, budget=None, steps=steps, device="cpu", init=str(init) if init else None,
                            overrides=list(overrides))
    assert train.run(ns) == 0
    return json.loads((out / "train.json").read_text())


def _falls(curve, ratio):
    return curve[-1][1] < ratio * curve[0][1]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_audio")
    records = {"clap": _run("clap", root / "clap")}
    records["sat"] = _run("sat", root / "sat", root / "clap", overrides=["sat_si_snr=0.01"])
    records["aar"] = _run("aar", root / "aar", root / "sat")
    return root, records


@pytest.fixture(scope="module")
def models(stages):
    from mmkv.pipelines.aar.loaders import load_models

    aar, sat, _ = load_models(stages[0] / "aar")
    return aar, sat


def _clips(n: int, seed0: int = 10**7) -> torch.Tensor:
    return train.render_clips([sounds.sample_sound(seed0 + i) for i in range(n)], CFG, torch.device("cpu"),
                              torch.Generator().manual_seed(0))


def test_every_stage_lowers_its_loss_and_writes_weights_only(stages):
    root, rec = stages
    for stage in train.STAGES:
        assert _falls(rec[stage]["loss_curve"], 0.8), (stage, rec[stage]["loss_curve"])
        assert rec[stage]["steps"] == rec[stage]["planned_steps"] and rec[stage]["ms_per_step"] > 0
    clap_files = {"config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json",
                  "tokenizer_config.json"}
    assert {p.name for p in (root / "aar" / "clap").iterdir()} == clap_files
    assert {p.name for p in (root / "aar").iterdir()} == {"AAR_micro.pth", "SAT_micro.pth", "clap", "train.json"}
    assert {p.name for p in (root / "sat").iterdir()} == {"SAT_micro.pth", "clap", "train.json"}
    for name, key in (("AAR_micro.pth", "model_state_dict"), ("SAT_micro.pth", "generator_state_dict")):
        ckpt = torch.load(root / "aar" / name, weights_only=True, map_location="cpu")
        assert set(ckpt) == {key} and all(isinstance(v, torch.Tensor) for v in ckpt[key].values())  # no optimiser


def test_train_json_reports_the_held_out_scores(stages):
    _, rec = stages
    top1 = rec["clap"]["retrieval"]["text_to_audio_top1"]
    assert "kind" in top1 and "all_named" in top1
    assert all(0 <= v["accuracy"] <= 1 and 0 < v["chance"] <= 1 for v in top1.values())
    held = rec["sat"]["heldout"]
    assert math.isfinite(held["si_snr_db"]) and held["log_mel_l1"] > 0
    assert set(held["si_snr_db_by_kind"]) <= set(sounds.KINDS) and held["si_snr_db_by_kind"]
    assert rec["sat"]["config"]["sat_si_snr"] == 0.01 and "si_snr_db" in rec["sat"]["loss_parts_last"]
    assert [u["tokens"] for u in held["codebook_usage"]] == list(CFG.sat["multi_scale"])
    assert all(1 <= u["used"] <= u["of"] == CFG.sat["bins"] for u in held["codebook_usage"])
    assert held["usage_clips"] == 12
    assert held["adherence"]["originals"]["clips"] == held["adherence"]["reconstructions"]["clips"] == held["clips"]
    aar = rec["aar"]["heldout"]
    assert len(aar["ce_cond_per_scale"]) == len(CFG.sat["multi_scale"]) and aar["ce_cond"] > 0
    # Teacher forcing without the earlier scales in attention: scale 0 has no past, so only the later scales change.
    assert aar["ce_cond_no_past_per_scale"][0] == pytest.approx(aar["ce_cond_per_scale"][0], abs=1e-3)
    assert aar["ce_cond_no_past_per_scale"][1:] != aar["ce_cond_per_scale"][1:]
    assert aar["rollouts"]["clips"] == CFG.eval_rollouts and aar["rollouts"]["finite"]
    lagged = aar["rollouts"]["direction_glide_lag"]  # the first held-out clip is a chirp
    assert lagged["lag"] == train.ROLLOUT_GLIDE_LAG and lagged["clips"] >= 1 and 0 <= lagged["ok"] <= 1
    for control in ("rollouts_no_past", "rollouts_random_aar"):  # does it read its cache; chance
        assert aar[control]["clips"] == CFG.eval_rollouts and aar[control]["finite"]
        assert 0 <= aar[control]["adherence"] <= 1


def test_the_no_past_control_removes_only_what_attention_reads_of_earlier_scales(models):
    """A native store gives the model's own cache's tokens; emptied after every scale, scale 0 (which has no past) is
    unchanged and a later scale's logits are not."""
    from mmkv.cache import CacheConfig, KVStore
    from mmkv.pipelines.aar.sample import rollout

    aar, sat = models
    cond = torch.nn.functional.normalize(torch.randn(3, 512, generator=torch.Generator().manual_seed(1)), dim=-1)
    store = KVStore(CacheConfig(codec=None, residual_window=1), num_layers=aar.depth, num_heads=aar.num_heads,
                    head_dim=aar.config.head_dim)
    own = rollout(aar, sat, cond, seed=5, key="k")
    native = rollout(aar, sat, cond, seed=5, key="k", store=store)
    assert native.tokens_sha256 == own.tokens_sha256
    cut = rollout(aar, sat, cond, seed=5, key="k", store=store, on_scale=lambda si: store.reset())
    assert cut.scale_logits_sha256[0] == own.scale_logits_sha256[0]
    assert all(a != b for a, b in zip(cut.scale_logits_sha256[1:], own.scale_logits_sha256[1:]))
    assert cut.noise_sha256 == own.noise_sha256  # the same sampling draws


def test_the_output_loads_through_the_loaders_and_the_clap_embedder_and_rolls_out(stages, models):
    from mmkv.pipelines.aar.sample import rollout

    aar, sat = models
    assert aar.depth == CFG.aar_depth and sat.codebook_size == CFG.sat["bins"]
    embedder = clap.ClapEmbedder(stages[0] / "aar" / "clap")
    wave = _clips(1)[0].numpy()
    emb = embedder.embed_wave(clap.resample(wave, CFG.sample_rate, clap.CLAP_SAMPLE_RATE))
    assert emb.shape == (512,) and abs(float(emb.norm()) - 1) < 1e-5
    out = rollout(aar, sat, emb[None], seed=0, key="clip")
    assert out.audio.shape == (1, 1, CFG.clip_samples) and torch.isfinite(out.audio).all()


def test_training_clap_embeddings_equal_the_clap_embedders(stages):
    from transformers import ClapModel

    folder = stages[0] / "aar" / "clap"
    model = ClapModel.from_pretrained(str(folder), local_files_only=True).eval()
    embedder = clap.ClapEmbedder(folder)
    wave = _clips(3)
    with torch.no_grad():
        ours = train.audio_embeddings(model, train.clap_inputs(wave, CFG, embedder.features, torch.device("cpu")))
    theirs = torch.stack([embedder.embed_wave(clap.resample(w.numpy(), CFG.sample_rate, clap.CLAP_SAMPLE_RATE))
                          for w in wave])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window_s", [1, 10])
def test_torch_features_equal_the_feature_extractor(window_s):
    """clap_features against `ClapFeatureExtractor` (numpy) on the same 48 kHz clips, at the micro window and at
    larger_clap_general's 10 s; the batched resampling against the per-clip `clap.resample` of `prepare_clip`."""
    extractor = train.feature_extractor(window_s)
    wave = _clips(2)
    w48 = train.clap_waves(wave, CFG.sample_rate)
    per_clip = np.stack([clap.resample(w.numpy(), CFG.sample_rate, clap.CLAP_SAMPLE_RATE) for w in wave])
    assert np.array_equal(w48.numpy(), per_clip)
    ref = extractor(list(per_clip), sampling_rate=clap.CLAP_SAMPLE_RATE, return_tensors="pt",
                    truncation="rand_trunc", padding="repeatpad")["input_features"]
    ours = train.clap_features(w48, extractor)
    assert ours.shape == ref.shape == (2, 1, 100 * window_s + 1, 64)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)  # dB; two FFT libraries


def test_quantiser_tokens_decode_to_the_inference_latent(models):
    """Eval-mode quantisation gives tokens whose inference decoding (`get_next_autoregressive_input`, as the
    rollout adds them up) is the quantiser's own latent, bit for bit; the training pass has the same value."""
    _, sat = models
    wave = _clips(3)[:, None]
    with torch.no_grad():
        z = sat.encoder(wave)
        f_hat, tokens, loss = train.quantize(sat, z)
        quant = sat.quantizer
        ref = torch.zeros_like(f_hat)
        for si, idx in enumerate(tokens):
            ref, _ = quant.get_next_autoregressive_input(si, ref, quant.embedding(idx, si))
    assert torch.equal(f_hat, ref) and float(loss) == 0
    assert [t.shape[1] for t in tokens] == list(CFG.sat["multi_scale"])
    trained = copy.deepcopy(sat)
    step = train.CodebookTraining(kmeans_iters=2, generator=torch.Generator().manual_seed(0))
    f_train, tokens_train, loss_train = train.quantize(trained, z, step)
    assert all(torch.equal(a, b) for a, b in zip(tokens, tokens_train))
    torch.testing.assert_close(f_train, f_hat, atol=1e-5, rtol=1e-5)
    assert loss_train > 0


def test_teacher_inputs_are_what_the_rollout_feeds():
    """Greedy rollout (top-k 1, no guidance) of tiny.py's random models, which read their inputs strongly: the
    teacher-forced logits built from the rollout's own tokens pick the same tokens at every position, so the inputs
    equal what the cached loop fed at each scale."""
    from mmkv.pipelines.aar.sample import SamplingConfig, rollout
    from mmkv.pipelines.aar.tiny import build_tiny, random_condition

    aar, sat = build_tiny("micro", seed=3)
    cond = random_condition(3, seed=4)
    out = rollout(aar, sat, cond, seed=0, key="greedy", sampling=SamplingConfig(cfg=0.0, top_k=1, top_p=0.0))
    inputs = train.teacher_inputs(sat, out.tokens)
    assert inputs.shape == (3, aar.L - aar.first_l, sat.latent_dim)
    with torch.no_grad():
        assert torch.equal(aar(cond, inputs).argmax(-1), out.tokens_flat)
        # the check can fail: inputs of another clip's tokens give other predictions
        shifted = train.teacher_inputs(sat, [torch.roll(t, 1, dims=0) for t in out.tokens])
        assert not torch.equal(aar(cond, shifted).argmax(-1), out.tokens_flat)


def test_kmeans_init_finds_the_clusters_of_the_first_batch():
    centres = torch.tensor([[5.0, 0, 0], [0, 5.0, 0], [0, 0, 5.0], [-5.0, 0, 0]])
    x = (centres[:, None] + 0.1 * torch.randn(4, 16, 3, generator=torch.Generator().manual_seed(1))).reshape(-1, 3)
    cb = EuclideanCodebook(3, 4)
    idx, _ = train.codebook_step(cb, x, train.CodebookTraining(kmeans_iters=10,
                                                                generator=torch.Generator().manual_seed(0)))
    assert bool(cb.inited) and sorted(torch.bincount(idx, minlength=4).tolist()) == [16] * 4
    means = torch.stack([x[i * 16:(i + 1) * 16].mean(0) for i in range(4)])
    found = cb.embed[idx.view(4, 16)[:, 0]]
    torch.testing.assert_close(found, means, atol=1e-3, rtol=0)  # and the EMA step on the same batch keeps them


def test_a_dead_code_restarts_at_a_vector_of_the_batch():
    """Upstream's reset writes only `embed` and the EMA step overwrites it; here the code really moves."""
    gen = torch.Generator().manual_seed(2)
    cb = EuclideanCodebook(3, 4)
    step = train.CodebookTraining(kmeans_iters=3, generator=gen)
    train.codebook_step(cb, torch.randn(32, 3, generator=gen), step)
    cb.embed[3] = 1e6  # never the nearest
    cb.cluster_size[3] = 0.5  # below dead_code 2
    x = torch.randn(32, 3, generator=gen)
    idx, _ = train.codebook_step(cb, x, step)
    assert 3 not in idx.tolist()
    assert torch.isclose(cb.embed[3][None], x, atol=1e-5).all(dim=1).any()
    assert cb.cluster_size[3] >= 0.99 * step.dead_code


def test_a_relative_dead_code_bar_keeps_a_codebook_fed_few_rows_a_step():
    """A coarse SAT scale sees one row a clip: with upstream's absolute bar nearly every code is reset every step
    and the codebook ends as copies of the last batches; the relative bar lets it spread over the data."""

    def fit(share: float) -> tuple[int, float]:
        gen = torch.Generator().manual_seed(0)
        cb = EuclideanCodebook(8, 128)
        step = train.CodebookTraining(kmeans_iters=3, dead_code_share=share, generator=torch.Generator().manual_seed(1))
        for _ in range(800):  # 8 rows a step for 128 codes
            train.codebook_step(cb, torch.randn(8, 8, generator=gen), step)
        x = torch.randn(2048, 8, generator=gen)
        idx, q = train.codebook_step(cb, x, None)
        return len(set(idx.tolist())), float(((x - q) ** 2).mean() / x.pow(2).mean())

    (used_abs, err_abs), (used_rel, err_rel) = fit(0.0), fit(0.1)
    assert used_abs <= 32 and used_rel >= 96  # measured: 13 and 127 of 128
    assert err_rel < 0.6 * err_abs  # measured: relative MSE 0.79 and 0.40


def test_contrastive_targets_count_same_caption_clips_as_positives():
    """Two clips whose captions mean the same: embedding them alike is optimal only when the groups say so."""
    scales = SimpleNamespace(logit_scale_a=torch.tensor(math.log(50.0)), logit_scale_t=torch.tensor(math.log(50.0)))
    e = torch.eye(3)
    alike = torch.stack([e[0], e[0], e[2]])
    apart = e
    same, distinct = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2])
    assert train.contrastive_loss(scales, alike, alike, same) < train.contrastive_loss(scales, apart, apart, same)
    assert train.contrastive_loss(scales, apart, apart, distinct) < train.contrastive_loss(scales, alike, alike,
                                                                                           distinct)


def test_caption_tokenizer_starts_every_caption_alike_and_knows_every_word(stages):
    from transformers import PreTrainedTokenizerFast

    saved = PreTrainedTokenizerFast.from_pretrained(str(stages[0] / "clap" / "clap"))
    captions = [sounds.caption(sounds.sample_sound(s)) for s in range(64)]
    for tok in (train.caption_tokenizer(CFG.text_len), saved):
        ids, mask = train.tokenize(tok, captions, CFG.text_len)
        assert (ids[:, 0] == 1).all() and not (ids == 2).any()  # `</s>` first, no unknown word
        assert (mask.sum(1) == torch.tensor([len(c.split()) + 2 for c in captions])).all()


def test_stage_order_and_folders_are_checked(stages, tmp_path):
    root, _ = stages
    with pytest.raises(ValueError, match="already holds"):
        _run("clap", root / "clap")
    with pytest.raises(ValueError, match="needs --from"):
        _run("sat", tmp_path / "x")
    with pytest.raises(ValueError, match="not the output of the 'sat' or 'aar' stage"):
        _run("aar", tmp_path / "y", root / "clap")
    with pytest.raises(ValueError, match="continues from the output of"):
        _run("aar", tmp_path / "z", root / "sat", init=root / "sat")
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()  # refused before writing anything


@pytest.mark.parametrize("stage", train.STAGES)
def test_init_continues_a_stage_from_its_weights(stages, tmp_path, stage):
    root, rec = stages
    source = {"clap": None, "sat": root / "clap", "aar": root / "sat"}[stage]
    more = _run(stage, tmp_path / stage, source, steps=3, init=root / stage, seed=1)
    assert more["init"] == str(root / stage) and more["steps"] == 3
    if stage != "clap":  # 12 steps of CLAP learn nothing that carries to other clips
        assert more["loss_curve"][0][1] < rec[stage]["loss_curve"][0][1]


@pytest.mark.parametrize("stage", ["clap", "sat"])
def test_an_aar_output_continues_the_earlier_stages_too(stages, tmp_path, stage):
    root, rec = stages
    source = {"clap": None, "sat": root / "clap"}[stage]
    more = _run(stage, tmp_path / stage, source, steps=3, init=root / "aar", seed=1)
    assert more["init"] == str(root / "aar") and more["steps"] == 3
    if stage == "sat":  # the aar folder's copy of the SAT: its codebooks and encoder, not a fresh init
        assert more["loss_curve"][0][1] < rec["sat"]["loss_curve"][0][1]


def test_a_release_with_its_training_state_continues_training(stages, tmp_path, capsys):
    """`ship audio --training-state`: bf16, the SAT's left-out state under training/, the aar stage's train.json
    beside; it loads as a release and every stage continues from it, the SAT from its own encoder and codebooks.
    Without training/ (the installed package) it is the plain release."""
    from mmkv.assets import trained_audio_assets
    from mmkv.cli import main
    from mmkv.pipelines.aar.loaders import load_models

    root, rec = stages
    aar_dir = root / "aar"
    slim, full = tmp_path / "slim", tmp_path / "full"
    common = ["ship", "audio", "--aar", str(aar_dir / "AAR_micro.pth"), "--sat", str(aar_dir / "SAT_micro.pth"),
              "--clap", str(aar_dir / "clap")]
    assert main(common + ["--out", str(slim)]) == 0 and main(common + ["--out", str(full), "--training-state"]) == 0
    capsys.readouterr()
    assert trained_audio_assets(full) is not None and not (slim / "train.json").exists()
    assert (full / "train.json").read_bytes() == (aar_dir / "train.json").read_bytes()
    # the checkpoints are the plain release's, byte for byte; the SAT's encoder and codebook sums lie under training/
    for name in ("AAR_micro.pth", "SAT_micro.pth"):
        assert (full / name).read_bytes() == (slim / name).read_bytes()
    extra = torch.load(full / "training" / "SAT_micro.pth", weights_only=True)["generator_state_dict"]
    assert any(k.startswith("encoder.") for k in extra) and any(k.endswith("embed_avg") for k in extra)
    assert all(v.dtype != torch.float32 for v in extra.values())
    assert sorted(p.relative_to(full).as_posix() for p in (full / "training").iterdir()) == ["training/SAT_micro.pth"]
    from mmkv.pipelines.aar.loaders import CheckpointError, EncoderLeftOut

    assert not isinstance(load_models(full)[1].encoder, EncoderLeftOut)  # read back from training/
    assert isinstance(load_models(slim)[1].encoder, EncoderLeftOut)
    more = _run("sat", tmp_path / "sat", root / "clap", steps=3, init=full, seed=1)
    assert more["loss_curve"][0][1] < rec["sat"]["loss_curve"][0][1]
    _run("aar", tmp_path / "aar", tmp_path / "sat", steps=3, init=full, seed=1)
    _run("clap", tmp_path / "clap", steps=3, init=full, seed=1)  # from its bf16 CLAP, trained in fp32
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "clap" / "clap" / "model.safetensors").values()
    assert {v.dtype for v in weights if v.is_floating_point()} == {torch.float32}
    # re-shipping the release with its training state gives the same bytes (its training/ is read with it)
    again = tmp_path / "again"
    assert main(["ship", "audio", "--aar", str(full / "AAR_micro.pth"), "--sat", str(full / "SAT_micro.pth"),
                 "--clap", str(full / "clap"), "--out", str(again), "--training-state"]) == 0
    assert (again / "SHA256SUMS").read_bytes() == (full / "SHA256SUMS").read_bytes()
    # the installed package's form leaves training/ out: still a checked release, a plain one to the loaders
    import shutil

    from mmkv.assets import AssetError

    installed = tmp_path / "installed"
    shutil.copytree(full, installed)
    shutil.rmtree(installed / "training")
    assert trained_audio_assets(installed) is not None
    assert isinstance(load_models(installed)[1].encoder, EncoderLeftOut)
    # present, it must be the recorded file; and it may not repeat the checkpoint's entries
    shutil.copy(slim / "SAT_micro.pth", again / "training" / "SAT_micro.pth")
    with pytest.raises(AssetError, match="training/SAT_micro.pth: SHA-256"):
        trained_audio_assets(again)
    with pytest.raises(CheckpointError, match="repeats entries of"):
        load_models(again)
    capsys.readouterr()
    # a release without its encoder cannot be one
    assert main(["ship", "audio", "--aar", str(slim / "AAR_micro.pth"), "--sat", str(slim / "SAT_micro.pth"),
                 "--clap", str(slim / "clap"), "--out", str(tmp_path / "x"), "--training-state"]) == 2
    assert "train.json" in capsys.readouterr().err and not (tmp_path / "x").exists()
    (slim / "train.json").write_bytes((aar_dir / "train.json").read_bytes())
    assert main(["ship", "audio", "--aar", str(slim / "AAR_micro.pth"), "--sat", str(slim / "SAT_micro.pth"),
                 "--clap", str(slim / "clap"), "--out", str(tmp_path / "x"), "--training-state"]) == 2
    assert "without its encoder" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_batch_si_snr_equals_the_float64_one_per_clip():
    from mmkv.pipelines.aar.sat_training import batch_si_snr_db, si_snr_db

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 2000, generator=gen)
    est = ref + 0.3 * torch.randn(3, 2000, generator=gen)
    per_clip = [si_snr_db(ref[i], est[i]) for i in range(3)]
    assert batch_si_snr_db(est, ref).item() == pytest.approx(float(np.mean(per_clip)), abs=1e-4)
    for i in range(3):  # against numpy, written from Le Roux et al. 2019, eq. 2 to 4
        r, e = ref[i].double().numpy(), est[i].double().numpy()
        r, e = r - r.mean(), e - e.mean()
        target = (e @ r) / (r @ r) * r
        assert per_clip[i] == pytest.approx(10 * np.log10((target @ target) / ((e - target) @ (e - target))),
                                            abs=1e-9)
    assert 5 < per_clip[0] < 15  # 0.3 noise: about 10.5 dB


def test_set_overrides_config_fields_with_their_types_and_names_bad_ones():
    from mmkv.pipelines.training import parse_overrides

    assert parse_overrides(CFG, ["sat_lr=1e-4", "sat_batch=8", "sat_si_snr=1"]) == {
        "sat_lr": 1e-4, "sat_batch": 8, "sat_si_snr": 1.0}
    for bad, words in [("sat_batch=2.5", "sat_batch takes a int"), ("nope=1", "expected FIELD=VALUE"),
                       ("sat_lr", "expected FIELD=VALUE"), ("name=x", "expected FIELD=VALUE"),
                       ("sat_lr=fast", "sat_lr takes a float")]:
        with pytest.raises(ValueError, match=words):
            parse_overrides(CFG, [bad])


def test_sat_adherence_ceiling_scores_originals_fully_and_silence_not():
    """evaluate_sat's `adherence` (what an AAR over the SAT's tokens can reach at best) on rendered held-out clips
    is 1 on the originals and drops when the waveform is lost."""
    from mmkv.pipelines.aar.sat_training import adherence_summary

    held = [sounds.sample_sound(s) for s in sounds.held_out_seeds(8)]
    waves = sounds.render(held).numpy()
    full = adherence_summary(waves, held, sounds.SAMPLE_RATE)
    assert full["clips"] == 8 and full["adherence"] == 1.0 and full["found"] == 8
    noisy = adherence_summary(np.random.default_rng(0).normal(0, 0.1, waves.shape).astype(np.float32), held,
                              sounds.SAMPLE_RATE)
    assert noisy["adherence"] is None or noisy["adherence"] < 0.6
    # Other detector thresholds reach score_audio: with no active frame allowed no clip shows a glide.
    from mmkv.metrics.audio_adherence import Thresholds

    chirps = [i for i, s in enumerate(held) if s.kind == "chirp"]
    strict = adherence_summary(waves[chirps], [held[i] for i in chirps], sounds.SAMPLE_RATE,
                               Thresholds(min_glide_steps=1000))
    assert chirps and strict["per_attribute"]["direction"]["ok"] == 0.0


def test_scales_see_only_themselves_inside_and_the_mask_comes_back():
    """The no-past teacher forcing lets each scale see its own tokens only, and restores the block-causal mask
    afterwards, also when the evaluation inside fails."""
    aar = train.init_aar(train.aar_config(CFG), 0)
    full = aar.attn_bias_for_masking.clone()
    lvl = aar.lvl_1L.view(-1)
    with pytest.raises(RuntimeError, match="inside"):
        with train.scales_see_only_themselves(aar):
            seen = torch.isfinite(aar.attn_bias_for_masking.view(len(lvl), len(lvl)))
            assert torch.equal(seen, lvl[:, None] == lvl[None, :])
            raise RuntimeError("inside")
    assert torch.equal(aar.attn_bias_for_masking, full)
    assert not torch.equal(torch.isfinite(full.view(len(lvl), len(lvl))), lvl[:, None] == lvl[None, :])
