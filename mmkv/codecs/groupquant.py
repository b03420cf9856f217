"""Asymmetric min-max group quantisation: the one quantiser the min-max family (groupquant, KIVI, OScaR) shares, and
the `groupquant` value codec the rotation codecs pair with.

groupquant (the `amirzandieh/QJL` `triton_quantize_and_pack_along_last_dim` recipe): per
token, groups of `group` consecutive channels along D, asymmetric min-max at b bits, fp16 scale and minimum:
s = (max - min) / (2^b - 1), q = round(clamp((x - min) / s, 0, 2^b - 1)), x^ = q s + min. Cost b + 32/g bits a value.

Groups run along one axis of the unit being encoded: channels within a token ("token" axis, V-style) or tokens within a
channel ("channel" axis, KIVI/OScaR K). When the axis length is not a multiple of the group, the last group is ragged
(shorter) and still stores its own scale and offset, which are counted. Codes of a whole unit are one dense bit row per
leading index (`mmkv.codecs.packing`), token-major: code (t, j) sits at bits [(t D + j) b, (t D + j + 1) b).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from mmkv.codecs.base import Codec, CodecError, Encoded
from mmkv.codecs.config import CodecConfig
from mmkv.codecs.packing import pack_bits, unpack_bits

META_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
ZERO_POINTS = ("min", "rounded")  # KIVI/QJL float minimum; OScaR/QuaRot rounded integer zero point


def num_groups(n: int, group: int) -> int:
    return -(-n // group)


def _expand(p: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """Per-group parameters [..., ng] -> per-element [..., n] (the ragged last group is cut short)."""
    return p.repeat_interleave(group, dim=-1)[..., :n]


def group_min_max(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of consecutive groups of `group` elements along the last dim, the last group possibly ragged."""
    n = x.shape[-1]
    full = n // group
    mins, maxs = [], []
    if full:
        main = x[..., : full * group].reshape(*x.shape[:-1], full, group)
        mins.append(main.amin(-1))
        maxs.append(main.amax(-1))
    if n % group:
        tail = x[..., full * group:]
        mins.append(tail.amin(-1, keepdim=True))
        maxs.append(tail.amax(-1, keepdim=True))
    if not mins:  # an empty unit
        empty = x.new_empty(*x.shape[:-1], 0)
        return empty, empty
    return torch.cat(mins, -1), torch.cat(maxs, -1)


def quantize_groups(
    x: torch.Tensor,
    group: int,
    bits: int,
    *,
    zero_point: str = "min",
    meta_dtype: torch.dtype = torch.float16,
    where: str = "min-max quantiser",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise groups along the last dim. Returns (codes int64 [..., n], scale [..., ng], offset [..., ng]).

    Decoding is x^ = q * scale + offset for both conventions: offset = min (KIVI, QJL) or offset = -z s with the
    integer zero point z = round(-min / s) (OScaR's `qpack.h::compute_affine_asym_params`). A
    zero-range group stores scale 0 and offset = min, so it decodes exactly (OScaR's CUDA path; KIVI has no guard and
    would divide by zero). Codes are computed against the stored (rounded) scale and offset, i.e. against the grid the
    decoder uses.
    """
    if zero_point not in ZERO_POINTS:
        raise CodecError(f"{where}: zero_point must be one of {ZERO_POINTS}, got {zero_point!r}")
    levels = (1 << bits) - 1
    mn, mx = group_min_max(x, group)
    scale = ((mx - mn) / levels).to(meta_dtype)
    s = scale.float()
    if zero_point == "min":
        offset = mn.to(meta_dtype)
    else:
        z = torch.round(-mn / torch.where(s > 0, s, torch.ones_like(s)))
        offset = torch.where(s > 0, -z * s, mn).to(meta_dtype)
    if scale.numel() and not (torch.isfinite(scale).all() and torch.isfinite(offset).all()):
        big = float(torch.maximum(mx.abs(), mn.abs()).max())
        raise CodecError(
            f"{where}: group scale/offset overflow {meta_dtype} (largest |value| {big:.4g}); use meta=fp32 for inputs "
            f"beyond the fp16 range"
        )
    n = x.shape[-1]
    s_el = _expand(s, group, n)
    o_el = _expand(offset.float(), group, n)
    safe = torch.where(s_el > 0, s_el, torch.ones_like(s_el))
    y = torch.where(s_el > 0, (x - o_el) / safe, torch.zeros_like(x))
    # KIVI's order (clamp, then round); for integer bounds it equals round-then-clamp (OScaR's order).
    codes = y.clamp(0, levels).round().to(torch.int64)
    return codes, scale, offset


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """x^ = q * scale + offset per group, in fp32."""
    n = codes.shape[-1]
    return codes.to(torch.float32) * _expand(scale.float(), group, n) + _expand(offset.float(), group, n)


# ----------------------------------------------------------------------------------------------------------------
# A whole unit x[..., T, D], grouped along channels ("token") or along tokens ("channel").

AXES = ("token", "channel")


def encode_minmax(
    x: torch.Tensor,
    *,
    bits: int,
    group: int,
    axis: str,
    zero_point: str,
    meta_dtype: torch.dtype,
    where: str,
) -> dict[str, torch.Tensor]:
    """Packed codes (token-major) plus per-group scale and offset.

    axis="token": per token, groups of `group` channels; scale/offset [..., T, ceil(D/G)].
    axis="channel": per channel, groups of `group` tokens (KIVI's K layout (B, H, d, T/G)); scale/offset
    [..., D, ceil(T/G)].
    """
    *lead, t, d = x.shape
    if axis == "token":
        codes, scale, offset = quantize_groups(
            x, group, bits, zero_point=zero_point, meta_dtype=meta_dtype, where=where
        )
    elif axis == "channel":
        codes, scale, offset = quantize_groups(
            x.transpose(-1, -2), group, bits, zero_point=zero_point, meta_dtype=meta_dtype, where=where
        )
        codes = codes.transpose(-1, -2)
    else:
        raise CodecError(f"{where}: axis must be one of {AXES}, got {axis!r}")
    packed = pack_bits(codes.reshape(*lead, t * d), bits)
    return {"codes": packed, "scale": scale.contiguous(), "offset": offset.contiguous()}


def decode_minmax(
    tensors: dict[str, torch.Tensor], shape: tuple[int, ...], *, bits: int, group: int, axis: str,
    units: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The decode of `encode_minmax`'s tensors. `units`: the token counts of consecutive units joined along the
    tokens ("channel" axis only, `RoleCodec.join_units`), each unit's groups starting at its own first token."""
    *lead, t, d = shape
    codes = unpack_bits(tensors["codes"], bits, t * d).reshape(*lead, t, d)
    if axis == "token":
        return dequantize_groups(codes, tensors["scale"], tensors["offset"], group)
    if units is None:
        return dequantize_groups(codes.transpose(-1, -2), tensors["scale"], tensors["offset"], group).transpose(-1, -2)
    idx = unit_groups(units, group, codes.device)  # each token's own group's parameters, the same values as above
    scale, offset = tensors["scale"].float().index_select(-1, idx), tensors["offset"].float().index_select(-1, idx)
    return (codes.transpose(-1, -2).to(torch.float32) * scale + offset).transpose(-1, -2)


@functools.lru_cache(maxsize=256)
def unit_groups(units: tuple[int, ...], group: int, device: torch.device) -> torch.Tensor:
    """The group of every token of consecutive units whose groups of `group` tokens start afresh at each unit's first
    token: int64 [sum(units)]. Kept per (units, group, device), read only (a store asks for the same few)."""
    parts, base = [], 0
    for n in units:
        parts.append(base + torch.arange(n) // group)
        base += num_groups(n, group)
    return torch.cat(parts).to(device)


@dataclass(frozen=True)
class GroupQuantConfig(CodecConfig):
    """bits per value, `group` channels a group, `meta` the dtype of the stored scale and minimum."""

    name: ClassVar[str] = "groupquant"
    aliases: ClassVar[dict[str, str]] = {"b": "bits", "g": "group"}
    allowed_bits: ClassVar[tuple[int, ...]] = tuple(range(1, 9))
    bits: int = 2
    group: int = 32
    meta: str = "fp16"

    def __post_init__(self) -> None:
        self.check_choice("bits", self.allowed_bits)
        if not isinstance(self.group, int) or isinstance(self.group, bool) or self.group < 1:
            self.fail(f"group must be a positive int (e.g. 16 or 32), got {self.group!r}")
        if self.meta not in META_DTYPES:
            self.fail(f"meta must be one of {sorted(META_DTYPES)}, got {self.meta!r}")


# KIVI's split, which OScaR keeps: keys in per-channel groups of tokens, values in per-token groups of channels.
ROLES = {"k": "channel", "v": "token"}


@dataclass(frozen=True)
class RoleConfig(GroupQuantConfig):
    """A min-max codec with a key role (per-channel groups over tokens) and a value role (KIVI, OScaR)."""

    role: str = "k"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.role not in ROLES:
            self.fail(f"role must be 'k' (per-channel keys) or 'v' (per-token values), got {self.role!r}")


class RoleCodec(Codec):
    """What KIVI and OScaR share: a K / V role (keys grouped over tokens per channel, values per token), V built with
    the key's own group and bits, and rows (batch, head) that decode independently, so the store stacks equal units
    (`stack_units`). Not registered itself."""

    config_class = RoleConfig
    stackable = True
    bit_streams = ("codes",)

    @classmethod
    def value_config(cls, config: CodecConfig, group: int = 32) -> CodecConfig:
        return config.replace(role="v")  # the paper's own V recipe, not the harness's value group

    def setup(self) -> None:
        self.bits, self.group, self.role = self.config.bits, self.config.group, self.config.role
        self.meta_dtype = META_DTYPES[self.config.meta]
        self.axis = ROLES[self.role]
        self.token_local = self.axis == "token"  # V: per-token groups; K groups over tokens
        # K units of any lengths join (`join_units`) when each token's codes fill whole bytes
        self.joins_units = self.axis == "channel" and self.head_dim * self.bits % 8 == 0

    def units(self, enc: Encoded) -> tuple[int, ...] | None:
        """The token counts of the units `join_units` joined into `enc` (None for one unit or a stack)."""
        return enc.meta.get("units")

    def join_units(self, encs: list[Encoded]) -> Encoded | None:
        """Consecutive K units of any token counts (an AAR's scales) as one encoding that decodes, bit for bit, as
        the units do: every stored tensor concatenated along its last axis (the code rows, whose tokens fill whole
        bytes; the groups' scales and offsets; OScaR's token norms), the units' token counts in `meta["units"]`,
        since each unit's groups start at its own first token (`decode_minmax(units=...)`). The same bytes as the
        units. None when it cannot be done exactly: V (token-local: `concat_tokens`), stacks, differing layouts."""
        if not self.joins_units or len(encs) < 2:
            return None
        first = encs[0]
        rest = {k: v for k, v in first.meta.items() if k != "units"}
        if len(first.shape) < 3 or any(
                len(e.shape) != len(first.shape) or tuple(e.shape[:-2]) != tuple(first.shape[:-2])
                or e.shape[-1] != first.shape[-1] or e.codec != first.codec or e.dtype != first.dtype
                or list(e.tensors) != list(first.tensors)
                or {k: v for k, v in e.meta.items() if k != "units"} != rest for e in encs):
            return None
        units = tuple(n for e in encs for n in (self.units(e) or (e.shape[-2],)))
        tensors = {k: torch.cat([e.tensors[k] for e in encs], dim=-1) for k in first.tensors}
        shape = (*first.shape[:-2], sum(units), first.shape[-1])
        return Encoded(first.codec, shape, first.dtype, tensors, {**rest, "units": units})


class GroupQuantCodec(Codec):
    """Per-token groups of `group` channels, asymmetric min-max, fp16 (scale, min): b + 32/g bits a value (A9)."""

    config_class = GroupQuantConfig
    display_name = "GroupQuant"
    token_local = True  # each token encoded on its own (CacheConfig.merge_units)
    bit_streams = ("codes",)

    def setup(self) -> None:
        self.bits, self.group = self.config.bits, self.config.group
        self.meta_dtype = META_DTYPES[self.config.meta]

    def _encode(self, x: torch.Tensor) -> Encoded:
        tensors = encode_minmax(
            x, bits=self.bits, group=self.group, axis="token", zero_point="min", meta_dtype=self.meta_dtype,
            where=f"codec {self.config} (layer {self.layer})",
        )
        return Encoded(self.name, tuple(x.shape), x.dtype, tensors)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return decode_minmax(enc.tensors, enc.shape, bits=self.bits, group=self.group, axis="token")
