"""The TCQ encoder's launch variants compile for an H100 / H200 (sm_90) on a machine without a GPU.

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

    sig = {"u_ptr": "*fp32", "table_ptr": "*fp32", "wide_ptr": "*i32", "bp_ptr": "*i16", "codes_ptr": "*i32",
           "first": "i32", "n": "i32", "STEPS": "constexpr", "K": "constexpr", "L": "constexpr", "WIDE": "constexpr",
           "NV": "constexpr", "PREFETCH": "constexpr"}
    out = []
    for consts, warps in json.loads(sys.argv[1]):
        src = ASTSource(fn=tcq_encode._tcq_viterbi_kernel, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        out.append(len(k.asm["cubin"]))
    print(json.dumps(out))
""")


def test_tcq_encoder_variants_compile_for_sm90():
    cases = [  # the default L of 2 and 4 bits, a width with wide steps; 1 or 4 vectors a program; prefetch or not
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 1, "PREFETCH": True}, 1),
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 4, "PREFETCH": False}, 4),
        ({"STEPS": 64, "K": 8, "L": 11, "WIDE": False, "NV": 1, "PREFETCH": True}, 1),
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": True, "NV": 1, "PREFETCH": True}, 2),
        ({"STEPS": 64, "K": 4, "L": 8, "WIDE": False, "NV": 2, "PREFETCH": True}, 1),
    ]
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    sizes = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(sizes) == len(cases) and all(s > 1000 for s in sizes)  # a cubin for each
