"""CUDA graphs for a block's denoising calls (`rollout(..., cuda_graphs=True)`, pipelines/wan/graphs.py): refused
off CUDA with a one-line reason; the signature that decides whether a call may be captured names the block and the
store's layout; and on CUDA, a graphed rollout's latents are the eager rollout's bit for bit."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from mmkv.cache import CacheConfig, KVStore
from mmkv.pipelines.common import NoiseStream
from mmkv.pipelines.wan import graphs, loop
from mmkv.pipelines.wan.graphs import GraphError, signature
from mmkv.pipelines.wan.loop import get_preset, rollout
from mmkv.pipelines.wan.tiny import TINY_DIT, tiny_dit

LAT_H, LAT_W = 4, 6


def make_store(codec, window=1):
    return KVStore(CacheConfig(codec=codec, residual_window=window), num_layers=TINY_DIT["num_layers"],
                   num_heads=TINY_DIT["num_attention_heads"], head_dim=TINY_DIT["attention_head_dim"])


def run(dit, context, preset, store, frames, graphs=False, on_block=None):
    store.reset()
    with torch.no_grad(), store.attach(dit.transformer):
        return rollout(dit, preset, context, NoiseStream(0, 0), num_frames=frames, latent_height=LAT_H,
                       latent_width=LAT_W, on_block=on_block, cuda_graphs=graphs)


@pytest.mark.usefixtures("one_thread")
def test_graphs_off_cuda_are_refused_with_the_reason(dit, context):
    with pytest.raises(GraphError, match="CUDA graphs need the model on a CUDA device, got cpu; run without them"):
        run(dit, context, get_preset("causal-forcing-frame"), make_store(None), 3, graphs=True)


@pytest.mark.usefixtures("one_thread")
def test_the_signature_names_the_block_and_the_stores_layout(dit, context):
    """Each block of a rollout has its own signature, a second rollout of the same settings meets the same ones in
    order (so its calls may be captured), and another codec or window gives others."""
    preset = get_preset("causal-forcing-frame")

    def signatures(codec, window=1):
        store, seen = make_store(codec, window), []
        x = torch.zeros(1, 1, TINY_DIT["in_channels"], LAT_H, LAT_W)

        def note(b, _n):
            seen.append(signature(dit, x, b + 1))
        run(dit, context, preset, store, 5, on_block=note)
        return seen

    first = signatures("groupquant:bits=2,group=8")
    assert len(set(first)) == len(first) == 5
    assert signatures("groupquant:bits=2,group=8") == first
    assert not set(signatures("groupquant:bits=4,group=8")) & set(first)
    assert not set(signatures("groupquant:bits=2,group=8", window=2)) & set(first)
    assert not set(signatures(None)) & set(first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
@pytest.mark.parametrize("name", ["causal-forcing-frame", "causvid"])
@pytest.mark.parametrize("codec", [None, "kivi:bits=2,group=32", "octopus:b=2", "qvg:bits=2,block=16"])
def test_a_graphed_rollout_is_the_eager_one_bit_for_bit(name, codec):
    """On the GPU in bf16, through the Triton kernels: two graphed rollouts after an eager one (the first graphed
    rollout captures the calls the eager one warmed, the second every call after the rollout's first), each equal
    to the eager rollout bit for bit, with most calls replayed."""
    dit = tiny_dit(seed=3, config=dict(TINY_DIT, attention_head_dim=128)).to("cuda", torch.bfloat16)
    context = torch.randn(1, 16, TINY_DIT["text_dim"], generator=torch.Generator().manual_seed(11)).to("cuda",
                                                                                                      torch.bfloat16)
    preset = get_preset(name)
    frames = 6 * preset.frames_per_block
    store = KVStore(CacheConfig(codec=codec, residual_window=1), num_layers=TINY_DIT["num_layers"],
                    num_heads=TINY_DIT["num_attention_heads"], head_dim=128)
    eager = run(dit, context, preset, store, frames)
    for _ in range(2):
        graphed = run(dit, context, preset, store, frames, graphs=True)
        assert torch.equal(graphed.latents, eager.latents)
    steps = len(preset.schedules()[1])
    assert graphed.graph_replays == (frames // preset.frames_per_block) * steps - 1
    # the loop itself never waits for the GPU (noise and sigma copies through pinned memory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(dit, context, preset, store, frames, graphs=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    loop_syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
                  and w.filename.endswith(("pipelines/common.py", "wan/loop.py", "wan/graphs.py"))]
    assert not loop_syncs


class ReplayByRunning(graphs.BlockGraphs):
    """The graph logic on the CPU: `_record` keeps the call and runs it once for its output buffer, `_replay` runs it
    again into that buffer. What it checks is the bookkeeping around a real capture: which calls are captured, which
    replayed, which run eagerly, and that replays read the step's latents and timestep."""

    fail = False
    side_calls = 0

    @staticmethod
    def check_device(model) -> None:
        pass

    def _record(self, call):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return call, call().clone()

    def _replay(self) -> None:
        self.out.copy_(self.graph())

    def _on_side(self, call):
        self.side_calls += 1
        return call()

    def _event(self):
        return Clock()

    def _sync(self) -> None:
        pass


class Clock:
    """A stand-in for a CUDA timing event: the host's clock when made."""

    def __init__(self):
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: "Clock") -> float:
        return (later.at - self.at) * 1e3


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["causal-forcing-frame", "causvid", "causal-forcing-frame-2step"])
def test_the_block_graph_bookkeeping_on_the_cpu(dit, context, monkeypatch, name):
    monkeypatch.setattr(loop, "BlockGraphs", ReplayByRunning)
    monkeypatch.setattr(graphs, "WARM", set())
    monkeypatch.setattr(graphs, "FAILED", {})
    preset = get_preset(name)
    frames = 4 * preset.frames_per_block
    store = make_store("groupquant:bits=2,group=8")
    eager = run(dit, context, preset, store, frames)
    first, rest = (len(s) for s in preset.schedules())
    cold = run(dit, context, preset, store, frames, graphs=True)
    warm = run(dit, context, preset, store, frames, graphs=True)
    assert torch.equal(cold.latents, eager.latents) and torch.equal(warm.latents, eager.latents)
    assert len(warm.block_seconds) == 4 and min(warm.block_seconds) > 0
    # cold: block 0 runs two calls eagerly (the rollout's first, then the first of its signature); later blocks one
    # each where two or more steps are left after it
    later = 3 * (rest - 1 if rest - 1 >= 2 else 0)
    assert cold.graph_replays == (first - 2 if first - 2 >= 2 else 0) + later
    # warm: every call but the rollout's first, in blocks of two or more steps
    assert warm.graph_replays == (first - 1 if first - 1 >= 2 else 0) + 3 * (rest if rest >= 2 else 0)
    assert not graphs.FAILED
    ReplayByRunning.fail = True
    try:
        failed = run(dit, context, preset, make_store("groupquant:bits=4,group=8"), frames, graphs=True)
        again = run(dit, context, preset, make_store("groupquant:bits=4,group=8"), frames, graphs=True)
    finally:
        ReplayByRunning.fail = False
    want = run(dit, context, preset, make_store("groupquant:bits=4,group=8"), frames)
    assert failed.graph_replays == again.graph_replays == 0
    assert torch.equal(failed.latents, want.latents) and torch.equal(again.latents, want.latents)
    assert graphs.FAILED and all("not permitted when stream is capturing" in r for r in graphs.FAILED.values())
