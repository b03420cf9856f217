"""Fused split-K decode attention over TCQ keys (reference: `mmkv.codecs.tcq`, decode + SDPA), with TCQ values (the
pairing `TCQCodec.value_config` makes) or groupquant values (as TurboQuant-MSE's kernel).

Scores in the rotated domain: q.k^ = gain_t <H(s q), u^_t>, the query rotated once per call. u^_t is QTIP's bitshift
trellis (Tseng et al., NeurIPS 2024; Cornell-RelaxML/qtip lib/codebook/bitshift.py): step i of a token reconstructs
the V = 2 values table[state_i], where state_i is the last L bits of the token's circular code string up to step i.
The stream stores step i's code above step i - 1's while the trellis shifts older codes up, so a state is not one
contiguous window of the packed bits: it is assembled from the codes of the J most recent steps, each read from its
1-3 byte window of the dense stream and shifted by the bits of the steps after it (the host tables of
`mmkv.codecs.tcq.lookback`; the extra bit of a wide step comes from the `code_hi` plane at the step's rank). Mixed step
widths (fractional rates, `hi` > 0) therefore run fused, the widths living only in those tables. The fp32 table
(2^L x 2, 16 KB at L = 11) is read through L1 with `lookup`.

TCQ values are accumulated in the rotated domain, sum_t p_t gain_t u^_t, and rotated back once per output row (as
OScaR's rotated V, `oscar_attn.py`); groupquant values are the unrotated token groups (`value_step`).
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
from mmkv.kernels import tcq_decode
from mmkv.kernels.packing import unpack_at


def supports(codec) -> bool:
    """Whether the kernel covers this TCQ codec (key or value): the head dims of the TCQ kernels, 16..256."""
    return tcq_decode.supports(codec)


@triton.jit
def trellis_states(code_row, hi_row, tok, tmask, src_ptr, shift_ptr, wide_ptr, rank_ptr, STEPS: tl.constexpr,
                   K: tl.constexpr, HI: tl.constexpr, L: tl.constexpr, J: tl.constexpr, KEYS: tl.constexpr):
    """The trellis states (int32) of tokens `tok` [N]: [STEPS, N] for keys (a token's steps in one thread), [N, STEPS]
    for values. state_i = (OR_j code[src[j, i]] << shift[j, i]) mod 2^L over the J most recent steps (circularly)."""
    i = tl.arange(0, STEPS)
    if KEYS:
        tk, m = tok[None, :], tmask[None, :]
        state = tl.zeros([STEPS, tok.shape[0]], tl.int32)
    else:
        tk, m = tok[:, None], tmask[:, None]
        state = tl.zeros([tok.shape[0], STEPS], tl.int32)
    for j in tl.static_range(J):
        src = tl.load(src_ptr + j * STEPS + i)
        shift = tl.load(shift_ptr + j * STEPS + i)
        if HI > 0:
            wide = tl.load(wide_ptr + src) > 0
            rank = tl.load(rank_ptr + src)  # the wide step's index in this token's code_hi bits
        if KEYS:
            src, shift = src[:, None], shift[:, None]
            if HI > 0:
                wide, rank = wide[:, None], rank[:, None]
        else:
            src, shift = src[None, :], shift[None, :]
            if HI > 0:
                wide, rank = wide[None, :], rank[None, :]
        code = unpack_at(code_row, 0, tk * STEPS + src, m, K)
        if HI > 0:
            code |= unpack_at(hi_row, 0, tk * HI + rank, m & wide, 1) << K
        state |= code << shift
    return state & ((1 << L) - 1)


@jit
def _tcq_attn_kernel(
    q_ptr, out_part, lse_part,
    kc_ptr, kh_ptr, kg_ptr, ktab, ksrc, kshift, kwide, krank,
    vc_ptr, vh_ptr, vs_ptr, vo_ptr, vtab, vsrc, vshift, vwide, vrank,
    T, skip, tile0, tiles_per_split, split0, S_total, Tq, GQ, scale_log2,
    kc_sb, kc_sh, kh_sb, kh_sh, kg_sb, kg_sh,
    vc_sb, vc_sh, vh_sb, vh_sh, vs_sb, vs_sh, vs_st,
    D: tl.constexpr, STEPS: tl.constexpr, BLOCK_N: tl.constexpr,
    KK: tl.constexpr, KHI: tl.constexpr, KL: tl.constexpr, KJ: tl.constexpr,
    VTCQ: tl.constexpr, VK: tl.constexpr, VHI: tl.constexpr, VL: tl.constexpr, VJ: tl.constexpr,
    NG: tl.constexpr, UPG: tl.constexpr, VSU: tl.constexpr, VW: tl.constexpr, VHALF: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr,
):
    """V: TCQ (VTCQ: codes vc, wide bits vh, gains vs; accumulated rotated as [1, STEPS, 2]) or groupquant (codes vc,
    scales vs, offsets vo)."""
    lo, hi = split_tiles(tile0, tiles_per_split, T, BLOCK_N)
    row, b, hk, q_row = query_row(q_ptr, Tq, GQ, D)
    kc_row = kc_ptr + b * kc_sb + hk * kc_sh
    kh_row = kh_ptr + b * kh_sb + hk * kh_sh
    kg_row = kg_ptr + b * kg_sb + hk * kg_sh
    vc_row, vs_row, vo_row = value_rows(vc_ptr, vs_ptr, vo_ptr, b, hk, vc_sb, vc_sh, vs_sb, vs_sh)
    vh_row = vh_ptr + b * vh_sb + hk * vh_sh

    # The rotated query as the two coordinates of each step, [STEPS] each.
    i = tl.arange(0, STEPS)
    q0 = tl.load(q_row + 2 * i)
    q1 = tl.load(q_row + 2 * i + 1)

    m_i, l_i, acc, accm = empty_split(NG, UPG, VSU)
    for j in tl.range(lo, hi, num_stages=STAGES):
        tok = j * BLOCK_N + tl.arange(0, BLOCK_N)
        tmask = (tok >= skip) & (tok < T)
        ks = trellis_states(kc_row, kh_row, tok, tmask, ksrc, kshift, kwide, krank, STEPS, KK, KHI, KL, KJ, True)
        dot = q0[:, None] * lookup(ktab, 2 * ks, ASM) + q1[:, None] * lookup(ktab, 2 * ks + 1, ASM)
        gain = tl.load(kg_row + tok, mask=tmask, other=0.0).to(tl.float32)
        p, alpha, m_i, l_i = softmax_step(tl.sum(dot, 0) * gain * scale_log2, tmask, m_i, l_i)
        if VTCQ:
            vst = trellis_states(vc_row, vh_row, tok, tmask, vsrc, vshift, vwide, vrank, STEPS, VK, VHI, VL, VJ,
                                 False)
            w = (p * tl.load(vs_row + tok, mask=tmask, other=0.0).to(tl.float32))[:, None]  # p_t gain_t
            a0 = tl.sum(w * lookup(vtab, 2 * vst, ASM), 0)
            a1 = tl.sum(w * lookup(vtab, 2 * vst + 1, ASM), 0)
            acc = acc * alpha + tl.reshape(tl.join(a0, a1), [1, STEPS, 2])
        else:
            acc, accm = value_step(acc, accm, alpha, p, tok, tmask, vc_row, vs_row, vo_row, vs_st, NG, UPG, VSU, VW,
                                   VHALF)

    store_split(acc, accm, m_i, l_i, out_part, lse_part, b, row, S_total, split0, D, NG, UPG, VSU, VW, VHALF)


def _byte_plane(t: torch.Tensor) -> torch.Tensor:
    """A [B, H, nbytes] uint8 bit stream per (batch, head) row, read byte-wise (`unpack_at`)."""
    if t.dtype != torch.uint8 or t.dim() != 3 or t.stride(-1) != 1:
        raise KernelUnsupported(f"expected a [B, H, nbytes] uint8 plane with unit inner stride, got {tuple(t.shape)}")
    return t


def trellis_args(codec, enc, device: torch.device) -> tuple[list[torch.Tensor], list[int], dict]:
    """(tensors, strides, constants) of a TCQ plane set as the kernel reads it: code, code_hi, gain, then the table
    and lookback tables; (B, H) strides of code, code_hi, gain; K, HI, L, J."""
    code, gain = _byte_plane(enc.tensors["code"]), enc.tensors["gain"]
    code_hi = _byte_plane(enc.tensors["code_hi"]) if codec.hi else code  # unread when hi = 0
    if gain.stride(-1) != 1:
        raise KernelUnsupported("TCQ gains need a unit inner stride")
    tab = tcq_decode.tables(codec, device)  # the decode kernel's table and lookback tables, shared
    tensors = [code, code_hi, gain, tab["table"], tab["src"], tab["shift"], tab["wide"], tab["rank"]]
    strides = [x.stride(i) for x in (code, code_hi, gain) for i in (0, 1)]
    return tensors, strides, dict(K=codec.k, HI=codec.hi, L=codec.L, J=tab["src"].shape[0])


class TCQAttention(SplitKAttention):
    """TCQ K with TCQ V (accumulated rotated) or groupquant V."""

    name = "tcq"
    default_block_n = 32  # TurboQuant-MSE's measured block (docs/perf.md); TCQ itself is not measured on a GPU yet
    default_warps = 4

    def __init__(self, k_config, v_config, **kw):
        super().__init__(k_config, v_config, **kw)
        self.rotated_values = v_config.name == "tcq"  # summed rotated, turned back once (`finish`)

    def check(self, q: torch.Tensor, seg) -> None:
        d = seg.k_enc.shape[-1]
        if not supports(seg.k_codec) or (self.rotated_values and not supports(seg.v_codec)):
            raise KernelUnsupported(f"head dim {d} is outside the TCQ kernels' 16..256")
        if not self.rotated_values:
            value_layout(seg.v_codec, d)

    def prepare(self, q: torch.Tensor, seg) -> torch.Tensor:
        return apply_rotation(q, rotation_matrix(seg.k_codec, "rotate_query", q.device), seg.k_enc.shape[1])

    def finish(self, out: torch.Tensor, seg) -> torch.Tensor:
        if not self.rotated_values:
            return out
        return apply_rotation(out, rotation_matrix(seg.v_codec, "unrotate", out.device), seg.v_enc.shape[1])

    def value_args(self, seg, device: torch.device, dummy: list[torch.Tensor]) -> tuple[list, list, dict]:
        """(tensors, strides, constants) of the values: (codes, wide bits, gains or scales, offsets, 5 trellis
        tables); (B, H) strides of the first three and the scales' token stride; the accumulator layout and the
        trellis constants. Slots the value codec has not are filled with `dummy` tensors, never read."""
        vc, ve, d = seg.v_codec, seg.v_enc, seg.v_enc.shape[-1]
        if self.rotated_values:
            (codes, hi, gain, *tabs), _, c = trellis_args(vc, ve, device)
            tensors, st = [codes, hi, gain, gain, *tabs], 1
            consts = dict(NG=1, UPG=vc.steps, VSU=2, VW=1, VHALF=False)  # the [1, STEPS, 2] rotated accumulator
            consts.update(VK=c["K"], VHI=c["HI"], VL=c["L"], VJ=c["J"])
        else:
            consts = value_layout(vc, d)
            codes = code_plane(ve.tensors["codes"], consts["VW"])
            scale, offset = ve.tensors["scale"], ve.tensors["offset"]
            if scale.stride(-1) != 1 or offset.stride() != scale.stride():
                raise KernelUnsupported("group scales and offsets need unit inner strides and shared strides")
            tensors, st = [codes, codes, scale, offset, *dummy], scale.stride(2)
            consts.update(VK=1, VHI=0, VL=1, VJ=1)
        strides = [x.stride(i) for x in tensors[:3] for i in (0, 1)] + [st]
        return tensors, strides, consts

    def launch(self, qk, seg, out_part, lse_part, split0, scale, tile0, tiles, splits) -> None:
        b, h, t, d = seg.k_enc.shape
        k_t, k_s, k_c = trellis_args(seg.k_codec, seg.k_enc, qk.device)
        v_t, v_s, v_c = self.value_args(seg, qk.device, k_t[3:])
        _tcq_attn_kernel[launch_grid(qk, splits)](
            qk, out_part, lse_part, *k_t, *v_t,
            t, seg.skip_tokens, tile0, cdiv(tiles, splits), split0, out_part.shape[-2], qk.shape[2],
            qk.shape[1] // h, scale * LOG2E, *k_s, *v_s,
            D=d, STEPS=seg.k_codec.steps, BLOCK_N=self.tile_size(seg),
            KK=k_c["K"], KHI=k_c["HI"], KL=k_c["L"], KJ=k_c["J"], VTCQ=self.rotated_values,
            STAGES=self.stages, ASM=use_asm(), num_warps=self.warps(seg), **v_c,
        )


def attention_kernel(k_config, v_config) -> TCQAttention | None:
    if v_config.name not in ("tcq", "groupquant"):
        return None
    return TCQAttention(k_config, v_config)
