"""GPU check of joined units: an AAR-shaped store (16 scales of 1 to 75 tokens, 16 heads x 64, batch 2, bf16, two
layers, residual window 1) built once on the codec kernels and once on the torch references, on the same GPU and
inputs. For each preset: the kernel's decode of the joined past against the reference decode of the same encoding
(K and V, bit for bit), the bytes held, the segments left and the units a joined KIVI / OScaR key or QVG span
records, and how far the two stores' pasts and attention outputs lie apart (the encoders round a few values at cell
boundaries the other way).

    python -m mmkv.kernels.gpu_check_joins [--json out.json] [--only PRESET ...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import mmkv.codecs.base as base
from mmkv.cache import CacheConfig, KVStore

SCALES = (1, 2, 4, 6, 9, 12, 16, 20, 25, 31, 37, 43, 50, 58, 66, 75)  # the AAR's tokens a scale
PRESETS = ["kivi:bits=2,group=32", "kivi:bits=4,group=32", "oscar:bits=2", "oscar:bits=4", "octopus:b=2",
           "octopus:b=4", "turboquant-mse:b=2", "tcq:bits=2", "qvg:bits=2,centroids=16", "qvg:bits=4,centroids=16"]


def rollout(preset: str, kernels: bool, device: torch.device) -> dict:
    lookup = base._KERNEL_LOOKUP
    base._KERNEL_LOOKUP = lookup if kernels else None
    try:
        store = KVStore(CacheConfig(codec=preset, residual_window=1), num_layers=2, num_heads=16, head_dim=64)
        g = torch.Generator(device=device).manual_seed(7)
        outs = []
        for t in SCALES:
            for layer in range(2):
                q, k, v = (torch.randn(2, 16, t, 64, generator=g, device=device).to(torch.bfloat16) for _ in range(3))
                outs.append(store.attend(layer, q, k, v))
                store.append(layer, k, v)
        segs = store.segments(0)
        decode_equal = []
        if kernels and segs[0].encoded:
            for codec, enc in ((store.k_codec(0), segs[0].k_enc), (store.v_codec(0), segs[0].v_enc)):
                got, want = codec.decode(enc, dtype=torch.float32), codec._decode(enc).float()
                decode_equal.append(bool(torch.equal(got, want)))
        return {"outs": outs, "past": store.past(0), "nbytes": store.nbytes(), "segments": len(segs),
                "units": list(segs[0].k_enc.meta.get("units") or []) if segs[0].encoded else [],
                "decode_equal": decode_equal}
    finally:
        base._KERNEL_LOOKUP = lookup


def _max_diff(xs, ys) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(xs, ys))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", help="preset(s) to check (default: all)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check_joins needs a CUDA device (the kernels do not run on the CPU outside the tests)")
    device = torch.device("cuda")
    rows = []
    for preset in args.only or PRESETS:
        t0 = time.perf_counter()
        ref, ker = rollout(preset, False, device), rollout(preset, True, device)
        row = {"preset": preset, "decode_bit_equal_k_v": ker["decode_equal"],
               "nbytes_equal": ker["nbytes"] == ref["nbytes"], "nbytes": ker["nbytes"],
               "segments": ker["segments"], "units": ker["units"],
               "past_max_diff": _max_diff(ker["past"], ref["past"]),
               "attend_max_diff": _max_diff(ker["outs"], ref["outs"]),
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(all(r["decode_bit_equal_k_v"]) and r["nbytes_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
