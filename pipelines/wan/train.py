"""`mmkv train video`: the tiny video models mmkv ships, trained on procedural captioned clips.

A Wan VAE, a umT5 text encoder with a word-level tokenizer and a block-causal Wan DiT, each of exactly the
architecture `mmkv generate video` loads (diffusers `AutoencoderKLWan`, transformers `UMT5EncoderModel`, diffusers
`WanTransformer3DModel` with mmkv's causal attention), trained on the clips of `mmkv.pipelines.wan.scenes`. Three
stages, each one command that reads the previous stage's folder and writes its own (weights only, no optimizer state):

* `vae`: the VAE (4x temporal, 4x spatial) with L1 + MSE + a 1e-6 KL term (no GAN, no LPIPS), on short crops; its
  `latents_mean` / `latents_std` are then measured on training latents and written into its config.
* `dit`: teacher-forced flow matching (Self-Forcing `model/diffusion.py`; Causal Forcing
  `configs/ar_diffusion_tf_chunkwise.yaml`). The sequence is [clean latents at t = 0 | a noisy copy]; each block of
  the copy has its own timestep (shift 5) and attends to the clean blocks before it and to itself, the clean half is
  block-causal, and the copy reuses the clean frames' RoPE indices. Blocks are 3 latent frames, or 1 frame for a
  `framewise` share of the batches, so both the chunk-wise and the frame-wise loops run on one model. The umT5
  encoder trains jointly, with a share of empty captions; it is frozen afterwards.
* `distill` (`pipelines/wan/distill.py`): ODE regression (CausVid `causvid/ode_regression.py`), so that the
  CausVid and Causal Forcing loops' 3-4 steps give sharp frames.

`dit` and `distill` write the release layout `mmkv generate video` reads: `base/` (a diffusers Wan folder: vae,
text_encoder, tokenizer, transformer/config.json, model_index.json) and `causvid/model.pt` (CausVid's
`{"generator": {"model." + original Wan key: tensor}}`, bf16), next to `train.json` (config, seeds, measured step
time, loss curve). Every stage takes a wall-clock budget: the first 50 steps are timed and the step count is cut to
what fits, and `train.json` records the steps run. Data and noise come from private generators seeded by `--seed`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mmkv.io import save_pretrained
from mmkv.pipelines.training import (
    add_stage_arguments, ema_update, finish_stage, frozen_copy, optimise, parse_overrides, pick_config, seeded,
    stage_record, start_stage, to_device,
)
from mmkv.pipelines.wan import scenes
from mmkv.pipelines.wan.model import TeacherForcing
from mmkv.pipelines.wan.release import (  # noqa: F401  (write_release re-exported: train.write_release)
    has_release, note_release_size, write_decoder_release, write_release)

STAGES = ("vae", "dit", "distill")


# ----------------------------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class VideoTrainConfig:
    """Model shapes and optimisation settings of one trained model family (`tiny` ships; `micro` is the CPU smoke
    test's)."""

    name: str
    height: int
    width: int
    frames: int  # pixel frames of a full clip (1 + 4k)
    vae: dict[str, Any]
    dit: dict[str, Any]
    t5: dict[str, Any]
    text_len: int
    # vae stage
    vae_steps: int
    vae_batch: int
    vae_frames: int  # pixel frames of a training crop (1 + 4k)
    vae_lr: float
    vae_kl: float
    vae_stat_clips: int  # clips whose latents give latents_mean / latents_std
    # A share of the VAE steps sees long crops (`vae_long_frames` frames of a `vae_long_size` spatial window): with
    # short crops only, the causal convolutions' caches never hold real content beyond two chunks, and full clips
    # degrade after frame 9 (measured: 33 dB on 9-frame crops, 18 dB on 81-frame clips; docs/training.md). The
    # encoder drifts too, not only the decoder: an encoder trained on 9-frame crops codes frames 17-24 of a full
    # clip 0.8 (mean |delta|, latents of mean magnitude 1.1) away from the same frames coded as a clip of their own,
    # and the named object is gone from its decoded full clips after frame 12. So the long crops are whole clips;
    # the `tiny` recipe now reaches that regime through the warm-cache steps below instead (0 whole-clip steps).
    vae_long_share: float
    vae_long_frames: int
    vae_long_size: tuple[int, int]
    vae_long_batch: int
    # dit stage
    dit_clips: int  # clips rendered and encoded once, then sampled with replacement
    dit_steps: int
    dit_batch: int
    dit_lr: float
    ema: float
    empty_caption: float
    framewise: float  # share of batches trained with 1-frame blocks
    shift: float
    # distill stage
    ode_clips: int  # teacher trajectories (a `framewise` share of them frame-wise)
    ode_steps: int
    guidance: float
    distill_steps: int
    distill_batch: int
    distill_lr: float
    warmup: int = 100
    frames_per_block: int = 3
    # A share of the DiT steps trains the first block alone (no context), `first_block_batch` clips at a time. Only
    # there must the model draw the scene from the caption: later blocks can copy it from their clean context, so
    # with teacher forcing alone the text is informative for 1 block in 7 (measured: a model that ignores the
    # colour word; docs/training.md). A first block is 1/14 of a doubled sequence's tokens, so these steps are cheap.
    first_block_share: float = 0.0
    first_block_batch: int = 128
    # The VAE's reconstruction weight on the named object's pixels is 1 + `vae_object_weight` (0: plain L1 + MSE).
    # The object is 2-6% of a frame, the part a full clip's decode loses first (docs/training.md). Its pixels are
    # the only ones with a channel above 0.6 in [-1, 1] (`scenes.COLOURS`; stripes, second object and bar stay
    # below), so the mask comes from the target itself.
    vae_object_weight: float = 0.0
    # The DiT's flow-matching loss weight on the latent cells that hold the named object is 1 + `dit_object_weight`
    # (normalised by the mean weight; 0: plain MSE). A small object covers 1-2% of a latent frame, so plain MSE
    # spends almost all of its gradient on the background; the ninth run's free rollouts lost small objects that the
    # VAE keeps (docs/training.md). The cells are the pixel mask `object_mask` max-pooled to the latent grid
    # (`latent_object_mask`).
    dit_object_weight: float = 0.0
    # A `vae_warm_share` of the VAE steps trains `vae_warm_chunks` chunks (4 frames each) of a full-size clip with
    # the encoder's and decoder's causal caches filled, without gradient, by the clip's first 1 to
    # `vae_warm_context` chunks (truncated back-propagation through time; `warm_reconstruct`). A whole-clip step
    # back-propagates through 21 chunks of a small window; this one pays a forward pass for the context and a
    # backward pass only for the frames it scores, so it sees the filled-cache regime at full size and batch.
    vae_warm_share: float = 0.0
    vae_warm_chunks: int = 2
    vae_warm_context: int = 19
    # A decoder-only vae stage writes init + `vae_decoder_blend` x (trained - init) for the decoder's weights (1: the
    # trained decoder). Interpolating a fine-tuned model's weights back towards its init keeps most of the fine-tune's
    # gain and more of the init's robustness to inputs off the fine-tuning distribution (Wortsman et al. 2022,
    # "Robust fine-tuning of zero-shot models", WiSE-FT, eq. 1): here the DiT's latents, which the decoder never
    # saw; the twentieth run's decoder, trained alone, drew fewer of the DiT's objects (docs/training.md).
    vae_decoder_blend: float = 1.0
    encode_batch: int = 32
    ode_batch: int = 256
    # Teacher trajectories of each kind, in place of the `ode_clips` split and of the budget's cut (-1: not pinned):
    # a replay (`mmkv train all --replay`) pins the counts an earlier run made, so that it draws the same ones.
    ode_chunk_trajectories: int = -1
    ode_frame_trajectories: int = -1
    # The DiT's depth (0: `dit["num_layers"]`, or the init's). A `dit` stage given an init with fewer layers deepens
    # it first (`deepen`: each block followed by copies of itself whose outputs are zeroed, so the deeper model
    # starts as the same function and the copies learn from there).
    dit_layers: int = 0
    # Held-out prompts on which the distillation scores its teacher's own ODE rollouts (chunk-wise, the trajectories'
    # grid and guidance), before training the student: whether a shape the student misses was drawn by its teacher.
    # 0: not scored. Its noise is its own (`NoiseStream`), so the training draws are the same either way.
    teacher_eval: int = 0
    # Train the DiT (the `dit` stage's, the distillation's student) with each transformer block compiled in place
    # (`torch.compile`, one graph a block and batch shape, reused by every layer): a teacher-forced step is bound by
    # its elementwise passes, which the compiler fuses. The first step of each shape pays the compilation (18-49 s on
    # an H100, whose deterministic whole-clip steps it made 3.5x faster; docs/training.md, "What a DiT step costs").
    # Two processes compiling the blocks trained different weights there, with inductor's deterministic mode too
    # (docs/training.md, "What a DiT step costs"), so `--deterministic` refuses it: a replayable run trains eager.
    dit_compile: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_T5 = {"d_kv": 32, "num_heads": 2, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
       "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6}
_DIT = {"patch_size": (1, 2, 2), "in_channels": 16, "out_channels": 16, "freq_dim": 256, "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}

CONFIGS: dict[str, VideoTrainConfig] = {
    # 64x96 px, 81 frames -> 21 latent frames of 16x24 -> 96 tokens a frame, 7 blocks of 3 frames. The DiT keeps
    # Wan 1.3B's head width (2 heads x 128; RoPE split 44/42/42), so every codec runs with its 128-d codebooks.
    "tiny": VideoTrainConfig(
        name="tiny", height=64, width=96, frames=81,
        vae={"base_dim": 16, "z_dim": 16, "dim_mult": [1, 2, 4], "num_res_blocks": 2, "attn_scales": [],
             "temperal_downsample": [True, True], "scale_factor_temporal": 4, "scale_factor_spatial": 4},
        dit={**_DIT, "num_attention_heads": 2, "attention_head_dim": 128, "text_dim": 64, "ffn_dim": 1024,
             "num_layers": 4},
        t5={**_T5, "d_model": 64, "d_ff": 256, "num_layers": 2},
        text_len=16,
        vae_steps=3000, vae_batch=32, vae_frames=9, vae_lr=1e-3, vae_kl=1e-6, vae_stat_clips=256,
        vae_long_share=0.0, vae_long_frames=81, vae_long_size=(32, 48), vae_long_batch=8, vae_warm_share=0.7,
        vae_object_weight=4.0,  # the fifth run's kept arm (va3: 31.0 dB on the frame, 25.7 dB on the object)
        dit_clips=8192, dit_steps=6000, dit_batch=32, dit_lr=5e-4, ema=0.999, empty_caption=0.1, framewise=0.25,
        shift=5.0,
        ode_clips=3072, ode_steps=48, guidance=2.0, distill_steps=3000, distill_batch=32, distill_lr=1e-4,
        first_block_share=0.5, first_block_batch=128,
    ),
    # CPU smoke test: the same code on a few-second budget (head_dim 32, 32x48 px, 6 latent frames).
    "micro": VideoTrainConfig(
        name="micro", height=32, width=48, frames=21,
        vae={"base_dim": 4, "z_dim": 16, "dim_mult": [1, 2, 4], "num_res_blocks": 1, "attn_scales": [],
             "temperal_downsample": [True, True], "scale_factor_temporal": 4, "scale_factor_spatial": 4},
        dit={**_DIT, "num_attention_heads": 2, "attention_head_dim": 32, "text_dim": 16, "ffn_dim": 64,
             "num_layers": 1, "rope_max_seq_len": 64},
        t5={**_T5, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "relative_attention_num_buckets": 8},
        text_len=16,
        vae_steps=16, vae_batch=2, vae_frames=5, vae_lr=3e-3, vae_kl=1e-6, vae_stat_clips=4,
        vae_long_share=0.5, vae_long_frames=13, vae_long_size=(16, 24), vae_long_batch=1,
        dit_clips=8, dit_steps=30, dit_batch=4, dit_lr=3e-3, ema=0.9, empty_caption=0.1, framewise=0.25, shift=5.0,
        ode_clips=4, ode_steps=4, guidance=2.0, distill_steps=20, distill_batch=4, distill_lr=1e-3, warmup=5,
        encode_batch=4, ode_batch=4, first_block_share=0.5, first_block_batch=8,
    ),
}


def get_config(name: str, **overrides: Any) -> VideoTrainConfig:
    return pick_config(CONFIGS, name, **overrides)


# ----------------------------------------------------------------------------------------------------------------
# Models and tokenizer


def word_tokenizer(words: list[str], text_len: int):
    """A word-level fast tokenizer with the T5 call contract (pad 0, eos 1 appended, unk 2), lower-casing its input:
    each caption word is one token, so a tiny encoder needs no sub-word composition."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in sorted(set(words)):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=text_len)


def build_vae(cfg: VideoTrainConfig, seed: int):
    from diffusers import AutoencoderKLWan

    return seeded(seed, lambda: AutoencoderKLWan(**cfg.vae))


def build_text_encoder(cfg: VideoTrainConfig, vocab_size: int, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, is_encoder_decoder=False, tie_word_embeddings=True, **cfg.t5)
    return seeded(seed, lambda: UMT5EncoderModel(config))


def build_dit(cfg: VideoTrainConfig, seed: int):
    from diffusers import WanTransformer3DModel

    from mmkv.pipelines.wan.model import CausalWan

    dit_cfg = {**cfg.dit, "num_layers": cfg.dit_layers or cfg.dit["num_layers"]}
    return CausalWan(seeded(seed, lambda: WanTransformer3DModel(**dit_cfg)))


# The projections that write a Wan block's three branches into the residual stream: zeroed, the block is the identity
# (diffusers `WanTransformerBlock.forward`: h + attn1(.) * gate, h + attn2(.), h + ffn(.) * gate).
_BLOCK_OUTPUTS = ("attn1.to_out.0.weight", "attn1.to_out.0.bias", "attn2.to_out.0.weight", "attn2.to_out.0.bias",
                  "ffn.net.2.weight", "ffn.net.2.bias")


def compile_blocks(dit, on: bool) -> None:
    """`dit_compile`: compile each of the DiT's transformer blocks in place (regional compilation); the module
    keeps its parameters, so the optimizer, the EMA and the release see the same tensors. Call after the EMA copy
    is made (a copy would carry the compiled forward)."""
    if on:
        for block in dit.transformer.blocks:
            block.compile()


def deepen(dit, layers: int):
    """`dit` (a `CausalWan`) with `layers` blocks by block expansion (Wu et al. 2024, "LLaMA Pro: Progressive
    LLaMA with Block Expansion", "Block Expansion"): blocks are followed by copies of themselves whose output
    projections are zeroed, so the deeper model computes the same function as `dit` and the copies, whose inputs
    already see trained features, learn from there. The `layers - num_layers` copies are spread evenly (block i gets
    floor((i + 1) e / n) - floor(i e / n) of e extra over n blocks: 4 -> 6 copies blocks 1 and 3, as LLaMA Pro
    spreads its added blocks over the stack). Unlike LLaMA Pro every block trains."""
    import re

    from diffusers import WanTransformer3DModel

    from mmkv.pipelines.wan.model import CausalWan

    old = dit.num_layers
    if layers == old:
        return dit
    if layers < old:
        raise ValueError(f"dit_layers={layers}: the init's DiT has {old} layers; give at least {old} "
                         f"(blocks are followed by copies of themselves, never removed)")
    extra = layers - old
    copies = [(i + 1) * extra // old - i * extra // old for i in range(old)]  # per block, summing to `extra`
    first = [i + sum(copies[:i]) for i in range(old)]  # where block i lands in the deeper stack
    config = {key: v for key, v in dict(dit.transformer.config).items() if not key.startswith("_")}
    state = {}
    for key, value in dit.transformer.state_dict().items():
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
        if m is None:
            state[key] = value
            continue
        i, rest = int(m.group(1)), m.group(2)
        for r in range(1 + copies[i]):
            state[f"blocks.{first[i] + r}.{rest}"] = value.clone().zero_() if r and rest in _BLOCK_OUTPUTS else value
    transformer = WanTransformer3DModel(**{**config, "num_layers": layers})
    transformer.load_state_dict(state, strict=True)
    return CausalWan(transformer.to(dit.device, dit.dtype)).train(dit.training)


# ----------------------------------------------------------------------------------------------------------------
# Data


def training_seeds(gen: torch.Generator, n: int) -> list[int]:
    """Scene seeds for training: [0, scenes.TRAIN_SEED_END) only, so held-out seeds are never trained on."""
    return torch.randint(0, scenes.TRAIN_SEED_END, (n,), generator=gen).tolist()


def render_pixels(seeds: list[int], *, frames: int, height: int, width: int, device: torch.device):
    """(pixels [B, 3, T, H, W] in [-1, 1], the VAE's input, and captions) of the scenes of `seeds`."""
    batch = [scenes.sample_scene(s) for s in seeds]
    video = scenes.render(batch, frames=frames, height=height, width=width, device=device)
    return video.permute(0, 4, 1, 2, 3).mul(2).sub(1), [scenes.caption(s) for s in batch]


def render_clips(seeds: list[int], cfg: VideoTrainConfig, device: torch.device):
    """`render_pixels` at a config's clip size."""
    return render_pixels(seeds, frames=cfg.frames, height=cfg.height, width=cfg.width, device=device)


def tokenize(tokenizer, captions: list[str], text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and mask exactly as `WanVideoPipeline.encode_text` makes them (prompts cleaned the same way)."""
    from mmkv.pipelines.wan.pipeline import clean_prompt

    tok = tokenizer([clean_prompt(c) for c in captions], padding="max_length", truncation=True, max_length=text_len,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    return tok.input_ids, tok.attention_mask


def text_states(encoder, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """umT5 states zeroed beyond each prompt's length, as the pipeline feeds the DiT."""
    states = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return states * mask.unsqueeze(-1).to(states.dtype)


def latent_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32)
    return mean.view(1, -1, 1, 1, 1), std.view(1, -1, 1, 1, 1)


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents [B, F, C, h, w] (frame-major, the DiT's layout): the posterior mean, (z - mean) / std."""
    z = vae.encode(pixels.to(next(vae.parameters()).dtype)).latent_dist.mode().float()
    mean, std = latent_stats(vae)
    return ((z - mean.to(z.device)) / std.to(z.device)).permute(0, 2, 1, 3, 4)


# ----------------------------------------------------------------------------------------------------------------
# Teacher forcing


def shifted_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching shift s u / (1 + (s - 1) u) (Wan / DiffSynth `FlowMatchScheduler`)."""
    return shift * u / (1 + (shift - 1) * u)


def teacher_forced_flow(dit, clean: torch.Tensor, noisy: torch.Tensor, t_frames: torch.Tensor,
                        context: torch.Tensor, mask: torch.Tensor | TeacherForcing) -> torch.Tensor:
    """The DiT's flow for `noisy` [B, F, C, h, w] at per-frame timesteps `t_frames` [B, F], each block seeing the
    clean blocks before it (`TeacherForcing`, or the dense bool mask of its `mask()`)."""
    b, f = clean.shape[:2]
    inputs = torch.cat([clean, noisy], dim=1)
    timestep = torch.cat([torch.zeros_like(t_frames), t_frames], dim=1)
    positions = torch.arange(f).repeat(2)  # on the CPU: the model checks them there and keeps their device copy
    out = dit(inputs, timestep, context, mode="full", attn_mask=mask, frame_positions=positions)
    return out[:, f:]


def first_block_flow(dit, noisy: torch.Tensor, t_frames: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """The DiT's flow for a clip's first block [B, fpb, C, h, w] alone (no context), as a rollout denoises it."""
    return dit(noisy, t_frames, context, mode="full")


def block_size(cfg: VideoTrainConfig, gen: torch.Generator) -> int:
    """Latent frames a block of one training batch: 1 (the frame-wise loops') in a `framewise` share of the batches,
    `frames_per_block` otherwise. First-block batches draw it too: a frame-wise rollout's first block is latent
    frame 0 alone, drawn from the caption with no context."""
    return 1 if float(torch.rand(1, generator=gen)) < cfg.framewise else cfg.frames_per_block


def block_timesteps(gen: torch.Generator, batch: int, num_frames: int, fpb: int, shift: float,
                    device: torch.device) -> torch.Tensor:
    """[B, F] timesteps, one shifted-uniform draw per block, in (0, 1000]."""
    u = 1 - torch.rand(batch, num_frames // fpb, generator=gen, device=device)  # (0, 1]
    return (1000 * shifted_sigmas(u, shift)).repeat_interleave(fpb, dim=1)


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: VAE


def object_mask(x: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, H, W] bool: pixels of clips [B, 3, T, H, W] in [-1, 1] with a channel above 0.6, which only the
    named object's colours have (`scenes.COLOURS`: a channel >= 230 of 255; everything else <= 145)."""
    return x.amax(dim=1, keepdim=True) > 0.6


def latent_object_mask(x: torch.Tensor, spatial: int, temporal: int) -> torch.Tensor:
    """[B, F, 1, h, w] bool, the DiT's frame-major latent layout: latent cells whose pixels hold any of the named
    object's (`object_mask` of clips [B, 3, 1 + temporal k, H, W]). As the causal VAE maps them, latent frame 0
    covers pixel frame 0 and latent frame i >= 1 pixel frames temporal (i - 1) + 1 ... temporal i; a cell covers
    `spatial` x `spatial` pixels."""
    m = object_mask(x).float()
    first = F.max_pool3d(m[:, :, :1], (1, spatial, spatial))
    rest = F.max_pool3d(m[:, :, 1:], (temporal, spatial, spatial))
    return torch.cat([first, rest], dim=2).permute(0, 2, 1, 3, 4) > 0


def object_weighted_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None,
                        weight: float) -> torch.Tensor:
    """MSE over [B, F, C, h, w], with the cells of `mask` [B, F, 1, h, w] weighted 1 + `weight` (normalised by the
    mean weight, so a uniform error scores the same); plain `F.mse_loss` when `weight` is 0."""
    if weight == 0:
        return F.mse_loss(pred, target)
    w = 1 + weight * mask.to(pred.dtype)
    return (w * (pred - target).square()).mean() / w.mean()


def reconstruction_loss(rec: torch.Tensor, x: torch.Tensor, object_weight: float) -> torch.Tensor:
    """L1 + MSE, with the named object's pixels weighted 1 + `object_weight` (normalised by the mean weight)."""
    if object_weight == 0:
        return F.l1_loss(rec, x) + F.mse_loss(rec, x)
    w = 1 + object_weight * object_mask(x).to(rec.dtype)
    d = rec - x
    return ((w * d.abs()).mean() + (w * d.square()).mean()) / w.mean()


def train_vae(cfg: VideoTrainConfig, out: Path, *, device: torch.device, seed: int, budget_s: float | None,
              init: Path | None = None, decoder_only: bool = False,
              log: Callable[[str], None] = print, step_plan: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """With `decoder_only` (needs `init`) the encoder is frozen and its latent statistics kept, so a DiT trained on
    the init's latents stays valid; the decoder learns from the posterior mean."""
    if decoder_only and init is None:
        raise ValueError("--decoder-only fine-tunes an existing VAE's decoder: give --init, a folder holding a VAE")
    if not 0 <= cfg.vae_decoder_blend <= 1 or (cfg.vae_decoder_blend != 1 and not decoder_only):
        raise ValueError(f"vae_decoder_blend={cfg.vae_decoder_blend}: a number in [0, 1] that blends a decoder-only "
                         "stage's decoder with its init's; give --decoder-only, or leave it at 1")
    vae = (_load_vae(init, device) if init else build_vae(cfg, seed).to(device)).train().requires_grad_(True)
    if decoder_only:
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator(device=device).manual_seed(seed + 1)

    def loss_fn(step: int) -> torch.Tensor:
        if cfg.vae_warm_share > 0 and float(torch.rand(1, generator=gen)) < cfg.vae_warm_share:
            x, context = vae_warm_batch(cfg, gen, device)
            rec, target, kl = warm_reconstruct(vae, x, context, noise_gen=None if decoder_only else noise_gen)
            return reconstruction_loss(rec.float(), target, cfg.vae_object_weight) + cfg.vae_kl * kl
        x = vae_batch(cfg, gen, device)
        if decoder_only:
            with torch.no_grad():
                z = vae.encode(x).latent_dist.mode()
            return reconstruction_loss(vae.decode(z).sample.float(), x, cfg.vae_object_weight)
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=noise_gen, device=device)
        rec = vae.decode(z).sample.float()
        kl = posterior.kl().mean() / x[0].numel()
        return reconstruction_loss(rec, x, cfg.vae_object_weight) + cfg.vae_kl * kl

    if decoder_only and cfg.vae_decoder_blend != 1:
        start = {k: v.detach().clone() for k, v in vae.named_parameters() if v.requires_grad}
    params = [p for p in vae.parameters() if p.requires_grad]
    stats = optimise(params, loss_fn, steps=cfg.vae_steps, lr=cfg.vae_lr, warmup=cfg.warmup, budget_s=budget_s,
                     device=device, log=log, name="vae", step_plan=step_plan)
    vae.eval()
    if not decoder_only:
        set_latent_stats(vae, cfg, seed, device)
    elif cfg.vae_decoder_blend != 1:
        trained = vae_held_out(vae, scenes.held_out_seeds(16 if cfg.name != "micro" else 2), frames=cfg.frames,
                               height=cfg.height, width=cfg.width, device=device, batch=cfg.encode_batch)
        stats["held_out_trained_psnr_db"] = trained["psnr_db"]
        log(f"vae: held-out PSNR {trained['psnr_db']} dB as trained; blended {cfg.vae_decoder_blend} of the way "
            "from the init")
        with torch.no_grad():
            for k, p in vae.named_parameters():
                if k in start:
                    p.copy_(start[k] + cfg.vae_decoder_blend * (p - start[k]))
    held_out = vae_held_out(vae, scenes.held_out_seeds(16 if cfg.name != "micro" else 2), frames=cfg.frames,
                            height=cfg.height, width=cfg.width, device=device, batch=cfg.encode_batch)
    log(f"vae: held-out PSNR {held_out['psnr_db']} dB, on the object {held_out['object_psnr_db']} dB "
        f"({held_out['object_psnr_second_half_db']} dB in the second half), object found in "
        f"{held_out['detector']['found_pct']}% of the reconstructions")
    save_pretrained(vae.to("cpu"), out / "vae")
    return {**stats, "held_out_psnr_db": held_out["psnr_db"], "held_out": held_out, "decoder_only": decoder_only}


@torch.no_grad()
def set_latent_stats(vae, cfg: VideoTrainConfig, seed: int, device: torch.device) -> None:
    """latents_mean / latents_std per channel over full training clips, into the VAE's config (the pipeline
    normalises latents with them)."""
    zs = []
    stat_gen = torch.Generator().manual_seed(seed + 2)
    for i in range(0, cfg.vae_stat_clips, cfg.encode_batch):
        video, _ = render_clips(training_seeds(stat_gen, min(cfg.encode_batch, cfg.vae_stat_clips - i)), cfg,
                                device)
        zs.append(vae.encode(video).latent_dist.mode().float().transpose(0, 1).flatten(1).cpu())
    z = torch.cat(zs, dim=1)
    vae.register_to_config(latents_mean=[round(float(v), 6) for v in z.mean(1)],
                           latents_std=[round(float(v), 6) for v in z.std(1)])


def vae_batch(cfg: VideoTrainConfig, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """One VAE training batch [B, 3, T, H, W] in [-1, 1] (of the steps that are not warm-cache steps): with
    probability `vae_long_share`, `vae_long_batch` crops of `vae_long_frames` frames and a `vae_long_size` window;
    else `vae_batch` full-size crops of `vae_frames`.
    Crops start on a chunk boundary (frame 4k), as the encoder's causal chunks do."""
    long = float(torch.rand(1, generator=gen)) < cfg.vae_long_share
    batch, crop = (cfg.vae_long_batch, cfg.vae_long_frames) if long else (cfg.vae_batch, cfg.vae_frames)
    video, _ = render_clips(training_seeds(gen, batch), cfg, device)
    start = 4 * int(torch.randint(0, (cfg.frames - crop) // 4 + 1, (1,), generator=gen))
    x = video[:, :, start:start + crop]
    if long:
        h, w = cfg.vae_long_size
        top = int(torch.randint(0, (cfg.height - h) // 8 + 1, (1,), generator=gen)) * 8
        left = int(torch.randint(0, (cfg.width - w) // 8 + 1, (1,), generator=gen)) * 8
        x = x[..., top:top + h, left:left + w]
    return x


def vae_warm_batch(cfg: VideoTrainConfig, gen: torch.Generator,
                   device: torch.device) -> tuple[torch.Tensor, int]:
    """A warm-cache batch: `vae_batch` full-size clips cut after `context + vae_warm_chunks` encoder chunks (chunk
    0 is frame 0, chunk i frames 4i - 3 .. 4i), and the number of context chunks, uniform in 1 ..
    `vae_warm_context` (at most what the clip leaves before the scored chunks)."""
    chunks = 1 + (cfg.frames - 1) // 4
    most = min(cfg.vae_warm_context, chunks - cfg.vae_warm_chunks)
    if most < 1:
        raise ValueError(f"vae_warm_chunks={cfg.vae_warm_chunks} leaves no context chunk in a {cfg.frames}-frame "
                         f"clip ({chunks} chunks); use at most {chunks - 1}")
    context = int(torch.randint(1, most + 1, (1,), generator=gen))
    video, _ = render_clips(training_seeds(gen, cfg.vae_batch), cfg, device)
    return video[:, :, :1 + 4 * (context + cfg.vae_warm_chunks - 1)], context


def warm_reconstruct(vae, x: torch.Tensor, context: int, *, noise_gen: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reconstruct the frames of `x` [B, 3, 1 + 4(n - 1), H, W] after its first `context` encoder chunks, with the
    causal caches of diffusers' `AutoencoderKLWan` filled by those chunks (encoded, and their posterior means
    decoded) without gradient: the same chunk loop as its `_encode` / `_decode`, so the frames come out as they do
    from a full clip's encode and decode. With `noise_gen` the scored latents are posterior samples and the
    encoder gets gradient (else the posterior mean, encoder without gradient: the decoder-only recipe). Returns
    (reconstruction, target frames, KL per target element)."""
    if context < 1:
        raise ValueError(f"context must be at least 1 chunk (frame 0), got {context}")
    chunks = 1 + (x.shape[2] - 1) // 4
    if x.shape[2] != 1 + 4 * (chunks - 1) or chunks <= context:
        raise ValueError(f"x has {x.shape[2]} frames; warm_reconstruct needs 1 + 4k frames with more than "
                         f"{context} chunks")

    def encode(i: int) -> torch.Tensor:
        vae._enc_conv_idx = [0]
        part = x[:, :, :1] if i == 0 else x[:, :, 1 + 4 * (i - 1):1 + 4 * i]
        return vae.encoder(part, feat_cache=vae._enc_feat_map, feat_idx=vae._enc_conv_idx)

    def decode(z: torch.Tensor, first: bool) -> torch.Tensor:
        vae._conv_idx = [0]
        kwargs = {"first_chunk": True} if first else {}
        return vae.decoder(z, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, **kwargs)

    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    vae.clear_cache()
    with torch.no_grad():
        warm = vae.quant_conv(torch.cat([encode(i) for i in range(context)], 2))
    with torch.set_grad_enabled(torch.is_grad_enabled() and noise_gen is not None):
        posterior = DiagonalGaussianDistribution(vae.quant_conv(torch.cat([encode(i) for i in range(context, chunks)],
                                                                          2)))
    if noise_gen is None:
        z, kl = posterior.mode().detach(), posterior.mean.new_zeros(())
    else:
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=noise_gen,
                                                          device=posterior.mean.device)
        kl = posterior.kl().mean() / x[0, :, 1 + 4 * (context - 1):].numel()
    vae.clear_cache()
    with torch.no_grad():
        zw = vae.post_quant_conv(DiagonalGaussianDistribution(warm).mode())
        for i in range(context):
            decode(zw[:, :, i:i + 1], i == 0)
    zs = vae.post_quant_conv(z)
    rec = torch.cat([decode(zs[:, :, i:i + 1], False) for i in range(zs.shape[2])], 2).clamp(-1, 1)
    vae.clear_cache()
    return rec, x[:, :, 1 + 4 * (context - 1):], kl


@torch.no_grad()
def vae_held_out(vae, seeds: list[int], *, frames: int, height: int, width: int, device: torch.device,
                 batch: int = 8) -> dict[str, Any]:
    """Full clips of `seeds` through encode (posterior mean) and decode, scored on 8-bit pixels: mean PSNR (dB) over
    each clip, over the named object's pixels (`object_mask` of the original) and over those in its second half
    (frames from (frames - 1) // 2 on: where a causal VAE's caches drift), and the detector's summary of the
    reconstructions (`mmkv.metrics.adherence`: is the object still there, and its attributes)."""
    from mmkv.metrics.adherence import score_clip
    from mmkv.metrics.video import psnr_from_mse
    from mmkv.pipelines.wan.evaluate import summarize

    clip, obj, late, scores = [], [], [], []
    half = (frames - 1) // 2
    dtype = next(vae.parameters()).dtype
    for i in range(0, len(seeds), batch):
        video, captions = render_pixels(seeds[i:i + batch], frames=frames, height=height, width=width, device=device)
        rec = vae.decode(vae.encode(video.to(dtype)).latent_dist.mode()).sample.float().clamp(-1, 1)
        a = ((video.float() + 1) * 127.5).round()
        b = ((rec + 1) * 127.5).round()
        sq = (a - b).pow(2).mean(1)  # [B, T, H, W]
        mask = object_mask(video.float())[:, 0]
        clip += psnr_from_mse(sq.flatten(1).mean(1).cpu().numpy()).tolist()
        for k in range(sq.shape[0]):
            for into, err in ((obj, sq[k][mask[k]]), (late, sq[k, half:][mask[k, half:]])):
                if err.numel():
                    into.append(float(psnr_from_mse(err.mean().cpu().numpy())))
            frames_u8 = b[k].permute(1, 2, 3, 0).to(torch.uint8).cpu().numpy()
            scores.append(score_clip(frames_u8, scenes.parse_caption(captions[k]), scenes.PALETTE))

    def mean(v: list[float]) -> float | None:
        return round(sum(v) / len(v), 3) if v else None

    return {"clips": len(seeds), "psnr_db": mean(clip), "object_psnr_db": mean(obj),
            "object_psnr_second_half_db": mean(late), "detector": summarize(scores)}


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: teacher-forced DiT + text encoder


def _load_vae(folder: Path, device: torch.device):
    from diffusers import AutoencoderKLWan

    vae_dir = folder / "vae" if (folder / "vae").is_dir() else folder / "base" / "vae"
    if not (vae_dir / "config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no trained VAE (vae/config.json or base/vae/config.json); run "
                                "`mmkv train video --stage vae` first")
    from mmkv.pipelines.wan.loaders import cpu_vae_paths_

    vae = AutoencoderKLWan.from_pretrained(vae_dir, torch_dtype=torch.float32, local_files_only=True)
    return cpu_vae_paths_(vae.to(device).eval())


def _load_release(folder: Path, device: torch.device):
    """(text encoder, DiT) of a release layout written by `write_release`, fp32, trainable."""
    from mmkv.pipelines.wan.loaders import load_wan

    comps = load_wan(folder / "causvid", folder / "base", device=device, dtype=torch.float32)
    return comps.text_encoder.train().requires_grad_(True), comps.dit.train().requires_grad_(True)


@torch.no_grad()
def build_dataset(vae, cfg: VideoTrainConfig, device: torch.device, seed: int, budget_s: float | None = None,
                  log: Callable[[str], None] = print
                  ) -> tuple[torch.Tensor, list[str], list[int], torch.Tensor | None]:
    """`cfg.dit_clips` training clips as normalised latents (bf16 on CUDA), their captions and seeds, and their
    `latent_object_mask`s when `cfg.dit_object_weight` is set (else None); with `budget_s`, fewer if encoding them
    would take longer (the count is recorded)."""
    gen = torch.Generator().manual_seed(seed)
    seeds = training_seeds(gen, cfg.dit_clips)
    t0 = time.perf_counter()
    lat, caps, masks = [], [], []
    spatial, temporal = cfg.vae["scale_factor_spatial"], cfg.vae["scale_factor_temporal"]
    for i in range(0, len(seeds), cfg.encode_batch):
        if budget_s is not None and i and time.perf_counter() - t0 > budget_s:
            seeds = seeds[:i]
            break
        video, c = render_clips(seeds[i:i + cfg.encode_batch], cfg, device)
        lat.append(encode_latents(vae, video).to(torch.bfloat16 if device.type == "cuda" else torch.float32))
        if cfg.dit_object_weight:
            masks.append(latent_object_mask(video, spatial, temporal))
        caps += c
    log(f"dataset: {len(seeds)} clips rendered and encoded in {time.perf_counter() - t0:.1f} s")
    return torch.cat(lat), caps, seeds, torch.cat(masks) if masks else None


def train_dit(cfg: VideoTrainConfig, vae_folder: Path, out: Path, *, device: torch.device, seed: int,
              budget_s: float | None, init: Path | None = None,
              log: Callable[[str], None] = print, step_plan: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    vae = _load_vae(vae_folder, device)
    data, captions, data_seeds, objects = build_dataset(vae, cfg, device, seed,
                                                        None if budget_s is None else 0.25 * budget_s, log)
    tokenizer = word_tokenizer(scenes.vocabulary(), cfg.text_len)
    ids, mask = tokenize(tokenizer, captions, cfg.text_len)
    empty_ids, empty_mask = tokenize(tokenizer, [""], cfg.text_len)
    ids, mask = ids.to(device), mask.to(device)
    empty_ids, empty_mask = empty_ids.to(device), empty_mask.to(device)
    if init is None:
        encoder = build_text_encoder(cfg, len(tokenizer), seed).to(device).train()
        dit = build_dit(cfg, seed).to(device).train()
    else:  # continue an earlier `dit` run (weights only: optimizer state and the schedule start afresh)
        encoder, dit = _load_release(init, device)
        tokenizer = word_tokenizer(scenes.vocabulary(), cfg.text_len)
        if cfg.dit_layers:
            dit = deepen(dit, cfg.dit_layers).requires_grad_(True)
            log(f"dit: the init's DiT deepened to {dit.num_layers} layers")
    dit.state.cache_cross_attn = False  # the text changes every step
    ema_dit, ema_enc = frozen_copy(dit), frozen_copy(encoder)
    compile_blocks(dit, cfg.dit_compile)
    f = data.shape[1]
    tpf = dit.tokens_per_frame(data.shape[3], data.shape[4])
    patterns = {fpb: TeacherForcing(f, fpb, tpf) for fpb in (cfg.frames_per_block, 1)}
    gen = torch.Generator(device=device).manual_seed(seed + 10)
    cpu_gen = torch.Generator().manual_seed(seed + 11)

    def loss_fn(step: int) -> torch.Tensor:
        first_only = float(torch.rand(1, generator=cpu_gen)) < cfg.first_block_share
        fpb = block_size(cfg, cpu_gen)  # the frame-wise loops' first block is latent frame 0 alone
        batch = cfg.first_block_batch if first_only else cfg.dit_batch
        idx = to_device(torch.randint(0, data.shape[0], (batch,), generator=cpu_gen), device)
        x0 = (data[idx, :fpb] if first_only else data[idx]).float()
        cells = None if objects is None else (objects[idx, :fpb] if first_only else objects[idx])
        drop = to_device(torch.rand(batch, generator=cpu_gen) < cfg.empty_caption, device)
        b_ids = torch.where(drop[:, None], empty_ids, ids[idx])
        b_mask = torch.where(drop[:, None], empty_mask, mask[idx])
        context = text_states(encoder, b_ids, b_mask)
        # text-to-first-block steps denoise the block on its own, as a rollout's first block is
        t = block_timesteps(gen, batch, fpb if first_only else f, fpb, cfg.shift, device)
        sigma = (t / 1000).view(*t.shape, 1, 1, 1)
        noise = torch.randn(x0.shape, generator=gen, device=device)
        noisy = (1 - sigma) * x0 + sigma * noise
        if first_only:
            flow = first_block_flow(dit, noisy, t, context)
        else:
            flow = teacher_forced_flow(dit, x0, noisy, t, context, patterns[fpb])
        return object_weighted_mse(flow.float(), noise - x0, cells, cfg.dit_object_weight)

    def after(step: int) -> None:
        ema_update(ema_dit, dit, cfg.ema, step)
        ema_update(ema_enc, encoder, cfg.ema, step)

    remaining = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
    stats = optimise(list(dit.parameters()) + list(encoder.parameters()), loss_fn, steps=cfg.dit_steps,
                      lr=cfg.dit_lr, warmup=cfg.warmup, budget_s=remaining, device=device, after_step=after, log=log,
                      name="dit", step_plan=step_plan)
    size = write_release(out, cfg, vae=vae, encoder=ema_enc, tokenizer=tokenizer, dit=ema_dit)
    note_release_size(size, log)
    return {**stats, "dataset_clips": len(data_seeds), "dataset_seed": seed, "release_bytes": size}


# ----------------------------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, STAGES, CONFIGS,
                        "the previous stage's output folder (dit: the vae stage's; distill: the dit stage's)")
    parser.add_argument("--decoder-only", action="store_true",
                        help="vae stage with --init: train the decoder only; the encoder and its latent statistics "
                             "stay, so a DiT trained on its latents stays valid (an init that is a release, a dit or "
                             "distill output or a shipped set, also gives OUT/release: its DiT with the new decoder)")


def run(args: argparse.Namespace) -> int:
    overrides = parse_overrides(get_config(args.config), args.overrides)
    if args.steps is not None:
        overrides[{"vae": "vae_steps", "dit": "dit_steps", "distill": "distill_steps"}[args.stage]] = args.steps
    cfg = get_config(args.config, **overrides)
    if cfg.dit_compile and getattr(args, "deterministic", False):
        raise ValueError("dit_compile=true with --deterministic: compiled blocks train other weights in another "
                         "process even in inductor's deterministic mode; drop one of them (a run that is to replay "
                         "trains eager)")
    # A dit or distill output holds the VAE it was trained on (base/vae): the vae stage may continue from it.
    # A distill output holds a DiT too (the student, a close init for more teacher-forced steps).
    st = start_stage(args, first_stage="vae", init_from={"vae": STAGES, "dit": ("dit", "distill")})
    common = dict(device=st.device, seed=args.seed, budget_s=args.budget, init=st.init, log=st.log,
                  step_plan=st.step_plan)
    if args.stage == "vae":
        stats = train_vae(cfg, st.out, decoder_only=args.decoder_only, **common)
        if args.decoder_only and has_release(st.init):
            # the init's DiT goes with the new decoder (same encoder, same latents): a release to score and ship
            record = stage_record(st, args, cfg.to_dict(), stats)
            stats["release_bytes"] = write_decoder_release(st.out / "release", st.out / "vae", st.init, record)
            note_release_size(stats["release_bytes"], st.log)
    elif args.decoder_only:
        raise ValueError("--decoder-only applies to --stage vae only")
    elif args.stage == "dit":
        stats = train_dit(cfg, st.source, st.out, **common)
    else:
        from mmkv.pipelines.wan.distill import distill  # distill builds on this module's helpers

        stats = distill(cfg, st.source, st.out, **common)
    finish_stage(st, args, cfg.to_dict(), stats)
    return 0
