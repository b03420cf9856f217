"""`mmkv bench video`: the full-size causal Wan DiT (random weights) with the bf16 cache and compressed caches.

Issue 4's performance check: 21 latent frames at 480x832 (60x104 latents, 1560 tokens per frame), each codec's wall time
as a ratio to the bf16 cache measured in the same process, measured KV bytes, KV x, peak KV and peak CUDA memory.
Every codec is warmed up once on a short rollout first (Triton compilation stays out of the timings). Random weights:
the quality columns only show that the rollouts differ, not how much a real model would.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

DEFAULT_CODECS = "octopus:b=2;oscar:bits=2,group=32;turboquant-mse:b=2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="causvid", help="loop preset (default causvid)")
    parser.add_argument("--codecs", default=DEFAULT_CODECS,
                        help=f"codec presets separated by ';' (presets contain commas; default {DEFAULT_CODECS!r})")
    parser.add_argument("--frames", type=int, default=21, help="latent frames (default 21)")
    parser.add_argument("--latent-size", default="60x104", help="latent HxW (default 60x104 = 480x832 pixels)")
    parser.add_argument("--residual-window", type=int, default=1)
    parser.add_argument("--reuse-decoded", action="store_true",
                        help="decode each unit once per rollout (faster; the decodes are held, memory not saved)")
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
                                    reuse_decoded=args.reuse_decoded), num_layers=layers,
                        num_heads=heads, head_dim=head_dim)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.no_grad(), store.attach(dit.transformer):
            r = rollout(dit, preset, ctx, NoiseStream(0, 0), num_frames=frames, latent_height=h, latent_width=w)
        torch.cuda.synchronize()
        return {"seconds": time.perf_counter() - t0, "latents": r.latents.float(), "store": store,
                "peak_cuda": torch.cuda.max_memory_allocated()}

    fpb = preset.frames_per_block
    rows = []
    base = None
    for codec in [None, *_codecs(args.codecs)]:
        one(codec, fpb * 2)  # warm-up: kernel compilation, allocator
        res = one(codec, args.frames)
        st = res["store"]
        if codec is None:
            base = res
        err = float((res["latents"] - base["latents"]).norm() / base["latents"].norm())
        s = st.stats()
        rows.append({
            "model": preset.name, "codec": codec or "bf16 cache", "frames": args.frames, "latent": f"{h}x{w}",
            "seconds": round(res["seconds"], 3), "ratio_to_bf16": round(res["seconds"] / base["seconds"], 3),
            "kv_bytes": st.nbytes(), "bf16_kv_bytes": st.bf16_nbytes(), "kv_ratio": round(st.kv_ratio, 3),
            "k_bits": s.get("k_effective_bits"), "v_bits": s.get("v_effective_bits"),
            "peak_kv_bytes": st.peak_nbytes, "peak_cuda_bytes": res["peak_cuda"],
            "bf16_kv_over_kvx": int(base["store"].peak_nbytes / st.kv_ratio) if st.kv_ratio else None,
            "rel_latent_diff": round(err, 4),
        })
        del res
        torch.cuda.empty_cache()
    print(table(rows, f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Wan 1.3B random weights, "
                      f"{preset.name}, {args.frames} latent frames {h}x{w}"))
    if args.json:
        from mmkv.io import atomic_write_json

        atomic_write_json(args.json, rows)
    return 0


def table(rows: list[dict], title: str) -> str:
    """The rows as Markdown through the project's one table writer."""
    from mmkv.report.tables import Column, Table, to_markdown

    mib, gib = 2.0**20, 2.0**30
    cols = [Column("codec", ("codec",)), Column("seconds", ("s",), "{:.2f}"),
            Column("ratio_to_bf16", ("x bf16 cache",), "{:.2f}"), Column("kv_mib", ("KV MiB",), "{:.0f}"),
            Column("kv_ratio", ("KVx",), "{:.2f}"), Column("peak_kv_mib", ("peak KV MiB",), "{:.0f}"),
            Column("bound_mib", ("bf16 KV / KVx MiB",), "{:.0f}"),
            Column("peak_cuda_gib", ("peak CUDA GiB",), "{:.2f}"),
            Column("rel_latent_diff", ("rel. latent diff",), "{:.3f}")]
    body = [[r["codec"], r["seconds"], r["ratio_to_bf16"], r["kv_bytes"] / mib, r["kv_ratio"], r["peak_kv_bytes"] / mib,
             r["bf16_kv_over_kvx"] / mib, r["peak_cuda_bytes"] / gib, r["rel_latent_diff"]] for r in rows]
    return to_markdown(Table("bench_video", title, cols, body))
