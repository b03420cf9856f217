"""`mmkv train audio`: the tiny audio models mmkv ships, trained on procedural captioned clips.

A CLAP, a SAT and an AAR, each of exactly the architecture `mmkv compare audio` loads (transformers `ClapModel`,
`mmkv.pipelines.aar.sat.SAT`, `mmkv.pipelines.aar.model.AAR`), trained on the clips of `mmkv.pipelines.aar.sounds`.
Three stages, each one command that reads the previous stage's folder and writes its own (weights only):

* `clap`: the demo's tiny `ClapModel` (512-d projections), contrastive (CLAP, Elizalde et al. 2023, section 2:
  symmetric InfoNCE with the learned logit scales `logit_scale_a` / `logit_scale_t`). Captions repeat (a chirp has
  six), so every pair of clips whose captions name the same attributes counts as a positive: the target of a row is
  uniform over them. Audio goes through the preprocessing of `mmkv.pipelines.aar.clap` (soxr resampling to 48 kHz,
  then the folder's `ClapFeatureExtractor`: repeat-pad, Slaney log-mel), computed in torch by `clap_features`,
  equal to the extractor's; text through a word-level tokenizer saved beside the weights. Writes `clap/`, a folder
  `ClapEmbedder` loads unchanged; scores text-to-audio retrieval per attribute on held-out clips.
* `sat`: SAT reconstruction (upstream `train_SAT_mpi.py` without its GAN: L1 / 10 + the 7-resolution log-mel L1 + L2
  of `losses.py` + the commitment loss), through the multi-scale residual VQ of upstream
  `quantization/core_vq.py`: each scale quantises the area-downsampled residual, its code vectors are upsampled
  (linear) and passed through the scale's phi convolution, exactly as `get_next_autoregressive_input` does at
  inference; the straight-through estimator carries the decoder's gradient to the encoder, phi learns from
  ||phi(q) - x||^2. Codebooks are EMA k-means (decay 0.99, Laplace smoothing), initialised by k-means on the first
  batch, with dead codes (EMA count < 2) reset to vectors of the batch. Writes `SAT_<config>.pth`
  (`generator_state_dict`) and copies `clap/`; scores held-out SI-SNR, log-mel L1 and per-scale codebook use.
* `aar`: next-scale prediction (upstream `train_AAR_mpi.py`): the SAT's tokens of a clip at every scale are the
  targets, the teacher-forcing inputs are what inference feeds (`teacher_inputs`: area-downsampled partial latents,
  `sample.py`'s loop), the condition is the trained CLAP's audio embedding of the same clip, replaced by the stored
  `uncond_embedding` in 10% of the rows; cross-entropy over all L tokens. Writes `AAR_<config>.pth`
  (`model_state_dict`, the EMA weights) beside copies of the SAT and `clap/`, the folder `mmkv compare audio --aar
  DIR --clap DIR/clap` reads; scores held-out teacher-forced cross-entropy (with and without the condition) and,
  optionally, the adherence of rollouts conditioned on held-out clips (`mmkv.metrics.audio_adherence`).

Every stage takes a wall-clock budget and `--init` (`mmkv.pipelines.training`); data, crops, k-means and condition
dropout draw from private generators seeded by `--seed`. All three train in fp32 (TF32 matmuls on CUDA): codebook
distances, STFT losses and cosine attention are kept out of bf16, and at these widths the steps are launch-bound.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mmkv.codecs.base import private_generator
from mmkv.io import save_pretrained
from mmkv.demo import TINY_CLAP_AUDIO, TINY_CLAP_TEXT
from mmkv.pipelines.aar import sounds
from mmkv.pipelines.aar.loaders import load_aar, load_sat, save_released_format, training_state_file
from mmkv.pipelines.aar.model import AAR, AARConfig, build_aar
from mmkv.pipelines.aar.sat import AAR_PATCH_NUMS, SAT, SATConfig
from mmkv.pipelines.aar.clap_training import (  # noqa: F401  (re-exported: train.contrastive_loss, ...)
    _summary, audio_embeddings, build_clap, contrastive_loss, retrieval, text_embeddings,
)
from mmkv.pipelines.aar.sat_training import (  # noqa: F401
    CodebookTraining, MelLoss, codebook_step, evaluate_sat, init_sat, kmeans_init_, quantize, si_snr_db,
    batch_si_snr_db,
)
from mmkv.pipelines.aar.train_data import (  # noqa: F401
    ATTRIBUTES, caption_tokenizer, clap_features, clap_inputs, clap_waves, draw_sounds, feature_extractor,
    named_groups, random_crop, render_clips, tokenize,
)
from mmkv.pipelines.training import (
    add_stage_arguments, ema_update, finish_stage, frozen_copy, optimise, parse_overrides, pick_config, start_stage,
    to_device,
)

STAGES = ("clap", "sat", "aar")


# ----------------------------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class AudioTrainConfig:
    """Model shapes and optimisation settings of one trained audio family (`tiny` ships; `micro` is the CPU smoke
    test's)."""

    name: str
    sat: dict[str, Any]  # SATConfig fields
    aar_depth: int  # width 64 x depth, heads = depth (the AAR builder's tie)
    clap_audio: dict[str, Any]
    clap_text: dict[str, Any]
    clap_window_s: int  # the feature extractor's window (larger_clap_general: 10 s)
    text_len: int
    # clap stage
    clap_clips: int  # clips rendered and featurised once, then drawn without replacement per batch
    clap_steps: int
    clap_batch: int
    clap_lr: float
    retrieval_clips: int  # held-out clips of the retrieval score
    # sat stage
    sat_clips: int
    sat_steps: int
    sat_batch: int
    sat_lr: float
    sat_eval_clips: int
    # aar stage
    # Clips tokenised and embedded once. 8,192 were memorised (the sixth run: held-out cross-entropy 3.51 against
    # 2.89 on its own clips, each seen 43 times; docs/training.md): 32,768 are each seen about 11 times in a stage.
    aar_clips: int
    aar_steps: int
    aar_batch: int
    aar_lr: float
    aar_eval_clips: int
    eval_rollouts: int  # held-out clips rolled out and scored for adherence (0: none)
    ema: float = 0.999
    cond_drop: float = 0.1
    codebook_decay: float = 0.99
    kmeans_iters: int = 50
    dead_code: float = 2.0
    # Dead codes by a share of the uniform split instead of the absolute count (`CodebookTraining.dead_code_share`):
    # scale 0 sees 32 rows a step, so the absolute 2.0 kept 53 of its 1,024 codes in use (sixth run). 0: upstream.
    dead_code_share: float = 0.1
    commitment: float = 1.0
    # SAT waveform terms: upstream's 0.1 L1 (`losses.py`), and a weight on -SI-SNR in dB (Le Roux et al. 2019).
    # Without the GAN, the mel terms leave the phase free: the first GPU run reconstructed the log-mel (L1 0.18) but
    # not the waveform (held-out SI-SNR -33 dB, every kind; docs/training.md).
    sat_wave_l1: float = 0.1
    sat_si_snr: float = 0.0
    sat_usage_clips: int = 2048  # held-out clips whose tokens count the codes used (at least sat_eval_clips)
    warmup: int = 100
    encode_batch: int = 64

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sat_config(self) -> SATConfig:
        return SATConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.sat.items()})

    @property
    def clip_samples(self) -> int:
        """Samples of a training clip: what the SAT decodes from its last scale (1 s for `tiny`)."""
        return self.sat_config().num_samples

    @property
    def sample_rate(self) -> int:
        return self.sat_config().sample_rate


CONFIGS: dict[str, AudioTrainConfig] = {
    # 1 s at 24 kHz, AAR's 16 scales (455 tokens). SAT: n_filters 16, dimension = latent 32, 1024 codes a scale;
    # AAR: depth 4 (C 256, 4 heads of 64); CLAP: the demo's tiny towers with larger_clap_general's 10 s window.
    "tiny": AudioTrainConfig(
        name="tiny",
        sat={"multi_scale": list(AAR_PATCH_NUMS), "phi_kernel": [9] * 6, "dimension": 32, "latent_dim": 32,
             "n_filters": 16, "bins": 1024},
        aar_depth=4, clap_audio=dict(TINY_CLAP_AUDIO), clap_text=dict(TINY_CLAP_TEXT), clap_window_s=10,
        text_len=16,
        clap_clips=8192, clap_steps=3000, clap_batch=128, clap_lr=5e-4, retrieval_clips=512,
        sat_clips=8192, sat_steps=6000, sat_batch=32, sat_lr=6e-4, sat_eval_clips=128,
        aar_clips=32768, aar_steps=6000, aar_batch=64, aar_lr=5e-4, aar_eval_clips=256, eval_rollouts=64,
        # The fifth and sixth runs' kept arm (given as --set there): without it the seventh run's from-scratch SAT
        # reconstructed the log-mel (L1 0.180) but not the waveform (held-out SI-SNR -32.5 dB; docs/training.md).
        sat_si_snr=0.5,
    ),
    # CPU smoke test: the same code on a few-second budget. Four scales to 8 latent frames: 2560 samples, the
    # shortest clip the adherence metric scores (0.1 s).
    "micro": AudioTrainConfig(
        name="micro",
        sat={"multi_scale": [1, 2, 4, 8], "phi_kernel": [9, 9], "dimension": 16, "latent_dim": 16,
             "n_filters": 8, "bins": 64},
        aar_depth=1, clap_audio={**TINY_CLAP_AUDIO, "spec_size": 128, "window_size": 4}, clap_text=dict(TINY_CLAP_TEXT),
        clap_window_s=1, text_len=16,
        clap_clips=8, clap_steps=12, clap_batch=8, clap_lr=2e-3, retrieval_clips=8,
        sat_clips=8, sat_steps=30, sat_batch=4, sat_lr=3e-3, sat_eval_clips=4,
        aar_clips=8, aar_steps=30, aar_batch=8, aar_lr=3e-3, aar_eval_clips=4, eval_rollouts=2,
        ema=0.9, kmeans_iters=5, warmup=5, encode_batch=8, sat_usage_clips=12,
    ),
}


def get_config(name: str, **overrides: Any) -> AudioTrainConfig:
    return pick_config(CONFIGS, name, **overrides)


# ----------------------------------------------------------------------------------------------------------------
# Data


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: CLAP


def train_clap(cfg: AudioTrainConfig, out: Path, *, device: torch.device, seed: int, budget_s: float | None,
               init: Path | None = None, log: Callable[[str], None] = print,
               step_plan: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    from transformers import ClapModel

    t_start = time.perf_counter()
    tokenizer = caption_tokenizer(cfg.text_len)
    extractor = feature_extractor(cfg.clap_window_s)
    if init is not None:
        model = ClapModel.from_pretrained(str(init / "clap"), local_files_only=True, dtype=torch.float32)
    else:
        model = build_clap(cfg, len(tokenizer), seed)
    model = model.to(device).train()
    gen = torch.Generator().manual_seed(seed + 30)
    t0 = time.perf_counter()
    batch = draw_sounds(gen, cfg.clap_clips)
    features = clap_inputs(render_clips(batch, cfg, device, gen), cfg, extractor, device)
    ids, mask = (t.to(device) for t in tokenize(tokenizer, [sounds.caption(s) for s in batch], cfg.text_len))
    groups = named_groups(batch).to(device)
    log(f"clap: {len(batch)} clips rendered and featurised in {time.perf_counter() - t0:.1f} s "
        f"({len(set(groups.tolist()))} distinct captions by meaning)")
    train_gen = torch.Generator().manual_seed(seed + 31)
    size = min(cfg.clap_batch, len(batch))

    def loss_fn(step: int) -> torch.Tensor:
        idx = to_device(torch.randperm(len(batch), generator=train_gen)[:size], device)
        return contrastive_loss(model, audio_embeddings(model, features[idx]),
                                text_embeddings(model, ids[idx], mask[idx]), groups[idx])

    @torch.no_grad()
    def clamp_scales(step: int) -> None:
        for p in (model.logit_scale_a, model.logit_scale_t):
            p.clamp_(0, math.log(100))  # CLIP's cap on the learned temperature

    remaining = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
    stats = optimise(list(model.parameters()), loss_fn, steps=cfg.clap_steps, lr=cfg.clap_lr, warmup=cfg.warmup,
                     budget_s=remaining, device=device, after_step=clamp_scales, log=log, name="clap", amp=False,
                     step_plan=step_plan)
    model.eval()
    write_clap(out / "clap", model, extractor, tokenizer)
    stats["retrieval"] = retrieval(model, tokenizer, extractor, cfg, device)
    stats["logit_scales"] = {"audio": round(model.logit_scale_a.exp().item(), 3),
                             "text": round(model.logit_scale_t.exp().item(), 3)}
    log(f"clap: held-out text-to-audio top-1 {_summary(stats['retrieval'])}")
    return stats


def write_clap(folder: Path, model, extractor, tokenizer) -> None:
    """A local CLAP folder as `clap.ClapEmbedder` reads it: config.json + model.safetensors + the feature
    extractor, and the caption tokenizer for the text side."""
    folder.mkdir(parents=True, exist_ok=True)
    for part in (model, extractor, tokenizer):
        save_pretrained(part, folder)


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: SAT


def sat_file(folder: Path, cfg: AudioTrainConfig) -> Path:
    return _stage_file(folder, f"SAT_{cfg.name}.pth", "SAT")


def _stage_file(folder: Path, name: str, what: str) -> Path:
    path = folder / name
    if not path.is_file():
        found = sorted(p.name for p in folder.glob(f"{what}_*.pth"))
        hint = f" (it holds {', '.join(found)}: trained with another --config?)" if found else ""
        raise FileNotFoundError(f"no {name} in {folder}{hint}")
    return path


def train_sat(cfg: AudioTrainConfig, source: Path, out: Path, *, device: torch.device, seed: int,
              budget_s: float | None, init: Path | None = None,
              log: Callable[[str], None] = print, step_plan: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    if not (source / "clap" / "config.json").is_file():
        raise FileNotFoundError(f"--from {source} holds no clap/ folder: give the clap stage's output")
    scales = cfg.sat_config().multi_scale
    if init is not None:
        sat = load_sat(sat_file(init, cfg), multi_scale=scales)
    else:
        sat = init_sat(cfg.sat_config(), seed)
    sat = sat.to(device).train().requires_grad_(True)
    gen = torch.Generator().manual_seed(seed + 40)
    t0 = time.perf_counter()
    batch = draw_sounds(gen, cfg.sat_clips)
    pool = torch.cat([sounds.render(batch[i:i + cfg.encode_batch], sample_rate=cfg.sample_rate, device=device)
                      for i in range(0, len(batch), cfg.encode_batch)])
    log(f"sat: {len(batch)} clips rendered in {time.perf_counter() - t0:.1f} s")
    train_gen = torch.Generator().manual_seed(seed + 41)
    codebooks = CodebookTraining(cfg.codebook_decay, kmeans_iters=cfg.kmeans_iters, dead_code=cfg.dead_code,
                                 dead_code_share=cfg.dead_code_share,
                                 generator=torch.Generator().manual_seed(seed + 42))
    mel = MelLoss(cfg.sample_rate, device)
    parts: dict[str, list[torch.Tensor]] = {"l1": [], "mel": [], "commit": [], "si_snr_db": []}

    def loss_fn(step: int) -> torch.Tensor:
        idx = to_device(torch.randint(0, len(batch), (cfg.sat_batch,), generator=train_gen), device)
        wave = random_crop(pool[idx], cfg.clip_samples, train_gen)[:, None]
        f_hat, _, commit = quantize(sat, sat.encoder(wave), codebooks, cfg.commitment)
        recon = sat.fhat_to_audio(f_hat)
        l1, lm = F.l1_loss(recon, wave), mel(recon, wave)
        si = batch_si_snr_db(recon[:, 0], wave[:, 0])
        for k, v in (("l1", l1), ("mel", lm), ("commit", commit), ("si_snr_db", si)):
            parts[k].append(v.detach())
        loss = cfg.sat_wave_l1 * l1 + lm + commit
        return loss - cfg.sat_si_snr * si if cfg.sat_si_snr else loss

    remaining = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
    stats = optimise(list(sat.parameters()), loss_fn, steps=cfg.sat_steps, lr=cfg.sat_lr, warmup=cfg.warmup,
                     budget_s=remaining, device=device, log=log, name="sat", amp=False, step_plan=step_plan)
    sat.eval().requires_grad_(False)
    save_released_format(sat, out / f"SAT_{cfg.name}.pth")
    _copy_tree(source / "clap", out / "clap")
    tail = max(1, len(parts["l1"]) // 10)
    stats["loss_parts_last"] = {k: round(float(torch.stack(v[-tail:]).mean()), 6) for k, v in parts.items()}
    stats["heldout"] = evaluate_sat(sat, cfg, device)
    h = stats["heldout"]
    log(f"sat: held-out SI-SNR {h['si_snr_db']:.2f} dB, log-mel L1 {h['log_mel_l1']:.3f}, codes used per scale "
        f"{[u['used'] for u in h['codebook_usage']]}")
    return stats


# ----------------------------------------------------------------------------------------------------------------
# Stage 3: AAR


@torch.no_grad()
def teacher_inputs(sat: SAT, tokens: list[torch.Tensor]) -> torch.Tensor:
    """AAR's teacher-forcing input [B, L - first_l, latent] for the tokens of every scale: after scale si the
    partial latent f_hat += phi(upsample(h_si)) is area-downsampled to scale si+1 (`sample.rollout`'s loop and
    upstream `idx_to_var_input`); the last scale's tokens feed nothing."""
    quant = sat.quantizer
    B, C, scales = tokens[0].shape[0], sat.latent_dim, sat.config.multi_scale
    f_hat = torch.zeros(B, C, scales[-1], device=tokens[0].device)
    inputs = []
    for si, pn in enumerate(scales[:-1]):
        h = quant.embedding(tokens[si], si).reshape(B, C, pn)
        f_hat, nxt = quant.get_next_autoregressive_input(si, f_hat, h)
        inputs.append(nxt.view(B, C, -1).transpose(1, 2))
    return torch.cat(inputs, dim=1)


def init_aar(cfg: AARConfig, seed: int) -> AAR:
    """upstream `build_aar`'s initialisation (init_adaln 0.5, init_adaln_gamma 1e-5, init_head 0.02), drawn from a
    private generator; it also draws the stored null condition `uncond_embedding`."""
    aar = build_aar(cfg, "meta").to_empty(device="cpu")
    return aar.init_weights(private_generator(seed, "train-aar"), init_adaln=0.5, init_adaln_gamma=1e-5,
                            init_head=0.02)


def aar_config(cfg: AudioTrainConfig) -> AARConfig:
    sat = cfg.sat_config()
    return AARConfig(depth=cfg.aar_depth, patch_nums=sat.multi_scale, cvae=sat.latent_dim, vocab_size=sat.bins)


@torch.no_grad()
def encode_clips(sat: SAT, clap_model, extractor, wave: torch.Tensor, cfg: AudioTrainConfig,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, L] of the SAT, CLAP audio embeddings [B, 512]) of clips [B, samples]."""
    tokens, conds = [], []
    for i in range(0, wave.shape[0], cfg.encode_batch):
        w = wave[i:i + cfg.encode_batch]
        tokens.append(torch.cat(quantize(sat, sat.encoder(w[:, None]))[1], dim=1))
        conds.append(audio_embeddings(clap_model, clap_inputs(w, cfg, extractor, device)))
    return torch.cat(tokens), torch.cat(conds)


def train_aar(cfg: AudioTrainConfig, source: Path, out: Path, *, device: torch.device, seed: int,
              budget_s: float | None, init: Path | None = None,
              log: Callable[[str], None] = print, step_plan: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    from transformers import ClapFeatureExtractor, ClapModel

    t_start = time.perf_counter()
    sat_path = sat_file(source, cfg)
    sat = load_sat(sat_path, multi_scale=cfg.sat_config().multi_scale, device=device)
    clap_dir = source / "clap"
    clap_model = ClapModel.from_pretrained(str(clap_dir), local_files_only=True,
                                            dtype=torch.float32).to(device).eval()
    extractor = ClapFeatureExtractor.from_pretrained(str(clap_dir), local_files_only=True)
    gen = torch.Generator().manual_seed(seed + 50)
    t0 = time.perf_counter()
    batch = draw_sounds(gen, cfg.aar_clips)
    tokens, conds = encode_clips(sat, clap_model, extractor, render_clips(batch, cfg, device, gen), cfg, device)
    log(f"aar: {len(batch)} clips tokenised ({tokens.shape[1]} tokens) and CLAP-embedded in "
        f"{time.perf_counter() - t0:.1f} s")
    acfg = aar_config(cfg)
    aar = (load_aar(_stage_file(init, f"AAR_{cfg.name}.pth", "AAR")) if init is not None else init_aar(acfg, seed))
    aar = aar.to(device).train().requires_grad_(True)
    ema = frozen_copy(aar)
    train_gen = torch.Generator().manual_seed(seed + 51)
    splits = list(acfg.patch_nums)

    def loss_fn(step: int) -> torch.Tensor:
        idx = to_device(torch.randint(0, len(batch), (cfg.aar_batch,), generator=train_gen), device)
        target = tokens[idx]
        drop = to_device(torch.rand(cfg.aar_batch, 1, generator=train_gen) < cfg.cond_drop, device)
        cond = torch.where(drop, aar.uncond_embedding, conds[idx])  # upstream model/aar.py forward
        logits = aar(cond, teacher_inputs(sat, list(target.split(splits, dim=1))))
        return F.cross_entropy(logits.reshape(-1, aar.V), target.reshape(-1))

    remaining = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
    stats = optimise(list(aar.parameters()), loss_fn, steps=cfg.aar_steps, lr=cfg.aar_lr, warmup=cfg.warmup,
                     budget_s=remaining, device=device, after_step=lambda s: ema_update(ema, aar, cfg.ema, s), log=log,
                     name="aar", amp=False, step_plan=step_plan)
    ema.eval()
    save_released_format(ema, out / f"AAR_{cfg.name}.pth")
    if sat_path.resolve() != (out / sat_path.name).resolve():
        shutil.copy2(sat_path, out / sat_path.name)
        state = training_state_file(sat_path)  # a release as --from keeps the SAT's encoder here
        if state.is_file():
            training_state_file(out / sat_path.name).parent.mkdir(exist_ok=True)
            shutil.copy2(state, training_state_file(out / sat_path.name))
    _copy_tree(clap_dir, out / "clap")
    stats["heldout"] = evaluate_aar(ema, sat, clap_model, extractor, cfg, device, seed)
    h = stats["heldout"]
    log(f"aar: held-out cross-entropy {h['ce_cond']:.3f} with the condition, {h['ce_uncond']:.3f} without"
        + (f"; rollout adherence {h['rollouts']['adherence']}" if h.get("rollouts") else ""))
    return stats


@contextlib.contextmanager
def scales_see_only_themselves(aar: AAR):
    """Teacher forcing with the earlier scales removed from attention (each scale attends to its own tokens, as
    `rollout_adherence(no_past=True)` does by emptying the cache); the next-scale input still carries the partial
    latent of the scales before it, as in a rollout."""
    full = aar.attn_bias_for_masking.clone()
    lvl = aar.lvl_1L.view(-1)
    aar.attn_bias_for_masking.copy_(torch.where(lvl[:, None] == lvl[None, :], 0.0, -torch.inf).view_as(full))
    try:
        yield
    finally:
        aar.attn_bias_for_masking.copy_(full)


@torch.no_grad()
def evaluate_aar(aar: AAR, sat: SAT, clap_model, extractor, cfg: AudioTrainConfig, device: torch.device,
                 seed: int) -> dict[str, Any]:
    """Held-out teacher-forced cross-entropy and accuracy per scale, with each clip's CLAP embedding and with the
    null condition; then rollouts conditioned on held-out clips, scored by `mmkv.metrics.audio_adherence` against
    the clip's caption."""
    held = [sounds.sample_sound(s) for s in sounds.held_out_seeds(cfg.aar_eval_clips)]
    wave = render_clips(held, cfg, device, torch.Generator().manual_seed(3))
    tokens, conds = encode_clips(sat, clap_model, extractor, wave, cfg, device)
    splits = list(aar.patch_nums)
    result: dict[str, Any] = {"clips": len(held)}
    for name, cond, past in (("cond", conds, True), ("uncond", aar.uncond_embedding.expand_as(conds), True),
                             ("cond_no_past", conds, False)):
        ce = torch.zeros(tokens.shape[1], device=device)
        right = torch.zeros(tokens.shape[1], device=device)
        with contextlib.nullcontext() if past else scales_see_only_themselves(aar):
            for i in range(0, len(held), cfg.encode_batch):
                t = tokens[i:i + cfg.encode_batch]
                logits = aar(cond[i:i + cfg.encode_batch], teacher_inputs(sat, list(t.split(splits, dim=1))))
                ce += F.cross_entropy(logits.transpose(1, 2), t, reduction="none").sum(0)
                right += (logits.argmax(-1) == t).float().sum(0)
        result[f"ce_{name}"] = round(float(ce.sum() / tokens.numel()), 4)
        result[f"ce_{name}_per_scale"] = [round(float(c.mean() / len(held)), 4) for c in ce.split(splits)]
        result[f"accuracy_{name}_per_scale"] = [round(float(r.mean() / len(held)), 4) for r in right.split(splits)]
    if cfg.eval_rollouts:
        n = cfg.eval_rollouts
        result["rollouts"] = rollout_adherence(aar, sat, conds[:n], held[:n], cfg, seed)
        # Controls: the same rollouts with every scale attending only to itself (does the model read its cache?),
        # and a random AAR of the same architecture (chance).
        result["rollouts_no_past"] = rollout_adherence(aar, sat, conds[:n], held[:n], cfg, seed, no_past=True)
        random_aar = init_aar(aar_config(cfg), seed + 1).to(conds.device).eval()
        result["rollouts_random_aar"] = rollout_adherence(random_aar, sat, conds[:n], held[:n], cfg, seed)
    return result


# STFT frames a glide step of the rollouts' second direction score spans (`Thresholds.glide_lag`): a generated
# chirp's peak jitters from frame to frame, so 10 ms steps miss sweeps that 80 ms steps find (docs/training.md).
ROLLOUT_GLIDE_LAG = 8


def rollout_adherence(aar: AAR, sat: SAT, conds: torch.Tensor, held: list[sounds.Sound], cfg: AudioTrainConfig,
                      seed: int, no_past: bool = False) -> dict[str, Any]:
    """One rollout per held-out clip (native cache, the pipeline's sampling), scored against the clip's caption;
    `direction_glide_lag` scores the chirps' direction again with glide steps of ROLLOUT_GLIDE_LAG frames. With
    `no_past` the cache is emptied after every scale, so each scale attends only to itself (its input, the partial
    latent of the scales before, still carries them: the control removes what attention reads, as the video
    eval's `--no-past` does); the sampling draws are the same."""
    from mmkv.cache import CacheConfig, KVStore
    from mmkv.metrics.audio_adherence import Thresholds
    from mmkv.pipelines.aar.sample import rollout
    from mmkv.pipelines.aar.sat_training import adherence_summary

    store = KVStore(CacheConfig(codec=None, residual_window=1), num_layers=aar.depth, num_heads=aar.num_heads,
                    head_dim=aar.config.head_dim)
    out = rollout(aar, sat, conds, seed=seed, key="train-heldout", store=store,
                  on_scale=(lambda si: store.reset()) if no_past else None)
    waves = out.audio[:, 0].numpy()
    lagged = adherence_summary(waves, held, cfg.sample_rate, Thresholds(glide_lag=ROLLOUT_GLIDE_LAG))
    direction = lagged["per_attribute"].get("direction")
    return {**adherence_summary(waves, held, cfg.sample_rate), "finite": bool(torch.isfinite(out.audio).all()),
            "direction_glide_lag": None if direction is None else {"lag": ROLLOUT_GLIDE_LAG, **direction}}


def _copy_tree(src: Path, dst: Path) -> None:
    if src.resolve() == dst.resolve():
        return
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


# ----------------------------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, STAGES, CONFIGS,
                        "the previous stage's output folder (sat: the clap stage's; aar: the sat stage's; a later "
                        "stage's output, which holds the same models, will do)")


def run(args: argparse.Namespace) -> int:
    overrides = parse_overrides(get_config(args.config), args.overrides)
    if args.steps is not None:
        overrides[f"{args.stage}_steps"] = args.steps
    cfg = get_config(args.config, **overrides)
    # A later stage's output holds copies of the earlier stages' models (sat: clap/; aar: clap/ and the SAT), so it
    # may stand for them: `train all --start-at aar` reads the SAT and CLAP of an aar output (or audio release).
    st = start_stage(args, first_stage="clap", previous={"sat": ("clap", "sat", "aar"), "aar": ("sat", "aar")},
                     init_from={"clap": STAGES, "sat": ("sat", "aar"), "aar": ("aar",)})
    common = dict(device=st.device, seed=args.seed, budget_s=args.budget, init=st.init, log=st.log,
                  step_plan=st.step_plan)
    if args.stage == "clap":
        stats = train_clap(cfg, st.out, **common)
    elif args.stage == "sat":
        stats = train_sat(cfg, st.source, st.out, **common)
    else:
        stats = train_aar(cfg, st.source, st.out, **common)
    finish_stage(st, args, cfg.to_dict(), stats)
    return 0
