"""The command-line flags that configure the KV cache, defined once for every command that takes them
(`mmkv generate video`, `mmkv compare audio`, `mmkv bench video`). Each command picks the flags it has; the help
names its unit (latent frames, scales)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from mmkv import attention

_REUSE_HELP = (
    "decode each compressed unit once per rollout and keep the decode (same outputs bit for bit, much faster, but the "
    "decodes are held beside the compressed cache, so memory is not saved; default: decode on every attention call "
    "into one layer's scratch)"
)

def layer_indices(text: str) -> tuple[int, ...]:
    """`--protected-layers 0,-1` -> (0, -1); an empty value -> ()."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, e.g. 0,-1, got {text!r}") from None


# flag -> its add_argument keywords, given the unit's name (plural) and the command's default V group size
_FLAGS: dict[str, Callable[[str, int], dict[str, Any]]] = {
    "--codecs": lambda units, group: dict(
        action="append", default=[], metavar="LIST",
        help="comma-separated codec presets, e.g. 'octopus:b=3,kivi:bits=2,group=32' (repeatable; K/V pairs as "
             "KEY/VALUE)"),
    "--codec": lambda units, group: dict(
        action="append", default=[], metavar="PRESET",
        help="one codec preset (repeatable); `K/V` names the key and value codecs explicitly"),
    "--residual-window": lambda units, group: dict(
        type=int, default=1, metavar="N", help=f"newest {units} kept native per layer (default 1)"),
    "--value-group": lambda units, group: dict(
        type=int, default=group, help=f"V group size of single-name presets (default {group})"),
    "--reuse-decoded": lambda units, group: dict(action="store_true", help=_REUSE_HELP),
    "--protected-layers": lambda units, group: dict(
        type=layer_indices, default="", metavar="I,J", help="layers whose cache stays native (comma-separated, negative from the end)"),
    "--protected-units": lambda units, group: dict(
        type=int, default=0, metavar="N", help=f"first N {units} of every rollout kept native"),
    "--window": lambda units, group: dict(
        type=int, default=None, metavar="W",
        help=f"rolling attention window in {units}, Self-Forcing's local_attn_size: the block being generated and "
             f"the sink {units} included (default: global attention)"),
    "--sink": lambda units, group: dict(
        type=int, default=0, metavar="S",
        help=f"first S {units} never evicted by the rolling window (Self-Forcing sink_size); they are encoded like "
             "the others unless protected (--protected-units)"),
    "--codec-seed": lambda units, group: dict(
        type=int, default=0, help="seed of codec randomness (rotations); never the noise or sampling seed"),
    "--attention": lambda units, group: dict(
        choices=attention.BACKENDS, default="auto",
        help="attention over the compressed cache: auto (fused kernel on CUDA where one exists), reference or "
             "decode (see mmkv.attention)"),
}


def add_cache_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: tuple[str, ...], *,
                        units: str, value_group: int = 32) -> None:
    """Add `flags` (a subset of the cache flags, in that order) to `parser`; `units` names the unit in the help."""
    unknown = [f for f in flags if f not in _FLAGS]
    if unknown:
        raise ValueError(f"add_cache_arguments: unknown flags {unknown}; known: {', '.join(_FLAGS)}")
    for flag in flags:
        parser.add_argument(flag, **_FLAGS[flag](units, value_group))
