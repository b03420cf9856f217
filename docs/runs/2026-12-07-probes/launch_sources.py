"""Where the frame-wise loop's extra launches and memsets come from: one profiled rollout per codec, each CUDA runtime
call attributed to its aten op chain (docs/perf.md, run AD). On a CUDA machine with mmkv installed, from another
folder than the checkout: `FRAMES=6 python launch_sources.py none "kivi:bits=2,group=32"` (launch_sources.json
into $OUT or /tmp)."""
import collections, json, os, sys, time
import torch
from mmkv.bench.video import _model
from mmkv.cache import CacheConfig, KVStore
from mmkv.pipelines.common import NoiseStream
from mmkv.pipelines.wan.loop import get_preset, rollout
from torch.profiler import ProfilerActivity, profile

frames = int(os.environ.get("FRAMES", "6"))
codecs = [None if c == "none" else c for c in (sys.argv[1:] or ["none", "kivi:bits=2,group=32"])]
dev = torch.device("cuda")
dit, ctx, heads, hd, layers = _model(False, dev)
preset = get_preset("causal-forcing-frame")

def one(codec):
    store = KVStore(CacheConfig(codec=codec, residual_window=1), num_layers=layers, num_heads=heads, head_dim=hd)
    with torch.no_grad(), store.attach(dit.transformer):
        rollout(dit, preset, ctx, NoiseStream(0, 0), num_frames=frames, latent_height=60, latent_width=104)
    torch.cuda.synchronize()

out = {}
for codec in codecs:
    one(codec); one(codec)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        t0 = time.perf_counter(); one(codec); wall = time.perf_counter() - t0
    by = collections.Counter()
    kinds = collections.Counter()
    for e in prof.events():
        n = e.name
        if not n.startswith(("cudaMemset", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpy")):
            continue
        kind = "memset" if "Memset" in n else ("memcpy" if "Memcpy" in n else "launch")
        kinds[kind] += 1
        chain, p, stack = [], e.cpu_parent, None
        while p is not None:
            if not p.name.startswith("cuda"):
                chain.append(p.name)
            if stack is None and p.stack:
                stack = [f for f in p.stack
                         if ("mmkv" in f or "pipelines" in f or "kernels" in f) and "profiler" not in f]
            p = p.cpu_parent
        src = " <- ".join((stack or [])[:3])
        by[(kind, " > ".join(reversed(chain[:3])), src)] += 1
    rows = [{"kind": k, "ops": c, "src": s, "n": n} for (k, c, s), n in by.most_common(80)]
    out[str(codec)] = {"wall_s": wall, "kinds": dict(kinds), "top": rows}
    print(f"== {codec}: wall {wall:.2f} s, {dict(kinds)}", flush=True)
    for r in rows[:int(os.environ.get("SHOW", "25"))]:
        print(f"{r['n']:6d} {r['kind']:6s} {r['ops'][:90]}\n        {r['src'][:220]}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "launch_sources.json"), "w") as f:
        json.dump(out, f, indent=1)
if len(codecs) == 2:
    a = {(r["kind"], r["ops"]): r["n"] for r in out[str(codecs[0])]["top"]}
    b = {(r["kind"], r["ops"]): r["n"] for r in out[str(codecs[1])]["top"]}
    print("== diff (second - first)")
    for k in sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))[:25]:
        print(b.get(k, 0) - a.get(k, 0), a.get(k, 0), b.get(k, 0), k)
