"""QJL (QJL paper, Def. 3.1): packed sign sketch + norm, the asymmetric unbiased estimator, and the matching decode."""

import math

import numpy as np
import pytest
import torch

from mmkv.codecs import CodecConfig, CodecError, build

D = 128


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits,norm", [(1, 32), (2, 32), (3, 16)])
def test_storage_is_bits_times_d_plus_norm(bits, norm):
    codec = build(f"qjl:bits={bits},norm={norm}", head_dim=D)
    x = gaussian(2, 3, 8, D, seed=1).to(torch.bfloat16)
    enc = codec.encode(x)
    assert set(enc.tensors) == {"signs", "norm"}
    assert enc.tensors["signs"].dtype == torch.uint8 and enc.tensors["signs"].shape == (2, 3, 8 * bits * D // 8)
    assert enc.tensors["norm"].dtype == (torch.float32 if norm == 32 else torch.float16)
    assert enc.nbytes == sum(t.numel() * t.element_size() for t in enc.tensors.values()) == 2 * 3 * 8 * (bits * D + norm) // 8
    assert enc.effective_bits == pytest.approx(bits + norm / D) and codec.bits_per_vector == bits * D + norm
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == torch.bfloat16


def test_signs_are_sign_of_gaussian_sketch():
    # Def. 3.1: bit j of a key is [ (S k)_j >= 0 ], S i.i.d. N(0, 1) of shape m x d with m = bits * d.
    codec = build("qjl:bits=2", head_dim=32, seed=3)
    assert codec.sketch.shape == (1, 64, 32)
    s = codec.sketch[0]
    assert abs(float(s.mean())) < 0.05 and float(s.std()) == pytest.approx(1.0, abs=0.05)
    k = gaussian(9, 32, seed=4)
    from mmkv.codecs.packing import unpack_bits

    bits = unpack_bits(codec.encode(k).tensors["signs"], 1, 9 * 64).view(9, 64)
    assert torch.equal(bits.bool(), (k @ s.T) >= 0)


def test_scores_are_the_paper_estimator_and_decode_matches_them():
    codec = build("qjl:bits=2", head_dim=64, num_heads=2, seed=5)
    k, q = gaussian(3, 2, 30, 64, seed=5), gaussian(3, 2, 4, 64, seed=6)
    enc = codec.encode(k)
    s = codec.scores(q, enc)
    assert s.shape == (3, 2, 4, 30)
    sk = torch.sign(k @ codec.sketch.transpose(-1, -2))
    inner = (q @ codec.sketch.transpose(-1, -2)) @ sk.transpose(-1, -2)  # <S q, sign(S k)>
    expect = math.sqrt(math.pi / 2) / 128 * k.norm(dim=-1).unsqueeze(-2) * inner
    torch.testing.assert_close(s, expect, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(s, q @ codec.decode(enc).transpose(-1, -2), rtol=1e-4, atol=1e-3)
    with pytest.raises(CodecError, match="KV heads"):
        codec.scores(gaussian(3, 1, 4, 64), enc)


def test_estimator_is_unbiased_over_sketches():
    # Lemma 3.2: for one fixed (q, k), the mean over independent S of the estimate is q.k.
    k = gaussian(1, 64, seed=7)
    q = k + 0.3 * gaussian(1, 64, seed=8)
    exact = float(q @ k.T)
    est = []
    for s in range(300):
        codec = build("qjl:bits=2", head_dim=64, seed=s)
        est.append(float(codec.scores(q, codec.encode(k))))
    mean, sem = np.mean(est) / exact, np.std(est) / exact / math.sqrt(len(est))
    assert abs(mean - 1) < max(4 * sem, 0.005), (mean, sem)
    # Lemma 3.5's spread: Var <= (pi/2)/m ||q||^2 ||k||^2.
    assert np.var(est) <= 1.2 * math.pi / 2 / 128 * float(q.norm() * k.norm()) ** 2


def test_table1_style_errors():
    # Reconstruction: E||k_hat - k||^2 / ||k||^2 = ((pi/2) d - 1)/m; IP error ~ sqrt(2/pi) sqrt(d * that).
    k, q = gaussian(1024, D, seed=9), gaussian(16, D, seed=10)
    codec = build("qjl:bits=2", head_dim=D, seed=1)
    enc = codec.encode(k)
    mse = float(((codec.decode(enc) - k).pow(2).sum(-1) / k.pow(2).sum(-1)).mean())
    assert mse == pytest.approx((math.pi / 2 * D - 1) / (2 * D), rel=0.03)
    ip = float((codec.scores(q, enc) - q @ k.T).abs().mean())
    assert ip == pytest.approx(math.sqrt(2 / math.pi) * math.sqrt(D * mse), rel=0.05)


def test_deterministic_seeded_per_head():
    x = gaussian(2, 2, 16, 64, seed=11)
    enc = build("qjl", head_dim=64, num_heads=2, seed=1, layer=4).encode(x)
    again = build("qjl", head_dim=64, num_heads=2, seed=1, layer=4).encode(x)
    assert all(torch.equal(enc.tensors[k], again.tensors[k]) for k in enc.tensors)
    assert not torch.equal(enc.tensors["signs"], build("qjl", head_dim=64, num_heads=2, seed=2, layer=4).encode(x).tensors["signs"])
    assert not torch.equal(enc.tensors["signs"], build("qjl", head_dim=64, num_heads=2, seed=1, layer=5).encode(x).tensors["signs"])
    codec = build("qjl", head_dim=64, num_heads=2, seed=1)
    assert not torch.equal(codec.sketch[0], codec.sketch[1])


def test_zero_vectors_and_non_pow2_dims():
    codec = build("qjl:bits=1", head_dim=80)  # no rotation, so any head dim works
    x = gaussian(5, 80, seed=12)
    x[3] = 0
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert torch.isfinite(y).all() and torch.equal(y[3], torch.zeros(80)) and (y[:3].abs().sum(-1) > 0).all()
    assert torch.equal(codec.scores(gaussian(2, 80), enc)[:, 3], torch.zeros(2))


@pytest.mark.parametrize(
    "preset,match", [("qjl:bits=0", "bits=0"), ("qjl:bits=9", "bits=9"), ("qjl:b=1.5", "bits=1.5"), ("qjl:norm=8", "norm=8")]
)
def test_bad_params_raise(preset, match):
    with pytest.raises(CodecError, match=match):
        build(preset, head_dim=D)


def test_presets_and_fp16_overflow():
    assert str(CodecConfig.parse("qjl")) == "qjl:bits=2,norm=32"
    assert CodecConfig.parse("qjl:b=3") == CodecConfig.parse("qjl:bits=3")
    with pytest.raises(CodecError, match="fp16"):
        build("qjl:norm=16", head_dim=D).encode(gaussian(4, D) * 1e4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    codec = build("qjl:bits=2", head_dim=D, num_heads=2, seed=13)
    x, q = gaussian(2, 2, 64, D, seed=13), gaussian(2, 2, 4, D, seed=14)
    enc = codec.encode(x.cuda())
    assert all(t.is_cuda for t in enc.tensors.values())
    agree = (enc.tensors["signs"].cpu() == codec.encode(x).tensors["signs"]).float().mean()
    assert agree > 0.99  # a sign exactly at 0 after a different matmul rounding is the only way to differ
    torch.testing.assert_close(codec.scores(q.cuda(), enc).cpu(), codec.scores(q, enc.to("cpu")), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(codec.decode(enc).cpu(), codec.decode(enc.to("cpu")), rtol=1e-4, atol=1e-4)
