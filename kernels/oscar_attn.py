"""Fused split-K decode attention over OScaR-packed K and V (reference: `mmkv.codecs.oscar`, decode + SDPA).

Scores in the rotated domain, in the order of OScaR's `flash_fwd_kernel.h`: s_t = <H q, deq(k^_t)> n_t, the query
rotated once per call. K groups run along tokens as in KIVI, so this is the KIVI kernel (`kivi_attn.py`) with the
token norms. V is stored rotated (H v): the weighted sum is accumulated in the rotated domain and rotated back
once per output row, since H is linear and self-inverse.
"""

from __future__ import annotations

import torch

from mmkv.kernels.attn_splitk import apply_rotation, rotation_matrix
from mmkv.kernels.kivi_attn import KiviAttention


class OscarAttention(KiviAttention):
    """OScaR K (role=k) with OScaR V (role=v)."""

    name = "oscar"
    has_norm = True
    rotated_values = True

    def prepare(self, q: torch.Tensor, seg) -> torch.Tensor:
        return apply_rotation(q, rotation_matrix(seg.k_codec, "rotate_query", q.device), seg.k_enc.shape[1])

    def finish(self, out: torch.Tensor, seg) -> torch.Tensor:
        return apply_rotation(out, rotation_matrix(seg.v_codec, "unrotate", out.device), seg.v_enc.shape[1])


def attention_kernel(k_config, v_config) -> OscarAttention | None:
    if k_config.get("role") != "k" or v_config.name != "oscar" or v_config.get("role") != "v":
        return None
    return OscarAttention(k_config, v_config)
