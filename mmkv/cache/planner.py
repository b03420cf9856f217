"""Equal-memory planning: a rollout's peak KV bytes simulated without holding it, and the longest rolling window
whose measured bytes fit a budget."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mmkv.cache.config import CacheConfig, KVCacheError, is_int
from mmkv.cache.store import KVStore
from mmkv.codecs.base import Codec, Encoded


@dataclass(frozen=True)
class Geometry:
    """What a rollout appends, for planning: `schedule[i]` units in the i-th commit, `unit_tokens` tokens each,
    K/V [batch, num_heads, tokens, head_dim] in `dtype`, over `num_layers` layers."""

    num_layers: int
    num_heads: int
    head_dim: int
    unit_tokens: int
    schedule: tuple[int, ...]
    batch: int = 1
    dtype: torch.dtype = torch.bfloat16

    @property
    def total_units(self) -> int:
        return sum(self.schedule)


class MeasuredCodec:
    """A stand-in for a codec that encodes a shape-only tensor by really encoding a random tensor of its shape once
    (on `probe_device`; cached in `memo` by codec config, shape and dtype): a codec's packed size depends on the
    shape it encodes, never on the values. Every other attribute is the wrapped codec's; the codec is not touched."""

    def __init__(self, codec: Codec, memo: dict, generator: torch.Generator, probe_device: torch.device | str):
        self.codec, self.memo, self.generator, self.probe_device = codec, memo, generator, probe_device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.codec, name)

    def encode(self, x: torch.Tensor) -> Encoded:
        key = (str(self.codec.config), tuple(x.shape), x.dtype)
        if key not in self.memo:
            probe = torch.randn(x.shape, generator=self.generator).to(device=self.probe_device, dtype=x.dtype)
            self.memo[key] = self.codec.encode(probe)
        return self.memo[key]


def simulate_peak_nbytes(
    config: CacheConfig, geometry: Geometry, *, probe_device: torch.device | str = "cpu",
    memo: dict | None = None,
) -> int:
    """`peak_nbytes` of a store with `config` over a rollout of `geometry`, without holding the rollout.

    The store runs its real bookkeeping (residual window, spans, protection, rolling eviction, and before each
    block the joins of the encoded past that attention makes when it reads a layer) on shape-only `meta` K/V, its
    codecs seen through `MeasuredCodec` (one real encode of every distinct span shape). So the number equals the
    `peak_nbytes` of a real rollout that attends before it commits each block (the tests check this).
    """
    store = KVStore(config, num_layers=geometry.num_layers, num_heads=geometry.num_heads,
                    head_dim=geometry.head_dim)
    memo = {} if memo is None else memo
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0)  # a private generator: planning never moves the global RNG
    measured = lambda codec: None if codec is None else MeasuredCodec(codec, memo, gen, probe_device)  # noqa: E731
    store._k_codecs = [measured(c) for c in store._k_codecs]
    store._v_codecs = [measured(c) for c in store._v_codecs]
    shape = (geometry.batch, geometry.num_heads, 0, geometry.head_dim)
    for n in geometry.schedule:
        kv = torch.empty(shape[0], shape[1], n * geometry.unit_tokens, shape[3], dtype=geometry.dtype, device="meta")
        for layer in range(geometry.num_layers):
            store._consolidate(layer, store._layers[layer])  # as the block's attention reads the layer first
            store.append(layer, kv, kv, num_units=n)
    return store.peak_nbytes


@dataclass(frozen=True)
class WindowFit:
    """The outcome of `fit_attention_window`: the store window (None = global attention, nothing evicted), its
    simulated peak bytes, and the budget."""

    attention_window: int | None
    peak_nbytes: int
    budget_nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"attention_window": self.attention_window, "peak_nbytes": self.peak_nbytes,
                "budget_nbytes": self.budget_nbytes}


def fit_attention_window(
    config: CacheConfig, geometry: Geometry, budget_nbytes: int, *, sink_units: int = 0,
    probe_device: torch.device | str = "cpu", memo: dict | None = None,
) -> WindowFit:
    """The longest rolling `attention_window` (units, beside `sink_units` sinks) whose simulated peak bytes fit in
    `budget_nbytes`: equal memory across codecs instead of equal window. `config`'s own window and sinks are replaced.

    Global attention (no eviction, no sinks) when the whole rollout fits. The peak grows with the window except for
    bumps within a span or a commit (with `span_units`, units waiting native for their span may be evicted before it
    fills at short windows, so one window can peak below a shorter one): binary search, then a scan of the next two
    spans' worth of windows past its result. The returned window was itself simulated, so the budget always holds.
    Raises KVCacheError when not even a one-unit window fits.
    """
    if not is_int(budget_nbytes) or budget_nbytes < 1:
        raise KVCacheError(f"fit_attention_window: budget must be a positive number of bytes, got {budget_nbytes!r}")
    if not is_int(sink_units) or sink_units < 0:
        raise KVCacheError(f"fit_attention_window: sink_units must be an int >= 0, got {sink_units!r}")
    memo = {} if memo is None else memo

    def peak(window: int | None) -> int:
        cfg = dataclasses.replace(config, attention_window=window, sink_units=sink_units if window else 0)
        return simulate_peak_nbytes(cfg, geometry, probe_device=probe_device, memo=memo)

    total = geometry.total_units
    whole = peak(None)
    if whole <= budget_nbytes or total <= 1:
        if whole > budget_nbytes:
            raise KVCacheError(f"fit_attention_window: a {total}-unit rollout needs {whole} B, over the budget of "
                               f"{budget_nbytes} B")
        return WindowFit(None, whole, budget_nbytes)
    lo_peak = peak(1)
    if lo_peak > budget_nbytes:
        codec = "native" if config.codec is None else str(config.codec)
        raise KVCacheError(
            f"fit_attention_window: the budget of {budget_nbytes} B is below the {lo_peak} B that the smallest "
            f"rolling window (1 unit + {sink_units} sink units, residual window {config.residual_window}) "
            f"needs with codec {codec}; raise the budget"
        )
    lo, hi, best = 1, total - 1, (1, lo_peak)  # peak(total) == whole > budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        p = peak(mid)
        if p <= budget_nbytes:
            lo, best = mid, (mid, p)
        else:
            hi = mid - 1
    span = max(geometry.schedule) + (KVStore(config, num_layers=1, num_heads=geometry.num_heads,
                                             head_dim=geometry.head_dim).span_units or 0)
    for window in range(best[0] + 1, min(best[0] + 2 * span, total - 1) + 1):
        p = peak(window)
        if p <= budget_nbytes:
            best = (window, p)
    return WindowFit(best[0], best[1], budget_nbytes)
