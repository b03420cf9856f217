"""`mmkv.attention`: exact log-sum-exp merging, the gather, the score-estimator path and the kernel seam."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mmkv.attention as attn
import mmkv.codecs as codecs
from mmkv.attention import AttentionError, Segment
from mmkv.codecs.base import CodecConfig
from mmkv.codecs.identity import IdentityCodec

B, H, D = 2, 3, 16


def rand(gen: torch.Generator, tokens: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(B, H, tokens, D, generator=gen, dtype=torch.float64).to(dtype)


class ScaledKeyScores(IdentityCodec):
    """An identity codec whose score estimator reports q·(2k): lets a test see which path scored the keys."""

    name = "identity"
    has_scores = True

    def scores(self, q, enc):
        return 2.0 * torch.matmul(q.float(), enc.tensors["x"].float().transpose(-1, -2))


def identity_codec(cls=IdentityCodec):
    return cls(CodecConfig.parse("identity"), head_dim=D, num_heads=H)


def encoded_segment(codec, k, v, skip=0) -> Segment:
    return Segment(k_enc=codec.encode(k), v_enc=codec.encode(v), k_codec=codec, v_codec=codec, skip_tokens=skip)


def test_merge_lse_is_exact():
    gen = torch.Generator().manual_seed(0)
    q, k, v = rand(gen, 7), rand(gen, 23), rand(gen, 23)
    scale = 0.37
    parts = [attn.attention_lse(q, k[..., a:b, :], v[..., a:b, :], scale) for a, b in ((0, 5), (5, 6), (6, 23))]
    out, lse = attn.merge_lse(parts)
    full, full_lse = attn.attention_lse(q, k, v, scale)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(full, F.scaled_dot_product_attention(q, k, v, scale=scale), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(full_lse, torch.logsumexp(q @ k.transpose(-1, -2) * scale, -1), rtol=1e-12, atol=0)


def test_attention_lse_chunks_queries_exactly(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    q, k, v = rand(gen, 10), rand(gen, 9), rand(gen, 9)
    whole = attn.attention_lse(q, k, v, 0.25)
    monkeypatch.setattr(attn, "_SCORE_ELEMENTS", B * H * 9 * 3)  # 3 query rows per chunk
    chunked = attn.attention_lse(q, k, v, 0.25)
    torch.testing.assert_close(whole, chunked, rtol=1e-12, atol=1e-12)  # matmul blocking may differ by an ulp


def test_gather_equals_concatenation_bit_exact():
    gen = torch.Generator().manual_seed(2)
    codec = identity_codec()
    ks = [rand(gen, n, torch.float32) for n in (4, 6, 3)]
    vs = [rand(gen, n, torch.float32) for n in (4, 6, 3)]
    kc, vc = rand(gen, 2, torch.float32), rand(gen, 2, torch.float32)
    segs = [encoded_segment(codec, ks[0], vs[0]), encoded_segment(codec, ks[1], vs[1], skip=2), Segment(ks[2], vs[2])]
    k, v = attn.gather(segs, kc, vc, torch.float32)
    assert torch.equal(k, torch.cat([ks[0], ks[1][..., 2:, :], ks[2], kc], 2))
    assert torch.equal(v, torch.cat([vs[0], vs[1][..., 2:, :], vs[2], vc], 2))
    assert k.is_contiguous() and v.is_contiguous()


def test_gather_joins_runs_of_native_parts_in_one_cat_per_tensor(monkeypatch):
    """Consecutive native parts in the buffer's dtype are copied by one `torch.cat` a tensor (host work on every
    attention call); a native part in another dtype, or an encoded one, ends the run and takes the per-part path."""
    gen = torch.Generator().manual_seed(12)
    codec = identity_codec()
    ks = [rand(gen, n, torch.float32) for n in (2, 3, 1, 4, 2)]
    vs = [rand(gen, n, torch.float32) for n in (2, 3, 1, 4, 2)]
    ks[3], vs[3] = ks[3].double(), vs[3].double()  # another dtype: copied (and cast) on its own
    kc, vc = rand(gen, 2, torch.float32), rand(gen, 2, torch.float32)
    segs = [Segment(ks[0], vs[0]), Segment(ks[1], vs[1]), encoded_segment(codec, ks[2], vs[2]),
            Segment(ks[3], vs[3]), Segment(ks[4], vs[4])]
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **kw: cats.append(len(ts)) or real_cat(ts, *a, **kw))
    k, v = attn.gather(segs, kc, vc, torch.float32)
    monkeypatch.undo()
    assert cats == [2, 2, 2, 2]  # [native, native] and [native, current], for K and for V
    assert torch.equal(k, torch.cat([ks[0], ks[1], ks[2], ks[3].float(), ks[4], kc], 2))
    assert torch.equal(v, torch.cat([vs[0], vs[1], vs[2], vs[3].float(), vs[4], vc], 2))
    only_native = [Segment(a, b) for a, b in zip(ks[:3], vs[:3])]
    k, v = attn.gather(only_native, kc, vc, torch.float32)
    assert torch.equal(k, torch.cat([*ks[:3], kc], 2)) and torch.equal(v, torch.cat([*vs[:3], vc], 2))
    # parts that need gradients take the per-part copy, which differentiates
    kg = kc.clone().requires_grad_(True)
    k, v = attn.gather(only_native, kg, vc, torch.float32)
    k.sum().backward()
    assert torch.equal(k, torch.cat([*ks[:3], kc], 2)) and torch.equal(kg.grad, torch.ones_like(kc))


def test_decode_path_is_one_sdpa_call_over_the_concatenation():
    gen = torch.Generator().manual_seed(3)
    codec = identity_codec()
    k1, v1, k2, v2 = (rand(gen, 5, torch.float32) for _ in range(4))
    kc, vc, q = rand(gen, 3, torch.float32), rand(gen, 3, torch.float32), rand(gen, 4, torch.float32)
    out = attn.attend(q, [encoded_segment(codec, k1, v1), Segment(k2, v2)], kc, vc)
    assert torch.equal(out, F.scaled_dot_product_attention(q, torch.cat([k1, k2, kc], 2), torch.cat([v1, v2, vc], 2)))


def test_score_estimator_is_used_and_merged_exactly():
    gen = torch.Generator().manual_seed(4)
    codec = identity_codec(ScaledKeyScores)
    k1, v1, k2, v2 = (rand(gen, 5, torch.float32) for _ in range(4))
    kc, vc, q = rand(gen, 3, torch.float32), rand(gen, 3, torch.float32), rand(gen, 4, torch.float32)
    segs = [encoded_segment(codec, k1, v1), encoded_segment(codec, k2, v2, skip=1)]
    out = attn.attend(q, segs, kc, vc, backend="reference")
    # the estimator doubles the encoded keys' scores; the current block is scored exactly
    expected = F.scaled_dot_product_attention(
        q.double(), torch.cat([2 * k1, 2 * k2[..., 1:, :], kc], 2).double(), torch.cat([v1, v2[..., 1:, :], vc], 2).double()
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # "decode" ignores the estimator: plain SDPA over the decoded keys
    plain = attn.attend(q, segs, kc, vc, backend="decode")
    assert torch.equal(
        plain, F.scaled_dot_product_attention(q, torch.cat([k1, k2[..., 1:, :], kc], 2), torch.cat([v1, v2[..., 1:, :], vc], 2))
    )


@pytest.mark.parametrize("codec_name", [n for n in codecs.names() if codecs.get_codec_class(n).has_scores])
def test_score_codecs_estimate_close_to_their_decode(codec_name):
    """Each registered score-estimator codec, through the split path, stays near attention over its decode."""
    gen = torch.Generator().manual_seed(5)
    d = 64
    codec = codecs.build(codec_name, head_dim=d, num_heads=H, seed=1)
    k, v = torch.randn(B, H, 32, d, generator=gen), torch.randn(B, H, 32, d, generator=gen)
    q = torch.randn(B, H, 4, d, generator=gen) * 0.3
    seg = Segment(k_enc=codec.encode(k), v_enc=codec.encode(v), k_codec=codec, v_codec=codec)
    est = attn.attend(q, [seg], backend="reference")
    dec = attn.attend(q, [seg], backend="decode")
    assert not torch.equal(est, dec)  # the estimator really was used
    assert (est - dec).abs().max() < 0.5


def test_kernel_seam_dispatches_and_merges(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    codec = identity_codec()
    k1, v1, k2, v2 = (rand(gen, 5, torch.float32) for _ in range(4))
    q = rand(gen, 4, torch.float32)
    calls = []

    def kernel(q, segments, scale):  # protocol: attend the encoded segments, return (out, lse) in fp32
        calls.append(len(segments))
        k, v = attn.gather(segments, None, None, torch.float32)
        return attn.attention_lse(q, k, v, scale)

    monkeypatch.setattr(attn, "find_kernel", lambda kc, vc, device: kernel)
    out = attn.attend(q, [encoded_segment(codec, k1, v1), Segment(k2, v2)])
    assert calls == [1]
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)), rtol=1e-5, atol=1e-6
    )
    calls.clear()
    attn.attend(q, [encoded_segment(codec, k1, v1)], backend="reference")  # "reference" never asks for a kernel
    assert calls == []


def test_long_query_blocks_skip_a_kernel_with_max_queries(monkeypatch):
    """A kernel that declares `max_queries` is used for short query blocks only; a long block (a video chunk) goes
    through decode + one SDPA call, bit-identical to the reference path."""
    gen = torch.Generator().manual_seed(8)
    codec = identity_codec()
    k1, v1, k2, v2 = (rand(gen, 5, torch.float32) for _ in range(4))
    calls = []

    def kernel(q, segments, scale):
        calls.append(q.shape[-2])
        k, v = attn.gather(segments, None, None, torch.float32)
        return attn.attention_lse(q, k, v, scale)

    kernel.max_queries = 4
    monkeypatch.setattr(attn, "find_kernel", lambda kc, vc, device: kernel)
    segs = [encoded_segment(codec, k1, v1), Segment(k2, v2)]
    attn.attend(rand(gen, 4, torch.float32), segs)
    assert calls == [4]
    q_long = rand(gen, 9, torch.float32)
    out = attn.attend(q_long, segs)
    assert calls == [4]  # not called for 9 query rows
    assert torch.equal(out, attn.attend(q_long, segs, backend="reference"))


def test_no_kernel_on_cpu():
    codec = identity_codec()
    assert attn.find_kernel(codec, codec, torch.device("cpu")) is None


def test_errors():
    gen = torch.Generator().manual_seed(7)
    q = rand(gen, 2, torch.float32)
    with pytest.raises(AttentionError, match="unknown attention backend"):
        attn.attend(q, [Segment(rand(gen, 2, torch.float32), rand(gen, 2, torch.float32))], backend="flash")
    with pytest.raises(AttentionError, match="nothing to attend"):
        attn.attend(q, [])
    with pytest.raises(AttentionError, match="at least one"):
        attn.merge_lse([])


def test_default_scale_is_inverse_sqrt_head_dim():
    gen = torch.Generator().manual_seed(8)
    codec = identity_codec(ScaledKeyScores)
    k, v, q = rand(gen, 5, torch.float32), rand(gen, 5, torch.float32), rand(gen, 3, torch.float32)
    seg = encoded_segment(codec, k / 2, v)  # the estimator doubles it back: scores are exactly q·k
    out = attn.attend(q, [seg], backend="reference")
    ref = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(D))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_gather_copies_for_a_codec_whose_decode_takes_no_out():
    """A codec registered from elsewhere may implement `decode(enc, dtype)` without `out=`: the gather still works,
    decoding then copying."""
    from mmkv.attention import Segment, gather
    from mmkv.codecs import build

    class Plain:
        def __init__(self, inner):
            self.inner = inner

        def decode(self, enc, dtype=None):
            return self.inner.decode(enc, dtype)

    codec = build("groupquant:bits=4,group=16", head_dim=32, num_heads=2)
    x = torch.randn(1, 2, 5, 32, generator=torch.Generator().manual_seed(3))
    enc = codec.encode(x)
    k, v = gather([Segment(k_enc=enc, v_enc=enc, k_codec=Plain(codec), v_codec=Plain(codec))], x, x, torch.float32)
    assert torch.equal(k[..., :5, :], codec.decode(enc, torch.float32)) and torch.equal(k[..., 5:, :], x)


def test_gather_copies_for_a_decode_wrapper_without_out_set_on_an_instance():
    from mmkv.attention import Segment, gather
    from mmkv.codecs import build

    codec = build("groupquant:bits=4,group=16", head_dim=32, num_heads=2)
    x = torch.randn(1, 2, 5, 32, generator=torch.Generator().manual_seed(4))
    enc = codec.encode(x)
    calls = []
    original = codec.decode

    def counting(enc, dtype=None, _orig=original):
        calls.append(1)
        return _orig(enc, dtype)

    codec.decode = counting
    k, _ = gather([Segment(k_enc=enc, v_enc=enc, k_codec=codec, v_codec=codec)], None, None, torch.float32)
    assert len(calls) == 2 and torch.equal(k, original(enc, torch.float32))
