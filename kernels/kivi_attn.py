"""Fused split-K decode attention over KIVI-packed K and V (reference: `mmkv.codecs.kivi`, decode + SDPA).

K is per-channel min-max over groups of G tokens (k^ = c s[d, g] + m[d, g]), so one tile is one K group: per tile the
query is multiplied by the group's channel scales once and sum_d q_d m[d, g] is one dot product, leaving one FMA per
code: score_t = sum_d (q_d s_dg) c_td + sum_d q_d m_dg (KIVI's `matmul.py`). V is per-token groups (`value_step`).
OScaR (`oscar_attn.py`) runs this kernel with its token norms (HAS_NORM) in the rotated domain.
"""

from __future__ import annotations

import torch
import triton.language as tl

from mmkv.kernels.attn_splitk import (
    LOG2E,
    KernelUnsupported,
    SplitKAttention,
    code_plane,
    empty_split,
    half_units,
    load_units,
    launch_grid,
    query_row,
    softmax_step,
    split_tiles,
    store_split,
    unit_scale,
    unit_values,
    value_layout,
    value_rows,
    value_step,
    unit_shape,
)
from mmkv.kernels.common import cdiv, jit


@jit
def _channel_group_attn_kernel(
    q_ptr, out_part, lse_part,
    kc_ptr, ks_ptr, ko_ptr, kn_ptr,
    vc_ptr, vs_ptr, vo_ptr,
    T, skip, tile0, tiles_per_split, split0, S_total, Tq, GQ, scale_log2,
    kc_sb, kc_sh, ks_sb, ks_sh, ks_sd, kn_sb,
    vc_sb, vc_sh, vs_sb, vs_sh, vs_st,
    D: tl.constexpr, G: tl.constexpr, KNU: tl.constexpr, KSU: tl.constexpr, KW: tl.constexpr,
    KHALF: tl.constexpr, HAS_NORM: tl.constexpr,
    NG: tl.constexpr, UPG: tl.constexpr, VSU: tl.constexpr, VW: tl.constexpr, VHALF: tl.constexpr,
    STAGES: tl.constexpr,
):
    lo, hi = split_tiles(tile0, tiles_per_split, T, G)
    row, b, hk, q_row = query_row(q_ptr, Tq, GQ, D)
    kc_row = kc_ptr + b * kc_sb + hk * kc_sh
    ks_row = ks_ptr + b * ks_sb + hk * ks_sh
    ko_row = ko_ptr + b * ks_sb + hk * ks_sh
    vc_row, vs_row, vo_row = value_rows(vc_ptr, vs_ptr, vo_ptr, b, hk, vc_sb, vc_sh, vs_sb, vs_sh)

    dk = tl.arange(0, KNU)[:, None] * KSU + tl.arange(0, KSU)[None, :]  # channel of each (unit, code)
    q = tl.load(q_row + dk)
    qk = q * unit_scale(KSU, KW, KHALF)[None, :]  # codes arrive as c 2^o: fold 2^-o into the query once

    m_i, l_i, acc, accm = empty_split(NG, UPG, VSU)
    for j in tl.range(lo, hi, num_stages=STAGES):
        tok = j * G + tl.arange(0, G)
        tmask = (tok >= skip) & (tok < T)
        vals = unit_values(load_units(kc_row, tok, tmask, KNU, KW, KHALF, True), KSU, KW, KHALF, True)
        s = tl.load(ks_row + dk * ks_sd + j).to(tl.float32)
        m = tl.load(ko_row + dk * ks_sd + j).to(tl.float32)
        score = tl.sum(tl.sum(vals * (qk * s)[:, :, None], 0), 0) + tl.sum(tl.sum(q * m, 1), 0)
        if HAS_NORM:
            score = score * tl.load(kn_ptr + b * kn_sb + tok, mask=tmask, other=1.0)
        p, alpha, m_i, l_i = softmax_step(score * scale_log2, tmask, m_i, l_i)
        acc, accm = value_step(acc, accm, alpha, p, tok, tmask, vc_row, vs_row, vo_row, vs_st, NG, UPG, VSU, VW,
                               VHALF)

    store_split(acc, accm, m_i, l_i, out_part, lse_part, b, row, S_total, split0, D, NG, UPG, VSU, VW, VHALF)


class KiviAttention(SplitKAttention):
    """KIVI K (role=k, per-channel token groups) with KIVI V (role=v, per-token channel groups)."""

    name = "kivi"

    def warps(self, seg) -> int:
        # Measured on H200 at Lk = 128K (docs/perf.md): one warp per 32-token tile is fastest at 4 bits and above;
        # at 2-3 bits one warp spills, two warps win.
        return self.num_warps or (1 if seg.k_codec.bits >= 4 else 2)
    has_norm = False

    def check(self, q: torch.Tensor, seg) -> None:
        kc, vc = seg.k_codec, seg.v_codec
        if kc.axis != "channel" or vc.axis != "token":
            raise KernelUnsupported("needs per-channel K and per-token V")
        g = kc.group
        if g & (g - 1) or not 2 <= g <= 256:
            raise KernelUnsupported(f"K group {g} is not a power of two in 2..256 (one tile is one K group)")
        d = seg.k_enc.shape[-1]
        unit_shape(d, kc.bits)
        value_layout(vc, d)

    def tile_size(self, seg) -> int:
        return seg.k_codec.group

    def prepare(self, q: torch.Tensor, seg) -> torch.Tensor:
        return q.float().contiguous()

    def launch(self, qk, seg, out_part, lse_part, split0, scale, tile0, tiles, splits) -> None:
        kc, vc = seg.k_codec, seg.v_codec
        ke, ve = seg.k_enc, seg.v_enc
        b, h, t, d = ke.shape
        knu, ksu = unit_shape(d, kc.bits)
        vl = value_layout(vc, d)
        kcodes, vcodes = code_plane(ke.tensors["codes"], kc.bits), code_plane(ve.tensors["codes"], vl["VW"])
        ks, ko, vs, vo = ke.tensors["scale"], ke.tensors["offset"], ve.tensors["scale"], ve.tensors["offset"]
        for x in (ks, ko, vs, vo):
            if x.stride(-1) != 1:
                raise KernelUnsupported("group parameters need a unit inner stride")
        if ko.stride() != ks.stride() or vo.stride() != vs.stride():
            raise KernelUnsupported("scale and offset tensors must share strides")
        if self.has_norm:
            kn = ke.tensors["norm"]
            if kn.dim() != 2 or kn.stride(-1) != 1:
                raise KernelUnsupported(f"expected OScaR token norms [B, T], got {tuple(kn.shape)}")
            kn_sb = kn.stride(0)
        else:
            kn, kn_sb = ks, 0  # unused
        _channel_group_attn_kernel[launch_grid(qk, splits)](
            qk, out_part, lse_part,
            kcodes, ks, ko, kn,
            vcodes, vs, vo,
            t, seg.skip_tokens, tile0, cdiv(tiles, splits), split0, out_part.shape[-2], qk.shape[2],
            qk.shape[1] // h, scale * LOG2E,
            kcodes.stride(0), kcodes.stride(1), ks.stride(0), ks.stride(1), ks.stride(2), kn_sb,
            vcodes.stride(0), vcodes.stride(1), vs.stride(0), vs.stride(1), vs.stride(2),
            D=d, G=kc.group, KNU=knu, KSU=ksu, KW=kc.bits, KHALF=half_units(kc.bits), HAS_NORM=self.has_norm,
            STAGES=self.stages, num_warps=self.warps(seg), **vl,
        )


def attention_kernel(k_config, v_config) -> KiviAttention | None:
    if k_config.get("role") != "k" or v_config.name != "kivi" or v_config.get("role") != "v":
        return None
    return KiviAttention(k_config, v_config)
