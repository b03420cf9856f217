"""Fused split-K decode attention over TCQ keys (`kernels/tcq_attn.py`) against exact attention over the codec's own
decode, on the CPU through the Triton interpreter at small shapes: integer and fractional rates (mixed step widths),
TCQ and groupquant values, one and several tiles, splits, the fallbacks and the attention seam.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels then run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1":  # tests/conftest.py: compiled kernels (CUDA) run the gpu-marked tests
    pytest.skip("interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

from mmkv.attention import Segment  # noqa: E402
from mmkv.codecs.base import build, kv_configs  # noqa: E402
from mmkv.kernels import attention_kernel, attn_splitk, dispatch  # noqa: E402


# Triton 3.6's interpreter under numpy >= 2.4 (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")


@functools.lru_cache(maxsize=None)
def _encoded(preset, b, hkv, d, lengths, seed):
    """Random K/V of ragged lengths encoded once per module (TCQ's torch Viterbi is most of this file's time)."""
    kc, vc = kv_configs(preset, 32)
    kcod = build(kc, head_dim=d, num_heads=hkv, seed=seed + 1)
    vcod = build(vc, head_dim=d, num_heads=hkv, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed)
    encs = []
    for n in lengths:
        k = torch.randn(b, hkv, n, d, generator=gen) * 1.5
        v = torch.randn(b, hkv, n, d, generator=gen)
        encs.append((kcod.encode(k), vcod.encode(v)))
    return kc, vc, kcod, vcod, encs


def setup(preset, *, b=1, hkv=2, group=2, d=32, tq=1, lengths=(100, 45), skip=(0, 5), seed=0):
    """Segments of ragged lengths (not multiples of a tile) with leading tokens skipped, and a query with `group`
    query heads per KV head."""
    kc, vc, kcod, vcod, encs = _encoded(preset, b, hkv, d, lengths, seed)
    segs = [Segment(k_enc=ke, v_enc=ve, k_codec=kcod, v_codec=vcod, skip_tokens=s) for (ke, ve), s in zip(encs, skip)]
    q = torch.randn(b, hkv * group, tq, d, generator=torch.Generator().manual_seed(seed + 100))
    return attention_kernel(kc, vc), q, segs


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_matches_reference(kernel, q, segs, scale):
    out, lse = kernel(q, segs, scale)
    assert kernel.last_path == "fused"
    ref, ref_lse = attn_splitk.reference_lse(q, segs, scale)
    assert out.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:-1]
    assert rel(out, ref) < 2e-5, rel(out, ref)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-5)


# (preset, head dim, segment lengths): TCQ values at an integer rate (4-bit steps), at fractional rates (wide steps
# from the code_hi plane: 5-bit among 4-bit, 9-bit among 8-bit) and with fp32 gains; 6-bit codes straddling bytes;
# groupquant values read as half-word units (4 bits) and as byte chunks (3 bits). Shipped tables only.
CASES = [
    ("tcq:bits=2,L=8", 32, (100, 45)),
    ("tcq:bits=2,hi=5,L=8", 32, (100, 45)),
    ("tcq:bits=4,hi=3,norm=32", 16, (40, 21)),
    ("tcq:bits=3", 16, (40, 21)),
    ("tcq:bits=2,L=8/groupquant:bits=4,group=16", 32, (70, 21)),
    ("tcq:bits=2,hi=7,L=8/groupquant:bits=3,group=16", 32, (70, 21)),
]


@pytest.mark.parametrize("preset,d,lengths", CASES, ids=[c[0] for c in CASES])
def test_fused_matches_exact_attention_over_the_decode(preset, d, lengths):
    kernel, q, segs = setup(preset, d=d, lengths=lengths)
    assert_matches_reference(kernel, q, segs, 0.21)


def test_head_dim_128_at_the_demo_preset():
    """The demo's TCQ point (2.6 bits: 45 wide steps of 64, fp32 gains), one short tile."""
    kernel, q, segs = setup("tcq:bits=2,hi=45,norm=32", hkv=1, group=1, d=128, lengths=(19,), skip=(2,), seed=3)
    assert_matches_reference(kernel, q, segs, 128**-0.5)


def test_short_query_blocks_and_batches():
    kernel, q, segs = setup("tcq:bits=2,hi=5,L=8", b=2, hkv=1, tq=3, lengths=(40,), skip=(2,), seed=2)
    assert_matches_reference(kernel, q, segs, 0.3)


def test_splits_merge_exactly():
    kernel, q, segs = setup("tcq:bits=2,L=8", group=1, lengths=(200,), skip=(0,), seed=7)
    kernel.splits = 1
    one, lse1 = kernel(q, segs, 0.3)
    kernel.splits = 5
    many, lse5 = kernel(q, segs, 0.3)
    assert kernel.last_path == "fused"
    assert rel(many, one) < 1e-6
    torch.testing.assert_close(lse5, lse1, rtol=0, atol=1e-5)


def test_uncovered_inputs_fall_back_exactly():
    # a value group that is not a power of two
    kernel, q, segs = setup("tcq:bits=2,L=8/groupquant:bits=4,group=24", lengths=(40,), skip=(0,), seed=11)
    out, _ = kernel(q, segs, 0.2)
    assert kernel.last_path == "reference"
    assert rel(out, attn_splitk.reference_lse(q, segs, 0.2)[0]) == 0.0
    # rotated values of two V rotations cannot share one rotation back
    kernel, q, segs = setup("tcq:bits=2,L=8", lengths=(40, 21), seed=12)
    other = build(segs[1].v_codec.config, head_dim=32, num_heads=2, seed=99)
    segs[1] = Segment(k_enc=segs[1].k_enc, v_enc=other.encode(torch.randn(1, 2, 21, 32)), k_codec=segs[1].k_codec,
                      v_codec=other)
    out, _ = kernel(q, segs, 0.2)
    assert kernel.last_path == "reference"
    assert rel(out, attn_splitk.reference_lse(q, segs, 0.2)[0]) == 0.0


def test_dispatch_names_the_kernel_only_for_covered_pairs(monkeypatch):
    assert dispatch.KERNELS["tcq"]["attention"] == "tcq_attn"
    for preset in ("tcq:bits=2,hi=45,norm=32", "tcq:bits=4,hi=47,norm=32", "tcq:bits=3/groupquant:bits=4,group=32"):
        kernel = attention_kernel(*kv_configs(preset, 32))
        assert kernel is not None and kernel.name == "tcq", preset
    for preset in ("tcq:bits=2/kivi:bits=2,role=v", "tcq:bits=2/identity"):
        assert attention_kernel(*kv_configs(preset, 32)) is None, preset
    monkeypatch.setenv("MMKV_KERNELS", "0")
    assert attention_kernel(*kv_configs("tcq:bits=2", 32)) is None


def test_through_the_attention_seam(through_the_seam):
    """`attend` with the kernel (encoded past fused, native window and current block exactly, merged by LSE) equals
    the decode path."""
    kernel, q, segs = setup("tcq:bits=2,hi=5,L=8", group=1, lengths=(40, 21), seed=13)
    fused, decoded, used = through_the_seam(kernel, q, segs)
    assert used == ["tcq"] and kernel.last_path == "fused"
    assert rel(fused, decoded) < 2e-5


def test_bench_times_tcq_decode_rows():
    from mmkv.bench import kernels as bench

    assert "tcq:bits=2,hi=45,norm=32" in bench.DECODE_PRESETS and "tcq" in bench.SWEEP
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--batch", "1", "--heads", "1", "--chunk", "64"])

    def host_timer(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    rows = bench._Bench(args, torch.device("cpu"), host_timer).decode(["tcq:bits=2,L=8"], [64])
    assert [r["codec"] for r in rows] == ["bf16 sdpa", "tcq:bits=2,L=8"]
    assert rows[1]["path"] == "fused" and rows[1]["config"].startswith("tcq fused")
    assert rows[1]["rel_error"] < 1e-5 and rows[1]["rel_error_vs_decode_sdpa"] < 1e-2
