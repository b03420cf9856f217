"""The min-max family: groupquant (the `amirzandieh/QJL` value recipe), KIVI and OScaR."""

from __future__ import annotations

import math

import pytest
import torch

from mmkv.codecs import CodecConfig, CodecError, build
from mmkv.codecs.base import kv_configs
from mmkv.codecs.rotation import hadamard_transform



def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x - y).square().sum(-1) / x.square().sum(-1)).mean())


def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(x, y, dim=-1).mean())


PRESETS = [
    "groupquant:bits=2,group=32",
    "groupquant:bits=3,group=16",
    "kivi:bits=2,group=32",
    "kivi:bits=4,group=32,role=v",
    "oscar:bits=2,group=32",
    "oscar:bits=4,group=32,role=v",
]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _round_trip_cases() -> list:
    """Every preset in every dtype on CPU; on CUDA (marked gpu) one dtype per preset, in turn, so each family meets two
    dtypes there and each (preset, dtype) compiles its kernels once instead of three times."""
    cases = [pytest.param(p, dt, "cpu") for p in PRESETS for dt in DTYPES]
    if torch.cuda.is_available():
        cases += [pytest.param(p, DTYPES[i % 3], "cuda", marks=pytest.mark.gpu) for i, p in enumerate(PRESETS)]
    return cases


@pytest.mark.parametrize("preset,dtype,device", _round_trip_cases())
def test_round_trip_shape_dtype_device(preset, dtype, device):
    # A ragged token count (45 = 32 + 13) exercises the short last token group.
    x = (torch.randn(2, 3, 45, 64, generator=gen(1)) * 2 + 0.5).to(device=device, dtype=dtype)
    codec = build(preset, head_dim=64, num_heads=3, layer=2, seed=7)
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert all(t.device == x.device for t in enc.tensors.values())
    assert rel_mse(x.float(), out.float()) < 0.25
    assert codec.decode(enc, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("preset", ["groupquant:bits=2,group=32", "kivi:bits=3,group=32", "kivi:bits=2,group=8,role=v"])
def test_min_convention_error_is_at_most_half_a_step(preset):
    # Float-min convention: every value lies on or within the stored grid, so |x - x^| <= s/2 (+ fp16 rounding).
    x = torch.randn(4, 50, 32, generator=gen(2)) * 3
    codec = build(preset, head_dim=32)
    enc = codec.encode(x)
    err = (codec.decode(enc) - x).abs()
    s = enc.tensors["scale"].float()
    group = codec.group
    if codec.name == "kivi" and codec.role == "k":
        step = s.repeat_interleave(group, -1)[..., :50].transpose(-1, -2)  # [.., D, ng] -> [.., T, D]
    else:
        step = s.repeat_interleave(group, -1)[..., :32]
    assert bool((err <= 0.5 * step + 2e-3 * x.abs().amax()).all())


def test_oscar_rounded_zero_point_grid():
    # OScaR stores (s, -z s) with integer z, so every decoded value is (q - z) s and 0 is on the grid.
    x = torch.randn(1, 64, 32, generator=gen(3))
    codec = build("oscar:bits=2,group=32,meta=fp32", head_dim=32)
    enc = codec.encode(x)
    s, off = enc.tensors["scale"], enc.tensors["offset"]
    z = -off / s
    assert torch.allclose(z, z.round(), atol=1e-4)
    khat = codec.decode_normalized(enc)
    target = hadamard_transform(x) / enc.tensors["norm"][..., None]
    step = s.repeat_interleave(32, -1).transpose(-1, -2)
    assert bool(((khat - target).abs() <= step * 1.0001).all())  # rounded z can clip an end by up to s/2


# -- byte accounting -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,group", [(1, 32), (2, 32), (3, 16), (4, 16), (8, 32)])
def test_groupquant_bits_are_b_plus_32_over_g(bits, group):
    x = torch.randn(3, 20, 128, generator=gen(4))
    enc = build(f"groupquant:bits={bits},group={group}", head_dim=128).encode(x)
    assert enc.effective_bits == bits + 32 / group
    assert enc.nbytes == sum(t.numel() * t.element_size() for t in enc.tensors.values())
    assert enc.tensors["scale"].dtype == torch.float16 and enc.tensors["offset"].dtype == torch.float16


def test_kivi_key_bits_and_ragged_group_count():
    x = torch.randn(2, 4, 96, 128, generator=gen(5))
    enc = build("kivi:bits=2,group=32", head_dim=128, num_heads=4).encode(x)
    assert enc.effective_bits == 3.0  # 2 + 32/32 when T is a multiple of G (KIVI's layout)
    # T = 1560 (a Wan latent frame): 48 full groups and one ragged group of 24 tokens, whose params are counted.
    x = torch.randn(1, 1560, 64, generator=gen(6))
    enc = build("kivi:bits=2,group=32", head_dim=64).encode(x)
    assert enc.tensors["scale"].shape == (1, 64, 49)
    assert enc.nbytes == 1560 * 64 * 2 // 8 + 49 * 64 * 2 * 2
    enc_v = build("kivi:bits=2,group=32,role=v", head_dim=64).encode(x)
    assert enc_v.effective_bits == 3.0 and enc_v.tensors["scale"].shape == (1, 1560, 2)


@pytest.mark.parametrize("bits", [2, 4])
def test_oscar_bits_add_the_fp32_token_norm(bits):
    h, d = 4, 64
    x = torch.randn(2, h, 64, d, generator=gen(7))
    enc = build(f"oscar:bits={bits},group=32", head_dim=d, num_heads=h).encode(x)
    assert enc.tensors["norm"].dtype == torch.float32 and enc.tensors["norm"].shape == (2, 64)
    assert enc.effective_bits == pytest.approx(bits + 1 + 32 / (h * d), abs=1e-12)
    enc_v = build(f"oscar:bits={bits},group=32,role=v", head_dim=d, num_heads=h).encode(x)
    assert enc_v.effective_bits == bits + 1 and "norm" not in enc_v.tensors


# -- determinism, exactness ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_deterministic(preset):
    x = torch.randn(2, 40, 32, generator=gen(8))
    a = build(preset, head_dim=32, num_heads=2, seed=3).encode(x)
    b = build(preset, head_dim=32, num_heads=2, seed=3).encode(x.clone())
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_zero_range_groups_are_exact():
    # fp16-representable constants (bf16/fp16 model activations are) decode exactly through the fp16 offset.
    x = torch.randn(3, 40, 64, generator=gen(9))
    const = torch.randn(3, 40, generator=gen(10)).half().float()
    x[:, :, 32:] = const[..., None]  # the second channel group of every token is constant
    codec = build("groupquant:bits=2,group=32", head_dim=64)
    out = codec.decode(codec.encode(x))
    assert torch.equal(out[:, :, 32:], x[:, :, 32:])
    # KIVI K: one channel constant over a token group; and one channel all zero.
    y = torch.randn(2, 64, 16, generator=gen(11))
    y[:, :32, 3] = torch.randn(2, 1, generator=gen(12)).half().float()
    y[:, :, 7] = 0.0
    kivi = build("kivi:bits=2,group=32", head_dim=16)
    enc = kivi.encode(y)
    assert bool((enc.tensors["scale"][:, 3, 0] == 0).all())
    out = kivi.decode(enc)
    assert torch.equal(out[:, :32, 3], y[:, :32, 3]) and torch.equal(out[:, :, 7], y[:, :, 7])


def test_oscar_constant_token_group_and_zero_token():
    h, d = 2, 32
    x = torch.randn(h, 64, d, generator=gen(13))
    x[:, 32:] = x[:, 32:33]  # the second group holds 32 copies of one token: every channel range is zero
    x[:, 5] = 0.0  # a zero token (over all heads): its norm is taken as 1 and it decodes to zeros
    codec = build("oscar:bits=2,group=32,meta=fp32", head_dim=d, num_heads=h)
    enc = codec.encode(x)
    assert bool((enc.tensors["scale"][..., 1] == 0).all())
    assert enc.tensors["norm"][5] == 1.0
    out = codec.decode(enc)
    assert torch.allclose(out[:, 32:], x[:, 32:], atol=1e-5, rtol=0)
    assert torch.equal(out[:, 5], torch.zeros_like(out[:, 5]))


# -- OScaR specifics -------------------------------------------------------------------------------------------------


def test_oscar_norm_is_one_per_token_over_all_heads():
    h, t, d = 4, 40, 64
    x = torch.randn(3, h, t, d, generator=gen(14)) * torch.rand(3, 1, t, 1, generator=gen(15)) * 5
    codec = build("oscar:bits=2,group=32", head_dim=d, num_heads=h)
    enc = codec.encode(x)
    norm = enc.tensors["norm"]
    assert norm.shape == (3, t)
    assert torch.allclose(norm, x.square().sum(dim=(-3, -1)).sqrt(), rtol=1e-5)
    # Changing one head of one token changes that token's norm, hence the stored normalised values of every head.
    y = x.clone()
    y[1, 2, 7] *= 3.0
    enc_y = codec.encode(y)
    changed = (enc_y.tensors["norm"] != norm).nonzero().tolist()
    assert changed == [[1, 7]]
    khat, khat_y = codec.decode_normalized(enc), codec.decode_normalized(enc_y)
    assert not torch.equal(khat[1, 0, 7], khat_y[1, 0, 7])  # head 0 of token 7 was rescaled by the shared norm


def test_oscar_rotated_domain_scores_match_decoded_keys():
    h, d = 2, 64
    k = torch.randn(h, 64, d, generator=gen(16))
    q = torch.randn(h, 5, d, generator=gen(17))
    codec = build("oscar:bits=2,group=32", head_dim=d, num_heads=h)
    enc = codec.encode(k)
    s = codec.scores(q, enc)
    assert s.shape == (h, 5, 64)
    assert torch.allclose(s, q @ codec.decode(enc, torch.float32).transpose(-1, -2), atol=1e-4)
    manual = (codec.rotate_query(q) @ codec.decode_normalized(enc).transpose(-1, -2)) * codec.token_norms(enc)
    assert torch.allclose(s, manual, atol=1e-5)
    # The generic rotation-codec contract: score = <rotate_query(q), decode_rotated(enc)>.
    assert torch.allclose(s, codec.rotate_query(q) @ codec.decode_rotated(enc).transpose(-1, -2), atol=1e-4)
    # The value path accumulates in the rotated basis; `unrotate` brings the result back.
    vcodec = build("oscar:bits=2,group=32,role=v", head_dim=d, num_heads=h)
    venc = vcodec.encode(k)
    assert torch.allclose(vcodec.unrotate(vcodec.decode_rotated(venc)), vcodec.decode(venc, torch.float32), atol=1e-6)


def test_oscar_beats_kivi_under_token_norm_imbalance():
    # OScaR's Token Norm Imbalance: per-token norms spread over orders of magnitude plus an outlier channel ruin
    # per-channel KIVI; rotating and normalising first fixes it.
    h, t, d = 4, 256, 64
    x = torch.randn(h, t, d, generator=gen(18))
    x[..., 5] += 8.0
    x = x * torch.exp(1.5 * torch.randn(t, generator=gen(19)))[None, :, None]
    mse = {}
    for name in ("kivi", "oscar"):
        codec = build(f"{name}:bits=2,group=32", head_dim=d, num_heads=h)
        mse[name] = rel_mse(x, codec.decode(codec.encode(x)))
    assert mse["oscar"] < 0.15 and mse["kivi"] > 10 * mse["oscar"], mse


@pytest.mark.parametrize(
    "preset,expected",
    [
        # Measured on n = 1024 Gaussian keys at d = 128 (see docs/decisions.md).
        ("groupquant:bits=2,group=32", 0.1545),
        ("groupquant:bits=4,group=32", 0.0062),
        ("kivi:bits=2,group=32", 0.1571),
        ("kivi:bits=3,group=32", 0.0287),
        ("oscar:bits=2,group=32", 0.1636),
        ("oscar:bits=4,group=32", 0.0065),
    ],
)
def test_gaussian_quality(preset, expected):
    x = torch.randn(1024, 128, generator=gen(0))
    codec = build(preset, head_dim=128)
    out = codec.decode(codec.encode(x))
    m = rel_mse(x, out)
    assert m == pytest.approx(expected, rel=0.05)
    assert cosine(x, out) > 1 - 0.6 * m  # cos ~ 1 - mse/2 for small errors


# -- pairing and bad input --------------------------------------------------------------------------------------------


def test_value_configs():
    k, v = kv_configs("kivi:bits=4,group=32")
    assert v == CodecConfig.parse("kivi:bits=4,group=32,role=v") and k["role"] == "k"
    k, v = kv_configs("oscar:bits=2")
    assert v == CodecConfig.parse("oscar:bits=2,group=32,role=v")
    assert CodecConfig.parse("groupquant:b=3,g=16") == CodecConfig.parse("groupquant:bits=3,group=16")


@pytest.mark.parametrize(
    "preset,head_dim,message",
    [
        ("groupquant:bits=0", 64, "bits"),
        ("groupquant:bits=9", 64, "bits"),
        ("groupquant:bits=2.5", 64, "bits"),
        ("groupquant:group=0", 64, "group"),
        ("groupquant:meta=bf16", 64, "meta"),
        ("kivi:bits=5", 64, "bits"),
        ("kivi:role=q", 64, "role"),
        ("oscar:bits=8", 64, "bits"),
        ("oscar:bits=2", 96, "power-of-two"),
        ("oscar:bits=2,role=v", 48, "power-of-two"),
    ],
)
def test_bad_config(preset, head_dim, message):
    with pytest.raises(CodecError, match=message):
        build(preset, head_dim=head_dim)


def test_bad_input():
    with pytest.raises(CodecError, match="all KV heads"):
        build("oscar:bits=2", head_dim=32, num_heads=1).encode(torch.randn(4, 32, 32, generator=gen(20)))
    with pytest.raises(CodecError, match="built for 4 heads"):
        build("oscar:bits=2", head_dim=32, num_heads=4).encode(torch.randn(2, 32, 32, generator=gen(21)))
    with pytest.raises(CodecError, match="head dim"):
        build("kivi:bits=2", head_dim=32).encode(torch.randn(8, 64, generator=gen(22)))
    x = torch.randn(8, 32, generator=gen(23))
    x[3, 3] = math.nan
    with pytest.raises(CodecError, match="NaN"):
        build("groupquant:bits=2", head_dim=32).encode(x)
    big = torch.randn(8, 32, generator=gen(24)) * 1e6
    with pytest.raises(CodecError, match="meta=fp32"):
        build("groupquant:bits=2", head_dim=32).encode(big)
    codec = build("groupquant:bits=2,meta=fp32", head_dim=32)
    assert rel_mse(big, codec.decode(codec.encode(big))) < 0.25
    with pytest.raises(CodecError, match="cannot decode"):
        build("kivi:bits=4", head_dim=32).decode(build("kivi:bits=2", head_dim=32).encode(x.nan_to_num()))
