"""The codec registry: codecs by name, built from a preset string or a config.

A built-in codec is one line of `BUILTIN` (its name and the `module:Class` defining it); the module is imported on
first use. `register` / `registered` add a codec class defined elsewhere (a plugin, a test).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from mmkv.codecs.config import CodecConfig, CodecError

if TYPE_CHECKING:
    from mmkv.codecs.base import Codec

# In the order report tables list codecs: baselines first, then the rotation and sketch codecs, OCTOPUS last.
BUILTIN: dict[str, str] = {
    "identity": "mmkv.codecs.identity:IdentityCodec",
    "groupquant": "mmkv.codecs.groupquant:GroupQuantCodec",
    "kivi": "mmkv.codecs.kivi:KiviCodec",
    "qvg": "mmkv.codecs.qvg:QVGCodec",
    "qjl": "mmkv.codecs.qjl:QJLCodec",
    "turboquant-mse": "mmkv.codecs.turboquant_mse:TurboQuantMSECodec",
    "polarquant": "mmkv.codecs.polarquant:PolarQuantCodec",
    "oscar": "mmkv.codecs.oscar:OscarCodec",
    "octopus": "mmkv.codecs.octopus:OctopusCodec",
    "octopus-qjl": "mmkv.codecs.octopus_qjl:OctopusQJLCodec",
    "turboquant-prod": "mmkv.codecs.turboquant_prod:TurboQuantProdCodec",
    "tcq": "mmkv.codecs.tcq:TCQCodec",
}

_ADDED: dict[str, type["Codec"]] = {}
_LOADED: dict[str, type["Codec"]] = {}


def register(cls: type["Codec"]) -> type["Codec"]:
    """Make a codec class available by its name (usable as a class decorator); `registered` undoes it after."""
    name = cls.config_class.name
    if not name:
        raise TypeError(f"{cls.__name__} has no codec name (its config_class {cls.config_class.__name__} has none)")
    if name in BUILTIN:
        raise TypeError(f"{cls.__name__}: {name!r} is a built-in codec's name")
    _ADDED[name] = cls
    return cls


@contextmanager
def registered(cls: type["Codec"]) -> Iterator[type["Codec"]]:
    """`register(cls)` for the duration of a `with` block."""
    register(cls)
    try:
        yield cls
    finally:
        _ADDED.pop(cls.config_class.name, None)


def get_codec_class(name: str) -> type["Codec"]:
    if name in _ADDED:
        return _ADDED[name]
    if name not in BUILTIN:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(names())}")
    if name not in _LOADED:
        module, _, attr = BUILTIN[name].partition(":")
        _LOADED[name] = getattr(importlib.import_module(module), attr)
    return _LOADED[name]


def names() -> list[str]:
    """Every registered codec's name, sorted."""
    return sorted({*BUILTIN, *_ADDED})


def table_order() -> list[str]:
    """Codec names in the order report tables list them (built-ins in `BUILTIN`'s order, then the added ones)."""
    return [*BUILTIN, *_ADDED]


def display_name(name: str) -> str:
    """A codec's display name (`OCTOPUS`, `KIVI`), or `name` itself for a codec that is not registered."""
    try:
        return get_codec_class(name).display_name
    except CodecError:
        return name


def build(config: "str | CodecConfig", *, head_dim: int, num_heads: int = 1, layer: int = 0, seed: int = 0
          ) -> "Codec":
    """Build a codec instance for one layer (and its `num_heads` KV heads) from a preset or config."""
    cfg = CodecConfig.parse(config)
    return get_codec_class(cfg.name)(cfg, head_dim=head_dim, num_heads=num_heads, layer=layer, seed=seed)


def kv_configs(preset: "str | CodecConfig", value_group: int = 32) -> tuple[CodecConfig, CodecConfig]:
    """The (K, V) codec configs a rollout preset stands for.

    `KEY/VALUE` names both explicitly (`octopus:b=2/groupquant:bits=2,group=16`); a single preset names the key codec
    and the value codec it pairs with in its paper's recipe (`Codec.value_config`), with `value_group` channels per
    value group (32 for video, 16 for audio).
    """
    if isinstance(preset, str) and "/" in preset:
        k_text, _, v_text = preset.strip().partition("/")
        return CodecConfig.parse(k_text), CodecConfig.parse(v_text)
    k = CodecConfig.parse(preset.strip() if isinstance(preset, str) else preset)
    return k, get_codec_class(k.name).value_config(k, value_group)
