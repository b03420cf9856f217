"""GPU check of the codec kernels: every encode/decode kernel against its torch reference at full size, then CUDA-event
timings (median) of encode (GB/s of bf16 input) and decode (GB/s of bf16 output) beside a device copy of the same
tensor measured in the same run.

    python -m mmkv.kernels.gpu_check_codecs [--quick] [--json out.json] [--jobs 16]

Shapes: LLM-like K [8, 32, 8192, 128] and video-like K [1, 12, 4680, 128] (CausVid/Wan: 12 heads, one chunk's
4680 tokens). Correctness: codes and side information of the kernel's encoding against the reference's on the same
input (fraction of differing packed bytes, largest relative difference of float side tensors, relative MSE of both
reconstructions), and the kernel's decode of the reference's encoding against the reference decode (fraction of bf16
outputs that differ, largest difference). `--jobs` compiles the kernels in parallel worker processes first (Triton's
on-disk cache), so the timed process only loads them. A cold compile of the OCTOPUS kernels takes about a minute each
(their triplet shuffles unroll), so give a cold first run several minutes, or use `--only` / `--shape` / `--quick`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch

from mmkv.codecs import build

SHAPES = {"llm": (8, 32, 8192, 128), "video": (1, 12, 4680, 128)}
PRESETS = [
    "octopus:b=2", "octopus:b=3", "octopus:b=4", "octopus:b=3,joint=0", "octopus-qjl:b=3",
    "turboquant-mse:b=2", "turboquant-mse:b=3", "turboquant-mse:b=4", "turboquant-prod:b=3", "qjl:bits=2",
    "polarquant:b=2", "groupquant:bits=2,group=32", "groupquant:bits=4,group=32", "kivi:bits=2,group=32",
    "kivi:bits=2,group=32,role=v", "oscar:bits=2,group=32", "oscar:bits=2,group=32,role=v",
    "qvg:bits=2", "qvg:bits=4", "tcq:bits=2", "tcq:bits=3", "tcq:bits=4,hi=47,norm=32", "tcq:bits=2,L=11",
]
# Reference at the LLM shape only for these (the others are checked at the video shape); the references of the
# rotation codecs hold [.., T, 43, 9, 3]-sized temporaries.
FULL_REFERENCE = {"octopus:b=3", "turboquant-mse:b=4", "groupquant:bits=2,group=32"}
# Launch variants timed for the two headline encoders: warps a program (one token a thread: 32 tokens a warp); for
# TCQ's Viterbi encoder, warps and vectors a program over their 2^L path costs each (default: 1 warp,
# `vectors_a_program`).
VARIANTS = [{"warps": 2}, {"warps": 8}]
# prefetch=False: each step's inputs loaded in the step (the default loads them a step ahead); programs: vectors a
# launch (default: as many as 128 MB of back-pointer scratch hold, one launch for the video shape; 4096, the earlier
# default, takes 14 launches of about one wave each); one warp with 2 or 4 vectors: independent searches side by side
# in one warp, to hide each step's latency (a step of the search is about 100 instructions a warp at L = 8, compiled
# for sm_90: docs/perf.md); fused=False: the reference's torch code after the search in place of the finishing kernel;
# fused=True: the finishing kernel after the lane search in place of its last backtrack (the default where it fits);
# window=None: pass one over all steps as QTIP's (the codes before 2026-12-03: the only variant whose codes may
# differ).
TCQ_VARIANTS = [{"warps": 4}, {"warps": 2}, {"warps": 8}, {"vectors": 1}, {"vectors": 2}, {"vectors": 4},
                {"vectors": 8}, {"vectors": 8, "warps": 2}, {"vectors": 4, "warps": 4}, {"vectors": 4, "warps": 8},
                {"vectors": 16, "warps": 8}, {"prefetch": False}, {"programs": 4096},
                {"prefetch": False, "programs": 4096}, {"vectors": 2, "programs": 4096},
                {"fused": False}, {"window": None}, {"layout": "lanes"}, {"layout": "lanes", "vectors": 1},
                {"layout": "lanes", "vectors": 4}, {"layout": "lanes", "vectors": 8, "warps": 2},
                {"fused": "backtrack"}, {"fused": "backtrack", "vectors": 2}, {"fused": True},
                {"fused": True, "vectors": 2}]


def reference_encode(codec, x):
    """The torch reference, whatever `Codec.encode` dispatches to: `_encode` on fp32, as `Codec.encode` does (QVG
    forms its residuals in the input dtype, so its reference takes x as it is)."""
    enc = codec._encode(x if codec.name == "qvg" else x.float())
    enc.shape, enc.dtype, enc.codec = tuple(x.shape), x.dtype, str(codec.config)
    return enc


def reference_decode(codec, enc, dtype):
    return codec._decode(enc).to(dtype)


def kernels_for(codec):
    from mmkv.kernels import dispatch

    enc, dec = dispatch.module(codec.name, "encode"), dispatch.module(codec.name, "decode")
    if not enc.supports(codec):
        raise RuntimeError(f"no kernel covers {codec.config}")
    return enc.encode, dec.decode


def _warm_then(fn, warmup: int, reps: int) -> range:
    """Call fn() `warmup` times, wait for the GPU, then give the range of the timed repetitions."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return range(reps)


def bench(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `reps` CUDA-event-timed calls."""
    times = []
    for _ in _warm_then(fn, warmup, reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_stream(fn, calls: int = 20, reps: int = 5, warmup: int = 3) -> float:
    """Median milliseconds a call of fn() when `calls` run back to back between two CUDA events (the host queues
    ahead of the GPU, as in a rollout, so the figure is the GPU's time a call, not the host's launch latency);
    device-side checks are collected inside the run and read after it (`encode_scope(collect=True)`)."""
    from mmkv.codecs.checks import encode_scope

    times = []
    for _ in _warm_then(fn, warmup, reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with encode_scope(collect=True) as pending:
            a.record()
            for _ in range(calls):
                fn()
            b.record()
        b.synchronize()
        if any(bool(bad) for bad, _ in pending):
            raise RuntimeError("a device-side check failed inside bench_stream")
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def kernel_ms(fn) -> dict[str, float]:
    """GPU milliseconds by kernel name of one fn() call (torch.profiler, after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and getattr(ev, "device_time_total", 0) > 0:
            out[ev.key[:60]] = round(ev.device_time_total / 1000, 4)
    return out


def make_input(shape, seed=0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)


def compare(codec, x, enc_fn, dec_fn) -> dict:
    ref = reference_encode(codec, x)
    ker = enc_fn(codec, x)
    out = {"bundle_ok": ref.codec == ker.codec and ref.shape == ker.shape and ref.dtype == ker.dtype
           and ref.meta == ker.meta and list(ref.tensors) == list(ker.tensors)}
    byte_diff, side = {}, {}
    for k, a in ref.tensors.items():
        b = ker.tensors[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            out["bundle_ok"] = False
            continue
        if a.dtype == torch.uint8:
            byte_diff[k] = float((a != b).float().mean())
        else:
            side[k] = float(((a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-30)).max())
    out["byte_diff"], out["side_rel"] = byte_diff, side
    xf = x.float()
    den = float(xf.square().sum())
    r_ref = reference_decode(codec, ref, torch.float32)
    r_ker = reference_decode(codec, ker, torch.float32)
    out["rel_mse_ref"] = float((r_ref - xf).square().sum()) / den
    out["rel_mse_kernel_enc"] = float((r_ker - xf).square().sum()) / den
    del r_ker
    d_ref = r_ref.to(torch.bfloat16)
    d_ker = dec_fn(codec, ref, torch.bfloat16)
    out["decode_diff_frac"] = float((d_ref != d_ker).float().mean())
    out["decode_max_abs"] = float((d_ref.float() - d_ker.float()).abs().max())
    return out


def run_preset(preset: str, shape_name: str, args, warm_only: bool = False) -> dict:
    B, H, T, D = SHAPES[shape_name]
    codec = build(preset, head_dim=D, num_heads=H, layer=1, seed=0)
    enc_fn, dec_fn = kernels_for(codec)
    x = make_input((B, H, T, D))
    row = {"preset": preset, "shape": shape_name}
    variants = [None]
    if preset in ("octopus:b=3", "turboquant-mse:b=4") and not (args.quick or args.no_variants):
        variants += VARIANTS
    elif codec.name == "tcq" and not (args.quick or args.no_variants):  # tiles of at most 8192 path costs
        from mmkv.kernels.tcq_encode import lanes_fit

        variants += [v for v in TCQ_VARIANTS if v.get("vectors", 1) << codec.L <= 8192
                     and ((v.get("layout") != "lanes" and v.get("fused") != "backtrack") or lanes_fit(codec))]
    if warm_only:
        for v in variants:
            enc = enc_fn(codec, x, **(v or {}))
        dec_fn(codec, enc, torch.bfloat16)
        torch.cuda.synchronize()
        return row
    if shape_name == "video" or preset in FULL_REFERENCE:
        row["check"] = compare(codec, x, enc_fn, dec_fn)
        torch.cuda.empty_cache()
    enc = enc_fn(codec, x)
    row["encode_ms"] = bench(lambda: enc_fn(codec, x))
    row["decode_ms"] = bench(lambda: dec_fn(codec, enc, torch.bfloat16))
    if codec.name == "tcq":  # the GPU's time a call with the host ahead, and where it goes
        from mmkv.kernels.tcq_encode import lanes_fit as tcq_lanes_fit

        row["encode_stream_ms"] = bench_stream(lambda: enc_fn(codec, x))
        row["encode_stream_GBs"] = x.numel() * 2 / row["encode_stream_ms"] / 1e6
        row["encode_kernel_ms"] = kernel_ms(lambda: enc_fn(codec, x))
        if not codec.hi and tcq_lanes_fit(codec):
            row["encode_stream_finish_ms"] = bench_stream(lambda: enc_fn(codec, x, fused=True))  # the other finish
            row["encode_kernel_finish_ms"] = kernel_ms(lambda: enc_fn(codec, x, fused=True))
    if codec.name == "tcq":  # the encode's parts: rotation and norm, the search (forming u, or given it), finish
        from mmkv.kernels import tcq_encode

        xf = x.float()
        r, norm = tcq_encode.rotated(codec, xf)
        u = codec.unit_rotated(xf, r)[1]  # the reference's u: the search given it must find the same codes
        row["u_in_kernel_codes_equal"] = bool(torch.equal(tcq_encode.search(codec, r, norm=norm),
                                                          tcq_encode.search(codec, u)))
        row["rotated_ms"] = bench(lambda: tcq_encode.rotated(codec, x.float()))  # the encode before its search
        row["viterbi_ms"] = bench(lambda: tcq_encode.search(codec, r, norm=norm))  # u formed in the kernel
        row["viterbi_on_u_ms"] = bench(lambda: tcq_encode.search(codec, u, norm=None))  # u read from memory
        if not codec.hi:  # after it: the states, gain and packing (`finish`)
            codes = tcq_encode.search(codec, r, norm=norm)
            row["finish_ms"] = bench(lambda: tcq_encode.finish(codec, codes, r))
            if tcq_encode.lanes_fit(codec):
                row["search_ms"] = {lay: bench(lambda: tcq_encode.search(codec, r, norm=norm, layout=lay))
                                    for lay in tcq_encode.LAYOUTS}
        row["viterbi_full_pass_one_ms"] = bench(lambda: tcq_encode.search(codec, r, norm=norm, window=None))  # QTIP's
    row["bytes_in"] = x.numel() * 2
    row["stored_bytes"] = enc.nbytes
    row["encode_GBs"] = row["bytes_in"] / row["encode_ms"] / 1e6
    row["decode_GBs"] = row["bytes_in"] / row["decode_ms"] / 1e6
    if len(variants) > 1:
        row["variants"] = {}
        for v in variants[1:]:
            ms = bench(lambda: enc_fn(codec, x, **v))
            name = ",".join(f"{k}={val}" for k, val in v.items())
            row["variants"][name] = {"encode_ms": ms, "encode_GBs": row["bytes_in"] / ms / 1e6}
            if codec.name == "tcq":  # a launch setting must not change the codes (pass one's window may)
                row["variants"][name]["codes_equal"] = bool(torch.equal(
                    enc_fn(codec, x, **v).tensors["code"], enc.tensors["code"]))
    if preset in FULL_REFERENCE or shape_name == "video":
        try:
            row["reference_encode_ms"] = bench(lambda: reference_encode(codec, x), reps=2, warmup=1)
        except torch.OutOfMemoryError:
            row["reference_encode_ms"] = None
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="video shape only, no launch variants")
    p.add_argument("--shape", choices=["both", "video", "llm"], default="both", help="which shapes (default both)")
    p.add_argument("--no-variants", action="store_true", help="skip the launch-variant timings")
    p.add_argument("--only", action="append", help="preset(s) to run (default: all)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--jobs", type=int, default=0, help="compile in this many worker processes first")
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_codecs: no CUDA device")
        return 2
    presets = args.only or PRESETS
    shapes = ["video"] if args.quick else (["video", "llm"] if args.shape == "both" else [args.shape])
    if args.jobs and not args.warm_only:
        t0 = time.time()
        procs, failed = [], []
        todo = list(presets)
        while todo or procs:
            while todo and len(procs) < args.jobs:
                pre = todo.pop(0)
                cmd = [sys.executable, "-m", "mmkv.kernels.gpu_check_codecs", "--warm-only", "--only", pre]
                procs.append((pre, subprocess.Popen(cmd + (["--quick"] if args.quick else []),
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
            for pre, pr in list(procs):
                if pr.poll() is not None:
                    procs.remove((pre, pr))
                    if pr.returncode:
                        failed.append(pre)
                        print(f"[warm] {pre} failed:\n{pr.stdout.read().decode()[-3000:]}")
                    else:
                        print(f"[warm] {pre} compiled ({time.time() - t0:.0f} s)", flush=True)
            time.sleep(0.2)
        print(f"[warm] compiled {len(presets)} presets in {time.time() - t0:.0f} s; failed: {failed or 'none'}")
    if not args.warm_only:
        import triton

        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"triton {triton.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}")
        x = make_input(SHAPES["llm"])
        y = torch.empty_like(x)
        copy_ms = bench(lambda: y.copy_(x))
        copy = {"bytes": x.numel() * 2, "ms": copy_ms, "GBs_in": x.numel() * 2 / copy_ms / 1e6,
                "GBs_rw": 2 * x.numel() * 2 / copy_ms / 1e6}
        print(f"device copy of bf16 {list(x.shape)}: {copy_ms:.3f} ms = {copy['GBs_in']:.0f} GB/s of input "
              f"({copy['GBs_rw']:.0f} GB/s read+write)")
        copies = {"llm": copy_ms}
        xv = make_input(SHAPES["video"])
        yv = torch.empty_like(xv)
        copies["video"] = bench(lambda: yv.copy_(xv))
        del x, y, xv, yv
    rows = []
    for shape_name in shapes:
        for pre in presets:
            try:
                row = run_preset(pre, shape_name, args, warm_only=args.warm_only)
            except Exception as err:  # report and go on: one failing kernel must not hide the others
                row = {"preset": pre, "shape": shape_name, "error": f"{type(err).__name__}: {err}"}
                print(f"!! {pre} {shape_name}: {row['error']}\n{traceback.format_exc()[-2500:]}")
            rows.append(row)
            torch.cuda.empty_cache()
            if not args.warm_only:
                print(json.dumps(row), flush=True)
                if args.json:  # after every row, so a run cut by a time limit keeps what it measured
                    from mmkv.io import atomic_write_json

                    atomic_write_json(args.json, {"copy": copy, "copies_ms": copies, "rows": rows, "complete": False})
    if args.warm_only:
        return 0
    print()
    print("| shape | preset | encode ms | enc GB/s | enc/copy | decode ms | dec GB/s | dec/copy | ref enc ms | "
          "codes differ | side rel | dec differ | rel MSE ref/kernel |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['preset']} | ERROR {r['error'][:80]} |")
            continue
        c = r.get("check", {})
        bd = max(c["byte_diff"].values()) if c.get("byte_diff") else float("nan")
        sr = max(c["side_rel"].values()) if c.get("side_rel") else float("nan")
        cp = copies[r["shape"]]
        ref = r.get("reference_encode_ms")
        print(f"| {r['shape']} | {r['preset']} | {r['encode_ms']:.3f} | {r['encode_GBs']:.4g} | "
              f"{r['encode_ms'] / cp:.2f} | {r['decode_ms']:.3f} | {r['decode_GBs']:.0f} | {r['decode_ms'] / cp:.2f} | "
              f"{'-' if ref is None else f'{ref:.1f}'} | {bd:.2g} | {sr:.2g} | "
              f"{c.get('decode_diff_frac', float('nan')):.2g} | "
              f"{c.get('rel_mse_ref', float('nan')):.5f}/{c.get('rel_mse_kernel_enc', float('nan')):.5f} |")
        if "viterbi_ms" in r:  # TCQ: where its encode's time goes
            parts = [f"rotated {r['rotated_ms']:.3f}", f"search {r['viterbi_ms']:.3f}",
                     f"search on u {r['viterbi_on_u_ms']:.3f}"]
            parts += [f"search[{k}] {v:.3f}" for k, v in r.get("search_ms", {}).items()]
            parts += [f"finish {r['finish_ms']:.3f}"] if "finish_ms" in r else []
            parts += ["u in kernel: " + ("codes equal" if r["u_in_kernel_codes_equal"] else "CODES DIFFER")]
            print(f"|  | ↳ ms: {', '.join(parts)} |")
        if "encode_stream_ms" in r:  # TCQ: the GPU's time a call (calls back to back) and its kernels
            line = f"encode back to back {r['encode_stream_ms']:.3f} ms = {r['encode_stream_GBs']:.1f} GB/s"
            if "encode_stream_finish_ms" in r:
                line += f", fused=True (the finishing kernel) {r['encode_stream_finish_ms']:.3f} ms"
            print(f"|  | ↳ {line} |")
            for key in ("encode_kernel_ms", "encode_kernel_finish_ms"):
                if key in r:
                    print(f"|  | ↳ {key}: " + ", ".join(f"{k} {v:.3f}" for k, v in r[key].items()) + " |")
        for name, v in r.get("variants", {}).items():
            same = {True: "codes equal", False: "CODES DIFFER"}.get(v.get("codes_equal"), "")
            print(f"|  | ↳ {name} | {v['encode_ms']:.3f} | {v['encode_GBs']:.4g} | {v['encode_ms'] / cp:.2f} "
                  f"| | | | | {same} | | | |")
    print(f"\ncopy ms: {copies}")
    if args.json:
        from mmkv.io import atomic_write_json

        atomic_write_json(args.json, {"copy": copy, "copies_ms": copies, "rows": rows, "complete": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
