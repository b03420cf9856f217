"""Flow-matching scheduler, the CausVid / Causal Forcing / Self-Forcing presets, and the block-autoregressive loop.

The loop is CausVid's causvid/models/wan/causal_inference.py:77-206 and Causal Forcing's
pipeline/causal_inference.py:66-333: per block of `frames_per_block` latent frames, denoise with the preset's timesteps
(re-noising the x0 prediction with fresh noise between steps), keep the last x0, then run one `commit` pass on that x0
at t = `context_noise` (0) so the block's clean K/V enter the cache. Only commit passes reach the store's `append`.
Every random draw comes from the rollout's `NoiseStream` (initial latents first, then re-noising draws in loop order),
so the reference and every codec consume identical bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mmkv.pipelines.common import NoiseStream, to_device
from mmkv.pipelines.wan.graphs import BlockGraphs
from mmkv.pipelines.wan.model import CausalWan


class PresetError(ValueError):
    """Unknown preset or a rollout shape the preset cannot generate."""


# ----------------------------------------------------------------------------------------------------------------
# Scheduler (DiffSynth FlowMatchScheduler, sigma_min 0, extra_one_step, 1000 grid points; CausVid flow_match.py:19-39)


class FlowMatchScheduler:
    """sigma_i = linspace(1, 0, 1001)[:-1], shifted s*sigma/(1+(s-1)*sigma); timestep = 1000*sigma (float32).

    Lookups use the grid point nearest to t (CausVid flow_match.py:19-73; Causal Forcing utils/scheduler.py:106-180).
    """

    def __init__(self, shift: float, num_train_timesteps: int = 1000):
        self.shift = float(shift)
        self.num_train_timesteps = num_train_timesteps
        sigmas = torch.linspace(1.0, 0.0, num_train_timesteps + 1)[:-1]
        self.sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        self.timesteps = self.sigmas * num_train_timesteps
        self._on_device: dict[tuple, torch.Tensor] = {}  # `_sigma_on`'s copies

    def warp(self, steps: list[float]) -> list[float]:
        """`warp_denoising_step`: entry n becomes grid-with-trailing-0[1000 - n].

        As Causal Forcing's pipeline/causal_inference.py:28-32."""
        grid = torch.cat([self.timesteps, torch.zeros(1)])
        out = []
        for n in steps:
            idx = self.num_train_timesteps - int(n)
            if not 0 <= idx < len(grid):
                raise PresetError(f"cannot warp step {n}: expected 0 < step <= {self.num_train_timesteps}")
            out.append(float(grid[idx]))
        return out

    def _index(self, t: torch.Tensor) -> torch.Tensor:
        grid = self.timesteps.to(device=t.device, dtype=t.dtype)
        return torch.argmin((grid.unsqueeze(0) - t.reshape(-1).unsqueeze(1)).abs(), dim=1)

    def sigma(self, t: float) -> torch.Tensor:
        """sigma at the grid point nearest to t (float32 scalar tensor)."""
        return self.sigmas[self._index(torch.tensor([float(t)], dtype=torch.float32))][0]

    def _sigma_on(self, t: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """`sigma(t)` in `dtype` on `device`, copied there once per (t, device, dtype) and without a host sync
        (`to_device`): the loop asks for it at every step."""
        key = (float(t), str(device), dtype)
        if key not in self._on_device:
            self._on_device[key] = to_device(self.sigma(t).to(dtype), device)
        return self._on_device[key]

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: float) -> torch.Tensor:
        """(1 - sigma_t) x0 + sigma_t eps, in float32 with the result in the noise's dtype (flow_match.py:58-73)."""
        # sigma as a [1,...,1] float32 tensor (not 0-dim) so bf16 latents promote to float32, as in the original.
        s = self._sigma_on(t, x0.device, torch.float32).reshape([1] * x0.dim())
        return ((1 - s) * x0 + s * noise).type_as(noise)

    def flow_to_x0(self, flow: torch.Tensor, xt: torch.Tensor, t: float) -> torch.Tensor:
        """x0 = x_t - sigma_t * flow, in float64 (CausVid wan_wrapper.py:115-139)."""
        s = self._sigma_on(t, flow.device, torch.float64)
        return (xt.double() - s * flow.double()).to(flow.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Presets


@dataclass(frozen=True)
class Preset:
    """One inference recipe: block size, timestep list (before warping), shift, and an optional block-0 list."""

    name: str
    frames_per_block: int
    steps: tuple[int, ...]
    shift: float
    warp: bool
    first_block_steps: tuple[int, ...] | None = None
    context_noise: float = 0.0
    source: str = ""

    def schedules(self) -> tuple[list[float], list[float]]:
        """(steps for block 0, steps for later blocks) as model timesteps."""
        sched = FlowMatchScheduler(self.shift)
        conv = sched.warp if self.warp else (lambda s: [float(x) for x in s])
        rest = conv(list(self.steps))
        first = conv(list(self.first_block_steps)) if self.first_block_steps else rest
        return first, rest

    def to_dict(self) -> dict:
        first, rest = self.schedules()
        return {
            "name": self.name, "frames_per_block": self.frames_per_block, "steps": list(self.steps),
            "shift": self.shift, "warp": self.warp,
            "first_block_steps": list(self.first_block_steps) if self.first_block_steps else None,
            "context_noise": self.context_noise, "timesteps": rest, "first_block_timesteps": first,
            "source": self.source,
        }


_CF_4 = (1000, 750, 500, 250)
# `source`: the upstream config a preset copies, prefixed with its repository's initials (tianweiy/CausVid,
# thu-ml/Causal-Forcing). Manifests record these strings, so they stay as they are.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("causvid", 3, (1000, 757, 522), 8.0, False,
               source="CV configs/wan_causal_dmd.yaml (autoregressive_checkpoint)"),
        Preset("causvid-warp4", 3, _CF_4, 8.0, True, source="CV configs/wan_causal_dmd_warp_4step_cfg2.yaml"),
        Preset("causal-forcing-chunk", 3, _CF_4, 5.0, True, source="CF configs/causal_forcing_dmd_chunkwise.yaml"),
        Preset("causal-forcing-frame", 1, _CF_4, 5.0, True, source="CF configs/causal_forcing_dmd_framewise.yaml"),
        Preset("causal-forcing-frame-2step", 1, (1000, 500), 5.0, True, first_block_steps=_CF_4,
               source="CF configs/causal_forcing_dmd_framewise_2step.yaml (Causal Forcing++)"),
        Preset("causal-forcing-frame-1step", 1, (1000,), 5.0, True, first_block_steps=_CF_4,
               source="CF configs/causal_forcing_dmd_framewise_1step.yaml (Causal Forcing++)"),
        # Self-Forcing (Huang et al. 2025) trains and samples chunk-wise: the recipe of Causal Forcing's chunk-wise
        # preset, under its own name so a run says which model it rendered.
        Preset("self-forcing", 3, _CF_4, 5.0, True,
               source="Self-Forcing configs/self_forcing_dmd.yaml (num_frame_per_block 3, warp_denoising_step, "
                      "timestep_shift 5)"),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise PresetError(f"unknown video model preset {name!r}; known: {', '.join(PRESETS)}") from None


# ----------------------------------------------------------------------------------------------------------------
# The block loop


@dataclass
class RolloutResult:
    latents: torch.Tensor  # [B, F, C, H, W], model dtype
    block_seconds: list[float] = field(default_factory=list)  # graphed: between CUDA events on the GPU's timeline
    calls: int = 0
    graph_replays: int = 0  # denoising calls served by a block's CUDA graph (`cuda_graphs=True`)


def rollout(
    model: CausalWan,
    preset: Preset,
    context: torch.Tensor,
    noise: NoiseStream,
    *,
    num_frames: int,
    latent_height: int,
    latent_width: int,
    batch_size: int = 1,
    on_block: Callable[[int, int], None] | None = None,
    prefix: torch.Tensor | None = None,
    cuda_graphs: bool = False,
) -> RolloutResult:
    """Generate `num_frames` latent frames block by block. The caller attaches the KV store around this call.

    `on_block(block_index, num_blocks)` is called after each block (progress bars). `prefix` [B, P, C, H, W] (P a
    multiple of the block size, below `num_frames`): given clean latent frames that open the video. They are
    committed to the cache as generated blocks are and copied to the output; only the frames after them are
    generated (Self-Forcing pipeline/causal_inference.py, `initial_latent`). The noise stream is consumed as if the
    given blocks were generated, so every later block sees the draws of a rollout without a prefix: a rollout whose
    prefix is its own first blocks repeats itself exactly.

    `cuda_graphs` (CUDA only): a block's denoising calls run as one captured CUDA graph, replayed for each step
    (`mmkv.pipelines.wan.graphs`: when a call runs eagerly instead, and why the outputs are the eager ones).
    """
    fpb = preset.frames_per_block
    if num_frames < 1 or num_frames % fpb:
        raise PresetError(
            f"preset {preset.name!r} generates blocks of {fpb} latent frame(s); {num_frames} latent frames is not a "
            f"multiple (pixel frames = 1 + 4*(latent frames - 1))"
        )
    first_steps, steps = preset.schedules()
    sched = FlowMatchScheduler(preset.shift)
    device, dtype = model.device, model.dtype
    shape = (batch_size, num_frames, model.in_channels, latent_height, latent_width)
    given = _check_prefix(prefix, shape, fpb)
    graphs = BlockGraphs(model, context) if cuda_graphs else None  # its clock starts here
    model.reset()
    x_init = noise.randn(*shape, device=device, dtype=dtype)  # one draw for the whole video (CausVid, Causal Forcing)
    out = torch.empty(shape, device=device, dtype=dtype)
    result = RolloutResult(latents=out)
    num_blocks = num_frames // fpb
    for b in range(num_blocks):
        t0 = time.perf_counter()
        s = b * fpb
        block_steps = first_steps if b == 0 else steps
        if s < given:  # a given block: skip its denoising, but not its re-noising draws
            x0 = prefix[:, s:s + fpb].to(device=device, dtype=dtype)
            for _ in block_steps[1:]:
                noise.randn(*x0.shape, device=device, dtype=dtype)
            block_steps = []
        x = x_init[:, s:s + fpb]
        for i, t in enumerate(block_steps):
            if graphs is None:
                flow = model(x, t, context, start_frame=s, mode="denoise")
            else:
                flow = graphs.denoise(x, t, s, steps_left=len(block_steps) - i)
            x0 = sched.flow_to_x0(flow, x, t)
            result.calls += 1
            if i + 1 < len(block_steps):
                eps = noise.randn(*x0.shape, device=device, dtype=dtype)  # fresh noise each step, as upstream
                x = sched.add_noise(x0, eps, block_steps[i + 1])
        out[:, s:s + fpb] = x0
        # Cache pass on the clean block: its output is discarded, its K/V are what later blocks see.
        model(x0, preset.context_noise, context, start_frame=s, mode="commit")
        result.calls += 1
        if graphs is not None:  # no wait for the GPU: block times from events, read at the end
            graphs.end_block()
        else:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result.block_seconds.append(time.perf_counter() - t0)
        if on_block is not None:
            on_block(b, num_blocks)
    if graphs is not None:
        result.block_seconds = graphs.finish()
        result.graph_replays = graphs.replayed
    return result


def _check_prefix(prefix: torch.Tensor | None, shape: tuple[int, ...], fpb: int) -> int:
    """The number of given latent frames (0 without a prefix); a one-line error for a prefix the loop cannot use."""
    if prefix is None:
        return 0
    p = prefix.shape[1] if prefix.ndim == 5 else -1
    if prefix.ndim != 5 or prefix.shape[0] != shape[0] or tuple(prefix.shape[2:]) != tuple(shape[2:]):
        raise PresetError(f"prefix latents must be shaped [{shape[0]}, P, {', '.join(map(str, shape[2:]))}], got "
                          f"{list(prefix.shape)}")
    if p < 1 or p % fpb or p >= shape[1]:
        raise PresetError(f"a prefix of {p} latent frames must be a positive multiple of the preset's {fpb}-frame "
                          f"blocks and shorter than the video's {shape[1]} latent frames")
    return p


def block_causal_mask(num_frames: int, frames_per_block: int, tokens_per_frame: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [L, L]: a query in block j may attend keys of blocks <= j (CausVid causal_model.py:414-455)."""
    block = torch.arange(num_frames, device=device) // frames_per_block
    block = block.repeat_interleave(tokens_per_frame)
    return block.unsqueeze(1) >= block.unsqueeze(0)
