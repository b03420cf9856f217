"""`mmkv generate video`: render the bf16-cache reference and each codec for every prompt, resumably.

    mmkv generate video --model causvid --ckpt CKPT --base WAN_DIR --prompts prompts/prompts.txt \
        --codecs octopus:b=3,kivi:bits=2,group=32 --residual-window 1 --seed 0 --out runs/causvid

Long videos (docs/decisions.md, "Long videos"): `--window W --sink S`
rolls Self-Forcing's window (`local_attn_size` W latent frames of K/V, the block being generated and S sink frames
included; older frames are evicted) for rollouts longer than the training length. Equal memory: `--kv-budget 2GiB` gives
every codec the longest window whose measured peak KV bytes fit the budget (planned by `mmkv.cache.fit_attention_window`
before anything is loaded, checked after each rollout); the reference keeps `--window` (global when absent).

Per (prompt, variant) it writes RUN/rollouts/pNNNN/<variant>/{frames.npy, latents.safetensors, video.mp4} and last,
atomically, rollout.json, then the rollout's wall times in timings.json; a rerun skips complete rollouts. A rollout
whose latents or decoded frames hold NaN / Inf writes failed.json (with the reason) instead and the command exits 1; a
rerun tries it again. A rerun must give the same checkpoint and base files: their SHA-256 are in the manifest and in
every rollout.json, and a mismatch is refused. Under torchrun each rank takes prompts i with i % WORLD_SIZE == RANK and
writes its own RUN/manifest.rank{R}.json and RUN/timings.rank{R}.json. The reference and every codec of a prompt draw
identical noise from a private generator seeded by (seed, prompt index); its SHA-256 is recorded per rollout. One line
per rollout (seconds, KV bytes) and a summary go to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmkv.cache import KVCacheError
from mmkv.cache.flags import add_cache_arguments
from mmkv.pipelines.common import (
    REFERENCE, CodecSpec, NoiseStream, NonFiniteError, RunError, RunFolder, WriteError, atomic_path, atomic_save_npy,
    atomic_save_safetensors, check_out_dir, failure_record, item_name, nonfinite_outputs, parse_codec_list,
    parse_device, parse_size, progress, rank_info, read_prompts, rollout_line, say, sha256_file, sha256_tree, shard,
    versions,
)
from mmkv.pipelines.wan.loop import PRESETS, get_preset

FPS = 16  # CausVid / Causal Forcing export rate (CausVid autoregressive_inference.py:41-49)
FILES = {"frames": "frames.npy", "latents": "latents.safetensors", "video": "video.mp4"}
# Settings that must not change when resuming into an existing run folder.
# Checkpoint and base hashes first: another --ckpt or --base renders other videos, whatever the other settings.
IDENTITY_KEYS = ("ckpt_sha256", "base_sha256", "model", "seed", "residual_window", "frames", "height", "width",
                 "value_group", "codec_seed", "prompts_sha256", "protected_layers", "protected_units", "window", "sink",
                 "kv_budget_bytes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="PRESET",
                        help=f"inference preset: {', '.join(PRESETS)}")
    parser.add_argument("--ckpt", required=True, metavar="PATH",
                        help="CausVid / Causal Forcing / Self-Forcing checkpoint file, or a directory holding one "
                             "(model.pt)")
    parser.add_argument("--ckpt-key", default=None, metavar="KEY",
                        help="entry of the checkpoint dict to load (default: generator_ema, else generator)")
    parser.add_argument("--base", required=True, metavar="DIR",
                        help="base Wan2.1-T2V-1.3B directory (original or diffusers layout): VAE, umT5, tokenizer")
    parser.add_argument("--prompts", required=True, metavar="FILE",
                        help="text file, one prompt per line (blank lines and # comments ignored)")
    add_cache_arguments(parser, ("--codecs", "--codec", "--residual-window", "--value-group", "--reuse-decoded",
                                 "--protected-layers", "--protected-units", "--window", "--sink", "--codec-seed"),
                        units="latent frames", value_group=32)
    parser.add_argument("--kv-budget", default=None, metavar="SIZE",
                        help="equal-memory mode: each codec gets the longest window whose measured peak KV bytes fit "
                             "SIZE (e.g. 2GiB, 512MiB; a bare number is GiB); the reference keeps --window")
    parser.add_argument("--seed", type=int, default=0, help="noise seed; prompt i draws from (seed, i)")
    parser.add_argument("--frames", type=int, default=81, help="pixel frames, 1 + 4k (default 81 = 21 latent)")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--max-prompts", type=int, default=None, metavar="N", help="only the first N prompts")
    parser.add_argument("--no-cross-attn-cache", action="store_true",
                        help="recompute the text K/V on every call instead of once per rollout")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: this rank's GPU, else CPU)")
    parser.add_argument("--out", required=True, metavar="RUN", help="run folder (created; reruns resume)")


def _validate(args: argparse.Namespace) -> tuple[list[str], str, list[CodecSpec]]:
    """Everything checkable before a model is loaded or a file written: (prompts, SHA-256 of the whole prompt
    list, codecs)."""
    from mmkv.pipelines.wan.loaders import detect_layout, find_checkpoint

    preset = get_preset(args.model)
    if args.residual_window < 0:
        raise RunError(f"--residual-window must be >= 0, got {args.residual_window}")
    if args.sink < 0:
        raise RunError(f"--sink must be >= 0 latent frames, got {args.sink}")
    if args.sink and args.window is None and args.kv_budget is None:
        raise RunError("--sink needs a rolling window: give --window or --kv-budget (or keep frames native with "
                       "--protected-units)")
    if args.window is not None:
        fpb = preset.frames_per_block
        if args.window < fpb + args.sink + 1:
            raise RunError(f"--window {args.window} must be at least {fpb + args.sink + 1} latent frames: the "
                           f"{fpb}-frame block being generated, {args.sink} sink frame(s) and one past frame")
    args.kv_budget_bytes = None if args.kv_budget is None else parse_size(args.kv_budget, what="--kv-budget")
    prompts = read_prompts(args.prompts)
    # Hash the whole list, so `--max-prompts 2` now and a full run later resume into the same folder.
    prompts_sha = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
    if args.max_prompts is not None:
        if args.max_prompts < 1:
            raise RunError(f"--max-prompts must be >= 1, got {args.max_prompts}")
        prompts = prompts[: args.max_prompts]
    codecs = parse_codec_list(args.codecs, args.codec, value_group=args.value_group)
    find_checkpoint(args.ckpt)
    detect_layout(args.base)
    return prompts, prompts_sha, codecs


def _check_shapes(args: argparse.Namespace) -> dict[str, Any]:
    """Check the resolution against the base config; return the KV geometry the planner needs."""
    from mmkv.pipelines.wan.loaders import base_vae_factors, detect_layout, read_dit_config
    from mmkv.pipelines.wan.pipeline import make_grid

    base = Path(args.base)
    cfg = read_dit_config(base, detect_layout(base))
    t_factor, s_factor = base_vae_factors(base)
    grid = make_grid(args.frames, args.height, args.width, t_factor=t_factor, s_factor=s_factor,
                     patch_size=cfg["patch_size"], frames_per_block=get_preset(args.model).frames_per_block,
                     rope_max_seq_len=cfg.get("rope_max_seq_len", 1024))
    return {"num_layers": cfg["num_layers"], "num_heads": cfg["num_attention_heads"],
            "head_dim": cfg["attention_head_dim"], "tokens_per_frame": grid.tokens_per_frame,
            "latent_frames": grid.latent_frames}


def _plan_windows(args: argparse.Namespace, codecs: list[CodecSpec], protected: tuple[int, ...],
                  shape: dict[str, Any], device: torch.device) -> dict[str, dict[str, Any]]:
    """The window of every variant, in Self-Forcing's units (`window`, None = global) and the store's
    (`attention_window`, None = nothing evicted), with its planned peak KV bytes.

    Without a budget every variant rolls `--window` (or attends globally). With one, each codec gets the longest
    window whose simulated peak fits (`mmkv.cache.fit_attention_window`, codec bytes measured on `device`); the
    reference keeps `--window` and reports whether it fits.
    """
    from mmkv.cache import CacheConfig, Geometry, fit_attention_window, simulate_peak_nbytes
    from mmkv.pipelines.wan.loaders import default_device_dtype
    from mmkv.pipelines.wan.pipeline import local_attn_size, store_window

    fpb = get_preset(args.model).frames_per_block
    _, dtype = default_device_dtype(device)
    geometry = Geometry(shape["num_layers"], shape["num_heads"], shape["head_dim"], shape["tokens_per_frame"],
                        (fpb,) * (shape["latent_frames"] // fpb), batch=1, dtype=dtype)
    fixed = store_window(args.window, args.sink, fpb)
    frames = shape["latent_frames"]
    memo: dict = {}
    budget = args.kv_budget_bytes
    plans: dict[str, dict[str, Any]] = {}
    for spec in [None, *codecs]:
        cfg = CacheConfig(codec=None if spec is None else spec.preset, value_group=args.value_group,
                          residual_window=args.residual_window, protected_layers=protected,
                          protected_units=args.protected_units, seed=args.codec_seed)
        if budget is None or spec is None:
            # A window as long as the rollout (W >= frames) evicts nothing any block attends to: run the global
            # cache, which it equals bit for bit (and span codecs keep their commit spans unsplit by the sinks).
            rolls = fixed is not None and frames - fpb > args.sink + fixed
            window, shown = (fixed if rolls else None), args.window
            rolled = dataclasses.replace(cfg, attention_window=window, sink_units=args.sink if window else 0)
            peak = simulate_peak_nbytes(rolled, geometry, probe_device=device, memo=memo)
        else:
            try:
                fit = fit_attention_window(cfg, geometry, budget, sink_units=args.sink, probe_device=device,
                                           memo=memo)
            except KVCacheError as err:
                raise RunError(f"--kv-budget {args.kv_budget}: codec {spec.preset}: {err}") from None
            window, peak = fit.attention_window, fit.peak_nbytes
            shown = local_attn_size(window, args.sink if window else 0, fpb)
        plans[REFERENCE if spec is None else spec.variant] = {
            "window": shown, "attention_window": window, "sink": args.sink if window else 0,
            "planned_peak_kv_bytes": peak, "kv_budget_bytes": budget,
            "within_budget": None if budget is None else peak <= budget,
        }
    return plans


HASH_LABELS = {"ckpt_sha256": "--ckpt checkpoint", "base_sha256": "--base folder"}


def _write_mp4(path: Path, frames: np.ndarray) -> None:
    """H.264 yuv420p mp4 at 16 fps, for people (metrics read frames.npy).

    ffmpeg (imageio-ffmpeg's binary) is run directly: imageio's writer ignores ffmpeg's exit status, so a full disk
    left an unreadable file that was then moved into place. Here a failed encode, an empty file or a file that does
    not hold every frame raises `WriteError` and nothing replaces `path`.
    """
    import subprocess

    import imageio_ffmpeg

    n, h, w = frames.shape[:3]
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-v", "error", "-f", "rawvideo", "-pix_fmt", "rgb24",
           "-s", f"{w}x{h}", "-r", str(FPS), "-i", "-", "-an", "-c:v", "libx264", "-pix_fmt", "yuv420p",
           "-crf", "18", "-preset", "medium", "-movflags", "+faststart"]
    if h % 2 or w % 2:  # yuv420p needs even sizes
        cmd += ["-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2"]
    with atomic_path(path) as tmp:
        done = subprocess.run([*cmd, str(tmp)], input=np.ascontiguousarray(frames, dtype=np.uint8).tobytes(),
                              capture_output=True)
        if done.returncode != 0:  # ffmpeg reports the cause first (e.g. No space left on device), then its effects
            lines = [re.sub(r"^\[[^]]*\]\s*", "", line) for line in done.stderr.decode(errors="replace").splitlines()]
            cause = next((line for line in lines if line.strip()), "no message")
            raise WriteError(None, f"cannot write {path}: ffmpeg failed (exit status {done.returncode}): {cause}")
        _check_mp4(tmp, n, path)


def _check_mp4(tmp: Path, frames: int, path: Path) -> None:
    """Refuse an mp4 that is empty or does not hold `frames` frames (read back by ffmpeg, without decoding)."""
    import imageio_ffmpeg

    if tmp.stat().st_size == 0:
        raise WriteError(None, f"cannot write {path}: ffmpeg wrote an empty file")
    try:
        found = imageio_ffmpeg.count_frames_and_secs(str(tmp))[0]
    except (RuntimeError, OSError):  # its message is ffmpeg's whole banner: say it in one line
        raise WriteError(None, f"cannot write {path}: ffmpeg cannot read the encoded file back") from None
    if found != frames:
        raise WriteError(None, f"cannot write {path}: the encoded file holds {found} frames, not {frames}")


def run(args: argparse.Namespace) -> int:
    prompts, prompts_sha, codecs = _validate(args)
    protected = args.protected_layers
    rank, world = rank_info()
    grid_shape = _check_shapes(args)  # a resolution the VAE cannot take fails before anything is loaded or written
    device = parse_device(args.device, rank)
    check_out_dir(args.out)  # a path under a file or a read-only folder fails before anything is loaded
    from mmkv.pipelines.wan.pipeline import prompt_cleaning

    cleaning = prompt_cleaning()  # ftfy, always (a missing ftfy fails here)
    windows = _plan_windows(args, codecs, protected, grid_shape, device)  # a budget too small fails here too
    hashes = _input_hashes(args)  # a resume must render from the same checkpoint and base files
    folder = RunFolder(args.out, rank, world)
    config = {
        "kind": "video", "model": args.model, "preset": get_preset(args.model).to_dict(),
        "ckpt": str(Path(args.ckpt).resolve()), "ckpt_key": args.ckpt_key, "base": str(Path(args.base).resolve()),
        **hashes,
        "prompts_file": str(Path(args.prompts).resolve()), "prompts_sha256": prompts_sha,
        "num_prompts": len(prompts), "codecs": [c.preset for c in codecs], "residual_window": args.residual_window,
        "value_group": args.value_group, "protected_layers": list(protected), "protected_units": args.protected_units,
        "seed": args.seed, "codec_seed": args.codec_seed, "frames": args.frames, "height": args.height,
        "width": args.width, "cross_attn_cache": not args.no_cross_attn_cache, "rank": rank, "world_size": world,
        "fps": FPS, "window": args.window, "sink": args.sink, "kv_budget_bytes": args.kv_budget_bytes,
        "windows": {variant: plan for variant, plan in windows.items()}, "prompt_cleaning": cleaning,
    }
    manifest = folder.open_manifest(config, identity_keys=IDENTITY_KEYS, labels=HASH_LABELS)
    variants: list[CodecSpec | None] = [None, *codecs]
    mine = shard(len(prompts), rank, world)
    todo = [(i, spec) for i in mine for spec in variants
            if not folder.is_complete(item_name(i), REFERENCE if spec is None else spec.variant)]
    for i in mine:  # rollouts finished by an earlier run (of any rank) stay listed, if made from the same inputs
        for spec in variants:
            variant = REFERENCE if spec is None else spec.variant
            record = folder.rollout_record(item_name(i), variant)
            if record is not None:
                folder.check_identity(item_name(i), variant, record, hashes, HASH_LABELS)
                manifest.add_rollout(_manifest_entry(record), folder.rollout_timings(item_name(i), variant))
    pending = {(item_name(i), REFERENCE if spec is None else spec.variant) for i, spec in todo}
    failures = {(f["item"], f["variant"]): f for f in manifest.data.get("failures", [])
                if isinstance(f, dict) and (f.get("item"), f.get("variant")) in pending}  # failed before, retried
    manifest["failures"] = list(failures.values())
    clock = manifest.start_run({"pending": len(todo), "versions": versions()})
    manifest.save()
    if not todo:
        say(f"rank {rank}: all {len(mine) * len(variants)} rollouts already complete in {folder.root}")
        return 0

    from mmkv.pipelines.wan.loaders import load_wan
    from mmkv.pipelines.wan.pipeline import WanVideoPipeline

    components = load_wan(args.ckpt, args.base, device=device, ckpt_key=args.ckpt_key)
    pipe = WanVideoPipeline(components, get_preset(args.model))
    pipe.dit.state.cache_cross_attn = not args.no_cross_attn_cache
    grid = pipe.grid(args.frames, args.height, args.width)  # fails before any rollout on a bad resolution
    manifest["checkpoints"] = components.files
    manifest["grid"] = grid.to_dict()
    manifest["device"] = str(device)
    manifest["dtype"] = str(components.dtype)
    manifest.save()

    bar = progress(total=len(todo), desc=f"rank {rank} rollouts", rank=rank)
    contexts: dict[int, torch.Tensor] = {}
    for index, spec in todo:
        if index not in contexts:
            contexts.clear()  # todo is grouped by prompt: keep one prompt's text states at a time
            t0 = time.perf_counter()
            contexts[index] = pipe.encode_text([prompts[index]])
            text_seconds = time.perf_counter() - t0
        plan = windows[REFERENCE if spec is None else spec.variant]
        record, timings = _render(pipe, folder, grid, args, index, prompts[index], spec, contexts[index], rank,
                                  protected, plan)
        key = (record["item"], record["variant"])
        record.update(hashes)
        if record.get("status") == "failed":
            folder.write_failure(*key, record)
            failures[key] = record
            say(f"{key[0]} {key[1]}: failed: {record['error']}")
        else:
            timings["text_encode"] = text_seconds
            folder.write_rollout(*key, record, timings)  # last, atomically: marks completion
            manifest.add_rollout(_manifest_entry(record), timings)
            failures.pop(key, None)
            say(rollout_line(*key, timings["total"], record["kv_bytes"], record["peak_kv_bytes"]))
        manifest["failures"] = list(failures.values())
        manifest.save()
        bar.update(1)
    bar.close()
    clock["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    manifest.save()
    say(f"rank {rank}: {len(todo) - len(failures)} rollout(s) rendered, {len(mine) * len(variants) - len(todo)} "
        f"already complete, {len(failures)} failed, in {folder.root}")
    for f in failures.values():
        say(f"  failed: {f['item']} {f['variant']}: {f['error']}")
    return 1 if failures else 0


def _input_hashes(args: argparse.Namespace) -> dict[str, str]:
    """SHA-256 of the checkpoint file and of the base files a run reads (cached per process: the loaders reuse
    them)."""
    from mmkv.pipelines.wan.loaders import base_files, find_checkpoint

    return {"ckpt_sha256": sha256_file(find_checkpoint(args.ckpt)),
            "base_sha256": sha256_tree(args.base, base_files(args.base))}


def _render(pipe, folder: RunFolder, grid, args, index: int, prompt: str, spec: CodecSpec | None,
            context: torch.Tensor, rank: int, protected: tuple[int, ...],
            plan: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Render one rollout and write its media; returns its record (rollout.json, or a failure record) and its wall
    times (None for a failure)."""
    item = item_name(index)
    variant = REFERENCE if spec is None else spec.variant
    out_dir = folder.rollout_dir(item, variant)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".*.tmp*"):  # temp files of a run killed mid-write (SIGKILL skips their cleanup)
        stale.unlink()
    device = pipe.c.device
    store = pipe.make_store(None if spec is None else spec.preset, residual_window=args.residual_window,
                            value_group=args.value_group, seed=args.codec_seed, protected_layers=protected,
                            protected_units=args.protected_units, attention_window=plan["attention_window"],
                            sink_units=plan["sink"], reuse_decoded=args.reuse_decoded)
    noise = NoiseStream(args.seed, index)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    blocks = progress(total=grid.latent_frames // pipe.preset.frames_per_block, desc=f"{item} {variant}",
                      rank=rank, leave=False)
    t0 = time.perf_counter()
    result = pipe.generate(context, noise, store, grid, on_block=lambda b, n: blocks.update(1))
    denoise_seconds = time.perf_counter() - t0
    blocks.close()
    t1 = time.perf_counter()
    try:
        reason = nonfinite_outputs({"latents": result.latents})
        if reason:
            raise NonFiniteError(reason)
        frames = pipe.decode(result.latents)[0]
    except NonFiniteError as err:
        return failure_record("video", item, index, variant, None if spec is None else spec.preset,
                              "non-finite output", str(err), noise_sha256=noise.sha256, rank=rank), None
    decode_seconds = time.perf_counter() - t1
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    budget = args.kv_budget_bytes
    if budget is not None and spec is not None and store.peak_nbytes > budget:
        # the plan simulates this very store; a difference means a codec's bytes depend on more than the shape
        raise RuntimeError(f"{item} {variant}: the KV store peaked at {store.peak_nbytes} B, over the --kv-budget of "
                           f"{budget} B that its planned window ({plan['planned_peak_kv_bytes']} B) fitted")

    atomic_save_npy(out_dir / FILES["frames"], frames)
    atomic_save_safetensors(out_dir / FILES["latents"], {"latents": result.latents[0].float()},
                            metadata={"layout": "F,C,H,W", "item": item, "variant": variant})
    _write_mp4(out_dir / FILES["video"], frames)

    stats = store.stats()
    if spec is not None and stats["k_effective_bits"] is not None:
        # 8 (K bytes + V bytes) / (K values + V values); K and V hold the same number of values.
        effective_bits = (stats["k_effective_bits"] + stats["v_effective_bits"]) / 2
    else:
        # The native cache (or nothing encoded yet): bits of what is held, measured (16 in bf16 on GPU, 32 in fp32
        # on CPU), as `mmkv compare audio` reports it.
        effective_bits = stats.get("effective_bits")
    record = {
        "kind": "video", "item": item, "item_index": index, "text": prompt, "variant": variant,
        "preset": None if spec is None else spec.preset,
        "k_codec": None if spec is None else str(spec.k), "v_codec": None if spec is None else str(spec.v),
        "bits": None if spec is None else spec.nominal_bits, "effective_bits": effective_bits,
        "kv_bytes": store.nbytes(), "bf16_kv_bytes": store.bf16_nbytes(),
        "kv_ratio": None if stats["kv_ratio"] is None else float(stats["kv_ratio"]),
        "peak_kv_bytes": store.peak_nbytes, "noise_sha256": noise.sha256, "noise_values": noise.count,
        "window": plan["window"], "attention_window": plan["attention_window"], "sink": plan["sink"],
        "kv_budget_bytes": budget, "planned_peak_kv_bytes": plan["planned_peak_kv_bytes"],
        "within_budget": None if budget is None else store.peak_nbytes <= budget,
        "latent_frames": grid.latent_frames,
        "seed": args.seed, "model": args.model, "residual_window": args.residual_window,
        "peak_memory_bytes": peak, "rank": rank, "files": dict(FILES), "versions": versions(),
        "grid": grid.to_dict(), "dit_calls": result.calls, "cache": store.manifest(),
        "frames_shape": list(frames.shape),
    }
    timings = {"total": denoise_seconds + decode_seconds, "denoise": denoise_seconds,
               "per_block": result.block_seconds, "vae_decode": decode_seconds}
    return record, timings


def _manifest_entry(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("item", "variant", "preset", "noise_sha256", "effective_bits", "kv_bytes", "bf16_kv_bytes", "kv_ratio",
            "peak_kv_bytes", "peak_memory_bytes", "window", "kv_budget_bytes")
    entry = {k: record.get(k) for k in keys}
    entry["path"] = f"rollouts/{record['item']}/{record['variant']}"
    return entry
