"""Tiny random AAR + SAT configurations for tests and the offline demo: same code paths, CPU-cheap.

* `tiny`: the full 16-scale schedule (L = 455, 1 s of audio), depth 2 (C = 128, 2 heads of
  64), SAT dimension = latent_dim = 16, n_filters 32.
* `micro`: scales (1, 2, 3, 5) (L = 11, 1 600 samples), two phi convs, and (our addition) a SEANet
  with n_filters 8 so a decode costs milliseconds. Keys and code paths are the released ones.

Weights come from a private generator and are re-initialised so attention over the KV cache matters (gamma 1, head
gain 1; AAR model/aar.py `init_weights`) and the codebooks are random (upstream's k-means path starts them at zero);
otherwise codec effects would be invisible.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mmkv.codecs.base import private_generator
from mmkv.pipelines.aar.loaders import save_released_format
from mmkv.pipelines.aar.model import AAR, AARConfig, build_aar
from mmkv.pipelines.aar.sat import SAT, SATConfig, build_sat

MICRO_SCALES = (1, 2, 3, 5)

CONFIGS: dict[str, tuple[AARConfig, SATConfig]] = {
    "tiny": (AARConfig(depth=2, cvae=16), SATConfig(dimension=16, latent_dim=16)),
    "micro": (
        AARConfig(depth=2, patch_nums=MICRO_SCALES, cvae=16),
        SATConfig(multi_scale=MICRO_SCALES, phi_kernel=(9, 9), dimension=16, latent_dim=16, n_filters=8),
    ),
}


def build_tiny(kind: str = "micro", seed: int = 0, device: torch.device | str = "cpu") -> tuple[AAR, SAT]:
    """Random tiny models in eval mode, deterministic given `seed`, without touching the global RNG."""
    if kind not in CONFIGS:
        raise ValueError(f"unknown tiny configuration {kind!r}; known: {sorted(CONFIGS)}")
    aar_cfg, sat_cfg = CONFIGS[kind]
    aar = build_aar(aar_cfg, "meta").to_empty(device="cpu")
    aar.init_weights(private_generator(seed, "tiny-aar", kind), init_adaln=0.5, init_adaln_gamma=1.0, init_head=1.0)
    sat = build_sat(sat_cfg, "meta").to_empty(device="cpu")
    sat.init_weights(private_generator(seed, "tiny-sat", kind))
    return aar.to(device).eval().requires_grad_(False), sat.to(device).eval().requires_grad_(False)


def write_tiny_checkpoints(directory: str | os.PathLike, kind: str = "micro", seed: int = 0,
                           prefix: str = "module.") -> tuple[Path, Path]:
    """Write `AAR_<kind>.pth` / `SAT_<kind>.pth` in the released container format (DDP `module.` prefix by default)."""
    aar, sat = build_tiny(kind, seed)
    d = Path(directory)
    return (save_released_format(aar, d / f"AAR_{kind}.pth", prefix=prefix),
            save_released_format(sat, d / f"SAT_{kind}.pth", prefix=prefix))


def random_condition(n: int = 1, seed: int = 0, dim: int = 512) -> torch.Tensor:
    """Seeded unit-norm CLAP-like embeddings (n, dim): a stub conditioner for tests."""
    x = torch.randn(n, dim, generator=private_generator(seed, "tiny-condition"))
    return x / x.norm(dim=-1, keepdim=True)
