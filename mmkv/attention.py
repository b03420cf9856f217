"""Attention of the current queries over [encoded past | native window | current block].

The store (`mmkv.cache`) hands this module the layer's past as a list of `Segment`s in time order: native K/V, or K/V
encoded by the layer's codecs (one unit each, or one span for span codecs). Three ways to attend, picked by `attend`:

* **decode + SDPA** (the reference): decode every encoded segment to the store dtype (bf16 on GPU, the model's dtype
  on CPU), gather [past | current] into one K and one V buffer, and make ONE `scaled_dot_product_attention` call. The
  native store takes the same path with nothing to decode, so the identity codec is bit-exact with the native cache
  (docs/architecture.md, Invariants: identity is bit-exact).
* **score estimator**: a key codec with `has_scores` (QJL family) defines its own unbiased estimate of q·k, which is
  what its paper evaluates. Each encoded segment is attended with `codec.scores(q, enc)` and the decoded V; native
  segments and the current block exactly; the partial results are merged exactly through log-sum-exp.
* **fused kernel** (the seam for `mmkv.kernels`): on CUDA, when `mmkv.kernels.attention_kernel(k_config, v_config)`
  returns a callable, it attends the encoded segments straight from their payload and returns (out, lse); the native
  part is attended by the torch reference and the two are merged through log-sum-exp.

Memory: the reference decodes the whole past of ONE layer on every call into a scratch buffer that is freed when the
call returns, so extra memory is one layer's past in the store dtype (plus one segment's decode), never the whole
model's. Caching decoded tensors across the 3-5 denoising calls of a video block would be faster but costs the native
footprint again, which is what the codec is meant to save (docs/decisions.md, "Decode per call by default, once per
rollout on request").
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from mmkv.codecs.base import Codec, Encoded

BACKENDS = ("auto", "reference", "decode")

# Score elements per query chunk on the explicit (score / log-sum-exp) path: bounds the fp32 [.., Tq, Tk] score
# scratch to 64 MiB per tile (a whole 4680-query video block over 6240 keys x 12 heads would be 1.4 GB).
_SCORE_ELEMENTS = 1 << 24


class AttentionError(ValueError):
    """Bad input to an attention call; the message says what was expected."""


@dataclass
class Segment:
    """A run of stored tokens of one layer, in time order: native K/V or K/V encoded by the layer's codecs.

    `skip_tokens` leading tokens of an encoded span are no longer visible (a rolling window evicted their units but the
    span still holds them, as QVG's `ChunkedKVCache.evict_range` does); they are decoded and dropped.

    `stack` > 1: the encodings of `stack` equal-length units stacked on a new axis after the batch axis, shape
    [B, stack, H, T_unit, D] (how the store joins the units of codecs that group over tokens, KIVI / OScaR keys, or
    QVG's commit spans, each a stack entry, so that one decode call covers them: the entries are independent rows
    to the codec). They stand for the tokens [B, H, stack * T_unit, D] in order.
    """

    k: torch.Tensor | None = None  # [B, H, T, D] native
    v: torch.Tensor | None = None
    k_enc: Encoded | None = None
    v_enc: Encoded | None = None
    k_codec: Codec | None = None
    v_codec: Codec | None = None
    skip_tokens: int = 0
    stack: int = 1

    @property
    def encoded(self) -> bool:
        return self.k_enc is not None

    @property
    def num_tokens(self) -> int:
        """Visible tokens."""
        if self.encoded:
            return self.stack * self.k_enc.shape[-2] - self.skip_tokens
        return self.k.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        """[B, H, T, D] of the tokens this segment holds (evicted ones included)."""
        if not self.encoded:
            return tuple(self.k.shape)
        if self.stack == 1:
            return tuple(self.k_enc.shape)
        b, n, h, t, d = self.k_enc.shape
        return (b, h, n * t, d)

    def unstacked(self) -> list["Segment"]:
        """One segment per entry (a unit or a span) of a stacked segment (views of its tensors where contiguous,
        else copies), for the paths that attend segment by segment (fused kernels, score estimators)."""
        if self.stack == 1:
            return [self]

        def pick(enc: Encoded, codec: Codec, i: int) -> Encoded:
            tensors = {name: t.select(codec.stack_axes.get(name, 1), i).contiguous() for name, t in enc.tensors.items()}
            shape = (enc.shape[0], *enc.shape[2:])
            return Encoded(enc.codec, shape, enc.dtype, tensors, dict(enc.meta))

        return [Segment(k_enc=pick(self.k_enc, self.k_codec, i), v_enc=pick(self.v_enc, self.v_codec, i),
                        k_codec=self.k_codec, v_codec=self.v_codec) for i in range(self.stack)]

    def decode(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the visible tokens in `dtype` (native segments are returned as stored when the dtype matches)."""
        if not self.encoded:
            return self.k.to(dtype), self.v.to(dtype)
        k = _unstack(self.k_codec.decode(self.k_enc, dtype=dtype), self.stack)
        v = _unstack(self.v_codec.decode(self.v_enc, dtype=dtype), self.stack)
        if self.skip_tokens:
            k, v = k[..., self.skip_tokens :, :], v[..., self.skip_tokens :, :]
        return k, v


def _unstack(x: torch.Tensor, stack: int) -> torch.Tensor:
    """[B, n, H, T, D] -> [B, H, n * T, D] (units in order); unchanged when stack == 1."""
    if stack == 1:
        return x
    b, n, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, h, n * t, d)


# ----------------------------------------------------------------------------------------------------------------
# Building blocks


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The one SDPA call every reference path makes (no mask: block-causality comes from what is stored)."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def gather(
    segments: Sequence[Segment],
    k_cur: torch.Tensor | None,
    v_cur: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[past | current] K and V as two contiguous [B, H, T, D] tensors of `dtype`.

    Each encoded segment is decoded straight into its slice of a preallocated buffer (`Codec.decode(out=...)`: the
    Triton decoders write there, with no copy); native segments and the current block are copied in, each run of
    consecutive ones already in `dtype` by one `torch.cat` into its slice (a bf16 cache of 21 frames is 22 parts:
    one call a tensor instead of a slice and a copy a part, which the host pays for on every attention call). The
    scratch is the buffer (plus, on the torch reference path, one segment's decode). Bit-exact, so this equals
    `torch.cat`.
    """
    parts = list(segments) + ([Segment(k=k_cur, v=v_cur)] if k_cur is not None else [])
    if not parts:
        raise AttentionError("nothing to attend: no stored segments and no current block")
    ref = parts[0].k if not parts[0].encoded else None
    shape = parts[0].shape
    total = sum(p.num_tokens for p in parts)
    device = ref.device if ref is not None else parts[0].k_enc.device
    k_out = torch.empty(*shape[:-2], total, shape[-1], dtype=dtype, device=device)
    v_out = torch.empty_like(k_out)
    start, i = 0, 0
    while i < len(parts):
        run = _native_run(parts, i, dtype)
        if run:
            n = sum(p.num_tokens for p in run)
            torch.cat([p.k for p in run], dim=-2, out=k_out[..., start : start + n, :])
            torch.cat([p.v for p in run], dim=-2, out=v_out[..., start : start + n, :])
            start, i = start + n, i + len(run)
            continue
        part = parts[i]
        i += 1
        n = part.num_tokens
        k_dst, v_dst = k_out[..., start : start + n, :], v_out[..., start : start + n, :]
        if part.encoded and part.stack > 1 and not part.skip_tokens:
            # one decode call for all the stacked units, written in token order: the slice [B, H, n * T, D] seen as
            # the stack's [B, n, H, T, D] (the min-max decode kernel addresses those rows; others decode and copy)
            for codec, enc, dst in ((part.k_codec, part.k_enc, k_dst), (part.v_codec, part.v_enc, v_dst)):
                b, units, h, t, d = enc.shape
                _decode_into(codec, enc, dtype, dst.view(b, h, units, t, d).transpose(1, 2))
        elif part.encoded and not part.skip_tokens:
            _decode_into(part.k_codec, part.k_enc, dtype, k_dst)
            _decode_into(part.v_codec, part.v_enc, dtype, v_dst)
        else:  # native, or a span with evicted leading units: decode whole, copy the visible tokens
            k, v = part.decode(dtype)
            k_dst.copy_(k)
            v_dst.copy_(v)
        start += n
    return k_out, v_out


def _native_run(parts: Sequence[Segment], i: int, dtype: torch.dtype) -> list[Segment]:
    """The native segments from `parts[i]` on whose K and V are already in `dtype` (empty when parts[i] is not).
    Parts that carry gradients are left to the per-part copy: `torch.cat(out=...)` does not differentiate."""
    grad = torch.is_grad_enabled()

    def plain(p: Segment) -> bool:
        return (not p.encoded and p.k.dtype == dtype and p.v.dtype == dtype
                and not (grad and (p.k.requires_grad or p.v.requires_grad)))

    j = i
    while j < len(parts) and plain(parts[j]):
        j += 1
    return list(parts[i:j])


@functools.lru_cache(maxsize=None)
def _takes_out(fn: Callable) -> bool:
    """Whether a decode function takes `out=` (every codec here does; one registered from elsewhere, or a wrapper
    set on an instance, may not)."""
    params = inspect.signature(fn).parameters
    return "out" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _decode_into(codec: Codec, enc: Encoded, dtype: torch.dtype, out: torch.Tensor) -> None:
    decode = codec.decode
    if _takes_out(getattr(decode, "__func__", decode)):
        codec.decode(enc, dtype=dtype, out=out)
    else:
        out.copy_(codec.decode(enc, dtype=dtype))


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in fp32 (fp64 if given fp64) and its log-sum-exp: (out [.., Tq, Dv], lse [.., Tq])."""
    acc = torch.promote_types(q.dtype, torch.float32)
    kt = k.to(acc).transpose(-1, -2)
    return _chunked(q, k.shape[-2], lambda qc: torch.matmul(qc.to(acc), kt).mul_(scale), v.to(acc))


def scores_lse(
    q: torch.Tensor, codec: Codec, enc: Encoded, v: torch.Tensor, scale: float, skip_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one encoded key segment scored by the codec's own estimator (`codec.scores`, fp32)."""

    def score(qc: torch.Tensor) -> torch.Tensor:
        s = codec.scores(qc, enc).float()
        return (s[..., skip_tokens:] if skip_tokens else s) * scale  # a fresh tensor: _chunked works in place

    return _chunked(q, enc.shape[-2], score, v.float())


def _chunked(
    q: torch.Tensor, keys: int, score: Callable[[torch.Tensor], torch.Tensor], v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = max(1, _SCORE_ELEMENTS // max(1, math.prod(q.shape[:-2]) * keys))
    outs, lses = [], []
    for start in range(0, q.shape[-2], rows):
        s = score(q[..., start : start + rows, :])
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def merge_lse(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over disjoint key sets exactly: softmax over the union = Σ_i exp(lse_i − lse) · out_i,
    lse = log Σ_i exp(lse_i) (the split-KV reduction of Flash-Decoding)."""
    if not parts:
        raise AttentionError("merge_lse needs at least one (out, lse) part")
    acc = parts[0][0].dtype
    for out, _ in parts[1:]:
        acc = torch.promote_types(acc, out.dtype)
    lse = torch.logsumexp(torch.stack([p[1].to(acc) for p in parts]), dim=0)
    out = sum(torch.exp(p[1].to(acc) - lse).unsqueeze(-1) * p[0].to(acc) for p in parts)
    return out, lse


# ----------------------------------------------------------------------------------------------------------------
# Kernel seam


def find_kernel(k_codec: Codec, v_codec: Codec, device: torch.device) -> Callable | None:
    """A fused attention kernel for this (K codec, V codec) pair on `device`, or None for the torch reference.

    Protocol for `mmkv.kernels`: a module-level `attention_kernel(k_config, v_config)` returning None or a callable
    `kernel(q, segments, scale) -> (out, lse)` that attends q [B, H, Tq, D] over the encoded `segments` (each with
    `k_enc`, `v_enc`, `k_codec`, `v_codec`, `skip_tokens`) and returns out [B, H, Tq, D] and lse [B, H, Tq], both fp32.
    """
    if device.type != "cuda":
        return None
    try:
        kernels = importlib.import_module("mmkv.kernels")
    except ModuleNotFoundError as err:
        if err.name not in ("mmkv.kernels", "triton"):
            raise
        return None
    lookup = getattr(kernels, "attention_kernel", None)
    return None if lookup is None else lookup(k_codec.config, v_codec.config)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch


def attend(
    q: torch.Tensor,
    segments: Sequence[Segment],
    k_cur: torch.Tensor | None = None,
    v_cur: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of q [B, H, Tq, D] over [segments | current block] -> [B, H, Tq, D] in q's dtype.

    `backend`: "auto" uses a fused kernel when `mmkv.kernels` has one (CUDA only) and otherwise behaves like
    "reference"; "reference" is torch only, with a key codec's own score estimator when it has one; "decode" always
    decodes to the store dtype and calls SDPA, ignoring score estimators.
    """
    if backend not in BACKENDS:
        raise AttentionError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    encoded = [s for s in segments if s.encoded]
    if encoded and backend != "decode":
        k_codec, v_codec = encoded[0].k_codec, encoded[0].v_codec
        kernel = find_kernel(k_codec, v_codec, q.device) if backend == "auto" else None
        if kernel is not None and q.shape[-2] > getattr(kernel, "max_queries", math.inf):
            # Long query blocks (a video chunk) are compute-bound: decode once into the gather buffer and make one
            # SDPA call over [past | current] rather than fused split-K plus an fp32 pass over the native part.
            kernel = None
        if kernel is not None and any(s.k_enc.meta.get("units") for s in encoded):
            # keys of units of unequal length joined into one encoding (KIVI / OScaR over an AAR's scales,
            # `RoleCodec.join_units`): the fused kernels read one unit's groups, so decode the past once instead
            kernel = None
        if kernel is not None or k_codec.has_scores:
            return _attend_split(q, segments, k_cur, v_cur, scale, kernel)
    k, v = gather(segments, k_cur, v_cur, q.dtype)
    return sdpa(q, k, v, scale=scale)


def _attend_split(
    q: torch.Tensor,
    segments: Sequence[Segment],
    k_cur: torch.Tensor | None,
    v_cur: torch.Tensor | None,
    scale: float | None,
    kernel: Callable | None,
) -> torch.Tensor:
    """Encoded segments through a kernel or the score estimator, native ones exactly; merged via log-sum-exp."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc: tuple[torch.Tensor, torch.Tensor] | None = None

    def fold(part: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # merge as we go, so one running output is held instead of one per segment
        return part if acc is None else merge_lse([acc, part])

    encoded = [u for s in segments if s.encoded for u in s.unstacked()]
    if kernel is not None:
        out, lse = kernel(q, encoded, scale)
        acc = fold((out.float(), lse.float()))
    else:
        for seg in encoded:
            v = seg.v_codec.decode(seg.v_enc, dtype=torch.float32)[..., seg.skip_tokens :, :]
            acc = fold(scores_lse(q, seg.k_codec, seg.k_enc, v, scale, seg.skip_tokens))
    native = [s for s in segments if not s.encoded]
    if native or k_cur is not None:
        k, v = gather(native, k_cur, v_cur, q.dtype)
        acc = fold(attention_lse(q, k, v, scale))
    return acc[0].to(q.dtype)
