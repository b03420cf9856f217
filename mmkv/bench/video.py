"""`mmkv bench video`: the full-size causal Wan DiT (random weights) with the bf16 cache and compressed caches.

The performance check of docs/perf.md: 21 latent frames at 480x832 (60x104 latents, 1560 tokens per frame), on the
chunk-wise CausVid loop and the frame-wise Causal Forcing loop (21 one-frame blocks), every codec of the demo's list
at 2 and 4 bits (OCTOPUS, OScaR, TurboQuant-MSE, KIVI, QVG), each codec's wall time as a ratio to the bf16 cache
measured in the same process on the same loop, measured KV bytes, KV x, peak KV and peak CUDA memory. The model is
built once and serves every loop and codec; every (loop, codec) is warmed up once on a two-block rollout first, or a
full-length one with `--full-warmup` (Triton compilation stays out of the timings); each rollout is then timed
`--repeats` times and the median reported (run-to-run spread on the H200 is a few per cent; with `--paired`, each
timed codec rollout follows a baseline rollout and the ratio is the median of the pairs'). `--jobs N` compiles the
kernels beforehand in N worker processes. Random weights: the
quality columns only show that the rollouts differ, not how much a real model would. `--tiny` runs the tiny DiT on
the CPU instead (the tests: the rows, and identity bit-exact with the native cache).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmkv.cache.flags import add_cache_arguments

DEFAULT_MODELS = "causvid,causal-forcing-frame"
# The demo's codecs at 2 and 4 bits (mmkv/demo.py CODECS, without identity) and QVG at the release's 256 centres
# (the demo's trained list has 16 for its tiny spans; here a span is a 4680-token chunk or a 1560-token frame).
DEFAULT_CODECS = ("octopus:b=2;octopus:b=4;oscar:bits=2;oscar:bits=4;turboquant-mse:b=2;turboquant-mse:b=4;"
                  "kivi:bits=2,group=32;kivi:bits=4,group=32;qvg:bits=2;qvg:bits=4")
FULL_LATENT, TINY_LATENT = "60x104", "8x12"
PAIRED_HELP = ("time a baseline rollout just before each timed codec rollout and report the median of the pairs' "
               "ratios, so that a drift in the host's pace (run L, docs/perf.md) moves both sides of each ratio "
               "(one more baseline rollout per codec rollout)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODELS,
                        help=f"loop presets, comma-separated (default {DEFAULT_MODELS!r})")
    parser.add_argument("--codecs", default=DEFAULT_CODECS,
                        help=f"codec presets separated by ';' (presets contain commas; default {DEFAULT_CODECS!r})")
    parser.add_argument("--frames", default="21",
                        help="latent frames, or a comma list (e.g. 21,42 with --window: the peak stays flat)")
    parser.add_argument("--latent-size", default=None,
                        help=f"latent HxW (default {FULL_LATENT} = 480x832 pixels; {TINY_LATENT} with --tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny DiT on the CPU (or the GPU when there is one): checks the bench, times nothing "
                             "that matters")
    add_cache_arguments(parser, ("--window", "--sink", "--residual-window", "--reuse-decoded"), units="latent frames")
    parser.add_argument("--no-merge", action="store_true",
                        help="encode unit by unit (CacheConfig.merge_units=False), to time what merging saves")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rollouts per codec and frame count; the median is reported (default 3)")
    parser.add_argument("--paired", action="store_true", help=PAIRED_HELP)
    parser.add_argument("--full-warmup", action="store_true",
                        help="warm each (loop, codec) up on a rollout of the largest frame count instead of two blocks "
                             "(the first full-length rollout after a two-block warm-up ran slow in runs L and M, "
                             "docs/perf.md; costs one more full rollout per codec)")
    parser.add_argument("--profile", action="store_true",
                        help="also run one rollout per codec (largest frame count) under torch.profiler and one under "
                             "cProfile, and report GPU kernel seconds, kernel launches, host syncs and the host's "
                             "costliest ops and Python functions next to the wall time")
    parser.add_argument("--count-syncs", action="store_true",
                        help="also run one rollout per codec (largest frame count) under torch.cuda's sync debug mode "
                             "and report how many host syncs torch ops made, by source line (cheaper than --profile)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="run each block's denoising calls as a captured CUDA graph, the baseline's and every "
                             "codec's (mmkv.pipelines.wan.graphs); implies --full-warmup; each row then also runs one "
                             "eager rollout and says whether the graphed rollout's latents equal it bit for bit "
                             "(graphs_equal_eager)")
    parser.add_argument("--jobs", type=int, default=0, metavar="N",
                        help="first compile the kernels in N worker processes, one warm-up rollout of each codec on "
                             "every loop (Triton's on-disk cache), so that the timed process only loads them: a cold "
                             "compile of OCTOPUS's kernels took 80-90 s a preset (docs/perf.md, run Q); default 0")
    parser.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)  # a --jobs worker
    parser.add_argument("--json", type=Path, help="write the rows here")


def worker_argv(args: argparse.Namespace, codec: str) -> list[str]:
    """The command line of the `--jobs` worker that warms `codec` up on every loop with the bench's settings."""
    argv = [sys.executable, "-m", "mmkv.cli", "bench", "video", "--warm-only", "--model", args.model,
            "--codecs", codec, "--frames", args.frames, "--residual-window", str(args.residual_window)]
    for flag, value in (("--latent-size", args.latent_size), ("--window", args.window), ("--sink", args.sink)):
        if value is not None:
            argv += [flag, str(value)]
    for flag, on in (("--tiny", args.tiny), ("--full-warmup", args.full_warmup), ("--no-merge", args.no_merge),
                     ("--reuse-decoded", args.reuse_decoded), ("--cuda-graphs", args.cuda_graphs)):
        if on:
            argv.append(flag)
    return argv


def precompile(args: argparse.Namespace, codecs: list[str], log=print) -> list[str]:
    """Run the `--jobs` workers, at most args.jobs at a time; returns the codecs whose worker failed (the timed
    process then compiles and reports them itself)."""
    t0 = time.perf_counter()
    todo, running, failed = list(codecs), [], []
    while todo or running:
        while todo and len(running) < args.jobs:
            codec = todo.pop(0)
            output = tempfile.TemporaryFile()  # not a pipe: a chatty worker must not block on a full one
            running.append((codec, subprocess.Popen(worker_argv(args, codec), stdout=output,
                                                    stderr=subprocess.STDOUT), output))
        for codec, proc, output in list(running):
            if proc.poll() is None:
                continue
            running.remove((codec, proc, output))
            output.seek(0)
            tail = output.read().decode(errors="replace")[-2000:]
            output.close()
            if proc.returncode:
                failed.append(codec)
                log(f"[warm] {codec}: worker failed (exit {proc.returncode}):\n{tail}")
            else:
                log(f"[warm] {codec}: compiled ({time.perf_counter() - t0:.0f} s)")
        time.sleep(0.1)
    log(f"[warm] {len(codecs)} codecs in {time.perf_counter() - t0:.0f} s with {args.jobs} workers; failed: "
        f"{', '.join(failed) or 'none'}")
    return failed


def _codecs(text: str) -> list[str]:
    return [c.strip() for c in text.split(";") if c.strip()]


def _models(text: str) -> list[str]:
    from mmkv.pipelines.wan.loop import get_preset

    names = [m.strip() for m in str(text).split(",") if m.strip()]
    if not names:
        raise ValueError(f"--model must name at least one loop preset, got {text!r}")
    return [get_preset(n).name for n in names]  # an unknown name fails here, before the model is built


def _latent(text: str | None, tiny: bool) -> tuple[int, int]:
    text = text or (TINY_LATENT if tiny else FULL_LATENT)
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        h = w = 0
    if h < 1 or w < 1:
        raise ValueError(f"--latent-size must be HxW with positive ints (e.g. {FULL_LATENT}), got {text!r}")
    return h, w


def _model(tiny: bool, dev):
    """(the causal DiT, its text context, heads, head dim, layers, the cache dtype)."""
    import torch

    from mmkv.pipelines.wan.model import CausalWan

    if tiny:
        from mmkv.pipelines.wan.tiny import TINY_DIT, TINY_TEXT_LEN, tiny_dit

        cfg, dit, text_len, dtype = TINY_DIT, tiny_dit(seed=3).to(dev), TINY_TEXT_LEN, torch.float32
    else:
        from diffusers import WanTransformer3DModel

        from mmkv.pipelines.wan.loaders import WAN21_T2V_1_3B

        cfg = {k: v for k, v in WAN21_T2V_1_3B.items() if k != "text_len"}
        with torch.random.fork_rng(devices=[]):  # diffusers' default init, seeded, leaving the global RNG alone
            torch.manual_seed(0)
            model = WanTransformer3DModel(**cfg)
        dit, text_len, dtype = CausalWan(model).to(dev, torch.bfloat16), 512, torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    ctx = (torch.randn(1, text_len, cfg["text_dim"], generator=g) * 0.5).to(dev, dtype)
    return dit.eval(), ctx, cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["num_layers"]


def run(args: argparse.Namespace) -> int:
    import torch

    from mmkv.cache import CacheConfig, KVStore
    from mmkv.pipelines.common import NoiseStream
    from mmkv.pipelines.wan.loop import get_preset, rollout

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise ValueError("mmkv bench video needs a CUDA GPU (the full-size 1.3B model in bf16); --tiny runs the tiny "
                         "DiT on the CPU")
    if args.cuda_graphs and not cuda:
        raise ValueError("mmkv bench video --cuda-graphs needs a CUDA GPU; run without --cuda-graphs on the CPU")
    h, w = _latent(args.latent_size, args.tiny)
    models, codecs, frame_counts = _models(args.model), _codecs(args.codecs), _frames(args.frames)
    if args.jobs < 0:
        raise ValueError(f"--jobs must be a worker count >= 0, got {args.jobs}")
    dev = torch.device("cuda" if cuda else "cpu")
    # graphed calls of a block run eagerly the first time the process meets them (pipelines/wan/graphs.py): a
    # two-block warm-up would leave that to the first timed rollout
    full_warmup = args.full_warmup or args.cuda_graphs
    began = time.perf_counter()
    if args.jobs and not args.warm_only:
        precompile(args, codecs)
    dit, ctx, heads, head_dim, layers = _model(args.tiny, dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def one(preset, codec: str | None, frames: int, graphs: bool = args.cuda_graphs) -> dict:
        store = KVStore(CacheConfig(codec=codec, residual_window=args.residual_window,
                                    reuse_decoded=args.reuse_decoded, attention_window=args.window,
                                    sink_units=args.sink, merge_units=not args.no_merge), num_layers=layers,
                        num_heads=heads, head_dim=head_dim)
        sync()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0  # the model, the text context and the baseline latents
        t0 = time.perf_counter()
        with torch.no_grad(), store.attach(dit.transformer):
            r = rollout(dit, preset, ctx, NoiseStream(0, 0), num_frames=frames, latent_height=h, latent_width=w,
                        cuda_graphs=graphs)
        sync()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        # the store's figures, not the store: a held store (the bf16 baseline's 5.6 GiB) would inflate the next
        # rollouts' CUDA peaks
        return {"seconds": time.perf_counter() - t0, "latents": r.latents.float(), "kv_bytes": store.nbytes(),
                "bf16_kv_bytes": store.bf16_nbytes(), "kv_ratio": store.kv_ratio, "stats": store.stats(),
                "peak_kv_bytes": store.peak_nbytes, "peak_cuda": peak,
                "peak_cuda_over_model": None if peak is None else peak - before,
                "calls": r.calls, "graph_replays": r.graph_replays}

    if args.warm_only:  # a --jobs worker: each codec's warm-up rollout on every loop, nothing timed
        for name in models:
            preset = get_preset(name)
            for codec in codecs:
                one(preset, codec, max(frame_counts) if full_warmup else preset.frames_per_block * 2)
        return 0
    rows = []
    for name in models:
        preset = get_preset(name)
        bases: dict[int, dict] = {}
        for codec in [None, *codecs]:
            try:
                warm = time.perf_counter()
                warm_frames = max(frame_counts) if full_warmup else preset.frames_per_block * 2
                one(preset, codec, warm_frames)  # warm-up: kernel compilation, allocator
                warm = time.perf_counter() - warm
                for frames in frame_counts:
                    runs, paired = timed(lambda: one(preset, codec, frames), args.repeats,
                                         lambda: one(preset, None, frames) if args.paired and codec else None)
                    res = runs[0]
                    res["all_seconds"] = [r["seconds"] for r in runs]
                    res["paired_base_seconds"] = paired
                    res["warmup_s"], warm = warm, 0.0  # the warm-up is counted in the first frame count's row
                    res["warmup_frames"] = warm_frames
                    res["seconds"] = statistics.median(res["all_seconds"])
                    if args.cuda_graphs:  # the same rollout without graphs: are the kernels' outputs the eager ones?
                        eager = one(preset, codec, frames, graphs=False)
                        res["graphs_equal_eager"] = bool(torch.equal(eager["latents"], res["latents"]))
                        res["eager_seconds"] = eager["seconds"]  # one rollout, after the timed ones: a rough gauge
                        del eager
                    del runs
                    if codec is None:
                        bases[frames] = res
                    rows.append(_row(preset.name, codec, frames, f"{h}x{w}", args, res, bases[frames]))
                    save_rows(args.json, rows)  # as each row lands: a call cut by its time limit keeps them
                    print(f"{preset.name} {rows[-1]['codec']}: {frames} frames {res['seconds']:.2f} s "
                          f"x{rows[-1]['ratio_to_bf16']:.2f} (warm-up {res['warmup_s']:.1f} s)"
                          + (f"; {res['graph_replays']} of {res['calls']} calls replayed, equal to eager: "
                             f"{res['graphs_equal_eager']} (eager rollout {res['eager_seconds']:.2f} s)"
                             if args.cuda_graphs else ""), flush=True)
                    del res
                if args.count_syncs and cuda:
                    rows[-1]["syncs"] = count_syncs(lambda: one(preset, codec, frame_counts[-1]))
                    print(f"  syncs: {rows[-1]['syncs']}", flush=True)
                if args.profile:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        wall = one(preset, codec, frame_counts[-1])["seconds"]
                    rows[-1]["profile"] = {"wall_s": round(wall, 3), **profile_summary(prof.key_averages()),
                                           **python_profile(lambda: one(preset, codec, frame_counts[-1]))}
                    print(f"  profiled: { {k: v for k, v in rows[-1]['profile'].items() if k != 'kernels'} }",
                          flush=True)
            except Exception:  # noqa: BLE001 - one failing codec must not lose the others' rows
                if codec is None:
                    raise
                import traceback

                print(f"FAILED {name} {codec}:\n{traceback.format_exc()}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
    where = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Wan 1.3B random weights" if not args.tiny
             else f"{dev.type}, torch {torch.__version__}, tiny DiT")
    print(table(rows, f"{where}, {', '.join(models)}, latent {h}x{w}, window {args.window or 'global'}, "
                      f"sink {args.sink}; {time.perf_counter() - began:.0f} s in all"))
    if args.cuda_graphs:
        from mmkv.pipelines.wan.graphs import FAILED

        reasons = sorted(set(FAILED.values()))
        print(f"CUDA graph captures that failed (those calls ran eagerly): {len(FAILED)}"
              + "".join(f"\n  {r[:300]}" for r in reasons[:5]))
    save_rows(args.json, rows)
    return 0


def timed(run, repeats: int, baseline) -> tuple[list[dict], list[float] | None]:
    """`repeats` (at least 1) results of `run()`; where `baseline()` returns a result (`--paired`), it runs just
    before each, and its seconds come back beside them (else None)."""
    runs, base = [], []
    for _ in range(max(1, repeats)):
        b = baseline()
        if b is not None:
            base.append(b["seconds"])
        runs.append(run())
    return runs, (base or None)


def ratio(res: dict, base: dict) -> float:
    """A result's time over its baseline's: the median of the paired rollouts' ratios where they were paired
    (`timed`), else the ratio of the medians."""
    paired = res.get("paired_base_seconds")
    if paired:
        return statistics.median(t / b for t, b in zip(res["all_seconds"], paired))
    return res["seconds"] / base["seconds"]


def save_rows(path: Path | None, rows: list[dict]) -> None:
    """The rows so far, written atomically to `path` (if given); `bench video` and `bench audio` call it after
    every row."""
    if path is not None:
        from mmkv.io import atomic_write_json

        atomic_write_json(path, rows)


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


def python_profile(fn, top: int = 12) -> dict:
    """Where the host's Python went while `fn` ran (`cProfile`, one more rollout): its own time (`tottime`, callees
    excluded) by Python function, the costliest `top` as "folder/file:line function", and its total beside the time
    in C functions (torch's ops and launches, Triton's driver calls). The torch profiler's host ops do not show the
    Python between them: the store's bookkeeping, the codecs' checks, Triton's launcher."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, ncalls, tottime, cumtime, callers)}
    py = {(f, line, name): v for (f, line, name), v in stats.items() if f != "~"}
    costly = sorted(py.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {
        "python_s": round(sum(v[2] for v in py.values()), 3),
        "c_functions_s": round(sum(v[2] for k, v in stats.items() if k[0] == "~"), 3),
        "python_top_ms": {f"{Path(f).parent.name}/{Path(f).name}:{line} {name}"[:80]: round(v[2] * 1e3, 1)
                          for (f, line, name), v in costly},
        "python_top_calls": {f"{Path(f).parent.name}/{Path(f).name}:{line} {name}"[:80]: v[1]
                             for (f, line, name), v in costly},
    }


def profile_summary(events) -> dict:
    """What a profiled rollout spent, from `torch.profiler` key averages: GPU kernel seconds, kernel launches (all,
    and Triton's `cuLaunchKernelEx`), host synchronisations (stream/device/event syncs), the top kernels by time
    and the most launched ones."""
    def device_time(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    count = {k: sum(e.count for e in events if e.key == k) for k in
             ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaStreamSynchronize",
              "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc", "cudaFree")}
    host = [e for e in events if not str(getattr(e, "device_type", "")).endswith("CUDA")]
    top = sorted(kernels, key=device_time, reverse=True)[:5]
    launched = sorted(kernels, key=lambda e: e.count, reverse=True)[:8]
    return {
        "gpu_kernel_s": round(sum(device_time(e) for e in kernels) / 1e6, 3),
        "launches": count["cudaLaunchKernel"] + count["cuLaunchKernelEx"] + count["cudaLaunchKernelExC"],
        "triton_launches": count["cuLaunchKernelEx"],
        "host_syncs": count["cudaStreamSynchronize"] + count["cudaDeviceSynchronize"] + count["cudaEventSynchronize"],
        "top_kernels_ms": {e.key[:60]: round(device_time(e) / 1e3, 1) for e in top},
        # the 40 costliest kernels with their launch counts, in the JSON only: a codec's row minus the baseline's
        # says which kernels its excess GPU time is (the codecs' own kernels are rarely among the top five)
        "kernels": {e.key[:80]: [round(device_time(e) / 1e3, 2), e.count]
                    for e in sorted(kernels, key=device_time, reverse=True)[:40]},
        "most_launched": {e.key[:60]: e.count for e in launched},  # which kernels a codec's extra launches are
        # where the host's time went, when the wall is well above the GPU's kernel time: the ops with the most
        # self CPU time, and the allocator's device mallocs and frees (a cudaFree waits for the device)
        "host_top_ms": {e.key[:60]: round(e.self_cpu_time_total / 1e3, 1)
                        for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]},
        "cuda_mallocs": count["cudaMalloc"], "cuda_frees": count["cudaFree"],
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
        "seconds": round(res["seconds"], 3), "ratio_to_bf16": round(ratio(res, base), 3),
        "all_seconds": [round(x, 3) for x in res.get("all_seconds", [res["seconds"]])],
        "paired_bf16_seconds": [round(x, 3) for x in res.get("paired_base_seconds") or []] or None,
        "warmup_s": round(res.get("warmup_s", 0.0), 3), "warmup_frames": res.get("warmup_frames"),
        "kv_bytes": res["kv_bytes"], "bf16_kv_bytes": res["bf16_kv_bytes"], "kv_ratio": round(kvx, 3),
        "k_bits": s.get("k_effective_bits"), "v_bits": s.get("v_effective_bits"),
        "peak_kv_bytes": res["peak_kv_bytes"], "peak_cuda_bytes": res["peak_cuda"],
        "peak_cuda_over_model_bytes": res["peak_cuda_over_model"],
        "bf16_kv_over_kvx": int(base["peak_kv_bytes"] / kvx) if kvx else None,
        "rel_latent_diff": round(err, 4), "bit_exact": bool((res["latents"] == base["latents"]).all()),
        "cuda_graphs": bool(getattr(args, "cuda_graphs", False)), "calls": res.get("calls"),
        "graph_replays": res.get("graph_replays"), "graphs_equal_eager": res.get("graphs_equal_eager"),
        "eager_seconds": None if res.get("eager_seconds") is None else round(res["eager_seconds"], 3),
    }


def table(rows: list[dict], title: str) -> str:
    """The rows as Markdown through the project's one table writer."""
    from mmkv.report.tables import Column, Table, to_markdown

    mib, gib = 2.0**20, 2.0**30
    cols = [Column("model", ("loop",)), Column("codec", ("codec",)), Column("frames", ("frames",)),
            Column("seconds", ("s",), "{:.2f}"),
            Column("ratio_to_bf16", ("x bf16 cache",), "{:.2f}"), Column("kv_mib", ("KV MiB",), "{:.0f}"),
            Column("kv_ratio", ("KVx",), "{:.2f}"), Column("peak_kv_mib", ("peak KV MiB",), "{:.0f}"),
            Column("bound_mib", ("bf16 KV / KVx MiB",), "{:.0f}"),
            Column("peak_cuda_gib", ("peak CUDA GiB",), "{:.2f}"),
            Column("peak_over_model_gib", ("peak CUDA over model GiB",), "{:.2f}"),
            Column("rel_latent_diff", ("rel. latent diff",), "{:.3f}")]
    body = [[r.get("model", ""), r["codec"], r["frames"], r["seconds"], r["ratio_to_bf16"], r["kv_bytes"] / mib,
             r["kv_ratio"], r["peak_kv_bytes"] / mib, r["bf16_kv_over_kvx"] / mib, _per(r.get("peak_cuda_bytes"), gib),
             _per(r.get("peak_cuda_over_model_bytes"), gib), r["rel_latent_diff"]] for r in rows]
    return to_markdown(Table("bench_video", title, cols, body))


def _per(value: float | None, unit: float) -> float:
    """value / unit, NaN where nothing was measured (CUDA peaks of a CPU run)."""
    return float("nan") if value is None else value / unit
