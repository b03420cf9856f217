"""Triton kernels, each beside the torch reference it must match (installed as `mmkv.kernels`).

* `<codec>_encode.py` / `<codec>_decode.py`: encode and decode-to-bf16 kernels that `Codec.encode` / `Codec.decode`
  use for CUDA tensors.
* `<codec>_attn.py`: fused split-K decode attention over encoded segments, the seam `mmkv.attention.find_kernel`
  calls on CUDA.

`dispatch.py` is the one registry of which kernel serves which codec. Submodules are imported only when used, so
importing `mmkv.kernels` never needs Triton or a GPU.
"""

from __future__ import annotations

from mmkv.kernels.dispatch import attention_kernel  # noqa: F401
