"""What a store measured: the byte split, effective bits and counts of a rollout (`KVStore.stats`), and the record
a run manifest keeps (`KVStore.manifest`). Bytes are what is really held, never nominal."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from mmkv.codecs.base import Codec, CodecConfig

if TYPE_CHECKING:
    from mmkv.cache.store import KVStore


def codec_state_nbytes(codecs: list[Codec]) -> int:
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


def visible_numel(store: "KVStore") -> int:
    """K and V elements of the tokens attention can see, over all layers."""
    return sum(2 * st.batch * store.num_heads * store.head_dim * st.visible_tokens()
               for st in store._layers if st.batch is not None)


def decoded_nbytes(store: "KVStore") -> int:
    """Bytes of the decodes kept by `reuse_decoded` (0 when it is off)."""
    return sum(s.decoded[0].numel() * s.decoded[0].element_size() * 2
               for st in store._layers for s in st.segs if s.decoded is not None)


def stats(store: "KVStore") -> dict[str, Any]:
    """Measured facts of the rollout so far: per-layer counts, byte split and effective bits (after reading
    every pending lagged check: the figures of an invalid cache are not reported)."""
    store.check()
    k_enc = sum(st.k_encoded_nbytes for st in store._layers)
    v_enc = sum(st.v_encoded_nbytes for st in store._layers)
    numel = sum(st.encoded_numel for st in store._layers)
    held_numel = visible_numel(store)
    ratio = store.kv_ratio
    return {
        "encodes_per_layer": [len(st.encoded_units) for st in store._layers],
        "encode_calls_per_layer": [st.encode_calls for st in store._layers],
        "units_per_layer": [store.num_units(i) for i in range(store.num_layers)],
        "native_units_per_layer": [store.num_native_units(i) for i in range(store.num_layers)],
        "tokens_per_layer": [store.num_tokens(i) for i in range(store.num_layers)],
        "evicted_units_per_layer": [st.evicted_units for st in store._layers],
        "k_payload_nbytes": k_enc,
        "v_payload_nbytes": v_enc,
        "native_nbytes": store._held - k_enc - v_enc,
        "nbytes": store._held,
        "bf16_nbytes": store.bf16_nbytes(),
        "peak_nbytes": store._peak,
        "scratch_peak_nbytes": store._scratch_peak,
        "decoded_nbytes": decoded_nbytes(store),  # reuse_decoded: decodes held beside the compressed bytes
        "decoded_peak_nbytes": store._decoded_peak,
        "kv_ratio": None if math.isnan(ratio) else ratio,
        # per-layer codec constants, independent of context length and rebuilt from the seed: reported, not in
        # nbytes (a fused kernel keeps them resident, so quote them next to KV× at short contexts)
        "codec_state_nbytes": codec_state_nbytes([c for c in store._k_codecs + store._v_codecs if c is not None]),
        # bits per encoded K (V) element, side information included; None until something is encoded
        "k_effective_bits": 8.0 * k_enc / numel if numel else None,
        "v_effective_bits": 8.0 * v_enc / numel if numel else None,
        # bits per held K/V element over the whole store (native window and protected units included)
        "effective_bits": 8.0 * store._held / held_numel if held_numel else None,
    }



# the measured figures a manifest repeats from `stats`, in the order it lists them
_MANIFEST_STATS = (
    "tokens_per_layer", "nbytes", "bf16_nbytes", "peak_nbytes", "scratch_peak_nbytes", "decoded_peak_nbytes",
    "kv_ratio", "k_payload_nbytes", "v_payload_nbytes", "native_nbytes", "codec_state_nbytes", "k_effective_bits",
    "v_effective_bits", "effective_bits",
)


def manifest(store: "KVStore") -> dict[str, Any]:
    """JSON-able record of how the cache was stored and what it measured."""
    measured = stats(store)
    return {
        **store.config.to_dict(),
        "protected_layers": list(store.protected_layers),
        "span_codec": store.span,
        "span_units": store.span_units,
        "num_layers": store.num_layers,
        "num_heads": store.num_heads,
        "head_dim": store.head_dim,
        **{key: measured[key] for key in _MANIFEST_STATS},
    }
