"""TCQ (QTIP's bitshift trellis over rotated coordinates): Viterbi optimality, tail-biting,
storage, the gain, and the distortion the trellis buys over scalar Lloyd-Max at d = 128."""

import itertools
import json

import pytest
import torch

from mmkv.codecs import CodecConfig, CodecError, build, codebooks
from mmkv.codecs.tcq import (
    SHIPPED, _distances, _trellis_pass, hi_steps, pass_one_window, states_from_codes, step_widths, tcq_table, trellis_table,
    viterbi,
)


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel_mse(x, x_hat):
    """OCTOPUS paper, section 4.1: mean ||x - x_hat||^2 / ||x||^2."""
    return float(((x - x_hat).pow(2).sum(-1) / x.pow(2).sum(-1)).mean())


def path_error(u, table, codes, widths, L):
    """Squared error per vector of the tail-biting path the codes spell, as the decoder reads it."""
    return (u - table[states_from_codes(codes, widths, L)]).pow(2).sum((-1, -2))


# ---------------------------------------------------------------------------------------------------------------
# The trellis


def all_codes(widths):
    return torch.tensor(list(itertools.product(*[range(1 << k) for k in widths])))


@pytest.mark.parametrize("widths", [[2, 2, 2, 2], [2, 3, 2, 3]])
def test_viterbi_is_the_best_tail_biting_path_with_its_overlap_bits(widths):
    """Pass two is exact: among all bit strings (brute force) whose wrapped bits h equal the ones pass one chose, none
    has less error."""
    L, n = 5, 64
    table = gaussian(1 << L, 2, seed=1)
    u = gaussian(n, len(widths), 2, seed=2)
    codes = viterbi(u, table, widths, L)
    cand = all_codes(widths)  # [C, T]
    err = path_error(u[:, None], table, cand[None].expand(n, -1, -1), widths, L)  # [n, C]
    ours = path_error(u, table, codes, widths, L)
    first = states_from_codes(cand, widths, L)[:, 0] >> widths[0]
    h = states_from_codes(codes, widths, L)[:, 0] >> widths[0]
    same_h = first[None] == h[:, None]
    best_same_h = torch.where(same_h, err, torch.full_like(err, float("inf"))).min(-1).values
    torch.testing.assert_close(ours, best_same_h, rtol=1e-6, atol=1e-6)


def test_the_distances_are_the_difference_square_and_sum_in_order():
    """The CPU Viterbi takes its step values and table value by value (contiguous rows, for speed); every distance is
    still (u_0 - t_0)^2 + (u_1 - t_1)^2 rounded op by op, as the Triton encoder computes it, bit for bit."""
    u, table = gaussian(300, 2, seed=3), gaussian(256, 2, seed=4)
    plain = (u[:, None, 0] - table[None, :, 0]).square() + (u[:, None, 1] - table[None, :, 1]).square()
    out, scratch = torch.empty(300, 256), torch.empty(300, 256)
    got = _distances(u.t().contiguous(), table.t().contiguous(), out, scratch)
    assert got is out and torch.equal(got, plain)


def test_two_passes_come_close_to_the_best_overlap_bits():
    """At d = 128 (64 steps) the wrap is a small part of the path: the overlap bits pass one picks cost well under 1%
    against the best of all 2^(L-k) choices (each one a constrained pass)."""
    L, k, widths = 8, 4, [4] * 64
    table = trellis_table(L, k)
    u = gaussian(32, 64, 2, seed=8)
    ours = path_error(u, table, viterbi(u, table, widths, L), widths, L)
    low = (1 << (L - k)) - 1
    best = torch.full_like(ours, float("inf"))
    for h in range(1 << (L - k)):
        hh = torch.full((32,), h)
        cost, _ = _trellis_pass(u, table, widths, L, hh, keep=False)
        ends = (torch.arange(1 << L) & low) == h
        best = torch.minimum(best, cost[:, ends].min(-1).values)
    assert bool((ours >= best - 1e-4).all())
    assert float(ours.mean()) <= 1.01 * float(best.mean())


def test_pass_one_sees_the_steps_around_the_first():
    assert pass_one_window(64) == (16, 32) and pass_one_window(64, None) == (32, 64)  # None: QTIP's, all steps
    assert pass_one_window(32) == (16, 32) and pass_one_window(3) == (1, 3) and pass_one_window(64, 8) == (8, 16)
    with pytest.raises(ValueError, match="window"):
        pass_one_window(64, 0)


@pytest.mark.parametrize("L, k, limit", [(8, 4, 1.003), (9, 6, 1.001)])
def test_a_windowed_pass_one_costs_next_to_nothing(L, k, limit):
    """Pass one over the 32 steps around the first instead of all 64: the tail-biting paths' error grows by a
    fraction of a percent (measured on 2,048 Gaussian vectors: 0.05% at L = 8, under 0.005% at L = 9); its codes
    differ from QTIP's pass one's only through h."""
    widths = [k] * 64
    table = trellis_table(L, k)
    u = gaussian(512, 64, 2, seed=9)
    ours = path_error(u, table, viterbi(u, table, widths, L), widths, L)
    full = path_error(u, table, viterbi(u, table, widths, L, window=None), widths, L)
    assert float(ours.mean()) <= limit * float(full.mean())
    assert float(ours.mean()) >= 0.99 * float(full.mean())


@pytest.mark.parametrize("steps, k, hi, L", [(8, 3, 3, 7), (64, 4, 0, 8), (64, 4, 21, 11), (64, 10, 5, 16),
                                          (4, 2, 0, 8), (3, 5, 1, 16)])
def test_states_are_the_circular_bit_string(steps, k, hi, L):
    """The state after step t is the last L bits of the circular code string ending at step t (a state that reaches
    round the whole string, as with 4 steps of 2 bits at L = 8, included)."""
    widths = step_widths(steps, k, hi)
    gen = torch.Generator().manual_seed(steps + k + hi + L)
    codes = torch.stack([torch.randint(0, 1 << w, (5,), generator=gen) for w in widths], -1)
    states = states_from_codes(codes, widths, L)
    ends = list(itertools.accumulate(widths))
    for r in range(codes.shape[0]):
        bits = [(int(c) >> i) & 1 for c, w in zip(codes[r], widths) for i in reversed(range(w))]
        for t, end in enumerate(ends):
            window = [bits[(end - L + i) % len(bits)] for i in range(L)]
            assert int(states[r, t]) == int("".join(map(str, window)), 2)


def test_packing_and_unpacking_ask_the_device_nothing():
    """Encode and decode around the search make no host sync: the codes are masked to their widths before packing
    (no range scan), and the wide steps are indices, not a bool mask (whose count the device would be asked)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    asked = []

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                asked.append(str(func))
            return func(*args, **(kwargs or {}))

    codec = build(CodecConfig.parse("tcq:bits=2,hi=16,L=8,norm=32"), head_dim=128, num_heads=2, seed=3, layer=0)
    x = gaussian(1, 2, 8, 128)
    codes = codec.codes(codec.unit_rotated(x)[1])
    gain = torch.ones(codes.shape[:-1])
    enc = codec.encode(x)  # (the reference encoder's input scan is a sync: the kernel path reads it later)
    codec.unpack_codes(enc)  # the wide-step indices made once, here
    with Syncs():
        packed = codec._pack(codes, gain)
        again = codec.unpack_codes(enc)
    assert asked == [] and packed["code_hi"].numel() and torch.equal(again, codes)


def test_read_only_tables_reach_a_device_once_a_process():
    """A store builds its codecs anew for every rollout; the rotation's signs, the trellis table and the wide steps
    are copied to a device once (each copy from host memory is a host sync on CUDA), and stay distinct where they
    differ."""
    cfg = CodecConfig.parse("tcq:bits=2,hi=16,L=8")
    a, b = (build(cfg, head_dim=128, num_heads=2, seed=3, layer=0) for _ in range(2))
    other = build(cfg, head_dim=128, num_heads=2, seed=3, layer=1)
    x = gaussian(1, 2, 8, 128)
    assert a.rotation._s(x) is b.rotation._s(x)
    assert a.rotation._s(x.double()) is not a.rotation._s(x) and a.rotation._s(x.double()).dtype == torch.float64
    assert not torch.equal(other.rotation._s(x), a.rotation._s(x))
    assert a._table_on(x.device) is b._table_on(x.device) and a._wide_on(x.device) is b._wide_on(x.device)
    assert torch.equal(a.decode(a.encode(x)), b.decode(b.encode(x)))


def greedy(u, table, widths, L):
    """Per-step rounding on the same table: the best first state, then the best k bits a step given the state."""
    S = 1 << L
    state = ((u[:, 0, None] - table[None]) ** 2).sum(-1).argmin(-1)
    err = ((u[:, 0] - table[state]) ** 2).sum(-1)
    for t in range(1, u.shape[1]):
        k = widths[t]
        succ = ((state << k)[:, None] | torch.arange(1 << k)) & (S - 1)
        e = ((u[:, t, None] - table[succ]) ** 2).sum(-1)
        j = e.argmin(-1)
        state = succ.gather(1, j[:, None])[:, 0]
        err = err + e.gather(1, j[:, None])[:, 0]
    return err


def test_viterbi_beats_greedy_rounding_on_the_same_table():
    """A trellis that constrains nothing is greedy rounding in disguise: the search must buy real distortion."""
    L, widths = 8, [4] * 64
    table = trellis_table(L, 4)
    u = gaussian(256, 64, 2, seed=3)
    viterbi_mse = float(path_error(u, table, viterbi(u, table, widths, L), widths, L).mean()) / 128
    greedy_mse = float(greedy(u, table, widths, L).mean()) / 128  # even with a free start state
    assert viterbi_mse < 0.75 * greedy_mse, (viterbi_mse, greedy_mse)


def test_wide_steps_are_spread_evenly():
    for steps, hi in [(64, 45), (64, 0), (64, 64), (4, 1)]:
        wide = hi_steps(steps, hi)
        assert sum(wide) == hi
        positions = [t for t, w in enumerate(wide) if w]
        assert all(b - a in (steps // hi, steps // hi + 1) for a, b in zip(positions, positions[1:])) if hi else True


# ---------------------------------------------------------------------------------------------------------------
# The table


@pytest.mark.slow
def test_table_is_shipped_and_rebuilds_within_tolerance():
    shipped = json.loads((codebooks.DATA_DIR / "tcq.json").read_text())["codebooks"]
    assert sorted(shipped) == sorted(SHIPPED)
    assert codebooks.differences({"L8_k4": tcq_table("L8_k4")}, {"L8_k4": shipped["L8_k4"]}) == []
    table = trellis_table(8, 4)
    assert table.shape == (256, 2) and table.dtype == torch.float32
    assert abs(float(table.mean())) < 0.1 and 0.8 < float(table.std()) < 1.2  # still close to N(0, 1)


# ---------------------------------------------------------------------------------------------------------------
# Distortion at d = 128 (payload bits a coordinate; scalar Lloyd-Max on the same rotated data for reference)

# (preset, relative MSE), measured on these 256 vectors: against 0.1163 / 0.0341 / 0.0094 for scalar Lloyd-Max at
# 2 / 3 / 4 bits, and the rate-distortion bound 2^(-2R) = 0.0625 / 0.0156 / 0.0039. A scratch simulation of the same
# trellis (free-run tail-biting, no gain fit) gave 0.0884 at L = 8 and 0.0787 / 0.0215 / 0.0060 at L = 12.
# The defaults (L = 8 / 9 / 11 at 2 / 3 / 4 bits) and L = 11 at 2 and 3 bits.
DISTORTION = [("tcq:bits=2", 0.0839), ("tcq:bits=2,L=11", 0.0751), ("tcq:bits=3", 0.0238), ("tcq:bits=3,L=11", 0.0212),
              ("tcq:bits=4", 0.0063)]


@pytest.mark.parametrize("preset,mse", DISTORTION)
def test_distortion_at_d128(preset, mse):
    x = gaussian(256, 128, seed=4)
    codec = build(preset, head_dim=128, seed=5)
    assert rel_mse(x, codec.decode(codec.encode(x))) == pytest.approx(mse, rel=0.06)


# ---------------------------------------------------------------------------------------------------------------
# Storage and the gain


@pytest.mark.parametrize("preset,bits_per_vector", [
    ("tcq:bits=2", 4 * 64 + 16), ("tcq:bits=2,hi=45,norm=32", 4 * 64 + 45 + 32), ("tcq:bits=3,hi=64", 7 * 64 + 16),
])
def test_nbytes_match_the_formula(preset, bits_per_vector):
    codec = build(preset, head_dim=128, num_heads=2)
    enc = codec.encode(gaussian(2, 16, 128))
    assert enc.nbytes == 2 * bits_per_vector * 16 // 8


def test_iso_rate_preset_spends_octopus_bits():
    x = gaussian(64, 128, seed=6)
    for b, hi in [(2, 45), (3, 46), (4, 47)]:
        ours = build(f"tcq:bits={b},hi={hi},norm=32", head_dim=128).encode(x).effective_bits
        assert ours == build(f"octopus:b={b},joint=0", head_dim=128).encode(x).effective_bits


def test_gain_is_the_least_squares_scale():
    x = gaussian(64, 128, seed=7) * 3.0
    codec = build("tcq:bits=2,norm=32", head_dim=128, seed=1)
    enc = codec.encode(x)
    rot = codec.rotate_query(x)
    u_hat = codec.unit_from_codes(codec.unpack_codes(enc))
    err = lambda g: (rot - g.unsqueeze(-1) * u_hat).pow(2).sum(-1)  # noqa: E731
    gain = enc.tensors["gain"]
    for scale in (0.98, 1.02):
        assert bool((err(gain) <= err(gain * scale) + 1e-5).all())
    torch.testing.assert_close(codec.decode(enc), codec.unrotate(gain.unsqueeze(-1) * u_hat))


def test_fp16_gain_overflows_loudly():
    codec = build("tcq:bits=2", head_dim=64)
    with pytest.raises(CodecError, match="fp16"):
        codec.encode(gaussian(3, 64) * 1e7)
    assert build("tcq:bits=2,norm=32", head_dim=64).encode(gaussian(3, 64) * 1e7).tensors["gain"].dtype == torch.float32


def test_scores_in_the_rotated_domain():
    codec = build("tcq:bits=3", head_dim=64, num_heads=2, seed=3)
    k, q = gaussian(2, 9, 64, seed=1), gaussian(2, 4, 64, seed=2)
    enc = codec.encode(k)
    rotated = codec.rotate_query(q) @ codec.decode_rotated(enc).transpose(-1, -2)
    torch.testing.assert_close(rotated, codec.scores(q, enc), rtol=1e-5, atol=1e-4)


def test_values_are_coded_like_keys():
    cfg = CodecConfig.parse("tcq:bits=3,hi=8")
    assert build(cfg, head_dim=64).value_config(cfg) == cfg


@pytest.mark.parametrize("preset,match", [
    ("tcq:bits=4,hi=1,L=8", "L >= 9"), ("tcq:L=3", "L"), ("tcq:norm=8", "norm"), ("tcq:hi=-1", "hi"),
    ("tcq:bits=6", "bits"),
])
def test_bad_params_raise(preset, match):
    with pytest.raises(CodecError, match=match):
        CodecConfig.parse(preset)


def test_shapes_the_trellis_cannot_hold_raise():
    with pytest.raises(CodecError, match="hi=40 exceeds the 32"):
        build("tcq:hi=40", head_dim=64)
    with pytest.raises(CodecError, match="fewer than the L=12"):
        build("tcq:bits=1,L=12", head_dim=8)


def test_preset_prints_L():
    assert str(CodecConfig.parse("tcq:bits=2,l=8")) == "tcq:L=8,bits=2,hi=0,norm=16"


def test_default_L_follows_the_width():
    """Each width's own default L (mmkv.codecs.tcq.DEFAULT_L), written into the canonical preset, so a run folder or
    manifest of `tcq:bits=2` names the L it ran; an explicit L wins; `replace` keeps the resolved L."""
    assert [CodecConfig.parse(f"tcq:bits={b}")["L"] for b in (1, 2, 3, 4, 5)] == [8, 8, 9, 11, 11]
    assert str(CodecConfig.parse("tcq:bits=3,hi=46,norm=32")) == "tcq:L=9,bits=3,hi=46,norm=32"
    assert CodecConfig.parse("tcq:bits=3,L=11")["L"] == 11
    assert CodecConfig.parse("tcq:bits=2").replace(hi=45)["L"] == 8
    assert build("tcq:bits=2", head_dim=128).L == 8
