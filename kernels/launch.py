"""A cheaper host path for launching the codec kernels: `Kernel`, the `triton.jit` kernel that `mmkv.kernels.common.jit`
makes when Triton compiles (not under `TRITON_INTERPRET`).

Why. In the frame-wise video loop and in AAR rollouts the GPU waits on the host, and a codec adds a few Triton
launches to each layer's attention call (a decode for K and one for V). Triton 3.6's `JITFunction.run` does, at every
launch: read its knobs, bind and specialise the arguments, build a string cache key, check the kernel's globals, build
a `LazyDict` of launch metadata for the (empty) launch hooks, and go through `CudaLauncher.__call__`, which allocates
no scratch for these kernels but defines a closure to find that out. Only three of those steps decide *which* binary
runs: the device, the binder's specialisation (argument types, pointer alignment, the "equals 1" / "divisible by 16"
properties of specialised integers, constexpr values) and the launch options. `Kernel` keys its own table by exactly
those, fills it through `JITFunction.run` (so the first launch of each specialisation compiles and runs as Triton
would), and afterwards calls the compiled launcher's C entry point itself, with the same arguments that
`JITFunction.run` passes it.

What it leaves out, and when it falls back to `JITFunction.run`:
- the launch hooks (Triton's profiler, proton): whenever a hook is registered, every launch goes through Triton;
- kernels that need global or profile scratch, or take tensor descriptors: never cached (the codec kernels take
  neither);
- the check that a kernel's global constants have not changed since it compiled: the globals the codec kernels read
  are module constants;
- Triton's `debug` and `instrumentation_mode` knobs, which `run` adds to the options at every launch: a process keeps
  the binaries its first launches compiled (set those knobs before the first launch, or use
  `MMKV_TRITON_LAUNCH=triton`);
- `MMKV_TRITON_LAUNCH=triton` in the environment turns the cache off for the process (to compare, or to rule it out).
The kernel that runs and its arguments are the same either way, so outputs are bit-identical
(`tests/test_kernels_launch.py`; on CUDA, against `JITFunction.run`).
"""

from __future__ import annotations

import functools
import os

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

FAST = os.environ.get("MMKV_TRITON_LAUNCH", "fast") != "triton"
if os.environ.get("MMKV_TRITON_LAUNCH", "fast") not in ("fast", "triton"):
    raise ValueError(f"MMKV_TRITON_LAUNCH must be 'fast' or 'triton', got {os.environ['MMKV_TRITON_LAUNCH']!r}")

_ENTER = knobs.runtime.launch_enter_hook
_EXIT = knobs.runtime.launch_exit_hook


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _launcher_entry(kernel) -> tuple | None:
    """(C launch function, function handle, packed metadata, cooperative grid, PDL) of a compiled kernel whose launch
    needs nothing but its arguments, else None."""
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    if signature is None or any(str(t).startswith("tensordesc") for t in signature.values()):
        return None  # tensor descriptors go through a Python wrapper of the launch
    launcher = kernel.run  # the CudaLauncher, made by the kernel's first launch
    launch = getattr(launcher, "launch", None)
    if launch is None or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None  # another backend's launcher, or a kernel that needs scratch memory allocated at each launch
    return (launch, kernel.function, kernel.packed_metadata, launcher.launch_cooperative_grid, launcher.launch_pdl)


class Kernel(JITFunction):
    """`triton.jit`'s JITFunction, whose `kernel[grid](*args, **options)` launches through a table of compiled
    launchers keyed by (device, specialisation, options): see the module docstring."""

    def __init__(self, fn, **kwargs):
        super().__init__(fn, **kwargs)
        self.launchers: dict[tuple, tuple | None] = {}

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs):
        if not FAST or _ENTER.calls or _EXIT.calls:
            return self.run(*args, grid=grid, warmup=False, **kwargs)
        device = _current_device()
        bound, spec, options = self.device_caches[device][4](*args, **kwargs)  # Triton's own binder
        try:
            key = (device, *spec, *options.items())
            entry = self.launchers.get(key, False)
        except TypeError:  # an unhashable constexpr: leave it to Triton
            return self.run(*args, grid=grid, warmup=False, **kwargs)
        if entry is False:
            kernel = self.run(*args, grid=grid, warmup=False, **kwargs)
            self.launchers[key] = _launcher_entry(kernel)
            return kernel
        if entry is None:
            return self.run(*args, grid=grid, warmup=False, **kwargs)
        launch, function, metadata, cooperative, pdl = entry
        if callable(grid):
            grid = grid(bound)
        n = len(grid)
        launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _current_stream(device), function,
               cooperative, pdl, None, None, metadata, None, None, None, *bound.values())
        return None
