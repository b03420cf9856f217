"""CUDA graphs for a block's denoising calls: `rollout(..., cuda_graphs=True)`.

Why. In the frame-wise loop (one 1,560-token latent frame a model call, 105 calls a 21-frame rollout) the GPU waits on
the host at every layer, so the host's work a call is the rollout's time, and a codec's few extra launches and Python
a layer show one for one in the wall time (docs/perf.md, runs AA, AC and AD). Within one block the denoising calls
differ only in their input latents and timestep: the store is written by the commit pass alone, so every denoising
call of a block reads the same stored tensors at the same addresses, with the same shapes. One capture records such a
call's kernels; each later step replays them with one launch, and the host runs ahead to the next block while the GPU
works. The kernels and their arguments are the eager call's, so the outputs are the eager rollout's bit for bit;
`mmkv bench video --cuda-graphs` checks that on every row (`graphs_equal_eager`).

Measured (docs/perf.md, run AE, one H100): exact on every row, but no faster than the eager loop, which the removal of
the loop's own host syncs had already made bound by the GPU; so graphs are off by default, an option for a host too
slow to keep the GPU busy.

Rules, each for a reason:
- The first call of a rollout runs eagerly: it fills the cross-attention K/V cache (`CausalState.cross_kv`) that
  later calls read, and tensors made inside a capture hold nothing until a replay.
- A call runs eagerly the first time this process meets its signature (device, latent shape and dtype, start frame,
  the store's configuration and the layout of every layer's stored past): Triton compiles, cuDNN and cuBLAS make
  their plans and lazily built device tables appear in that eager call, none of which may happen inside a capture.
  It runs on the capture stream (as `torch.cuda.make_graphed_callables` warms up), so the handles and workspaces
  that the libraries keep per stream exist before the first capture on it.
- The store's own lazy work (joining encoded segments, `reuse_decoded`'s decode) is done before a capture, so no
  stored tensor is replaced by one the graph would only fill at replay.
- The block's last step runs eagerly when no graph exists yet (a capture costs the host as much as the call).
- A capture that fails (an op that waits for the GPU, a host-to-device copy from pageable memory) is ended, the call
  runs eagerly, and its signature is not captured again in this process (`FAILED` keeps why).
- A graph serves one block. The loop does not wait for the GPU between graphed blocks (block times come from CUDA
  events, and the noise and sigma copies do not sync: `mmkv.pipelines.common.to_device`), so a block's graph is kept
  until the next block ends and dropped once an event behind its replays has passed.
- With a KV observer attached (`mmkv inspect kv`) every call runs eagerly: the observer reads each call's tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# signatures this process has run eagerly (their kernels and plans exist), and the ones whose capture failed -> why
WARM: set[tuple] = set()
FAILED: dict[tuple, str] = {}
STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # the capture stream of each device


class GraphError(ValueError):
    """CUDA graphs asked for where they cannot run; the message says what would be accepted."""


def _stores(model) -> list[Any]:
    """The KV stores attached to the model's self-attention modules (one, normally)."""
    seen: dict[int, Any] = {}
    for m in model.transformer.modules():
        store = m.__dict__.get("mmkv_store")
        if store is not None:
            seen[id(store)] = store
    return list(seen.values())


def _observed(model) -> bool:
    return any(m.__dict__.get("mmkv_observer") is not None for m in model.transformer.modules())


def signature(model, x: torch.Tensor, start_frame: int) -> tuple:
    """What decides which kernels and plans a denoising call needs: the device, the latent shape and dtype, the start
    frame (RoPE) and, for each attached store, its configuration and every layer's stored past as (encoded, tokens,
    stack, skipped tokens) a segment. Two calls with one signature launch the same kernels on the same shapes.
    Reading the segments also does the store's lazy work (joining encoded segments, `reuse_decoded`'s decode) here,
    outside any capture, so that no stored tensor is replaced by one a graph would only fill when replayed."""
    stores = []
    for store in _stores(model):
        layers = tuple(tuple((s.encoded, s.num_tokens, s.stack, s.skip_tokens) for s in store.segments(layer))
                       for layer in range(store.num_layers))
        stores.append((repr(store.config), layers))
    return (str(x.device), x.dtype, tuple(x.shape), int(start_frame), model.dtype, tuple(stores))


class BlockGraphs:
    """Runs a rollout's denoising calls, capturing the first call of a block that may be captured as a CUDA graph and
    replaying it for the block's later steps (see the module docstring for when a call runs eagerly instead)."""

    def __init__(self, model, context: torch.Tensor):
        self.check_device(model)
        self.model = model
        self.context = context
        self.graph: Any = None  # the block's torch.cuda.CUDAGraph
        self.start_frame: int | None = None
        self.x = self.t = self.out = None
        self.retired: tuple | None = None  # the last block's graph, its buffers and an event behind its replays
        self.replayed = 0  # calls served by a replay (RolloutResult.graph_replays)
        self.marks = [self._event()]  # the rollout's start, then each block's end

    @staticmethod
    def check_device(model) -> None:
        if model.device.type != "cuda":
            raise GraphError(f"CUDA graphs need the model on a CUDA device, got {model.device}; run without them "
                             f"(cuda_graphs=False, no --cuda-graphs)")

    def denoise(self, x: torch.Tensor, t: float, start_frame: int, steps_left: int) -> torch.Tensor:
        """The flow prediction `model(x, t, context, start_frame=start_frame, mode="denoise")`, from the block's graph
        where there is one. `steps_left`: this step and the block's later ones."""
        if self.graph is None:
            model = self.model
            first = model.state.cache_cross_attn and not model.state.cross_kv
            key = None if first or steps_left < 2 or _observed(model) else signature(model, x, start_frame)
            call = lambda: model(x, t, self.context, start_frame=start_frame, mode="denoise")  # noqa: E731
            if key is not None and key not in WARM:  # on the capture stream, whose handles a capture then finds
                WARM.add(key)
                return self._on_side(call)
            if key is None or key in FAILED or not self._capture(x, start_frame, key):
                return call()
        elif start_frame != self.start_frame or x.shape != self.x.shape or x.dtype != self.x.dtype:
            raise GraphError(f"a block's graph was captured for frame {self.start_frame} and latents "
                             f"{tuple(self.x.shape)} {self.x.dtype}, called for frame {start_frame} and "
                             f"{tuple(x.shape)} {x.dtype}: end_block() must follow each block's commit")
        self.x.copy_(x)
        self.t.fill_(float(t))
        self._replay()
        self.replayed += 1
        return self.out

    def _capture(self, x: torch.Tensor, start_frame: int, key: tuple) -> bool:
        """Capture one denoising call; False (and the reason in FAILED) when the capture failed. The store's lazy work
        is already done: `signature` read every layer's segments."""
        self.x = torch.empty_like(x)
        self.t = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
        try:
            self.graph, self.out = self._record(
                lambda: self.model(self.x, self.t, self.context, start_frame=start_frame, mode="denoise"))
        except Exception as err:  # noqa: BLE001 - any failure inside a capture means: run this call eagerly
            FAILED[key] = f"{type(err).__name__}: {err}"
            self.x = self.t = None
            return False
        self.start_frame = int(start_frame)
        return True

    def _side(self) -> torch.cuda.Stream:
        """The process's capture stream for this device (one, so the cuBLAS and cuDNN handles and workspaces that the
        eager warm-up calls made on it are there for every capture)."""
        device = self.model.device
        if device not in STREAMS:
            STREAMS[device] = torch.cuda.Stream(device)
        return STREAMS[device]

    def _on_side(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`call()` run eagerly on the capture stream, ordered after the work queued so far and before what follows.
        Memory it frees is reused on that stream only after it has waited for the main stream again."""
        side, main = self._side(), torch.cuda.current_stream(self.model.device)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                return call()
        finally:
            main.wait_stream(side)

    def _record(self, call: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """(graph, its output tensor): `call` captured on the capture stream, not run."""
        graph = torch.cuda.CUDAGraph()
        side, main = self._side(), torch.cuda.current_stream(self.model.device)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = call()
                finally:
                    graph.capture_end()
        finally:
            main.wait_stream(side)
        return graph, out

    def _replay(self) -> None:
        self.graph.replay()

    def end_block(self) -> None:
        """Retire the block's graph and mark the block's end on the GPU's timeline. The loop does not wait for the GPU
        at the end of a graphed block, so the graph may still be replaying: it is kept, with an event recorded behind
        its work, until the next block ends, and dropped once that event has passed (the host then runs at most
        about a block ahead of the GPU)."""
        self.release()
        if self.graph is not None:
            self.retired = (self.graph, self.out, self.x, self.t, self._event())
        self.graph = self.out = self.x = self.t = None
        self.start_frame = None
        self.marks.append(self._event())

    def release(self) -> None:
        """Drop the retired graph, waiting for the GPU to have run its replays."""
        retired, self.retired = self.retired, None
        if retired is not None:
            retired[-1].synchronize()

    def finish(self) -> list[float]:
        """Wait for the GPU, drop the last graph, and return each block's seconds between its end marks."""
        self._sync()
        self.release()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]

    def _event(self) -> Any:
        """A timing event recorded on the current stream (behind the work queued so far)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.model.device))
        return event

    def _sync(self) -> None:
        torch.cuda.synchronize(self.model.device)
