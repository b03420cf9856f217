"""`mmkv bench video`: the full-size causal Wan DiT (random weights) with the bf16 cache and compressed caches.

Issue 4's performance check: 21 latent frames at 480x832 (60x104 latents, 1560 tokens per frame), each codec's wall time
as a ratio to the bf16 cache measured in the same process, measured KV bytes, KV x, peak KV and peak CUDA memory.
Every codec is warmed up once on a short rollout first (Triton compilation stays out of the timings); each
rollout is then timed `--repeats` times and the median reported (run-to-run spread on the H200 is a few per
cent). Random weights:
the quality columns only show that the rollouts differ, not how much a real model would.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mmkv.cache.flags import add_cache_arguments

DEFAULT_CODECS = "octopus:b=2;oscar:bits=2,group=32;turboquant-mse:b=2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="causvid", help="loop preset (default causvid)")
    parser.add_argument("--codecs", default=DEFAULT_CODECS,
                        help=f"codec presets separated by ';' (presets contain commas; default {DEFAULT_CODECS!r})")
    parser.add_argument("--frames", default="21",
                        help="latent frames, or a comma list (e.g. 21,42 with --window: the peak stays flat)")
    parser.add_argument("--latent-size", default="60x104", help="latent HxW (default 60x104 = 480x832 pixels)")
    add_cache_arguments(parser, ("--window", "--sink", "--residual-window", "--reuse-decoded"), units="latent frames")
    parser.add_argument("--no-merge", action="store_true",
                        help="encode unit by unit (CacheConfig.merge_units=False), to time what merging saves")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rollouts per codec and frame count; the median is reported (default 3)")
    parser.add_argument("--profile", action="store_true",
                        help="also run one rollout per codec (largest frame count) under torch.profiler and report GPU "
                             "kernel seconds, kernel launches and host syncs next to the wall time")
    parser.add_argument("--count-syncs", action="store_true",
                        help="also run one rollout per codec (largest frame count) under torch.cuda's sync debug mode "
                             "and report how many host syncs torch ops made, by source line (cheaper than --profile)")
    parser.add_argument("--json", type=Path, help="write the rows here")


def _codecs(text: str) -> list[str]:
    return [c.strip() for c in text.split(";") if c.strip()]


def run(args: argparse.Namespace) -> int:
    import torch
    from diffusers import WanTransformer3DModel

    from mmkv.cache import CacheConfig, KVStore
    from mmkv.pipelines.common import NoiseStream
    from mmkv.pipelines.wan.loaders import WAN21_T2V_1_3B
    from mmkv.pipelines.wan.loop import get_preset, rollout
    from mmkv.pipelines.wan.model import CausalWan

    if not torch.cuda.is_available():
        raise ValueError("mmkv bench video needs a CUDA GPU (the full-size 1.3B model in bf16)")
    h, w = (int(x) for x in args.latent_size.lower().split("x"))
    dev = torch.device("cuda")
    cfg = {k: v for k, v in WAN21_T2V_1_3B.items() if k != "text_len"}
    with torch.random.fork_rng(devices=[]):  # diffusers' default init, seeded, leaving the global RNG alone
        torch.manual_seed(0)
        model = WanTransformer3DModel(**cfg)
    dit = CausalWan(model).to(dev, torch.bfloat16).eval()
    g = torch.Generator(device="cpu").manual_seed(0)
    ctx = (torch.randn(1, 512, 4096, generator=g) * 0.5).to(dev, torch.bfloat16)
    preset = get_preset(args.model)
    heads, head_dim, layers = cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["num_layers"]

    def one(codec: str | None, frames: int) -> dict:
        store = KVStore(CacheConfig(codec=codec, residual_window=args.residual_window,
                                    reuse_decoded=args.reuse_decoded, attention_window=args.window,
                                    sink_units=args.sink, merge_units=not args.no_merge), num_layers=layers,
                        num_heads=heads, head_dim=head_dim)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()  # the model, the text context and the baseline latents kept
        t0 = time.perf_counter()
        with torch.no_grad(), store.attach(dit.transformer):
            r = rollout(dit, preset, ctx, NoiseStream(0, 0), num_frames=frames, latent_height=h, latent_width=w)
        torch.cuda.synchronize()
        # the store's figures, not the store: a held store (the bf16 baseline's 5.6 GiB) would inflate the next
        # rollouts' CUDA peaks
        return {"seconds": time.perf_counter() - t0, "latents": r.latents.float(), "kv_bytes": store.nbytes(),
                "bf16_kv_bytes": store.bf16_nbytes(), "kv_ratio": store.kv_ratio, "stats": store.stats(),
                "peak_kv_bytes": store.peak_nbytes, "peak_cuda": torch.cuda.max_memory_allocated(),
                "peak_cuda_over_model": torch.cuda.max_memory_allocated() - before}

    fpb = preset.frames_per_block
    bases: dict[int, dict] = {}
    rows = []
    frame_counts = _frames(args.frames)
    for codec in [None, *_codecs(args.codecs)]:
        try:
            one(codec, fpb * 2)  # warm-up: kernel compilation, allocator
            for frames in frame_counts:
                runs = [one(codec, frames) for _ in range(max(1, args.repeats))]
                res = runs[0]
                res["all_seconds"] = [r["seconds"] for r in runs]
                res["seconds"] = statistics.median(res["all_seconds"])
                del runs
                if codec is None:
                    bases[frames] = res
                rows.append(_row(preset.name, codec, frames, f"{h}x{w}", args, res, bases[frames]))
                print(f"{rows[-1]['codec']}: {frames} frames {res['seconds']:.2f} s "
                      f"x{rows[-1]['ratio_to_bf16']:.2f}", flush=True)
                del res
            if args.count_syncs:
                rows[-1]["syncs"] = count_syncs(lambda: one(codec, frame_counts[-1]))
                print(f"  syncs: {rows[-1]['syncs']}", flush=True)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    wall = one(codec, frame_counts[-1])["seconds"]
                rows[-1]["profile"] = {"wall_s": round(wall, 3), **profile_summary(prof.key_averages())}
                print(f"  profiled: {rows[-1]['profile']}", flush=True)
        except Exception:  # noqa: BLE001 - one failing codec must not lose the others' rows
            if codec is None:
                raise
            import traceback

            print(f"FAILED {codec}:\n{traceback.format_exc()}", flush=True)
        torch.cuda.empty_cache()
    print(table(rows, f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Wan 1.3B random weights, "
                      f"{preset.name}, latent {h}x{w}, window {args.window or 'global'}, sink {args.sink}"))
    if args.json:
        from mmkv.io import atomic_write_json

        atomic_write_json(args.json, rows)
    return 0


def count_syncs(fn) -> dict:
    """Host syncs made by torch ops while `fn` runs (`torch.cuda.set_sync_debug_mode`: .item(), .tolist(), host
    copies, blocking host-to-device copies from pageable memory...), in total and by the source line that made
    them (top 8). Triton launches never sync; explicit `torch.cuda.synchronize()` calls are not counted."""
    import collections
    import warnings

    import torch

    lines: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            lines[f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"] += 1
    return {"total": sum(lines.values()), "by_line": dict(lines.most_common(8))}


def profile_summary(events) -> dict:
    """What a profiled rollout spent, from `torch.profiler` key averages: GPU kernel seconds, kernel launches (all,
    and Triton's `cuLaunchKernelEx`), host synchronisations (stream/device/event syncs) and the top kernels."""
    def device_time(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    count = {k: sum(e.count for e in events if e.key == k) for k in
             ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaStreamSynchronize",
              "cudaDeviceSynchronize", "cudaEventSynchronize")}
    top = sorted(kernels, key=device_time, reverse=True)[:5]
    return {
        "gpu_kernel_s": round(sum(device_time(e) for e in kernels) / 1e6, 3),
        "launches": count["cudaLaunchKernel"] + count["cuLaunchKernelEx"] + count["cudaLaunchKernelExC"],
        "triton_launches": count["cuLaunchKernelEx"],
        "host_syncs": count["cudaStreamSynchronize"] + count["cudaDeviceSynchronize"] + count["cudaEventSynchronize"],
        "top_kernels_ms": {e.key[:60]: round(device_time(e) / 1e3, 1) for e in top},
    }


def _frames(text: str) -> list[int]:
    try:
        frames = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        frames = []
    if not frames or min(frames) < 1:
        raise ValueError(f"--frames must be a positive int or a comma list of them, got {text!r}")
    return frames


def _row(model: str, codec: str | None, frames: int, latent: str, args, res: dict, base: dict) -> dict:
    err = float((res["latents"] - base["latents"]).norm() / base["latents"].norm())
    s, kvx = res["stats"], res["kv_ratio"]
    return {
        "model": model, "codec": codec or "bf16 cache", "frames": frames, "latent": latent,
        "window": args.window, "sink": args.sink, "reuse_decoded": bool(args.reuse_decoded),
        "merge_units": not args.no_merge,
        "seconds": round(res["seconds"], 3), "ratio_to_bf16": round(res["seconds"] / base["seconds"], 3),
        "all_seconds": [round(x, 3) for x in res.get("all_seconds", [res["seconds"]])],
        "kv_bytes": res["kv_bytes"], "bf16_kv_bytes": res["bf16_kv_bytes"], "kv_ratio": round(kvx, 3),
        "k_bits": s.get("k_effective_bits"), "v_bits": s.get("v_effective_bits"),
        "peak_kv_bytes": res["peak_kv_bytes"], "peak_cuda_bytes": res["peak_cuda"],
        "peak_cuda_over_model_bytes": res["peak_cuda_over_model"],
        "bf16_kv_over_kvx": int(base["peak_kv_bytes"] / kvx) if kvx else None,
        "rel_latent_diff": round(err, 4),
    }


def table(rows: list[dict], title: str) -> str:
    """The rows as Markdown through the project's one table writer."""
    from mmkv.report.tables import Column, Table, to_markdown

    mib, gib = 2.0**20, 2.0**30
    cols = [Column("codec", ("codec",)), Column("frames", ("frames",)), Column("seconds", ("s",), "{:.2f}"),
            Column("ratio_to_bf16", ("x bf16 cache",), "{:.2f}"), Column("kv_mib", ("KV MiB",), "{:.0f}"),
            Column("kv_ratio", ("KVx",), "{:.2f}"), Column("peak_kv_mib", ("peak KV MiB",), "{:.0f}"),
            Column("bound_mib", ("bf16 KV / KVx MiB",), "{:.0f}"),
            Column("peak_cuda_gib", ("peak CUDA GiB",), "{:.2f}"),
            Column("peak_over_model_gib", ("peak CUDA over model GiB",), "{:.2f}"),
            Column("rel_latent_diff", ("rel. latent diff",), "{:.3f}")]
    body = [[r["codec"], r["frames"], r["seconds"], r["ratio_to_bf16"], r["kv_bytes"] / mib, r["kv_ratio"],
             r["peak_kv_bytes"] / mib, r["bf16_kv_over_kvx"] / mib, r["peak_cuda_bytes"] / gib,
             r.get("peak_cuda_over_model_bytes", float("nan")) / gib, r["rel_latent_diff"]] for r in rows]
    return to_markdown(Table("bench_video", title, cols, body))
