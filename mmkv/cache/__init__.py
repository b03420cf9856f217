"""The compressed KV store: one per model, one entry per layer, one unit per thing the model commits at once.

A *unit* is what a generator appends to its attention cache in one piece: a latent frame of a video block (1560 tokens
for Wan-1.3B at 480x832), one scale of an AAR audio rollout, a block of tokens. Per layer the store keeps, in time
order:

    [protected units (native) | encoded units (or spans) | native residual window of the newest units]

* An older unit is encoded exactly once, when it leaves the residual window (never re-encoded: error does not
  compound). Protected layers and the first `protected_units` units of a rollout stay native.
* K and V have their own codec instances, one pair per layer, built from the rollout preset by `kv_configs`.
* `nbytes()` counts what is really held (packed payload, side information, native units); `bf16_nbytes()` what a
  bf16 cache of the same tokens would hold; KV× = their ratio, measured, never nominal.
* Attention goes through `mmkv.attention` (decode the layer's past to the store dtype, then SDPA; or a codec's score
  estimator; or a fused kernel on CUDA).

Video (CausVid / Causal Forcing): denoising passes call `attend(layer, q, k_cur, v_cur)` and never write; the t=0
commit pass attends the same way and then calls `append(layer, k_cur, v_cur, num_units=frames_per_block)`. Audio
(AAR): one unit per scale; with the scale appended before attending, `residual_window=1` is "the current scale
native".

The package, one job per module: `config` (CacheConfig, KVCacheError), `store` (KVStore), `segments` (what a layer
holds, how units are grouped for encoding and joined for decoding), `checks` (the lagged device-side checks),
`validate` (input checks), `accounting` (stats and manifest), `planner` (peak bytes without a rollout, the
equal-memory window), `flags` (the command-line flags that build a CacheConfig).
"""

from mmkv.cache.config import CHECKS, CacheConfig, KVCacheError
from mmkv.cache.planner import Geometry, MeasuredCodec, WindowFit, fit_attention_window, simulate_peak_nbytes
from mmkv.cache.store import KVStore

__all__ = [
    "CHECKS", "CacheConfig", "Geometry", "KVCacheError", "KVStore", "MeasuredCodec", "WindowFit",
    "fit_attention_window", "simulate_peak_nbytes",
]
