"""The TCQ encoder's launch variants, the min-max encoder and OScaR's token-norm kernel compile for an H100 / H200
(sm_90) on a machine without a GPU.

The interpreter tests (tests/test_kernels_tcq.py) check what the kernels compute, but the interpreter accepts code
that the GPU compiler rejects; device time is scarce, so the variants that `kernels/gpu_check_codecs.py` times are
compiled here ahead of time (Triton's own compiler and its bundled ptxas, target sm_90), in a child process without
the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mmkv.kernels import tcq_encode

    sig = {"u_ptr": "*fp32", "norm_ptr": "*fp32", "c": "fp32", "table_ptr": "*fp32", "wide_ptr": "*i32",
           "bp_ptr": "*i16", "codes_ptr": "*i32", "first": "i32", "n": "i32", "STEPS": "constexpr", "K": "constexpr",
           "L": "constexpr", "WIDE": "constexpr", "NV": "constexpr", "PREFETCH": "constexpr", "ROLL1": "constexpr",
           "PASS1": "constexpr", "SCALED": "constexpr"}
    out = []
    for consts, warps in json.loads(sys.argv[1]):
        # pass one's window at 64 steps (mmkv.codecs.tcq.pass_one_window); u formed from r and ||x|| as the encoder
        # asks, or read (`viterbi` given u)
        consts = {"SCALED": True, **consts, "ROLL1": 16, "PASS1": 32}
        src = ASTSource(fn=tcq_encode._tcq_viterbi_kernel, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        out.append(len(k.asm["cubin"]))
    print(json.dumps(out))
""")


# Prepended to the child scripts that read ptxas's report: `spill_report(ptx)` -> (spill store bytes a thread, how
# many functions ptxas reported on), from Triton's bundled ptxas at sm_90a.
SPILLS = textwrap.dedent("""
    import os, re, subprocess, tempfile
    import triton

    def spill_report(ptx):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:  # ptxas -v: the registers and spill bytes
            f.write(ptx)
            f.flush()
            log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                                 capture_output=True, text=True, check=True).stderr
        return sum(int(b) for b in re.findall(r"(\\d+) bytes spill stores", log)), log.count("bytes spill stores")
""")


def compiled(script: str, *args: str, cache=None):
    """Run `script` in a child process without the interpreter or a GPU (Triton's own compiler, target sm_90) and
    return the JSON its last line prints; `cache`: a cold Triton cache folder."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    if cache is not None:
        env["TRITON_CACHE_DIR"] = str(cache)
    res = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_tcq_encoder_variants_compile_for_sm90():
    cases = [  # the default L of 2 and 4 bits, a width with wide steps; 1 or 4 vectors a program; prefetch or not
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 4, "PREFETCH": False}, 1),  # the 2-bit default
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 1, "PREFETCH": True, "SCALED": False}, 1),
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 4, "PREFETCH": False}, 4),
        ({"STEPS": 64, "K": 8, "L": 11, "WIDE": False, "NV": 1, "PREFETCH": True}, 1),
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": True, "NV": 1, "PREFETCH": True}, 2),
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 2, "PREFETCH": True}, 1),
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 8, "PREFETCH": False}, 1),  # 168 registers, no spill
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 8, "PREFETCH": False}, 2),
    ]
    sizes = compiled(SCRIPT, json.dumps(cases))
    assert len(sizes) == len(cases) and all(s > 1000 for s in sizes)  # a cubin for each


LANES = SPILLS + textwrap.dedent("""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mmkv.kernels import tcq_encode

    sig = {"u_ptr": "*fp32", "norm_ptr": "*fp32", "c": "fp32", "table_ptr": "*fp32", "bp_ptr": "*i8",
           "codes_ptr": "*i32", "first": "i32", "n": "i32", "packed_ptr": "*u8", "gain_ptr": "*fp16",
           "bad_ptr": "*i8", "STEPS": "constexpr", "K": "constexpr", "NV": "constexpr", "ROLL1": "constexpr",
           "PASS1": "constexpr", "SCALED": "constexpr", "FINISH": "constexpr", "FP16": "constexpr"}
    out = []
    for consts, warps in json.loads(sys.argv[1]):
        consts = {"SCALED": True, "FINISH": False, "FP16": True, **consts, "ROLL1": 16, "PASS1": 32}
        k = triton.compile(ASTSource(fn=tcq_encode._tcq_lanes_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        spills, reports = spill_report(k.asm["ptx"])
        out.append([len(k.asm["cubin"]), spills, k.asm["ptx"].count("shfl.sync"), reports])
    print(json.dumps(out))
""")


def test_tcq_lane_search_compiles_for_sm90_without_spills():
    cases = [  # the 2-bit default (k = 4, L = 8) at its 4 vectors a program and the variants gpu_check_codecs times;
        ({"STEPS": 64, "K": 4, "NV": 2}, 1),  # k = 3 (L = 6), k = 5 (L = 10)
        ({"STEPS": 64, "K": 4, "NV": 4}, 1),
        ({"STEPS": 64, "K": 4, "NV": 8}, 2),
        ({"STEPS": 64, "K": 3, "NV": 4}, 1),
        ({"STEPS": 64, "K": 5, "NV": 1}, 1),
        ({"STEPS": 64, "K": 4, "NV": 2, "SCALED": False}, 1),
        ({"STEPS": 64, "K": 4, "NV": 4, "FINISH": True}, 1),  # the encode finished in the last backtrack
        ({"STEPS": 64, "K": 4, "NV": 2, "FINISH": True}, 1),
    ]
    res = compiled(LANES, json.dumps(cases))
    assert len(res) == len(cases)
    for (consts, _), (size, spills, shuffles, reports) in zip(cases, res):
        assert size > 1000 and reports >= 1 and spills == 0, (consts, size, spills)
        assert shuffles > 0, consts  # the rows' broadcast goes through warp shuffles, not shared memory


MINMAX = SPILLS + textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mmkv.kernels import groupquant_encode, oscar_encode
    from mmkv.kernels.common import LAUNCH

    target = GPUTarget("cuda", 90, 32)
    sig = {"x_ptr": "*bf16", "norm_ptr": "*fp32", "codes_ptr": "*u8", "scale_ptr": "*fp16", "offset_ptr": "*fp16",
           "bad_ptr": "*i8", "T": "i32", "NH": "i32", "rscale": "fp32", "row_bytes": "i32", "NGT": "i32",
           "D": "constexpr", "DP": "constexpr", "BT": "constexpr", "G": "constexpr", "BITS": "constexpr",
           "CHANNEL": "constexpr", "ROTATE": "constexpr", "NORM": "constexpr", "ROUNDED": "constexpr"}
    out = []
    for channel, rotate in [(True, True), (False, True), (False, False)]:  # OScaR K, OScaR V, KIVI V
        consts = {"D": 128, "DP": 128, "BT": 32, "G": 32, "BITS": 2, "CHANNEL": channel, "ROTATE": rotate,
                  "NORM": channel and rotate, "ROUNDED": rotate}
        k = triton.compile(ASTSource(fn=groupquant_encode._minmax_encode_kernel, signature=sig, constexprs=consts),
                           target=target, options={"num_warps": 4, **LAUNCH})
        out.append([len(k.asm["cubin"]), spill_report(k.asm["ptx"])[0]])
    sig = {"x_ptr": "*bf16", "out_ptr": "*fp32", "T": "i32", "NH": "i32", "rscale": "fp32",
           "D": "constexpr", "BT": "constexpr"}
    k = triton.compile(ASTSource(fn=oscar_encode._token_norm_kernel, signature=sig,
                                 constexprs={"D": 128, "BT": 32}),
                       target=target, options={"num_warps": 4, **LAUNCH})
    out.append([len(k.asm["cubin"]), spill_report(k.asm["ptx"])[0]])
    print(json.dumps(out))
""")


def test_minmax_encoder_and_oscar_norm_kernels_compile_for_sm90(tmp_path):
    """The min-max encoder with its non-finite flags, and OScaR's token-norm kernel with its loop over the heads
    (a runtime loop: unrolled over 12 heads the kernel took 51 s to compile, looped about 2 s; a cold cache here)."""
    built = compiled(MINMAX, cache=tmp_path)
    assert len(built) == 4 and all(size > 1000 for size, _ in built)
    size = built[-1][0]
    assert size < 2_000_000, f"the token-norm kernel's cubin is {size} bytes: is the head loop unrolled again?"
    # none spills at the Wan head size (the token norms, one token a thread, spilled 1,520 bytes a thread)
    assert [spills for _, spills in built] == [0, 0, 0, 0]


QVG_KMEANS = SPILLS + textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mmkv.kernels import qvg_kmeans
    from mmkv.kernels.common import LAUNCH

    target = GPUTarget("cuda", 90, 32)
    out = []
    sig = {"x_ptr": "*bf16", "c_ptr": "*bf16", "csq_ptr": "*fp32", "ids_ptr": "*u8", "prev_ptr": "*u8",
           "sums_ptr": "*fp64", "counts_ptr": "*i32", "changed_ptr": "*i32", "N": "i32", "K": "constexpr",
           "D": "constexpr", "BN": "constexpr", "BK": "constexpr", "SUB": "constexpr", "MMA": "constexpr",
           "COMPARE": "constexpr"}
    for compare in (False, True):  # the first iteration; a later one, which counts the changed ids
        consts = {"K": 256, "D": 128, "BN": 64, "BK": 64, "SUB": 16, "MMA": True, "COMPARE": compare}
        k = triton.compile(ASTSource(fn=qvg_kmeans._step_kernel, signature=sig, constexprs=consts),
                           target=target, options={"num_warps": 4, **LAUNCH})
        ptx = k.asm["ptx"]
        out.append((len(k.asm["cubin"]), "atom.global" in ptx and ".f64" in ptx and "mma" in ptx
                    and spill_report(ptx)[0] == 0))
    sig = {"sums_ptr": "*fp64", "counts_ptr": "*i32", "old_ptr": "*bf16", "out_ptr": "*bf16", "csq_ptr": "*fp32",
           "changed_ptr": "*i32", "limit": "i32", "K": "i32", "D": "constexpr", "BK": "constexpr",
           "SELECT": "constexpr", "NORMS": "constexpr"}
    k = triton.compile(ASTSource(fn=qvg_kmeans._finish_kernel, signature=sig,
                                 constexprs={"D": 128, "BK": 8, "SELECT": True, "NORMS": True}),
                       target=target, options={"num_warps": 4, **LAUNCH})
    out.append((len(k.asm["cubin"]), "div.rn.f64" in k.asm["ptx"] and spill_report(k.asm["ptx"])[0] == 0))
    from mmkv.kernels import qvg_decode  # the decode with its output rows in up to three strided levels (a stack)
    sig = {"codes_ptr": "*u8", "scale_ptr": "*u8", "zero_ptr": "*u8", "ids_ptr": "*u8", "c_ptr": "*bf16",
           "out_ptr": "*bf16", "starts_ptr": "*i32", "N": "i32", "K": "i32", "KT": "i32", "NU": "i32", "P": "i32",
           "row_bytes": "i32", "N1": "i32", "N2": "i32", "S0": "i64", "S1": "i64", "S2": "i64", "D": "constexpr",
           "BT": "constexpr", "BLK": "constexpr", "BITS": "constexpr", "ASYM": "constexpr", "STAGES": "constexpr",
           "UNITS": "constexpr", "UP": "constexpr"}
    for units, up in [(False, 1), (True, 16)]:  # one span or a stack; joined spans (an AAR's 15 scales)
        consts = {"D": 64 if units else 128, "BT": qvg_decode.block_tokens(64 if units else 128), "BLK": 64,
                  "BITS": 2, "ASYM": False, "STAGES": 1, "UNITS": units, "UP": up}
        k = triton.compile(ASTSource(fn=qvg_decode._decode_kernel, signature=sig, constexprs=consts),
                           target=target, options={"num_warps": 4, **LAUNCH})
        out.append((len(k.asm["cubin"]), True))
    print(json.dumps(out))
""")


def test_qvg_kmeans_kernels_compile_for_sm90(tmp_path):
    """QVG's k-means: the step (bf16 tensor-core distances, fp64 atomic adds, native on sm_90, with and without the
    changed-ids count; no spills: the sums' operand a whole tile at once took every register and spilled) and the finish (an IEEE fp64 division, as the reference's torch ops compute it, and the early
    stop's choice); and its decode, which writes a stack of spans into token order, with and without joined spans
    (a token's centre table found from the spans' first tokens)."""
    built = compiled(QVG_KMEANS, cache=tmp_path)
    assert [ok for _, ok in built] == [True] * 5 and all(size > 1000 for size, _ in built)


TCQ_FINISH = textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mmkv.kernels import tcq_encode
    from mmkv.kernels.common import LAUNCH

    sig = {"codes_ptr": "*i32", "r_ptr": "*fp32", "table_ptr": "*fp32", "src_ptr": "*i32", "shift_ptr": "*i32",
           "packed_ptr": "*u8", "gain_ptr": "*fp16", "bad_ptr": "*i8", "T": "i32", "row_bytes": "i32",
           "D": "constexpr", "STEPS": "constexpr", "BT": "constexpr", "K": "constexpr", "L": "constexpr",
           "J": "constexpr", "FP16": "constexpr"}
    out = []
    for k, L, j, fp16 in [(4, 8, 2, True), (6, 9, 2, True), (8, 11, 2, False)]:  # the default L of 2, 3, 4 bits
        if not fp16:
            sig = {**sig, "gain_ptr": "*fp32"}
        consts = {"D": 128, "STEPS": 64, "BT": tcq_encode.FINISH_TOKENS, "K": k, "L": L, "J": j, "FP16": fp16}
        c = triton.compile(ASTSource(fn=tcq_encode._tcq_finish_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **LAUNCH})
        out.append(len(c.asm["cubin"]))
    print(json.dumps(out))
""")


def test_tcq_finishing_kernel_compiles_for_sm90(tmp_path):
    """The one-kernel finish after TCQ's search (states, gain, packing) at the default L of each width."""
    built = compiled(TCQ_FINISH, cache=tmp_path)
    assert len(built) == 3 and all(size > 1000 for size in built)


TCQ_DECODE = SPILLS + textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mmkv.kernels import tcq_decode
    from mmkv.kernels.common import LAUNCH, ROWS_WARPS

    sig = {"code_ptr": "*u8", "hi_ptr": "*u8", "gain_ptr": "*fp16", "table_ptr": "*i64", "src_ptr": "*i32",
           "shift_ptr": "*i32", "wide_ptr": "*i32", "rank_ptr": "*i32", "s_ptr": "*fp32", "out_ptr": "*bf16",
           "T": "i32", "NH": "i32", "scale": "fp32", "code_row_bytes": "i32", "hi_row_bytes": "i32", "vr": "i32",
           "ORS": "i32", "D": "constexpr", "STEPS": "constexpr", "BT": "constexpr", "V": "constexpr",
           "K": "constexpr", "HI": "constexpr", "L": "constexpr", "J": "constexpr"}
    out = []
    for k, hi, L, j in [(4, 0, 8, 2), (4, 45, 8, 2)]:  # the 2-bit default; a fractional rate's wide steps
        consts = {"D": 128, "STEPS": 64, "BT": 32 * ROWS_WARPS, "V": 8, "K": k, "HI": hi, "L": L, "J": j}
        c = triton.compile(ASTSource(fn=tcq_decode._tcq_decode_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": ROWS_WARPS, **LAUNCH})
        spills, reports = spill_report(c.asm["ptx"])
        out.append([len(c.asm["cubin"]), spills, c.asm["ptx"].count("ld.global"), reports])
    print(json.dumps(out))
""")


def test_tcq_decode_compiles_for_sm90_without_spills(tmp_path):
    """TCQ's decode kernel at the 2-bit default computes its lookback instead of loading it and reads a state's
    two table values in one load: compiled for sm_90 it spills nothing (it spilled 48 bytes a thread at 255
    registers before, docs/perf.md), and it issues fewer global loads than the form with wide steps, which still
    reads its lookback tables."""
    (size, spills, loads, reports), (size_hi, _, loads_hi, _) = compiled(TCQ_DECODE, cache=tmp_path)
    assert size > 1000 and size_hi > 1000
    assert reports >= 1 and spills == 0
    assert loads < loads_hi


MINMAX_DECODE = SPILLS + textwrap.dedent("""
    import json
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mmkv.kernels import groupquant_decode
    from mmkv.kernels.common import LAUNCH, vector
    from mmkv.kernels.groupquant_encode import block_tokens, row_layout

    target = GPUTarget("cuda", 90, 32)
    sig = {"codes_ptr": "*u8", "scale_ptr": "*fp16", "offset_ptr": "*fp16", "norm_ptr": "*fp32", "out_ptr": "*bf16",
           "starts_ptr": "*i32", "T": "i32", "NH": "i32", "rscale": "fp32", "row_bytes": "i32", "NGT": "i32",
           "NU": "i32", "vr": "i32", "N1": "i32", "N2": "i32", "S0": "i64", "S1": "i64", "S2": "i64",
           "D": "constexpr", "DP": "constexpr", "BT": "constexpr", "G": "constexpr", "BITS": "constexpr",
           "CHANNEL": "constexpr", "ROTATE": "constexpr", "NORM": "constexpr", "ROWS": "constexpr", "V": "constexpr",
           "UNITS": "constexpr", "UP": "constexpr"}
    out = []
    for rotate in (False, True):  # KIVI K, OScaR K: the AAR's 64-wide heads, groups of 32 tokens, 2 bits
        for units, up in ((False, 1), (True, 16)):  # one unit (or a stack); 16 joined scales
            rows = row_layout(64, 2, rotate)
            bt = block_tokens(32, 64, True, rows)
            consts = {"D": 64, "DP": 64, "BT": bt, "G": 32, "BITS": 2, "CHANNEL": True, "ROTATE": rotate,
                      "NORM": rotate, "ROWS": rows, "V": vector(torch.bfloat16), "UNITS": units, "UP": up}
            warps = max(1, bt // 32) if rows else (4 if bt * 64 <= 4096 else 8)
            k = triton.compile(ASTSource(fn=groupquant_decode._minmax_decode_kernel, signature=sig,
                                         constexprs=consts), target=target, options={"num_warps": warps, **LAUNCH})
            out.append(len(k.asm["cubin"]))
    spills = []
    for channel in (True, False):  # OScaR's K and V decode at the Wan head size, one token a thread
        bt = block_tokens(32, 128, channel, True)
        consts = {"D": 128, "DP": 128, "BT": bt, "G": 32, "BITS": 2, "CHANNEL": channel, "ROTATE": True,
                  "NORM": channel, "ROWS": True, "V": vector(torch.bfloat16), "UNITS": False, "UP": 1}
        k = triton.compile(ASTSource(fn=groupquant_decode._minmax_decode_kernel, signature=sig, constexprs=consts),
                           target=target, options={"num_warps": max(1, bt // 32), **LAUNCH})
        spills.append(spill_report(k.asm["ptx"])[0])
    print(json.dumps([out, spills]))
""")


def test_minmax_decode_kernel_compiles_for_sm90_with_and_without_joined_units(tmp_path):
    """KIVI's and OScaR's key decode, for one unit and for 16 units of unequal length joined along the tokens
    (each token's group looked up in a table of the units' first tokens and groups), as the AAR's scales are."""
    built, spills = compiled(MINMAX_DECODE, cache=tmp_path)
    assert len(built) == 4 and all(size > 1000 for size in built)
    # OScaR's decode at D 128 keeps a row in registers: with a scale and an offset loaded per element it spilled
    # (108 and 166 bytes a thread, K and V); loaded once a group, it does not
    assert spills == [0, 0]
