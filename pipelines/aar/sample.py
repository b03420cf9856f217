"""The AAR generation loop (`autoregressive_infer_cfg`, AAR model/aar.py), returning tokens, the latent and the audio.

Sampling randomness: upstream draws with `torch.multinomial(generator=aar.rng)`, whose stream depends on the device
and cannot be hashed. Here each row's token is drawn by inverse-CDF sampling from ONE float64 uniform, taken from a
private CPU generator seeded by (seed, clip) and hashed as drawn. Every rollout of a clip (reference and each codec)
therefore consumes the identical uniforms in the identical order — B x pn per scale, whatever the logits are — so
tokens differ only where a codec moved the logits enough to move the draw (common random numbers), and the recorded
`noise_sha256` is equal across variants. The same seed gives the same tokens on CPU and CUDA up to logit rounding.
The top-k / top-p filter is upstream's (`sample_with_top_k_top_p_`, modules/helpers.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mmkv.codecs.base import derive_seed
from mmkv.pipelines.aar.model import AAR
from mmkv.pipelines.aar.sat import SAT


@dataclass(frozen=True)
class SamplingConfig:
    """Official inference settings (inference_AAR.py): cfg 4, top-k 200, top-p 0.95."""

    cfg: float = 4.0
    top_k: int = 200
    top_p: float = 0.95

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class SamplingStream:
    """The uniforms of one rollout from a private CPU generator seeded by (seed, key), hashed in order as drawn."""

    def __init__(self, seed: int, key: str):
        self.seed = int(seed)
        self.key = str(key)
        self.derived_seed = derive_seed(self.seed, "aar-sampling", self.key)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.derived_seed)
        self._hash = hashlib.sha256()
        self.scale_sha256: list[str] = []
        self.count = 0

    def uniform(self, n: int) -> torch.Tensor:
        u = torch.rand(n, generator=self.generator, dtype=torch.float64)
        data = u.numpy().tobytes()
        self._hash.update(data)
        self.scale_sha256.append(hashlib.sha256(data).hexdigest())
        self.count += n
        return u

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


def top_k_top_p_filter_(logits_BlV: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Upstream's filter, in place: keep logits >= the k-th largest, then drop the low tail of cumulative
    probability <= 1 - p (always keeping the largest)."""
    V = logits_BlV.shape[-1]
    if top_k > 0:
        kth = logits_BlV.topk(min(top_k, V), largest=True, sorted=False, dim=-1)[0].amin(dim=-1, keepdim=True)
        logits_BlV.masked_fill_(logits_BlV < kth, -torch.inf)
    if top_p > 0:
        sorted_logits, sorted_idx = logits_BlV.sort(dim=-1, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum_(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False
        logits_BlV.masked_fill_(remove.scatter(sorted_idx.ndim - 1, sorted_idx, remove), -torch.inf)
    return logits_BlV


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i] per row (float64), never a zero-probability entry.

    probs (N, V) >= 0, u (N,) in [0, 1). Equivalent in law to `torch.multinomial(probs, 1)`.
    """
    cdf = probs.double().cumsum(dim=-1)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Guard the float edge u * total == total: fall back to the last entry with positive probability.
    V = probs.shape[-1]
    last_pos = torch.where(probs > 0, torch.arange(V, device=probs.device), -1).amax(dim=-1)
    return torch.minimum(idx, last_pos)


@dataclass
class Rollout:
    """One generation: tokens per scale (B, pn) int64, the latent f_hat (B, Cvae, T) fp32, audio (B, 1, samples)."""

    tokens: list[torch.Tensor]
    latent: torch.Tensor
    audio: torch.Tensor
    noise_sha256: str
    scale_noise_sha256: list[str]
    scale_logits_sha256: list[str]  # guided fp32 logits of each scale before filtering: where two rollouts diverge
    sampling_seed: int
    timings: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_flat(self) -> torch.Tensor:
        """Tokens concatenated over scales: (B, L)."""
        return torch.cat(self.tokens, dim=1)

    @property
    def tokens_sha256(self) -> str:
        return hashlib.sha256(self.tokens_flat.cpu().contiguous().numpy().tobytes()).hexdigest()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def rollout(
    aar: AAR,
    sat: SAT,
    cond: torch.Tensor,
    *,
    seed: int,
    key: str,
    sampling: SamplingConfig = SamplingConfig(),
    store: Any = None,
    on_scale: Callable[[int], None] | None = None,
) -> Rollout:
    """Generate from CLAP embeddings `cond` (B, 512). With `store` (an `mmkv.cache.KVStore`) the attention KV cache
    lives in the store (reset here); without one, in the model's own concatenating cache."""
    device = aar.lvl_1L.device
    label_B = cond.to(device=device, dtype=torch.float32)
    if label_B.dim() != 2 or label_B.shape[1] != aar.config.input_dim:
        raise ValueError(f"condition must be (B, {aar.config.input_dim}) CLAP embeddings, got {tuple(label_B.shape)}")
    B = label_B.shape[0]
    stream = SamplingStream(seed, key)
    timings: dict[str, Any] = {"scale_s": []}
    t_start = time.perf_counter()

    cond_BD = aar.condition(label_B)
    lvl_pos = aar.level_positions()
    next_token_map = aar.first_tokens(cond_BD, lvl_pos)
    f_hat = cond_BD.new_zeros(B, aar.Cvae, aar.patch_nums[-1])
    tokens: list[torch.Tensor] = []
    logit_hashes: list[str] = []
    quant = sat.quantizer
    cur_L = 0

    if store is not None:
        store.reset()
        ctx = store.attach(aar)
    else:
        ctx = contextlib.nullcontext()
    aar.kv_caching(True)
    try:
        with ctx:
            for si, pn in enumerate(aar.patch_nums):
                t0 = time.perf_counter()
                cur_L += pn
                logits = aar.step(next_token_map, cond_BD)
                t = sampling.cfg * si / aar.num_stages_minus_1  # guidance ramps from 0 to cfg (AAR model/aar.py)
                logits = (1 + t) * logits[:B] - t * logits[B:]
                logit_hashes.append(hashlib.sha256(logits.detach().cpu().contiguous().numpy().tobytes()).hexdigest())
                top_k_top_p_filter_(logits, sampling.top_k, sampling.top_p)
                probs = logits.softmax(dim=-1).view(-1, aar.V)
                idx = inverse_cdf_sample(probs, stream.uniform(B * pn)).view(B, pn)
                tokens.append(idx)
                h = quant.embedding(idx, si).reshape(B, aar.Cvae, pn)
                f_hat, next_token_map = quant.get_next_autoregressive_input(si, f_hat, h)
                if si != aar.num_stages_minus_1:
                    nxt = next_token_map.view(B, aar.Cvae, -1).transpose(1, 2)
                    nxt = aar.word_embed(nxt) + lvl_pos[:, cur_L: cur_L + aar.patch_nums[si + 1]]
                    next_token_map = nxt.repeat(2, 1, 1)  # CFG doubles the batch
                _sync(device)
                timings["scale_s"].append(time.perf_counter() - t0)
                if on_scale is not None:
                    on_scale(si)
    finally:
        aar.kv_caching(False)
    timings["transformer_s"] = time.perf_counter() - t_start
    t0 = time.perf_counter()
    latent = f_hat.clone()
    audio = sat.fhat_to_audio(f_hat)
    _sync(device)
    timings["decode_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    return Rollout(
        tokens=[t.cpu() for t in tokens],
        latent=latent.float().cpu(),
        audio=audio.float().cpu(),
        noise_sha256=stream.sha256,
        scale_noise_sha256=stream.scale_sha256,
        scale_logits_sha256=logit_hashes,
        sampling_seed=stream.derived_seed,
        timings=timings,
    )
