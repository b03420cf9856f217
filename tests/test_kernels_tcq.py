"""TCQ kernels (kernels/tcq_encode.py, kernels/tcq_decode.py) against the torch reference, on CPU through Triton's
interpreter at small shapes (odd token counts, several heads, wide steps, bf16/fp16/fp32).

What must hold: the Viterbi kernel finds the reference's codes bit for bit on the same u (the same fp32 operations in
the same order, ties to the lowest index on both sides), so the whole encoding is the reference's; the decoder
reproduces the reference's decode bit for bit (table lookup, the fp32 butterfly), also into a strided `out`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere in this process

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from mmkv.codecs import build  # noqa: E402
from mmkv.codecs.tcq import viterbi as reference_viterbi  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py: compiled kernels (CUDA) run the gpu-marked tests
    pytest.skip("interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402


def _modules():
    names = ["common", "packing", "rotation", "tcq_decode", "tcq_encode", "dispatch"]
    mods = {n: importlib.import_module(f"mmkv.kernels.{n}") for n in names}
    if not isinstance(mods["tcq_decode"]._tcq_decode_kernel, InterpretedFunction):
        mods = {n: importlib.reload(mods[n]) for n in names}
    return mods


K = _modules()

# (preset, head_dim, heads (0: a bare [T, D] unit), tokens, input dtype); shipped tables only (training one takes
# seconds): L = 8 at 2 bits (the default), the default L = 9 at 3 bits and L = 11 at 4 bits.
CASES = [
    ("tcq:bits=2,L=8", 16, 2, 5, torch.float32),
    ("tcq:bits=2,hi=3,L=8", 16, 0, 7, torch.bfloat16),
    ("tcq:bits=3,hi=8", 32, 2, 3, torch.float16),
    ("tcq:bits=4,norm=32", 16, 2, 3, torch.float32),
    # 64 steps: pass one sees the 32 around the first (pass_one_window); one token a head (the interpreter's time
    # goes by programs times steps: 2 vectors make 2 programs at 1 vector a program, a partial one at 4)
    ("tcq:bits=2", 128, 1, 1, torch.bfloat16),
    ("tcq:bits=3,hi=20", 128, 0, 2, torch.float32),
]


def _setup(preset, d, heads, t, dtype, seed=0):
    codec = build(preset, head_dim=d, num_heads=max(heads, 1), layer=1, seed=5)
    shape = (2, heads, t, d) if heads else (t, d)
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed + d + t)) * 2.0 + 0.3).to(dtype)
    return codec, x


def test_registered_for_both_ops():
    kernels = K["dispatch"].KERNELS["tcq"]
    assert (kernels["encode"], kernels["decode"]) == ("tcq_encode", "tcq_decode")  # attention: test_kernels_tcq_attn
    assert K["tcq_encode"].supports(build("tcq", head_dim=128))
    assert not K["tcq_encode"].supports(build("tcq", head_dim=8))


# Each case at 1 and 4 vectors a program (7 vectors leave a partial tile), but the first at 1: the lane layout's
# search of 1 vector a program at d = 16 is test_lane_layout_finds_the_reference_codes's (in launches of 8, on vectors
# full of ties).
VITERBI = [(*c, vectors) for vectors in (1, 4) for c in CASES if (c, vectors) != (CASES[0], 1)]


@pytest.mark.parametrize("preset,d,heads,t,dtype,vectors", VITERBI, ids=[f"{c[0]}-d{c[1]}-{c[5]}" for c in VITERBI])
def test_viterbi_kernel_finds_the_reference_codes(preset, d, heads, t, dtype, vectors):
    codec, x = _setup(preset, d, heads, t, dtype)
    _, u = codec.unit_rotated(x.float())
    ref = reference_viterbi(u.reshape(-1, codec.steps, 2), codec.table, codec.widths, codec.L)
    got = K["tcq_encode"].viterbi(codec, u, warps=1, vectors=vectors)
    assert torch.equal(got.reshape(-1, codec.steps), ref)


def test_viterbi_kernel_with_qtips_pass_one():
    """`window=None` (pass one over all 64 steps, as QTIP's and as before 2026-12-03) is the reference's too."""
    codec, x = _setup("tcq:bits=2", 128, 1, 1, torch.float32, seed=4)  # 2 vectors: one program of the default 4
    _, u = codec.unit_rotated(x.float())
    ref = reference_viterbi(u.reshape(-1, codec.steps, 2), codec.table, codec.widths, codec.L, window=None)
    got = K["tcq_encode"].viterbi(codec, u, warps=1, window=None)
    assert torch.equal(got.reshape(-1, codec.steps), ref)


def test_viterbi_over_several_launches(monkeypatch):
    """20 vectors in launches of 8 (the back-pointer scratch reused), 4 or 8 vectors a program, the last launch
    partial (1 vector a program in launches of 8, the same codec and shape: test_viterbi_launch_settings_keep_the_codes
    [tcq:bits=2,hi=5,L=8])."""
    codec, x = _setup("tcq:bits=2,hi=5,L=8", 16, 2, 5, torch.float32, seed=3)
    _, u = codec.unit_rotated(x.float())
    ref = reference_viterbi(u.reshape(-1, codec.steps, 2), codec.table, codec.widths, codec.L)
    monkeypatch.setattr(K["tcq_encode"], "PROGRAMS", 8)
    for vectors in (4, 8):
        got = K["tcq_encode"].viterbi(codec, u, warps=1, vectors=vectors)
        assert torch.equal(got.reshape(-1, codec.steps), ref), vectors
    with pytest.raises(ValueError, match="power of two"):
        K["tcq_encode"].viterbi(codec, u, vectors=3)


@pytest.mark.parametrize("preset", ["tcq:bits=2,hi=5,L=8", "tcq:bits=3,L=9"])  # with and without wide steps
def test_viterbi_launch_settings_keep_the_codes(preset):
    """The launch variants kernels/gpu_check_codecs.py times (inputs loaded a step ahead, vectors a launch) find the
    reference's codes; 20 vectors in launches of 8 leave a partial last launch."""
    codec, x = _setup(preset, 16, 2, 5, torch.float32, seed=4)
    _, u = codec.unit_rotated(x.float())
    ref = reference_viterbi(u.reshape(-1, codec.steps, 2), codec.table, codec.widths, codec.L)
    for vectors, prefetch, programs in ((1, True, 8), (4, True, None), (2, False, 6)):
        got = K["tcq_encode"].viterbi(codec, u, warps=1, vectors=vectors, prefetch=prefetch, programs=programs)
        assert torch.equal(got.reshape(-1, codec.steps), ref), (vectors, prefetch, programs)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="programs"):
            K["tcq_encode"].viterbi(codec, u, programs=bad)
    import inspect

    from mmkv.kernels import gpu_check_codecs
    accepted = set(inspect.signature(K["tcq_encode"].encode).parameters)
    assert all(set(v) <= accepted for v in gpu_check_codecs.TCQ_VARIANTS)


def test_lane_layout_finds_the_reference_codes():
    """The lane layout (L = 2k, no wide steps: the 2-bit default) on vectors full of ties (all zeros: every path costs
    the same; equal pair values; repeated pairs), in launches of 8 with a partial last one, 1, 2 or 4 vectors a
    program on 1 or 2 warps, with pass one windowed (d = 32, a window of 4 of its 16 steps: what d = 128 does with
    the default 16 of 64, at an eighth of the interpreter's time) or over all steps (d = 16, and `window=None`).
    One head: 10 vectors at d = 16 (launches of 8 and 2, 6 and 4), 6 at d = 32 (launches of 5 and 1, partial
    programs); the interpreter's time goes by programs, and it ignores warps: 2 vectors a program in one launch is
    d = 32's alone, and at d = 16, where the window covers all 8 steps, `window=None` would be the (4, 2, None)
    launch again."""
    from mmkv.codecs.tcq import PASS_ONE_WINDOW, pass_one_window

    enc = K["tcq_encode"]
    for d, t, window in ((32, 3, 4), (16, 5, PASS_ONE_WINDOW)):
        codec, x = _setup("tcq:bits=2,L=8", d, 1, t, torch.float32, seed=6)
        assert enc.lanes_fit(codec)
        assert (pass_one_window(codec.steps, window)[1] < codec.steps) == (d == 32)  # windowed at d = 32 only
        _, u = codec.unit_rotated(x.float())
        u = u.reshape(-1, codec.steps, 2).clone()
        u[0] = 0.0
        u[1, :, 1] = u[1, :, 0]
        u[2, 1::2] = u[2, 0::2]  # every pair twice
        ref = reference_viterbi(u, codec.table, codec.widths, codec.L, window=window)
        settings = ((1, 1, 8), (4, 1, 8), (2, 2, 6), (4, 2, None)) if d == 16 else ((2, 1, None), (4, 2, 5))
        for vectors, warps, programs in settings:
            got = enc.viterbi(codec, u.reshape(-1, d), warps=warps, vectors=vectors, programs=programs,
                              layout="lanes", window=window)
            assert torch.equal(got, ref), (d, vectors, warps, programs)
        assert torch.equal(enc.viterbi(codec, u.reshape(-1, d), layout="tile", window=window), ref)
        if d == 32:
            full = reference_viterbi(u, codec.table, codec.widths, codec.L, window=None)
            assert torch.equal(enc.viterbi(codec, u.reshape(-1, d), window=None, layout="lanes"), full)


@pytest.mark.parametrize("preset,layout", [("tcq:bits=2,L=8", "lanes"), ("tcq:bits=2,L=8", "tile"),
                                           ("tcq:bits=2,hi=3,L=8", "tile")])
def test_search_forms_the_reference_unit_vectors(preset, layout):
    """Given r and ||x||, as the encoder passes them, the search's u = r * (reciprocal(||x||) * sqrt(d)) is the
    reference's u bit for bit (torch's `scalar / tensor` is `reciprocal() * scalar`): the reference's codes, for
    norms from 1e-15 to 1e15 and an all-zero vector (its norm 0 is replaced by 1, as the reference does)."""
    import math

    codec = build(preset, head_dim=16, num_heads=1, layer=1, seed=5)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(11)) * torch.logspace(-15, 15, 12)[:, None]
    x[3] = 0.0
    r, u = codec.unit_rotated(x)
    enc = K["tcq_encode"]
    kr, norm = enc.rotated(codec, x)
    assert torch.equal(kr, r)
    scale = torch.where(norm > 0, norm, 1.0).reciprocal() * torch.tensor(math.sqrt(16), dtype=torch.float32)
    assert torch.equal(r * scale, u)  # the order of roundings the kernel follows (`_unit_scale`)
    ref = reference_viterbi(u.reshape(-1, codec.steps, 2), codec.table, codec.widths, codec.L)
    assert torch.equal(enc.viterbi(codec, kr, norm=norm, layout=layout).reshape(-1, codec.steps), ref)
    assert not torch.equal(enc.viterbi(codec, kr, layout=layout).reshape(-1, codec.steps), ref)  # r is not u
    with pytest.raises(ValueError, match="one norm a vector"):
        enc.viterbi(codec, kr, norm=norm[:5])


def test_layout_choice_and_refusals():
    enc = K["tcq_encode"]
    wide = build("tcq:bits=2,hi=5,L=8", head_dim=16)
    three = build("tcq:bits=3", head_dim=16)
    assert enc.layout_of(wide, None) == "tile" and enc.layout_of(three, None) == "tile"
    assert enc.layout_of(build("tcq:bits=2", head_dim=16), None) == enc.DEFAULT_LAYOUT
    u = torch.zeros(2, 16)
    for codec in (wide, three):
        with pytest.raises(ValueError, match="lanes layout needs L = 2k"):
            enc.viterbi(codec, u, layout="lanes")
    with pytest.raises(ValueError, match="layout must be one of"):
        enc.viterbi(wide, u, layout="rows")


@pytest.mark.parametrize("layout", ["lanes", "tile"])
def test_encode_in_either_layout_is_the_reference_encoding(layout):
    codec, x = _setup("tcq:bits=2", 128, 1, 3, torch.bfloat16, seed=7)  # 6 vectors: the lanes' 4, then a partial 2
    ref = codec._encode(x.float())
    ker = K["tcq_encode"].encode(codec, x, layout=layout)
    assert list(ker.tensors) == list(ref.tensors)
    for name, a in ref.tensors.items():
        assert torch.equal(a, ker.tensors[name]), name


@pytest.mark.parametrize("warps", [1, 4])  # the default, and the earlier default (a launch variant)
def test_encode_is_the_reference_encoding(warps):
    codec, x = _setup(*CASES[1])
    ref = codec._encode(x.float())
    ker = K["tcq_encode"].encode(codec, x, warps=warps)
    assert list(ker.tensors) == list(ref.tensors)
    for name, a in ref.tensors.items():
        assert torch.equal(a, ker.tensors[name]), name


@pytest.mark.parametrize("preset,d,heads,t,dtype", CASES, ids=[f"{c[0]}-d{c[1]}" for c in CASES])
def test_decode_is_bit_identical(preset, d, heads, t, dtype):
    codec, x = _setup(preset, d, heads, t, dtype, seed=1)
    enc = codec.encode(x)  # CPU: the reference
    for out_dtype in (dtype, torch.float32):
        want = codec._decode(enc).to(out_dtype)
        got = K["tcq_decode"].decode(codec, enc, out_dtype, warps=1)
        assert torch.equal(got, want)


def test_decode_into_a_token_slice():
    codec, x = _setup("tcq:bits=2,hi=5,L=8", 32, 2, 6, torch.bfloat16, seed=2)
    enc = codec.encode(x)
    buf = torch.zeros(2, 2, 10, 32, dtype=torch.bfloat16)
    got = K["tcq_decode"].decode(codec, enc, torch.bfloat16, warps=1, out=buf[..., 3:9, :])
    assert got.data_ptr() == buf[..., 3:, :].data_ptr()
    assert torch.equal(buf[..., 3:9, :], codec._decode(enc).to(torch.bfloat16))
    assert not buf[..., :3, :].any() and not buf[..., 9:, :].any()


@pytest.mark.parametrize("preset,d,heads,t,dtype", [c for c in CASES if "hi=" not in c[0]],
                         ids=[f"{c[0]}-d{c[1]}" for c in CASES if "hi=" not in c[0]])
def test_fused_finish_packs_the_reference_codes_and_its_gains(preset, d, heads, t, dtype):
    """The one-kernel finish after the search: the packed codes are the reference's bytes, the gains the
    reference's up to the order of two 128-term sums (an fp16 gain within one ulp), and the whole encode
    decodes like the reference encoding; the tokens make one whole block of the kernel's 32 vectors and a partial
    one (2 x 2 heads x 9 tokens at d = 16, 2 x 1 x 17 at d = 128)."""
    tokens = (17 if heads == 1 else 9) if heads else t
    codec, x = _setup(preset, d, heads, tokens, dtype, seed=6)
    ref = codec._encode(x.float())
    # The search before the finish (its codes do not depend on its launch settings, and are checked here): 32 vectors
    # a program (2 of the interpreter's programs instead of 9 or 36), and at d = 128 the tile layout (a lane program
    # of 64 steps takes the interpreter 4 times a tile's; the lane search at d = 128 is the Viterbi tests' and the
    # backtrack finish's). The finish reads the same int32 codes from either layout.
    search = {"vectors": 32, "layout": "tile" if d == 128 else None}
    ker = K["tcq_encode"].encode(codec, x, fused=True, **search)
    assert list(ker.tensors) == list(ref.tensors) == ["code", "gain"]
    assert torch.equal(ker.tensors["code"], ref.tensors["code"])
    if d < 128:  # at d = 128 the unfused path's search is the Viterbi test's (this case's time halved)
        plain = K["tcq_encode"].encode(codec, x, fused=False, **search)
        assert torch.equal(plain.tensors["code"], ref.tensors["code"])
        assert torch.equal(plain.tensors["gain"], ref.tensors["gain"])
    g, want = ker.tensors["gain"], ref.tensors["gain"]
    assert g.dtype == want.dtype and g.shape == want.shape
    # two sums of 128 products in another order: a few fp32 ulps, which an fp16 gain rounds away but at ties
    ulps = 2 if want.dtype == torch.float16 else 32
    assert ((g.float() - want.float()).abs() <= ulps * torch.finfo(want.dtype).eps * want.float().abs()).all()
    ker.shape, ker.dtype, ker.codec = ref.shape, ref.dtype, ref.codec = tuple(x.shape), x.dtype, str(codec.config)
    assert torch.allclose(codec._decode(ker), codec._decode(ref), rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("preset,d,heads,t,dtype,vectors", [
    ("tcq:bits=2,L=8", 16, 2, 13, torch.float32, 8),  # 52 vectors: a partial last program (4 of 8), 20 of 32 packed
    ("tcq:bits=2,L=8,norm=32", 32, 2, 3, torch.bfloat16, 4),  # fp32 gains
    ("tcq:bits=2", 128, 1, 1, torch.bfloat16, 2),  # the video's head dim, windowed pass one (one program)
    ("tcq:bits=1,L=4", 16, 1, 11, torch.float16, 4),  # k = 2: a vector's 2 bytes of codes from two lanes
])
def test_the_lane_search_can_finish_the_encode_in_its_last_backtrack(preset, d, heads, t, dtype, vectors):
    """`fused="backtrack"`: the codes packed byte for byte as the reference packs them and the gains within the
    finishing kernel's tolerance of the reference's (their sums run over the steps, last to first), with no int32
    codes in between."""
    codec, x = _setup(preset, d, heads, t, dtype, seed=6)
    ref = codec._encode(x.float())
    ker = K["tcq_encode"].encode(codec, x, fused="backtrack", vectors=vectors)
    assert list(ker.tensors) == ["code", "gain"]
    assert torch.equal(ker.tensors["code"], ref.tensors["code"])
    g, want = ker.tensors["gain"], ref.tensors["gain"]
    assert g.dtype == want.dtype and g.shape == want.shape
    ulps = 2 if want.dtype == torch.float16 else 32
    assert ((g.float() - want.float()).abs() <= ulps * torch.finfo(want.dtype).eps * want.float().abs()).all()


def test_the_encode_finishes_in_the_backtrack_by_default_where_it_can(monkeypatch):
    """The default `fused=None` takes the backtrack finish where the lanes search a multiple of 8 steps (the same
    bytes as asking for it) and the finishing kernel elsewhere (the tile layout, asked for or the only one at L = 9)."""
    enc = K["tcq_encode"]
    calls = []
    real = enc.finish
    monkeypatch.setattr(enc, "finish", lambda *a, **k: calls.append(1) or real(*a, **k))
    codec, x = _setup("tcq:bits=2,L=8", 16, 2, 1, torch.float32, seed=3)  # 4 vectors: one program
    assert enc.backtrack_fits(codec) and not enc.backtrack_fits(codec, "tile")
    default = enc.encode(codec, x)
    assert not calls
    back = enc.encode(codec, x, fused="backtrack")
    assert all(torch.equal(default.tensors[k], back.tensors[k]) for k in ("code", "gain"))
    enc.encode(codec, x, layout="tile")
    assert len(calls) == 1
    tile, y = _setup("tcq:bits=2,L=9", 16, 1, 3, torch.float32, seed=3)  # L != 2k: no lanes
    assert not enc.backtrack_fits(tile)
    enc.encode(tile, y)
    assert len(calls) == 2


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's fp16 inf
def test_the_backtrack_finish_refuses_a_gain_beyond_fp16_and_what_it_cannot_search():
    from mmkv.codecs import CodecError

    enc = K["tcq_encode"]
    codec, x = _setup("tcq:bits=2,L=8", 16, 2, 1, torch.float32)  # 4 vectors: one program
    with pytest.raises(CodecError, match=r"does not fit an fp16 norm \(max 65504.0\); use norm=32"):
        enc.encode(codec, x * 1e5, fused="backtrack")
    with pytest.raises(ValueError, match="finishes the encode only in the lanes layout"):
        enc.encode(codec, x, fused="backtrack", layout="tile")
    with pytest.raises(ValueError, match="fused must be None, True, False or 'backtrack'"):
        enc.encode(codec, x, fused="search")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's fp16 inf
def test_fused_finish_refuses_a_gain_beyond_fp16():
    from mmkv.codecs import CodecError

    codec, x = _setup("tcq:bits=2,L=8", 16, 2, 1, torch.float32)  # 4 vectors: one program
    with pytest.raises(CodecError, match=r"does not fit an fp16 norm \(max 65504.0\); use norm=32"):
        K["tcq_encode"].encode(codec, x * 1e5, fused=True)
    with pytest.raises(CodecError, match="does not fit an fp16 norm"):
        codec._encode(x * 1e5)  # the reference says the same
