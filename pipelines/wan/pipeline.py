"""One text-to-video pipeline for every preset: text encoding, the block loop over a KV store, VAE decoding.

Shapes come from the loaded configs: latent grid from the VAE's compression factors, tokens per frame from the DiT's
patch size, layer / head counts from the DiT config, text length from the base config (never upstream's fixed
1560 / 32760).
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from mmkv.cache import CacheConfig, KVStore
from mmkv.pipelines.common import NoiseStream, NonFiniteError, RunError, nonfinite_outputs
from mmkv.pipelines.wan.loaders import WanComponents, latent_latents_stats, vae_factors
from mmkv.pipelines.wan.loop import Preset, RolloutResult, rollout


class ResolutionError(ValueError):
    """A frame count or frame size the VAE / DiT / preset cannot take."""


@dataclass(frozen=True)
class Grid:
    frames: int  # pixel frames
    height: int
    width: int
    latent_frames: int
    latent_height: int
    latent_width: int
    tokens_per_frame: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def make_grid(frames: int, height: int, width: int, *, t_factor: int, s_factor: int,
              patch_size: tuple[int, int, int], frames_per_block: int, rope_max_seq_len: int) -> Grid:
    """Latent grid of a pixel video; raises `ResolutionError` saying which dimension is wrong and why."""
    _, p_h, p_w = patch_size
    step_h, step_w = s_factor * p_h, s_factor * p_w
    problems = []
    if height < step_h or height % step_h:
        problems.append(f"height {height} is not a positive multiple of {step_h} (VAE {s_factor}x spatial "
                        f"compression x DiT patch {p_h})")
    if width < step_w or width % step_w:
        problems.append(f"width {width} is not a positive multiple of {step_w} (VAE {s_factor}x spatial "
                        f"compression x DiT patch {p_w})")
    if frames < 1 or (frames - 1) % t_factor:
        problems.append(f"frame count {frames} is not 1 + {t_factor}k (the VAE keeps frame 0 alone and compresses "
                        f"the rest {t_factor}x in time; e.g. 81 -> 21 latent frames)")
    if problems:
        raise ResolutionError(f"cannot render {frames}x{height}x{width}: " + "; ".join(problems))
    lat_f = (frames - 1) // t_factor + 1
    lat_h, lat_w = height // s_factor, width // s_factor
    if lat_f % frames_per_block:
        raise ResolutionError(
            f"{frames} frames = {lat_f} latent frames, not a multiple of the preset's {frames_per_block} latent "
            f"frames per block"
        )
    if lat_f > rope_max_seq_len or max(lat_h // p_h, lat_w // p_w) > rope_max_seq_len:
        raise ResolutionError(f"{frames}x{height}x{width} needs more than the model's {rope_max_seq_len} RoPE "
                              "positions")
    return Grid(frames, height, width, lat_f, lat_h, lat_w, (lat_h // p_h) * (lat_w // p_w))


def store_window(window: int | None, sink: int, frames_per_block: int) -> int | None:
    """Self-Forcing's rolling window (`local_attn_size` latent frames of K/V buffer, the block being generated and the
    `sink_size` sink frames included; Causal Forcing causal_model.py:198-239) -> the store's `attention_window` (stored
    frames kept besides the sinks; the current block is attended from the call, not stored). None = global attention."""
    if window is None:
        return None
    past = window - frames_per_block - sink
    if past < 1:
        raise ResolutionError(
            f"a window of {window} latent frames holds the current block ({frames_per_block}) and {sink} sink "
            f"frame(s), which leaves no past frame to roll; use a window of at least {frames_per_block + sink + 1}"
        )
    return past


def local_attn_size(attention_window: int | None, sink: int, frames_per_block: int) -> int | None:
    """The inverse of `store_window`: the Self-Forcing window a store window corresponds to (None = global)."""
    return None if attention_window is None else attention_window + sink + frames_per_block


def _ftfy():
    try:
        import ftfy
    except ImportError:
        raise RunError("prompts are cleaned with ftfy, as the original Wan tokenizer does, but ftfy is not "
                           "installed: pip install 'ftfy~=6.3.1' (a dependency of mmkv)") from None
    return ftfy


def clean_prompt(text: str) -> str:
    """Wan's `whitespace` cleaning (Causal Forcing wan/modules/tokenizers.py): ftfy.fix_text, HTML unescape twice,
    collapse whitespace. Always with ftfy, like the original: without it curly quotes or mojibake reach the tokenizer as
    other token ids than upstream's."""
    text = _ftfy().fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def prompt_cleaning() -> dict[str, str]:
    """How prompts were cleaned before tokenizing, for the run manifest."""
    return {"steps": "ftfy.fix_text, html.unescape x2, whitespace collapsed (Wan tokenizers.py whitespace clean)",
            "ftfy": _ftfy().__version__}


class WanVideoPipeline:
    def __init__(self, components: WanComponents, preset: Preset):
        self.c = components
        self.preset = preset
        self.dit = components.dit
        self.t_factor, self.s_factor = vae_factors(components.vae)

    # -- shapes ----------------------------------------------------------------------------------------------
    def grid(self, frames: int, height: int, width: int) -> Grid:
        return make_grid(frames, height, width, t_factor=self.t_factor, s_factor=self.s_factor,
                         patch_size=self.dit.patch_size, frames_per_block=self.preset.frames_per_block,
                         rope_max_seq_len=self.dit.config.rope_max_seq_len)

    # -- text --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """[B, text_len, text_dim] umT5 states, zero beyond each prompt's length (CausVid wan_wrapper.py:16-53)."""
        tok = self.c.tokenizer(
            [clean_prompt(p) for p in prompts], padding="max_length", truncation=True, max_length=self.c.text_len,
            add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        ids = tok.input_ids.to(self.c.device)
        mask = tok.attention_mask.to(self.c.device)
        states = self.c.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        lengths = mask.gt(0).sum(dim=1)
        keep = torch.arange(states.shape[1], device=states.device)[None, :] < lengths[:, None]
        return (states * keep[..., None]).to(self.dit.dtype)

    # -- cache -------------------------------------------------------------------------------------------------
    def make_store(self, codec: str | None, *, residual_window: int, value_group: int = 32, seed: int = 0,
                   protected_layers: tuple[int, ...] = (), protected_units: int = 0,
                   attention_window: int | None = None, sink_units: int = 0,
                   reuse_decoded: bool = False) -> KVStore:
        """A KV store for this model; `attention_window` / `sink_units` in the store's units (latent frames kept
        besides the current block; see `store_window` for Self-Forcing's `local_attn_size`)."""
        cfg = CacheConfig(codec=codec, value_group=value_group, residual_window=residual_window,
                          protected_layers=protected_layers, protected_units=protected_units, seed=seed,
                          attention_window=attention_window, sink_units=sink_units if attention_window else 0,
                          reuse_decoded=reuse_decoded)
        return KVStore(cfg, num_layers=self.dit.num_layers, num_heads=self.dit.num_heads, head_dim=self.dit.head_dim)

    # -- generation --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, context: torch.Tensor, noise: NoiseStream, store: KVStore, grid: Grid,
                 on_block: Callable[[int, int], None] | None = None,
                 prefix: torch.Tensor | None = None) -> RolloutResult:
        store.reset()
        with store.attach(self.dit.transformer):
            return rollout(self.dit, self.preset, context, noise, num_frames=grid.latent_frames,
                           latent_height=grid.latent_height, latent_width=grid.latent_width,
                           batch_size=context.shape[0], on_block=on_block, prefix=prefix)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """uint8 frames [B, T, H, W, 3] from latents [B, F, C, h, w]: denormalise (z * std + mean, CausVid
        wan_wrapper.py:55-65), decode, clamp to [-1, 1], map to [0, 255] with rounding."""
        vae = self.c.vae
        dtype = next(vae.parameters()).dtype
        mean, std = latent_latents_stats(vae, latents.device, torch.float32)
        z = latents.permute(0, 2, 1, 3, 4).float()
        z = z * std.view(1, -1, 1, 1, 1) + mean.view(1, -1, 1, 1, 1)
        video = vae.decode(z.to(dtype)).sample.float()  # [B, 3, T, H, W]
        reason = nonfinite_outputs({"decoded frames": video})
        if reason:  # the clamp and uint8 cast below would turn NaN into a black video that looks like a result
            raise NonFiniteError(f"VAE decode: {reason}")
        video = video.clamp(-1, 1)
        video = (video * 0.5 + 0.5).clamp(0, 1)
        frames = (video * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)
        return frames.cpu().numpy()

