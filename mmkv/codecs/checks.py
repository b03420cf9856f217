"""Where a codec's validity checks go while it encodes.

Some checks have their answer on the device (a NaN/Inf in the input, side information overflowing fp16): reading one
is a host sync. A caller that encodes many tensors at once (`mmkv.cache.KVStore.append`) opens an `encode_scope`:
inside it the encoders skip the input scan it has already done (`inputs_checked`) and hand their device-side checks
to it (`collect`) to be read together, in one sync. Outside any scope every check is read at once, so a plain
`codec.encode(x)` is fully checked. The codec protocol carries none of this."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from mmkv.codecs.config import CodecError


@dataclass
class _Scope:
    inputs_checked: bool
    pending: list | None  # (bad flag, message) pairs the scope's owner reads; None: read each check at once


_SCOPE: ContextVar[_Scope | None] = ContextVar("mmkv_encode_scope", default=None)


@contextmanager
def encode_scope(*, inputs_checked: bool = False, collect: bool = False) -> Iterator[list | None]:
    """Encodes inside skip their NaN/Inf input scan when `inputs_checked` (the caller scanned), and with `collect`
    append their device-side checks as (bad flag, message) to the yielded list, which the caller must read before
    using the results. A scope replaces any outer one for its duration."""
    token = _SCOPE.set(_Scope(inputs_checked, [] if collect else None))
    try:
        yield _SCOPE.get().pending
    finally:
        _SCOPE.reset(token)


def inputs_checked() -> bool:
    """Whether the active scope's owner has already scanned the inputs for NaN/Inf."""
    scope = _SCOPE.get()
    return scope is not None and scope.inputs_checked


def in_scope() -> bool:
    """Whether any `encode_scope` is active (a plain `codec.encode(x)` call has none)."""
    return _SCOPE.get() is not None


def collecting() -> bool:
    """Whether device-side checks are collected for later (then a message should not keep large tensors alive)."""
    scope = _SCOPE.get()
    return scope is not None and scope.pending is not None


def check_or_defer(bad: torch.Tensor, message: Callable[[], str]) -> None:
    """A validity check whose answer lives on the device: `bad` is a 0-d bool tensor. Collected by the active scope
    when it collects; otherwise read now (a host sync), raising `CodecError(message())` if set."""
    scope = _SCOPE.get()
    if scope is not None and scope.pending is not None:
        scope.pending.append((bad, message))
    elif bool(bad):
        raise CodecError(message())
