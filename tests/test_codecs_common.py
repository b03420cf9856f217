"""Properties every registered codec must have (codec protocol, `mmkv/codecs/base.py`): real packed bytes, determinism
given a seed, independent rotations per seed, shape/dtype/device-preserving round trips, clear errors on bad input,
zeros in -> zeros out, and scores that agree with the decode. Each codec runs at its default preset plus a few
representative ones; a codec registered later is covered at its default preset automatically (a codec registered
inside a test, tests/test_codec_registry.py, calls these checks itself).
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmkv.codecs import CodecConfig, CodecError, build, get_codec_class, names

# Representative presets per codec beyond its default one, with the relative reconstruction error
# sum ||x - x_hat||^2 / sum ||x||^2 each must stay under on Gaussian data (about 3x its measured value at d = 128,
# OCTOPUS paper Table 1; QJL-style decodes are unbiased but noisy by design: ((pi/2) d - 1) / m for QJL).
PRESETS: dict[str, list[tuple[str, float]]] = {
    "identity": [("identity", 0.0), ("identity:dtype=bf16", 1e-4)],
    "groupquant": [("groupquant:bits=2,group=32", 0.5), ("groupquant:bits=4,group=16", 0.03)],
    "kivi": [("kivi:bits=2,group=32", 0.5), ("kivi:bits=4,group=32,role=v", 0.03)],
    "oscar": [("oscar:bits=2,group=32", 0.5), ("oscar:bits=4,group=16,role=v", 0.03)],
    "polarquant": [("polarquant:b=2", 0.7), ("polarquant:levels=4222", 0.1)],
    "qjl": [("qjl:bits=2", 2.5), ("qjl:bits=1,norm=16", 4.0)],
    "turboquant-mse": [("turboquant-mse:b=2", 0.35), ("turboquant-mse:b=3,hi=8,norm=16", 0.1)],
    "turboquant-prod": [("turboquant-prod:b=2", 1.6), ("turboquant-prod:b=4,norm=16", 0.16)],
    "octopus": [("octopus:b=2,joint=0", 0.3), ("octopus:b=3", 0.08), ("octopus:b=4,norm=16", 0.025),
                ("octopus:b=2,dir=4,rho=0", 0.5)],
    "octopus-qjl": [("octopus-qjl:b=2", 0.15), ("octopus-qjl:b=4,joint=0", 0.015)],
    # QVG on i.i.d. Gaussian spans: k-means smoothing barely helps, the INT2 residual dominates (~0.38 at T = 2048).
    "qvg": [("qvg:bits=2", 0.8), ("qvg:bits=4,centroids=16,block=32", 0.03),
            ("qvg:bits=2,stages=2,centroids=8,asymmetric=true", 0.9)],
    # TCQ (its shipped tables only: another L or width trains one on first use): 0.075 / 0.084 / ~0.005 measured.
    "tcq": [("tcq:bits=2", 0.25), ("tcq:bits=2,L=8", 0.25), ("tcq:bits=4,hi=8,norm=32", 0.02)],
}
DEFAULT_BOUND = 2.0  # for a codec registered after this file was written, at its default preset

# Codecs that draw no random numbers (no seeded rotation or sketch): the seed must not change their bytes. OScaR's
# Canalized Rotation is the plain Walsh-Hadamard matrix, without random signs.
SEEDLESS = {"identity", "groupquant", "kivi", "oscar"}


def _presets() -> list[tuple[str, float]]:
    out = []
    for name in names():
        listed = PRESETS.get(name, [])
        default = str(CodecConfig.parse(name))
        if all(str(CodecConfig.parse(p)) != default for p, _ in listed):
            out.append((name, max((b for _, b in listed), default=DEFAULT_BOUND)))
        out += listed
    return out


ALL = _presets()
PRESET_IDS = [p for p, _ in ALL]
BOUND = dict(ALL)

def _cls(preset: str):
    return get_codec_class(CodecConfig.parse(preset).name)


def _is_identity(preset: str) -> bool:
    return CodecConfig.parse(preset).name == "identity"


def _cross_token(preset: str) -> bool:
    """Codecs whose code for a token depends on the other tokens: channel-wise K (KIVI/OScaR: a zero token is one
    value of a channel's range) and span codecs (QVG: a zero token shares a k-means centre). A zero token decodes
    to within a quantisation step of zero rather than to exactly zero."""
    cfg = CodecConfig.parse(preset)
    return (cfg.name in ("kivi", "oscar") and cfg.get("role") == "k") or _cls(preset).span_codec


def _x(shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def _nominal_bits(preset: str) -> float | None:
    cfg = CodecConfig.parse(preset)
    if cfg.get("levels"):  # PolarQuant's native per-level widths, e.g. 4222: (32 + 8 + 4 + 2) / 16 payload bits
        lv = [int(c) for c in str(cfg["levels"])]
        return sum(b * 2 ** (3 - i) for i, b in enumerate(lv)) / 16
    return cfg.nominal_bits


# ----------------------------------------------------------------------------------------------------------------
# Bytes


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_nbytes_is_the_real_packed_size(preset):
    codec = build(preset, head_dim=128, num_heads=2, seed=3)
    # Span codecs store per-span tables (QVG: 256 bf16 centres) and are meant for long spans (a 4680-token chunk).
    x = _x((2, 2048 if _cls(preset).span_codec else 64, 128), 1)
    enc = codec.encode(x)
    real = 0
    for key, t in enc.tensors.items():
        assert isinstance(t, torch.Tensor), key
        # No hidden storage behind a view: what the tensor holds is what it costs.
        assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
        real += t.numel() * t.element_size()
    assert enc.nbytes == real and codec.nbytes(enc) == real
    assert codec.effective_bits(enc) == pytest.approx(8.0 * real / x.numel())
    if _is_identity(preset):
        want = 16 if "bf16" in preset else 32
        assert codec.effective_bits(enc) == want
        return
    # Really packed: side information only in float dtypes (no float tensor anywhere near the input's size), and
    # measured bits well below 16, at or above the nominal width.
    for key, t in enc.tensors.items():
        if t.is_floating_point():
            assert t.numel() <= x.numel() // 8, (key, tuple(t.shape))
    bits = codec.effective_bits(enc)
    assert bits < 8.0
    nominal = _nominal_bits(preset)
    if nominal is not None:
        assert nominal <= bits <= nominal + 2.5, (nominal, bits)


# ----------------------------------------------------------------------------------------------------------------
# Determinism and seeds


def _same_bytes(a, b) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors
    )


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_same_seed_gives_identical_bytes(preset):
    x = _x((2, 48, 64), 5)
    state = torch.random.get_rng_state()
    a = build(preset, head_dim=64, num_heads=2, seed=11, layer=3).encode(x)
    b = build(preset, head_dim=64, num_heads=2, seed=11, layer=3).encode(x)
    assert _same_bytes(a, b)
    assert torch.equal(torch.random.get_rng_state(), state)  # private generators only: the global RNG never moves


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_another_seed_gives_another_rotation(preset):
    x = _x((2, 48, 64), 6)
    a = build(preset, head_dim=64, num_heads=2, seed=11).encode(x)
    b = build(preset, head_dim=64, num_heads=2, seed=12).encode(x)
    if CodecConfig.parse(preset).name in SEEDLESS:
        assert _same_bytes(a, b)
    else:
        assert not _same_bytes(a, b), f"{preset}: seed changes nothing; if it draws no randomness add it to SEEDLESS"


# ----------------------------------------------------------------------------------------------------------------
# Round trips


def _round_trip_cases() -> list:
    """Every preset in every dtype on CPU. On CUDA (marked gpu) each codec's default preset in bf16, the dtype the
    models cache: there every (preset, dtype) compiles its own Triton kernels (seconds each for OCTOPUS), and the
    other presets and dtypes run the same kernels with other constants, compared under the interpreter
    (tests/test_kernels_codec.py; the min-max and PolarQuant round trips take fp32 / fp16 inputs on CUDA)."""
    cases = [pytest.param(p, dt, "cpu") for p in PRESET_IDS for dt in (torch.float32, torch.float16, torch.bfloat16)]
    if torch.cuda.is_available():
        defaults = {str(CodecConfig.parse(name)) for name in names()}
        cases += [pytest.param(p, torch.bfloat16, "cuda", marks=pytest.mark.gpu) for p in PRESET_IDS
                  if str(CodecConfig.parse(p)) in defaults]
    return cases


@pytest.mark.parametrize("preset,dtype,device", _round_trip_cases())
def test_round_trip_keeps_shape_dtype_device(preset, dtype, device):
    codec = build(preset, head_dim=32, num_heads=3, seed=1)
    x = _x((2, 3, 7, 32), 2, dtype).to(device)
    enc = codec.encode(x)
    assert enc.device.type == device and enc.shape == tuple(x.shape) and enc.dtype == dtype
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == dtype and y.device.type == device
    assert torch.isfinite(y).all()
    y32 = codec.decode(enc, dtype=torch.float32)
    assert y32.dtype == torch.float32 and torch.equal(y32.to(dtype), y)


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_decode_into_out(preset):
    """`decode(out=...)` writes the same values into the given tensor (here a token slice of a bigger buffer, as the
    attention gather passes it) and returns it; a wrong shape or dtype is refused before anything is written."""
    codec = build(preset, head_dim=32, num_heads=3, seed=1)
    x = _x((2, 3, 7, 32), 2, torch.bfloat16)
    enc = codec.encode(x)
    buf = torch.zeros(2, 3, 12, 32, dtype=torch.bfloat16)
    got = codec.decode(enc, out=buf[..., 2:9, :])
    assert got.data_ptr() == buf[..., 2:, :].data_ptr() and torch.equal(got, codec.decode(enc))
    assert not buf[..., :2, :].any() and not buf[..., 9:, :].any()
    for bad in (torch.zeros(2, 3, 7, 32), torch.zeros(2, 3, 8, 32, dtype=torch.bfloat16)):
        with pytest.raises(CodecError, match="decode out must be"):
            codec.decode(enc, out=bad)


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_token_local_codecs_concatenate_exactly(preset):
    """`token_local` codecs encode each token on its own: a run of units encoded at once decodes bit for bit like
    the units encoded one by one, and `concat_tokens` joins encodings without changing a byte (the store relies on
    both); codecs that group over tokens do not claim it, and `concat_tokens` refuses them."""
    from mmkv.codecs.base import concat_tokens

    codec = build(preset, head_dim=32, num_heads=3, seed=1)
    xs = [_x((2, 3, t, 32), 5 + t, torch.bfloat16) for t in (8, 16, 24)]
    parts = [codec.encode(x) for x in xs]
    joined = concat_tokens(codec, parts)
    if not codec.token_local:
        assert joined is None
        return
    whole = codec.decode(codec.encode(torch.cat(xs, 2)))
    assert torch.equal(whole, torch.cat([codec.decode(p) for p in parts], 2))
    assert joined is not None and joined.nbytes == sum(p.nbytes for p in parts)
    assert torch.equal(codec.decode(joined), whole)


def test_concat_streams_is_packing_all_the_codes_in_one_row():
    """Joining dense bit streams (whole-byte parts, parts ending inside a byte, long and one-bit parts) gives what
    `pack_bits` gives for all their codes at once; a malformed part is refused by name."""
    from mmkv.codecs.packing import concat_streams, pack_bits

    g = torch.Generator().manual_seed(5)
    for width, lengths in [(5, [22, 1, 7]), (2, [4, 4, 3]), (3, [8, 13, 1, 40]), (1, [1]), (7, [3, 16, 5])]:
        codes = [torch.randint(0, 1 << width, (2, 3, n), generator=g) for n in lengths]
        got = concat_streams([(pack_bits(c, width), c.shape[-1] * width) for c in codes])
        assert torch.equal(got, pack_bits(torch.cat(codes, -1), width)), (width, lengths)
    with pytest.raises(CodecError, match="stream of 9 bits has 2 bytes"):
        concat_streams([(torch.zeros(3, dtype=torch.uint8), 9)])


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_token_local_codecs_join_ragged_units_as_one_encode(preset):
    """Units of 1, 5 and 7 tokens, whose packed rows mostly end inside a byte, still join: a field the codec names in
    `bit_streams` is joined bit by bit, so the joined encoding is, field for field, what encoding all the tokens at
    once stores (no more bytes than the parts), and it decodes as the parts do."""
    from mmkv.codecs.base import concat_tokens

    codec = build(preset, head_dim=32, num_heads=3, seed=1)
    xs = [_x((2, 3, t, 32), 11 + t, torch.bfloat16) for t in (1, 5, 7)]
    parts = [codec.encode(x) for x in xs]
    joined = concat_tokens(codec, parts)
    if not codec.token_local:
        assert joined is None
        return
    whole = codec.encode(torch.cat(xs, 2))
    assert joined is not None and list(joined.tensors) == list(whole.tensors) and joined.shape == whole.shape
    for key, t in whole.tensors.items():
        assert torch.equal(joined.tensors[key], t), key
    assert joined.nbytes == whole.nbytes <= sum(p.nbytes for p in parts)
    assert torch.equal(codec.decode(joined), torch.cat([codec.decode(p) for p in parts], 2))
    if preset in ("octopus:b=2,joint=0", "octopus:b=3"):  # 11 triplets of 5 or 7 bits a token: padding to drop
        assert joined.nbytes < sum(p.nbytes for p in parts)


@pytest.mark.parametrize("preset", ["kivi:bits=2,group=32", "oscar:bits=2,group=32", "kivi:bits=4,group=16",
                                    "oscar:bits=3,group=16"])
def test_grouped_keys_join_units_of_any_length(preset):
    """KIVI's and OScaR's keys group over each unit's tokens, so units of unequal length (an AAR's 1 to 75-token
    scales) cannot be stacked; `join_units` concatenates every stored tensor along its last axis and records the
    units' token counts, each unit's groups starting at its own first token: the same bytes, decoded bit for bit as
    the units are, and joined again with later units. Values (token-local) and rows that end inside a byte refuse."""
    codec = build(preset, head_dim=64, num_heads=4, seed=1)
    xs = [_x((2, 4, t, 64), 3 + t, torch.bfloat16) for t in (1, 5, 40, 3, 75)]
    parts = [codec.encode(x) for x in xs]
    first = codec.join_units(parts[:3])
    joined = codec.join_units([first, *parts[3:]])
    assert joined.meta["units"] == (1, 5, 40, 3, 75) and joined.shape == (2, 4, 124, 64)
    assert joined.nbytes == sum(p.nbytes for p in parts)
    assert torch.equal(codec.decode(joined), torch.cat([codec.decode(p) for p in parts], 2))
    assert torch.equal(codec.decode(first), torch.cat([codec.decode(p) for p in parts[:3]], 2))
    values = build(preset + ",role=v", head_dim=64, num_heads=4, seed=1)
    assert values.join_units([values.encode(x) for x in xs[:2]]) is None
    odd = build(preset.split(":")[0] + ":bits=3,group=16", head_dim=4, seed=1)  # 12 bits a token: not whole bytes
    assert not odd.joins_units and odd.join_units([odd.encode(_x((1, t, 4), t, torch.float32)) for t in (2, 3)]) is None


@pytest.mark.parametrize("preset", ["qvg:bits=2,centroids=4,block=16", "qvg:bits=4,centroids=3,block=16,stages=2",
                                    "qvg:bits=2,centroids=4,block=16,asymmetric=1"])
def test_qvg_spans_of_any_length_join(preset):
    """QVG's spans each hold their own centres, so spans of unequal length (an AAR's scales) could not stack;
    `join_units` concatenates the codes, scales, zeros and ids along the tokens and the spans' centre tables one
    after the other: the same bytes, decoded bit for bit as the spans are (a token of span u reads from u *
    centroids on), and joined again with later spans. No stage, or codes that end inside a byte, refuse."""
    codec = build(preset, head_dim=32, num_heads=2, seed=1)
    assert codec.joins_units
    xs = [_x((2, 2, t, 32), 3 + t, torch.bfloat16) for t in (1, 5, 12, 3, 20)]
    parts = [codec.encode(x) for x in xs]
    first = codec.join_units(parts[:3])
    joined = codec.join_units([first, *parts[3:]])
    assert joined.meta["units"] == (1, 5, 12, 3, 20) and joined.shape == (2, 2, 41, 32)
    assert len(joined.meta["units_kmeans_iters"]) == 5
    assert joined.nbytes == sum(p.nbytes for p in parts)
    assert torch.equal(codec.decode(joined), torch.cat([codec.decode(p) for p in parts], 2))
    assert torch.equal(codec.decode(first), torch.cat([codec.decode(p) for p in parts[:3]], 2))
    none = build(preset + ",stages=0" if "stages" not in preset else preset.replace("stages=2", "stages=0"),
                 head_dim=32, num_heads=2, seed=1)
    assert not none.joins_units and none.join_units([none.encode(x) for x in xs[:2]]) is None
    odd = build("qvg:bits=2,centroids=2,block=4", head_dim=6, seed=1)  # 12 bits a token: not whole bytes
    assert not odd.joins_units
    assert odd.join_units([odd.encode(_x((1, 1, t, 6), t, torch.float32)) for t in (2, 3)]) is None


@pytest.mark.parametrize("preset", ["kivi:bits=2,group=16", "oscar:bits=3,group=16", "kivi:bits=4,group=16,role=v",
                                    "qvg:bits=2,centroids=8,block=16", "qvg:bits=4,centroids=4,block=16,stages=2"])
def test_stackable_codecs_decode_a_stack_like_each_unit(preset):
    """`stack_units` puts equal units' encodings on a new axis after the batch axis without changing a byte; a
    stackable codec decodes the stack as each unit alone (ragged token groups included); unequal units refuse."""
    from mmkv.codecs.base import stack_units

    codec = build(preset, head_dim=32, num_heads=3, seed=1)
    assert codec.stackable and not codec.token_local or preset.endswith("role=v")
    xs = [_x((2, 3, 20, 32), 7 + i, torch.bfloat16) for i in range(3)]  # 20 tokens: a ragged group of 16
    parts = [codec.encode(x) for x in xs]
    two = stack_units(parts[:2], codec.stack_axes)
    three = stack_units([two, parts[2]], codec.stack_axes)  # a stack grows by later units
    assert three.shape == (2, 3, 3, 20, 32) and three.nbytes == sum(p.nbytes for p in parts)
    dec = codec.decode(three)
    for i, p in enumerate(parts):
        assert torch.equal(dec[:, i], codec.decode(p))
    assert stack_units([parts[0], codec.encode(_x((2, 3, 24, 32), 9, torch.bfloat16))], codec.stack_axes) is None
    assert stack_units(parts[:1]) is None


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_single_head_rank2_input(preset):
    codec = build(preset, head_dim=64, seed=4)
    x = _x((33, 64), 3)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and torch.isfinite(y).all()


# ----------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_nan_and_inf_are_refused(preset):
    codec = build(preset, head_dim=64, seed=0)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = _x((9, 64), 4)
        x[3, 5] = bad
        with pytest.raises(CodecError, match="NaN/Inf"):
            codec.encode(x)


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_wrong_rank_dtype_and_shape_are_refused(preset):
    codec = build(preset, head_dim=64, num_heads=2, seed=0)
    with pytest.raises(CodecError, match="at least 2 dims"):
        build(preset, head_dim=64).encode(_x((64,), 1))
    for dtype in (torch.int32, torch.uint8, torch.bool):
        with pytest.raises(CodecError, match="float tensor"):
            codec.encode(torch.ones(2, 5, 64, dtype=dtype))
    with pytest.raises(CodecError, match="expected a torch.Tensor"):
        codec.encode([[0.0] * 64])
    with pytest.raises(CodecError, match="head dim 32"):
        codec.encode(_x((2, 5, 32), 1))
    with pytest.raises(CodecError, match="heads|head"):
        codec.encode(_x((3, 5, 64), 1))


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_decoding_another_codecs_bytes_is_refused(preset):
    other = "identity:dtype=bf16" if not preset.startswith("identity:dtype=bf16") else "identity"
    enc = build(other, head_dim=64).encode(_x((4, 64), 1))
    with pytest.raises(CodecError, match="cannot decode"):
        build(preset, head_dim=64).decode(enc)


@pytest.mark.parametrize("name", names())
def test_head_dim_not_a_power_of_two(name):
    if get_codec_class(name).requires_pow2:
        with pytest.raises(CodecError, match=r"power-of-two.*Supported: 16, 32, 64, 128"):
            build(name, head_dim=96)
    else:
        codec = build(name, head_dim=96)
        x = _x((5, 96), 7)
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("name", names())
def test_unsupported_bits_are_refused(name):
    cls = get_codec_class(name)
    key = "bits" if "bits" in cls.config_class.field_names() else None
    if key is None:  # identity: its one parameter is the storage dtype
        with pytest.raises(CodecError, match="dtype"):
            build(f"{name}:dtype=int4", head_dim=64)
        return
    for bad in (0, 17, -1, 2.5, "two"):
        with pytest.raises(CodecError, match=rf"{key}"):
            build(CodecConfig.parse(name).replace(**{key: bad}), head_dim=64)
    with pytest.raises(CodecError, match="no parameter"):
        CodecConfig.parse(f"{name}:nosuchparam=1")


# ----------------------------------------------------------------------------------------------------------------
# Zeros


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_zero_vectors_decode_to_zeros(preset):
    codec = build(preset, head_dim=64, num_heads=2, seed=2)
    enc = codec.encode(torch.zeros(2, 40, 64))
    y = codec.decode(enc)
    assert torch.isfinite(y).all() and torch.equal(y, torch.zeros_like(y))
    s = codec.scores(_x((2, 3, 64), 1), enc)
    assert torch.isfinite(s).all() and torch.equal(s, torch.zeros_like(s))
    # Zero keys among nonzero ones: no NaN anywhere, and the zero rows stay (exactly, or for channel-wise codecs
    # within a quantisation step of) zero.
    x = _x((2, 40, 64), 9)
    x[:, ::7] = 0.0
    y = codec.decode(codec.encode(x))
    assert torch.isfinite(y).all()
    zero_rows = y[:, ::7]
    if _cross_token(preset):
        assert zero_rows.norm(dim=-1).max() <= 0.5 * x.norm(dim=-1).median()
    else:
        assert torch.equal(zero_rows, torch.zeros_like(zero_rows))


# ----------------------------------------------------------------------------------------------------------------
# Hypothesis: shapes, dtypes, seeds, scales


@st.composite
def _case(draw, preset: str):
    head_dim = draw(st.sampled_from([32, 64]))
    heads = draw(st.integers(1, 3))
    lead = draw(st.sampled_from([(), (2,)]))
    tokens = draw(st.integers(4, 40))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-2, 1.0, 30.0]))
    data_seed = draw(st.integers(0, 2**31 - 1))
    shape = (*lead, heads, tokens, head_dim) if heads > 1 or draw(st.booleans()) else (*lead, tokens, head_dim)
    return head_dim, heads, shape, dtype, seed, scale, data_seed


@pytest.mark.parametrize("preset", PRESET_IDS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_round_trip_property(preset, data):
    head_dim, heads, shape, dtype, seed, scale, data_seed = data.draw(_case(preset))
    codec = build(preset, head_dim=head_dim, num_heads=heads, seed=seed)
    x = _x(shape, data_seed, dtype, scale)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
    assert _same_bytes(enc, codec.encode(x))  # deterministic
    # Bounded error, scale-free (relative to the input's energy).
    x32, y32 = x.float(), y.float()
    rel = float(((x32 - y32) ** 2).sum() / (x32**2).sum().clamp_min(1e-30))
    # A low-precision output dtype adds its own rounding (bf16: 2^-9 relative per value).
    slack = {torch.float16: 1e-6, torch.bfloat16: 2e-5}.get(dtype, 0.0)
    assert rel <= BOUND.get(preset, DEFAULT_BOUND) + slack, rel
    # The score path agrees with the decode path: q . k_hat (for the QJL family, decode is built to make it so).
    q = _x((*shape[:-2], 3, head_dim), data_seed + 1)
    s = codec.scores(q, enc)
    k_hat = codec.decode(enc, dtype=torch.float32)
    assert s.shape == (*shape[:-2], 3, shape[-2]) and s.dtype == torch.float32
    ref = q @ k_hat.transpose(-1, -2)
    tol = 1e-4 * q.norm(dim=-1, keepdim=True) * k_hat.norm(dim=-1).unsqueeze(-2) + 1e-6
    assert ((s - ref).abs() <= tol).all()


# ----------------------------------------------------------------------------------------------------------------
# Shipped codebooks (`mmkv codebooks build --check`)


def test_codebook_check_accepts_last_bit_noise_and_names_a_real_change(tmp_path, monkeypatch, capsys):
    """Another machine's SIMD sums move a codebook's last bits (up to ~2e-13 seen): `--check` accepts that within
    1e-12 and says so, and still fails, naming the key and index, on a change a builder edit would make."""
    import argparse
    import json

    from mmkv.codecs import codebooks

    shipped = json.loads((codebooks.DATA_DIR / "polarquant.json").read_text())
    books = shipped["codebooks"]
    noisy = {k: [v + (-1) ** i * 3e-13 * max(1.0, abs(v)) for i, v in enumerate(vs)] for k, vs in books.items()}
    assert noisy != books and codebooks.differences(noisy, books) == []
    changed = json.loads(json.dumps(books))
    changed["level3_b2"][1] += 1e-9
    assert codebooks.differences(changed, books) == [
        f"key 'level3_b2': 1 of 4 values differ, the most at index 1 ({changed['level3_b2'][1]!r} computed, "
        f"{books['level3_b2'][1]!r} shipped)"]
    assert "missing" in codebooks.differences(books, {k: v for k, v in books.items() if k != "level1_b4"})[0]

    monkeypatch.setattr(codebooks, "DATA_DIR", tmp_path)
    args = argparse.Namespace(check=True, family=["polarquant"], out=tmp_path)
    for books_there, rc, said in ((noisy, 0, "regenerates within 1e-12"), (changed, 1, "'level3_b2': 1 of 4 values")):
        (tmp_path / "polarquant.json").write_text(json.dumps({"family": "polarquant", "codebooks": books_there}))
        assert codebooks.run(args) == rc
        assert said in capsys.readouterr().out


def test_config_string_is_made_once_and_stays_canonical():
    """A config's preset string is built once (a store's codecs compare it at every encode and decode); a field
    normalised in `__post_init__` (TCQ's default L) is in it, and `replace` makes a new one."""
    cfg = CodecConfig.parse("tcq:bits=3")
    assert str(cfg) == "tcq:L=9,bits=3,hi=0,norm=16" and str(cfg) is str(cfg)
    assert str(cfg.replace(hi=4)) == "tcq:L=9,bits=3,hi=4,norm=16" and str(cfg) == "tcq:L=9,bits=3,hi=0,norm=16"
    again = CodecConfig.parse(str(cfg))
    assert again == cfg and hash(again) == hash(cfg)
