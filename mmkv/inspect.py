"""`mmkv inspect kv`: what a rollout's KV cache looks like, per layer and head (kv_stats.json + kv_stats.png).

    mmkv inspect kv --model causvid --ckpt CKPT --base WAN_DIR --prompt "A red fox runs through snow." --out DIR
    mmkv inspect kv --model causvid --random-init --base WAN_DIR --prompt "A red fox" --out DIR  # random baseline
    mmkv inspect kv --model causvid --random-init --prompt "A red fox" --out DIR   # offline: the tests' tiny DiT
    mmkv inspect kv --aar AAR_DIR --clap CLAP_DIR --clip dog.wav --out DIR        # audio, as `mmkv compare audio`
    mmkv inspect kv --aar AAR_DIR --embeddings EMB.safetensors --clip-index 3 --out DIR
    mmkv inspect kv --model aar --random-init --out DIR      # offline: the tiny random AAR, a seeded random condition

The statistics, the observer and the plot live in `mmkv.kv_stats` (its docstring says what each measures).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from mmkv.cli import UsageError

from mmkv.kv_stats import (  # noqa: F401  (re-exported: mmkv.inspect.KVObserver, ...)
    channel_rms, DIGITS, first_block_mass, inspect_aar, inspect_video, KMEANS_ITERS, KMEANS_K, kmeans_residual, KMEANS_SEED, KVObserver, plot, summarize, token_norms, TOP_CHANNELS, unit_stats,
)

AUDIO_MODEL = "aar"  # --model of the audio family, for --random-init with no other audio flag
TINY_AAR = "tiny"  # the --random-init audio models: mmkv.pipelines.aar.tiny's full 16-scale schedule
AUDIO_SEED = 42  # `mmkv compare audio`'s default sampling seed
AUDIO_FLAGS = ("--aar", "--sat", "--clap", "--embeddings", "--clip", "--clips", "--clip-index")
VIDEO_ONLY = ("--prompt", "--prompts", "--frames", "--height", "--width", "--ckpt-key")


# ----------------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mmkv.pipelines.wan.loop import PRESETS

    g = parser.add_argument_group("video model (as `mmkv generate video`)")
    g.add_argument("--model", metavar="PRESET",
                   help=f"video inference preset: {', '.join(PRESETS)}; the audio flags need none ({AUDIO_MODEL!r}: "
                        "the audio family, for --random-init without other audio flags)")
    g.add_argument("--ckpt", metavar="PATH",
                   help="CausVid / Causal Forcing checkpoint file, or a directory holding one (model.pt)")
    g.add_argument("--ckpt-key", default=None, metavar="KEY",
                   help="entry of the checkpoint dict to load (default: generator_ema, else generator)")
    g.add_argument("--base", metavar="DIR",
                   help="base Wan2.1 directory (original or diffusers layout): VAE, umT5, tokenizer, DiT config")
    g.add_argument("--random-init", action="store_true",
                   help="random DiT weights (fan-in scaled, seed --init-seed) instead of --ckpt: with --base, of the "
                        "base's DiT config, text encoder and VAE (a random baseline of a trained checkpoint's "
                        "architecture); without, the tests' tiny model, built in memory (offline, no files); audio: "
                        f"the tiny random AAR + SAT ({TINY_AAR!r} of mmkv.pipelines.aar.tiny: 16 scales, 2 layers), "
                        "conditioned on --clap / --embeddings if given, else on a seeded random embedding")
    g.add_argument("--init-seed", type=int, default=0,
                   help="seed of --random-init weights and of the random audio condition (default 0)")
    g = parser.add_argument_group("audio model and conditioning (as `mmkv compare audio`)")
    from mmkv.pipelines.audio_cli import add_model_arguments

    add_model_arguments(g, g, required=False)
    g.add_argument("--clip", metavar="FILE", help="the audio clip that conditions the rollout")
    g.add_argument("--clips", nargs="+", metavar="DIR|FILE",
                   help="audio clips or folders searched recursively, in `mmkv compare audio`'s order; --clip-index "
                        "picks one (without --clips, --clip-index picks an entry of --embeddings)")
    g.add_argument("--clip-index", type=int, default=None, metavar="N", help="which of --clips (default 0)")
    g = parser.add_argument_group("rollout")
    g.add_argument("--prompt", metavar="TEXT", help="the prompt")
    g.add_argument("--prompts", metavar="FILE", help="prompt file (one a line); --index picks the line")
    g.add_argument("--index", type=int, default=0,
                   help="prompt index: the line of --prompts and the noise stream (seed, index) (default 0)")
    g.add_argument("--seed", type=int, default=None,
                   help="noise seed, as `mmkv generate video` (default 0); audio: the sampling seed, as `mmkv compare "
                        f"audio` (default {AUDIO_SEED}: the same rollout as its reference for the same clip)")
    g.add_argument("--frames", type=int, default=None,
                   help="pixel frames, 1 + 4k (default 81; --random-init without --base: 33)")
    g.add_argument("--height", type=int, default=None, help="default 480 (--random-init without --base: 32)")
    g.add_argument("--width", type=int, default=None, help="default 832 (--random-init without --base: 48)")
    g.add_argument("--device", default=None, help="torch device (default: the GPU, else CPU)")
    g = parser.add_argument_group("statistics")
    g.add_argument("--kmeans-k", type=int, default=KMEANS_K, help=f"k-means centres (default {KMEANS_K})")
    g.add_argument("--kmeans-iters", type=int, default=KMEANS_ITERS,
                   help=f"k-means Lloyd iterations (default {KMEANS_ITERS})")
    g.add_argument("--kmeans-seed", type=int, default=KMEANS_SEED, help="seed of the k-means init (default 0)")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for kv_stats.json and kv_stats.png")


def _family(args: argparse.Namespace) -> str:
    """"video" or "audio", from the flags given; mixing the two is an error."""
    video = [flag for flag in ("--ckpt", "--base") if getattr(args, flag[2:]) is not None]
    audio = [flag for flag in AUDIO_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
    if video and audio:
        raise UsageError(f"give the video flags (--ckpt / --base) or the audio flags ({', '.join(AUDIO_FLAGS)}), not "
                         f"both (got {', '.join(video + audio)})")
    if audio or args.model == AUDIO_MODEL:
        if args.model not in (None, AUDIO_MODEL):
            raise UsageError(f"--model {args.model} is a video preset; the audio flags ({', '.join(audio)}) take no "
                             f"--model")
        wrong = [flag for flag in VIDEO_ONLY if getattr(args, flag[2:].replace("-", "_")) is not None]
        if wrong:
            raise UsageError(f"{', '.join(wrong)}: video flag(s); an AAR rollout is conditioned on --clip / "
                             f"--embeddings (or, with --random-init, a random embedding)")
        return "audio"
    if args.model is None:
        raise UsageError(f"give --model PRESET for video (with --ckpt and --base, or --random-init), or the audio "
                         f"flags (--aar DIR ..., or --model {AUDIO_MODEL} --random-init)")
    return "video"


def _check_kmeans(args: argparse.Namespace) -> None:
    for name in ("kmeans_k", "kmeans_iters"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def _validate(args: argparse.Namespace) -> tuple[str, torch.device]:
    """Everything checkable before a model is built: (prompt, device)."""
    from mmkv.pipelines.common import local_device, read_prompts
    from mmkv.pipelines.wan.loop import get_preset

    get_preset(args.model)
    if args.random_init and args.ckpt:
        raise UsageError("give --ckpt or --random-init, not both")
    if not args.random_init and not (args.ckpt and args.base):
        raise UsageError("--ckpt and --base are required (or --random-init for random weights)")
    if args.ckpt:
        from mmkv.pipelines.wan.loaders import find_checkpoint

        find_checkpoint(args.ckpt)
    if args.base:
        from mmkv.pipelines.wan.loaders import detect_layout

        detect_layout(args.base)
    if (args.prompt is None) == (args.prompts is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompts FILE")
    if args.index < 0:
        raise UsageError(f"--index must be >= 0, got {args.index}")
    _check_kmeans(args)
    if args.prompts is not None:
        prompts = read_prompts(args.prompts)
        if args.index >= len(prompts):
            raise UsageError(f"--index {args.index} is past the end of {args.prompts} ({len(prompts)} prompts)")
        prompt = prompts[args.index]
    else:
        prompt = " ".join(args.prompt.split())
        if not prompt:
            raise UsageError("--prompt is empty")
    if args.device is None:
        device = local_device(0)
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise UsageError(f"--device {args.device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    return prompt, device


def _components(args: argparse.Namespace, device: torch.device):
    """WanComponents: loaded (--ckpt), random DiT on a base's config (--random-init --base), or all tiny."""
    from mmkv.pipelines.wan import loaders, tiny

    if not args.random_init:
        return loaders.load_wan(args.ckpt, args.base, device=device, ckpt_key=args.ckpt_key)
    dev, dtype = loaders.default_device_dtype(device)
    if args.base is None:
        dit = tiny.tiny_dit(seed=args.init_seed).to(device=dev, dtype=dtype)
        vae = tiny.tiny_vae(seed=args.init_seed)  # only its compression factors are read: stays fp32 on the CPU
        enc = tiny.tiny_text_encoder(seed=args.init_seed).to(device=dev, dtype=dtype)
        return loaders.WanComponents(dit, vae, tiny.tiny_tokenizer(), enc, tiny.TINY_TEXT_LEN, "in-memory", dev, dtype,
                                     {"dit_config": dict(tiny.TINY_DIT)})
    base = Path(args.base)
    layout = loaders.detect_layout(base)
    config = loaders.read_dit_config(base, layout)
    dit = loaders.build_dit(config)  # fp32 on the CPU, then drawn from the private generator, then moved
    tiny.reinit_(dit.transformer, args.init_seed, "dit")
    dit = dit.to(device=dev, dtype=dtype).eval()
    vae, _ = loaders.load_vae(base, layout, device=dev, dtype=dtype)
    tokenizer, enc, _ = loaders.load_text_encoder(base, layout, device=dev, dtype=dtype)
    return loaders.WanComponents(dit, vae, tokenizer, enc, config["text_len"], layout, dev, dtype,
                                 {"base": str(base.resolve()), "dit_config": config})


def run(args: argparse.Namespace) -> int:
    return _run_audio(args) if _family(args) == "audio" else _run_video(args)


def _run_video(args: argparse.Namespace) -> int:
    from mmkv.pipelines.common import NoiseStream
    from mmkv.pipelines.wan.loop import get_preset
    from mmkv.pipelines.wan.pipeline import WanVideoPipeline

    prompt, device = _validate(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    tiny_defaults = args.random_init and args.base is None
    frames = args.frames if args.frames is not None else (33 if tiny_defaults else 81)
    height = args.height if args.height is not None else (32 if tiny_defaults else 480)
    width = args.width if args.width is not None else (48 if tiny_defaults else 832)
    preset = get_preset(args.model)
    if args.base is not None:  # a resolution the VAE / DiT cannot take fails before anything is loaded
        from mmkv.pipelines.wan.loaders import base_vae_factors, detect_layout, read_dit_config
        from mmkv.pipelines.wan.pipeline import make_grid

        cfg = read_dit_config(Path(args.base), detect_layout(args.base))
        t_factor, s_factor = base_vae_factors(args.base)
        make_grid(frames, height, width, t_factor=t_factor, s_factor=s_factor, patch_size=cfg["patch_size"],
                  frames_per_block=preset.frames_per_block, rope_max_seq_len=cfg.get("rope_max_seq_len", 1024))
    components = _components(args, device)
    pipe = WanVideoPipeline(components, preset)
    grid = pipe.grid(frames, height, width)
    context = pipe.encode_text([prompt])
    seed = 0 if args.seed is None else args.seed
    noise = NoiseStream(seed, args.index)
    stats, _ = inspect_video(pipe, context, noise, grid, k=args.kmeans_k, iters=args.kmeans_iters,
                             seed=args.kmeans_seed)
    dit = components.dit
    model = {"preset": args.model, "weights": "random-init" if args.random_init else "checkpoint",
             "init_seed": args.init_seed if args.random_init else None, "checkpoint": components.files.get("dit"),
             "base": None if args.base is None else str(Path(args.base).resolve()), "num_layers": dit.num_layers,
             "num_heads": dit.num_heads, "head_dim": dit.head_dim, "dtype": str(components.dtype)}
    rollout = {"prompt": prompt, "index": args.index, "seed": seed, "noise_sha256": noise.sha256,
               "grid": grid.to_dict(), "frames_per_block": preset.frames_per_block,
               "blocks": grid.latent_frames // preset.frames_per_block, "device": str(device),
               "cache": "native (uncompressed), global attention; statistics over the commit passes"}
    config = {"kmeans": {"k": args.kmeans_k, "iters": args.kmeans_iters, "seed": args.kmeans_seed,
                         "init": "uniform with replacement, bf16 centres (mmkv.codecs.qvg.kmeans)"},
              "first_block": f"the first {preset.frames_per_block} latent frame(s)"}
    title = f"{args.model} ({model['weights']}), {grid.latent_frames} latent frames x {grid.tokens_per_frame} tokens"
    return _write(out, {"model": model, "rollout": rollout, "statistics": config, **stats}, title, "block")


def _write(out: Path, record: dict[str, Any], title: str, unit: str) -> int:
    """kv_stats.json and kv_stats.png in `out`, and the summary's headline numbers on stdout."""
    from mmkv.io import atomic_write_json

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "kv_stats.json", record)
    plot(record, out / "kv_stats.png", title=title, unit=unit)
    s = record["summary"]
    print(f"wrote {out / 'kv_stats.json'} and {out / 'kv_stats.png'}")
    for name in ("key.rms_max_over_median", "value.norm_max_over_median", "first_block_attention.mass",
                 "key.kmeans_residual", "value.kmeans_residual"):
        if s.get(name):
            print(f"  {name:<34} mean {s[name]['mean']:.4g}  max {s[name]['max']:.4g} at {s[name]['max_at']}")
    for row in s.get("scales", []):
        mass = row["first_scale_attention_mean"]
        print(f"  scale {row['scale']:>2} ({row['tokens']:>3} tokens): key RMS mean {row['key_rms_mean']:.4g}  "
              f"value RMS mean {row['value_rms_mean']:.4g}  "
              f"first-scale mass {'-' if mass is None else format(mass, '.4g')}")
    return 0


# ----------------------------------------------------------------------------------------------------------------
# The audio side: AAR + SAT loaded, and conditioned, as `mmkv compare audio` does


def _validate_audio(args: argparse.Namespace) -> None:
    if args.random_init and args.aar:
        raise UsageError("give --aar or --random-init, not both")
    if not args.random_init and not args.aar:
        raise UsageError("--aar DIR is required for audio (or --random-init for the tiny random AAR)")
    if args.sat and not args.aar:
        raise UsageError("--sat FILE goes with --aar DIR (the AAR it decodes for)")
    if args.clap and args.embeddings:
        raise UsageError("give --clap DIR or --embeddings PATH, not both")
    conditioned = args.clap or args.embeddings
    if not args.random_init and not conditioned:
        raise UsageError("give --clap DIR (a local laion/larger_clap_general) or --embeddings PATH")
    if args.clip and args.clips:
        raise UsageError("give --clip FILE, or --clips DIR|FILE... with --clip-index N, not both")
    if args.clip and args.clip_index is not None:
        raise UsageError("--clip-index picks one of --clips (or of --embeddings' entries); with --clip leave it out")
    if args.clip_index is not None and args.clip_index < 0:
        raise UsageError(f"--clip-index must be >= 0, got {args.clip_index}")
    if not conditioned and (args.clip or args.clips or args.clip_index is not None):
        raise UsageError("--clip / --clips / --clip-index need --clap DIR or --embeddings PATH to condition on "
                         "(--random-init alone uses a seeded random embedding)")
    if args.clap and not (args.clip or args.clips):
        raise UsageError("--clap embeds a clip: give --clip FILE (or --clips DIR|FILE... --clip-index N)")
    _check_kmeans(args)


def _audio_condition(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """(CLAP embedding [1, 512], what the rollout record says of it), through `mmkv compare audio`'s Conditioner."""
    import tempfile

    from mmkv.pipelines.aar.clap import embedding_sha256

    if not (args.clap or args.embeddings):
        from mmkv.pipelines.aar.tiny import random_condition

        cond = random_condition(1, seed=args.init_seed)
        return cond, {"item": f"random-condition-{args.init_seed}", "clip": None, "clip_index": None,
                      "conditioner": {"backend": "random (mmkv.pipelines.aar.tiny.random_condition)",
                                      "seed": args.init_seed}, "condition": {},
                      "condition_sha256": embedding_sha256(cond[0])}
    from mmkv.pipelines.audio_cli import Conditioner, _items, clip_warnings

    conditioner = Conditioner(args, device)
    names, paths = _items(argparse.Namespace(clips=[args.clip] if args.clip else args.clips, limit=None), conditioner)
    index = args.clip_index or 0
    if index >= len(names):
        where = "--clips" if args.clips else f"--embeddings {args.embeddings}"
        raise UsageError(f"--clip-index {index} is past the end of {where} ({len(names)} entries)")
    with tempfile.TemporaryDirectory() as cache:  # compare audio caches embeddings in its run folder; we keep none
        emb, info = conditioner.get(names[index], paths[index], Path(cache))
    for warning in clip_warnings(paths[index], info):
        print(f"warning: {warning}", flush=True)
    return emb[None], {"item": names[index], "clip": None if paths[index] is None else str(paths[index]),
                       "clip_index": index, "conditioner": conditioner.identity, "condition": info,
                       "condition_sha256": embedding_sha256(emb)}


def _run_audio(args: argparse.Namespace) -> int:
    from mmkv.pipelines.aar.sample import SamplingConfig
    from mmkv.pipelines.common import check_out_dir, parse_device, sha256_file

    _validate_audio(args)
    device = parse_device(args.device)
    out = check_out_dir(args.out)  # a path under a file or a read-only folder fails before any model is loaded
    if args.random_init:
        from mmkv.pipelines.aar.tiny import build_tiny

        aar, sat = build_tiny(TINY_AAR, seed=args.init_seed, device=device)
        model: dict[str, Any] = {"family": "audio", "weights": "random-init", "tiny": TINY_AAR,
                                 "init_seed": args.init_seed}
    else:
        from mmkv.pipelines.aar.loaders import load_models

        aar, sat, info = load_models(args.aar, sat=args.sat, device=device)
        model = {"family": "audio", "weights": "checkpoint", "aar_checkpoint": info["aar_path"],
                 "sat_checkpoint": info["sat_path"], "aar_sha256": sha256_file(info["aar_path"]),
                 "sat_sha256": sha256_file(info["sat_path"])}
    cond, condition = _audio_condition(args, device)
    seed = AUDIO_SEED if args.seed is None else args.seed
    stats, result = inspect_aar(aar, sat, cond, seed=seed, key=condition["item"], k=args.kmeans_k,
                                iters=args.kmeans_iters, kmeans_seed=args.kmeans_seed)
    patch_nums = list(aar.patch_nums)
    model.update({"num_layers": aar.config.depth, "num_heads": aar.config.num_heads, "head_dim": aar.config.head_dim,
                  "patch_nums": patch_nums, "dtype": str(next(aar.parameters()).dtype),
                  "aar_config": aar.config.to_dict()})
    rollout = {**condition, "seed": seed, "sampling": SamplingConfig().to_dict(), "noise_sha256": result.noise_sha256,
               "tokens_sha256": result.tokens_sha256, "scales": len(patch_nums), "tokens": sum(patch_nums),
               "device": str(device), "cache": "native (uncompressed); statistics over the commit pass of each scale "
               "(conditional and CFG-null rows pooled)"}
    config = {"kmeans": {"k": args.kmeans_k, "iters": args.kmeans_iters, "seed": args.kmeans_seed,
                         "init": "uniform with replacement, bf16 centres (mmkv.codecs.qvg.kmeans)"},
              "first_block": f"the first scale ({patch_nums[0]} token(s)); the first_block_attention entries and "
                             "each scale's first_scale_attention are the mass on its keys",
              "key_rms": "per scale and head: sqrt(mean k^2) over the scale's tokens and the head's channels "
                         "(value_rms: the same of v); AAR's cosine attention caches unit-norm keys, so key_rms is "
                         "1/sqrt(head_dim)"}
    title = (f"AAR ({model['weights']}), {len(patch_nums)} scales, {sum(patch_nums)} tokens, "
             f"condition {condition['item']}")
    return _write(out, {"model": model, "rollout": rollout, "statistics": config, **stats}, title, "scale")
