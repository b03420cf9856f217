"""Triton kernels, each beside the torch reference it must match (installed as `mmkv.kernels`).

* `<codec>_encode.py` / `<codec>_decode.py` with `dispatch.lookup(op, codec)`: encode and decode-to-bf16 kernels that
  `Codec.encode` / `Codec.decode` use for CUDA tensors.
* `<codec>_attn.py` with `attention_kernel(k_config, v_config)`: fused split-K decode attention over encoded segments,
  the seam `mmkv.attention.find_kernel` calls on CUDA.

Submodules are imported only when used, so importing `mmkv.kernels` never needs Triton or a GPU.
"""

from __future__ import annotations

import importlib
import os

# Key codec -> the module holding its fused attention kernel (paired with the value codecs it names).
ATTENTION_MODULES = {
    "kivi": "mmkv.kernels.kivi_attn",
    "octopus": "mmkv.kernels.octopus_attn",
    "oscar": "mmkv.kernels.oscar_attn",
    "turboquant-mse": "mmkv.kernels.turboquant_mse_attn",
}


def attention_kernel(k_config, v_config):
    """A fused attention callable `kernel(q, segments, scale) -> (out, lse)` for this (K, V) codec config pair, or
    None when there is none (the torch reference then runs). MMKV_KERNELS=0 turns kernels off; without Triton there
    are none."""
    if os.environ.get("MMKV_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):  # as dispatch.enabled
        return None
    module = ATTENTION_MODULES.get(k_config.name)
    if module is None:
        return None
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == "triton":
            return None
        raise
    return mod.attention_kernel(k_config, v_config)
