"""Stage 3 of `mmkv train video`: ODE distillation for the few-step loops (CausVid `causvid/ode_regression.py`).

The `dit` model integrates the flow ODE block by block (Euler, classifier-free guidance), its clean endpoints
committed to a KV cache as in inference; the student, initialised from it, learns to map the trajectory's state at
each timestep the CausVid and Causal Forcing loops call the model at to the endpoint."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mmkv.pipelines.training import ema_update, frozen_copy, optimise, to_device
from mmkv.pipelines.wan import scenes
from mmkv.pipelines.wan.loop import get_preset
from mmkv.pipelines.wan.release import note_release_size, write_release
from mmkv.pipelines.wan.train import (
    VideoTrainConfig, _load_release, compile_blocks, shifted_sigmas, teacher_forced_flow, text_states, tokenize,
    training_seeds,
)
from mmkv.pipelines.wan.model import TeacherForcing

# ----------------------------------------------------------------------------------------------------------------
# Stage 3: ODE distillation for the few-step loops


def loop_timesteps(preset_name: str) -> list[float]:
    """The timesteps a preset calls the model at after block 0 (all of them: these presets use one list)."""
    first, rest = get_preset(preset_name).schedules()
    return sorted({round(float(t), 6) for t in first + rest}, reverse=True)


def ode_grid(steps: int, shift: float, keep: list[float]) -> list[float]:
    """Euler nodes from t = 1000 to 0: `steps` shifted-uniform steps with the `keep` timesteps inserted exactly."""
    u = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    nodes = {round(float(1000 * shifted_sigmas(x, shift)), 6) for x in u} | {round(float(t), 6) for t in keep}
    return sorted(nodes, reverse=True)


@torch.no_grad()
def ode_rollout(dit, context: torch.Tensor, uncond: torch.Tensor | None, noise: torch.Tensor, *, fpb: int,
                grid: list[float], guidance: float, capture: list[float]) -> tuple[torch.Tensor, dict[float, torch.Tensor]]:
    """Integrate the flow ODE block by block with classifier-free guidance, committing each block's clean endpoint
    to a native KV cache exactly as inference does (mode "commit" at t = 0). Returns the endpoints [B, F, C, h, w]
    and the state at each `capture` timestep."""
    from mmkv.cache import CacheConfig, KVStore

    b, f = noise.shape[:2]
    cfg_on = uncond is not None and guidance != 1.0
    ctx = torch.cat([context, uncond]) if cfg_on else context
    store = KVStore(CacheConfig(codec=None, residual_window=f), num_layers=dit.num_layers, num_heads=dit.num_heads,
                    head_dim=dit.head_dim)
    missing = sorted(set(capture) - set(grid))
    if missing:
        raise ValueError(f"capture timesteps {missing} are not nodes of the ODE grid")
    out = torch.empty_like(noise)
    caps = {t: torch.empty_like(noise) for t in capture}
    dit.reset()
    with store.attach(dit.transformer):
        for s in range(0, f, fpb):
            x = noise[:, s:s + fpb].float()
            for t, t_next in zip(grid[:-1], grid[1:]):
                if t in caps:
                    caps[t][:, s:s + fpb] = x.to(noise.dtype)
                inp = torch.cat([x, x]) if cfg_on else x
                flow = dit(inp.to(dit.dtype), t, ctx, start_frame=s, mode="denoise").float()
                if cfg_on:
                    cond, unc = flow.chunk(2)
                    flow = unc + guidance * (cond - unc)
                x = x + (t_next - t) / 1000 * flow
            out[:, s:s + fpb] = x.to(noise.dtype)
            x0 = x.to(dit.dtype)
            dit(torch.cat([x0, x0]) if cfg_on else x0, 0.0, ctx, start_frame=s, mode="commit")
    return out, caps


@torch.no_grad()
def score_teacher(comps, sampler, cfg: VideoTrainConfig, *, grid: list[float], device: torch.device
                  ) -> dict[str, Any]:
    """The teacher's chunk-wise ODE rollouts (as the trajectories are made) of `cfg.teacher_eval` held-out captions,
    each from `NoiseStream(0, i)`, decoded and scored by the detector as `mmkv eval video` scores a rollout."""
    from mmkv.metrics.adherence import score_clip
    from mmkv.pipelines.common import NoiseStream
    from mmkv.pipelines.wan.evaluate import StackedNoise, _slim, summarize
    from mmkv.pipelines.wan.pipeline import WanVideoPipeline

    t0 = time.perf_counter()
    pipe = WanVideoPipeline(comps, get_preset("causvid"))
    seeds = scenes.held_out_seeds(cfg.teacher_eval)
    captions = [scenes.caption(scenes.sample_scene(s)) for s in seeds]
    s_factor = cfg.vae["scale_factor_spatial"]
    shape = (1 + (cfg.frames - 1) // cfg.vae["scale_factor_temporal"], cfg.dit["in_channels"],
             cfg.height // s_factor, cfg.width // s_factor)
    empty_ids, empty_mask = tokenize(comps.tokenizer, [""], cfg.text_len)
    scores = []
    for i in range(0, len(seeds), cfg.ode_batch):
        part = captions[i:i + cfg.ode_batch]
        ids, mask = tokenize(comps.tokenizer, part, cfg.text_len)
        context = text_states(comps.text_encoder, ids.to(device), mask.to(device))
        uncond = text_states(comps.text_encoder, empty_ids.expand(len(part), -1).to(device),
                             empty_mask.expand(len(part), -1).to(device))
        noise = StackedNoise([NoiseStream(0, i + j) for j in range(len(part))]).randn(len(part), *shape,
                                                                                       device=device)
        end, _ = ode_rollout(sampler, context.to(sampler.dtype), uncond.to(sampler.dtype), noise,
                             fpb=cfg.frames_per_block, grid=grid, guidance=cfg.guidance, capture=[])
        for seed, text, video in zip(seeds[i:], part, pipe.decode(end)):
            scores.append({"seed": seed, "prompt": text,
                           **score_clip(video, scenes.parse_caption(text), scenes.PALETTE)})
    return {"preset": "causvid", "ode_steps": len(grid) - 1, "guidance": cfg.guidance,
            "seconds": round(time.perf_counter() - t0, 2), "summary": summarize(scores),
            "clips": [_slim(s) for s in scores]}


def distill(cfg: VideoTrainConfig, dit_folder: Path, out: Path, *, device: torch.device, seed: int,
            budget_s: float | None, init: Path | None = None,
            log: Callable[[str], None] = print, step_plan: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    from mmkv.pipelines.wan.loaders import load_wan

    t_start = time.perf_counter()
    comps = load_wan(dit_folder / "causvid", dit_folder / "base", device=device, dtype=torch.float32)
    teacher, encoder, tokenizer, vae = comps.dit, comps.text_encoder, comps.tokenizer, comps.vae
    teacher.eval()
    # Trajectories come from the model as inference runs it (bf16 weights on CUDA, no autocast: the KV store takes
    # K and V of one dtype); the student trains from the fp32 weights under autocast.
    sampler = frozen_copy(teacher).to(torch.bfloat16) if device.type == "cuda" else teacher
    chunk_ts = loop_timesteps("causvid")
    frame_ts = loop_timesteps("causal-forcing-frame")
    grid = ode_grid(cfg.ode_steps, cfg.shift, chunk_ts + frame_ts + [0.0])
    s_factor = cfg.vae["scale_factor_spatial"]
    f = 1 + (cfg.frames - 1) // cfg.vae["scale_factor_temporal"]
    shape = (cfg.dit["in_channels"], cfg.height // s_factor, cfg.width // s_factor)
    gen = torch.Generator().manual_seed(seed + 20)
    noise_gen = torch.Generator(device=device).manual_seed(seed + 21)
    n_frame = int(round(cfg.ode_clips * cfg.framewise))
    n_chunk = cfg.ode_clips - n_frame
    pinned = cfg.ode_chunk_trajectories >= 0 or cfg.ode_frame_trajectories >= 0
    if pinned:  # a replay: the counts an earlier run made, each drawn as it drew them, with no time cut
        if cfg.ode_chunk_trajectories < 0 or cfg.ode_frame_trajectories < 0:
            raise ValueError("ode_chunk_trajectories and ode_frame_trajectories pin the teacher trajectories together: "
                             f"got {cfg.ode_chunk_trajectories} and {cfg.ode_frame_trajectories}; give both (>= 0)")
        n_chunk, n_frame = cfg.ode_chunk_trajectories, cfg.ode_frame_trajectories
    trajectories: dict[int, dict[str, Any]] = {}
    made: dict[int, int] = {}
    t0 = time.perf_counter()
    empty_ids, empty_mask = tokenize(tokenizer, [""], cfg.text_len)
    for fpb, n, ts in ((cfg.frames_per_block, n_chunk, chunk_ts), (1, n_frame, frame_ts)):
        if n == 0:
            continue
        ends, states, ctxs = [], {t: [] for t in ts}, []
        share = (n / cfg.ode_clips) * 0.4 * budget_s if budget_s is not None and not pinned else None
        t_kind = t_batch = time.perf_counter()
        for i in range(0, n, cfg.ode_batch):
            now = time.perf_counter()
            # out of this kind's share of the budget, or the next batch (timed as the last) would run past it:
            # train on what is there (recorded below)
            if share is not None and i and now - t_kind + (now - t_batch) > share:
                break
            t_batch = now
            m = min(cfg.ode_batch, n - i)
            seeds = training_seeds(gen, m)
            captions = [scenes.caption(scenes.sample_scene(s)) for s in seeds]
            ids, mask = tokenize(tokenizer, captions, cfg.text_len)
            with torch.no_grad():
                context = text_states(encoder, ids.to(device), mask.to(device)).float()
                uncond = text_states(encoder, empty_ids.expand(m, -1).to(device),
                                     empty_mask.expand(m, -1).to(device)).float()
                noise = torch.randn((m, f, *shape), generator=noise_gen, device=device)
                end, caps = ode_rollout(sampler, context.to(sampler.dtype), uncond.to(sampler.dtype), noise,
                                        fpb=fpb, grid=grid, guidance=cfg.guidance, capture=ts)
            keep_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            ends.append(end.to(keep_dtype))
            ctxs.append(context.to(keep_dtype))
            for t in ts:
                states[t].append(caps[t].to(keep_dtype))
        trajectories[fpb] = {"end": torch.cat(ends), "context": torch.cat(ctxs),
                             "states": {t: torch.cat(v) for t, v in states.items()}, "ts": ts}
        made[fpb] = trajectories[fpb]["end"].shape[0]
        log(f"distill: {made[fpb]} teacher trajectories with {fpb}-frame blocks ({len(grid) - 1} Euler steps, "
            f"guidance {cfg.guidance})")
    ode_seconds = time.perf_counter() - t0
    teacher_eval = None
    if cfg.teacher_eval:
        teacher_eval = score_teacher(comps, sampler, cfg, grid=grid, device=device)
        s = teacher_eval["summary"]
        log(f"distill: the teacher on {s['clips']} held-out prompts ({teacher_eval['seconds']} s): colour "
            f"{s['colour_pct']}%, shape {s['shape_pct']}%, direction {s['direction_pct']}%")
    student = (teacher if init is None else _load_release(init, device)[1]).train().requires_grad_(True)
    student.state.cache_cross_attn = False
    ema = frozen_copy(student)
    compile_blocks(student, cfg.dit_compile)
    tpf = student.tokens_per_frame(shape[1], shape[2])
    patterns = {fpb: TeacherForcing(f, fpb, tpf) for fpb in trajectories}
    train_gen = torch.Generator().manual_seed(seed + 22)

    def loss_fn(step: int) -> torch.Tensor:
        use_frame = 1 in trajectories and (cfg.frames_per_block not in trajectories
                                           or float(torch.rand(1, generator=train_gen)) < cfg.framewise)
        fpb = 1 if use_frame else cfg.frames_per_block
        traj = trajectories[fpb]
        idx = to_device(torch.randint(0, traj["end"].shape[0], (cfg.distill_batch,), generator=train_gen), device)
        x0 = traj["end"][idx].float()
        blocks = f // fpb
        pick = torch.randint(0, len(traj["ts"]), (cfg.distill_batch, blocks), generator=train_gen)
        t = to_device(torch.tensor(traj["ts"], dtype=torch.float32)[pick].repeat_interleave(fpb, dim=1), device)
        stack = torch.stack([traj["states"][ts][idx] for ts in traj["ts"]], dim=0)  # [T, B, F, C, h, w]
        choice = to_device(pick.repeat_interleave(fpb, dim=1), device)  # [B, F]
        noisy = torch.gather(stack, 0, choice[None, :, :, None, None, None].expand(1, *stack.shape[1:]))[0].float()
        flow = teacher_forced_flow(student, x0, noisy, t, traj["context"][idx].float(), patterns[fpb])
        x0_pred = noisy - (t / 1000).view(*t.shape, 1, 1, 1) * flow.float()
        return F.mse_loss(x0_pred, x0)

    remaining = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
    stats = optimise(list(student.parameters()), loss_fn, steps=cfg.distill_steps, lr=cfg.distill_lr,
                      warmup=cfg.warmup, budget_s=remaining, device=device,
                      after_step=lambda s: ema_update(ema, student, cfg.ema, s), log=log, name="distill",
                      step_plan=step_plan)
    size = write_release(out, cfg, vae=vae, encoder=encoder, tokenizer=tokenizer, dit=ema,
                         base_from=dit_folder / "base")
    note_release_size(size, log)
    return {**stats, "release_bytes": size, "ode_trajectories": {f"{k}-frame blocks": v for k, v in made.items()},
            "ode_seconds": round(ode_seconds, 2), "ode_grid": grid, "teacher_eval": teacher_eval,
            "capture_timesteps": {"causvid": chunk_ts, "causal-forcing-frame": frame_ts}}
