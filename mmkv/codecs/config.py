"""Typed codec configs and the one parser of preset strings (`octopus:b=3`, `kivi:bits=2,group=32`).

Each codec declares a frozen dataclass subclass of `CodecConfig` whose fields are its parameters, with their
defaults, checked in `__post_init__`. A config prints as a canonical preset string: the codec name, then every
parameter as `key=value` sorted by key. That string names run folders, manifest entries and bench rows, so a codec
that printed its width as `b` before it was called `bits` keeps printing `b` (`printed`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar


class CodecError(ValueError):
    """Bad input to a codec or a bad codec configuration; the message says what was expected."""


def _parse_value(text: str) -> Any:
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def split_preset(preset: str) -> tuple[str, list[tuple[str, str]]]:
    """`name[:key=value,...]` -> (lower-case name, [(lower-case key, value text), ...]), syntax only: the codec need
    not be registered (reports read presets of old runs with this)."""
    if not isinstance(preset, str) or not preset.strip():
        raise CodecError(f"empty codec preset {preset!r}; expected e.g. 'octopus:b=3' or 'kivi:bits=2,group=32'")
    name, _, rest = preset.strip().partition(":")
    items = []
    for item in rest.split(",") if rest.strip() else ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise CodecError(f"malformed parameter {item!r} in codec preset {preset!r}; expected key=value")
        items.append((key.strip().lower(), value.strip()))
    return name.strip().lower(), items


# A comma-separated token starts a new codec when it begins with a bare name followed by ':' or the end of the token
# (`kivi:bits=2`, `identity`); tokens containing `key=value` first continue the previous preset (`group=32`).
_NEW_CODEC = re.compile(r"^\s*[A-Za-z][\w.-]*\s*(:|$)")


def split_preset_list(text: str) -> list[str]:
    """Split `kivi:bits=2,group=32,octopus:b=3,identity` into presets, keeping commas inside a preset."""
    if not isinstance(text, str) or not text.strip():
        raise CodecError(f"empty codec list {text!r}; expected e.g. 'octopus:b=3,kivi:bits=2,group=32'")
    presets: list[str] = []
    for token in text.split(","):
        if not token.strip():
            raise CodecError(f"empty entry in codec list {text!r} (two commas in a row or a trailing comma?)")
        if _NEW_CODEC.match(token) or not presets:
            presets.append(token.strip())
        else:
            presets[-1] += "," + token.strip()
    return presets


@dataclass(frozen=True)
class CodecConfig:
    """A codec's parameters: subclasses add typed fields (with defaults) and check them in `__post_init__`."""

    name: ClassVar[str] = ""
    aliases: ClassVar[dict[str, str]] = {}  # other accepted spellings -> field
    printed: ClassVar[dict[str, str]] = {}  # field -> the key it prints as, where that differs

    @classmethod
    def named(cls, name: str) -> type["CodecConfig"]:
        """A config class without parameters for codec `name` (for codecs that take none)."""
        return dataclass(frozen=True)(type(f"{name.title().replace('-', '')}Config", (cls,), {"name": name}))

    @classmethod
    def parse(cls, preset: "str | CodecConfig") -> "CodecConfig":
        """The config a preset string names, its parameters' spellings resolved and the rest defaulted."""
        if isinstance(preset, CodecConfig):
            return preset
        from mmkv.codecs.registry import get_codec_class

        name, items = split_preset(preset)
        config_cls = get_codec_class(name).config_class
        values: dict[str, Any] = {}
        for key, text in items:
            field = config_cls.field_for(key)
            if field is None:
                raise CodecError(f"codec {name!r} has no parameter {key!r} (in {preset!r}); allowed: "
                                 f"{config_cls.spellings()}")
            if field in values:
                raise CodecError(f"parameter {key!r} given twice in codec preset {preset!r}")
            values[field] = _parse_value(text)
        return config_cls(**values)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def field_for(cls, key: str) -> str | None:
        """The field a key spells (its name, its printed key or an alias), or None."""
        fields = cls.field_names()
        inverse = {p: f for f, p in cls.printed.items()}
        field = cls.aliases.get(key, inverse.get(key, key))
        return field if field in fields else None

    @classmethod
    def spellings(cls, field: str | None = None) -> list[str]:
        """Every key that parses (to `field`, when given), sorted."""
        keys = set(cls.field_names()) | set(cls.aliases) | set(cls.printed.values())
        return sorted(k for k in keys if field is None or cls.field_for(k) == field)

    @property
    def params(self) -> tuple[tuple[str, Any], ...]:
        """(printed key, value) pairs sorted by key: the preset string's parameters."""
        return tuple(sorted((self.printed.get(f, f), getattr(self, f)) for f in self.field_names()))

    @property
    def nominal_bits(self) -> float | None:
        """The codec's nominal width (its `bits` field), None for a codec without one (identity)."""
        bits = getattr(self, "bits", None)
        return float(bits) if isinstance(bits, (int, float)) and not isinstance(bits, bool) else None

    def get(self, key: str, default: Any = None) -> Any:
        field = self.field_for(key)
        return default if field is None else getattr(self, field)

    def __getitem__(self, key: str) -> Any:
        field = self.field_for(key)
        if field is None:
            raise KeyError(key)
        return getattr(self, field)

    def replace(self, **changes: Any) -> "CodecConfig":
        fields = {}
        for key, value in changes.items():
            field = self.field_for(key)
            if field is None:
                raise CodecError(f"codec {self.name!r} has no parameter {key!r}; allowed: {self.spellings()}")
            fields[field] = value
        return dataclasses.replace(self, **fields)

    def __str__(self) -> str:
        # Made once a config (frozen; `set` drops it): a store's codecs compare it at every encode and decode, where
        # building it again took some 20 us of host time a call (a full-size AAR rollout decodes about 3,800 times).
        text = self.__dict__.get("_text")
        if text is None:
            params = self.params
            text = self.name + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in params) if params else self.name
            object.__setattr__(self, "_text", text)
        return text

    @property
    def slug(self) -> str:
        """Filesystem-safe name, e.g. `octopus_b3_joint1_norm32`."""
        parts = [self.name.replace("-", "")] + [f"{k}{_fmt(v)}" for k, v in self.params]
        return "_".join(parts).replace(".", "p")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params), "preset": str(self)}

    # -- checks for __post_init__ ---------------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        raise CodecError(f"codec {self.name!r}: {message}")

    def check_choice(self, field: str, allowed) -> None:
        """`field` is one of `allowed`; where those are ints, an int (not a bool, not a float)."""
        value = getattr(self, field)
        ints = all(isinstance(a, int) for a in allowed)
        if value not in allowed or (ints and (not isinstance(value, int) or isinstance(value, bool))):
            self.fail(f"unsupported {field}={value!r}; supported: {list(allowed)}")

    def check_int(self, field: str, lo: int, hi: int | None = None) -> None:
        value = getattr(self, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            self.fail(f"{field} must be an int {bound}, got {value!r}")

    def set(self, field: str, value: Any) -> None:
        """Normalise a field in `__post_init__` (the dataclass is frozen; a string made before is dropped)."""
        object.__setattr__(self, field, value)
        self.__dict__.pop("_text", None)
