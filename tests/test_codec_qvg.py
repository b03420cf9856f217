"""QVG (`mmkv/codecs/qvg.py`) against an independent numpy fp32 computation of the same algorithm, the
bit accounting, its quantiser edge cases, and the Triton kernels (`kernels/qvg_*.py`) under TRITON_INTERPRET on CPU.

The independent computation shares only the seed contract with the codec (init indices drawn from
`private_generator(seed, "qvg-kmeans-init", layer, stage)`); distances, means, residuals and the quantiser are written
again in numpy. Distances are dot products whose summation order belongs to the BLAS (torch's AVX2 or AVX-512 kernels,
numpy's, the kernel's `tl.dot`), so an id may flip at a near-tie and the flip carries into every later iteration:
the codec is checked step by step on its own assignments instead (each id within 1e-5 of the nearest distance, each
centre exactly the bf16 mean of its ids, the early stop as released, then codes, scales and the reconstruction bit
for bit), and only its reconstruction error is compared with the free-running independent computation (within 2%).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere in this process

import importlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from mmkv.codecs import CodecError, build  # noqa: E402
from mmkv.codecs import qvg as Q  # noqa: E402
from mmkv.codecs.base import private_generator  # noqa: E402
from mmkv.codecs.packing import pack_bits, unpack_bits  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kv_like(shape, seed, dtype=torch.bfloat16) -> torch.Tensor:
    # a mean offset and a few large channels, like real keys
    x = torch.randn(*shape, generator=gen(seed)) * 1.5 + 0.2
    x[..., :: max(1, shape[-1] // 6)] *= 4.0
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# The independent computation (numpy fp32; fp64 cluster sums; torch only for the bf16 / E4M3 roundings)


def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).bfloat16().float().numpy()


def independent_qvg(x: torch.Tensor, *, seed, layer, k, iters, tol, bits, block, stages=1):
    """x [P, N, D] -> (reconstruction fp32, ids per stage, centres per stage, unsigned codes, E4M3 scales)."""
    work = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    p_count, n, d = x.shape
    r = x.to(work).float().numpy()
    ids_all, cents_all = [], []
    for stage in range(stages):
        idx = torch.randint(0, n, (p_count, k), generator=private_generator(seed, "qvg-kmeans-init", layer, stage))
        c = _bf16(np.stack([r[p][idx[p].numpy()] for p in range(p_count)]))
        prev = None
        for _ in range(iters):
            ids = np.empty((p_count, n), np.int64)
            new = c.copy()
            for p in range(p_count):
                xs, cs = r[p], c[p]
                dist = ((xs * xs).sum(1)[:, None] + (cs * cs).sum(1)[None, :]) - np.float32(2) * (xs @ cs.T)
                ids[p] = np.maximum(dist, 0).argmin(1)
                sums = np.zeros((k, d))
                np.add.at(sums, ids[p], xs.astype(np.float64))
                count = np.bincount(ids[p], minlength=k)
                new[p] = np.where(count[:, None] > 0, _bf16((sums / np.maximum(count, 1)[:, None]).astype(np.float32)),
                                  cs)
            if prev is not None and (ids != prev).mean() < tol:
                break  # pre-update centres with this iteration's ids
            c, prev = new, ids
        ids_all.append(ids)
        cents_all.append(c)
        r = torch.from_numpy(r - np.take_along_axis(c, ids[..., None], 1)).to(work).float().numpy()
    qmax = 2 ** (bits - 1) - 1
    rb = r.reshape(p_count, n, d // block, block)
    raw = np.minimum(np.maximum(np.abs(rb).max(-1) / np.float32(qmax), np.float32(1e-10)), np.float32(448))
    scales = torch.from_numpy(raw).to(torch.float8_e4m3fn)
    s = scales.float().numpy()[..., None]
    y = rb / np.where(s > 0, s, 1)
    a = np.abs(y)
    t = np.floor(a)
    q = np.where(s > 0, np.clip(np.sign(y) * (t + (a - t >= 0.5)), -qmax, qmax), 0)
    recon = (q * s).reshape(p_count, n, d).astype(np.float32)
    for st in range(stages):
        recon = recon + np.take_along_axis(cents_all[st], ids_all[st][..., None], 1)
    return recon, ids_all, cents_all, (q + qmax).reshape(p_count, n, d).astype(np.int64), scales


def _rel_err(recon: np.ndarray, x: torch.Tensor) -> float:
    xf = x.float().numpy()
    return float(((recon - xf) ** 2).sum() / (xf**2).sum())


# Step-by-step checks of one encode on its own k-means trajectory. They hold on any machine: everything compared
# exactly is elementwise IEEE arithmetic, order-independent maxima or exact fp64 sums; the one order-dependent
# quantity, the distance, is held to 1e-5 of (||x||^2 + ||c||^2), ~100x the fp32 rounding of the expansion.
NEAREST_RTOL = 1e-5


def traced_encode(codec, x: torch.Tensor, cluster=None, quantize=None):
    """`codec.encode_with(x, quantize, cluster)` (default: the reference's functions), recording every assignment
    as (points, centres, ids); the recording only reads the tensors, so the bytes are those of the plain encode."""
    trace = []
    enc = codec.encode_with(x, quantize or codec._quantize_reference, cluster or Q.kmeans, trace)
    enc.shape, enc.dtype, enc.codec = tuple(x.shape), x.dtype, str(codec.config)
    return enc, trace


def assert_nearest(points: np.ndarray, cents: np.ndarray, ids: np.ndarray) -> None:
    """Every id's distance (fp64, from the exact fp32 / bf16 inputs) is within NEAREST_RTOL of the nearest one."""
    x, c = points.astype(np.float64), cents.astype(np.float64)
    x_sq, c_sq = (x * x).sum(-1), (c * c).sum(-1)
    dist = x_sq[..., None] + c_sq[..., None, :] - 2 * np.matmul(x, np.swapaxes(c, -1, -2))
    chosen = np.take_along_axis(dist, ids[..., None], -1)[..., 0]
    gap = chosen - dist.min(-1)
    bound = NEAREST_RTOL * (x_sq + np.take_along_axis(c_sq, ids, -1))
    assert (gap <= bound).all(), f"{int((gap > bound).sum())} ids are not the nearest centre (worst gap {gap.max():g})"


def mean_update(points: np.ndarray, ids: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Cluster means in fp64 -> fp32 -> bf16; an empty cluster keeps its centre (the release's kmeans_euclid.py)."""
    p_count, k, d = old.shape
    new = old.copy()
    for p in range(p_count):
        sums = np.zeros((k, d))
        np.add.at(sums, ids[p], points[p].astype(np.float64))
        count = np.bincount(ids[p], minlength=k)
        new[p] = np.where(count[:, None] > 0, _bf16((sums / np.maximum(count, 1)[:, None]).astype(np.float32)), old[p])
    return new


def quantize_np(r: np.ndarray, bits: int, block: int, asymmetric: bool):
    """`Q.quantize_residual` written again in numpy: (codes int64, scales E4M3, zeros E4M3 or None, dequantised)."""
    p_count, n, d = r.shape
    rb = r.reshape(p_count, n, d // block, block)

    def e4m3(v):
        return torch.from_numpy(np.ascontiguousarray(np.clip(v, -448, 448), dtype=np.float32)).to(torch.float8_e4m3fn)

    def round_away(y):
        a = np.abs(y)
        t = np.floor(a)
        return np.sign(y) * (t + (a - t >= 0.5))

    if asymmetric:
        levels = 2**bits - 1
        mn, mx = rb.min(-1), rb.max(-1)
        scales, zeros = e4m3(np.maximum((mx - mn) / np.float32(levels), np.float32(1e-10))), e4m3(mn)
        s, z = scales.float().numpy()[..., None], zeros.float().numpy()[..., None]
        q = np.where(s > 0, np.clip(round_away((rb - z) / np.where(s > 0, s, 1)), 0, levels), 0).astype(np.float32)
        return q.reshape(p_count, n, d).astype(np.int64), scales, zeros, (q * s + z).reshape(p_count, n, d)
    qmax = 2 ** (bits - 1) - 1
    scales = e4m3(np.maximum(np.abs(rb).max(-1) / np.float32(qmax), np.float32(1e-10)))
    s = scales.float().numpy()[..., None]
    q = np.where(s > 0, np.clip(round_away(rb / np.where(s > 0, s, 1)), -qmax, qmax), 0).astype(np.float32)
    return (q + qmax).reshape(p_count, n, d).astype(np.int64), scales, None, (q * s).reshape(p_count, n, d)


def check_trace(codec, x4: torch.Tensor, enc, trace) -> np.ndarray:
    """Replay one encode of x4 [B, H, N, D] from its trace and assert each step; returns the reconstruction."""
    *lead, n, d = x4.shape
    p_count = int(np.prod(lead))
    assert d % codec.block == 0
    work = Q.work_dtype(x4.dtype)
    r = x4.reshape(p_count, n, d).to(work).float().numpy()
    stages = []
    for call in trace:  # one kmeans call per stage, every assignment of a stage on the same points tensor
        if not stages or call[0] is not stages[-1][0][0]:
            stages.append([])
        stages[-1].append(call)
    assert len(stages) == codec.stages
    centres = []  # C_s[id_s] per stage, which decode adds to the residual in stage order
    for st, calls in enumerate(stages):
        points = calls[0][0].float().numpy()
        assert np.array_equal(points, r), f"stage {st}: its points are not the previous stage's residual"
        idx = torch.randint(0, n, (p_count, codec.centroids),
                            generator=private_generator(codec.seed, "qvg-kmeans-init", codec.layer, st))
        assert np.array_equal(calls[0][1].float().numpy(), _bf16(np.take_along_axis(r, idx.numpy()[..., None], 1)))
        prev_ids = prev_c = None
        stop = False
        for i, (_, c_t, ids_t) in enumerate(calls):
            c, ids = c_t.float().numpy(), ids_t.numpy()
            assert not stop, f"stage {st}: an iteration ran after the early stop"
            assert_nearest(points, c, ids)
            if i:
                assert np.array_equal(c, mean_update(points, prev_ids, prev_c)), f"stage {st}, iteration {i}"
                stop = (ids != prev_ids).mean() < codec.tol
            prev_ids, prev_c = ids, c
        final = prev_c if stop else mean_update(points, prev_ids, prev_c)  # early stop: pre-update centres
        assert stop or len(calls) == codec.iters
        assert enc.meta["kmeans_iters"][st] == len(calls)
        assert np.array_equal(enc.tensors["ids"][st].reshape(p_count, n).long().numpy(), prev_ids)
        assert np.array_equal(enc.tensors["centroids"][st].reshape(p_count, -1, d).float().numpy(), final)
        gathered = np.take_along_axis(final, prev_ids[..., None], 1)
        r = torch.from_numpy(points - gathered).to(work).float().numpy()
        centres.append(gathered)
    codes, scales, zeros, recon = quantize_np(r, codec.bits, codec.block, codec.asymmetric)
    assert np.array_equal(unpack_bits(enc.tensors["codes"], codec.bits, n * d).reshape(p_count, n, d).numpy(), codes)
    assert torch.equal(enc.tensors["scales"].reshape(p_count, n, -1).view(torch.uint8), scales.view(torch.uint8))
    if zeros is not None:
        assert torch.equal(enc.tensors["zeros"].reshape(p_count, n, -1).view(torch.uint8), zeros.view(torch.uint8))
    for gathered in centres:
        recon = recon + gathered
    assert np.array_equal(codec.decode(enc, torch.float32).reshape(p_count, n, d).numpy(), recon)
    return recon


def _compare_with_independent(x4: torch.Tensor, preset: str, seed: int, layer: int):
    """Encode [B, H, N, D] with the codec; check it step by step (`check_trace`), and its reconstruction error against
    the free-running independent computation from the same init."""
    b, h, n, d = x4.shape
    codec = build(preset, head_dim=d, num_heads=h, seed=seed, layer=layer)
    enc = codec.encode(x4)
    traced, trace = traced_encode(codec, x4)
    assert all(torch.equal(enc.tensors[k].view(torch.uint8), traced.tensors[k].view(torch.uint8)) for k in enc.tensors)
    y = check_trace(codec, x4, enc, trace)
    recon, *_ = independent_qvg(
        x4.reshape(b * h, n, d), seed=seed, layer=layer, k=codec.centroids, iters=codec.iters, tol=codec.tol,
        bits=codec.bits, block=codec.block, stages=codec.stages,
    )
    x3 = x4.reshape(b * h, n, d)
    assert _rel_err(y, x3) == pytest.approx(_rel_err(recon, x3), rel=0.02)
    return codec, enc, _rel_err(y, x3)


# ----------------------------------------------------------------------------------------------------------------
# Acceptance: independent computation and bit accounting


def test_int2_4680_token_span_matches_independent_fp32_and_the_spec_bits():
    x = kv_like((1, 2, 4680, 128), seed=1)
    codec, enc, err = _compare_with_independent(x, "qvg:bits=2,centroids=256,block=64,stages=1", seed=5, layer=4)
    # Default setting: 2 + 8/64 + 8/128 + 256*16/4680 = 3.0627 bits per element, measured from the stored tensors
    assert enc.effective_bits == pytest.approx(2 + 0.125 + 0.0625 + 4096 / 4680, abs=1e-12)
    assert round(enc.effective_bits, 2) == 3.06 and codec.expected_bits(4680) == enc.effective_bits
    assert enc.nbytes == sum(t.numel() * t.element_size() for t in enc.tensors.values())
    assert {k: t.dtype for k, t in enc.tensors.items()} == {
        "codes": torch.uint8, "scales": torch.float8_e4m3fn, "ids": torch.uint8, "centroids": torch.bfloat16}
    assert enc.tensors["centroids"].shape == (1, 1, 2, 256, 128) and enc.tensors["ids"].shape == (1, 1, 2, 4680)
    assert 0.05 < err < 0.6  # ternary residuals after smoothing: lossy, far from useless


@pytest.mark.parametrize("preset, expect", [
    ("qvg:bits=4,centroids=256", 4 + 0.125 + 0.0625 + 4096 / 1560),
    ("qvg:bits=2,centroids=64,block=16,stages=2,asymmetric=true", 2 + 2 * 0.5 + 2 * 0.0625 + 2 * 64 * 16 / 1560),
])
def test_bits_follow_the_spec_formula(preset, expect):
    codec = build(preset, head_dim=128, num_heads=2)
    enc = codec.encode(kv_like((2, 1560, 128), seed=2))
    assert enc.effective_bits == pytest.approx(expect, abs=1e-12) == codec.expected_bits(1560)


def test_stages_and_fp32_input_match_independent_computation():
    # 1200 tokens: on 300, one near-tie flip moves a 10-point cluster's mean enough that two equally valid
    # trajectories end 2% apart in error (seen between torch's default and AVX2 paths); here they stay within 0.2%.
    x = kv_like((1, 2, 1200, 64), seed=3, dtype=torch.float32)
    _, enc, err2 = _compare_with_independent(x, "qvg:bits=2,centroids=32,block=32,stages=2,iters=4", seed=1, layer=0)
    _, _, err1 = _compare_with_independent(x, "qvg:bits=2,centroids=32,block=32,stages=1,iters=4", seed=1, layer=0)
    assert err2 < err1  # progressive residual quantisation: a second stage lowers the error
    assert enc.meta["kmeans_iters"] and all(1 <= i <= 4 for i in enc.meta["kmeans_iters"])


def _tiny_video_kv() -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of layer 1 after a 9-frame chunk-wise rollout of the tiny causal Wan DiT (8x12 latents: 24 tokens a
    frame), captured from a native store."""
    from mmkv.cache import CacheConfig, KVStore
    from mmkv.pipelines.common import NoiseStream
    from mmkv.pipelines.wan.loop import get_preset, rollout
    from mmkv.pipelines.wan.tiny import TINY_DIT, tiny_dit

    dit = tiny_dit(seed=3)
    store = KVStore(CacheConfig(codec=None), num_layers=TINY_DIT["num_layers"],
                    num_heads=TINY_DIT["num_attention_heads"], head_dim=TINY_DIT["attention_head_dim"])
    context = torch.randn(1, 16, TINY_DIT["text_dim"], generator=gen(11))
    with torch.no_grad(), store.attach(dit.transformer):
        rollout(dit, get_preset("causvid"), context, NoiseStream(0, 0), num_frames=9, latent_height=8,
                latent_width=12)
    return store.past(1)


def test_tiny_video_kv_matches_independent_fp32_computation():
    k, v = _tiny_video_kv()
    assert k.shape == (1, 2, 9 * 24, 32) and k.std() > 0.1 and v.std() > 0.1
    for x, layer in ((k, 1), (v, 1)):
        _, enc, err = _compare_with_independent(x, "qvg:bits=2,centroids=16,block=16", seed=0, layer=layer)
        assert err < 0.6
    _, _, err4 = _compare_with_independent(k, "qvg:bits=4,centroids=16,block=16", seed=0, layer=1)
    assert err4 < err  # INT4 residuals beat INT2


# ----------------------------------------------------------------------------------------------------------------
# Pieces: quantiser given ids and centres, k-means, packing layout, edge blocks


def test_quantiser_alone_is_exact_given_the_same_ids_and_centres():
    # Kernel against reference: feed identical ids and centres, compare codes and scales exactly
    r = kv_like((3, 50, 64), seed=4, dtype=torch.float32)
    for bits in (2, 4):
        codes, scales, zeros = Q.quantize_residual(r, bits, 32)
        assert zeros is None and scales.dtype == torch.float8_e4m3fn and scales.shape == (3, 50, 2)
        qmax = 2 ** (bits - 1) - 1
        rn = r.numpy().reshape(3, 50, 2, 32)
        raw = np.minimum(np.maximum(np.abs(rn).max(-1) / np.float32(qmax), np.float32(1e-10)), np.float32(448))
        want_s = torch.from_numpy(raw).to(torch.float8_e4m3fn)
        assert torch.equal(scales.view(torch.uint8), want_s.view(torch.uint8))
        s = want_s.float().numpy()[..., None]
        y = rn / s
        a = np.abs(y)
        want = np.clip(np.sign(y) * (np.floor(a) + (a - np.floor(a) >= 0.5)), -qmax, qmax) + qmax
        assert np.array_equal(codes.numpy(), want.reshape(3, 50, 64))
        assert codes.min() >= 0 and codes.max() <= 2 * qmax  # INT2 is ternary: code 3 never occurs
    # asymmetric (off by default): min-max over 2^b - 1 levels with an E4M3 zero point
    codes, scales, zeros = Q.quantize_residual(r, 2, 32, asymmetric=True)
    assert zeros is not None and codes.max() == 3
    back = Q.dequantize_residual(codes, scales, zeros, 2, 32)
    assert ((back - r) ** 2).sum() / (r**2).sum() < 0.4  # coarse E4M3 zero point


def test_kmeans_with_fixed_init_matches_lloyd():
    pts = kv_like((2, 200, 16), seed=5, dtype=torch.float32)
    init = pts[:, :8].to(torch.bfloat16)
    ids, cents, iters = Q.kmeans(pts, init, iters=50, tol=0.0)
    # a fixed point of Lloyd: every point sits with its nearest (bf16) centre and every non-empty centre is its
    # cluster's mean rounded to bf16
    assert_nearest(pts.numpy(), cents.float().numpy(), ids.numpy())
    for p in range(2):
        for c in ids[p].unique():
            mean = pts[p][ids[p] == c].double().mean(0).float().to(torch.bfloat16)
            assert torch.equal(cents[p, c], mean)
    # objective within 1e-3 of the released convergence rule's result at the same init
    ids2, cents2, it2 = Q.kmeans(pts, init, iters=50, tol=1e-4)
    obj = lambda i, c: float(((pts - Q.gather_centroids(c.float(), i)) ** 2).sum())  # noqa: E731
    assert obj(ids2, cents2) == pytest.approx(obj(ids, cents), rel=1e-3) and it2 <= iters


def test_empty_clusters_keep_their_centre_and_ties_go_low():
    pts = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [4.0, 4.0]]])
    init = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [5.0, 5.0]]], dtype=torch.bfloat16)  # duplicate centres: a tie
    ids, cents, _ = Q.kmeans(pts, init, iters=1, tol=0.0)
    assert ids.tolist() == [[0, 0, 2]]  # both zeros go to the lower of the tied centres
    assert torch.equal(cents[0, 1], init[0, 1])  # centre 1 got no point: kept
    assert cents[0, 2].tolist() == [4.0, 4.0]


def test_packing_layout_golden_vectors():
    # The project's one layout (little-endian stream, mmkv.codecs.packing), not the release's MSB-first bytes
    # (`quant_videogen/real/quant_pack.py`): same byte count, codes in the opposite order within a byte.
    assert pack_bits(torch.tensor([2, 1, 0, 2]), 2).tolist() == [0b10_00_01_10]
    assert pack_bits(torch.tensor([14, 0]), 4).tolist() == [0x0E]


def test_edge_blocks():
    r = torch.randn(1, 4, 64, generator=gen(6))
    r[0, 0, :32] = 0.0  # all-zero block
    r[0, 1, 32:] = 1e-4 * r[0, 1, 32:].sign()  # tiny block: scale 1e-4 rounds to E4M3 0 -> stores the zero code
    r[0, 2, :32] = 0.0
    r[0, 2, 0] = 2.0**-6  # absmax on the normal/subnormal E4M3 edge: scale exactly 2^-6 (qmax 1)
    r[0, 3, 32:] = 0.0
    r[0, 3, 32] = 500.0  # beyond the E4M3 range: the scale clamps to 448 (not NaN), the value clamps to +qmax
    codes, scales, _ = Q.quantize_residual(r, 2, 32)
    back = Q.dequantize_residual(codes, scales, None, 2, 32)
    assert scales[0, 0, 0].float() == 0 and (codes[0, 0, :32] == 1).all() and (back[0, 0, :32] == 0).all()
    assert scales[0, 1, 1].float() == 0 and (codes[0, 1, 32:] == 1).all() and (back[0, 1, 32:] == 0).all()
    assert scales[0, 2, 0].float() == 2.0**-6 and back[0, 2, 0] == 2.0**-6 and (back[0, 2, 1:32] == 0).all()
    assert scales[0, 3, 1].float() == 448.0 and back[0, 3, 32] == 448.0 and torch.isfinite(back).all()
    # tiny *residuals* under real centres: the whole span decodes to the centres, never NaN
    codec = build("qvg:centroids=4,block=32", head_dim=64, num_heads=1)
    x = torch.full((12, 64), 3.0)
    x[::2] += 1e-5
    y = codec.decode(codec.encode(x), torch.float32)
    assert torch.isfinite(y).all() and (y - x).abs().max() < 1e-3


def test_round_half_away_from_zero():
    y = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, 0.49999997, -0.49999997, 0.0, -0.0])
    assert Q.round_half_away(y).tolist() == [1.0, -1.0, 2.0, -2.0, 3.0, 0.0, -0.0, 0.0, -0.0]


# ----------------------------------------------------------------------------------------------------------------
# Seeds, determinism, dtypes, errors


def test_private_generator_determinism_and_seed_dependence():
    x = kv_like((2, 2, 90, 32), seed=7)
    state = torch.random.get_rng_state()
    a = build("qvg:centroids=16,block=16", head_dim=32, num_heads=2, seed=3, layer=1).encode(x)
    b = build("qvg:centroids=16,block=16", head_dim=32, num_heads=2, seed=3, layer=1).encode(x)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG never moves
    assert all(torch.equal(a.tensors[k].view(torch.uint8), b.tensors[k].view(torch.uint8)) for k in a.tensors)
    c = build("qvg:centroids=16,block=16", head_dim=32, num_heads=2, seed=3, layer=2).encode(x)
    assert not torch.equal(a.tensors["centroids"], c.tensors["centroids"])  # init drawn per (seed, layer, stage)


def test_decode_casts_once_from_fp32():
    x = kv_like((2, 40, 32), seed=8)
    codec = build("qvg:bits=4,centroids=8,block=16", head_dim=32, num_heads=2)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.dtype == torch.bfloat16 and torch.equal(codec.decode(enc, torch.float32).to(torch.bfloat16), y)


@pytest.mark.parametrize("preset, match", [
    ("qvg:bits=3", "bits"), ("qvg:centroids=257", "centroids"), ("qvg:centroids=0", "centroids"),
    ("qvg:block=0", "block"), ("qvg:stages=-1", "stages"), ("qvg:iters=0", "iters"), ("qvg:tol=2", "tol"),
    ("qvg:asymmetric=2", "asymmetric"), ("qvg:span_units=-1", "span_units"),
])
def test_bad_parameters_are_refused(preset, match):
    with pytest.raises(CodecError, match=match):
        build(preset, head_dim=64)


def test_empty_span_is_refused():
    with pytest.raises(CodecError, match="at least one token"):
        build("qvg", head_dim=64).encode(torch.zeros(0, 64))


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (CPU), against the reference


def _kernels():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py: on CUDA the kernels run compiled elsewhere
        pytest.skip("interpreter tests: run with TRITON_INTERPRET=1")
    from triton.runtime.interpreter import InterpretedFunction

    names = ["common", "packing", "qvg_kmeans", "qvg_encode", "qvg_decode"]
    mods = {n: importlib.import_module(f"mmkv.kernels.{n}") for n in names}
    if not isinstance(mods["qvg_kmeans"]._step_kernel, InterpretedFunction):
        mods = {n: importlib.reload(mods[n]) for n in names}  # imported before the variable was set
    return mods


try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel tests skip
    triton = None

if triton is not None:

    @triton.jit
    def _e4m3_probe(v_ptr, val_ptr, bits_ptr, back_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        val, b = _E4M3_ROUND(tl.load(v_ptr + i))  # noqa: F821  (set by the test to the kernels' helpers)
        tl.store(val_ptr + i, val)
        tl.store(bits_ptr + i, b)
        tl.store(back_ptr + i, _E4M3_VALUE(b))  # noqa: F821


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype, preset", [
    (torch.bfloat16, "qvg:bits=2,centroids=16,block=16"),
    (torch.float32, "qvg:bits=4,centroids=8,block=32,stages=2,asymmetric=true"),
    (torch.float16, "qvg:bits=2,centroids=20,block=32,stages=0"),
])
def test_kernels_encode_and_decode_match_reference(dtype, preset):
    k = _kernels()
    codec = build(preset, head_dim=32, num_heads=3, seed=1, layer=2)
    assert k["qvg_encode"].supports(codec)
    x = kv_like((2, 3, 45, 32), seed=9, dtype=dtype)  # 45 tokens: a partial token block
    ref = codec._encode(x)

    def fused(residual, last):
        return k["qvg_encode"].quant_pack(codec, residual, last)

    # The fused subtract + quantise + pack kernel on the reference's own k-means (torch computed ids and centres for
    # both sides): codes, scales and zeros bit for bit.
    same_ids = codec.encode_with(x, fused)
    assert ref.tensors.keys() == same_ids.tensors.keys()
    for key in ref.tensors:
        assert _same(ref.tensors[key], same_ids.tensors[key]), key
    # The whole kernel encode, the k-means kernels included: their norms and dot products sum in another order than
    # torch's, so ids may differ from the reference's at near-ties; each step is the algorithm's, checked on its own
    # trajectory.
    ker = k["qvg_encode"].encode(codec, x)
    traced, trace = traced_encode(codec, x, k["qvg_kmeans"].kmeans, fused)
    assert ker.tensors.keys() == ref.tensors.keys()
    # Both name the codec as `Codec.encode` does, so a bundle reads the same from either path (the GPU check
    # compares them).
    assert ker.codec == ref.codec == str(codec.config) and ker.meta == ref.meta
    for key, t in ker.tensors.items():
        assert _same(t, traced.tensors[key]) and (t.shape, t.dtype) == (ref.tensors[key].shape, ref.tensors[key].dtype)
    check_trace(codec, x, traced, trace)
    ref.shape, ref.dtype, ref.codec = tuple(x.shape), dtype, str(codec.config)
    for out in (dtype, torch.float32):
        assert torch.equal(k["qvg_decode"].decode(codec, ref, out), codec._decode(ref).to(out))
    buf = torch.zeros(2, 3, 50, 32, dtype=dtype)  # into a token slice of a gather buffer, as attention passes it
    k["qvg_decode"].decode(codec, ref, dtype, out=buf[..., 5:, :])
    assert torch.equal(buf[..., 5:, :], codec._decode(ref).to(dtype)) and not buf[..., :5, :].any()


@pytest.mark.parametrize("preset, batch", [("qvg:bits=2,centroids=8,block=16", 2), ("qvg:bits=4,block=16,stages=2", 1)])
def test_stacked_spans_decode_straight_into_token_order(preset, batch):
    """Commit spans of equal length stack as rows (`stack_units` with `stack_axes`: the per-stage ids and centres on
    their axis 2), and the decode kernel writes the stack [B, n, H, T, D] into the token-ordered gather slice
    [B, H, n * T, D] (the view `mmkv.attention.gather` passes): bit for bit each span's reference decode, and nothing
    outside the slice."""
    from mmkv.codecs.base import stack_units

    k = _kernels()
    codec = build(preset, head_dim=32, num_heads=2, seed=3)
    assert codec.stackable and codec.stack_axes == {"ids": 2, "centroids": 2}
    g = torch.Generator().manual_seed(12)
    parts = [codec.encode(torch.randn(batch, 2, 20, 32, generator=g).to(torch.bfloat16)) for _ in range(3)]
    stacked = stack_units(parts, codec.stack_axes)
    assert stacked.shape == (batch, 3, 2, 20, 32) and stacked.nbytes == sum(p.nbytes for p in parts)
    want = torch.cat([codec._decode(p).to(torch.bfloat16) for p in parts], dim=2)
    assert torch.equal(codec._decode(stacked).to(torch.bfloat16).transpose(1, 2).reshape(batch, 2, 60, 32), want)
    buf = torch.full((batch, 2, 5 + 60 + 4, 32), 7.0, dtype=torch.bfloat16)
    dst = buf[..., 5:65, :]
    got = k["qvg_decode"].decode(codec, stacked, torch.bfloat16, out=dst.view(batch, 2, 3, 20, 32).transpose(1, 2))
    assert got.data_ptr() == dst.data_ptr()
    assert torch.equal(dst, want)
    assert (buf[..., :5, :] == 7).all() and (buf[..., 65:, :] == 7).all()


def test_kernel_assignment_matches_reference_and_e4m3_helpers_match_torch():
    k = _kernels()
    pts = kv_like((2, 70, 64), seed=10, dtype=torch.float32)
    cents = pts[:, ::5].to(torch.bfloat16) + 0.01
    trace = []
    k["qvg_kmeans"].kmeans(pts, cents, 1, 0.0, trace)
    ids_k = trace[0][2]
    ids_r = Q.assign_reference(pts, cents, Q.sq_norms(pts), Q.sq_norms(cents))
    assert ids_k.dtype == torch.uint8
    assert (ids_k.long() == ids_r).float().mean() >= 0.99  # only summation-order near-ties may differ
    assert_nearest(pts.numpy(), cents.float().numpy(), ids_k.long().numpy())
    # E4M3 by hand (round to nearest even, subnormals, +-448) == torch's cast, both ways
    globals().update(_E4M3_ROUND=k["qvg_encode"].e4m3_round, _E4M3_VALUE=k["qvg_decode"].e4m3_value)
    v = (torch.randn(1024, generator=gen(12)) * torch.logspace(-5, 2.7, 1024)).clamp(-448, 448)
    v[:8] = torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-10, 1.5 * 2.0**-9, 2.0**-6, 240.0])
    val, bits, back = torch.empty(1024), torch.empty(1024, dtype=torch.int32), torch.empty(1024)
    _e4m3_probe[(1,)](v, val, bits, back, N=1024)
    want = v.to(torch.float8_e4m3fn)
    assert torch.equal(bits, want.view(torch.uint8).int()) and torch.equal(val, want.float())
    assert torch.equal(back, want.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_centre_update_is_the_reference_bit_for_bit(dtype):
    """The fp64 sums are exact, so the kernels' atomic adds give the reference's means of the same ids whatever their
    order: centres (bf16) equal, empty clusters keep their old centre, a partial token block and a 64-d head; and
    the sums buffer is zeroed for the next iteration (a second iteration's centres are the means of its own ids)."""
    k = _kernels()
    pts = kv_like((3, 150, 64), seed=14, dtype=dtype)
    old = kv_like((3, 16, 64), seed=16, dtype=torch.bfloat16)
    old[:, 12:] += 1e3  # centres 12-15 are never the nearest anywhere
    trace = []
    ids, got, iters = k["qvg_kmeans"].kmeans(pts, old, 2, 0.0, trace)
    assert iters == 2 and len(trace) == 2 and got.dtype == torch.bfloat16
    first, _ = Q.update_centroids(pts, trace[0][2].long(), old)
    assert torch.equal(trace[1][1], first)  # iteration 1's centres: the means of iteration 0's ids
    want, counts = Q.update_centroids(pts, ids.long(), first)
    assert torch.equal(got, want)  # tol 0 never stops: the last ids with their means
    assert (counts[:, 12:] == 0).all() and torch.equal(got[:, 12:], old[:, 12:])


@pytest.mark.parametrize("iters, tol", [(2, 1.0), (3, 1.0), (3, 0.0), (1, 0.5)])
def test_kernel_kmeans_stops_like_the_reference(iters, tol):
    """The early stop on the kernels: the changed-ids count against `stop_limit` (tol 1: the second iteration always
    stops and keeps its pre-update centres, on the device at the last iteration or read on the host before it), the
    same trajectory as the reference's on points whose assignment has no near-ties."""
    k = _kernels()
    g = gen(17)
    centres = torch.randn(2, 4, 32, generator=g) * 10
    pts = (centres[:, torch.arange(40) % 4] + 0.1 * torch.randn(2, 40, 32, generator=g)).to(torch.bfloat16)
    init = pts[:, :4].clone()
    tk, tr = [], []
    ids_k, c_k, it_k = k["qvg_kmeans"].kmeans(pts, init, iters, tol, tk)
    ids_r, c_r, it_r = Q.kmeans(pts, init, iters, tol, tr)
    assert it_k == it_r == len(tk) == len(tr) == (min(iters, 2) if tol == 1.0 else iters)
    assert torch.equal(ids_k.long(), ids_r) and torch.equal(c_k, c_r)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(tk, tr))


def test_stop_limit_is_the_fraction_rule_as_a_count():
    for total in (1, 7, 49, 4680, 56160):
        for tol in (0.0, 1e-4, 0.013, 0.5, 1.0):
            limit = Q.stop_limit(total, tol)
            assert all((c / total < tol) == (c < limit) for c in range(total + 1) if abs(c - limit) < 3 or c % 97 == 0)
    assert Q.stop_limit(100, 0.0) == 0 and Q.stop_limit(100, 1.0) == 100


def test_dispatch_lists_the_qvg_kernels(monkeypatch):
    """On CUDA (or under the interpreter) `Codec.encode/decode` of qvg run the Triton kernels; parameters the kernels
    do not cover (a head dim that is not a power of two) fall back to the reference."""
    k = _kernels()
    from mmkv.kernels import dispatch

    codec = build("qvg:bits=2,centroids=16,block=16", head_dim=32, num_heads=3)
    assert dispatch.lookup("encode", codec) is k["qvg_encode"].encode
    assert dispatch.lookup("decode", codec) is k["qvg_decode"].decode
    assert dispatch.lookup("encode", build("qvg:block=16", head_dim=48)) is None
    monkeypatch.setenv("MMKV_KERNELS", "0")
    assert dispatch.lookup("decode", codec) is None


def test_released_two_iterations_read_nothing_on_the_host(monkeypatch):
    """With the released 2 iterations the last (and only) stop decision just picks a centre table, on the device: an
    encode inside the store's scope reads no tensor value on the host (no host sync on CUDA), and the result is the
    early-stop rule's (checked step by step in `check_trace` above)."""
    from mmkv.codecs.checks import encode_scope

    codec = build("qvg:bits=2,centroids=16,block=32", head_dim=32, num_heads=2, seed=2)
    x = kv_like((1, 2, 96, 32), seed=8)
    want = codec.encode(x)
    reads = []
    for name in ("item", "__bool__", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a))
    with encode_scope(inputs_checked=True, collect=True):
        got = codec.encode(x)
    monkeypatch.undo()
    assert reads == [] and got.meta == want.meta == {"kmeans_iters": [2]}
    assert all(torch.equal(got.tensors[k].view(torch.uint8), want.tensors[k].view(torch.uint8)) for k in want.tensors)
