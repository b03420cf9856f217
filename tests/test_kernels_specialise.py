"""Every launched kernel passes its sizes and offsets unspecialised, so a rollout compiles each kernel once.

Triton compiles a kernel again for each new combination of its integer arguments' "equals 1" and "divisible by 16"
properties. Token counts, tile and split offsets change with every unit, scale and cache length, so a kernel that
specialised them compiled again every few calls of an AAR rollout (docs/perf.md, the first full-size audio bench).
Checked on the compiled form (`triton.jit`, not the interpreter), in a child process without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import importlib, json, pkgutil
    from triton.runtime.jit import JITFunction
    import mmkv.kernels as K
    from mmkv.kernels.common import SIZE_ARGS, jit

    out = {}
    for m in pkgutil.iter_modules(K.__path__):
        mod = importlib.import_module(f"mmkv.kernels.{m.name}")
        for name, f in vars(mod).items():
            if isinstance(f, JITFunction) and f.__module__ == mod.__name__ and name.endswith("kernel"):
                out[f"{m.name}.{name}"] = {p.name: bool(p.do_not_specialize) for p in f.params}
    def probe(x_ptr, T):
        pass

    try:
        jit(also=("no_such_arg",))(probe)
        err = ""
    except ValueError as e:
        err = str(e)
    print(json.dumps({"kernels": out, "sizes": sorted(SIZE_ARGS), "err": err}))
""")


@pytest.fixture(scope="module")
def kernels() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sizes_and_offsets_are_not_specialised(kernels):
    sizes = set(kernels["sizes"])
    assert len(kernels["kernels"]) >= 20  # every codec's encode / decode / attention kernel, found by name
    for name, params in kernels["kernels"].items():
        specialised = [p for p in params if p in sizes and not params[p]]
        assert not specialised, f"{name} specialises {specialised}: decorate it with mmkv.kernels.common.jit"


def test_strides_stay_specialised_except_octopus_bit_streams(kernels):
    # the alignment of strides lets loads vectorise; OCTOPUS's bit streams (42 triplets a token) are the exception
    kivi = kernels["kernels"]["kivi_attn._channel_group_attn_kernel"]
    assert not kivi["kc_sh"] and not kivi["vc_sh"] and kivi["T"] and kivi["Tq"]
    octo = kernels["kernels"]["octopus_attn._octopus_attn_kernel"]
    assert octo["dir_sh"] and octo["rho_sb"] and not octo["vc_sh"]
    assert kernels["kernels"]["octopus_decode._octopus_decode_kernel"]["dir_row_bytes"]


def test_jit_refuses_unknown_argument_names(kernels):
    assert "no_such_arg" in kernels["err"]
