"""Joining encodings without re-encoding: consecutive units of a token-local codec along the token axis
(`concat_tokens`), equal-length units of a row-independent codec on a new axis (`stack_units`)."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from mmkv.codecs.encoded import Encoded
from mmkv.codecs.packing import concat_streams

if TYPE_CHECKING:
    from mmkv.codecs.base import Codec


_LAYOUTS: dict[tuple, dict[str, tuple[int, Fraction]]] = {}


def token_layout(codec: "Codec", lead: int) -> dict[str, tuple[int, Fraction]]:
    """For each tensor a token-local codec stores, (the axis that grows with the token count, entries per token),
    found once per codec and leading rank by encoding two probe lengths on the CPU (shapes never depend on values).
    Fields with a fixed part (not proportional to the token count) are left out: they cannot be concatenated.
    Kept per (codec class, config, head_dim, num_heads, lead), not per instance: a store builds its codecs afresh for
    each rollout, and the probes (the torch reference encode) cost up to 14 ms a codec (OCTOPUS), 0.5 s per rollout
    of a 30-layer model."""
    key = (type(codec), str(codec.config), codec.head_dim, codec.num_heads, lead)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    g = torch.Generator().manual_seed(0)
    heads = [codec.num_heads] if lead >= 1 and codec.num_heads > 1 else [1] * min(lead, 1)
    dims = [1] * (lead - len(heads)) + heads
    probes = []
    for t in (16, 32):
        # the class's encode, not an instance attribute (tests and simulate_peak_nbytes wrap that to count units)
        enc = type(codec).encode(codec, torch.randn(*dims, t, codec.head_dim, generator=g))
        probes.append({k: tuple(v.shape) for k, v in enc.tensors.items()})
    layout = {}
    for k, s1 in probes[0].items():
        s2 = probes[1][k]
        diff = [i for i, (a, b) in enumerate(zip(s1, s2)) if a != b]
        if len(diff) == 1:
            rate = Fraction(s2[diff[0]] - s1[diff[0]], 16)
            if rate * 16 == s1[diff[0]]:  # proportional: no fixed part
                layout[k] = (diff[0], rate)
    _LAYOUTS[key] = layout
    return layout


def concat_tokens(codec: "Codec", encs: list[Encoded]) -> Encoded | None:
    """One encoding of the concatenated tokens of `encs` (consecutive encodings of a token-local codec, same leading
    dims), built by concatenating the stored tensors, or None when that would not be exact: a field whose size is not
    proportional to its tokens, differing metadata, or a codec that is not token-local. A field the codec names in
    `bit_streams` (a dense bit stream over the row's tokens, `mmkv.codecs.packing`) whose bits do not end on a byte
    is joined bit by bit (`concat_streams`): the result is what encoding all the tokens at once stores, its last
    byte's padding only, so it can hold fewer bytes than the parts. Decoding it equals concatenating the decodes, bit
    for bit."""
    if not getattr(codec, "token_local", False) or len(encs) < 2:
        return None
    first = encs[0]
    lead = len(first.shape) - 2
    if any(tuple(e.shape[:-2]) != tuple(first.shape[:-2]) or e.meta != first.meta or e.codec != first.codec
           or list(e.tensors) != list(first.tensors) for e in encs):
        return None
    layout = token_layout(codec, lead)
    if set(layout) != set(first.tensors):
        return None
    streams = {k: int(rate * 8) for k, (axis, rate) in layout.items()
               if k in getattr(codec, "bit_streams", ()) and (rate * 8).denominator == 1
               and axis == first.tensors[k].dim() - 1 and first.tensors[k].dtype == torch.uint8}
    ragged = set()
    for e in encs:
        t = e.shape[-2]
        for k, (axis, rate) in layout.items():
            if rate * t == e.tensors[k].shape[axis]:
                continue
            if k in streams and e.tensors[k].shape[axis] == (streams[k] * t + 7) // 8:
                ragged.add(k)
                continue
            return None
    tensors = {k: concat_streams([(e.tensors[k], streams[k] * e.shape[-2]) for e in encs]) if k in ragged
               else torch.cat([e.tensors[k] for e in encs], dim=layout[k][0]) for k in first.tensors}
    shape = (*first.shape[:-2], sum(e.shape[-2] for e in encs), first.shape[-1])
    return Encoded(first.codec, shape, first.dtype, tensors, dict(first.meta))


def stack_units(encs: list[Encoded], axes: dict[str, int] | None = None) -> Encoded | None:
    """One encoding of equal-length units stacked on a new axis after the batch axis: each of `encs` is one unit's
    [B, H, T, D] encoding or an earlier stack [B, n, H, T, D]; the result is [B, sum n, H, T, D], every stored tensor
    stacked (or concatenated) the same way on its axis 1, or on the axis `axes` names for it (`Codec.stack_axes`).
    For codecs whose leading dims are independent rows (KIVI and OScaR, whose keys group over tokens and so cannot be
    joined along the token axis; QVG, whose spans each have their own centres): decoding the stack decodes each unit
    as it would alone. A unit may be a span of several of the store's units. None when the units' layouts differ
    (shapes, dtypes, metadata)."""
    axes = axes or {}
    if len(encs) < 2:
        return None
    unit = lambda e: tuple(e.shape) if len(e.shape) == 4 else (e.shape[0], *e.shape[2:])  # noqa: E731
    first = encs[0]
    if len(first.shape) not in (4, 5):
        return None

    def per_unit(k: str, t: torch.Tensor, stacked: bool) -> tuple[int, ...]:
        a = axes.get(k, 1)
        return tuple(t.shape[:a] + t.shape[a + 1:]) if stacked else tuple(t.shape)

    fields = {k: (t.dtype, per_unit(k, t, len(first.shape) == 5)) for k, t in first.tensors.items()}
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in fields}
    units = 0
    for e in encs:
        if len(e.shape) not in (4, 5) or unit(e) != unit(first) or e.codec != first.codec or e.dtype != first.dtype \
                or e.meta != first.meta or set(e.tensors) != set(fields):
            return None
        for k, t in e.tensors.items():
            a = axes.get(k, 1)
            if (t.dtype, per_unit(k, t, len(e.shape) == 5)) != fields[k] or t.dim() < a:
                return None
            parts[k].append(t.unsqueeze(a) if len(e.shape) == 4 else t)
        units += 1 if len(e.shape) == 4 else e.shape[1]
    tensors = {k: torch.cat(ts, dim=axes.get(k, 1)) for k, ts in parts.items()}
    b, h, t, d = unit(first)
    return Encoded(first.codec, (b, units, h, t, d), first.dtype, tensors, dict(first.meta))
