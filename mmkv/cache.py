"""The compressed KV store: one per model, one entry per layer, one unit per thing the model commits at once.

A *unit* is what a generator appends to its attention cache in one piece: a latent frame of a video block (1560 tokens
for Wan-1.3B at 480x832, video.md §4.3), one scale of an AAR audio rollout (audio.md §5.3), a block of tokens. Per
layer the store keeps, in time order:

    [protected units (native) | encoded units (or spans) | native residual window of the newest units]

* An older unit is encoded exactly once, when it leaves the residual window (never re-encoded: error does not
  compound, audio.md §5.3). Protected layers and the first `protected_units` units of a rollout stay native.
* K and V have their own codec instances, one pair per layer, built from the rollout preset by `kv_configs`.
* `nbytes()` counts what is really held (packed payload, side information, native units); `bf16_nbytes()` what a
  bf16 cache of the same tokens would hold; KV× = their ratio, measured, never nominal (codecs.md §5.8).
* Attention goes through `mmkv.attention` (decode the layer's past to the store dtype, then SDPA; or a codec's score
  estimator; or a fused kernel on CUDA).

Video (CausVid / Causal Forcing): denoising passes call `attend(layer, q, k_cur, v_cur)` and never write; the t=0
commit pass attends the same way and then calls `append(layer, k_cur, v_cur, num_units=frames_per_block)`
(video.md §4.1-4.3). Audio (AAR): one unit per scale; with the scale appended before attending, `residual_window=1`
is "the current scale native" (audio.md §5.3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from mmkv import attention
from mmkv.codecs.base import (
    FLOAT_DTYPES, Codec, CodecConfig, CodecError, Encoded, _kernel, build, concat_tokens, kv_configs, stack_units,
)


class KVCacheError(ValueError):
    """Bad input to the KV store or a bad cache configuration; the message says what was expected and where."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _codec_state_nbytes(codecs: list[Codec]) -> int:
    """Bytes of the codecs' per-layer constants (rotation signs, codebooks, JL sketches, per-device copies).

    Uses `codec.state_nbytes()` where a codec defines it, else walks the instance's tensor attributes (dicts, lists and
    helper objects three levels down), counting each storage once.
    """
    seen: set[tuple[str, int]] = set()
    total = 0

    def walk(obj: Any, depth: int) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            key = (str(obj.device), obj.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
            return
        if depth == 0:
            return
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            items = list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, CodecConfig, torch.dtype)):
            items = list(vars(obj).values())
        else:
            return
        for item in items:
            walk(item, depth - 1)

    for codec in codecs:
        if hasattr(codec, "state_nbytes"):
            total += int(codec.state_nbytes())
        else:
            walk(codec, 3)
    return total


# ----------------------------------------------------------------------------------------------------------------
# Config


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
                      evicting the others (Self-Forcing `local_attn_size` / `sink_size`, video.md §3.4).
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

        need(_is_int(self.value_group) and self.value_group >= 1, "value_group must be a positive int", self.value_group)
        need(
            _is_int(self.residual_window) and self.residual_window >= 0,
            "residual_window must be an int >= 0 (units kept native)",
            self.residual_window,
        )
        need(
            _is_int(self.protected_units) and self.protected_units >= 0,
            "protected_units must be an int >= 0",
            self.protected_units,
        )
        need(_is_int(self.seed), "seed must be an int", self.seed)
        need(
            self.attention_window is None or (_is_int(self.attention_window) and self.attention_window >= 1),
            "attention_window must be None (global attention) or an int >= 1 (units)",
            self.attention_window,
        )
        need(_is_int(self.sink_units) and self.sink_units >= 0, "sink_units must be an int >= 0", self.sink_units)
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
        if not all(_is_int(x) for x in layers):
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


# ----------------------------------------------------------------------------------------------------------------
# Per-layer storage


@dataclass
class _Seg:
    """Units [first_unit, first_unit + len(unit_tokens)) of one layer: native K/V (always one unit) or encoded."""

    first_unit: int
    unit_tokens: tuple[int, ...]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_enc: Encoded | None = None
    v_enc: Encoded | None = None
    skip_units: int = 0  # leading units evicted by the rolling window while the rest of the span is live
    stack: int = 1  # > 1: k_enc / v_enc are `stack` equal units stacked [B, stack, H, T, D] (`stack_units`)
    decoded: tuple[torch.Tensor, torch.Tensor] | None = None  # whole-span decode kept by `reuse_decoded`

    @property
    def encoded(self) -> bool:
        return self.k_enc is not None

    @property
    def end_unit(self) -> int:
        return self.first_unit + len(self.unit_tokens)

    @property
    def num_units(self) -> int:
        return len(self.unit_tokens) - self.skip_units

    @property
    def num_tokens(self) -> int:
        return sum(self.unit_tokens[self.skip_units :])

    @property
    def k_nbytes(self) -> int:
        return self.k_enc.nbytes if self.encoded else self.k.numel() * self.k.element_size()

    @property
    def v_nbytes(self) -> int:
        return self.v_enc.nbytes if self.encoded else self.v.numel() * self.v.element_size()

    @property
    def nbytes(self) -> int:
        return self.k_nbytes + self.v_nbytes


@dataclass
class _Layer:
    segs: list[_Seg] = field(default_factory=list)
    next_unit: int = 0  # index of the next unit to append (units ever appended in this rollout)
    batch: int | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    nbytes: int = 0
    encoded_units: list[int] = field(default_factory=list)  # every unit index handed to encode, in order
    encode_calls: int = 0  # codec.encode calls per tensor (a span is one call)
    evicted_units: int = 0
    k_encoded_nbytes: int = 0  # bytes of encoded K / V currently held, and the elements they stand for
    v_encoded_nbytes: int = 0
    encoded_numel: int = 0  # elements of K held encoded (V has as many)


@dataclass
class _Pending:
    """The device-side checks of one append, read later (CacheConfig.checks = "lagged")."""

    layer: int
    units: list[int]
    flags: torch.Tensor  # host copy (pinned on CUDA): [store NaN/Inf flag, encoder checks...]
    event: Any  # torch.cuda.Event recorded after the copy, or None (CPU: ready at once)
    messages: list[Callable[[], str]]  # an encoder check's message, one per flag after the first


# ----------------------------------------------------------------------------------------------------------------
# Store


class KVStore:
    """Per-layer KV store of one model: native residual window, units encoded once when they leave it."""

    def __init__(self, config: CacheConfig | None = None, *, num_layers: int, num_heads: int, head_dim: int):
        config = CacheConfig() if config is None else config
        if not isinstance(config, CacheConfig):
            raise KVCacheError(f"KVStore: config must be a CacheConfig, got {type(config).__name__}")
        for name, value in (("num_layers", num_layers), ("num_heads", num_heads), ("head_dim", head_dim)):
            if not _is_int(value) or value < 1:
                raise KVCacheError(f"KVStore: {name} must be a positive int, got {value!r}")
        self.config = config
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.k_config, self.v_config = config.codec_configs()
        protected = set()
        for layer in config.protected_layers:
            if not -num_layers <= layer < num_layers:
                raise KVCacheError(
                    f"KVStore: protected layer {layer} out of range for a model with {num_layers} layers "
                    f"(valid: {-num_layers}..{num_layers - 1})"
                )
            protected.add(layer % num_layers)
        self.protected_layers = tuple(sorted(protected))
        self._k_codecs: list[Codec | None] = []
        self._v_codecs: list[Codec | None] = []
        for layer in range(num_layers):
            if self.k_config is None or layer in protected:
                self._k_codecs.append(None)
                self._v_codecs.append(None)
                continue
            self._k_codecs.append(self._build(self.k_config, "K", layer))
            self._v_codecs.append(self._build(self.v_config, "V", layer))
        codecs = [c for c in self._k_codecs + self._v_codecs if c is not None]
        # Span codecs (QVG) encode every group of units that leaves the window in one commit jointly ("commit span",
        # qvg.md §8.1); a codec attribute `span_units = m` instead waits (native) until m units have left.
        self.span = any(c.span_codec for c in codecs)
        spans = {getattr(c, "span_units", None) for c in codecs} - {None}
        if len(spans) > 1:
            raise KVCacheError(f"KVStore: K and V codecs ask for different span_units {sorted(spans)}")
        self.span_units: int | None = spans.pop() if spans else None
        # Token-local codecs encode a run of units exactly as unit by unit (see CacheConfig.merge_units).
        # Not for score-estimator keys on their own path (attention != "decode"): `scores_lse` unpacks a whole
        # segment once per query chunk, so one long segment would cost quadratically in the past.
        scored = config.attention != "decode" and any(c.has_scores for c in codecs)
        self.merge = (config.merge_units and config.attention_window is None and not self.span and bool(codecs)
                      and all(c.token_local for c in codecs) and not scored)
        # Codecs that group over tokens (KIVI / OScaR keys) encode unit by unit; with every codec stackable, attention
        # stacks a layer's equal encoded units instead and decodes them in one call per K and V.
        self.stack = (config.merge_units and config.attention_window is None and not self.span and bool(codecs)
                      and not self.merge and all(c.stackable or c.token_local for c in codecs) and not scored)
        if self.span_units is not None and (not _is_int(self.span_units) or self.span_units < 1):
            raise KVCacheError(f"KVStore: codec span_units must be a positive int, got {self.span_units!r}")
        self.reset()

    def _build(self, cfg: CodecConfig, which: str, layer: int) -> Codec:
        try:
            return build(cfg, head_dim=self.head_dim, num_heads=self.num_heads, layer=layer, seed=self.config.seed)
        except CodecError as err:
            raise KVCacheError(
                f"KVStore: cannot build the {which} codec {cfg} for layer {layer} "
                f"(num_heads={self.num_heads}, head_dim={self.head_dim}): {err}"
            ) from err

    # -- rollout lifecycle -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new rollout: drop every unit and reset all statistics (codec instances are kept: same seed)."""
        self._layers = [_Layer() for _ in range(self.num_layers)]
        self._on_kernels_cache: dict[tuple[int, str, str], bool] = {}
        self._held = 0
        self._peak = 0
        self._scratch_peak = 0
        self._decoded_peak = 0
        self._pending: list[_Pending] = []  # lagged checks not read yet, oldest first
        self._invalid: str | None = None  # a lagged check failed: the message every later call raises

    @property
    def is_native(self) -> bool:
        """True when nothing is ever encoded (codec None)."""
        return self.k_config is None

    def k_codec(self, layer: int) -> Codec | None:
        return self._k_codecs[self._check_layer(layer)]

    def v_codec(self, layer: int) -> Codec | None:
        return self._v_codecs[self._check_layer(layer)]

    # -- writing -----------------------------------------------------------------------------------------------
    def append(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        num_units: int = 1,
        *,
        first_unit: int | None = None,
    ) -> None:
        """Commit `num_units` units of post-RoPE K and raw V, k/v [B, H, T, D], T split evenly into the units.

        Units that leave the residual window (old ones, or some of these if num_units > residual_window) are encoded
        now, exactly once. `first_unit`, if given, must be the index of the next unit of this layer (a check that the
        pipeline commits in order: a block committed twice or skipped is an error).
        """
        layer = self._check_layer(layer)
        st = self._layers[layer]
        where = f"KVStore.append(layer={layer})"
        self._poll()
        self._check_kv(st, k, v, where, "k", "v")
        if not _is_int(num_units) or num_units < 1:
            raise KVCacheError(f"{where}: num_units must be a positive int, got {num_units!r}")
        tokens = k.shape[2]
        if tokens == 0 or tokens % num_units:
            raise KVCacheError(
                f"{where}: {tokens} tokens cannot be split evenly into num_units={num_units} units "
                f"(k is [B, H, T, D] = {list(k.shape)})"
            )
        if first_unit is not None and first_unit != st.next_unit:
            raise KVCacheError(
                f"{where}: appending units out of order: first_unit={first_unit} but this layer holds units "
                f"0..{st.next_unit - 1} of the rollout, so the next unit is {st.next_unit} (reset() starts a rollout)"
            )
        per = tokens // num_units
        first, total = st.next_unit, st.next_unit + num_units
        new = {
            first + i: (k[:, :, i * per : (i + 1) * per].detach(), v[:, :, i * per : (i + 1) * per].detach())
            for i in range(num_units)
        }

        # 1. Which units leave the native window now. Units the rolling window evicts in this append are dropped
        #    first, so an evicted unit is never encoded for nothing.
        live = self._live_predicate(total)
        natives = {s.first_unit: s for s in st.segs if not s.encoded and live(s.first_unit)}
        new = {u: t for u, t in new.items() if live(u)}
        leaving = sorted(u for u in list(natives) + list(new) if not self._stays_native(layer, u, total))

        # 2. Encode them (exactly once) before touching the store, so a failing encode leaves it as it was.
        #    Validity checks that live on the device (NaN/Inf in the input, side information overflowing fp16) are
        #    read together, in one host sync for the whole append, when the Triton encoders run; otherwise at once.
        staged = []
        groups = self._groups(leaving)
        encoding = [u for group in groups for u in group]  # a span codec may keep a short leftover native
        deferred = self._on_kernels(layer, k.device, "encode") and bool(encoding)
        nonfinite = self._nonfinite(encoding, natives, new)
        # deferred: the flag is read after the encodes; otherwise now (a NaN/Inf lets the codecs' own scans name it)
        assume_finite = deferred or nonfinite is None or not bool(nonfinite)
        checks: list[tuple[list[int], torch.Tensor, Any]] = []
        for group in groups:
            defer: list | None = [] if deferred else None
            try:
                staged.append(self._encode(layer, group, natives, new, assume_finite, defer))
            except CodecError as err:
                if deferred and nonfinite is not None and bool(nonfinite):
                    self._refuse_nonfinite(where, layer, groups, natives, new)
                raise KVCacheError(f"{where}: encoding units {group} failed; nothing was stored: {err}") from err
            checks += [(group, bad, message) for bad, message in defer or []]
        if deferred and nonfinite is not None:
            flags = torch.stack([nonfinite.reshape(())] + [bad.reshape(()) for _, bad, _ in checks])
            if self._lagged(k.device):
                self._defer_checks(layer, encoding, flags, [message for _, _, message in checks])
            else:
                values = flags.tolist()
                if values[0]:
                    self._refuse_nonfinite(where, layer, groups, natives, new)
                for (group, _, message), bad in zip(checks, values[1:]):
                    if bad:
                        raise KVCacheError(f"{where}: encoding units {group} failed; nothing was stored: {message()}")
            del checks  # their messages may hold tensors of the encodes

        # 3. Commit: evict, swap encoded segments in for their native sources, add the rest of the new units
        #    natively (a copy: a view would pin the caller's whole block).
        if st.batch is None:
            st.batch, st.dtype, st.device = k.shape[0], k.dtype, k.device
        st.evicted_units += num_units - len(new)  # new units already outside the rolling window
        self._evict(st, live)
        for seg, sources, numel in staged:
            st.segs.append(seg)
            self._add_bytes(st, seg.nbytes)  # the encoded copy exists before the native one is freed: count both
            st.k_encoded_nbytes += seg.k_nbytes
            st.v_encoded_nbytes += seg.v_nbytes
            st.encoded_numel += numel
            st.encoded_units.extend(range(seg.first_unit, seg.end_unit))
            st.encode_calls += 1
        for seg, sources, _ in staged:
            for src in sources:
                st.segs.remove(src)
                self._add_bytes(st, -src.nbytes)
        encoded = {u for seg, _, _ in staged for u in range(seg.first_unit, seg.end_unit)}
        for unit, (ku, vu) in new.items():
            if unit in encoded:
                continue
            seg = _Seg(
                unit,
                (per,),
                k=ku.clone(memory_format=torch.contiguous_format),
                v=vu.clone(memory_format=torch.contiguous_format),
            )
            st.segs.append(seg)
            self._add_bytes(st, seg.nbytes)
        st.segs.sort(key=lambda s: s.first_unit)
        st.next_unit = total

    def _live_predicate(self, total: int):
        window, sinks = self.config.attention_window, self.config.sink_units
        if window is None:
            return lambda unit: True
        return lambda unit: unit < sinks or unit >= total - window

    def _stays_native(self, layer: int, unit: int, total: int) -> bool:
        return (
            self._k_codecs[layer] is None
            or unit < self.config.protected_units
            or unit >= total - self.config.residual_window
        )

    def _groups(self, leaving: list[int]) -> list[list[int]]:
        """Units encoded together: runs of consecutive units for span codecs (never straddling the sink boundary, so
        eviction only ever trims a span from its old end) and for token-local codecs under `merge_units`; one each
        otherwise."""
        if not (self.span or self.merge):
            return [[u] for u in leaving]
        runs: list[list[int]] = []
        for u in leaving:
            if runs and u == runs[-1][-1] + 1 and not u == self.config.sink_units:
                runs[-1].append(u)
            else:
                runs.append([u])
        if self.span_units is None:
            return runs
        m = self.span_units
        return [run[i : i + m] for run in runs for i in range(0, len(run) - len(run) % m, m)]

    @staticmethod
    def _nonfinite(leaving: list[int], natives: dict[int, _Seg], new: dict[int, tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor | None:
        """A 0-d bool tensor: does any K/V element of the units about to be encoded hold NaN/Inf? One reduction for
        the whole append instead of one scan (and host sync) per codec call; None when there is nothing to scan
        (no units, or `simulate_peak_nbytes`' shape-only tensors). When it is set the codecs scan again and the first
        one to find a NaN/Inf names it."""
        tensors = [t for u in leaving for t in (new[u] if u in new else (natives[u].k, natives[u].v))]
        if not tensors or tensors[0].device.type == "meta":
            return None
        return ~torch.stack([torch.isfinite(t).all() for t in tensors]).all()

    def _refuse_nonfinite(self, where: str, layer: int, groups: list[list[int]], natives: dict[int, _Seg],
                          new: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The store's NaN/Inf flag is set: encode again with the codecs' own scans, so that the first to meet the
        NaN/Inf names it (codec, layer, count); nothing is stored either way."""
        for group in groups:
            try:
                self._encode(layer, group, natives, new, False, None)
            except CodecError as err:
                raise KVCacheError(f"{where}: encoding units {group} failed; nothing was stored: {err}") from err
        raise KVCacheError(f"{where}: units {[u for g in groups for u in g]} hold NaN/Inf values; nothing was stored")

    def _on_kernels(self, layer: int, device: torch.device, op: str) -> bool:
        """Whether this layer's codecs run Triton kernels for `op` on `device` (decided once per layer, device and op:
        it is asked on every attention call). Encoders: they take NaN/Inf without failing, so their checks and the
        store's NaN scan can be read after them, together. Decoders: they write into the gather buffer."""
        key = (layer, str(device), op)
        if key not in self._on_kernels_cache:
            self._on_kernels_cache[key] = all(_kernel(c, op, device) is not None
                                    for c in (self._k_codecs[layer], self._v_codecs[layer]) if c is not None)
        return self._on_kernels_cache[key]

    # -- lagged checks (CacheConfig.checks) ----------------------------------------------------------------------
    def _lagged(self, device: torch.device) -> bool:
        mode = self.config.checks
        return mode == "lagged" or (mode == "auto" and device.type == "cuda")

    def _defer_checks(self, layer: int, units: list[int], flags: torch.Tensor,
                      messages: list[Callable[[], str]]) -> None:
        """Queue this append's device-side checks ([store NaN/Inf flag, one flag per message]): copied to pinned host
        memory behind the work that computes them, with an event that says when the copy has landed (no host sync)."""
        event = None
        if flags.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flags.device))
        else:
            host = flags
        self._pending.append(_Pending(layer, units, host, event, messages))

    def _poll(self, block: bool = False) -> None:
        """Read the lagged checks whose copies have landed (all of them with `block`, waiting for each one's own
        event, not for the whole device); raise KVCacheError on the first that failed, and on every call after it
        until `reset()`."""
        if self._invalid is not None:
            raise KVCacheError(self._invalid)
        while self._pending:
            p = self._pending[0]
            if p.event is not None:
                if block:
                    p.event.synchronize()
                elif not p.event.query():
                    return
            self._pending.pop(0)
            flags = p.flags.tolist()
            if flags[0]:
                problem = "hold NaN/Inf values"
            else:
                problem = next((message() for message, bad in zip(p.messages, flags[1:]) if bad), None)
            if problem is not None:
                self._pending.clear()
                self._invalid = (
                    f"KVStore (checks={self.config.checks!r}): units {p.units} of layer {p.layer}, encoded at an "
                    f"earlier append, failed a check read after they were stored: {problem}. This rollout's cache is "
                    f"invalid: reset() starts a new one (CacheConfig(checks='eager') refuses such an append before "
                    f"storing anything, at one host sync per append)"
                )
                raise KVCacheError(self._invalid)

    def check(self) -> None:
        """Read every pending lagged check now (waiting for the GPU to reach them); KVCacheError if one failed."""
        self._poll(block=True)

    def _encode(
        self,
        layer: int,
        group: list[int],
        natives: dict[int, _Seg],
        new: dict[int, tuple[torch.Tensor, torch.Tensor]],
        finite: bool = False,
        defer: list | None = None,
    ) -> tuple[_Seg, list[_Seg], int]:
        """Encode one group of consecutive units; returns (encoded segment, native segments it replaces, K numel)."""
        ks, vs, sources = [], [], []
        for unit in group:
            if unit in new:
                ku, vu = new[unit]
            else:
                src = natives[unit]
                ku, vu = src.k, src.v
                sources.append(src)
            ks.append(ku)
            vs.append(vu)
        k = ks[0] if len(ks) == 1 else torch.cat(ks, dim=2)
        v = vs[0] if len(vs) == 1 else torch.cat(vs, dim=2)
        kc, vc = self._k_codecs[layer], self._v_codecs[layer]
        seg = _Seg(group[0], tuple(t.shape[2] for t in ks), k_enc=kc.encode(k, assume_finite=finite, defer=defer),
                   v_enc=vc.encode(v, assume_finite=finite, defer=defer))
        return seg, sources, k.numel()

    def _evict(self, st: _Layer, live) -> None:
        for seg in list(st.segs):
            units = range(seg.first_unit + seg.skip_units, seg.end_unit)
            dead = [u for u in units if not live(u)]
            if not dead:
                continue
            st.evicted_units += len(dead)
            if len(dead) == len(units):
                st.segs.remove(seg)
                self._add_bytes(st, -seg.nbytes)
                if seg.encoded:
                    st.k_encoded_nbytes -= seg.k_nbytes
                    st.v_encoded_nbytes -= seg.v_nbytes
                    st.encoded_numel -= math.prod(seg.k_enc.shape)
            else:  # a span partly out of the window stays held, its old units hidden (qvg.md §4.1)
                assert dead == list(units[: len(dead)]), "eviction must trim a span from its old end"
                seg.skip_units += len(dead)

    def _add_bytes(self, st: _Layer, delta: int) -> None:
        st.nbytes += delta
        self._held += delta
        self._peak = max(self._peak, self._held)

    # -- reading -----------------------------------------------------------------------------------------------
    def segments(self, layer: int) -> list[attention.Segment]:
        """The layer's past in time order, as `mmkv.attention.Segment`s (what attention and kernels read)."""
        layer = self._check_layer(layer)
        kc, vc = self._k_codecs[layer], self._v_codecs[layer]
        st = self._layers[layer]
        self._consolidate(layer, st)
        reuse = self.config.reuse_decoded and kc is not None and not kc.has_scores
        out = []
        for s in st.segs:
            if s.encoded:
                skip = sum(s.unit_tokens[: s.skip_units])
                seg = attention.Segment(k_enc=s.k_enc, v_enc=s.v_enc, k_codec=kc, v_codec=vc, skip_tokens=skip,
                                        stack=s.stack)
                if reuse:
                    if s.decoded is None:
                        s.decoded = attention.Segment(k_enc=s.k_enc, v_enc=s.v_enc, k_codec=kc, v_codec=vc,
                                                      stack=s.stack).decode(st.dtype)
                        self._decoded_peak = max(self._decoded_peak, self.decoded_nbytes())
                    seg = attention.Segment(k=s.decoded[0][..., skip:, :], v=s.decoded[1][..., skip:, :])
                out.append(seg)
            else:
                out.append(attention.Segment(k=s.k, v=s.v))
        return out

    def _consolidate(self, layer: int, st: _Layer) -> None:
        """Under `merge_units`, join the layer's encoded segments into one (`concat_tokens`: the same bytes, so the
        same decode), so that attention decodes the whole encoded past in one call per K and V. Done when attention
        first reads a layer after new segments arrived (once per layer and block); skipped when a segment's packed
        rows do not end on a byte, and under `reuse_decoded` (its decodes are kept per segment). Codecs that group
        over tokens (KIVI / OScaR keys) are stacked instead (`stack_units`: equal units on a new axis, the same
        bytes). While the tensors are copied the old ones still exist: that transient is counted in
        `scratch_peak_nbytes`."""
        if not (self.merge or self.stack) or self.config.reuse_decoded:
            return
        idx = [i for i, s in enumerate(st.segs) if s.encoded]
        if len(idx) < 2 or idx != list(range(idx[0], idx[-1] + 1)):
            return
        segs = [st.segs[i] for i in idx]
        if any(a.end_unit != b.first_unit or a.skip_units or b.skip_units for a, b in zip(segs, segs[1:])):
            return
        stack = 1
        if self.merge:
            k_enc = concat_tokens(self._k_codecs[layer], [s.k_enc for s in segs])
            v_enc = concat_tokens(self._v_codecs[layer], [s.v_enc for s in segs]) if k_enc is not None else None
        else:
            k_enc = stack_units([s.k_enc for s in segs])
            v_enc = stack_units([s.v_enc for s in segs]) if k_enc is not None else None
            stack = 0 if v_enc is None else k_enc.shape[1]
            if v_enc is not None and (v_enc.shape[1] != stack or stack != sum(len(s.unit_tokens) for s in segs)):
                v_enc = None  # a segment of several units (not one unit each) cannot be a stack entry
        if v_enc is None:
            return
        joined = _Seg(segs[0].first_unit, tuple(t for s in segs for t in s.unit_tokens), k_enc=k_enc, v_enc=v_enc,
                      stack=stack)
        old = sum(s.nbytes for s in segs)
        if joined.nbytes != old:  # concat_tokens only joins exact layouts; anything else is a bug
            raise KVCacheError(f"layer {layer}: joining encoded segments changed their bytes "
                               f"({old} -> {joined.nbytes})")
        self._scratch_peak = max(self._scratch_peak, old)
        st.segs[idx[0] : idx[-1] + 1] = [joined]

    def decoded_nbytes(self) -> int:
        """Bytes of the decodes kept by `reuse_decoded` (0 when it is off)."""
        return sum(
            s.decoded[0].numel() * s.decoded[0].element_size() * 2
            for st in self._layers for s in st.segs if s.decoded is not None
        )

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference: every stored unit decoded to the store dtype, concatenated: K, V [B, H, Tpast, D]."""
        layer = self._check_layer(layer)
        st = self._layers[layer]
        self._poll()
        if not st.segs:
            raise KVCacheError(self._empty_message(layer, "KVStore.past"))
        segs = self.segments(layer)
        self._note_scratch(layer, st, segs, None)
        return attention.gather(segs, None, None, st.dtype)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k_cur: torch.Tensor | None = None,
        v_cur: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention of q [B, H, Tq, D] over [stored units | current block] -> [B, H, Tq, D] (no mask).

        k_cur/v_cur [B, H, Tc, D] are attended but not stored (append them in the commit pass).
        """
        layer = self._check_layer(layer)
        st = self._layers[layer]
        where = f"KVStore.attend(layer={layer})"
        self._poll()
        if (k_cur is None) != (v_cur is None):
            raise KVCacheError(f"{where}: give both k_cur and v_cur or neither")
        if k_cur is not None:
            self._check_kv(st, k_cur, v_cur, where, "k_cur", "v_cur")
        if not st.segs and k_cur is None:
            raise KVCacheError(self._empty_message(layer, where))
        self._check_q(st, q, k_cur, where)
        if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
            raise KVCacheError(f"{where}: scale must be a positive number or None (1/sqrt(D)), got {scale!r}")
        segs = self.segments(layer)
        self._note_scratch(layer, st, segs, k_cur)
        return attention.attend(q, segs, k_cur, v_cur, scale=scale, backend=self.config.attention)

    def _note_scratch(self, layer: int, st: _Layer, segs: list[attention.Segment], k_cur: torch.Tensor | None
                      ) -> None:
        # Upper bound of what the reference allocates besides SDPA's own workspace: the gathered K and V buffers of
        # [past | current] plus one encoded segment's decode (shape arithmetic, not an allocator reading).
        ref_batch = st.batch if st.batch is not None else k_cur.shape[0]
        ref_dtype = st.dtype if st.dtype is not None else k_cur.dtype
        per_token = 2 * ref_batch * self.num_heads * self.head_dim * ref_dtype.itemsize
        total = sum(s.num_tokens for s in segs) + (0 if k_cur is None else k_cur.shape[2])
        # A Triton decoder writes straight into the gather buffer (`Codec.decode(out=...)`); the torch reference
        # decodes a segment (after `_consolidate`, the whole encoded past) into a temporary first.
        direct = self._on_kernels(layer, st.device if st.device is not None else k_cur.device, "decode")
        # a span partly evicted by the rolling window is decoded whole and copied, kernels or not
        # (a stack of units is decoded whole and copied into token order)
        biggest = max((s.num_tokens + s.skip_tokens for s in segs
                       if s.encoded and (s.skip_tokens or s.stack > 1 or not direct)), default=0)
        self._scratch_peak = max(self._scratch_peak, per_token * (total + biggest))

    # -- counts and bytes --------------------------------------------------------------------------------------
    def num_units(self, layer: int) -> int:
        """Units of this layer visible to attention (evicted ones excluded)."""
        return sum(s.num_units for s in self._layers[self._check_layer(layer)].segs)

    def num_tokens(self, layer: int) -> int:
        return sum(s.num_tokens for s in self._layers[self._check_layer(layer)].segs)

    def num_native_units(self, layer: int) -> int:
        return sum(s.num_units for s in self._layers[self._check_layer(layer)].segs if not s.encoded)

    def encoded_units(self, layer: int) -> list[int]:
        """Every unit index this layer has handed to its codecs, in order (each at most once)."""
        return list(self._layers[self._check_layer(layer)].encoded_units)

    def nbytes(self) -> int:
        """Bytes really held: encoded payload and side information, native units, over all layers."""
        return self._held

    def bf16_nbytes(self) -> int:
        """Bytes a bf16 cache of the same visible tokens would hold: 2 bytes per K and V element."""
        return sum(
            2 * 2 * st.batch * self.num_heads * self.head_dim * sum(s.num_tokens for s in st.segs)
            for st in self._layers
            if st.batch is not None
        )

    @property
    def kv_ratio(self) -> float:
        """Measured KV× = bf16_nbytes / nbytes (nan while the store is empty)."""
        held = self.nbytes()
        return self.bf16_nbytes() / held if held else float("nan")

    @property
    def peak_nbytes(self) -> int:
        """The most bytes held at any moment of the rollout (an encoded unit and its native copy both count while
        both exist)."""
        return self._peak

    @property
    def scratch_peak_nbytes(self) -> int:
        """The largest decode scratch one `attend`/`past` call needed (one layer's [past | current] K and V in the
        store dtype plus one encoded segment's decode)."""
        return self._scratch_peak

    def stats(self) -> dict[str, Any]:
        """Measured facts of the rollout so far: per-layer counts, byte split and effective bits (after reading
        every pending lagged check: the figures of an invalid cache are not reported)."""
        self.check()
        k_enc = sum(st.k_encoded_nbytes for st in self._layers)
        v_enc = sum(st.v_encoded_nbytes for st in self._layers)
        numel = sum(st.encoded_numel for st in self._layers)
        held_numel = sum(
            2 * st.batch * self.num_heads * self.head_dim * sum(s.num_tokens for s in st.segs)
            for st in self._layers
            if st.batch is not None
        )
        ratio = self.kv_ratio
        return {
            "encodes_per_layer": [len(st.encoded_units) for st in self._layers],
            "encode_calls_per_layer": [st.encode_calls for st in self._layers],
            "units_per_layer": [self.num_units(i) for i in range(self.num_layers)],
            "native_units_per_layer": [self.num_native_units(i) for i in range(self.num_layers)],
            "tokens_per_layer": [self.num_tokens(i) for i in range(self.num_layers)],
            "evicted_units_per_layer": [st.evicted_units for st in self._layers],
            "k_payload_nbytes": k_enc,
            "v_payload_nbytes": v_enc,
            "native_nbytes": self._held - k_enc - v_enc,
            "nbytes": self._held,
            "bf16_nbytes": self.bf16_nbytes(),
            "peak_nbytes": self._peak,
            "scratch_peak_nbytes": self._scratch_peak,
            "decoded_nbytes": self.decoded_nbytes(),  # reuse_decoded: decodes held beside the compressed bytes
            "decoded_peak_nbytes": self._decoded_peak,
            "kv_ratio": None if math.isnan(ratio) else ratio,
            # per-layer codec constants, independent of context length and rebuilt from the seed: reported, not in
            # nbytes (a fused kernel keeps them resident, so quote them next to KV× at short contexts)
            "codec_state_nbytes": _codec_state_nbytes([c for c in self._k_codecs + self._v_codecs if c is not None]),
            # bits per encoded K (V) element, side information included; None until something is encoded
            "k_effective_bits": 8.0 * k_enc / numel if numel else None,
            "v_effective_bits": 8.0 * v_enc / numel if numel else None,
            # bits per held K/V element over the whole store (native window and protected units included)
            "effective_bits": 8.0 * self._held / held_numel if held_numel else None,
        }

    def manifest(self) -> dict[str, Any]:
        """JSON-able record of how the cache was stored and what it measured."""
        stats = self.stats()
        return {
            **self.config.to_dict(),
            "protected_layers": list(self.protected_layers),
            "span_codec": self.span,
            "span_units": self.span_units,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "tokens_per_layer": stats["tokens_per_layer"],
            "nbytes": stats["nbytes"],
            "bf16_nbytes": stats["bf16_nbytes"],
            "peak_nbytes": stats["peak_nbytes"],
            "scratch_peak_nbytes": stats["scratch_peak_nbytes"],
            "decoded_peak_nbytes": stats["decoded_peak_nbytes"],
            "kv_ratio": stats["kv_ratio"],
            "k_payload_nbytes": stats["k_payload_nbytes"],
            "v_payload_nbytes": stats["v_payload_nbytes"],
            "native_nbytes": stats["native_nbytes"],
            "codec_state_nbytes": stats["codec_state_nbytes"],
            "k_effective_bits": stats["k_effective_bits"],
            "v_effective_bits": stats["v_effective_bits"],
            "effective_bits": stats["effective_bits"],
        }

    # -- attaching to a model ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attach(self, model: torch.nn.Module) -> Iterator["KVStore"]:
        """Point every module with an int `mmkv_layer` at this store (`m.mmkv_store = self`); restore on exit."""
        if not isinstance(model, torch.nn.Module):
            raise KVCacheError(f"KVStore.attach: expected a torch.nn.Module, got {type(model).__name__}")
        targets = [m for m in model.modules() if _is_int(getattr(m, "mmkv_layer", None))]
        if not targets:
            raise KVCacheError(
                f"KVStore.attach: no module of {type(model).__name__} has an int `mmkv_layer` attribute; install the "
                "mmkv attention processors first"
            )
        for m in targets:
            if not 0 <= m.mmkv_layer < self.num_layers:
                raise KVCacheError(
                    f"KVStore.attach: module {type(m).__name__} has mmkv_layer={m.mmkv_layer}, but the store has "
                    f"{self.num_layers} layers (0..{self.num_layers - 1})"
                )
        _absent = object()
        saved = [(m, m.__dict__.get("mmkv_store", _absent)) for m in targets]
        try:
            for m in targets:
                m.mmkv_store = self
            yield self
            self.check()  # a rollout that ends with a failed lagged check must not look finished
        finally:
            for m, old in saved:
                if old is _absent:
                    m.__dict__.pop("mmkv_store", None)
                else:
                    m.mmkv_store = old

    # -- validation --------------------------------------------------------------------------------------------
    def _check_layer(self, layer: Any) -> int:
        if not _is_int(layer) or not 0 <= layer < self.num_layers:
            raise KVCacheError(f"KVStore: layer must be an int in 0..{self.num_layers - 1}, got {layer!r}")
        return layer

    def _empty_message(self, layer: int, where: str) -> str:
        return (
            f"{where}: layer {layer} holds nothing in this rollout (never written since reset()) and no current "
            "block was given"
        )

    def _check_kv(self, st: _Layer, k: Any, v: Any, where: str, kname: str, vname: str) -> None:
        for name, t in ((kname, k), (vname, v)):
            if not isinstance(t, torch.Tensor):
                raise KVCacheError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in FLOAT_DTYPES:
                raise KVCacheError(f"{where}: {name} must be a float tensor, got {t.dtype}")
        expect = f"[B, {self.num_heads}, T, {self.head_dim}]"
        if k.dim() != 4 or k.shape[1] != self.num_heads or k.shape[3] != self.head_dim:
            hint = ""
            if k.dim() == 4 and k.shape[2] == self.num_heads and k.shape[3] == self.head_dim:
                hint = " (it looks like [B, T, H, D]: transpose(1, 2) first)"
            raise KVCacheError(f"{where}: {kname} must be {expect}, got {list(k.shape)}{hint}")
        if v.shape != k.shape:
            raise KVCacheError(f"{where}: {vname} shape {list(v.shape)} differs from {kname} shape {list(k.shape)}")
        if v.dtype != k.dtype:
            raise KVCacheError(f"{where}: {vname} dtype {v.dtype} differs from {kname} dtype {k.dtype}")
        if v.device != k.device:
            raise KVCacheError(f"{where}: {vname} is on {v.device} but {kname} on {k.device}")
        if st.batch is not None:
            if k.shape[0] != st.batch:
                raise KVCacheError(f"{where}: batch {k.shape[0]} differs from the stored units' batch {st.batch}")
            if k.dtype != st.dtype:
                raise KVCacheError(f"{where}: {kname} dtype {k.dtype} differs from the stored units' dtype {st.dtype}")
            if k.device != st.device:
                raise KVCacheError(f"{where}: {kname} is on {k.device} but the stored units on {st.device}")

    def _check_q(self, st: _Layer, q: Any, ref: torch.Tensor | None, where: str) -> None:
        if not isinstance(q, torch.Tensor):
            raise KVCacheError(f"{where}: q must be a torch.Tensor, got {type(q).__name__}")
        batch = st.batch if st.batch is not None else ref.shape[0]
        dtype = st.dtype if st.dtype is not None else ref.dtype
        device = st.device if st.device is not None else ref.device
        expect = f"[{batch}, {self.num_heads}, Tq, {self.head_dim}]"
        if q.dim() != 4 or q.shape[0] != batch or q.shape[1] != self.num_heads or q.shape[3] != self.head_dim:
            raise KVCacheError(f"{where}: q must be {expect}, got {list(q.shape)}")
        if q.dtype != dtype:
            raise KVCacheError(f"{where}: q dtype {q.dtype} differs from the K/V dtype {dtype}")
        if q.device != device:
            raise KVCacheError(f"{where}: q is on {q.device} but K/V on {device}")

    def __repr__(self) -> str:
        codec = "native" if self.k_config is None else f"K={self.k_config}, V={self.v_config}"
        return (
            f"KVStore({codec}, layers={self.num_layers}, heads={self.num_heads}, head_dim={self.head_dim}, "
            f"window={self.config.residual_window}, held={self._held} B)"
        )


# ----------------------------------------------------------------------------------------------------------------
# Equal-memory planning: the longest rolling window whose measured bytes fit a budget


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


def simulate_peak_nbytes(
    config: CacheConfig, geometry: Geometry, *, probe_device: torch.device | str = "cpu",
    memo: dict | None = None,
) -> int:
    """`peak_nbytes` of a store with `config` over a rollout of `geometry`, without holding the rollout.

    The store runs its real bookkeeping (residual window, spans, protection, rolling eviction) on shape-only `meta`
    K/V, and each codec's bytes are measured by really encoding a random tensor of every distinct span shape once on
    `probe_device` (cached in `memo` by codec config, shape and dtype): a codec's packed size depends on the shape it
    encodes, never on the values. So the number equals the `peak_nbytes` of the real rollout (the tests check this).
    """
    store = KVStore(config, num_layers=geometry.num_layers, num_heads=geometry.num_heads,
                    head_dim=geometry.head_dim)
    memo = {} if memo is None else memo
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0)  # a private generator: planning never moves the global RNG

    def measured(codec: Codec):
        real = codec.encode

        def encode(x: torch.Tensor, **_: Any) -> Encoded:
            key = (str(codec.config), tuple(x.shape), x.dtype)
            if key not in memo:
                probe = torch.randn(x.shape, generator=gen).to(device=probe_device, dtype=x.dtype)
                memo[key] = real(probe)
            return memo[key]

        return encode

    for codec in store._k_codecs + store._v_codecs:
        if codec is not None:
            codec.encode = measured(codec)  # this throwaway store's own instances only
    shape = (geometry.batch, geometry.num_heads, 0, geometry.head_dim)
    for n in geometry.schedule:
        kv = torch.empty(shape[0], shape[1], n * geometry.unit_tokens, shape[3], dtype=geometry.dtype, device="meta")
        for layer in range(geometry.num_layers):
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
    if not _is_int(budget_nbytes) or budget_nbytes < 1:
        raise KVCacheError(f"fit_attention_window: budget must be a positive number of bytes, got {budget_nbytes!r}")
    if not _is_int(sink_units) or sink_units < 0:
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
