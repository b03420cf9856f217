"""The device-side checks of an append (NaN/Inf in the units being encoded, side information overflowing fp16),
read either at once (`eager`: one host sync per append) or later, without a sync (`lagged`, see `CacheConfig.checks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mmkv.cache.config import KVCacheError
from mmkv.cache.segments import Seg


def nonfinite(leaving: list[int], natives: dict[int, Seg], new: dict[int, tuple[torch.Tensor, torch.Tensor]]
              ) -> torch.Tensor | None:
    """A 0-d bool tensor: does any K/V element of the units about to be encoded hold NaN/Inf? One reduction for
    the whole append instead of one scan (and host sync) per codec call; None when there is nothing to scan
    (no units, or the planner's shape-only tensors). When it is set the codecs scan again and the first one to find
    a NaN/Inf names it."""
    tensors = [t for u in leaving for t in (new[u] if u in new else (natives[u].k, natives[u].v))]
    if not tensors or tensors[0].device.type == "meta":
        return None
    # A float64 sum of fp32 / bf16 / fp16 values is finite exactly when they all are (no sum of finite ones can
    # reach 1.8e308, and a NaN or an infinity propagates), so one reduction a tensor and two ops on the total
    # decide it: 5 launches an append of one unit's K and V, against 13 for `isfinite(t).all()` a tensor
    # (`isfinite` is four elementwise ops).
    sums = [t.sum(dtype=torch.float64) for t in tensors]
    total = sums[0] if len(sums) == 1 else sums[0] + sums[1] if len(sums) == 2 else torch.stack(sums).sum()
    return (total - total) != 0  # inf - inf and NaN - NaN are NaN, and NaN != 0


@dataclass
class _Pending:
    """The device-side checks of one append, read later (CacheConfig.checks = "lagged")."""

    layer: int
    units: list[int]
    flags: torch.Tensor  # host copy (pinned on CUDA): [store NaN/Inf flag, encoder checks...]
    event: Any  # torch.cuda.Event recorded after the copy, or None (CPU: ready at once)
    messages: list[Callable[[], str]]  # an encoder check's message, one per flag after the first


class CheckQueue:
    """Lagged checks not read yet, oldest first; once one fails, every later call raises until the store resets."""

    def __init__(self, mode: str):
        self.mode = mode
        self._pending: list[_Pending] = []
        self._invalid: str | None = None  # a lagged check failed: the message every later call raises

    def lagged(self, device: torch.device) -> bool:
        return self.mode == "lagged" or (self.mode == "auto" and device.type == "cuda")

    def defer(self, layer: int, units: list[int], flags: torch.Tensor, messages: list[Callable[[], str]]) -> None:
        """Queue an append's checks ([store NaN/Inf flag, one flag per message]): copied to pinned host memory
        behind the work that computes them, with an event that says when the copy has landed (no host sync)."""
        event = None
        if flags.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flags.device))
        else:
            host = flags
        self._pending.append(_Pending(layer, units, host, event, messages))

    def poll(self, block: bool = False) -> None:
        """Read the checks whose copies have landed (all of them with `block`, waiting for each one's own event, not
        for the whole device); raise KVCacheError on the first that failed, and on every call after it."""
        if self._invalid is not None:
            raise KVCacheError(self._invalid)
        while self._pending:
            p = self._pending[0]
            if p.event is not None:
                if block:
                    p.event.synchronize()
                elif not p.event.query():
                    return
            self._pending.pop(0)
            flags = p.flags.tolist()
            if flags[0]:
                problem = "hold NaN/Inf values"
            else:
                problem = next((message() for message, bad in zip(p.messages, flags[1:]) if bad), None)
            if problem is not None:
                self._pending.clear()
                self._invalid = (
                    f"KVStore (checks={self.mode!r}): units {p.units} of layer {p.layer}, encoded at an "
                    f"earlier append, failed a check read after they were stored: {problem}. This rollout's cache is "
                    f"invalid: reset() starts a new one (CacheConfig(checks='eager') refuses such an append before "
                    f"storing anything, at one host sync per append)"
                )
                raise KVCacheError(self._invalid)
