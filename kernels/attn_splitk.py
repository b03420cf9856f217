"""What every fused decode-attention kernel (`kernels/<codec>_attn.py`) shares: split-K planning, the min-max value
tile, the online softmax, the log-sum-exp combine, rotations of the query and the output, and the fallbacks.

Design (OScaR's fused decode kernel, `csrc/oscar/src/flash_fwd_kernel.h`, forked from BitDecoding; the
Flash-Decoding split-K reduction; attention through a rotation as in TurboQuant and OCTOPUS: docs/decisions.md,
"Fused decode attention"). One program attends ONE query row of one (batch,
query head) over one split of one encoded segment's tokens, reading only packed bytes:

* keys are scored straight from their codes (in the rotated domain for the rotation codecs: the query is rotated once
  per call by a [D, D] matrix product, never the keys);
* values are min-max token groups (groupquant / KIVI V / OScaR V): the group scale is folded into the softmax weight,
  so a value costs one mask-or, one subtract and one FMA (`unit_values`); OScaR's rotated V is accumulated in the
  rotated domain and rotated back once per output row;
* key tiles are laid out [channels, tokens] (a token's channels in one thread: the score's sum over channels stays
  in-thread) and value tiles [tokens, channels] (the weighted sum over tokens stays in-thread); only the weight
  vector p [BLOCK_N] changes layout between the two;
* splits write (out, lse) partials; one combine launch merges splits and segments exactly by log-sum-exp.

Queries are CUDA-core GEMV work at decode (Lq = 1, no GQA group to fill a tensor-core tile); blocks of more than
`MAX_FUSED_QUERIES` rows are compute-bound and go through decode-to-bf16 + flash attention instead (a Wan 1.3B video chunk is 1,560 query tokens a
latent frame: compute-bound; docs/perf.md).

Packed code planes are dense little-endian bit streams per (batch, head) row (`mmkv.codecs.packing`). Widths that
divide 16 are read as int32 words of two half-words of 16 // w codes ("half" units); other widths <= 8 as w-byte
chunks of 8 codes. Measured speed and its limits (instruction issue, not bytes): docs/perf.md.
"""

from __future__ import annotations

import os
import weakref
from typing import Sequence

import torch

from mmkv.codecs.base import to_device_shared
from mmkv.kernels.attn_splitk_triton import (  # noqa: F401
    _combine_kernel, _load_chunks, combine, empty_split, load_units, lookup, query_row, softmax_step, split_tiles,
    store_split, unit_ints, unit_scale, unit_values, value_rows, value_step,
)
from mmkv.kernels.common import cdiv

# Query rows above which the fused path loses to decode + flash attention (one program per row re-dequantises the
# tile for each row; flash attention is compute-bound at video chunk sizes; docs/perf.md).
MAX_FUSED_QUERIES = 4
LOG2E = 1.4426950408889634
# Programs to aim for per multiprocessor when choosing the split count (enough loads in flight to cover latency).
PROGRAMS_PER_SM = 8
# Fewest tiles a split is given, so that its epilogue (a D-wide store and one combine slot) stays amortised.
MIN_TILES_PER_SPLIT = 4


class KernelUnsupported(Exception):
    """The fused kernel does not handle this input; the caller uses the exact torch path instead."""


# ----------------------------------------------------------------------------------------------------------------
# Host side


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keep a few splits so the combine is exercised


def plan_splits(programs: int, tiles: int, device: torch.device, splits: int | None = None) -> int:
    """Splits per segment: enough programs to fill the machine, each with at least MIN_TILES_PER_SPLIT tiles."""
    if splits is None:
        splits = max(1, round(PROGRAMS_PER_SM * num_sms(device) / max(programs, 1)))
        splits = min(splits, max(1, tiles // MIN_TILES_PER_SPLIT))
    return max(1, min(int(splits), tiles))


def half_units(w: int) -> bool:
    """Codes of w bits are read as half-words of 16 // w codes (in int32 words) when w divides 16, else as w-byte
    chunks of 8 codes."""
    return 16 % w == 0


def unit_shape(d: int, w: int) -> tuple[int, int]:
    """(units per token, codes per unit) of a token-major plane of d w-bit codes per token."""
    if half_units(w):
        if (d * w) % 32:
            raise KernelUnsupported(f"{d} codes of {w} bits are not a whole number of 32-bit words")
        return d * w // 16, 16 // w
    if w > 8:
        raise KernelUnsupported(f"{w}-bit codes are not supported (at most 8 bits)")
    return d // 8, 8


def code_plane(t: torch.Tensor, w: int) -> torch.Tensor:
    """A [B, H, nbytes] uint8 plane as the kernel reads it: int32 words for half-word units, bytes otherwise."""
    if t.dtype != torch.uint8 or t.dim() != 3 or t.stride(-1) != 1:
        raise KernelUnsupported(f"expected a [B, H, nbytes] uint8 plane with unit inner stride, got {tuple(t.shape)}")
    if not half_units(w):
        return t
    if t.shape[-1] % 4 or any(s % 4 for s in t.stride()[:-1]) or t.storage_offset() % 4:
        raise KernelUnsupported("a word plane needs byte counts, strides and offset divisible by 4")
    return t.view(torch.int32)


def value_layout(v_codec, d: int) -> dict:
    """Kernel constants of a min-max token-group value codec (NG groups of UPG units per token), or unsupported."""
    w, g = v_codec.bits, v_codec.group
    if getattr(v_codec, "axis", "token") != "token":
        raise KernelUnsupported(f"value codec {v_codec.config} is not per-token grouped")
    nu, su = unit_shape(d, w)
    g = min(g, d)  # one (ragged) group covers a whole token when the group is wider than the head
    if g & (g - 1) or g % su:
        raise KernelUnsupported(f"value group {g} is not a power-of-two multiple of the {su} codes of a unit")
    return dict(NG=d // g, UPG=g // su, VSU=su, VW=w, VHALF=half_units(w))


_MATRICES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def rotation_matrix(codec, which: str, device: torch.device) -> torch.Tensor:
    """[Hc, D, D] (or [D, D]) fp32 matrix M with codec.<which>(x) == x @ M for row vectors x, per KV head.

    Built by applying the codec's own function to the identity, so it is the codec's rotation by construction; one
    small matrix product then rotates all query rows (or output rows) of a call."""
    cache = _MATRICES.setdefault(codec, {})
    key = (which, device)
    if key not in cache:
        d, h = codec.head_dim, codec.num_heads
        eye = torch.eye(d, dtype=torch.float32)
        eye = eye.expand(h, d, d).contiguous() if h > 1 else eye
        m = getattr(codec, which)(eye).float()
        cache[key] = to_device_shared({"m": m}, torch.device(device), f"rotation:{which}")["m"]
    return cache[key]


def apply_rotation(x: torch.Tensor, m: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """x [B, Hq, T, D] @ the KV head's matrix (query head hq uses KV head hq // (Hq / Hkv)), fp32, contiguous."""
    b, hq, t, d = x.shape
    if m.dim() == 2:
        return torch.matmul(x.float(), m).contiguous()
    if m.shape[0] != kv_heads:
        raise KernelUnsupported(f"codec built for {m.shape[0]} heads, segment has {kv_heads}")
    y = torch.matmul(x.float().reshape(b, kv_heads, (hq // kv_heads) * t, d), m)
    return y.reshape(b, hq, t, d).contiguous()


class SplitKAttention:
    """The callable `mmkv.kernels.attention_kernel` returns: kernel(q, segments, scale) -> (out, lse), fp32.

    Subclasses provide `prepare(q, seg)` (the query as the kernel reads it), `launch(...)` (one segment's split-K
    kernel) and optionally `finish(out, seg)` (rotate the output back). Anything the kernel does not cover (a shape, a
    ragged parameter, more than MAX_FUSED_QUERIES rows) goes through an exact torch or flash-attention path, so the
    callable is always correct. `splits`, `block_n`, `num_warps` and `stages` (software-pipelining depth of the
    packed loads) override the defaults (benchmark sweeps).
    """

    name = "splitk"
    max_queries = MAX_FUSED_QUERIES  # `mmkv.attention.attend` sends longer query blocks down decode + one SDPA call

    def __init__(self, k_config, v_config, *, splits: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, stages: int = 3):
        self.k_config, self.v_config = k_config, v_config
        self.splits, self.block_n, self.num_warps, self.stages = splits, block_n, num_warps, stages
        self.last_path = None  # "fused", "flash" or "reference": which path the last call took (tests, bench)

    # -- to override -------------------------------------------------------------------------------------------
    def prepare(self, q: torch.Tensor, seg) -> torch.Tensor:
        raise NotImplementedError

    def launch(self, qk: torch.Tensor, seg, out_part: torch.Tensor, lse_part: torch.Tensor, split0: int, scale: float,
               tile0: int, tiles: int, splits: int) -> None:
        """Launch one segment's kernel: `splits` programs per query row over `tiles` tiles from `tile0`, writing
        partial slots [split0, split0 + splits) of out_part [B, Hq, Tq, S, D] and lse_part [B, Hq, Tq, S]."""
        raise NotImplementedError

    def num_tiles(self, seg) -> tuple[int, int]:
        """(first tile, number of tiles) of the visible tokens."""
        bn = self.tile_size(seg)
        t = seg.k_enc.shape[-2]
        first = seg.skip_tokens // bn
        return first, cdiv(t, bn) - first

    default_block_n = 64
    default_warps = 4

    def tile_size(self, seg) -> int:
        return self.block_n or self.default_block_n

    def warps(self, seg) -> int:
        return self.num_warps or self.default_warps

    # Values accumulated in a rotated domain, turned back once per call by `finish` with the first segment's V codec:
    # every segment's values must then rotate alike (codecs of one config, layer and seed share their rotation).
    rotated_values = False

    def finish(self, out: torch.Tensor, seg) -> torch.Tensor:
        return out

    def check(self, q: torch.Tensor, seg) -> None:
        """Raise KernelUnsupported for inputs the kernel does not cover."""

    # -- the protocol ------------------------------------------------------------------------------------------
    def __call__(self, q: torch.Tensor, segments: Sequence, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        segments = [s for s in segments if s.num_tokens > 0]
        if not segments:
            raise ValueError("fused attention needs at least one encoded segment with visible tokens")
        try:
            for seg in segments:
                self._check_common(q, seg)
                self.check(q, seg)
                if self.rotated_values and not _same_rotation(seg.v_codec, segments[0].v_codec):
                    raise KernelUnsupported("the segments' values rotate differently: one rotation back cannot serve")
        except KernelUnsupported:
            self.last_path = "reference"
            return reference_lse(q, segments, scale)
        if q.shape[-2] > MAX_FUSED_QUERIES:
            self.last_path = "flash" if _flash_ok(q) else "reference"
            return decode_flash_lse(q, segments, scale)
        self.last_path = "fused"
        b, hq, tq, d = q.shape
        plans = []
        for seg in segments:
            tile0, tiles = self.num_tiles(seg)
            plans.append((tile0, tiles, plan_splits(b * hq * tq, tiles, q.device, self.splits)))
        total = sum(p[2] for p in plans)
        out_part = torch.empty(b, hq, tq, total, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(b, hq, tq, total, dtype=torch.float32, device=q.device)
        split0 = 0
        prepared: dict[int, torch.Tensor] = {}
        for seg, (tile0, tiles, splits) in zip(segments, plans):
            key = id(seg.k_codec)
            if key not in prepared:
                prepared[key] = self.prepare(q, seg)
            self.launch(prepared[key], seg, out_part, lse_part, split0, scale, tile0, tiles, splits)
            split0 += splits
        out, lse = combine(out_part, lse_part)
        return self.finish(out, segments[0]), lse

    def _check_common(self, q: torch.Tensor, seg) -> None:
        if not seg.encoded:
            raise KernelUnsupported("native segment")
        shape = seg.k_enc.shape
        if len(shape) != 4 or q.dim() != 4 or tuple(seg.v_enc.shape) != tuple(shape):
            raise KernelUnsupported(f"expected [B, H, T, D] segments and queries, got {shape} and {tuple(q.shape)}")
        b, h, _, d = shape
        if q.shape[0] != b or q.shape[-1] != d or q.shape[1] % h:
            raise KernelUnsupported(f"query {tuple(q.shape)} does not match segment {shape}")
        if d < 16 or d & (d - 1):
            raise KernelUnsupported(f"head dim {d} is not a power of two >= 16")
        if str(seg.k_codec.config) != str(self.k_config) or str(seg.v_codec.config) != str(self.v_config):
            raise KernelUnsupported("segment codecs differ from the kernel's configs")


def _same_rotation(a, b) -> bool:
    """Whether two codecs of one config (`_check_common`) rotate alike: a seeded rotation is drawn from (layer, seed,
    heads); for a fixed one (OScaR's Hadamard) the test is conservative, and a cache's segments share one codec."""
    return a is b or (a.layer, a.seed, a.num_heads) == (b.layer, b.seed, b.num_heads)


def use_asm() -> bool:
    """Inline PTX is available except under the Triton interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("1", "true", "True")


def launch_grid(q: torch.Tensor, splits: int) -> tuple[int, int, int]:
    """(split, query head x row, batch): the splits of one row are neighbours, so they share L2 lines of q."""
    b, hq, tq, _ = q.shape
    return (splits, hq * tq, b)


# ----------------------------------------------------------------------------------------------------------------
# Exact fallbacks


def _repeat_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x if x.shape[1] == hq else x.repeat_interleave(hq // x.shape[1], dim=1)


def reference_lse(q: torch.Tensor, segments: Sequence, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode each segment to fp32 with the codec's torch reference and attend exactly (mmkv.attention)."""
    from mmkv import attention

    parts = []
    for seg in segments:
        k = seg.k_codec._decode(seg.k_enc)[..., seg.skip_tokens :, :]
        v = seg.v_codec._decode(seg.v_enc)[..., seg.skip_tokens :, :]
        hq = q.shape[1]
        parts.append(attention.attention_lse(q.float(), _repeat_heads(k, hq), _repeat_heads(v, hq), scale))
    return attention.merge_lse(parts)


def _flash_ok(q: torch.Tensor) -> bool:
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def decode_flash_lse(q: torch.Tensor, segments: Sequence, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Long query blocks: decode the past once into the query dtype (the codec's decode, Triton where registered)
    and run flash attention, which returns the LSE (the video chunk regime is compute-bound; docs/perf.md)."""
    from mmkv import attention

    if not _flash_ok(q):
        return reference_lse(q, segments, scale)
    k, v = attention.gather(segments, None, None, q.dtype)
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out.float(), lse.float()
