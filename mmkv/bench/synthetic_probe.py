"""The synthetic probe's protocol, its data and its measurements: reconstruction (MSE, cosine, inner-product error
with the codec's own score estimator, effective bits from the stored bytes) and needle retrieval (softmax mass on a
planted key); `mmkv.bench.synthetic` describes the protocol and runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mmkv.codecs.base import Codec
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.encoded import Encoded
from mmkv.codecs.registry import build
from mmkv.codecs.seeds import derive_seed

ROW_FIELDS = (
    "section", "codec", "config", "bits", "effective_bits", "mse", "mse_se", "cosine", "ip_error", "ip_error_se",
    "ip_bias", "needle_mass", "needle_mass_se", "dim", "seeds", "needle_seeds", "delta", "b_dir", "b_nrm", "matches",
)


@dataclass(frozen=True)
class Protocol:
    dim: int = 128
    seeds: int = 64
    keys: int = 1024
    queries: int = 16
    needle_tokens: int = 2048  # distractors; the needle makes T + 1 keys
    needle_seeds: int = 128
    needle_noise: float = 0.1
    seed: int = 0
    device: str = "cpu"


# ----------------------------------------------------------------------------------------------------------------
# Data (private generators only; never the global RNG)


def _gen(p: Protocol, *keys: Any) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(p.seed, "bench-synthetic", p.dim, *keys))
    return g


def reconstruction_data(p: Protocol) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [S, n, d] and queries [S, m, d], i.i.d. N(0, 1), one private generator per seed."""
    ks, qs = [], []
    for s in range(p.seeds):
        g = _gen(p, "keys", s)
        ks.append(torch.randn(p.keys, p.dim, generator=g))
        qs.append(torch.randn(p.queries, p.dim, generator=g))
    return torch.stack(ks).to(p.device), torch.stack(qs).to(p.device)


def needle_data(p: Protocol) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys [S, T+1, d] with norm sqrt(d), queries [S, 1, d] (needle + 10% relative noise), needle positions [S]."""
    ks, qs, pos = [], [], []
    t = p.needle_tokens + 1
    for s in range(p.needle_seeds):
        g = _gen(p, "needle", s)
        k = torch.randn(t, p.dim, generator=g)
        k = k * (math.sqrt(p.dim) / k.norm(dim=-1, keepdim=True))
        j = int(torch.randint(0, t, (1,), generator=g))
        z = torch.randn(p.dim, generator=g)
        q = k[j] + p.needle_noise * k[j].norm() * z / z.norm()
        ks.append(k)
        qs.append(q[None])
        pos.append(j)
    return torch.stack(ks).to(p.device), torch.stack(qs).to(p.device), torch.tensor(pos, device=p.device)


# ----------------------------------------------------------------------------------------------------------------
# Running a codec over many seeds


def encode_seeds(config: CodecConfig, x: torch.Tensor, p: Protocol, section: str):
    """Yield (codec, encoded, seed) for each seed s of x[S, T, d]: one single-head codec per seed, built with
    seed = derive_seed(--seed, section, s), so every seed has its own rotation (and sketch, and k-means init)."""
    for s in range(x.shape[0]):
        codec = build(config, head_dim=p.dim, seed=derive_seed(p.seed, section, s))
        yield codec, codec.encode(x[s]), s


def _scores(codec: Codec, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
    """q[m, d] -> the codec's own score estimates [m, T] (fp32)."""
    return codec.scores(q, enc).float()


def _mean_se(values: torch.Tensor) -> tuple[float, float | None]:
    """Mean over seeds and its standard error (None from a single seed)."""
    v = values.double()
    se = float(v.std(unbiased=True) / math.sqrt(v.numel())) if v.numel() > 1 else None
    return float(v.mean()), se


def measure_reconstruction(config: CodecConfig, keys: torch.Tensor, queries: torch.Tensor, p: Protocol) -> dict:
    mse, cos, ip, bias = [], [], [], []
    nbytes = numel = 0
    for codec, enc, s in encode_seeds(config, keys, p, "reconstruction"):
        k, q = keys[s], queries[s]
        k_hat = codec.decode(enc, dtype=torch.float32)
        nbytes += codec.nbytes(enc)
        numel += k.numel()
        mse.append((((k - k_hat) ** 2).sum(-1) / (k**2).sum(-1)).mean(-1))
        cos.append(torch.nn.functional.cosine_similarity(k, k_hat, dim=-1, eps=1e-30).mean(-1))
        err = _scores(codec, q, enc) - q @ k.transpose(-1, -2)
        ip.append(err.abs().mean())
        bias.append(err.mean())
    mse_m, mse_se = _mean_se(torch.stack(mse))
    ip_m, ip_se = _mean_se(torch.stack(ip))
    return {
        "effective_bits": 8.0 * nbytes / numel,
        "mse": mse_m,
        "mse_se": mse_se,
        "cosine": float(torch.stack(cos).double().mean()),
        "ip_error": ip_m,
        "ip_error_se": ip_se,
        "ip_bias": float(torch.stack(bias).double().mean()),
    }


def needle_mass_from_scores(scores: torch.Tensor, pos: torch.Tensor, dim: int) -> torch.Tensor:
    """scores [S, 1, T+1] (q.k estimates) -> softmax mass on the needle per seed, logits q.k / sqrt(d)."""
    probs = torch.softmax(scores.double() / math.sqrt(dim), dim=-1)[:, 0, :]
    return probs.gather(-1, pos.view(-1, 1))[:, 0]


def measure_needle(config: CodecConfig | None, keys: torch.Tensor, queries: torch.Tensor, pos: torch.Tensor,
                   p: Protocol) -> tuple[float, float]:
    """Mean (and standard error) softmax mass on the needle; `config=None` is the exact fp32 baseline."""
    if config is None:
        return _mean_se(needle_mass_from_scores(queries @ keys.transpose(-1, -2), pos, p.dim))
    masses = []
    for codec, enc, s in encode_seeds(config, keys, p, "needle"):
        masses.append(needle_mass_from_scores(_scores(codec, queries[s], enc)[None], pos[s : s + 1], p.dim))
    return _mean_se(torch.cat(masses))
