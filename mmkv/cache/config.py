"""How a rollout's KV cache is stored (`CacheConfig`), and the error every part of the cache raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmkv import attention
from mmkv.codecs.base import CodecConfig, CodecError, kv_configs


class KVCacheError(ValueError):
    """Bad input to the KV store or a bad cache configuration; the message says what was expected and where."""


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


CHECKS = ("auto", "eager", "lagged")


@dataclass(frozen=True)
class CacheConfig:
    """How a rollout's KV cache is stored.

    codec:            rollout preset (`octopus:b=2`, `kivi:...`, `KEY/VALUE`), a CodecConfig, or None = native cache.
    value_group:      V group size for `kv_configs` (32 for video, 16 for audio).
    residual_window:  newest units kept native (per layer).
    protected_layers: layer indices kept native (negative counts from the end: -1 = last layer).
    protected_units:  first N units of a rollout kept native, whatever the codec (attention sinks).
    seed:             codec seed (rotation signs etc.); never the noise seed.
    attention_window: rolling window, None = global: keep only the newest W units plus the first `sink_units`,
                      evicting the others (Self-Forcing's `local_attn_size` / `sink_size`).
    sink_units:       units never evicted by the rolling window (they are encoded unless also protected).
    attention:        "auto" (fused kernel on CUDA when one exists), "reference" (torch; score estimators for
                      codecs that define one) or "decode" (always decode + SDPA); see `mmkv.attention.attend`.
    reuse_decoded:    keep each encoded unit's decode (store dtype) after its first use, so a unit is decoded once
                      per rollout instead of on every attention call (a video block's 3-5 denoising passes, every
                      later block). Faster quality sweeps, same outputs bit for bit; but the decodes are held beside
                      the compressed bytes (`decoded_nbytes` in stats, not in nbytes), so memory is not saved. Off
                      (default): decode per call into one layer's scratch. Key codecs with a score estimator keep
                      using it (their encoded form is what they score).
    merge_units:      with global attention (no rolling window) and token-local K and V codecs (each token encoded
                      on its own: OCTOPUS, TurboQuant-MSE, PolarQuant, identity, per-token group quantisers), encode
                      the consecutive units that leave the window in one append as one segment (default). Decodes are
                      bit-identical to unit-by-unit encoding; a segment of 3 frames instead of 3 segments means 3x
                      fewer encode calls. When attention reads the layer, its encoded segments are also joined into
                      one (the same bytes, concatenated; skipped where a packed row would not end on a byte), so the
                      whole encoded past is decoded in one call per K and V. Codecs that group over tokens (KIVI /
                      OScaR keys) encode unit by unit, and their encoded units are stacked on a new axis instead
                      (the same bytes; decoded in one call per K and V, then copied into token order). Rolling
                      windows (which evict unit by unit) always encode, hold and decode unit by unit.
    checks:           when the device-side checks of an append (NaN/Inf in the units being encoded, side information
                      overflowing fp16) are read, on the Triton path. "eager": before the append commits (one host
                      sync per append; a failing append stores nothing). "lagged": copied to the host asynchronously
                      and read at a later store call once the GPU has passed them (no sync); a failure then raises
                      there, naming the layer, units and problem, and the rollout's cache is invalid until
                      `reset()`; `check()`, `stats()` and leaving `attach` read every pending check. "auto"
                      (default): lagged on CUDA, eager elsewhere. The torch reference path always checks eagerly.
    """

    codec: str | CodecConfig | None = None
    value_group: int = 32
    residual_window: int = 1
    protected_layers: tuple[int, ...] = ()
    protected_units: int = 0
    seed: int = 0
    attention_window: int | None = None
    sink_units: int = 0
    attention: str = "auto"
    reuse_decoded: bool = False
    merge_units: bool = True
    checks: str = "auto"

    def __post_init__(self) -> None:
        def need(ok: bool, what: str, value: Any) -> None:
            if not ok:
                raise KVCacheError(f"CacheConfig: {what}, got {value!r}")

        need(is_int(self.value_group) and self.value_group >= 1, "value_group must be a positive int", self.value_group)
        need(
            is_int(self.residual_window) and self.residual_window >= 0,
            "residual_window must be an int >= 0 (units kept native)",
            self.residual_window,
        )
        need(
            is_int(self.protected_units) and self.protected_units >= 0,
            "protected_units must be an int >= 0",
            self.protected_units,
        )
        need(is_int(self.seed), "seed must be an int", self.seed)
        need(
            self.attention_window is None or (is_int(self.attention_window) and self.attention_window >= 1),
            "attention_window must be None (global attention) or an int >= 1 (units)",
            self.attention_window,
        )
        need(is_int(self.sink_units) and self.sink_units >= 0, "sink_units must be an int >= 0", self.sink_units)
        need(isinstance(self.reuse_decoded, bool), "reuse_decoded must be True or False", self.reuse_decoded)
        need(isinstance(self.merge_units, bool), "merge_units must be True or False", self.merge_units)
        need(
            self.sink_units == 0 or self.attention_window is not None,
            "sink_units only makes sense with a rolling attention_window; set attention_window or use protected_units",
            self.sink_units,
        )
        need(self.attention in attention.BACKENDS, f"attention must be one of {attention.BACKENDS}", self.attention)
        need(self.checks in CHECKS, f"checks must be one of {CHECKS}", self.checks)
        layers = self.protected_layers
        if layers is None or isinstance(layers, (int, str)):
            raise KVCacheError(f"CacheConfig: protected_layers must be a sequence of ints, got {layers!r}")
        layers = tuple(layers)
        if not all(is_int(x) for x in layers):
            raise KVCacheError(f"CacheConfig: protected_layers must be a sequence of ints, got {layers!r}")
        object.__setattr__(self, "protected_layers", tuple(sorted(set(layers))))
        need(
            self.codec is None or isinstance(self.codec, (str, CodecConfig)),
            "codec must be a preset string, a CodecConfig or None",
            self.codec,
        )
        self.codec_configs()  # fail now on an unknown codec or parameter, not at the first append

    def codec_configs(self) -> tuple[CodecConfig | None, CodecConfig | None]:
        """(K config, V config); (None, None) for the native cache."""
        if self.codec is None:
            return None, None
        try:
            return kv_configs(self.codec, self.value_group)
        except CodecError as err:
            raise KVCacheError(f"CacheConfig: bad codec preset {str(self.codec)!r}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        k, v = self.codec_configs()
        return {
            "codec": None if self.codec is None else str(self.codec),
            "k_codec": None if k is None else str(k),
            "v_codec": None if v is None else str(v),
            "value_group": self.value_group,
            "residual_window": self.residual_window,
            "protected_layers": list(self.protected_layers),
            "protected_units": self.protected_units,
            "seed": self.seed,
            "attention_window": self.attention_window,
            "sink_units": self.sink_units,
            "reuse_decoded": self.reuse_decoded,
            "merge_units": self.merge_units,
            "checks": self.checks,
            "attention": self.attention,
        }
