"""What one layer of the store holds: its segments in time order, and the rules that group units for encoding and
join encoded segments for decoding."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mmkv.codecs.base import Codec, Encoded, concat_tokens, stack_units


@dataclass
class Seg:
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
class LayerState:
    """One layer of the store: its segments in time order and the counts the statistics report."""

    segs: list[Seg] = field(default_factory=list)
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

    def visible_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segs)


def live_predicate(total: int, window: int | None, sinks: int) -> Callable[[int], bool]:
    """Which unit indices a rolling window of `window` units plus `sinks` sink units keeps once `total` units were
    appended (every unit under global attention)."""
    if window is None:
        return lambda unit: True
    return lambda unit: unit < sinks or unit >= total - window


def group_units(leaving: list[int], *, runs: bool, sink_units: int, span_units: int | None) -> list[list[int]]:
    """Units encoded together. With `runs` (span codecs, and token-local codecs under `merge_units`): runs of
    consecutive units, never straddling the sink boundary, so eviction only ever trims a span from its old end; a
    `span_units = m` codec takes whole groups of m and leaves a short rest native. One each otherwise."""
    if not runs:
        return [[u] for u in leaving]
    out: list[list[int]] = []
    for u in leaving:
        if out and u == out[-1][-1] + 1 and not u == sink_units:
            out[-1].append(u)
        else:
            out.append([u])
    if span_units is None:
        return out
    m = span_units
    return [run[i : i + m] for run in out for i in range(0, len(run) - len(run) % m, m)]


def joins_units(codec: Codec) -> bool:
    """Whether consecutive encodings of this codec join along the tokens whatever their lengths: token-local codecs
    (`concat_tokens`) and KIVI's / OScaR's keys (`join_units`)."""
    return bool(codec.token_local or getattr(codec, "joins_units", False))


def join_units(codec: Codec, encs: list[Encoded]) -> Encoded | None:
    """`encs` (single units, or earlier joins) joined along the tokens by the codec's own rule, None if it has
    none."""
    if codec.token_local:
        return concat_tokens(codec, encs)
    return codec.join_units(encs) if getattr(codec, "joins_units", False) else None


def _entries(enc: Encoded, codec: Codec, stack: int) -> list[Encoded]:
    """A stack's entries as encodings of their own (copies), or [enc]."""
    if stack == 1:
        return [enc]
    unit = (enc.shape[0], *enc.shape[2:])
    return [Encoded(enc.codec, unit, enc.dtype,
                    {k: t.select(codec.stack_axes.get(k, 1), i).contiguous() for k, t in enc.tensors.items()},
                    dict(enc.meta)) for i in range(stack)]


def join_encoded(segs: list[Seg], kc: Codec, vc: Codec, *, merge: bool) -> Seg | None:
    """The layer's consecutive encoded segments as one, holding the same bytes (or fewer: a bit stream's padding,
    `concat_tokens`): joined along the token axis for token-local codecs (`merge`, `concat_tokens`), else stacked
    segment by segment on a new axis (`stack_units`: one unit each, or a span codec's commit spans of equal
    length), and where the lengths differ and both codecs join units of any length (KIVI / OScaR: `join_units`),
    joined along the tokens. None when they cannot be joined exactly (segments not adjacent, partly evicted,
    segments of unequal length in a stack that cannot be joined otherwise)."""
    if any(a.end_unit != b.first_unit or a.skip_units or b.skip_units for a, b in zip(segs, segs[1:])):
        return None
    stack = 1
    if merge:
        k_enc = concat_tokens(kc, [s.k_enc for s in segs])
        v_enc = concat_tokens(vc, [s.v_enc for s in segs]) if k_enc is not None else None
    else:
        k_enc = stack_units([s.k_enc for s in segs], kc.stack_axes)
        v_enc = stack_units([s.v_enc for s in segs], vc.stack_axes) if k_enc is not None else None
        stack = 0 if v_enc is None else k_enc.shape[1]
        if v_enc is not None and (v_enc.shape[1] != stack or stack != sum(s.stack for s in segs)):
            v_enc = None  # every segment must be one stack entry (or a stack of them)
        if v_enc is None and joins_units(kc) and joins_units(vc):
            k_enc = join_units(kc, [e for s in segs for e in _entries(s.k_enc, kc, s.stack)])
            v_enc = join_units(vc, [e for s in segs for e in _entries(s.v_enc, vc, s.stack)]) if k_enc else None
            stack = 1
    if v_enc is None:
        return None
    return Seg(segs[0].first_unit, tuple(t for s in segs for t in s.unit_tokens), k_enc=k_enc, v_enc=v_enc,
               stack=stack)
