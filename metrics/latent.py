"""Latent cosine: how far a compressed rollout's latent drifted from the reference latent, direction only.

Video: the denoised Wan latents of the whole rollout; audio: the SAT continuous latent f_hat, just before
`fhat_to_audio` (AAR model/SAT.py). Both are flattened, so the number is one cosine per rollout, computed in float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _as_float64(x, name: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or numpy array, got {type(x).__name__}")
    return x.detach().to("cpu", torch.float64)


def latent_cosine(reference, test) -> float:
    """cos = <vec(ref), vec(test)> / (||ref|| ||test||); NaN when either latent is all zeros (undefined)."""
    a = _as_float64(reference, "reference latent")
    b = _as_float64(test, "test latent")
    if a.shape != b.shape:
        raise ValueError(f"latent shapes differ: reference {tuple(a.shape)} vs test {tuple(b.shape)}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError("latent contains NaN/Inf values; a cosine of them means nothing")
    na, nb = torch.linalg.vector_norm(a), torch.linalg.vector_norm(b)
    if na == 0 or nb == 0:
        return math.nan
    cos = float(torch.dot(a.flatten(), b.flatten()) / (na * nb))
    return max(-1.0, min(1.0, cos))  # rounding can push |cos| a hair past 1
