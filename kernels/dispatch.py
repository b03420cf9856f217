"""The kernel registry: which Triton kernel encodes, decodes or attends over a codec's data.

`KERNELS` is the one table: codec name -> the kernel module (under `mmkv.kernels`) of each op it has. Modules are
imported only when a kernel is first asked for, so importing `mmkv.kernels` never needs Triton or a GPU.
`MMKV_KERNELS=0` (or false/off/no) turns every kernel off (`kernels_off`, the one place that reads it).

Importing this module installs `lookup` in `mmkv.codecs.base` (the `mmkv` package imports it), so codecs never
import kernels. Protocol (what `Codec.encode/decode` call on CUDA; each module also has `supports(codec)`):
  encode: fn(codec, x) -> Encoded
                                         x[..., T, D] already validated by `check_input`, any float dtype, on the
                                         kernel's device; returns the complete bundle (codec string, shape, dtype,
                                         tensors, meta) that the reference `codec.encode(x)` returns. Checks of
                                         the result that need a host sync go through
                                         `mmkv.codecs.checks.check_or_defer` (read now, or by the caller's
                                         `encode_scope`).
  decode: fn(codec, enc, dtype, *, out=None) -> Tensor
                                         enc already checked against the codec; returns [..., T, D] in `dtype`,
                                         written into `out` when given (rows evenly strided, unit channel
                                         stride: `mmkv.kernels.common.decode_out`; ValueError otherwise).
  attention: attention_kernel(k_config, v_config) -> None or kernel(q, segments, scale) -> (out, lse)
                                         fused split-K decode attention over encoded segments, for the key codec's
                                         module and the value codecs it names (`mmkv.attention.find_kernel`).
None means "use the torch reference": off CUDA, when triton is not installed, when MMKV_KERNELS=0, or when no
kernel covers this codec or these parameters. Under TRITON_INTERPRET=1 the kernels run on CPU tensors through
Triton's interpreter, which is what CI tests.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

from mmkv.codecs.base import use_kernels

OPS = ("encode", "decode")
KERNELS: dict[str, dict[str, str]] = {
    "groupquant": {"encode": "groupquant_encode", "decode": "groupquant_decode"},
    "kivi": {"encode": "kivi_encode", "decode": "kivi_decode", "attention": "kivi_attn"},
    "octopus": {"encode": "octopus_encode", "decode": "octopus_decode", "attention": "octopus_attn"},
    # OCTOPUS's kernels have a QJL branch, taken for a codec with a residual sketch
    "octopus-qjl": {"encode": "octopus_encode", "decode": "octopus_decode"},
    "oscar": {"encode": "oscar_encode", "decode": "oscar_decode", "attention": "oscar_attn"},
    "polarquant": {"encode": "polarquant_encode", "decode": "polarquant_decode"},
    "qjl": {"encode": "qjl_encode", "decode": "qjl_decode"},
    "qvg": {"encode": "qvg_encode", "decode": "qvg_decode"},
    "turboquant-mse": {"encode": "turboquant_mse_encode", "decode": "turboquant_mse_decode",
                       "attention": "turboquant_mse_attn"},
    "turboquant-prod": {"encode": "turboquant_prod_encode", "decode": "turboquant_prod_decode"},
    "tcq": {"encode": "tcq_encode", "decode": "tcq_decode", "attention": "tcq_attn"},
}


def kernels_off() -> bool:
    """MMKV_KERNELS is set to 0, false, off or no."""
    return os.environ.get("MMKV_KERNELS", "1").strip().lower() in ("0", "false", "off", "no")


def enabled() -> bool:
    """Kernels may run here: MMKV_KERNELS is not 0, triton imports, and there is CUDA (or the interpreter)."""
    if kernels_off():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return interpret or torch.cuda.is_available()


def module(name: str, op: str):
    """The kernel module for `op` of codec `name` (imported now), or None when the codec has no such kernel."""
    stem = KERNELS.get(name, {}).get(op)
    return None if stem is None else importlib.import_module(f"mmkv.kernels.{stem}")


def lookup(op: str, codec) -> Callable | None:
    """The kernel for `op` ("encode" or "decode") of this codec instance, or None for the torch reference. Asked at
    every encode and decode, so the answer is kept on the instance for each value of MMKV_KERNELS (what else it
    depends on, Triton and CUDA being there and the codec's config, does not change in a process)."""
    memo = codec.__dict__.setdefault("_kernel_lookup", {})
    key = (op, os.environ.get("MMKV_KERNELS"))
    found = memo.get(key, memo)
    if found is not memo:
        return found
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; expected one of {OPS}")
    if op not in KERNELS.get(codec.name, {}) or not enabled():
        found = None
    else:
        mod = module(codec.name, op)
        found = getattr(mod, op) if mod.supports(codec) else None
    memo[key] = found
    return found


def attention_kernel(k_config, v_config):
    """A fused attention callable `kernel(q, segments, scale) -> (out, lse)` for this (K, V) codec config pair, or
    None when there is none (the torch reference then runs). MMKV_KERNELS=0 turns kernels off; without Triton there
    are none."""
    if kernels_off() or "attention" not in KERNELS.get(k_config.name, {}):
        return None
    try:
        mod = module(k_config.name, "attention")
    except ModuleNotFoundError as err:
        if err.name == "triton":
            return None
        raise
    return mod.attention_kernel(k_config, v_config)


use_kernels(lookup)  # what `Codec.encode/decode` ask for CUDA tensors
