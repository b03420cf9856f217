"""Input checks of the store's public calls: each failure is a KVCacheError saying what was expected and where."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mmkv.cache.config import KVCacheError, is_int
from mmkv.cache.segments import LayerState
from mmkv.codecs.base import FLOAT_DTYPES

if TYPE_CHECKING:
    from mmkv.cache.store import KVStore


def check_layer(layer: Any, num_layers: int) -> int:
    if not is_int(layer) or not 0 <= layer < num_layers:
        raise KVCacheError(f"KVStore: layer must be an int in 0..{num_layers - 1}, got {layer!r}")
    return layer


def empty_message(layer: int, where: str) -> str:
    return (
        f"{where}: layer {layer} holds nothing in this rollout (never written since reset()) and no current "
        "block was given"
    )


def check_kv(store: "KVStore", st: LayerState, k: Any, v: Any, where: str, kname: str, vname: str) -> None:
    """k and v are float [B, H, T, D] tensors of the store's heads and head_dim, alike, and like the units the layer
    already holds."""
    for name, t in ((kname, k), (vname, v)):
        if not isinstance(t, torch.Tensor):
            raise KVCacheError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise KVCacheError(f"{where}: {name} must be a float tensor, got {t.dtype}")
    expect = f"[B, {store.num_heads}, T, {store.head_dim}]"
    if k.dim() != 4 or k.shape[1] != store.num_heads or k.shape[3] != store.head_dim:
        hint = ""
        if k.dim() == 4 and k.shape[2] == store.num_heads and k.shape[3] == store.head_dim:
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

def check_q(store: "KVStore", st: LayerState, q: Any, ref: torch.Tensor | None, where: str) -> None:
    """q is [B, H, Tq, D] with the batch, dtype and device of the layer's units (or of `ref`, the current block)."""
    if not isinstance(q, torch.Tensor):
        raise KVCacheError(f"{where}: q must be a torch.Tensor, got {type(q).__name__}")
    batch = st.batch if st.batch is not None else ref.shape[0]
    dtype = st.dtype if st.dtype is not None else ref.dtype
    device = st.device if st.device is not None else ref.device
    expect = f"[{batch}, {store.num_heads}, Tq, {store.head_dim}]"
    if q.dim() != 4 or q.shape[0] != batch or q.shape[1] != store.num_heads or q.shape[3] != store.head_dim:
        raise KVCacheError(f"{where}: q must be {expect}, got {list(q.shape)}")
    if q.dtype != dtype:
        raise KVCacheError(f"{where}: q dtype {q.dtype} differs from the K/V dtype {dtype}")
    if q.device != device:
        raise KVCacheError(f"{where}: q is on {q.device} but K/V on {device}")
