"""OCTOPUS and OCTOPUS-QJL (OCTOPUS paper, sections 3 and 4.1): codebooks, storage, quality, estimator."""

import json
import math

import numpy as np
import pytest
import torch

from mmkv.codecs import CodecError, build, codebooks
from mmkv.codecs import octopus as oct_mod
from mmkv.codecs.base import private_generator
from mmkv.codecs.lloyd import quantizer_mse

# Reference codebooks (OCTOPUS paper, section 3.4; pooled, implementation-matched, 100k vectors).
# d = 128: positive half of C_xi.
SPEC_XI = {
    (128, 3): [0.14420, 0.38536, 0.61701, 0.85757],
    (128, 4): [0.07199, 0.20211, 0.32397, 0.44182, 0.55870, 0.67647, 0.79814, 0.92805],
    (128, 5): [0.03687, 0.10544, 0.17068, 0.23361, 0.29469, 0.35456, 0.41374, 0.47251, 0.53116, 0.58990, 0.64878,
               0.70830, 0.76891, 0.83136, 0.89621, 0.96414],
    (64, 3): [-0.86903, -0.59879, -0.33800, -0.05890, 0.20186, 0.43065, 0.65478, 0.89138],
    (64, 4): [-0.94957, -0.80660, -0.67416, -0.54604, -0.41876, -0.28982, -0.15520, -0.00859, 0.12551, 0.24809,
              0.36462, 0.47878, 0.59252, 0.70783, 0.82769, 0.95704],
    (64, 5): [-0.98400, -0.91144, -0.84263, -0.77670, -0.71259, -0.64960, -0.58734, -0.52559, -0.46400, -0.40212,
              -0.33969, -0.27654, -0.21183, -0.14520, -0.07531, -0.00123, 0.06823, 0.13407, 0.19695, 0.25770, 0.31696,
              0.37530, 0.43315, 0.49083, 0.54876, 0.60705, 0.66589, 0.72545, 0.78629, 0.84945, 0.91566, 0.98527],
}
# Entry-wise tolerance: 1e-3, except where Monte-Carlo noise of a 100k-vector reference is itself
# larger (many levels on a near-flat density: two independent 100k-vector draws differ by up to ~3e-3 there; see
# docs/decisions.md). Those codebooks are also held to equal distortion below.
XI_TOL = {(128, 3): 1e-3, (128, 4): 1e-3, (128, 5): 2e-3, (64, 3): 1e-3, (64, 4): 3e-3, (64, 5): 3e-3}
SPEC_RHO = {
    (128, 1): [0.09994, 0.19659],
    (128, 2): [0.06911, 0.12380, 0.17788, 0.24673],
    (128, 3): [0.04681, 0.08111, 0.11043, 0.13853, 0.16746, 0.19929, 0.23752, 0.29212],
    (64, 1): [0.13548, 0.27336],
    (64, 2): [0.08818, 0.16824, 0.24535, 0.34158],
    (64, 3): [0.05262, 0.10486, 0.14798, 0.18867, 0.23005, 0.27499, 0.32817, 0.40247],
}
SPEC_E_RHO = {128: 0.14062, 64: 0.19567}


def _keys(n, d, label, seed=0, heads=None):
    g = private_generator(seed, "test-octopus", label)
    shape = (n, d) if heads is None else (heads, n, d)
    return torch.randn(*shape, generator=g)


def _rel_mse(k, k_hat):
    return (((k - k_hat) ** 2).sum(-1) / (k**2).sum(-1)).mean().item()


# -- codebooks -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,bits", sorted(SPEC_XI))
def test_xi_codebook_matches_spec_table(d, bits):
    c = codebooks.load("octopus", f"d{d}_xi{bits}").double().numpy()
    assert c.size == 2**bits and np.all(np.diff(c) > 0)
    ours = c[c.size // 2 :] if d == 128 else c
    np.testing.assert_allclose(ours, SPEC_XI[(d, bits)], atol=XI_TOL[(d, bits)], rtol=0)
    if d == 128:  # symmetric to ~1e-3 at d = 128 (d mod 3 = 2), and not symmetrised by us
        assert np.abs(c + c[::-1]).max() < 2e-3
    else:  # d = 64: the padded triplet's point masses make the optimum lopsided (paper section 3.4)
        assert np.abs(c + c[::-1]).max() > 0.02


@pytest.mark.parametrize("d,bits", sorted(SPEC_RHO))
def test_rho_codebook_matches_spec_table(d, bits):
    c = codebooks.load("octopus", f"d{d}_rho{bits}").double().numpy()
    np.testing.assert_allclose(c, SPEC_RHO[(d, bits)], atol=1e-3, rtol=0)


@pytest.mark.parametrize("d", [128, 64])
def test_rho_constant_for_zero_bits_is_pooled_mean(d):
    c = codebooks.load("octopus", f"d{d}_rho0")
    assert c.numel() == 1 and abs(float(c[0]) - SPEC_E_RHO[d]) < 5e-4


def test_xi_codebooks_have_the_reference_distortion():
    """On fresh pooled xi samples (independent of training), ours and the reference lists quantise equally well."""
    for d in (128, 64):
        g = np.random.default_rng(12345 + d)
        u = g.standard_normal((6000, d))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        t = torch.from_numpy(np.pad(u, ((0, 0), (0, 3 * oct_mod.n_triplets(d) - d)))).view(6000, -1, 3)
        xi, eta = oct_mod.oct_encode(t)
        samples = np.concatenate([xi.numpy().ravel(), eta.numpy().ravel()])
        for bits in (3, 4, 5):
            ref = np.array(SPEC_XI[(d, bits)])
            ref = np.concatenate([-ref[::-1], ref]) if d == 128 else ref
            ours = codebooks.load("octopus", f"d{d}_xi{bits}").double().numpy()
            mse_ours, mse_ref = quantizer_mse(samples, ours), quantizer_mse(samples, ref)
            assert abs(mse_ours / mse_ref - 1) < 2e-3, (d, bits, mse_ours, mse_ref)


def test_codebooks_rebuild_within_tolerance():
    shipped = json.loads((codebooks.DATA_DIR / "octopus.json").read_text())["codebooks"]
    assert set(shipped) == set(oct_mod.codebook_keys())
    oct_mod.marginal_samples.cache_clear()
    keys = ("d16_xi3", "d16_xi7", "d16_rho2", "d16_rho0", "d32_xi4", "d32_rho1")  # the CLI --check does all
    fresh = {key: oct_mod.octopus_codebook(key) for key in keys}
    assert codebooks.differences(fresh, {key: shipped[key] for key in keys}) == []
    oct_mod.marginal_samples.cache_clear()


# -- storage -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,expected", [(2, 2.602), (3, 3.609), (4, 4.617)])
def test_effective_bits_are_the_spec_formula(b, expected):
    d, T = 128, 1024
    for norm, n_gamma in ((32, 32), (16, 16)):
        codec = build(f"octopus:b={b},norm={norm},joint=0", head_dim=d)  # joint rounding leaves the format alone
        enc = codec.encode(_keys(T, d, f"bits{b}"))
        real = sum(t.numel() * t.element_size() for t in enc.tensors.values())
        formula_bits = ((3 * b + 1) * math.ceil(d / 3) + n_gamma) * T
        assert enc.nbytes == real == codec.nbytes(enc) == formula_bits // 8
        assert enc.effective_bits == formula_bits / (T * d)
        if norm == 32:
            assert round(enc.effective_bits, 3) == expected
        elif b == 2:
            assert round(enc.effective_bits, 3) == 2.477
    qjl = build(f"octopus-qjl:b={b}", head_dim=d).encode(_keys(T, d, "qjl-bits"))
    assert qjl.effective_bits == pytest.approx(((3 * b + 1) * 43 + 32) / d + (d + 16) / d, abs=1e-12)


def test_d64_bits_and_planar_layout():
    enc = build("octopus:b=3", head_dim=64, num_heads=2).encode(_keys(16, 64, "d64", heads=2))
    assert enc.effective_bits == pytest.approx(3.938, abs=1e-3)
    assert enc.tensors["dir"].dtype == torch.uint8 and enc.tensors["dir"].shape == (2, 16 * 22)  # 8-bit codes at b=3
    assert enc.tensors["rho"].shape == (2, 16 * 22 * 2 // 8)
    assert enc.tensors["gamma"].dtype == torch.float32 and enc.tensors["gamma"].shape == (2, 16)
    enc1 = build("octopus:b=1", head_dim=64).encode(_keys(16, 64, "d64"))
    assert "rho" not in enc1.tensors  # 0 rho bits: the constant E[rho], nothing stored


# -- round trip, heads, rotated domain -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["octopus", "octopus-qjl"])
def test_round_trip_shape_dtype_heads(name):
    codec = build(f"{name}:b=3", head_dim=64, num_heads=4, layer=2, seed=7)
    x = _keys(32, 64, "rt", heads=4).unsqueeze(0).repeat(2, 1, 1, 1).to(torch.bfloat16)  # [B, H, T, D]
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.device == x.device
    assert codec.decode(enc, torch.float32).dtype == torch.float32
    assert _rel_mse(x.float(), y.float()) < 0.04
    # each head has its own signs: the same vectors in two heads give different codes
    same = _keys(32, 64, "same").expand(4, 32, 64)
    codes = build(f"{name}:b=3", head_dim=64, num_heads=4).encode(same).tensors["dir"]
    assert not torch.equal(codes[0], codes[1])
    with pytest.raises(CodecError, match="heads"):
        codec.encode(_keys(8, 64, "rt", heads=3))


@pytest.mark.parametrize("name", ["octopus", "octopus-qjl"])
def test_rotated_domain_score_and_value_paths(name):
    codec = build(f"{name}:b=2", head_dim=128, num_heads=2, seed=3)
    k, q = _keys(64, 128, "k", heads=2), _keys(5, 128, "q", heads=2)
    enc = codec.encode(k)
    k_hat = codec.decode(enc, torch.float32)
    torch.testing.assert_close(codec.unrotate(codec.decode_rotated(enc)), k_hat, atol=1e-5, rtol=1e-5)
    ref = q @ k_hat.transpose(-1, -2)
    torch.testing.assert_close(codec.scores(q, enc), ref, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(codec.rotate_query(q) @ codec.decode_rotated(enc).transpose(-1, -2), ref, atol=2e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["octopus", "octopus-qjl"])
def test_cuda_matches_cpu(name):
    """The Triton kernels on CUDA against the CPU reference. Head dim 32 keeps the compile short (the encoder unrolls
    its triplet loops over D: ~70 s at D = 128, minutes with QJL); D = 128 is compared under the interpreter
    (tests/test_kernels_codec.py) and runs on CUDA in tests/test_cuda_memory.py. bf16 keys of 263 tokens in 2 heads
    compile the same specialisations as tests/test_codecs_common.py's CUDA round trip, which then reuses them."""
    from mmkv.codecs.packing import unpack_bits

    d, t = 32, 263
    codec = build(f"{name}:b=3", head_dim=d, num_heads=2)
    x = _keys(t, d, "cuda", heads=2).to(torch.bfloat16)
    cpu, gpu = codec.encode(x), codec.encode(x.cuda())
    assert gpu.device.type == "cuda" and codec.decode(gpu).device.type == "cuda"
    assert list(gpu.tensors) == list(cpu.tensors)
    gpu_cpu = gpu.to("cpu")
    # gamma = ||k|| sums d squares in another order on each device: a sum in any order, then a square root, lie
    # (d + 1) unit roundoffs apart at most (27-62% of the norms differ in their last bits on an H200)
    torch.testing.assert_close(gpu_cpu.tensors["gamma"], cpu.tensors["gamma"], rtol=(d + 1) * 2.0**-24, atol=0)

    def codes(enc, key, width, per_token):
        return unpack_bits(enc.tensors[key], width, t * per_token).reshape(2, t, per_token)

    # A code moves only where u or the norm lands within rounding of a cell boundary: a few tokens at most.
    moved = torch.zeros(2, t, dtype=torch.bool)
    for key, width in (("dir", 2 * codec.dir_bits), ("rho", codec.rho_bits)):
        moved |= (codes(gpu_cpu, key, width, codec.n_t) != codes(cpu, key, width, codec.n_t)).any(-1)
    assert int(moved.sum()) <= 2, f"codes of {int(moved.sum())} of {2 * t} tokens differ"
    if name == "octopus-qjl":  # on the other tokens the residual's signs and fp16 norm agree up to rounding
        flips = codes(gpu_cpu, "qjl", 1, d) != codes(cpu, "qjl", 1, d)
        assert int(flips[~moved].sum()) <= 2
        far = ~torch.isclose(gpu_cpu.tensors["rnorm"].float(), cpu.tensors["rnorm"].float(), rtol=2.0**-10, atol=0)
        assert int(far[~moved].sum()) <= 2
    # the decode kernel on the GPU's bytes against the reference decode of the same bytes, then the two encodings
    torch.testing.assert_close(codec.decode(gpu, torch.float32).cpu(), codec.decode(gpu_cpu, torch.float32),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(codec.decode(gpu).cpu(), codec.decode(cpu), atol=0.05, rtol=0)


# -- determinism, seeds, bad input, zeros --------------------------------------------------------------------------


def test_deterministic_and_seed_dependent_and_no_global_rng():
    x = _keys(128, 128, "det")
    state = torch.get_rng_state()
    a = build("octopus-qjl:b=2", head_dim=128, seed=1).encode(x)
    b = build("octopus-qjl:b=2", head_dim=128, seed=1).encode(x)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    c = build("octopus-qjl:b=2", head_dim=128, seed=2).encode(x)
    d = build("octopus-qjl:b=2", head_dim=128, seed=1, layer=1).encode(x)
    assert not torch.equal(a.tensors["dir"], c.tensors["dir"]) and not torch.equal(a.tensors["dir"], d.tensors["dir"])
    q = build("octopus-qjl:b=2", head_dim=128, seed=1)
    assert not torch.equal(q.rotation.signs, q.sketch.signs)  # R' has its own seed stream


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(CodecError, match="power-of-two"):
        build("octopus:b=3", head_dim=96)
    for bad in ("b=0", "b=6", "b=2.5", "joint=2", "norm=8", "dir=9", "rho=7", "dir=x"):
        with pytest.raises(CodecError, match="unsupported"):
            build(f"octopus:{bad}", head_dim=64)
    with pytest.raises(CodecError, match="no parameter"):
        build("octopus:bitz=3", head_dim=64)
    codec = build("octopus:b=3", head_dim=64)
    x = _keys(4, 64, "nan")
    x[1, 5] = float("nan")
    with pytest.raises(CodecError, match="NaN"):
        codec.encode(x)
    with pytest.raises(CodecError, match="head dim"):
        codec.encode(_keys(4, 32, "dim"))
    enc = build("octopus:b=2", head_dim=64).encode(_keys(4, 64, "other"))
    with pytest.raises(CodecError, match="cannot decode"):
        codec.decode(enc)
    with pytest.raises(CodecError, match="fp16"):
        build("octopus:b=3,norm=16", head_dim=64).encode(_keys(4, 64, "big") * 1e5)


@pytest.mark.parametrize("preset", ["octopus:b=1", "octopus:b=3,joint=0", "octopus-qjl:b=2", "octopus:b=2,norm=16"])
def test_zero_vectors_decode_to_zero(preset):
    codec = build(preset, head_dim=64)
    x = _keys(8, 64, "zeros")
    x[[0, 5]] = 0.0
    enc = codec.encode(x)
    y = codec.decode(enc, torch.float32)
    assert torch.isfinite(y).all() and (y[[0, 5]] == 0).all() and (y[1].abs() > 0).any()
    assert torch.isfinite(codec.scores(_keys(3, 64, "zq"), enc)).all()


# -- quality: reduced Table 1, App. D/E analogues, QJL unbiasedness -------------------------------------------------


def _table1(preset, seeds=8, d=128):
    """OCTOPUS paper, section 4.1: n = 1024 Gaussian keys per seed, a fresh codec seed each; returns (relative MSE,
    IP error). The IP error E|q.k - q.k_hat| over Gaussian queries q ~ N(0, I) is exactly sqrt(2/pi) ||k - k_hat||,
    so it is taken in closed form rather than over 16 sampled queries, whose norms alone make an 8-seed mean wander
    by +-0.02 at b = 2 (the 64-seed, 16-query estimate of this codec is 2.697 +- 0.007)."""
    mse = ip = 0.0
    for seed in range(seeds):
        k = _keys(1024, d, "t1k", seed)
        codec = build(preset, head_dim=d, seed=seed)
        k_hat = codec.decode(codec.encode(k))
        mse += _rel_mse(k, k_hat)
        ip += math.sqrt(2 / math.pi) * (k - k_hat).norm(dim=-1).mean().item()
    return mse / seeds, ip / seeds


def test_reduced_table1_no_joint_reproduces_quoted_cells():
    mse, ip = _table1("octopus:b=2,joint=0")
    assert abs(mse - 0.0897) < 0.002 and abs(ip - 2.682) < 0.03, (mse, ip)
    mse, ip = _table1("octopus:b=4,joint=0")
    assert abs(mse - 0.0071) < 0.0003 and abs(ip - 0.753) < 0.01, (mse, ip)


def test_sampled_queries_agree_with_the_closed_form_ip_error():
    k, q = _keys(1024, 128, "t1k", 0), _keys(256, 128, "t1q-many", 0)
    codec = build("octopus:b=2", head_dim=128)
    enc = codec.encode(k)
    sampled = (q @ k.T - codec.scores(q, enc)).abs().mean().item()
    closed = math.sqrt(2 / math.pi) * (k - codec.decode(enc)).norm(dim=-1).mean().item()
    assert abs(sampled / closed - 1) < 0.02  # 256 query norms: standard error ~0.4%


@pytest.mark.parametrize("b", [2, 4])
def test_joint_rounding_lowers_mse_5_to_10_percent(b):
    plain, _ = _table1(f"octopus:b={b},joint=0", seeds=3)
    joint, _ = _table1(f"octopus:b={b},joint=1", seeds=3)
    assert 0.90 < joint / plain < 0.95, (plain, joint)


def test_bit_split_override_and_optimality():
    """OCTOPUS paper App. D analogue: (b+1, b-1) beats the uniform (b, b) split by 31-41% (section 3.3) and
    (b+2, b-2) too (d=128, b=3)."""
    k = _keys(1024, 128, "split")
    mse = {}
    for dir_bits, rho_bits in ((4, 2), (3, 3), (5, 1)):
        codec = build(f"octopus:b=3,joint=0,dir={dir_bits},rho={rho_bits}", head_dim=128)
        enc = codec.encode(k)
        assert enc.nbytes == ((2 * dir_bits + rho_bits) * 43 * 1024 + 7) // 8 + 4 * 1024
        mse[dir_bits] = _rel_mse(k, codec.decode(enc))
    auto = build("octopus:b=3,joint=0", head_dim=128)  # dir/rho "auto" = (b+1, b-1)
    assert _rel_mse(k, auto.decode(auto.encode(k))) == mse[4]
    assert 0.55 < mse[4] / mse[3] < 0.70 and mse[4] < mse[5], mse  # measured 0.589: a 41% cut


def test_octopus_qjl_is_unbiased_and_octopus_is_not():
    """E[score] = q.k: the QJL-corrected score regresses on the true score with slope 1; plain OCTOPUS shrinks."""
    slopes = {}
    for name in ("octopus", "octopus-qjl"):
        true, est = [], []
        for seed in range(4):
            k, q = _keys(1024, 128, "ubk", seed), _keys(16, 128, "ubq", seed)
            codec = build(f"{name}:b=2", head_dim=128, seed=seed)
            true.append((q @ k.T).ravel())
            est.append(codec.scores(q, codec.encode(k)).ravel())
        t, e = torch.cat(true), torch.cat(est)
        slopes[name] = float((t * e).sum() / (t * t).sum())
        assert abs(float((e - t).mean())) < 0.05
    assert abs(slopes["octopus-qjl"] - 1) < 0.006, slopes  # standard error of the slope is ~0.002
    assert slopes["octopus"] < 0.95, slopes  # Lloyd-Max shrinkage: E[k_hat . k] = ||k_hat||^2 < ||k||^2


def test_octopus_qjl_seed_averaged_bias_vanishes_for_one_pair():
    """Fixed (q, k); over 256 codec seeds (independent R and R') the mean QJL score is q.k within 3 standard errors."""
    k, q = _keys(1, 128, "pair-k"), _keys(1, 128, "pair-q")
    truth = float(q @ k.T)
    scores = []
    for seed in range(256):
        codec = build("octopus-qjl:b=2", head_dim=128, seed=seed)
        scores.append(float(codec.scores(q, codec.encode(k))))
    est = torch.tensor(scores, dtype=torch.float64)
    assert abs(float(est.mean()) - truth) < 3 * float(est.std()) / 16, (truth, float(est.mean()))
