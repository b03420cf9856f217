"""PolarQuant-R (arXiv 2502.02617): recursive polar transform of 16-blocks, level codebooks, byte counts."""

from __future__ import annotations

import math

import pytest
import torch

from mmkv.codecs import CodecConfig, CodecError, build, codebooks
from mmkv.codecs.base import kv_configs
from mmkv.codecs.polarquant import angle_codebook



def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x - y).square().sum(-1) / x.square().sum(-1)).mean())


# Exact Lloyd-Max on the PolarQuant paper's level densities (Lemma 2) at L = 4.
SPEC_CENTROIDS = {
    (2, 2): [0.30976, 0.63398, 0.93682, 1.26104],
    (3, 2): [0.42625, 0.67438, 0.89641, 1.14455],
    (4, 2): [0.52421, 0.70591, 0.86489, 1.04658],
    (2, 3): [0.18845, 0.38, 0.54825, 0.70723, 0.86357, 1.02254, 1.1908, 1.38235],
    (3, 3): [0.30752, 0.47318, 0.60607, 0.72675, 0.84405, 0.96473, 1.09762, 1.26328],
    (4, 3): [0.42576, 0.55565, 0.6548, 0.74287, 0.82793, 0.916, 1.01515, 1.14504],
}


@pytest.mark.parametrize("level,bits", sorted(SPEC_CENTROIDS))
def test_shipped_codebooks_match_spec(level, bits):
    got = angle_codebook(level, bits).double()
    assert torch.allclose(got, torch.tensor(SPEC_CENTROIDS[(level, bits)], dtype=torch.float64), atol=1e-3)


def test_level1_codebook_is_uniform_midpoints_and_builder_reproduces_shipped():
    assert torch.allclose(angle_codebook(1, 4).double(), torch.tensor([(2 * k + 1) * math.pi / 16 for k in range(16)],
                                                                      dtype=torch.float64))
    shipped = codebooks._file("polarquant")["level3_b2"]
    fresh = codebooks.compute("polarquant", "level3_b2")
    assert codebooks.differences({"level3_b2": fresh}, {"level3_b2": shipped}) == []
    assert torch.equal(angle_codebook(3, 2), torch.tensor(shipped, dtype=torch.float64).float())  # what codecs load


ROUND_TRIP = [("polarquant:b=2", torch.float32), ("polarquant:levels=4222", torch.bfloat16)]


def _round_trip_cases() -> list:
    """Both presets in both dtypes on CPU; on CUDA (marked gpu) one dtype each, one compile set per preset."""
    cases = [pytest.param(p, dt, "cpu") for p, _ in ROUND_TRIP for dt in (torch.float32, torch.bfloat16)]
    if torch.cuda.is_available():
        cases += [pytest.param(p, dt, "cuda", marks=pytest.mark.gpu) for p, dt in ROUND_TRIP]
    return cases


@pytest.mark.parametrize("preset,dtype,device", _round_trip_cases())
def test_round_trip_shape_dtype_device(preset, dtype, device):
    x = torch.randn(2, 3, 37, 64, generator=gen(1)).to(device=device, dtype=dtype)
    codec = build(preset, head_dim=64, num_heads=3, layer=4, seed=11)
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert rel_mse(x.float(), out.float()) < 0.3
    assert enc.tensors["radius"].dtype == torch.float16 and enc.tensors["radius"].shape == (2, 3, 37, 4)


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_bits_per_coordinate_baseline(b):
    x = torch.randn(4, 40, 128, generator=gen(2))
    enc = build(f"polarquant:b={b}", head_dim=128).encode(x)
    assert enc.effective_bits == (15 * b + 16) / 16  # b bits on every level plus the fp16 radius
    assert enc.nbytes == sum(t.numel() * t.element_size() for t in enc.tensors.values())


def test_bits_per_coordinate_native():
    x = torch.randn(40, 64, generator=gen(3))
    enc = build("polarquant:levels=4222", head_dim=64).encode(x)
    assert enc.effective_bits == 3.875  # the paper's 4/2/2/2: 62 bits per 16-block


def test_gaussian_mse_matches_the_reproduction():
    # Reproduced MSE 0.2167 at b = 2, d = 128 (OCTOPUS paper's PolarQuant comparison); 0.0321 for (4, 2, 2, 2).
    x = torch.randn(1024, 128, generator=gen(0))
    mse = {}
    for preset in ("polarquant:b=2", "polarquant:b=3", "polarquant:b=4", "polarquant:levels=4222"):
        codec = build(preset, head_dim=128)
        mse[preset] = rel_mse(x, codec.decode(codec.encode(x)))
    assert mse["polarquant:b=2"] == pytest.approx(0.2167, rel=0.03)
    assert mse["polarquant:levels=4222"] == pytest.approx(0.0321, rel=0.05)
    assert mse["polarquant:b=4"] == pytest.approx(0.0143, rel=0.05)
    # The native allocation beats b = 3 everywhere at nearly the same rate (3.875 vs 3.8125 bpc): the wide level-1 angle
    # carries most of the error, so (b, b, b, b) is a weak (if paper-matched) baseline.
    assert mse["polarquant:b=4"] < mse["polarquant:levels=4222"] < mse["polarquant:b=3"] < mse["polarquant:b=2"]


def test_polar_tree_inverts_at_high_resolution():
    # With 8 bits on every level the only errors are fine angle steps: the tree and its inverse agree.
    x = torch.randn(64, 32, generator=gen(4)) * 3
    codec = build("polarquant:b=8", head_dim=32)
    assert rel_mse(x, codec.decode(codec.encode(x))) < 2e-4


def test_zero_token_decodes_to_zero():
    x = torch.randn(10, 64, generator=gen(5))
    x[4] = 0.0
    codec = build("polarquant:b=3", head_dim=64)
    out = codec.decode(codec.encode(x))
    assert torch.equal(out[4], torch.zeros(64))


def test_determinism_and_seed():
    x = torch.randn(2, 30, 64, generator=gen(6))
    a = build("polarquant:b=2", head_dim=64, num_heads=2, seed=1).encode(x)
    b = build("polarquant:b=2", head_dim=64, num_heads=2, seed=1).encode(x.clone())
    c = build("polarquant:b=2", head_dim=64, num_heads=2, seed=2).encode(x)
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert not torch.equal(a.tensors["angles1"], c.tensors["angles1"])
    # One rotation shared by every layer and head, as the PolarQuant paper shares its rotation.
    d = build("polarquant:b=2", head_dim=64, num_heads=2, layer=9, seed=1).encode(x)
    assert all(torch.equal(a.tensors[k], d.tensors[k]) for k in a.tensors)


def test_rotated_domain_scores():
    k = torch.randn(50, 64, generator=gen(7))
    q = torch.randn(3, 64, generator=gen(8))
    codec = build("polarquant:b=3", head_dim=64)
    enc = codec.encode(k)
    ref = q @ codec.decode(enc, torch.float32).T
    assert torch.allclose(codec.rotate_query(q) @ codec.decode_rotated(enc).T, ref, atol=1e-4)
    assert torch.allclose(codec.scores(q, enc), ref, atol=1e-5)


def test_value_config():
    assert kv_configs("polarquant:b=3", value_group=16)[1] == CodecConfig.parse("groupquant:bits=3,group=16")
    native = CodecConfig.parse("polarquant:levels=4222")
    assert kv_configs(native)[1] == native


@pytest.mark.parametrize(
    "preset,head_dim,message",
    [
        ("polarquant:b=2", 48, "power-of-two"),
        ("polarquant:b=2", 8, "16-coordinate blocks"),
        ("polarquant:b=0", 64, "unsupported b"),
        ("polarquant:b=9", 64, "unsupported b"),
        ("polarquant:levels=422", 64, "levels"),
        ("polarquant:levels=4292", 64, "levels"),
        ("polarquant:levels=abcd", 64, "levels"),
    ],
)
def test_bad_config(preset, head_dim, message):
    with pytest.raises(CodecError, match=message):
        build(preset, head_dim=head_dim)


def test_bad_input():
    codec = build("polarquant:b=2", head_dim=32)
    with pytest.raises(CodecError, match="head dim"):
        codec.encode(torch.randn(4, 64, generator=gen(9)))
    with pytest.raises(CodecError, match="fp16"):
        codec.encode(torch.randn(4, 32, generator=gen(10)) * 1e5)
