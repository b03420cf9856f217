"""Fused split-K decode attention over TurboQuant-MSE keys and groupquant values (reference:
`mmkv.codecs.turboquant_mse` + `mmkv.codecs.groupquant`, decode + SDPA).

Scores in the rotated domain (as OCTOPUS paper eq. 13): q.k^ = gamma_t <H(s q), c[idx_t]>, with the query rotated once
per call and each code looked up in the 2^b-entry Lloyd-Max codebook (one L1 line, so a warp's lookups are one
wavefront). Values are the unrotated groupquant token groups (`value_step`).
"""

from __future__ import annotations

import torch
import triton.language as tl

from mmkv.kernels.attn_splitk import (
    LOG2E,
    KernelUnsupported,
    SplitKAttention,
    apply_rotation,
    code_plane,
    empty_split,
    half_units,
    load_units,
    lookup,
    launch_grid,
    query_row,
    rotation_matrix,
    softmax_step,
    split_tiles,
    store_split,
    unit_ints,
    value_layout,
    value_rows,
    value_step,
    unit_shape,
    use_asm,
)
from mmkv.kernels.common import cdiv, jit


@jit
def _turboquant_attn_kernel(
    q_ptr, out_part, lse_part,
    kc_ptr, kn_ptr, cb_ptr,
    vc_ptr, vs_ptr, vo_ptr,
    T, skip, tile0, tiles_per_split, split0, S_total, Tq, GQ, scale_log2,
    kc_sb, kc_sh, kn_sb, kn_sh,
    vc_sb, vc_sh, vs_sb, vs_sh, vs_st,
    D: tl.constexpr, BLOCK_N: tl.constexpr, KNU: tl.constexpr, KSU: tl.constexpr, KW: tl.constexpr,
    KHALF: tl.constexpr,
    NG: tl.constexpr, UPG: tl.constexpr, VSU: tl.constexpr, VW: tl.constexpr, VHALF: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr,
):
    lo, hi = split_tiles(tile0, tiles_per_split, T, BLOCK_N)
    row, b, hk, q_row = query_row(q_ptr, Tq, GQ, D)
    kc_row = kc_ptr + b * kc_sb + hk * kc_sh
    kn_row = kn_ptr + b * kn_sb + hk * kn_sh
    vc_row, vs_row, vo_row = value_rows(vc_ptr, vs_ptr, vo_ptr, b, hk, vc_sb, vc_sh, vs_sb, vs_sh)

    # The rotated query as [unit, code] like a key tile (natural channel order, unit-major).
    q = tl.load(q_row + tl.arange(0, KNU)[:, None] * KSU + tl.arange(0, KSU)[None, :])

    m_i, l_i, acc, accm = empty_split(NG, UPG, VSU)
    for j in tl.range(lo, hi, num_stages=STAGES):
        tok = j * BLOCK_N + tl.arange(0, BLOCK_N)
        tmask = (tok >= skip) & (tok < T)
        c = lookup(cb_ptr, unit_ints(load_units(kc_row, tok, tmask, KNU, KW, KHALF, True), KSU, KW, True), ASM)
        gamma = tl.load(kn_row + tok, mask=tmask, other=0.0).to(tl.float32)
        score = tl.sum(tl.sum(c * q[:, :, None], 0), 0) * gamma
        p, alpha, m_i, l_i = softmax_step(score * scale_log2, tmask, m_i, l_i)
        acc, accm = value_step(acc, accm, alpha, p, tok, tmask, vc_row, vs_row, vo_row, vs_st, NG, UPG, VSU, VW,
                               VHALF)

    store_split(acc, accm, m_i, l_i, out_part, lse_part, b, row, S_total, split0, D, NG, UPG, VSU, VW, VHALF)


class TurboQuantAttention(SplitKAttention):
    """TurboQuant-MSE K (hi = 0) with groupquant V."""

    name = "turboquant-mse"
    default_block_n = 32  # measured on H200 at Lk = 128K: faster than 64 at b = 2 and 4 (docs/perf.md)
    default_warps = 4

    def check(self, q: torch.Tensor, seg) -> None:
        kc = seg.k_codec
        if kc.hi:
            raise KernelUnsupported("mixed-precision TurboQuant (hi > 0) has two code planes")
        d = seg.k_enc.shape[-1]
        unit_shape(d, kc.b)
        value_layout(seg.v_codec, d)

    def prepare(self, q: torch.Tensor, seg) -> torch.Tensor:
        return apply_rotation(q, rotation_matrix(seg.k_codec, "rotate_query", q.device), seg.k_enc.shape[1])

    def launch(self, qk, seg, out_part, lse_part, split0, scale, tile0, tiles, splits) -> None:
        kc, ke, ve = seg.k_codec, seg.k_enc, seg.v_enc
        b, h, t, d = ke.shape
        knu, ksu = unit_shape(d, kc.b)
        vl = value_layout(seg.v_codec, d)
        kcodes, vcodes = code_plane(ke.tensors["idx"], kc.b), code_plane(ve.tensors["codes"], vl["VW"])
        kn, vs, vo = ke.tensors["norm"], ve.tensors["scale"], ve.tensors["offset"]
        if kn.stride(-1) != 1 or vs.stride(-1) != 1 or vo.stride() != vs.stride():
            raise KernelUnsupported("norms and group parameters need unit inner strides")
        cb = kc.lo_q._on(qk.device)[0]  # the codec's own fp32 centroids on this device
        _turboquant_attn_kernel[launch_grid(qk, splits)](
            qk, out_part, lse_part,
            kcodes, kn, cb,
            vcodes, vs, vo,
            t, seg.skip_tokens, tile0, cdiv(tiles, splits), split0, out_part.shape[-2], qk.shape[2],
            qk.shape[1] // h, scale * LOG2E,
            kcodes.stride(0), kcodes.stride(1), kn.stride(0), kn.stride(1),
            vcodes.stride(0), vcodes.stride(1), vs.stride(0), vs.stride(1), vs.stride(2),
            D=d, BLOCK_N=self.tile_size(seg), KNU=knu, KSU=ksu, KW=kc.b, KHALF=half_units(kc.b),
            STAGES=self.stages, ASM=use_asm(), num_warps=self.warps(seg), **vl,
        )


def attention_kernel(k_config, v_config) -> TurboQuantAttention | None:
    if k_config.get("hi", 0) or v_config.name not in ("groupquant",):
        return None
    return TurboQuantAttention(k_config, v_config)
