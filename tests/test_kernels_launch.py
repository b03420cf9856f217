"""`mmkv.kernels.launch.Kernel`: the codec kernels' launch table (kernels/launch.py).

On the CPU the table's bookkeeping is checked with a fake binder and launcher (the compiled path needs a GPU); on
CUDA a codec's decode through the table equals its decode through `JITFunction.run` bit for bit."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from mmkv.kernels import launch as L  # noqa: E402


def probe(x_ptr, T, BT):  # a kernel body is never traced here
    pass


class FakeCompiled:
    def __init__(self, calls, scratch=0, signature=None):
        self.function = 7
        self.packed_metadata = (4, 1, 0)
        self.src = types.SimpleNamespace(signature=signature or {"x_ptr": "*bf16", "T": "i32", "BT": "constexpr"})
        self.run = types.SimpleNamespace(launch=lambda *a: calls.append(("launch", a)), global_scratch_size=scratch,
                                         profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False)


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(L, "FAST", True)
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_current_stream", lambda device: 123)
    k = L.Kernel(probe, do_not_specialize=["T"])
    calls: list = []
    k.calls = calls

    def binder(x, T, BT, **options):  # Triton's binder: the bound arguments, the specialisation, the options
        return {"x_ptr": x, "T": T, "BT": BT}, [("*bf16", "D" if x % 16 == 0 else ""), ("i32", ""),
                                                   ("constexpr", BT)], options

    k.device_caches = {0: (None, None, None, None, binder)}
    k.scratch = 0

    def run(*args, grid, warmup, **kwargs):
        calls.append(("run", args, grid))
        return FakeCompiled(calls, scratch=k.scratch)

    k.run = run
    return k


def test_first_launch_goes_through_triton_and_later_ones_through_the_table(kernel):
    kernel[(3, 2)](4096, 10, BT=64, num_warps=4)
    assert [c[0] for c in kernel.calls] == ["run"]
    kernel[(5,)](8192, 11, BT=64, num_warps=4)
    assert kernel.calls[-1] == ("launch", (5, 1, 1, 123, 7, False, False, None, None, (4, 1, 0), None, None, None,
                                           8192, 11, 64))
    kernel[lambda bound: (bound["T"], 2, 3)](8192, 12, BT=64, num_warps=4)
    assert kernel.calls[-1][1][:3] == (12, 2, 3)
    assert len(kernel.launchers) == 1


def test_a_new_specialisation_or_option_compiles_through_triton(kernel):
    kernel[(1,)](4096, 10, BT=64, num_warps=4)
    kernel[(1,)](4100, 10, BT=64, num_warps=4)  # a pointer off 16-byte alignment: another binary
    kernel[(1,)](4096, 10, BT=128, num_warps=4)  # another constexpr
    kernel[(1,)](4096, 10, BT=64, num_warps=8)  # another option
    assert [c[0] for c in kernel.calls] == ["run"] * 4
    assert len(kernel.launchers) == 4
    kernel[(1,)](4100, 99, BT=64, num_warps=4)
    assert kernel.calls[-1][0] == "launch"


def test_hooks_scratch_and_the_switch_fall_back_to_triton(kernel, monkeypatch):
    kernel[(1,)](4096, 10, BT=64)
    hook = lambda metadata: None  # noqa: E731
    L._ENTER.add(hook)
    try:
        kernel[(1,)](4096, 10, BT=64)
    finally:
        L._ENTER.remove(hook)
    assert [c[0] for c in kernel.calls] == ["run", "run"]
    monkeypatch.setattr(L, "FAST", False)
    kernel[(1,)](4096, 10, BT=64)
    assert kernel.calls[-1][0] == "run"
    monkeypatch.setattr(L, "FAST", True)
    kernel.scratch = 256  # a kernel that needs scratch memory is never cached
    kernel[(1,)](4096, 10, BT=32)
    kernel[(1,)](4096, 10, BT=32)
    assert [c[0] for c in kernel.calls[-2:]] == ["run", "run"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["groupquant:bits=2,group=32", "turboquant-mse:b=2", "octopus:b=2"])
def test_decode_through_the_table_is_triton_launch_bit_for_bit(preset, monkeypatch):
    from mmkv.codecs import build

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4, 300, 128, device="cuda", generator=g).to(torch.bfloat16)
    codec = build(preset, head_dim=128, num_heads=4, seed=0)
    outs = []
    for fast in (False, True, True):
        monkeypatch.setattr(L, "FAST", fast)
        enc = codec.encode(x)
        outs.append((enc, codec.decode(enc, torch.bfloat16)))
    for enc, y in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(enc.tensors.values(), outs[0][0].tensors.values()))
        assert torch.equal(y, outs[0][1])
