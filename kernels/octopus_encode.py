"""OCTOPUS (and OCTOPUS-QJL) encode + pack in one pass, the kernel twin of `OctopusCodec._quantize` / `_pack`
(codecs.md 5.2; reference `mmkv/codecs/octopus.py`, `mmkv/codecs/octopus_qjl.py`).

One program codes BT tokens of one row: gamma = ||k||, u = H(s * k/gamma), contiguous zero-padded triplets, the
octahedral fold, nearest (xi, eta) centroids, optionally the joint 3x3 rounding (step 7: best <t, n_hat> over the
clamped neighbours, first maximum on ties, rho coded from that inner product), then the `dir`, `rho` (and QJL sign)
planes are packed straight from registers and gamma written in fp32 (the launcher rounds it to fp16 for norm=16 after
the reference's overflow check).

Rotation: the butterfly in fp32 (bit-identical u) or, for bf16/fp16 keys, three tensor-core products with the +-1
Hadamard columns 3i, 3i+1, 3i+2 that land the triplet coordinates (and the zero padding) directly in registers.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from mmkv.codecs.base import CodecError, Encoded
from mmkv.kernels.common import INTERPRET, LAUNCH, boundaries, count_less, device_tables, head_count, next_pow2, rows_of
from mmkv.kernels.packing import pack_block
from mmkv.kernels.rotation import fwht, hadamard_pm1, rows_dot

_EPS = 1e-30  # codecs.md A20, as the reference


@triton.jit
def _octopus_encode_kernel(
    x_ptr, s_ptr, mat_ptr, xi_t_ptr, rho_t_ptr, lut_ptr, rho_c_ptr, sk_ptr,
    dir_ptr, rho_ptr, gamma_ptr, qjl_ptr, rnorm_ptr,
    T, NH, scale, dir_row_bytes, rho_row_bytes, qjl_row_bytes,
    D: tl.constexpr, NT: tl.constexpr, NTP: tl.constexpr, BT: tl.constexpr,
    DIR_BITS: tl.constexpr, RHO_BITS: tl.constexpr, JOINT: tl.constexpr, MMA: tl.constexpr, QJL: tl.constexpr,
    INTERP: tl.constexpr,
):
    L: tl.constexpr = 1 << DIR_BITS
    pid_t = tl.program_id(0)
    row = tl.program_id(1)
    t0 = pid_t * BT
    n_tok = tl.minimum(T - t0, BT)
    tt = tl.arange(0, BT)
    jj = tl.arange(0, D)
    tmask = tt < n_tok
    x = tl.load(
        x_ptr + row.to(tl.int64) * T * D + (t0 + tt).to(tl.int64)[:, None] * D + jj[None, :],
        mask=tmask[:, None], other=0.0,
    )
    xf = x.to(tl.float32)
    gamma = tl.sqrt_rn(tl.sum(xf * xf, axis=1))  # step 1
    g = tl.maximum(gamma, _EPS)[:, None]
    s = tl.load(s_ptr + (row % NH) * D + jj)
    ii = tl.arange(0, NTP)
    if MMA:
        # (s * k) @ H[:, 3i + c] = (H (s * k))_{3i + c}; columns past D are zero: the padding of step 3.
        xs = (xf * s.to(tl.float32)[None, :]).to(x.dtype)  # exact: a sign flip
        tx = tl.math.div_rn(rows_dot(xs, mat_ptr, D, NTP, INTERP) * scale, g)
        ty = tl.math.div_rn(rows_dot(xs, mat_ptr + D * NTP, D, NTP, INTERP) * scale, g)
        tz = tl.math.div_rn(rows_dot(xs, mat_ptr + 2 * D * NTP, D, NTP, INTERP) * scale, g)
    else:
        u = fwht(tl.math.div_rn(xf, g) * s.to(tl.float32)[None, :], BT, D) * scale  # step 2
        j3 = 3 * ii[None, :] + tt[:, None] * 0  # step 3: contiguous triplets, zero padded
        tx = tl.where(j3 < D, tl.gather(u, tl.minimum(j3, D - 1), axis=1), 0.0)
        ty = tl.where(j3 + 1 < D, tl.gather(u, tl.minimum(j3 + 1, D - 1), axis=1), 0.0)
        tz = tl.where(j3 + 2 < D, tl.gather(u, tl.minimum(j3 + 2, D - 1), axis=1), 0.0)
    # steps 4-5: octahedral fold (scale-free), sgn(0) = +1, top hemisphere for z >= 0
    ell = tl.maximum(tl.abs(tx) + tl.abs(ty) + tl.abs(tz), _EPS)
    px = tl.math.div_rn(tx, ell)
    py = tl.math.div_rn(ty, ell)
    pz = tl.math.div_rn(tz, ell)
    top = pz >= 0
    xi = tl.where(top, px, (1 - tl.abs(py)) * tl.where(px >= 0, 1.0, -1.0))
    eta = tl.where(top, py, (1 - tl.abs(px)) * tl.where(py >= 0, 1.0, -1.0))
    jx = count_less(xi, xi_t_ptr, L - 1)  # step 6
    jy = count_less(eta, xi_t_ptr, L - 1)
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
    code = jx + (jy << DIR_BITS)
    row64 = row.to(tl.int64)
    pack_block(code, dir_ptr, row64 * dir_row_bytes, t0, n_tok, BT, NTP, NT, 2 * DIR_BITS, 0, 0, NT)
    if RHO_BITS > 0:
        jr = count_less(r, rho_t_ptr, (1 << RHO_BITS) - 1)
        pack_block(jr, rho_ptr, row64 * rho_row_bytes, t0, n_tok, BT, NTP, NT, RHO_BITS, 0, 0, NT)
    else:
        jr = tl.zeros(code.shape, tl.int32)
    tl.store(gamma_ptr + row64 * T + t0 + tt, gamma, mask=tmask)
    if QJL:
        # OCTOPUS-QJL (codecs.md 5.6): r = u - u_hat in the rotated domain, sigma = sign(H(s' r)), ||r|| in fp16.
        tl.static_assert(not MMA, "the QJL residual needs the butterfly rotation")
        jd = jj // 3
        code_d = tl.gather(code, jd[None, :] + tt[:, None] * 0, axis=1)
        jr_d = tl.gather(jr, jd[None, :] + tt[:, None] * 0, axis=1)
        u_hat = tl.load(lut_ptr + code_d * 3 + (jj % 3)[None, :]) * tl.load(rho_c_ptr + jr_d)
        res = u - u_hat
        sk = tl.load(sk_ptr + (row % NH) * D + jj).to(tl.float32)
        proj = fwht(res * sk[None, :], BT, D) * scale
        bits = (proj >= 0).to(tl.int32)
        pack_block(bits, qjl_ptr, row64 * qjl_row_bytes, t0, n_tok, BT, D, D, 1, 0, 0, D)
        rn = tl.sqrt_rn(tl.sum(res * res, axis=1))
        tl.store(rnorm_ptr + row64 * T + t0 + tt, rn.to(tl.float16), mask=tmask)


def rotation_mode(dtype: torch.dtype) -> str:
    """"mma" (tensor-core Hadamard columns) for bf16/fp16 keys unless MMKV_ROTATION=butterfly; fp32 keys always use
    the exact butterfly (a 16-bit operand would round them)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return "butterfly"
    mode = os.environ.get("MMKV_ROTATION", "mma").strip().lower()
    if mode not in ("mma", "butterfly"):
        raise CodecError(f"MMKV_ROTATION must be 'mma' or 'butterfly', got {mode!r}")
    return mode


def supports(codec) -> bool:
    d = codec.head_dim
    return 16 <= d <= 256 and codec.dir_bits <= 7 and codec.rho_bits <= 6


def _tables(codec, device: torch.device) -> dict:
    def build():
        t = {
            "signs": codec.rotation.signs,
            "xi_t": boundaries(codec.xi_codebook),
            "rho_t": boundaries(codec.rho_codebook) if codec.rho_bits else torch.zeros(1),
            "lut": codec.dir_lut.reshape(-1),
            "rho_c": codec.rho_codebook.float(),
        }
        t["sketch"] = codec.sketch.signs if hasattr(codec, "sketch") else t["signs"]
        return t

    return device_tables(codec, device, "octopus", build)


def _mats(codec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[3, D, NTP] +-1 columns: mats[c][:, i] = H[:, 3i + c] (zero past D)."""

    def build():
        d, ntp = codec.head_dim, next_pow2(codec.n_t)
        h = hadamard_pm1(d)
        m = torch.zeros(3, d, ntp)
        for c in range(3):
            cols = torch.arange(codec.n_t) * 3 + c
            keep = cols < d
            m[c][:, : codec.n_t][:, keep] = h[:, cols[keep]]
        return {"m": m.to(dtype)}

    return device_tables(codec, device, f"octopus-mats-{dtype}", build)["m"]


def encode(
    codec, x: torch.Tensor, *, rotation: str | None = None, bt: int | None = None, warps: int = 4
) -> Encoded:
    """`codec.encode(x)` for OCTOPUS / OCTOPUS-QJL on the kernel: x[..., T, D] in any float dtype, already validated."""
    qjl = hasattr(codec, "sketch")
    x = x.contiguous()
    *lead, T, D = x.shape
    rows = rows_of(x)
    dev = x.device
    tab = _tables(codec, dev)
    n_t, ntp = codec.n_t, next_pow2(codec.n_t)
    mode = rotation or rotation_mode(x.dtype)
    # tl.dot needs every dim >= 16: the column count is next_pow2(n_t) (>= 16 from d = 32 on)
    mma = mode == "mma" and not qjl and x.dtype in (torch.bfloat16, torch.float16) and ntp >= 16
    mats = _mats(codec, dev, x.dtype) if mma else x
    dir_bytes = (T * n_t * 2 * codec.dir_bits + 7) // 8
    rho_bytes = (T * n_t * codec.rho_bits + 7) // 8
    qjl_bytes = (T * D + 7) // 8
    dir_p = torch.empty(*lead, dir_bytes, dtype=torch.uint8, device=dev)
    rho_p = torch.empty(*lead, rho_bytes, dtype=torch.uint8, device=dev)
    gamma = torch.empty(*lead, T, dtype=torch.float32, device=dev)
    qjl_p = torch.empty(*lead, qjl_bytes if qjl else 0, dtype=torch.uint8, device=dev)
    rnorm = torch.empty(*lead, T if qjl else 0, dtype=torch.float16, device=dev)
    bt = bt or (32 if D <= 128 else 16)
    bt = max(bt, 16) if mma else bt
    if rows and T:
        _octopus_encode_kernel[(triton.cdiv(T, bt), rows)](
            x, tab["signs"], mats, tab["xi_t"], tab["rho_t"], tab["lut"], tab["rho_c"], tab["sketch"],
            dir_p, rho_p if codec.rho_bits else dir_p, gamma, qjl_p if qjl else dir_p, rnorm if qjl else gamma,
            T, head_count(codec), 1.0 / math.sqrt(D), dir_bytes, rho_bytes, qjl_bytes,
            D=D, NT=n_t, NTP=ntp, BT=bt, DIR_BITS=codec.dir_bits, RHO_BITS=codec.rho_bits, JOINT=codec.joint,
            MMA=mma, QJL=qjl, INTERP=INTERPRET, num_warps=warps, **LAUNCH,
        )
    tensors = {"dir": dir_p, "gamma": codec._store_gamma(gamma)}
    if codec.rho_bits:
        tensors["rho"] = rho_p
    if qjl:
        tensors["qjl"] = qjl_p
        tensors["rnorm"] = rnorm
    return Encoded(str(codec.config), tuple(x.shape), x.dtype, tensors, {"n_t": n_t})
