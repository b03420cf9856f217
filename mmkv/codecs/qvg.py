"""Quant VideoGen (QVG, Xi et al., ICML 2026, arXiv 2602.02958): a span codec for video KV caches.

For every (leading index, head) of a span x[..., H, N, D] (the release's `quant_videogen/real/prq.py`: per layer, K or
V, batch element and head, all tokens of the span jointly):

1. Semantic-aware smoothing, repeated for `stages` stages (progressive residual quantisation, `prq.py`): k-means with
   `centroids` centres over the span's tokens (`kmeans/`: init = `centroids` token indices drawn uniformly *with
   replacement* from a private generator, Lloyd assign/update, empty clusters keep their centre, early stop when
   fewer than `tol` of the ids changed, at most `iters` iterations), then subtract each token's nearest centre.
   Centres are bf16, ids uint8 (`real/smooth.py`).
2. The final residual is quantised per token in blocks of `block` channels (`real/quant_pack.py`): symmetric absmax with
   qmax = 2^(b-1) - 1 (INT2 is ternary {-1, 0, 1}, INT4 uses -7..7), the scale rounded to FP8 E4M3 *before* the
   division, round half away from zero; or, with `asymmetric`, min-max over 2^b - 1 levels with an E4M3 zero-point.

Decode (`real/accumulate.py`): x^ = dequant(residual) + sum_s C_s[id_s], accumulated in fp32 in that order, then cast.

Stored per span (`nbytes` counts them all): packed codes (b bits a value), E4M3 scales (and zeros) per
block, one uint8 id per token, head and stage, and each stage's bf16 centre table:
bits/value = b + 8/block * (1 + asym) + stages * 8/D + stages * centroids * 16/N. INT2, D = 128, block 64, 256
centres and a 4680-token span (one 3-frame Wan chunk): 2.1875 + 4096/4680 = 3.06 bits.

Deliberate choices (docs/decisions.md): centre sums are accumulated in fp64 (order-independent, so
deterministic on any device, where the release uses fp32 atomics); the init generator is reseeded per encode
from (codec seed, layer, stage), never the global RNG (the release's Self-Forcing path shares it with
the sampler); a zero E4M3 scale stores the zero code;
scales are clamped to the E4M3 maximum 448; codes use the project's one bit-packing layout (little-endian stream,
`mmkv.codecs.packing`), not the release's MSB-first bytes (same byte count); blocks that do not divide D end in a
shorter block (the release requires block | D).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from mmkv.codecs.base import Codec, CodecError, Encoded, _kernel, private_generator
from mmkv.codecs.checks import inputs_checked
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.groupquant import group_min_max, num_groups
from mmkv.codecs.packing import pack_bits, unpack_bits

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-10  # the release's lower clamp before the E4M3 cast (quant_pack.py)
MAX_CENTROIDS = 256  # ids are uint8 (prq.py asserts ids < 256)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype residuals are formed in: the input's own (bf16 on GPU, like the release), fp32 for fp64 input."""
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


# ----------------------------------------------------------------------------------------------------------------
# k-means (semantic-aware smoothing, `quant_videogen/kmeans/`)


def init_indices(seed: int, layer: int, stage: int, problems: int, tokens: int, centroids: int) -> torch.Tensor:
    """Init token indices [problems, centroids], uniform with replacement, from a generator reseeded per encode."""
    g = private_generator(seed, "qvg-kmeans-init", layer, stage)
    return torch.randint(0, tokens, (problems, centroids), generator=g, dtype=torch.int64)


@functools.lru_cache(maxsize=4096)
def device_init_indices(seed: int, layer: int, stage: int, problems: int, tokens: int, centroids: int,
                        device: str) -> torch.Tensor:
    """`init_indices` on `device`, kept per argument: the same every encode (the generator is reseeded), and a fresh
    copy from host memory on each encode would be a blocking transfer (a host sync on CUDA). Kept across codec
    instances, since a sweep builds its stores (and codecs) afresh per rollout: 480 encodes of the d16 AAR's rollout
    drew and compared their inits on the host every time before. Read-only (an index)."""
    return init_indices(seed, layer, stage, problems, tokens, centroids).to(device)


def sq_norms(x: torch.Tensor) -> torch.Tensor:
    """||x||^2 over the last dim in fp32 (x [..., D] in any float dtype)."""
    xf = x.float()
    return (xf * xf).sum(-1)


def assign_reference(points: torch.Tensor, centroids: torch.Tensor, x_sq: torch.Tensor,
                     c_sq: torch.Tensor) -> torch.Tensor:
    """Nearest centre of every point: argmin_k max(||x||^2 + ||c_k||^2 - 2 x.c_k, 0), ties to the lowest k.

    points [P, N, D] (any float dtype), centroids [P, K, D] bf16, x_sq [P, N], c_sq [P, K] fp32 -> ids int64 [P, N].
    """
    dot = torch.bmm(points.float(), centroids.float().transpose(1, 2))
    d = (x_sq.unsqueeze(-1) + c_sq.unsqueeze(-2)) - 2.0 * dot
    return d.clamp_(min=0.0).argmin(dim=-1)  # argmin returns the first minimum


def update_centroids(points: torch.Tensor, ids: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster means -> bf16, empty clusters keep their old centre (kmeans_euclid.py line 23).

    Sums are accumulated in fp64, which is exact for bf16/fp32 inputs of ordinary range, so the result does not depend
    on the summation order (the release's fp32 atomics make it nondeterministic); the mean is
    divided in fp64, rounded to fp32, then to bf16. The counts ride along as one more column of ones, so sums and
    counts are one scatter. Returns (centres [P, K, D] bf16, counts [P, K] int64).
    """
    p, n, d = points.shape
    k = old.shape[1]
    ext = torch.ones(p, n, d + 1, dtype=torch.float64, device=points.device)
    ext[..., :d] = points
    sums = torch.zeros(p, k, d + 1, dtype=torch.float64, device=points.device)
    sums.scatter_add_(1, ids.unsqueeze(-1).expand(p, n, d + 1), ext)
    counts = sums[..., d]  # exact: integers below 2^53
    mean = (sums[..., :d] / counts.clamp(min=1).unsqueeze(-1)).float().to(torch.bfloat16)
    return torch.where(counts.unsqueeze(-1) > 0, mean, old), counts.long()


def stop_limit(total: int, tol: float) -> int:
    """The early stop's rule as a count: the fraction of ids changed, changed / total in fp64 (correctly rounded, as
    torch's CPU mean of a bool tensor), is below `tol` exactly when changed < stop_limit(total, tol). The division is
    monotone in the count, so this is the smallest count whose fraction reaches tol (0 for tol 0: never stop)."""
    c = max(0, int(tol * total) - 2)
    while c > 0 and (c - 1) / total >= tol:
        c -= 1
    while c <= total and c / total < tol:
        c += 1
    return c


def kmeans(
    points: torch.Tensor,
    init: torch.Tensor,
    iters: int,
    tol: float,
    trace: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Lloyd's k-means as released (`kmeans/`) on P problems at once: points [P, N, D], init centres [P, K, D] bf16.

    From the second iteration on, when the fraction of ids (over all P problems: one batched call, one decision)
    that changed is below `tol`, stop and return this iteration's ids with its *pre-update* centres; otherwise the
    centres become the new means. Without an early stop the last ids come back with the means computed from them.
    The fraction is compared as a count (`stop_limit`). The last iteration's decision only picks between those two
    centre tables, so it is made on the device (`torch.where`, no host sync); only earlier iterations, where it
    decides whether to go on, read it on the host. With the released 2 iterations no call syncs. `trace`, when
    given, receives (points, centres, ids) for every assignment. `kernels/qvg_kmeans.py` holds the kernel
    twin. Returns (ids int64 [P, N], centres bf16 [P, K, D], iterations run).
    """
    x_sq = sq_norms(points)
    limit = stop_limit(points.shape[0] * points.shape[1], tol)
    c = init
    prev = None
    for it in range(iters):
        ids = assign_reference(points, c, x_sq, sq_norms(c))
        if trace is not None:
            trace.append((points, c, ids))
        new, _ = update_centroids(points, ids, c)
        if prev is not None:
            stop = (ids != prev).sum() < limit
            if it + 1 == iters:
                return ids, torch.where(stop, c, new), iters
            if stop.item():
                return ids, c, it + 1
        c, prev = new, ids
    return ids, c, iters


@functools.lru_cache(maxsize=256)
def centre_bases(units: tuple[int, ...], centroids: int, device: torch.device) -> torch.Tensor:
    """Joined spans (`QVGCodec.join_units`): each token's first centre in the joined table, u * centroids for a
    token of span u; int64 [sum(units)], kept per (units, centroids, device), read only."""
    bases = torch.arange(len(units)) * centroids
    return torch.repeat_interleave(bases, torch.tensor(units)).to(device)


def gather_centroids(centroids: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """C[id] per token: centroids [..., K, D], ids [..., N] -> [..., N, D] (centroid dtype)."""
    idx = ids.long().unsqueeze(-1).expand(*ids.shape, centroids.shape[-1])
    return torch.gather(centroids, -2, idx)


def subtract(residual: torch.Tensor, centroids: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """residual - C[id], computed in fp32 and rounded to the residual's dtype (the release's `minus_centroid`)."""
    return (residual.float() - gather_centroids(centroids, ids).float()).to(residual.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Residual quantiser (`quant_videogen/real/quant_pack.py`, `_quant_pack_kernel`)


def round_half_away(y: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (CUDA `libdevice.round`), exactly: |y| - floor(|y|) is exact in floating point."""
    a = y.abs()
    t = a.floor()
    return torch.copysign(t + (a - t >= 0.5).to(y.dtype), y)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> FP8 E4M3 (round to nearest even), clamped to +-448 first: the release does not guard the overflow,
    which would turn into NaN."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def expand_blocks(p: torch.Tensor, block: int, d: int) -> torch.Tensor:
    """Per-block values [..., ceil(D/block)] -> per-channel [..., D] (a shorter last block is cut)."""
    return p.repeat_interleave(block, dim=-1)[..., :d]


def quantize_residual(
    r: torch.Tensor, bits: int, block: int, asymmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """r [..., N, D] -> (unsigned codes int64 [..., N, D], scales E4M3 [..., N, nb], zeros E4M3 or None).

    Symmetric: s = e4m3(max(absmax / qmax, 1e-10)), q = clamp(round_half_away(r / s), -qmax, qmax), code = q + qmax;
    a block whose scale rounds to 0 stores the zero code (decodes to 0). Asymmetric: s = e4m3((max - min) / (2^b - 1)),
    z = e4m3(min), code = clamp(round_half_away((r - z) / s), 0, 2^b - 1) (code 0 when s = 0).
    """
    d = r.shape[-1]
    r = r.float()
    mn, mx = group_min_max(r, block)
    if asymmetric:
        levels = (1 << bits) - 1
        scale = to_e4m3(((mx - mn) / levels).clamp(min=SCALE_FLOOR))
        zero = to_e4m3(mn)
        s = expand_blocks(scale.float(), block, d)
        z = expand_blocks(zero.float(), block, d)
        y = (r - z) / torch.where(s > 0, s, torch.ones_like(s))
        q = round_half_away(y).clamp(0, levels)
        q = torch.where(s > 0, q, torch.zeros_like(q))
        return q.to(torch.int64), scale, zero
    qmax = (1 << (bits - 1)) - 1
    absmax = torch.maximum(mx.abs(), mn.abs())
    scale = to_e4m3((absmax / qmax).clamp(min=SCALE_FLOOR))
    s = expand_blocks(scale.float(), block, d)
    y = r / torch.where(s > 0, s, torch.ones_like(s))
    q = round_half_away(y).clamp(-qmax, qmax)
    q = torch.where(s > 0, q, torch.zeros_like(q))
    return (q + qmax).to(torch.int64), scale, None


def dequantize_residual(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                        block: int) -> torch.Tensor:
    """fp32 residual: (code - qmax) * s (symmetric) or code * s + z (asymmetric)."""
    d = codes.shape[-1]
    s = expand_blocks(scale.float(), block, d)
    if zero is not None:
        return codes.float() * s + expand_blocks(zero.float(), block, d)
    qmax = (1 << (bits - 1)) - 1
    return (codes - qmax).float() * s


# ----------------------------------------------------------------------------------------------------------------
# The codec


@dataclass(frozen=True)
class QVGConfig(CodecConfig):
    """Defaults are the released per-chunk setting: 1 stage, 64-channel blocks, 256 centres, 2 k-means iterations,
    tol 1e-4, symmetric. `span_units=m` makes the cache wait until m units have left its native window and encode
    them as one span (the official quant_factor); 0 = every commit's leaving units form one span."""

    name: ClassVar[str] = "qvg"
    aliases: ClassVar[dict[str, str]] = {"b": "bits", "k": "centroids", "kc": "centroids", "group": "block",
                                         "g": "block", "s": "stages", "asym": "asymmetric", "span": "span_units"}
    bits: int = 2
    centroids: int = 256
    block: int = 64
    stages: int = 1
    iters: int = 2
    tol: float = 1e-4
    asymmetric: bool = False
    span_units: int = 0

    def __post_init__(self) -> None:
        self.check_choice("bits", (2, 4))
        self.check_int("centroids", 1, MAX_CENTROIDS)
        self.check_int("block", 1)
        self.check_int("stages", 0, 8)
        self.check_int("iters", 1)
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol <= 1:
            self.fail(f"tol must be a number in [0, 1] (fraction of ids changed), got {tol!r}")
        self.set("tol", float(tol))
        if self.asymmetric not in (True, False) or isinstance(self.asymmetric, float):  # a config prints a bool 0/1
            self.fail(f"asymmetric must be true or false (1 or 0), got {self.asymmetric!r}")
        self.set("asymmetric", bool(self.asymmetric))
        self.check_int("span_units", 0)


class QVGCodec(Codec):
    """QVG: per-span k-means smoothing (bf16 centres, uint8 ids) + block-scaled INT2/INT4 residuals (E4M3 scales);
    parameters: `QVGConfig`."""

    config_class = QVGConfig
    display_name = "QVG"
    span_codec = True
    # Each span's encoding holds its own centres: spans of equal length stack as independent rows (`stack_units`),
    # the per-stage ids and centres on their axis 2 (after the stage and batch axes).
    stackable = True
    stack_axes = {"ids": 2, "centroids": 2}
    # ... and spans of any lengths (an AAR's scales) join along the tokens (`join_units`), each field on its axis
    join_axes = {"codes": -1, "scales": -2, "zeros": -2, "ids": -1, "centroids": -2}

    @classmethod
    def value_config(cls, config, group: int = 32):
        return config  # V is clustered separately with the same settings (cache_num_v_centroids = _k_ in the release)

    def setup(self) -> None:
        cfg = self.config
        self.bits, self.centroids, self.block, self.stages, self.iters = (cfg.bits, cfg.centroids, cfg.block,
                                                                          cfg.stages, cfg.iters)
        self.tol, self.asymmetric = cfg.tol, cfg.asymmetric
        self.span_units = cfg.span_units or None  # read by mmkv.cache.KVStore
        self.qmax = (1 << (self.bits - 1)) - 1

    @property
    def joins_units(self) -> bool:
        """Whether spans of unequal length join (`join_units`): with at least one stage (the centres tell the
        spans apart) and codes that fill whole bytes a token."""
        return self.stages >= 1 and (self.head_dim * self.bits) % 8 == 0

    def units(self, enc: Encoded) -> tuple[int, ...] | None:
        """The token counts of the spans `join_units` joined into `enc` (None for one span or a stack)."""
        return enc.meta.get("units")

    def join_units(self, encs: list[Encoded]) -> Encoded | None:
        """Consecutive spans of any token counts (an AAR's scales) as one encoding that decodes, bit for bit, as the
        spans do: the code rows (whole bytes a token), scales, zeros and ids concatenated along the tokens, each
        span's centre tables one after the other (`join_axes`); a token of span u finds its centre at u * centroids
        + id (`centre_bases`). The spans' token counts go in `meta["units"]`, their k-means iterations in
        `meta["units_kmeans_iters"]`. The same bytes as the spans. None when it cannot be done exactly: no stage,
        codes that end inside a byte, stacks, differing layouts."""
        if not self.joins_units or len(encs) < 2:
            return None
        first = encs[0]
        if any(len(e.shape) != 4 or tuple(e.shape[:2]) != tuple(first.shape[:2]) or e.shape[-1] != first.shape[-1]
               or e.codec != first.codec or e.dtype != first.dtype or list(e.tensors) != list(first.tensors)
               for e in encs):
            return None
        units = tuple(n for e in encs for n in (self.units(e) or (e.shape[-2],)))
        iters = tuple(it for e in encs
                      for it in e.meta.get("units_kmeans_iters", (tuple(e.meta.get("kmeans_iters", ())),)))
        tensors = {k: torch.cat([e.tensors[k] for e in encs], dim=self.join_axes[k]) for k in first.tensors}
        shape = (*first.shape[:2], sum(units), first.shape[-1])
        return Encoded(first.codec, shape, first.dtype, tensors, {"units": units, "units_kmeans_iters": iters})

    # -- protocol ----------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Encoded:
        # Not Codec.encode: that hands _encode fp32, and QVG forms its residuals in the input dtype (`real/smooth.py`).
        self.check_input(x, finite=not inputs_checked())
        if x.shape[-2] == 0:
            raise CodecError(f"codec {self.config} (layer {self.layer}): a span needs at least one token, got 0")
        kernel = _kernel(self, "encode", x.device)
        enc = kernel(self, x) if kernel is not None else self._encode(x)
        enc.shape, enc.dtype, enc.codec = tuple(x.shape), x.dtype, str(self.config)
        return enc

    def _encode(self, x: torch.Tensor) -> Encoded:
        return self.encode_with(x, self._quantize_reference)

    def _init_indices(self, stage: int, problems: int, tokens: int, device: torch.device) -> torch.Tensor:
        """`init_indices` on `device` (`device_init_indices`)."""
        return device_init_indices(self.seed, self.layer, stage, problems, tokens, self.centroids, str(device))

    def encode_with(self, x: torch.Tensor, quantize: Callable, cluster: Callable = kmeans,
                    trace: list | None = None) -> Encoded:
        """The encode pipeline with pluggable k-means (`kmeans` or its kernel twin, called as
        cluster(points, init, iters, tol, trace)) and final subtract+quantise+pack (the Triton kernel); `trace`
        receives every assignment (points, centres, ids), stage after stage."""
        *lead, n, d = x.shape
        problems = 1
        for s in lead:
            problems *= s
        residual = x.detach().reshape(problems, n, d).to(work_dtype(x.dtype)).contiguous()
        ids_all, cents_all, iters = [], [], []
        for stage in range(self.stages):
            idx = self._init_indices(stage, problems, n, x.device)
            init = torch.gather(residual, 1, idx.unsqueeze(-1).expand(problems, self.centroids, d))
            ids, cents, it = cluster(residual, init.to(torch.bfloat16), self.iters, self.tol, trace)
            ids_all.append(ids)
            cents_all.append(cents)
            iters.append(it)
            if stage + 1 < self.stages:
                residual = subtract(residual, cents, ids)
        last = (cents_all[-1], ids_all[-1]) if self.stages else None
        tensors = quantize(residual, last)  # codes / scales / zeros of residual - C_last[id_last]
        tensors = {k: v.reshape(*lead, *v.shape[1:]) for k, v in tensors.items()}
        if self.stages:  # one stage (the default): no stack, whose copy would be one more launch an encode
            ids = ids_all[0].unsqueeze(0) if self.stages == 1 else torch.stack(ids_all)
            cents = cents_all[0].unsqueeze(0) if self.stages == 1 else torch.stack(cents_all)
            tensors["ids"] = ids.to(torch.uint8).reshape(self.stages, *lead, n)  # the kernels' ids are uint8 already
            tensors["centroids"] = cents.reshape(self.stages, *lead, self.centroids, d)
        return Encoded(str(self.config), tuple(x.shape), x.dtype, tensors, meta={"kmeans_iters": iters})

    def _quantize_reference(self, residual: torch.Tensor, last) -> dict[str, torch.Tensor]:
        if last is not None:
            residual = subtract(residual, *last)
        codes, scale, zero = quantize_residual(residual, self.bits, self.block, self.asymmetric)
        p, n, d = codes.shape
        out = {"codes": pack_bits(codes.reshape(p, n * d), self.bits), "scales": scale.contiguous()}
        if zero is not None:
            out["zeros"] = zero.contiguous()
        return out

    def _decode(self, enc: Encoded) -> torch.Tensor:
        *lead, n, d = enc.shape
        t = enc.tensors
        codes = unpack_bits(t["codes"], self.bits, n * d).reshape(*lead, n, d)
        out = dequantize_residual(codes, t["scales"], t.get("zeros"), self.bits, self.block)
        units = self.units(enc)
        for stage in range(self.stages):  # the release's accumulation order: residual first, then stage by stage
            ids = t["ids"][stage]
            if units:  # joined spans: each span's centres follow the last one's
                ids = ids.long() + centre_bases(units, self.centroids, ids.device)
            out = out + gather_centroids(t["centroids"][stage], ids).float()
        return out

    def expected_bits(self, tokens: int) -> float:
        """Bits per value for a span of `tokens` tokens (packing pads a unit's code stream to a byte)."""
        d = self.head_dim
        nb = num_groups(d, self.block)
        code_bits = 8 * ((tokens * d * self.bits + 7) // 8) / (tokens * d)
        side = 8 * nb * (1 + self.asymmetric) / d
        return code_bits + side + self.stages * 8 / d + self.stages * self.centroids * 16 / tokens
