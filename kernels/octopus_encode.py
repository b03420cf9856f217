"""OCTOPUS (and OCTOPUS-QJL) encode + pack in one pass, the kernel twin of `OctopusCodec._quantize` / `_pack`
(OCTOPUS paper, section 3.2; reference `mmkv/codecs/octopus.py`, `mmkv/codecs/octopus_qjl.py`).

One program codes BT tokens of one row, one token a thread (`mmkv.kernels.common.load_rows`, so the butterfly, the
triplet gathers and the fold are register work): gamma = ||k||, u = H(s * k) / gamma (one division a token),
contiguous zero-padded triplets, the octahedral fold (one reciprocal a triplet), nearest (xi, eta) centroids,
optionally the joint 3x3 rounding (step 7: best <t, n_hat> over the clamped neighbours, first maximum on ties, rho
coded from that inner product), then the `dir`, `rho` (and QJL sign) planes are packed straight from registers and gamma written in fp32 (the launcher rounds it to fp16 for norm=16 after
the reference's overflow check). gamma's sum, the late 1/gamma and the reciprocal fold each round differently from the
reference, so an intermediate can differ by an ulp or two and a code can move where it sits that close to a decision
boundary (docs/decisions.md, "Codec kernels").
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import Encoded
from mmkv.kernels.common import (
    LAUNCH, ROWS_WARPS, cdiv, cells, device_tables, head_count, jit, load_rows, next_power_of_2, rows_of, search,
    search_table, token_block, vector,
)
from mmkv.kernels.packing import pack_block, pack_rows
from mmkv.kernels.rotation import fwht

_EPS = tl.constexpr(1e-30)  # guards zero keys and triplets, as the reference


@triton.jit
def triplet_plane(u, C: tl.constexpr, I0: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, W: tl.constexpr):
    """[BT, W] with entry k = u[:, 3 (I0 + k) + C] (0 past D: the zero padding of step 3). A row is in one thread and
    every register's column is a compile-time constant, so the selects and -0.0 sums below fold to register moves (a
    `tl.gather` along a row in one thread would index local memory)."""
    jj = tl.arange(0, D)[None, :]
    kk = tl.arange(0, W)[None, :]
    out = tl.zeros((BT, W), u.dtype)
    for k in tl.static_range(W):
        if 3 * (I0 + k) + C < D:
            out = tl.where(kk == k, tl.sum(tl.where(jj == 3 * (I0 + k) + C, u, -0.0), axis=1)[:, None], out)
    return out


@triton.jit
def place(acc, part, I0: tl.constexpr, BT: tl.constexpr, N: tl.constexpr, W: tl.constexpr):
    """acc[BT, N] with columns [I0, I0 + W) replaced by part[BT, W] (register moves, as in `triplet_plane`)."""
    ii = tl.arange(0, N)[None, :]
    kk = tl.arange(0, W)[None, :]
    for k in tl.static_range(W):
        if I0 + k < N:
            acc = tl.where(ii == I0 + k, tl.sum(tl.where(kk == k, part, 0), axis=1)[:, None], acc)
    return acc


@triton.jit
def from_triplets(px, py, pz, BT: tl.constexpr, D: tl.constexpr, NTP: tl.constexpr):
    """The inverse of `triplet_plane`: row [BT, D] with entry j = p_{j % 3}[:, j // 3] (padding dropped)."""
    jj = tl.arange(0, D)[None, :]
    ii = tl.arange(0, NTP)[None, :]
    neutral = -0.0 if px.dtype.is_floating() else 0
    out = tl.zeros((BT, D), px.dtype)
    for j in tl.static_range(D):
        if j % 3 == 0:
            col = tl.sum(tl.where(ii == j // 3, px, neutral), axis=1)
        elif j % 3 == 1:
            col = tl.sum(tl.where(ii == j // 3, py, neutral), axis=1)
        else:
            col = tl.sum(tl.where(ii == j // 3, pz, neutral), axis=1)
        out = tl.where(jj == j, col[:, None], out)
    return out


# OCTOPUS packs 2 x bits (and rho bits) a triplet, 42 triplets a token, so its row byte counts change their
# divisibility with the token count, and its codes are read at bit offsets: their alignment buys nothing.
@jit(also=("dir_row_bytes", "rho_row_bytes"))
def _octopus_encode_kernel(
    x_ptr, s_ptr, xi_t_ptr, xi_n_ptr, rho_t_ptr, rho_n_ptr, lut_ptr, rho_c_ptr, sk_ptr,
    dir_ptr, rho_ptr, gamma_ptr, qjl_ptr, rnorm_ptr,
    T, NH, scale, dir_row_bytes, rho_row_bytes, vr,
    D: tl.constexpr, NT: tl.constexpr, NTP: tl.constexpr, BT: tl.constexpr, V: tl.constexpr,
    DIR_BITS: tl.constexpr, RHO_BITS: tl.constexpr, JOINT: tl.constexpr, QJL: tl.constexpr,
    XI_CELLS: tl.constexpr, RHO_CELLS: tl.constexpr, CH: tl.constexpr,
):
    L: tl.constexpr = 1 << DIR_BITS
    row, row64, t0, n_tok = token_block(T, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    xf = load_rows(x_ptr, row64 * T * D, t0, n_tok, vr, BT, D, V).to(tl.float32)
    gamma = tl.sqrt_rn(tl.sum(xf * xf, axis=1))  # step 1
    # step 2; 1/gamma after the rotation, one division a token (u within an ulp or two of the reference's)
    inv = tl.math.div_rn(scale, tl.maximum(gamma, _EPS))[:, None]
    s = tl.load(s_ptr + (row % NH) * D + jj).to(tl.float32)
    u = fwht(xf * s[None, :], BT, D) * inv
    # steps 3-7 in chunks of CH triplets (fewer live registers); codes gathered as code | jr << 16
    packed = tl.zeros((BT, NTP), tl.int32)
    for c in tl.static_range(NTP // CH):
        if c * CH < NT:
            tx = triplet_plane(u, 0, c * CH, BT, D, CH)  # step 3: contiguous triplets, zero padded
            ty = triplet_plane(u, 1, c * CH, BT, D, CH)
            tz = triplet_plane(u, 2, c * CH, BT, D, CH)
            # steps 4-5: octahedral fold (scale-free), sgn(0) = +1, top hemisphere for z >= 0; one reciprocal a triplet
            rl = tl.math.div_rn(1.0, tl.maximum(tl.abs(tx) + tl.abs(ty) + tl.abs(tz), _EPS))
            px = tx * rl
            py = ty * rl
            pz = tz * rl
            top = pz >= 0
            xi = tl.where(top, px, (1 - tl.abs(py)) * tl.where(px >= 0, 1.0, -1.0))
            eta = tl.where(top, py, (1 - tl.abs(px)) * tl.where(py >= 0, 1.0, -1.0))
            jx = search(xi, xi_t_ptr, xi_n_ptr, L - 1, XI_CELLS)  # step 6
            jy = search(eta, xi_t_ptr, xi_n_ptr, L - 1, XI_CELLS)
            if JOINT:  # step 7: candidates in ascending (jx, jy), dx outer; strict '>' keeps the first maximum
                best = tl.full(tx.shape, float("-inf"), tl.float32)
                bx = jx
                by = jy
                for dx in tl.static_range(3):
                    cx = tl.minimum(tl.maximum(jx + (dx - 1), 0), L - 1)
                    for dy in tl.static_range(3):
                        cy = tl.minimum(tl.maximum(jy + (dy - 1), 0), L - 1)
                        li = (cx + cy * L) * 3
                        sc = tl.load(lut_ptr + li) * tx + tl.load(lut_ptr + li + 1) * ty + tl.load(lut_ptr + li + 2) * tz
                        better = sc > best
                        best = tl.where(better, sc, best)
                        bx = tl.where(better, cx, bx)
                        by = tl.where(better, cy, by)
                jx = bx
                jy = by
                r = best
            else:
                r = tl.sqrt_rn(tx * tx + ty * ty + tz * tz)
            if RHO_BITS > 0:
                jr = search(r, rho_t_ptr, rho_n_ptr, (1 << RHO_BITS) - 1, RHO_CELLS)
            else:
                jr = tl.zeros(jx.shape, tl.int32)
            packed = place(packed, jx + (jy << DIR_BITS) + (jr << 16), c * CH, BT, NTP, CH)
    code = packed & 0xFFFF
    jr = packed >> 16
    pack_block(code, dir_ptr, row64 * dir_row_bytes, t0, n_tok, BT, NTP, NT, 2 * DIR_BITS, 0, 0, NT)
    if RHO_BITS > 0:
        pack_block(jr, rho_ptr, row64 * rho_row_bytes, t0, n_tok, BT, NTP, NT, RHO_BITS, 0, 0, NT)
    tl.store(gamma_ptr + row64 * T + t0 + tt, gamma, mask=tmask)
    if QJL:
        # OCTOPUS-QJL (paper section 3.6): r = u - u_hat in the rotated domain, sigma = sign(H(s' r)), ||r|| in fp16.
        rc = tl.load(rho_c_ptr + jr)  # t_hat = DIR[code] * C_rho[jr], back on the coordinates
        u_hat = from_triplets(tl.load(lut_ptr + code * 3) * rc, tl.load(lut_ptr + code * 3 + 1) * rc,
                              tl.load(lut_ptr + code * 3 + 2) * rc, BT, D, NTP)
        res = u - u_hat
        sk = tl.load(sk_ptr + (row % NH) * D + jj).to(tl.float32)
        bits = (fwht(res * sk[None, :], BT, D) * scale >= 0).to(tl.int32)
        pack_rows(bits, qjl_ptr, row64 * T * (D // 8), t0, n_tok, vr, BT, D, 1, V)
        rn = tl.sqrt_rn(tl.sum(res * res, axis=1))
        tl.store(rnorm_ptr + row64 * T + t0 + tt, rn.to(tl.float16), mask=tmask)


def nonfinite(codec, enc: Encoded) -> torch.Tensor:
    """Whether a key norm gamma is NaN/Inf, as any NaN/Inf of the input makes it (a finite input only by overflowing
    fp32 or the fp16 gamma): the flag `mmkv.codecs.base.Codec._encode_checked` reads instead of scanning the input."""
    return ~torch.isfinite(enc.tensors["gamma"]).all()


def supports(codec) -> bool:
    d = codec.head_dim
    return 16 <= d <= 256 and codec.dir_bits <= 7 and codec.rho_bits <= 6


def _tables(codec, device: torch.device) -> dict:
    def build():
        xi = search_table(codec.xi_codebook)
        rho = search_table(codec.rho_codebook) if codec.rho_bits else {"t": torch.zeros(4), "n": torch.zeros(1, dtype=torch.uint8)}
        t = {
            "signs": codec.rotation.signs,
            "xi_t": xi["t"], "xi_n": xi["n"], "rho_t": rho["t"], "rho_n": rho["n"],
            "lut": codec.dir_lut.reshape(-1),
            "rho_c": codec.rho_codebook.float(),
        }
        t["sketch"] = codec.sketch.signs if hasattr(codec, "sketch") else t["signs"]
        return t

    return device_tables(codec, device, "octopus", build)


def encode(codec, x: torch.Tensor, *, warps: int | None = None) -> Encoded:
    """`codec.encode(x)` for OCTOPUS / OCTOPUS-QJL on the kernel: x[..., T, D] in any float dtype, already validated."""
    qjl = hasattr(codec, "sketch")
    x = x.contiguous()
    *lead, T, D = x.shape
    rows = rows_of(x)
    dev = x.device
    tab = _tables(codec, dev)
    n_t, ntp = codec.n_t, next_power_of_2(codec.n_t)
    dir_bytes = (T * n_t * 2 * codec.dir_bits + 7) // 8
    rho_bytes = (T * n_t * codec.rho_bits + 7) // 8
    dir_p = torch.empty(*lead, dir_bytes, dtype=torch.uint8, device=dev)
    rho_p = torch.empty(*lead, rho_bytes, dtype=torch.uint8, device=dev)
    gamma = torch.empty(*lead, T, dtype=torch.float32, device=dev)
    qjl_p = torch.empty(*lead, (T * D + 7) // 8 if qjl else 0, dtype=torch.uint8, device=dev)
    rnorm = torch.empty(*lead, T if qjl else 0, dtype=torch.float16, device=dev)
    warps = warps or ROWS_WARPS
    bt = 32 * warps  # one token a thread
    v = min(vector(x.dtype), D)
    if rows and T:
        _octopus_encode_kernel[(cdiv(T, bt), rows)](
            x, tab["signs"], tab["xi_t"], tab["xi_n"], tab["rho_t"], tab["rho_n"], tab["lut"], tab["rho_c"],
            tab["sketch"], dir_p, rho_p if codec.rho_bits else dir_p, gamma, qjl_p if qjl else dir_p,
            rnorm if qjl else gamma, T, head_count(codec), 1.0 / math.sqrt(D), dir_bytes, rho_bytes, v,
            D=D, NT=n_t, NTP=ntp, BT=bt, V=v, DIR_BITS=codec.dir_bits, RHO_BITS=codec.rho_bits, JOINT=codec.joint,
            QJL=qjl, XI_CELLS=cells({"n": tab["xi_n"]}), RHO_CELLS=cells({"n": tab["rho_n"]}), CH=min(8, ntp),
            num_warps=warps,
            **LAUNCH,
        )
    tensors = {"dir": dir_p, "gamma": codec._store_gamma(gamma)}
    if codec.rho_bits:
        tensors["rho"] = rho_p
    if qjl:
        tensors["qjl"] = qjl_p
        tensors["rnorm"] = rnorm
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors, {"n_t": n_t})
