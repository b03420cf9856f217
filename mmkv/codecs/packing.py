"""The one bit-packing module: fixed-width codes as a dense little-endian bit stream along the last dim.

Code i of a row occupies bits [i*w, (i+1)*w) of the row's byte string, least significant bit first. For w in
{1, 2, 4, 8} this is the usual "8/w codes per byte, lowest bits first" layout; for other widths a code spans at most two
bytes when w <= 8, so a kernel reads a 16-bit window at byte (i*w) >> 3 and shifts by (i*w) & 7. Rows are padded to a
whole byte only at their end, and that padding is stored and counted like any other byte.
"""

from __future__ import annotations

import torch

from mmkv.codecs.base import CodecError


def packed_nbytes(n: int, width: int) -> int:
    """Bytes for n codes of `width` bits."""
    return (n * width + 7) // 8


def _group(width: int) -> int | None:
    """Smallest number of codes g whose g*width bits fill whole bytes within one int64 word (None: use bit planes)."""
    for g in (1, 2, 4, 8):
        if (g * width) % 8 == 0 and g * width <= 64:
            return g
    return None


def pack_bits(codes: torch.Tensor, width: int, *, in_range: bool = False) -> torch.Tensor:
    """codes[..., N] (integers in [0, 2**width)) -> uint8[..., ceil(N*width/8)]. The range is checked (two host syncs
    on CUDA) unless `in_range` says the caller masked the codes to `width` bits."""
    if not 1 <= width <= 16:
        raise CodecError(f"pack width must be in 1..16 bits, got {width}")
    codes = codes.to(torch.int64)
    if not in_range and codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << width)):
        raise CodecError(f"codes out of range for {width}-bit packing: [{int(codes.min())}, {int(codes.max())}]")
    lead, n = codes.shape[:-1], codes.shape[-1]
    if width == 8:
        return codes.to(torch.uint8)
    g = _group(width)
    if g is not None:
        # g codes -> one int64 word of g*width bits -> g*width/8 bytes: the same bit stream, far fewer temporaries.
        groups = -(-n // g)
        c = torch.nn.functional.pad(codes, (0, groups * g - n)).view(*lead, groups, g)
        word = (c << (torch.arange(g, device=codes.device, dtype=torch.int64) * width)).sum(-1)
        nb = g * width // 8
        out = (word.unsqueeze(-1) >> (torch.arange(nb, device=codes.device, dtype=torch.int64) * 8)) & 255
        return out.to(torch.uint8).view(*lead, groups * nb)[..., : packed_nbytes(n, width)].contiguous()
    shifts = torch.arange(width, device=codes.device, dtype=torch.int64)
    bits = ((codes.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(*lead, n * width)
    nbytes = packed_nbytes(n, width)
    pad = nbytes * 8 - n * width
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    bits = bits.reshape(*lead, nbytes, 8).to(torch.int64)
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int64))
    return (bits * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """uint8[..., M] -> int64[..., n]; the inverse of `pack_bits`."""
    if packed.dtype != torch.uint8:
        raise CodecError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_nbytes(n, width):
        raise CodecError(f"{packed.shape[-1]} bytes cannot hold exactly {n} codes of {width} bits")
    if width == 8:
        return packed.to(torch.int64)
    lead = packed.shape[:-1]
    g = _group(width)
    if g is not None:
        nb = g * width // 8
        groups = -(-n // g)
        p = torch.nn.functional.pad(packed, (0, groups * nb - packed.shape[-1])).view(*lead, groups, nb).to(torch.int64)
        word = (p << (torch.arange(nb, device=packed.device, dtype=torch.int64) * 8)).sum(-1)
        shifts = torch.arange(g, device=packed.device, dtype=torch.int64) * width
        return ((word.unsqueeze(-1) >> shifts) & ((1 << width) - 1)).view(*lead, groups * g)[..., :n]
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64)
    bits = ((packed.to(torch.int64).unsqueeze(-1) >> shifts) & 1).reshape(*lead, -1)[..., : n * width]
    bits = bits.reshape(*lead, n, width)
    weights = (1 << torch.arange(width, device=packed.device, dtype=torch.int64))
    return (bits * weights).sum(-1)


def concat_streams(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Dense bit streams uint8[..., ceil(n_i / 8)] holding n_i bits each (same leading dims) -> the one stream of their
    sum n_i bits: what `pack_bits` gives for all their codes in one row, so the padding of each part's last byte
    goes, and only the end is padded (with zeros). Whole bytes are kept as bytes up to the first part that ends
    inside a byte; from that part's last byte on, the bits are unpacked, joined and packed again, so a store that
    joins its whole past with a new unit repacks the new unit, not the past."""
    if not parts:
        raise CodecError("concat_streams: no streams to join")
    for p, n in parts:
        if p.dtype != torch.uint8 or p.shape[-1] != packed_nbytes(n, 1):
            raise CodecError(f"concat_streams: a uint8 stream of {n} bits has {(n + 7) // 8} bytes, got "
                             f"{p.dtype} [..., {p.shape[-1]}]")
    aligned = 0
    while aligned < len(parts) - 1 and parts[aligned][1] % 8 == 0:
        aligned += 1
    head = [p for p, _ in parts[:aligned]]
    rest = parts[aligned:]
    if len(rest) > 1:
        p, n = rest[0]
        if n >= 8:  # its whole bytes stay bytes; only the partial last one is repacked with what follows
            head.append(p[..., : n // 8])
            rest = [(p[..., n // 8 :], n % 8), *rest[1:]]
        shifts = torch.arange(8, device=rest[0][0].device, dtype=torch.uint8)
        bits = torch.cat([((p.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :n] for p, n in rest], dim=-1)
        total = bits.shape[-1]
        bits = torch.nn.functional.pad(bits, (0, packed_nbytes(total, 1) * 8 - total))
        rest = [((bits.unflatten(-1, (-1, 8)) << shifts).sum(-1, dtype=torch.uint8), total)]
    joined = head + [p for p, _ in rest]
    return joined[0] if len(joined) == 1 else torch.cat(joined, dim=-1)
