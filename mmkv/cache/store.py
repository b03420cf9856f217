"""`KVStore`: the per-layer compressed KV store of one model (see the package docstring for its layout)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch

from mmkv import attention
from mmkv.cache import accounting
from mmkv.cache.checks import CheckQueue, nonfinite
from mmkv.cache.config import CacheConfig, KVCacheError, is_int
from mmkv.cache.segments import LayerState, Seg, group_units, join_encoded, joins_units, live_predicate
from mmkv.cache.validate import check_kv, check_layer, check_q, empty_message
from mmkv.codecs.base import Codec, CodecConfig, CodecError, _kernel, build
from mmkv.codecs.checks import encode_scope

_Units = dict[int, tuple[torch.Tensor, torch.Tensor]]  # unit index -> (K, V) of the units of this append


class KVStore:
    """Per-layer KV store of one model: native residual window, units encoded once when they leave it."""

    def __init__(self, config: CacheConfig | None = None, *, num_layers: int, num_heads: int, head_dim: int):
        config = CacheConfig() if config is None else config
        if not isinstance(config, CacheConfig):
            raise KVCacheError(f"KVStore: config must be a CacheConfig, got {type(config).__name__}")
        for name, value in (("num_layers", num_layers), ("num_heads", num_heads), ("head_dim", head_dim)):
            if not is_int(value) or value < 1:
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
            native = self.k_config is None or layer in protected
            self._k_codecs.append(None if native else self._build(self.k_config, "K", layer))
            self._v_codecs.append(None if native else self._build(self.v_config, "V", layer))
        codecs = [c for c in self._k_codecs + self._v_codecs if c is not None]
        # Span codecs (QVG) encode every group of units that leaves the window in one commit jointly (a "commit
        # span"); a codec attribute `span_units = m` instead waits (native) until m units have left.
        self.span = any(c.span_codec for c in codecs)
        spans = {getattr(c, "span_units", None) for c in codecs} - {None}
        if len(spans) > 1:
            raise KVCacheError(f"KVStore: K and V codecs ask for different span_units {sorted(spans)}")
        self.span_units: int | None = spans.pop() if spans else None
        # Token-local codecs encode a run of units exactly as unit by unit (see CacheConfig.merge_units).
        # Not for score-estimator keys on their own path (attention != "decode"): `scores_lse` unpacks a whole
        # segment once per query chunk, so one long segment would cost quadratically in the past.
        scored = config.attention != "decode" and any(c.has_scores for c in codecs)
        joinable = config.merge_units and config.attention_window is None and bool(codecs)
        self.merge = joinable and not self.span and all(c.token_local for c in codecs) and not scored
        # Codecs that group over tokens (KIVI / OScaR keys) encode unit by unit, span codecs (QVG) commit span by
        # commit span; with every codec stackable, attention stacks a layer's equal encoded units or spans instead
        # and decodes them in one call per K and V.
        self.stack = joinable and not self.merge and all(c.stackable or c.token_local for c in codecs) and not scored
        # ... and where every codec also joins units of any length (KIVI / OScaR keys, `join_units`), units of
        # unequal length (an AAR's scales) join along the tokens instead of staying one segment each
        self.ragged = self.stack and all(joins_units(c) for c in codecs)
        if self.span_units is not None and (not is_int(self.span_units) or self.span_units < 1):
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

    def reset(self) -> None:
        """Start a new rollout: drop every unit and reset all statistics (codec instances are kept: same seed)."""
        self._layers = [LayerState() for _ in range(self.num_layers)]
        self._on_kernels_cache: dict[tuple[int, str, str], bool] = {}
        self._held = 0
        self._peak = 0
        self._scratch_peak = 0
        self._decoded_peak = 0
        self._checks = CheckQueue(self.config.checks)

    def k_codec(self, layer: int) -> Codec | None:
        return self._k_codecs[check_layer(layer, self.num_layers)]

    def v_codec(self, layer: int) -> Codec | None:
        return self._v_codecs[check_layer(layer, self.num_layers)]

    # -- writing -----------------------------------------------------------------------------------------------
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, num_units: int = 1, *,
               first_unit: int | None = None) -> None:
        """Commit `num_units` units of post-RoPE K and raw V, k/v [B, H, T, D], T split evenly into the units.

        Units that leave the residual window (old ones, or some of these if num_units > residual_window) are encoded
        now, exactly once. `first_unit`, if given, must be the index of the next unit of this layer (a check that the
        pipeline commits in order: a block committed twice or skipped is an error).
        """
        layer = check_layer(layer, self.num_layers)
        st = self._layers[layer]
        where = f"KVStore.append(layer={layer})"
        self._checks.poll()
        check_kv(self, st, k, v, where, "k", "v")
        if not is_int(num_units) or num_units < 1:
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
        live = live_predicate(total, self.config.attention_window, self.config.sink_units)
        natives = {s.first_unit: s for s in st.segs if not s.encoded and live(s.first_unit)}
        new = {u: t for u, t in new.items() if live(u)}
        leaving = sorted(u for u in list(natives) + list(new) if not self._stays_native(layer, u, total))

        # 2. Encode them (exactly once) before touching the store, so a failing encode leaves it as it was.
        staged = self._encode_leaving(layer, leaving, natives, new, k.device, where)

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
            seg = Seg(unit, (per,), k=ku.clone(memory_format=torch.contiguous_format),
                      v=vu.clone(memory_format=torch.contiguous_format))
            st.segs.append(seg)
            self._add_bytes(st, seg.nbytes)
        st.segs.sort(key=lambda s: s.first_unit)
        st.next_unit = total

    def _stays_native(self, layer: int, unit: int, total: int) -> bool:
        return (
            self._k_codecs[layer] is None
            or unit < self.config.protected_units
            or unit >= total - self.config.residual_window
        )

    def _encode_leaving(self, layer: int, leaving: list[int], natives: dict[int, Seg], new: _Units,
                        device: torch.device, where: str) -> list[tuple[Seg, list[Seg], int]]:
        """Encode the units that leave the native window, grouped (`group_units`); nothing is stored on failure.
        Validity checks that live on the device (NaN/Inf in the input, side information overflowing fp16) are read
        together, in one host sync for the whole append, when the Triton encoders run, or queued unread
        (`checks="lagged"`); on the torch reference the codecs check at once."""
        staged = []
        groups = group_units(leaving, runs=self.span or self.merge, sink_units=self.config.sink_units,
                             span_units=self.span_units)
        encoding = [u for group in groups for u in group]  # a span codec may keep a short leftover native
        deferred = self._on_kernels(layer, device, "encode") and bool(encoding)
        bad_input = nonfinite(encoding, natives, new)
        # deferred: the flag is read after the encodes; otherwise now (a NaN/Inf lets the codecs' own scans name it)
        assume_finite = deferred or bad_input is None or not bool(bad_input)
        checks: list[tuple[list[int], torch.Tensor, Any]] = []
        for group in groups:
            try:
                with encode_scope(inputs_checked=assume_finite, collect=deferred) as pending:
                    staged.append(self._encode(layer, group, natives, new))
            except CodecError as err:
                if deferred and bad_input is not None and bool(bad_input):
                    self._refuse_nonfinite(where, layer, groups, natives, new)
                raise KVCacheError(f"{where}: encoding units {group} failed; nothing was stored: {err}") from err
            checks += [(group, bad, message) for bad, message in pending or []]
        if deferred and bad_input is not None:
            flags = torch.stack([bad_input.reshape(())] + [bad.reshape(()) for _, bad, _ in checks])
            if self._checks.lagged(device):
                self._checks.defer(layer, encoding, flags, [message for _, _, message in checks])
            else:
                values = flags.tolist()
                if values[0]:
                    self._refuse_nonfinite(where, layer, groups, natives, new)
                for (group, _, message), bad in zip(checks, values[1:]):
                    if bad:
                        raise KVCacheError(f"{where}: encoding units {group} failed; nothing was stored: {message()}")
            del checks  # their messages may hold tensors of the encodes
        return staged

    def _refuse_nonfinite(self, where: str, layer: int, groups: list[list[int]], natives: dict[int, Seg],
                          new: _Units) -> None:
        """The store's NaN/Inf flag is set: encode again with the codecs' own scans, so that the first to meet the
        NaN/Inf names it (codec, layer, count); nothing is stored either way."""
        for group in groups:
            try:
                with encode_scope():  # the codecs' own scans, read at once
                    self._encode(layer, group, natives, new)
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

    def check(self) -> None:
        """Read every pending lagged check now (waiting for the GPU to reach them); KVCacheError if one failed."""
        self._checks.poll(block=True)

    def _encode(self, layer: int, group: list[int], natives: dict[int, Seg], new: _Units
                ) -> tuple[Seg, list[Seg], int]:
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
        seg = Seg(group[0], tuple(t.shape[2] for t in ks), k_enc=kc.encode(k), v_enc=vc.encode(v))
        return seg, sources, k.numel()

    def _evict(self, st: LayerState, live: Callable[[int], bool]) -> None:
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
            else:  # a span partly out of the window stays held, its old units hidden until the whole span is out
                assert dead == list(units[: len(dead)]), "eviction must trim a span from its old end"
                seg.skip_units += len(dead)

    def _add_bytes(self, st: LayerState, delta: int) -> None:
        st.nbytes += delta
        self._held += delta
        self._peak = max(self._peak, self._held)

    # -- reading -----------------------------------------------------------------------------------------------
    def segments(self, layer: int) -> list[attention.Segment]:
        """The layer's past in time order, as `mmkv.attention.Segment`s (what attention and kernels read)."""
        layer = check_layer(layer, self.num_layers)
        kc, vc = self._k_codecs[layer], self._v_codecs[layer]
        st = self._layers[layer]
        self._consolidate(layer, st)
        reuse = self.config.reuse_decoded and kc is not None and not kc.has_scores
        out = []
        for s in st.segs:
            if not s.encoded:
                out.append(attention.Segment(k=s.k, v=s.v))
                continue
            skip = sum(s.unit_tokens[: s.skip_units])
            if reuse:
                if s.decoded is None:
                    s.decoded = attention.Segment(k_enc=s.k_enc, v_enc=s.v_enc, k_codec=kc, v_codec=vc,
                                                  stack=s.stack).decode(st.dtype)
                    self._decoded_peak = max(self._decoded_peak, accounting.decoded_nbytes(self))
                out.append(attention.Segment(k=s.decoded[0][..., skip:, :], v=s.decoded[1][..., skip:, :]))
            else:
                out.append(attention.Segment(k_enc=s.k_enc, v_enc=s.v_enc, k_codec=kc, v_codec=vc, skip_tokens=skip,
                                             stack=s.stack))
        return out

    def _consolidate(self, layer: int, st: LayerState) -> None:
        """Under `merge_units`, join the layer's encoded segments into one (`join_encoded`: the same codes, so the
        same decode), so that attention decodes the whole encoded past in one call per K and V; a stack joins each
        run of equal-length segments (QVG's commit spans after its shorter first one), or the whole encoded past
        where every codec also joins units of unequal length (`ragged`: KIVI / OScaR). Done when attention
        first reads a layer after new segments arrived (once per layer and block); not under `reuse_decoded` (its
        decodes are kept per segment). A join holds the same bytes, or fewer where a bit stream's rows did not end on
        a byte (the padding of each part's last byte goes: `concat_tokens`); the store counts what it then holds.
        While the tensors are copied the old ones still exist: that transient is counted in
        `scratch_peak_nbytes`."""
        if not (self.merge or self.stack) or self.config.reuse_decoded:
            return
        idx = [i for i, s in enumerate(st.segs) if s.encoded]
        if len(idx) < 2 or idx != list(range(idx[0], idx[-1] + 1)):
            return
        if self.merge or self.ragged:
            runs = [idx]  # (ragged: stacked while the lengths are equal, joined along the tokens once they differ)
        else:  # a stack takes equal lengths: QVG's first commit span is shorter than the rest (the residual window)
            runs = []
            for i in idx:
                tokens = st.segs[i].k_enc.shape[-2]
                if runs and st.segs[runs[-1][-1]].k_enc.shape[-2] == tokens:
                    runs[-1].append(i)
                else:
                    runs.append([i])
        for run in reversed([r for r in runs if len(r) > 1]):  # from the end, so that earlier indices hold
            segs = [st.segs[i] for i in run]
            joined = join_encoded(segs, self._k_codecs[layer], self._v_codecs[layer], merge=self.merge)
            if joined is None:
                continue
            old = sum(s.nbytes for s in segs)
            if joined.nbytes > old:  # exact layouts only: a join keeps every byte but a bit stream's padding
                raise KVCacheError(f"layer {layer}: joining encoded segments changed their bytes "
                                   f"({old} -> {joined.nbytes})")
            self._scratch_peak = max(self._scratch_peak, old)
            st.segs[run[0] : run[-1] + 1] = [joined]
            if joined.nbytes < old:
                self._add_bytes(st, joined.nbytes - old)
                st.k_encoded_nbytes += joined.k_nbytes - sum(s.k_nbytes for s in segs)
                st.v_encoded_nbytes += joined.v_nbytes - sum(s.v_nbytes for s in segs)

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference: every stored unit decoded to the store dtype, concatenated: K, V [B, H, Tpast, D]."""
        layer = check_layer(layer, self.num_layers)
        st = self._layers[layer]
        self._checks.poll()
        if not st.segs:
            raise KVCacheError(empty_message(layer, "KVStore.past"))
        segs = self.segments(layer)
        self._note_scratch(layer, st, segs, None)
        return attention.gather(segs, None, None, st.dtype)

    def attend(self, layer: int, q: torch.Tensor, k_cur: torch.Tensor | None = None,
               v_cur: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Attention of q [B, H, Tq, D] over [stored units | current block] -> [B, H, Tq, D] (no mask).

        k_cur/v_cur [B, H, Tc, D] are attended but not stored (append them in the commit pass).
        """
        layer = check_layer(layer, self.num_layers)
        st = self._layers[layer]
        where = f"KVStore.attend(layer={layer})"
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            # event queries, which a CUDA graph capture (pipelines/wan/graphs.py) refuses; the next call reads them
            self._checks.poll()
        if (k_cur is None) != (v_cur is None):
            raise KVCacheError(f"{where}: give both k_cur and v_cur or neither")
        if k_cur is not None:
            check_kv(self, st, k_cur, v_cur, where, "k_cur", "v_cur")
        if not st.segs and k_cur is None:
            raise KVCacheError(empty_message(layer, where))
        check_q(self, st, q, k_cur, where)
        if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
            raise KVCacheError(f"{where}: scale must be a positive number or None (1/sqrt(D)), got {scale!r}")
        segs = self.segments(layer)
        self._note_scratch(layer, st, segs, k_cur)
        return attention.attend(q, segs, k_cur, v_cur, scale=scale, backend=self.config.attention)

    def _note_scratch(self, layer: int, st: LayerState, segs: list[attention.Segment],
                      k_cur: torch.Tensor | None) -> None:
        # Upper bound of what the reference allocates besides SDPA's own workspace: the gathered K and V buffers of
        # [past | current] plus one encoded segment's decode (shape arithmetic, not an allocator reading).
        ref_batch = st.batch if st.batch is not None else k_cur.shape[0]
        ref_dtype = st.dtype if st.dtype is not None else k_cur.dtype
        per_token = 2 * ref_batch * self.num_heads * self.head_dim * ref_dtype.itemsize
        total = sum(s.num_tokens for s in segs) + (0 if k_cur is None else k_cur.shape[2])
        # A Triton decoder writes straight into the gather buffer (`Codec.decode(out=...)`); the torch reference
        # decodes a segment (after `_consolidate`, the whole encoded past) into a temporary first.
        direct = self._on_kernels(layer, st.device if st.device is not None else k_cur.device, "decode")
        # a span partly evicted by the rolling window is decoded whole and copied, kernels or not; a stack of units
        # is written straight into token order by stackable codecs' kernels, decoded and copied by any other
        biggest = max((s.num_tokens + s.skip_tokens for s in segs
                       if s.encoded and (s.skip_tokens or not direct
                                         or (s.stack > 1 and not (s.k_codec.stackable and s.v_codec.stackable)))),
                      default=0)
        self._scratch_peak = max(self._scratch_peak, per_token * (total + biggest))

    # -- counts and bytes --------------------------------------------------------------------------------------
    def num_units(self, layer: int) -> int:
        """Units of this layer visible to attention (evicted ones excluded)."""
        return sum(s.num_units for s in self._layers[check_layer(layer, self.num_layers)].segs)

    def num_tokens(self, layer: int) -> int:
        return self._layers[check_layer(layer, self.num_layers)].visible_tokens()

    def num_native_units(self, layer: int) -> int:
        return sum(s.num_units for s in self._layers[check_layer(layer, self.num_layers)].segs if not s.encoded)

    def encoded_units(self, layer: int) -> list[int]:
        """Every unit index this layer has handed to its codecs, in order (each at most once)."""
        return list(self._layers[check_layer(layer, self.num_layers)].encoded_units)

    def nbytes(self) -> int:
        """Bytes really held: encoded payload and side information, native units, over all layers."""
        return self._held

    def bf16_nbytes(self) -> int:
        """Bytes a bf16 cache of the same visible tokens would hold: 2 bytes per K and V element."""
        return 2 * accounting.visible_numel(self)

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
        """Measured facts of the rollout so far (`mmkv.cache.accounting.stats`)."""
        return accounting.stats(self)

    def manifest(self) -> dict[str, Any]:
        """JSON-able record of how the cache was stored and what it measured."""
        return accounting.manifest(self)

    # -- attaching to a model ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attach(self, model: torch.nn.Module) -> Iterator["KVStore"]:
        """Point every module with an int `mmkv_layer` at this store (`m.mmkv_store = self`); restore on exit."""
        if not isinstance(model, torch.nn.Module):
            raise KVCacheError(f"KVStore.attach: expected a torch.nn.Module, got {type(model).__name__}")
        targets = [m for m in model.modules() if is_int(getattr(m, "mmkv_layer", None))]
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

    def __repr__(self) -> str:
        codec = "native" if self.k_config is None else f"K={self.k_config}, V={self.v_config}"
        return (
            f"KVStore({codec}, layers={self.num_layers}, heads={self.num_heads}, head_dim={self.head_dim}, "
            f"window={self.config.residual_window}, held={self._held} B)"
        )
