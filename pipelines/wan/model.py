"""The causal Wan2.1 DiT: diffusers' `WanTransformer3DModel` with frame-offset RoPE and causal attention processors.

The diffusers model is used unchanged except for three swaps, all done at construction (docs/decisions.md,
"diffusers model with three swaps"):
* `transformer.rope` becomes `OffsetRoPE`, whose temporal positions start at the current block's first latent frame
  (`causal_rope_apply`, CausVid causvid/models/wan/causal_model.py:27-54). Its cos/sin tables are plain float64
  attributes, not buffers, so casting the model to bf16 leaves them exact (the original keeps `freqs` as a plain
  attribute for the same reason).
* every `blocks[i].attn1` gets `CausalSelfAttnProcessor` and the attribute `mmkv_layer = i`, so that
  `KVStore.attach(transformer)` hands it the store (`attn.mmkv_store`). In `denoise` mode a call attends over
  [stored past | current block] and stores nothing; in `commit` mode it attends the same way and then appends the
  block's post-RoPE K and raw V to the store, which encodes frames that leave the residual window (CausVid
  causal_model.py:134-143). `full` mode attends within the call only, with an optional mask: the block-causal recompute
  (CausVid causal_model.py:414-455).
* every `blocks[i].attn2` gets `CrossAttnProcessor`, which can keep the per-prompt text K/V (CausVid
  wan_base/modules/model.py:159-194).

Both processors normalise q/k in float32 and cast back, like the original `WanRMSNorm` (gueraf/self-forcing-diffusers'
model_patches.py does the same for parity), and rotate in float64 like the original complex128 RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("denoise", "commit", "full")


class ModelError(ValueError):
    """Bad input to the causal DiT (shape, frame offset, missing store); the message says what was expected."""


@dataclass
class CausalState:
    """Per-call facts shared by the RoPE module and every processor (diffusers does not forward kwargs to blocks)."""

    start_frame: int = 0  # absolute latent-frame index of the first frame in this call
    num_frames: int = 0  # latent frames in this call (the commit pass appends this many units)
    mode: str = "denoise"
    # `full` mode only: bool [L, L] (True = may attend), or the teacher-forcing pattern computed block by block.
    attn_mask: torch.Tensor | TeacherForcing | None = None
    # `full` mode only: the RoPE time index of each latent frame of the call (None = start_frame, start_frame + 1,
    # ...). Teacher forcing feeds [clean frames | noisy copies] and the copies reuse the clean frames' indices
    # (Self-Forcing `wan/modules/causal_model.py`, `_prepare_teacher_forcing_mask`).
    frame_positions: torch.Tensor | None = None
    cache_cross_attn: bool = True
    cross_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class TeacherForcing:
    """The attention pattern of a teacher-forced sequence [clean frames | their noisy copies] (Self-Forcing
    `wan/modules/causal_model.py`, `_prepare_teacher_forcing_mask`): clean block j sees clean blocks <= j, noisy
    block j sees clean blocks < j and itself. `mask` is that pattern as a dense bool [2L, 2L]; `attend` computes the
    same attention block by block with unmasked SDPA calls, so the 71% of the score matrix the mask forbids (7
    blocks) is never computed and the calls may take the fused kernels that a mask rules out."""

    num_frames: int
    frames_per_block: int
    tokens_per_frame: int

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        block = (torch.arange(self.num_frames, device=device) // self.frames_per_block).repeat_interleave(
            self.tokens_per_frame)
        q, k = block.unsqueeze(1), block.unsqueeze(0)
        top = torch.cat([q >= k, torch.zeros_like(q >= k)], dim=1)
        bottom = torch.cat([q > k, q == k], dim=1)
        return torch.cat([top, bottom], dim=0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """SDPA over q, k, v [B, H, 2L, D] under `mask()`, block by block."""
        n = self.num_frames * self.tokens_per_frame
        if q.shape[2] != 2 * n or k.shape[2] != 2 * n:
            raise ModelError(f"teacher forcing over {self.num_frames} frames of {self.tokens_per_frame} tokens "
                             f"needs 2 x {n} tokens, got {q.shape[2]}")
        step = self.frames_per_block * self.tokens_per_frame
        clean, noisy = [], []
        for s in range(0, n, step):
            e = min(s + step, n)
            clean.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e]))
            keys = torch.cat([k[:, :, :s], k[:, :, n + s:n + e]], dim=2)
            values = torch.cat([v[:, :, :s], v[:, :, n + s:n + e]], dim=2)
            noisy.append(F.scaled_dot_product_attention(q[:, :, n + s:n + e], keys, values))
        return torch.cat(clean + noisy, dim=2)


# ----------------------------------------------------------------------------------------------------------------
# RoPE with a frame offset


class OffsetRoPE(nn.Module):
    """Wan's 3D RoPE (t/h/w split of `head_dim`) whose time index starts at `state.start_frame`."""

    def __init__(self, state: CausalState, head_dim: int, patch_size: tuple[int, int, int], max_seq_len: int,
                 theta: float = 10000.0):
        super().__init__()
        from diffusers.models.embeddings import get_1d_rotary_pos_embed

        self.state = state
        self.patch_size = tuple(patch_size)
        self.max_seq_len = max_seq_len
        # Same split as diffusers' WanRotaryPosEmbed (transformer_wan.py:368) and the original (model.py:29-36).
        self.h_dim = self.w_dim = 2 * (head_dim // 6)
        self.t_dim = head_dim - self.h_dim - self.w_dim
        cos, sin = [], []
        for dim in (self.t_dim, self.h_dim, self.w_dim):
            c, s = get_1d_rotary_pos_embed(dim, max_seq_len, theta, use_real=True, repeat_interleave_real=True,
                                           freqs_dtype=torch.float64)
            cos.append(c)
            sin.append(s)
        # Plain attributes (not buffers): model.to(bfloat16) must not round the tables. Each frequency sits in two
        # lanes (2i, 2i + 1); `apply_rope` takes sin with its even lanes negated (exact), made here once.
        self._cos = [c.double() for c in cos]
        self._sin = [s.double() for s in sin]
        self._sin_signed = [s.double() * _even_lanes_negated(s.shape[-1]) for s in sin]
        self._device_tables: dict[torch.device, tuple[list[torch.Tensor], ...]] = {}
        self._device_positions: dict[tuple, torch.Tensor] = {}

    def _tables(self, device: torch.device):
        if device not in self._device_tables:
            self._device_tables[device] = tuple([t.to(device) for t in tables]
                                                for tables in (self._cos, self._sin, self._sin_signed))
        return self._device_tables[device]

    def _positions(self, pos: torch.Tensor, ppf: int, device: torch.device) -> torch.Tensor:
        """`frame_positions` checked and on `device`. Positions given on the CPU (as teacher forcing gives them) are
        checked there and their device copy kept, so that a training step neither waits for the GPU to read them back
        nor copies them again; positions already on the device are checked with a read-back."""
        if pos.numel() != ppf or int(pos.min()) < 0 or int(pos.max()) >= self.max_seq_len:
            raise ModelError(f"frame_positions must hold {ppf} indices in [0, {self.max_seq_len}), got "
                             f"{pos.numel()} in [{int(pos.min())}, {int(pos.max())}]")
        if pos.device.type != "cpu" or device.type == "cpu":
            return pos.to(device)
        key = (tuple(pos.tolist()), device)
        if key not in self._device_positions:
            self._device_positions[key] = pos.to(device)
        return self._device_positions[key]

    def forward(self, hidden_states: torch.Tensor) -> "RopeTables":
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        ppf, pph, ppw = frames // p_t, height // p_h, width // p_w
        s = self.state.start_frame
        if s < 0 or s + ppf > self.max_seq_len or max(pph, ppw) > self.max_seq_len:
            raise ModelError(
                f"RoPE positions out of range: frames [{s}, {s + ppf}) and a {pph}x{ppw} token grid, but the table "
                f"has {self.max_seq_len} positions (rope_max_seq_len)"
            )
        cos, sin, sin_signed = self._tables(hidden_states.device)
        pos = self.state.frame_positions
        if pos is not None:
            pos = self._positions(pos, ppf, hidden_states.device)

        def grid(tables):
            t = tables[0][s:s + ppf] if pos is None else tables[0][pos]
            t = t.view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1)
            h = tables[1][:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1)
            w = tables[2][:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1)
            return torch.cat([t, h, w], dim=-1).reshape(1, ppf * pph * ppw, 1, -1)

        return RopeTables(grid(cos), grid(sin), grid(sin_signed))


def _even_lanes_negated(d: int) -> torch.Tensor:
    """[-1, 1, -1, 1, ...] (d lanes, float64)."""
    return torch.tensor([-1.0, 1.0], dtype=torch.float64).repeat(d // 2)


class RopeTables(tuple):
    """(cos, sin) [1, L, 1, D] float64, as diffusers' `WanRotaryPosEmbed` returns them (frequency i in lanes 2i and
    2i + 1), with `sin_signed`, sin whose even lanes are negated, for `apply_rope`."""

    sin_signed: torch.Tensor

    def __new__(cls, cos: torch.Tensor, sin: torch.Tensor, sin_signed: torch.Tensor):
        tables = super().__new__(cls, (cos, sin))
        tables.sin_signed = sin_signed
        return tables


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) = (x[2i], x[2i+1]) of x [B, L, H, D] by the float64 tables [1, L, 1, D] (`RopeTables`:
    cos, and sin with its even lanes negated): x1 c - x2 s and x1 s + x2 c in float64 (as the original's complex
    product in float64, CausVid causal_model.py `causal_rope_apply`), cast back to x's dtype.

    Computed as x * cos + swap(x) * sin_signed, swap exchanging each pair: lane 2i is x1 c + x2 (-s), lane 2i+1 is
    x2 c + x1 s, each product and sum rounded once in float64, so bit for bit the pairwise form x1 c - x2 s,
    x1 s + x2 c (negation is exact and IEEE addition commutes) in 5 ops where that form takes 9."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x * cos + swapped * sin_signed).to(x.dtype)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The original WanRMSNorm: normalise in float32, cast back, then scale (CausVid model.py WanRMSNorm.forward)."""
    xf = x.float()
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.type_as(x)
    return y * norm.weight if norm.weight is not None else y


# ----------------------------------------------------------------------------------------------------------------
# Attention processors


class CausalSelfAttnProcessor:
    """Self-attention over [stored past | current block] through `attn.mmkv_store` (CausVid causal_model.py:134-143)."""

    def __init__(self, state: CausalState, layer: int):
        self.state = state
        self.layer = layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        state = self.state
        q = rms_norm(attn.norm_q, attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = rms_norm(attn.norm_k, attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        k_pre_rope = k
        if rotary_emb is not None:
            q = apply_rope(q, rotary_emb[0], rotary_emb.sin_signed)
            k = apply_rope(k, rotary_emb[0], rotary_emb.sin_signed)
        # [B, L, H, D] -> [B, H, L, D]: the store's layout. K is post-RoPE, V raw (CausVid causal_model.py:96-102).
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        observer = getattr(attn, "mmkv_observer", None)  # set by `mmkv.inspect.KVObserver.attach`; reads only
        if observer is not None:
            observer(self.layer, state.mode, q, k_pre_rope.transpose(1, 2), k, v)
        if state.mode == "full":
            mask = state.attn_mask
            if isinstance(mask, TeacherForcing):
                out = mask.attend(q, k, v)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            store = getattr(attn, "mmkv_store", None)
            if store is None:
                raise ModelError(
                    f"layer {self.layer}: mode {state.mode!r} needs a KV store; run inside `with store.attach(model)`"
                )
            out = store.attend(self.layer, q, k_cur=k, v_cur=v)
            if state.mode == "commit":
                # Only the clean (t = context_noise) pass persists; denoising writes are transient
                # (CausVid causal_inference.py:77-206).
                store.append(self.layer, k, v, num_units=state.num_frames)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class CrossAttnProcessor:
    """Text cross-attention; with `state.cache_cross_attn` the text K/V are computed once per rollout (as CausVid)."""

    def __init__(self, state: CausalState, layer: int):
        self.state = state
        self.layer = layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is None:
            raise ModelError(f"layer {self.layer}: cross-attention needs the text embedding")
        state = self.state
        q = rms_norm(attn.norm_q, attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        cached = state.cross_kv.get(self.layer) if state.cache_cross_attn else None
        if cached is None:
            k = rms_norm(attn.norm_k, attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            v = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            if state.cache_cross_attn:
                state.cross_kv[self.layer] = (k, v)
        else:
            k, v = cached
        out = F.scaled_dot_product_attention(q, k, v)  # no mask, as upstream (CausVid causal_model.py:530-538)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


# ----------------------------------------------------------------------------------------------------------------
# The wrapper


class CausalWan(nn.Module):
    """A `WanTransformer3DModel` turned causal. Latents in and flow out are [B, F, C, H, W] (frame-major, like the
    original repos); diffusers' own layout [B, C, F, H, W] stays inside."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        from diffusers import WanTransformer3DModel

        if not isinstance(transformer, WanTransformer3DModel):
            raise ModelError(f"expected a diffusers WanTransformer3DModel, got {type(transformer).__name__}")
        cfg = transformer.config
        if cfg.image_dim is not None or cfg.added_kv_proj_dim is not None:
            raise ModelError("image-conditioned Wan (I2V, image_dim / added_kv_proj_dim set) is not supported")
        self.transformer = transformer
        self.state = CausalState()
        self.num_layers = cfg.num_layers
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.attention_head_dim
        self.in_channels = cfg.in_channels
        self.patch_size = tuple(cfg.patch_size)
        transformer.rope = OffsetRoPE(self.state, self.head_dim, self.patch_size, cfg.rope_max_seq_len)
        for i, block in enumerate(transformer.blocks):
            block.attn1.mmkv_layer = i
            block.attn1.set_processor(CausalSelfAttnProcessor(self.state, i))
            block.attn2.set_processor(CrossAttnProcessor(self.state, i))

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.patch_embedding.weight.device

    @property
    def config(self) -> Any:
        return self.transformer.config

    def tokens_per_frame(self, latent_height: int, latent_width: int) -> int:
        """Tokens per latent frame, from the latent grid and the patch size (1560 for 60x104 latents)."""
        _, p_h, p_w = self.patch_size
        return (latent_height // p_h) * (latent_width // p_w)

    def reset(self) -> None:
        """Forget the per-prompt cross-attention K/V (call at the start of every rollout)."""
        self.state.cross_kv.clear()

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor | float, context: torch.Tensor, *,
                start_frame: int = 0, mode: str = "denoise", attn_mask: torch.Tensor | TeacherForcing | None = None,
                frame_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Flow prediction for `latents` [B, F, C, H, W] at absolute frames [start_frame, start_frame + F).

        `timestep` is a float / [B] (one value per sample) or [B, F] (one per frame, expanded to tokens).
        """
        if mode not in MODES:
            raise ModelError(f"unknown mode {mode!r}; expected one of {MODES}")
        if latents.dim() != 5:
            raise ModelError(f"latents must be [B, F, C, H, W], got shape {tuple(latents.shape)}")
        b, f, c, h, w = latents.shape
        if c != self.in_channels:
            raise ModelError(f"latents have {c} channels, the model takes {self.in_channels}")
        p_t, p_h, p_w = self.patch_size
        if f % p_t or h % p_h or w % p_w:
            raise ModelError(f"latent grid {f}x{h}x{w} is not divisible by the patch size {self.patch_size}")
        if isinstance(timestep, (int, float)):  # filled on the device: a host scalar copied there waits for the GPU
            t = torch.full((b,), float(timestep), device=latents.device, dtype=torch.float32)
        else:
            t = torch.as_tensor(timestep, device=latents.device, dtype=torch.float32)
        if t.dim() == 0:
            t = t.expand(b)
        elif t.dim() == 2:
            if t.shape != (b, f):
                raise ModelError(f"per-frame timestep must be [B, F] = [{b}, {f}], got {tuple(t.shape)}")
            if p_t != 1:
                raise ModelError(f"per-frame timesteps need a temporal patch size of 1, got {p_t}")
            # Per-token timesteps (diffusers' 2D `timestep`, transformer_wan.py:677-690).
            t = t.repeat_interleave(self.tokens_per_frame(h, w), dim=1)
        self.state.start_frame = int(start_frame)
        self.state.num_frames = f // p_t
        self.state.mode = mode
        if frame_positions is not None and mode != "full":
            raise ModelError("frame_positions is for `full` mode (teacher forcing); cached modes use start_frame")
        self.state.attn_mask = attn_mask
        self.state.frame_positions = frame_positions
        try:
            out = self.transformer(
                hidden_states=latents.permute(0, 2, 1, 3, 4),
                timestep=t,
                encoder_hidden_states=context,
                return_dict=False,
            )[0]
        finally:
            self.state.attn_mask = None
            self.state.frame_positions = None
        return out.permute(0, 2, 1, 3, 4)
