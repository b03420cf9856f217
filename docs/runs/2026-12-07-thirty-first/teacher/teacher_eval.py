"""Score DiT folders' teachers (chunk-wise ODE at guidance 3, as distill's teacher_eval) on this device."""
import json, sys, time
from pathlib import Path
import torch
from mmkv.pipelines.wan.train import get_config
from mmkv.pipelines.wan.distill import score_teacher, ode_grid, loop_timesteps
from mmkv.pipelines.wan.loaders import load_wan
from mmkv.pipelines.training import deterministic_kernels, frozen_copy

n, out = int(sys.argv[1]), Path(sys.argv[2])
dev = torch.device("cuda")
deterministic_kernels(True)
cfg = get_config("tiny", guidance=3.0, dit_object_weight=4.0, shift=2.0, teacher_eval=n)
grid = ode_grid(cfg.ode_steps, cfg.shift, loop_timesteps("causvid") + loop_timesteps("causal-forcing-frame") + [0.0])
res = {}
for name in sys.argv[3:]:
    folder = Path(name)
    comps = load_wan(folder / "causvid", folder / "base", device=dev, dtype=torch.float32)
    comps.dit.eval()
    sampler = frozen_copy(comps.dit).to(torch.bfloat16)
    t = time.perf_counter()
    r = score_teacher(comps, sampler, cfg, grid=grid, device=dev)
    s = r["summary"]
    print(name, round(time.perf_counter() - t, 1), "s", {k: s[k] for k in ("colour_pct", "shape_pct", "direction_pct")},
          {k: (v["right"], v["clips"]) for k, v in s["shape_by_named"].items()}, flush=True)
    res[name] = r
    out.write_text(json.dumps(res, indent=1))
