"""Which Triton kernel encodes or decodes a codec's data: `lookup(op, codec) -> callable | None`.

Protocol (what `Codec.encode/decode` call when the input is on CUDA):
  encode: fn(codec, x, *, defer=None) -> Encoded
                                         x[..., T, D] already validated by `check_input`, any float dtype, on the
                                         kernel's device; returns the complete bundle (codec string, shape, dtype,
                                         tensors, meta) that the reference `codec.encode(x)` returns. Checks of
                                         the result that need a host sync go to `defer` when it is a list
                                         (`mmkv.codecs.base.check_or_defer`).
  decode: fn(codec, enc, dtype, *, out=None) -> Tensor
                                         enc already checked against the codec; returns [..., T, D] in `dtype`,
                                         written into `out` when given (rows evenly strided, unit channel
                                         stride: `mmkv.kernels.common.decode_out`; ValueError otherwise).
None means "use the torch reference": off CUDA, when triton is not installed, when the environment sets
MMKV_KERNELS=0, or when no kernel covers this codec or these parameters (each kernel module's `supports(codec)`).
Under TRITON_INTERPRET=1 the kernels run on CPU tensors through Triton's interpreter, which is what CI tests.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

OPS = ("encode", "decode")
# codec name -> kernel module stem (`kernels/<stem>_encode.py`, `kernels/<stem>_decode.py`)
KERNELS = {
    "groupquant": "groupquant",
    "kivi": "kivi",
    "octopus": "octopus",
    "octopus-qjl": "octopus_qjl",
    "oscar": "oscar",
    "polarquant": "polarquant",
    "qjl": "qjl",
    "qvg": "qvg",
    "turboquant-mse": "turboquant_mse",
    "turboquant-prod": "turboquant_prod",
}


def enabled() -> bool:
    """Kernels may run here: MMKV_KERNELS is not 0, triton imports, and there is CUDA (or the interpreter)."""
    if os.environ.get("MMKV_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return interpret or torch.cuda.is_available()


def lookup(op: str, codec) -> Callable | None:
    """The kernel for `op` ("encode" or "decode") of this codec instance, or None for the torch reference."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; expected one of {OPS}")
    stem = KERNELS.get(getattr(codec, "name", None))
    if stem is None or not enabled():
        return None
    module = importlib.import_module(f"mmkv.kernels.{stem}_{op}")
    if not module.supports(codec):
        return None
    return getattr(module, op)
