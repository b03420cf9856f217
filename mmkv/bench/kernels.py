"""`mmkv bench kernels`: GPU kernels against bf16 SDPA measured in the same process.

Cases (one process, one card, the baseline timed in the same run as the kernel it is compared with):
- decode: one query row (Lq = 1), B = 8, H = 32, D = 128, Lk in {8K, 32K, 128K}: the fused split-K kernel
  (`mmkv.kernels.attention_kernel`) over the encoded cache against `scaled_dot_product_attention` on the bf16 cache.
- video: a video chunk, B = 1, H = 12, D = 128, Lq = 4680, Lk in {9360, 32760}: the path `mmkv.attention` takes for
  long query blocks (decode the past to bf16, then SDPA; docs/decisions.md, "Attention: decode + one SDPA call") against
  SDPA on the bf16 cache. The past is built by a `KVStore` from 3-frame commits, so its segments are the store's (the
  encoded past joined into one segment, or for KIVI / OScaR keys a stack of frames).
- encode: `Codec.encode` of a bf16 [1, 32, T, 128] tensor, in GB/s of bf16 input.

Timing: `triton.testing.do_bench` (CUDA events, L2 flushed before each call), median. `ratio` = ms / baseline_ms
(time ratio: lower is better; the decode targets are <= 1/3 and <= 1/5, the video target is <= 1/0.9).
`gbps` = bytes read / time: the packed K and V for the kernel rows, the bf16 K and V for the SDPA rows, the bf16
input for encode rows. `rel_error` = ||out - ref|| / ||ref|| against exact fp32 attention over the codec's own fp32
decode (kernel numerics, not codec error; for SDPA rows over the bf16 cache); `rel_error_vs_decode_sdpa` compares the
fused output with decode-to-bf16 + SDPA (the acceptance check, <= 1e-2). Encode rows report the codec's
reconstruction error ||decode(encode(x)) - x|| / ||x||. Inputs are N(0, 1) from a private CUDA generator.

Caches are encoded in chunks of `--chunk` tokens (bounded memory for the torch reference encoders) and concatenated
along the token axis into one segment; the fp32 references are computed chunk by chunk and merged exactly by LSE.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mmkv.cli import UsageError
from mmkv.codecs.base import Codec, Encoded, build, derive_seed, kv_configs

DECODE_PRESETS = (
    "kivi:bits=4,group=32",
    "kivi:bits=2,group=32",
    "oscar:bits=2,group=32",
    "turboquant-mse:b=4",
    "turboquant-mse:b=2",
    "octopus:b=4",
    "octopus:b=3",
    "octopus:b=2",
    # TCQ at each OCTOPUS point's effective bits (the synthetic bench's iso-rate rows); no decode target of its own
    "tcq:bits=4,hi=47,norm=32",
    "tcq:bits=3,hi=46,norm=32",
    "tcq:bits=2,hi=45,norm=32",
)
# Decode-time targets at Lk = 128K as a fraction of bf16 SDPA time (docs/perf.md): 4-bit class 1/3, 2-bit class 1/5.
DECODE_TARGET = {
    "kivi:bits=4,group=32": 1 / 3, "turboquant-mse:b=4": 1 / 3, "octopus:b=4": 1 / 3, "octopus:b=3": 1 / 3,
    "kivi:bits=2,group=32": 1 / 5, "oscar:bits=2,group=32": 1 / 5, "turboquant-mse:b=2": 1 / 5, "octopus:b=2": 1 / 5,
}
VIDEO_TARGET = 1 / 0.9  # decode + attention >= 0.9x bf16 SDPA throughput
# Timed in the encode case only, with the default presets: OCTOPUS without its joint 3x3 rounding is token-local like
# TurboQuant (the 1 TB/s encode target of docs/perf.md is for those).
ENCODE_ONLY = ("octopus:b=4,joint=0", "octopus:b=2,joint=0")
ENCODE_TARGET_GBPS = 1500.0
# TCQ's Viterbi search costs about 2^L * 64 * 2 compare-adds a 128-vector (docs/decisions.md, "Default L by width"):
# its own target, at the default L.
ENCODE_TARGET_GBPS_BY_CODEC = {"tcq": 20.0}
FIELDS = ("case", "codec", "config", "shape", "ms", "baseline_ms", "ratio", "gbps", "rel_error",
          "rel_error_vs_decode_sdpa", "target", "meets_target", "path")

# Kernel settings tried by --sweep at the largest decode Lk: (num_warps, block_n, splits multiplier).
SWEEP = {
    "kivi": [(1, None, 1), (4, None, 1)],
    "oscar": [(1, None, 1)],
    "turboquant-mse": [(4, 32, 1), (4, 64, 2)],
    "octopus": [(8, 64, 1), (2, 32, 1)],
    "tcq": [(4, 64, 1), (8, 64, 1), (2, 32, 1)],  # not measured yet: the default is (4 warps, block 32)
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write every row as JSON to PATH")
    parser.add_argument("--cases", default="decode,video,encode",
                        help="comma list of decode, video, encode, launch (host time a codec call, not in the default)")
    parser.add_argument("--presets", default=";".join(DECODE_PRESETS), help="rollout presets separated by ';'")
    parser.add_argument("--decode-lk", default="8192,32768,131072", help="decode cache lengths")
    parser.add_argument("--video-lk", default="9360,32760", help="video chunk cache lengths")
    parser.add_argument("--batch", type=int, default=8, help="decode batch")
    parser.add_argument("--heads", type=int, default=32, help="decode heads")
    parser.add_argument("--video-lq", type=int, default=4680, help="video chunk queries (3 latent frames of 1560)")
    parser.add_argument("--video-heads", type=int, default=12, help="video heads (Wan2.1-1.3B)")
    parser.add_argument("--frame-tokens", type=int, default=1560, help="tokens per latent frame (a store unit)")
    parser.add_argument("--block-frames", type=int, default=3, help="frames per commit when building the video cache")
    parser.add_argument("--encode-tokens", type=int, default=32768, help="tokens per head of the encode input")
    parser.add_argument("--chunk", type=int, default=8192, help="tokens encoded per call when building caches")
    parser.add_argument("--sweep", action="store_true", help="also time kernel variants at the largest decode Lk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition budget, ms")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise UsageError("mmkv bench kernels needs a CUDA GPU: it times Triton kernels against bf16 SDPA on the device")
    import triton

    presets = [p.strip() for p in args.presets.split(";") if p.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = set(cases) - {"decode", "video", "encode", "launch"}
    if bad:
        raise UsageError(f"unknown case(s) {sorted(bad)}; expected decode, video, encode, launch")
    dev = torch.device("cuda")
    meta = {
        "device": torch.cuda.get_device_name(dev),
        "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "timing": "triton.testing.do_bench median, L2 flushed per call",
        "ratio": "ms / baseline_ms (time; lower is better)",
    }
    print(f"# {meta['device']} ({meta['sms']} SMs), torch {meta['torch']}, triton {meta['triton']}, "
          f"CUDA {meta['cuda']}")
    rows: list[dict] = []
    t0 = time.time()
    bench = _Bench(args, dev)

    def save(done: bool) -> None:
        # after every case, so a run cut by a time limit keeps the cases it finished
        if args.json:
            from mmkv.io import atomic_write_json

            meta["seconds"] = round(time.time() - t0, 1)
            atomic_write_json(args.json, {"meta": {**meta, "complete": done}, "rows": rows})

    if "decode" in cases:
        lks = [int(x) for x in args.decode_lk.split(",")]
        for lk in lks:
            rows += bench.decode(presets, [lk], sweep_lk=max(lks))
            save(False)
    if "video" in cases:
        for lk in [int(x) for x in args.video_lk.split(",")]:
            rows += bench.video(presets, [lk])
            save(False)
    if "encode" in cases:
        default = args.presets == ";".join(DECODE_PRESETS)
        rows += bench.encode(presets + [p for p in ENCODE_ONLY if default and p not in presets])
        save(False)
    if "launch" in cases:
        rows += bench.launch(presets)
    save(True)
    print(render(rows))
    if args.json:
        print(f"wrote {args.json}")
    return 0


# ----------------------------------------------------------------------------------------------------------------


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def token_axes(codec: Codec, b: int, h: int, d: int, group: int, device: torch.device) -> dict[str, int]:
    """For each stored tensor, the axis that grows with the token count (found by encoding two probe lengths)."""
    g = torch.Generator(device=device).manual_seed(1)
    shapes = []
    for t in (2 * group, 4 * group):
        x = torch.randn(b, h, t, d, generator=g, device=device)
        shapes.append({k: v.shape for k, v in codec.encode(x).tensors.items()})
    axes = {}
    for k, s1 in shapes[0].items():
        diff = [i for i, (a, c) in enumerate(zip(s1, shapes[1][k])) if a != c]
        if len(diff) != 1:
            raise RuntimeError(f"{codec.config}: cannot find the token axis of tensor {k!r} ({s1} vs {shapes[1][k]})")
        axes[k] = diff[0]
    return axes


def join_chunks(chunks: list[Encoded], axes: dict[str, int]) -> Encoded:
    """One Encoded over all tokens from chunks of whole bytes and whole groups (the chunk length is a multiple of 8
    tokens and of every codec group, so each packed row of a chunk ends on a byte boundary). Unlike
    `mmkv.codecs.segments.concat_tokens`, which joins only token-local codecs and checks exactness itself, the bench
    knows its chunk boundaries are exact for every codec (KIVI and OScaR keys group over tokens) and names the axes."""
    first = chunks[0]
    tensors = {k: torch.cat([c.tensors[k] for c in chunks], dim=axes[k]) for k in first.tensors}
    shape = list(first.shape)
    shape[-2] = sum(c.shape[-2] for c in chunks)
    return Encoded(first.codec, tuple(shape), first.dtype, tensors, dict(first.meta))


class _Bench:
    """The three cases; `timer(fn) -> ms` defaults to do_bench (tests pass a host timer to run it on the CPU)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, timer: Callable | None = None):
        self.args, self.device, self.timer = args, device, timer

    def time_ms(self, fn: Callable[[], Any]) -> float:
        if self.timer is not None:
            return float(self.timer(fn))
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, return_mode="median"))

    def randn(self, *shape: int, key: Any) -> torch.Tensor:
        g = torch.Generator(device=self.device).manual_seed(derive_seed(self.args.seed, "bench-kernels", *key))
        return torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32).to(torch.bfloat16)

    def codecs(self, preset: str, heads: int, d: int) -> tuple[Codec, Codec]:
        kc, vc = kv_configs(preset, 32)
        return (build(kc, head_dim=d, num_heads=heads, seed=self.args.seed),
                build(vc, head_dim=d, num_heads=heads, seed=self.args.seed))

    def encode_one(self, codec: Codec, x: torch.Tensor) -> Encoded:
        """`Codec.encode` (a Triton encoder where `mmkv.kernels.dispatch` has one); if that raises, the torch
        reference, with a warning, so that one broken encoder does not stop the attention measurements."""
        try:
            return codec.encode(x)
        except Exception as exc:  # noqa: BLE001 - reported, then the reference runs
            print(f"  warning: {codec.config} encode kernel failed ({type(exc).__name__}: {exc}); torch reference")
            enc = codec._encode(x.float())
            enc.shape, enc.dtype, enc.codec = tuple(x.shape), x.dtype, str(codec.config)
            return enc

    def encode_chunked(self, codec: Codec, x: torch.Tensor) -> tuple[list[Encoded], Encoded]:
        t = x.shape[-2]
        step = min(self.args.chunk, t)
        chunks = [self.encode_one(codec, x[..., s : s + step, :].contiguous()) for s in range(0, t, step)]
        if len(chunks) == 1:
            return chunks, chunks[0]
        group = max(int(codec.config.get("group", 1) or 1), 8)
        axes = token_axes(codec, x.shape[0], x.shape[1], x.shape[-1], group, x.device)
        return chunks, join_chunks(chunks, axes)

    # -- launch ----------------------------------------------------------------------------------------------
    def launch(self, presets: list[str], calls: int = 2000, rounds: int = 3) -> list[dict]:
        """Host time of one `Codec.decode` / `Codec.encode` call on a shape too small to keep the GPU busy
        ([1, 12, 16, 128] bf16), so the host sets the pace: through `mmkv.kernels.launch.Kernel`'s table and
        through Triton's `JITFunction.run` (`FAST` off), `rounds` alternations of `calls` calls, median of each.
        A tiny `torch.add` is timed the same way, to show the host's pace a launch."""
        from mmkv.kernels import launch as L

        x = self.randn(1, 12, 16, 128, key=("launch",))
        shape = "x".join(map(str, x.shape))

        def host_ms(fn: Callable[[], Any]) -> float:
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            ms = (time.perf_counter() - t) / calls * 1e3
            torch.cuda.synchronize()
            return ms

        aten = statistics.median(host_ms(lambda: torch.add(x, x)) for _ in range(rounds))
        rows = [self._row("launch", "torch.add", "host ms a call", shape, aten, aten, 0, None, None, None, "aten")]
        saved = L.FAST
        try:
            for preset in presets:
                for codec in dict.fromkeys(self.codecs(preset, 12, 128), None):
                    enc = codec.encode(x)
                    out = torch.empty_like(x)
                    for op, fn in (("decode", lambda: codec.decode(enc, torch.bfloat16, out=out)),
                                   ("encode", lambda: codec.encode(x))):
                        got: dict[bool, list[float]] = {False: [], True: []}
                        for _ in range(rounds):
                            for fast in (False, True):
                                L.FAST = fast
                                got[fast].append(host_ms(fn))
                        table, triton_ms = statistics.median(got[True]), statistics.median(got[False])
                        rows.append(self._row("launch", f"{codec.config} {op}", "host ms a call: launch table (ms) vs "
                                              "Triton's JITFunction.run (baseline)", shape, table, triton_ms, 0,
                                              None, None, None, "triton"))
                        print(f"  launch {codec.config} {op}: table {table * 1e3:.1f} us, Triton's launcher "
                              f"{triton_ms * 1e3:.1f} us, torch.add {aten * 1e3:.1f} us", flush=True)
        finally:
            L.FAST = saved
        return rows

    # -- decode ----------------------------------------------------------------------------------------------
    def _sdpa_baseline(self, case: str, q, k, v, scale: float, shape: str) -> dict:
        """The bf16 SDPA row every preset of a case is timed against: its time, bytes and error against exact fp32
        attention."""
        from mmkv.attention import attention_lse

        base_ms = self.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale))
        ref = attention_lse(q.float(), k.float(), v.float(), scale)[0]
        return self._row(case, "bf16 sdpa", "torch sdpa", shape, base_ms, base_ms, 2 * k.numel() * k.element_size(),
                         rel_error(F.scaled_dot_product_attention(q, k, v, scale=scale), ref), None, None, "sdpa")

    def decode(self, presets: list[str], lks: list[int], sweep_lk: int | None = None) -> list[dict]:
        b, h, d = self.args.batch, self.args.heads, 128
        scale = 1.0 / math.sqrt(d)
        rows = []
        for lk in lks:
            q = self.randn(b, h, 1, d, key=("q", lk))
            k = self.randn(b, h, lk, d, key=("k", lk))
            v = self.randn(b, h, lk, d, key=("v", lk))
            shape = f"B={b} H={h} D={d} Lq=1 Lk={lk}"
            rows.append(self._sdpa_baseline("decode", q, k, v, scale, shape))
            base_ms = rows[-1]["ms"]
            print(f"decode Lk={lk}: bf16 SDPA {base_ms:.3f} ms ({rows[-1]['gbps']:.0f} GB/s)", flush=True)
            for preset in presets:
                rows += _guard(f"decode {preset} Lk={lk}", self._decode_one, preset, q, k, v, scale, shape, base_ms,
                               sweep_lk or max(lks))
            del q, k, v
            torch.cuda.empty_cache()
        return rows

    def _decode_one(self, preset, q, k, v, scale, shape, base_ms, sweep_lk) -> list[dict]:
        from mmkv.attention import Segment, attention_lse, merge_lse
        from mmkv.kernels import attention_kernel

        rows = []
        lk, (_, h, _, d) = k.shape[-2], q.shape
        kcod, vcod = self.codecs(preset, h, d)
        kernel = attention_kernel(kcod.config, vcod.config)
        if kernel is None:
            print(f"  {preset}: no fused kernel", flush=True)
            return rows
        kch, ke = self.encode_chunked(kcod, k)
        vch, ve = self.encode_chunked(vcod, v)
        seg = Segment(k_enc=ke, v_enc=ve, k_codec=kcod, v_codec=vcod)
        out, _ = kernel(q, [seg], scale)
        path = kernel.last_path
        # References chunk by chunk: exact fp32 attention over the fp32 decode, and decode-to-bf16 + SDPA.
        parts, kb, vb = [], [], []
        for kc_, vc_ in zip(kch, vch):
            kf, vf = kcod._decode(kc_), vcod._decode(vc_)
            parts.append(attention_lse(q.float(), kf, vf, scale))
            kb.append(kf.to(torch.bfloat16))
            vb.append(vf.to(torch.bfloat16))
            del kf, vf
        ref, _ = merge_lse(parts)
        sdpa_out = F.scaled_dot_product_attention(q, torch.cat(kb, 2), torch.cat(vb, 2), scale=scale)
        del kb, vb, parts
        err, err_sdpa = rel_error(out, ref), rel_error(out, sdpa_out.float())
        packed = ke.nbytes + ve.nbytes
        ms = self.time_ms(lambda: kernel(q, [seg], scale))
        target = DECODE_TARGET.get(preset) if lk >= 131072 else None
        config = self._kernel_config(kernel, seg, q)
        rows.append(self._row("decode", preset, config, shape, ms, base_ms, packed, err, err_sdpa, target,
                              path))
        print(f"  {preset:24s} {ms:.3f} ms  ratio {ms / base_ms:.3f}  {packed / ms / 1e6:.0f} GB/s  "
              f"err {err:.1e} / vs sdpa {err_sdpa:.1e}  [{config}]", flush=True)
        if self.args.sweep and lk == sweep_lk:
            rows += self._sweep(preset, kernel, q, seg, scale, shape, base_ms, packed, ref)
        del seg, ke, ve, kch, vch, out, ref, sdpa_out
        torch.cuda.empty_cache()
        return rows

    def _kernel_config(self, kernel, seg, q) -> str:
        from mmkv.kernels.attn_splitk import plan_splits

        first, tiles = kernel.num_tiles(seg)
        splits = plan_splits(q.shape[0] * q.shape[1] * q.shape[2], tiles, q.device, kernel.splits)
        return (f"{kernel.name} fused: block_n={kernel.tile_size(seg)} warps={kernel.warps(seg)} "
                f"stages={kernel.stages} splits={splits}")

    def _sweep(self, preset, kernel, q, seg, scale, shape, base_ms, packed, ref) -> list[dict]:
        from mmkv.kernels import attention_kernel
        from mmkv.kernels.attn_splitk import plan_splits

        rows = []
        first, tiles = kernel.num_tiles(seg)
        auto = plan_splits(q.shape[0] * q.shape[1], tiles, q.device)
        for warps, block_n, mult in SWEEP.get(seg.k_codec.name, []):
            var = attention_kernel(seg.k_codec.config, seg.v_codec.config)
            var.num_warps, var.block_n, var.splits = warps, block_n, auto * mult
            try:
                out, _ = var(q, [seg], scale)
                err = rel_error(out, ref)
                ms = self.time_ms(lambda: var(q, [seg], scale))
            except Exception as exc:  # a variant that fails to compile or run is reported, not fatal
                print(f"    sweep {warps=} {block_n=} x{mult}: {type(exc).__name__}: {exc}", flush=True)
                continue
            config = "sweep " + self._kernel_config(var, seg, q)
            rows.append(self._row("decode-sweep", preset, config, shape, ms, base_ms, packed, err, None, None,
                                  var.last_path))
            print(f"    {config}: {ms:.3f} ms ratio {ms / base_ms:.3f} err {err:.1e}", flush=True)
        return rows

    # -- video -----------------------------------------------------------------------------------------------
    def video(self, presets: list[str], lks: list[int]) -> list[dict]:
        b, h, d, lq, frame = 1, self.args.video_heads, 128, self.args.video_lq, self.args.frame_tokens
        scale = 1.0 / math.sqrt(d)
        rows = []
        for lk in lks:
            q = self.randn(b, h, lq, d, key=("vq", lk))
            k = self.randn(b, h, lk, d, key=("vk", lk))
            v = self.randn(b, h, lk, d, key=("vv", lk))
            shape = f"B={b} H={h} D={d} Lq={lq} Lk={lk}"
            rows.append(self._sdpa_baseline("video", q, k, v, scale, shape))
            base_ms = rows[-1]["ms"]
            print(f"video Lk={lk}: bf16 SDPA {base_ms:.3f} ms", flush=True)
            for preset in presets:
                rows += _guard(f"video {preset} Lk={lk}", self._video_one, preset, q, k, v, scale, shape, base_ms,
                               frame)
            del q, k, v
            torch.cuda.empty_cache()
        return rows

    def _video_one(self, preset, q, k, v, scale, shape, base_ms, frame) -> list[dict]:
        from mmkv.attention import attend, attention_lse, merge_lse
        from mmkv.cache import CacheConfig, KVStore

        rows = []
        lk, (_, h, _, d) = k.shape[-2], q.shape
        block = frame * self.args.block_frames
        if lk % frame:
            raise UsageError(f"video Lk={lk} is not a whole number of {frame}-token frames")
        # The past as the store holds it after CausVid commits of `block_frames` frames with a residual window of 0:
        # one segment per block for token-local codecs (merge_units), one per frame for the others.
        store = KVStore(CacheConfig(codec=preset, residual_window=0, seed=self.args.seed), num_layers=1, num_heads=h,
                        head_dim=d)
        for s in range(0, lk, block):
            n = min(block, lk - s)
            store.append(0, k[..., s : s + n, :], v[..., s : s + n, :], num_units=n // frame)
        segs = store.segments(0)
        kcod, vcod = store.k_codec(0), store.v_codec(0)
        out = attend(q, segs, backend="decode", scale=scale)
        parts = [attention_lse(q.float(), kcod._decode(u.k_enc), vcod._decode(u.v_enc), scale)
                 for g in segs for u in g.unstacked()]
        ref, _ = merge_lse(parts)
        del parts
        err = rel_error(out.float(), ref)
        ms = self.time_ms(lambda: attend(q, segs, backend="decode", scale=scale))
        packed = store.nbytes()
        path = _dispatch_path("decode", self.device, kcod, vcod)
        stacked = sum(g.stack for g in segs if g.stack > 1)
        layout = f"{len(segs)} segments" + (f" (a stack of {stacked} frames)" if stacked else "")
        rows.append(self._row("video", preset, f"decode to bf16 ({path}) + sdpa, {layout}",
                              shape, ms, base_ms, packed, err, None, VIDEO_TARGET, path))
        print(f"  {preset:24s} {ms:.3f} ms  ratio {ms / base_ms:.3f}  err {err:.1e}  {layout}  [{path}]",
              flush=True)
        del segs, store, out, ref
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return rows

    # -- encode ----------------------------------------------------------------------------------------------
    def encode(self, presets: list[str]) -> list[dict]:
        rows = []
        h, d = 32, 128
        seen = set()
        for preset in presets:
            for codec in self.codecs(preset, h, d):
                key = str(codec.config)
                if key in seen:
                    continue
                seen.add(key)
                path = _dispatch_path("encode", self.device, codec)
                t = self.args.encode_tokens if path == "triton" else min(self.args.encode_tokens, 8192)
                x = self.randn(1, h, t, d, key=("enc", t))
                shape = f"B=1 H={h} T={t} D={d} bf16"
                enc = codec.encode(x)
                err = rel_error(codec.decode(enc, dtype=torch.float32), x.float())
                ms = self.time_ms(lambda: codec.encode(x))
                nbytes = x.numel() * x.element_size()
                gbps = nbytes / ms / 1e6
                target = ENCODE_TARGET_GBPS_BY_CODEC.get(codec.name, ENCODE_TARGET_GBPS)
                rows.append({
                    "case": "encode", "codec": key, "config": f"Codec.encode ({path})", "shape": shape,
                    "ms": ms, "baseline_ms": None, "ratio": None, "gbps": gbps, "rel_error": err,
                    "rel_error_vs_decode_sdpa": None, "target": target,
                    "meets_target": gbps >= target, "path": path,
                })
                print(f"encode {key:34s} {ms:.3f} ms  {gbps:.0f} GB/s  recon err {err:.3f}  [{path}]", flush=True)
                del x, enc
                torch.cuda.empty_cache()
        return rows

    @staticmethod
    def _row(case, codec, config, shape, ms, base_ms, nbytes, err, err_sdpa, target, path) -> dict:
        ratio = ms / base_ms
        return {
            "case": case, "codec": codec, "config": config, "shape": shape, "ms": ms, "baseline_ms": base_ms,
            "ratio": ratio, "gbps": nbytes / ms / 1e6, "rel_error": err, "rel_error_vs_decode_sdpa": err_sdpa,
            "target": target, "meets_target": None if target is None else ratio <= target, "path": path,
        }


def _guard(what: str, fn: Callable, *args) -> list[dict]:
    """Run one measurement; a failure is printed with its traceback and skipped, not fatal to the whole run."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - one broken configuration must not lose the others' numbers
        import traceback

        print(f"  FAILED {what}:\n{traceback.format_exc()}", flush=True)
        torch.cuda.empty_cache()
        return []


def _dispatch_path(op: str, device: torch.device, *codecs: Codec) -> str:
    """'triton' when `Codec.encode/decode` will run a `mmkv.kernels.dispatch` kernel for `op` of every codec on
    `device` (CUDA only), else 'torch-reference'."""
    if device.type != "cuda":
        return "torch-reference"
    try:
        from mmkv.kernels import dispatch
    except ImportError:
        return "torch-reference"
    return "triton" if all(dispatch.lookup(op, c) is not None for c in codecs) else "torch-reference"


def render(rows: list[dict]) -> str:
    """The rows as Markdown tables (one per case), through the project's table writer."""
    from mmkv.report.tables import Column, Table, to_markdown

    cols = [
        Column("codec", ("codec",)), Column("shape", ("shape",)), Column("ms", ("ms",), "{:.3f}"),
        Column("baseline_ms", ("bf16 SDPA ms",), "{:.3f}"), Column("ratio", ("ratio",), "{:.3f}"),
        Column("gbps", ("GB/s",), "{:.0f}"), Column("rel_error", ("rel err",), "{:.1e}"),
        Column("rel_error_vs_decode_sdpa", ("vs decode+SDPA",), "{:.1e}"),
        Column("target", ("target",), "{:.3g}"), Column("meets_target", ("met",)), Column("config", ("config",)),
    ]
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        sel = [r for r in rows if r["case"] == case]
        out.append(to_markdown(Table(case, f"{case}", cols, [[r.get(c.key) for c in cols] for r in sel])))
    return "\n".join(out)
