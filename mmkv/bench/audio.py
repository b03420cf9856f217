"""`mmkv bench audio`: the full-size AAR (d16) with SAT (random weights) with the native cache and compressed caches.

The audio half of docs/perf.md's performance check, measured as `mmkv bench video` measures video: one clip of 1 s
(AAR's 16 scales, L = 455 tokens, CFG doubling the batch), the transformer blocks and their KV cache in bf16, every
codec of the demo's list (OCTOPUS, OScaR, TurboQuant-MSE, KIVI at 2 and 4 bits, QVG with the demo's 16 centres)
through the kernels on CUDA; each codec's wall time (sampling and the SAT decode) as a ratio to the native cache's in
the same process, measured KV bytes, KV x, peak KV and peak CUDA memory. The models are built once; each codec is
warmed up on one rollout (Triton compilation stays out of the timings), then timed `--repeats` times and the median
reported (with `--paired`, each after a native-cache rollout, the ratio the median of the pairs'). Random weights
(the tiny models' init, so attention matters): the token agreement only shows that the rollouts differ. `--tiny` runs
the micro AAR on the CPU (the tests: the rows, and identity bit-exact with the native cache).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mmkv.bench.video import PAIRED_HELP, profile_summary, python_profile, ratio, save_rows, timed
from mmkv.cache.flags import add_cache_arguments

# The demo's codecs for the trained models without identity (mmkv/demo.py TRAINED_CODECS): QVG with 16 centres a
# span, since a span here is one scale of at most 75 tokens.
DEFAULT_CODECS = ("octopus:b=2;octopus:b=4;oscar:bits=2;oscar:bits=4;turboquant-mse:b=2;turboquant-mse:b=4;"
                  "kivi:bits=2,group=32;kivi:bits=4,group=32;qvg:bits=2,centroids=16;qvg:bits=4,centroids=16")
DTYPES = ("bf16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--codecs", default=DEFAULT_CODECS,
                        help=f"codec presets separated by ';' (presets contain commas; default {DEFAULT_CODECS!r})")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="the transformer blocks' and KV cache's dtype (default bf16; the head and SAT stay fp32)")
    parser.add_argument("--tiny", action="store_true",
                        help="the micro AAR + SAT (4 scales, depth 2) on the CPU (or the GPU when there is one): "
                             "checks the bench, times nothing that matters")
    add_cache_arguments(parser, ("--residual-window", "--reuse-decoded"), units="scales")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rollouts per codec; the median is reported (default 3)")
    parser.add_argument("--paired", action="store_true", help=PAIRED_HELP)
    parser.add_argument("--profile", action="store_true",
                        help="also run one rollout per codec under torch.profiler and one under cProfile, and report "
                             "GPU kernel seconds, launches, host syncs, the host's costliest ops and its costliest "
                             "Python functions next to the wall time (as bench video)")
    parser.add_argument("--json", type=Path, help="write the rows here")


def _codecs(text: str) -> list[str]:
    return [c.strip() for c in text.split(";") if c.strip()]


def _models(tiny: bool, dev):
    """(AAR, SAT) with random weights, drawn on the CPU from private generators as the tiny models are."""
    from mmkv.codecs.base import private_generator
    from mmkv.pipelines.aar.model import AARConfig, build_aar
    from mmkv.pipelines.aar.sat import SATConfig, build_sat
    from mmkv.pipelines.aar.tiny import build_tiny

    if tiny:
        return build_tiny("micro", seed=0, device=dev)
    aar = build_aar(AARConfig(), "meta").to_empty(device="cpu")
    aar.init_weights(private_generator(0, "bench-aar"), init_adaln=0.5, init_adaln_gamma=1.0, init_head=1.0)
    sat = build_sat(SATConfig(), "meta").to_empty(device="cpu")
    sat.init_weights(private_generator(0, "bench-sat"))
    return aar.to(dev).eval().requires_grad_(False), sat.to(dev).eval().requires_grad_(False)


def blocks_in(aar, dtype) -> None:
    """Run the AAR's transformer blocks (attention and its KV cache, the MLPs) in `dtype`: the blocks are cast and a
    pair of hooks casts each block's floating inputs in and its output back to fp32, so the embeddings, the head and
    the sampler stay fp32 (no change to the model code). Nothing to do for fp32."""
    import torch

    if dtype == torch.float32:
        return

    def cast_in(module, args, kwargs):
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    for block in aar.blocks:
        block.to(dtype)
        block.register_forward_pre_hook(cast_in, with_kwargs=True)
        block.register_forward_hook(lambda module, args, out: out.float())


def run(args: argparse.Namespace) -> int:
    import torch

    from mmkv.cache import CacheConfig, KVStore
    from mmkv.pipelines.aar.sample import rollout
    from mmkv.pipelines.aar.tiny import random_condition

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise ValueError("mmkv bench audio needs a CUDA GPU (the full-size AAR d16 and SAT); --tiny runs the tiny "
                         "AAR on the CPU")
    codecs = _codecs(args.codecs)
    dev = torch.device("cuda" if cuda else "cpu")
    began = time.perf_counter()
    aar, sat = _models(args.tiny, dev)
    blocks_in(aar, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    cond = random_condition(1, seed=0, dim=aar.config.input_dim)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def one(codec: str | None) -> dict:
        store = KVStore(CacheConfig(codec=codec, residual_window=args.residual_window,
                                    reuse_decoded=args.reuse_decoded),
                        num_layers=aar.depth, num_heads=aar.num_heads, head_dim=aar.config.head_dim)
        sync()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0  # the models and the baseline's outputs kept
        t0 = time.perf_counter()
        r = rollout(aar, sat, cond, seed=0, key="bench", store=store)
        sync()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        return {"seconds": time.perf_counter() - t0, "transformer_s": r.timings["transformer_s"],
                "tokens": r.tokens_flat, "audio": r.audio, "kv_bytes": store.nbytes(),
                "bf16_kv_bytes": store.bf16_nbytes(), "kv_ratio": store.kv_ratio, "stats": store.stats(),
                "peak_kv_bytes": store.peak_nbytes, "peak_cuda": peak,
                "peak_cuda_over_model": None if peak is None else peak - before}

    rows = []
    base: dict | None = None
    for codec in [None, *codecs]:
        try:
            warm = time.perf_counter()
            one(codec)  # warm-up: kernel compilation, allocator
            warm = time.perf_counter() - warm
            runs, paired = timed(lambda: one(codec), args.repeats,
                                 lambda: one(None) if args.paired and codec else None)
            res = runs[0]
            res["warmup_s"] = warm
            res["all_seconds"] = [r["seconds"] for r in runs]
            res["paired_base_seconds"] = paired
            res["seconds"] = statistics.median(res["all_seconds"])
            res["transformer_s"] = statistics.median(r["transformer_s"] for r in runs)
            del runs
            if codec is None:
                base = res
            rows.append(_row(codec, args, res, base))
            save_rows(args.json, rows)  # as each row lands: a call cut by its time limit keeps them
            print(f"{rows[-1]['codec']}: {res['seconds']:.3f} s x{rows[-1]['ratio_to_native']:.2f} "
                  f"(warm-up {res['warmup_s']:.1f} s)", flush=True)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=activities) as prof:
                    wall = one(codec)["seconds"]
                rows[-1]["profile"] = {"wall_s": round(wall, 3), **profile_summary(prof.key_averages()),
                                       **python_profile(lambda: one(codec))}
                save_rows(args.json, rows)
                print(f"  profiled: {rows[-1]['profile']}", flush=True)
        except Exception:  # noqa: BLE001 - one failing codec must not lose the others' rows
            if codec is None:
                raise
            import traceback

            print(f"FAILED {codec}:\n{traceback.format_exc()}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    where = f"{torch.cuda.get_device_name()}" if cuda else "cpu"
    model = "micro AAR" if args.tiny else "AAR d16 + SAT"
    print(table(rows, f"{where}, torch {torch.__version__}, {model} random weights, blocks and cache {args.dtype}, "
                      f"residual window {args.residual_window} scale(s); {time.perf_counter() - began:.0f} s in all"))
    save_rows(args.json, rows)
    return 0


def _row(codec: str | None, args, res: dict, base: dict) -> dict:
    import torch

    s, kvx = res["stats"], res["kv_ratio"]
    return {
        "codec": codec or "native cache", "dtype": args.dtype, "residual_window": args.residual_window,
        "reuse_decoded": bool(args.reuse_decoded),
        "seconds": round(res["seconds"], 4), "ratio_to_native": round(ratio(res, base), 3),
        "transformer_s": round(res["transformer_s"], 4),
        "transformer_ratio": round(res["transformer_s"] / base["transformer_s"], 3),
        "all_seconds": [round(x, 4) for x in res["all_seconds"]], "warmup_s": round(res["warmup_s"], 3),
        "paired_native_seconds": [round(x, 4) for x in res.get("paired_base_seconds") or []] or None,
        "kv_bytes": res["kv_bytes"], "bf16_kv_bytes": res["bf16_kv_bytes"], "kv_ratio": round(kvx, 3),
        "k_bits": s.get("k_effective_bits"), "v_bits": s.get("v_effective_bits"),
        "peak_kv_bytes": res["peak_kv_bytes"], "peak_cuda_bytes": res["peak_cuda"],
        "peak_cuda_over_model_bytes": res["peak_cuda_over_model"],
        "bf16_kv_over_kvx": int(base["peak_kv_bytes"] / kvx) if kvx else None,
        "token_agreement": round(float((res["tokens"] == base["tokens"]).double().mean()), 4),
        "bit_exact": torch.equal(res["tokens"], base["tokens"]) and torch.equal(res["audio"], base["audio"]),
    }


def table(rows: list[dict], title: str) -> str:
    """The rows as Markdown through the project's one table writer."""
    from mmkv.report.tables import Column, Table, to_markdown

    kib, mib = 2.0**10, 2.0**20
    nan = float("nan")
    cols = [Column("codec", ("codec",)), Column("seconds", ("s",), "{:.3f}"),
            Column("ratio_to_native", ("x native cache",), "{:.2f}"),
            Column("transformer_ratio", ("x native (sampling only)",), "{:.2f}"),
            Column("kv_kib", ("KV KiB",), "{:.0f}"), Column("kv_ratio", ("KVx",), "{:.2f}"),
            Column("peak_kv_kib", ("peak KV KiB",), "{:.0f}"), Column("bound_kib", ("bf16 KV / KVx KiB",), "{:.0f}"),
            Column("peak_cuda_mib", ("peak CUDA MiB",), "{:.0f}"),
            Column("token_agreement", ("tokens equal",), "{:.3f}")]
    body = [[r["codec"], r["seconds"], r["ratio_to_native"], r["transformer_ratio"], r["kv_bytes"] / kib,
             r["kv_ratio"], r["peak_kv_bytes"] / kib, (r["bf16_kv_over_kvx"] or nan) / kib,
             nan if r["peak_cuda_bytes"] is None else r["peak_cuda_bytes"] / mib, r["token_agreement"]]
            for r in rows]
    return to_markdown(Table("bench_audio", title, cols, body))
