"""Fused split-K decode attention over OCTOPUS keys and groupquant values (reference: `mmkv.codecs.octopus` +
`mmkv.codecs.groupquant`, decode + SDPA).

Score path (OCTOPUS eq. 13, fp32): with the query rotated once, q' = H(s q) zero-padded to 3 n_t and split
into triplets q'_i, score_t = gamma_t sum_i C_rho[jr_i] <q'_i, n^(C_xi[jx_i], C_xi[jy_i])>, where n^ is the
octahedral decode normalised in registers (one rsqrt a triplet; the 2^dir-entry xi codebook is one L1 line, unlike the
2^(2 dir)-entry direction LUT). Accumulated in fp32, gamma and the softmax scale applied last. Triplets are processed
in chunks of TCH (43 triplets at d = 128 -> 3 chunks of 16). Codes are read from the dense bit streams at bit
(t n_t + i) w: a window of one to three bytes. Values are the unrotated groupquant token groups (`value_step`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmkv.kernels.attn_splitk import (
    LOG2E,
    KernelUnsupported,
    SplitKAttention,
    apply_rotation,
    code_plane,
    empty_split,
    launch_grid,
    lookup,
    query_row,
    rotation_matrix,
    softmax_step,
    split_tiles,
    store_split,
    use_asm,
    value_layout,
    value_rows,
    value_step,
)
from mmkv.kernels.common import cdiv, jit

TRIPLET_CHUNK = 16


@triton.jit
def _stream_codes(row_ptr, idx, mask, W: tl.constexpr, NB: tl.constexpr):
    """Code number `idx` of a dense W-bit stream: a little-endian window of NB bytes from byte (idx W) >> 3."""
    bit = idx * W
    ptr = row_ptr + (bit >> 3)
    x = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    for j in tl.static_range(1, NB):
        x = x | (tl.load(ptr + j, mask=mask, other=0).to(tl.int32) << (8 * j))
    return (x >> (bit & 7)) & ((1 << W) - 1)


# OCTOPUS packs 2 x bits (and rho bits) a triplet, 42 triplets a token, so its row byte counts change their
# divisibility with the token count, and its codes are read at bit offsets: their alignment buys nothing.
@jit(also=("dir_sb", "dir_sh", "rho_sb", "rho_sh"))
def _octopus_attn_kernel(
    q_ptr, out_part, lse_part,
    dir_ptr, rho_ptr, gam_ptr, xi_tab, rho_tab,
    vc_ptr, vs_ptr, vo_ptr,
    T, skip, tile0, tiles_per_split, split0, S_total, Tq, GQ, scale_log2,
    dir_sb, dir_sh, rho_sb, rho_sh, gam_sb, gam_sh,
    vc_sb, vc_sh, vs_sb, vs_sh, vs_st,
    D: tl.constexpr, NT: tl.constexpr, TCH: tl.constexpr, NCH: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRB: tl.constexpr, DIR_NB: tl.constexpr, RHOW: tl.constexpr, RHO_NB: tl.constexpr, HAS_RHO: tl.constexpr,
    NG: tl.constexpr, UPG: tl.constexpr, VSU: tl.constexpr, VW: tl.constexpr, VHALF: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr,
):
    lo, hi = split_tiles(tile0, tiles_per_split, T, BLOCK_N)
    row, b, hk, q_row = query_row(q_ptr, Tq, GQ, D)
    dir_row = dir_ptr + b * dir_sb + hk * dir_sh
    rho_row = rho_ptr + b * rho_sb + hk * rho_sh
    gam_row = gam_ptr + b * gam_sb + hk * gam_sh
    vc_row, vs_row, vo_row = value_rows(vc_ptr, vs_ptr, vo_ptr, b, hk, vc_sb, vc_sh, vs_sb, vs_sh)

    m_i, l_i, acc, accm = empty_split(NG, UPG, VSU)
    rho_const = tl.load(rho_tab)  # E[rho] when no rho bits are stored
    for j in tl.range(lo, hi, num_stages=STAGES):
        tok = j * BLOCK_N + tl.arange(0, BLOCK_N)
        tmask = (tok >= skip) & (tok < T)
        score = tl.zeros([BLOCK_N], tl.float32)
        for c in tl.static_range(NCH):
            i = c * TCH + tl.arange(0, TCH)
            # q'_i; zero on the padded coordinates (>= D) and on triplets past n_t, so those add nothing.
            qx = tl.load(q_row + 3 * i, mask=3 * i < D, other=0.0)
            qy = tl.load(q_row + 3 * i + 1, mask=3 * i + 1 < D, other=0.0)
            qz = tl.load(q_row + 3 * i + 2, mask=3 * i + 2 < D, other=0.0)
            idx = i[:, None] + tok[None, :] * NT  # [TCH, BLOCK_N]: a token's triplets in one thread
            valid = (i < NT)[:, None] & tmask[None, :]
            code = _stream_codes(dir_row, idx, valid, 2 * DIRB, DIR_NB)
            xi = lookup(xi_tab, code & ((1 << DIRB) - 1), ASM)
            eta = lookup(xi_tab, code >> DIRB, ASM)
            if HAS_RHO:
                rho = lookup(rho_tab, _stream_codes(rho_row, idx, valid, RHOW, RHO_NB), ASM)
            else:
                rho = rho_const
            # Octahedral decode (OCTOPUS paper, eq. 6), sgn(0) = +1 as in the encoder.
            z = 1.0 - tl.abs(xi) - tl.abs(eta)
            bottom = z < 0
            x = tl.where(bottom, tl.where(xi >= 0, 1.0 - tl.abs(eta), tl.abs(eta) - 1.0), xi)
            y = tl.where(bottom, tl.where(eta >= 0, 1.0 - tl.abs(xi), tl.abs(xi) - 1.0), eta)
            dot = qx[:, None] * x + qy[:, None] * y + qz[:, None] * z
            score += tl.sum(dot * rho * tl.math.rsqrt(x * x + y * y + z * z), 0)
        gamma = tl.load(gam_row + tok, mask=tmask, other=0.0).to(tl.float32)
        p, alpha, m_i, l_i = softmax_step(score * gamma * scale_log2, tmask, m_i, l_i)
        acc, accm = value_step(acc, accm, alpha, p, tok, tmask, vc_row, vs_row, vo_row, vs_st, NG, UPG, VSU, VW,
                               VHALF)

    store_split(acc, accm, m_i, l_i, out_part, lse_part, b, row, S_total, split0, D, NG, UPG, VSU, VW, VHALF)


def window_bytes(w: int) -> int:
    """Bytes a w-bit code can span in a dense stream: codes start at bit offsets (k w) mod 8, at most 8 - gcd(w, 8)."""
    from math import gcd

    return (8 - gcd(w, 8) + w + 7) // 8


class OctopusAttention(SplitKAttention):
    """OCTOPUS K with groupquant V."""

    name = "octopus"
    default_block_n = 32
    default_warps = 4  # measured on H200 at Lk = 128K: faster than (64, 8 warps) and (32, 2 warps)

    def check(self, q: torch.Tensor, seg) -> None:
        kc = seg.k_codec
        if window_bytes(2 * kc.dir_bits) > 4 or (kc.rho_bits and window_bytes(kc.rho_bits) > 4):
            raise KernelUnsupported("code windows wider than 4 bytes")
        value_layout(seg.v_codec, seg.k_enc.shape[-1])

    def prepare(self, q: torch.Tensor, seg) -> torch.Tensor:
        return apply_rotation(q, rotation_matrix(seg.k_codec, "rotate_query", q.device), seg.k_enc.shape[1])

    def launch(self, qk, seg, out_part, lse_part, split0, scale, tile0, tiles, splits) -> None:
        kc, ke, ve = seg.k_codec, seg.k_enc, seg.v_enc
        b, h, t, d = ke.shape
        vl = value_layout(seg.v_codec, d)
        dirs, gam = ke.tensors["dir"], ke.tensors["gamma"]
        rho = ke.tensors.get("rho", dirs)  # unused without rho bits
        vcodes, vs, vo = code_plane(ve.tensors["codes"], vl["VW"]), ve.tensors["scale"], ve.tensors["offset"]
        for x in (dirs, rho, gam, vs):
            if x.stride(-1) != 1:
                raise KernelUnsupported("code planes, norms and group parameters need unit inner strides")
        if vo.stride() != vs.stride():
            raise KernelUnsupported("scale and offset tensors must share strides")
        xi, _, rho_c, _, _ = kc._on(qk.device)  # the codec's own fp32 codebooks on this device
        nch = cdiv(kc.n_t, TRIPLET_CHUNK)
        _octopus_attn_kernel[launch_grid(qk, splits)](
            qk, out_part, lse_part,
            dirs, rho, gam, xi, rho_c,
            vcodes, vs, vo,
            t, seg.skip_tokens, tile0, cdiv(tiles, splits), split0, out_part.shape[-2], qk.shape[2],
            qk.shape[1] // h, scale * LOG2E,
            dirs.stride(0), dirs.stride(1), rho.stride(0), rho.stride(1), gam.stride(0), gam.stride(1),
            vcodes.stride(0), vcodes.stride(1), vs.stride(0), vs.stride(1), vs.stride(2),
            D=d, NT=kc.n_t, TCH=TRIPLET_CHUNK, NCH=nch, BLOCK_N=self.tile_size(seg),
            DIRB=kc.dir_bits, DIR_NB=window_bytes(2 * kc.dir_bits),
            RHOW=max(kc.rho_bits, 1), RHO_NB=window_bytes(max(kc.rho_bits, 1)), HAS_RHO=kc.rho_bits > 0,
            STAGES=self.stages, ASM=use_asm(), num_warps=self.warps(seg), **vl,
        )


def attention_kernel(k_config, v_config) -> OctopusAttention | None:
    if v_config.name != "groupquant":
        return None
    return OctopusAttention(k_config, v_config)
