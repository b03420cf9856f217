"""Fused split-K decode attention (`kernels/<codec>_attn.py`) against exact attention over the codec's own decode,
run on the CPU through the Triton interpreter on small shapes (the GPU run of `mmkv bench kernels` checks full size).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels then run on CPU tensors

import argparse  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1":  # tests/conftest.py: compiled kernels (CUDA) run the gpu-marked tests
    pytest.skip("interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

import mmkv.attention as attn  # noqa: E402
from mmkv.attention import Segment  # noqa: E402
from mmkv.codecs.base import build, kv_configs  # noqa: E402
from mmkv.kernels import attention_kernel  # noqa: E402
from mmkv.kernels import attn_splitk  # noqa: E402


# Triton 3.6's interpreter under numpy >= 2.4 (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")


# The rollout presets with a fused kernel, with every code-reading path: half-word units at 2/4/8 bits, byte chunks
# at 3 bits (K and V), OCTOPUS code windows of 1 byte (b=3) and 2 bytes (b=2, b=4), rho planes of 1-3 bits.
PRESETS = [
    "kivi:bits=2,group=32",
    "kivi:bits=4,group=32",
    "kivi:bits=3,group=16",
    "kivi:bits=8,group=32",
    "oscar:bits=2,group=32",
    "oscar:bits=3,group=16",
    "turboquant-mse:b=2",
    "turboquant-mse:b=4",
    "turboquant-mse:b=3",
    "octopus:b=2",
    "octopus:b=3",
    "octopus:b=4",
]


def setup(preset, *, b=1, hkv=2, group=2, d=64, tq=1, lengths=(150, 77), skip=(0, 5), seed=0):
    """Random K/V encoded into segments of ragged lengths (not multiples of any tile or group) plus a query with
    `group` query heads per KV head."""
    kc, vc = kv_configs(preset, 32)
    kcod = build(kc, head_dim=d, num_heads=hkv, seed=seed + 1)
    vcod = build(vc, head_dim=d, num_heads=hkv, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed)
    segs = []
    for n, s in zip(lengths, skip):
        k = torch.randn(b, hkv, n, d, generator=gen) * 1.5
        v = torch.randn(b, hkv, n, d, generator=gen)
        segs.append(Segment(k_enc=kcod.encode(k), v_enc=vcod.encode(v), k_codec=kcod, v_codec=vcod, skip_tokens=s))
    q = torch.randn(b, hkv * group, tq, d, generator=gen)
    return attention_kernel(kc, vc), q, segs


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_matches_exact_attention_over_the_decode(preset):
    kernel, q, segs = setup(preset)
    out, lse = kernel(q, segs, 0.21)
    assert kernel.last_path == "fused"
    ref, ref_lse = attn_splitk.reference_lse(q, segs, 0.21)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert rel(out, ref) < 2e-5, rel(out, ref)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-5)


def test_short_query_blocks_and_batches():
    kernel, q, segs = setup("turboquant-mse:b=4", b=2, tq=3, lengths=(70,), skip=(2,), seed=2)
    out, lse = kernel(q, segs, 0.3)
    assert kernel.last_path == "fused"
    ref, ref_lse = attn_splitk.reference_lse(q, segs, 0.3)
    assert rel(out, ref) < 2e-5
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-5)


@pytest.mark.parametrize("preset", ["octopus:b=3", "kivi:bits=2,group=32"])
def test_head_dim_128(preset):
    kernel, q, segs = setup(preset, b=1, hkv=1, group=1, d=128, lengths=(100,), skip=(3,), seed=3)
    out, lse = kernel(q, segs, 128**-0.5)
    ref, ref_lse = attn_splitk.reference_lse(q, segs, 128**-0.5)
    assert rel(out, ref) < 2e-5
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-5)


@pytest.mark.parametrize("preset", ["kivi:bits=2,group=32", "oscar:bits=2,group=32", "turboquant-mse:b=2",
                                    "octopus:b=2", "tcq:bits=2,L=8"])
def test_pasts_shorter_than_a_tile(preset):
    """An AAR's first scales hold 1, 2 and 3 tokens: a past of a fraction of one tile (one key group for KIVI and
    OScaR), with the CFG batch of 2 and queries of 1 and 2 rows, is still exact attention over the decode."""
    for n, tq in ((1, 1), (2, 2), (3, 1)):
        kernel, q, segs = setup(preset, b=2, tq=tq, lengths=(n,), skip=(0,), seed=13 + n)
        out, lse = kernel(q, segs, 0.2)
        assert kernel.last_path == "fused"
        ref, ref_lse = attn_splitk.reference_lse(q, segs, 0.2)
        assert rel(out, ref) < 2e-5, (n, rel(out, ref))
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-5)


def test_matches_decode_then_sdpa_within_bf16_tolerance():
    """The acceptance check: fused vs the reference path of `mmkv.attention` (decode to the store dtype + SDPA)."""
    kernel, q, segs = setup("octopus:b=2", seed=5)
    out, _ = kernel(q, segs, 0.125)
    k, v = attn.gather(segs, None, None, torch.bfloat16)
    hq = q.shape[1]
    k, v = k.repeat_interleave(hq // k.shape[1], 1), v.repeat_interleave(hq // v.shape[1], 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k, v, scale=0.125)
    assert rel(out, sdpa.float()) < 1e-2


def test_splits_merge_exactly():
    kernel, q, segs = setup("turboquant-mse:b=2", lengths=(300,), skip=(0,), seed=7)
    kernel.splits = 1
    one, lse1 = kernel(q, segs, 0.3)
    kernel.splits = 5
    many, lse5 = kernel(q, segs, 0.3)
    assert rel(many, one) < 1e-6
    torch.testing.assert_close(lse5, lse1, rtol=0, atol=1e-5)


def test_long_query_blocks_take_the_exact_path():
    kernel, q, segs = setup("kivi:bits=2,group=32", tq=attn_splitk.MAX_FUSED_QUERIES + 1, seed=9)
    out, lse = kernel(q, segs, 0.2)
    assert kernel.last_path == "reference"  # on CUDA with bf16 queries: decode + flash attention
    ref, ref_lse = attn_splitk.reference_lse(q, segs, 0.2)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_unsupported_parameters_fall_back_exactly():
    kernel, q, segs = setup("kivi:bits=2,group=24", seed=11)  # K tiles are one K group: 24 is not a power of two
    out, _ = kernel(q, segs, 0.2)
    assert kernel.last_path == "reference"
    assert rel(out, attn_splitk.reference_lse(q, segs, 0.2)[0]) == 0.0


def test_rotated_values_of_other_codecs_fall_back_exactly():
    """OScaR's values are turned back once with the first segment's V codec: a segment from a codec that may rotate
    otherwise (another seed) takes the exact path, and segments of one codec stay fused."""
    kernel, q, segs = setup("oscar:bits=2,group=32", lengths=(40, 21), seed=12)
    kernel(q, segs, 0.2)
    assert kernel.last_path == "fused"
    other = build(segs[1].v_codec.config, head_dim=64, num_heads=2, seed=99)
    segs[1] = Segment(k_enc=segs[1].k_enc, v_enc=other.encode(torch.randn(1, 2, 21, 64)), k_codec=segs[1].k_codec,
                      v_codec=other, skip_tokens=segs[1].skip_tokens)
    out, _ = kernel(q, segs, 0.2)
    assert kernel.last_path == "reference"
    assert rel(out, attn_splitk.reference_lse(q, segs, 0.2)[0]) == 0.0


def test_dispatch_names_kernels_only_for_covered_pairs(monkeypatch):
    for preset in ("kivi:bits=4", "oscar:bits=2", "turboquant-mse:b=4", "octopus:b=3"):
        assert attention_kernel(*kv_configs(preset, 32)) is not None, preset
    for preset in ("qjl:bits=3", "polarquant:b=3", "identity", "turboquant-mse:b=2,hi=45",
                   "octopus:b=3/kivi:bits=2,role=v"):
        assert attention_kernel(*kv_configs(preset, 32)) is None, preset
    monkeypatch.setenv("MMKV_KERNELS", "0")
    assert attention_kernel(*kv_configs("octopus:b=3", 32)) is None


def test_through_the_attention_seam(through_the_seam):
    """`attend` with the kernel (encoded past through the kernel, native window and current block exactly, merged by
    LSE) equals the decode path."""
    kernel, q, segs = setup("oscar:bits=2,group=32", group=1, seed=13)
    fused, decoded, used = through_the_seam(kernel, q, segs)
    assert used == ["oscar"] and kernel.last_path == "fused"
    assert rel(fused, decoded) < 2e-5


def test_bench_rows_on_cpu_and_refusal_without_cuda(monkeypatch):
    from mmkv.bench import kernels as bench
    from mmkv.cli import UsageError

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--batch", "1", "--heads", "2", "--chunk", "64"])

    def host_timer(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    rows = bench._Bench(args, torch.device("cpu"), host_timer).decode(["kivi:bits=4,group=32"], [128])
    assert [r["codec"] for r in rows] == ["bf16 sdpa", "kivi:bits=4,group=32"]
    for r in rows:
        assert set(bench.FIELDS) <= set(r) and r["ms"] > 0 and r["gbps"] > 0
    assert rows[1]["rel_error"] < 1e-5 and rows[1]["rel_error_vs_decode_sdpa"] < 1e-2
    assert rows[1]["path"] == "fused" and "splits=" in rows[1]["config"]
    assert "kivi:bits=4,group=32" in bench.render(rows)

    # the video case: the past as the store holds it (token-local codecs: one segment per 3-frame block)
    args = parser.parse_args(["--video-heads", "2", "--video-lq", "8", "--frame-tokens", "16"])
    b = bench._Bench(args, torch.device("cpu"), host_timer)
    rows = b.video(["turboquant-mse:b=2", "kivi:bits=2,group=32"], [96])
    assert [r["codec"] for r in rows] == ["bf16 sdpa", "turboquant-mse:b=2", "kivi:bits=2,group=32"]
    assert "1 segments" in rows[1]["config"]  # joined
    assert "1 segments (a stack of 6 frames)" in rows[2]["config"]  # the encoded frames stacked
    assert all(r["rel_error"] < 1e-2 for r in rows)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="CUDA"):
        bench.run(args)
