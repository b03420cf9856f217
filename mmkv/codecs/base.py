"""The codec protocol, typed configs parsed from preset strings, and the registry.

A codec turns `x[..., T, D]` (keys or values of one layer) into an `Encoded` bundle of real packed tensors and back.
`nbytes` counts every stored byte, so effective bits are measured, never nominal. Codecs are built from a frozen
`CodecConfig`, parsed from strings such as `octopus:b=3` or `kivi:bits=2,group=32`.

Layout convention: when a codec is built with `num_heads > 1`, dim -3 of its input is the (KV) head axis, so per-head
state (rotation signs) and per-token cross-head statistics (OScaR's omni-token norm) are well defined.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, ClassVar

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class CodecError(ValueError):
    """Bad input to a codec or a bad codec configuration; the message says what was expected."""


# ----------------------------------------------------------------------------------------------------------------
# Config


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


@dataclass(frozen=True)
class CodecConfig:
    """A codec name plus its parameters, hashable and printable as a canonical preset string."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, preset: "str | CodecConfig") -> "CodecConfig":
        """Parse `name[:key=value,key=value]`, resolve aliases and fill defaults from the registered codec."""
        if isinstance(preset, CodecConfig):
            return preset
        if not isinstance(preset, str) or not preset.strip():
            raise CodecError(f"empty codec preset {preset!r}; expected e.g. 'octopus:b=3' (known: {', '.join(names())})")
        name, _, rest = preset.strip().partition(":")
        name = name.strip().lower()
        codec_cls = get_codec_class(name)
        raw: dict[str, Any] = {}
        if rest.strip():
            for item in rest.split(","):
                key, eq, value = item.partition("=")
                key = key.strip().lower()
                if not eq or not key or not value.strip():
                    raise CodecError(f"malformed parameter {item!r} in codec preset {preset!r}; expected key=value")
                key = codec_cls.aliases.get(key, key)
                if key not in codec_cls.defaults:
                    allowed = sorted(set(codec_cls.defaults) | set(codec_cls.aliases))
                    raise CodecError(f"codec {name!r} has no parameter {key!r} (in {preset!r}); allowed: {allowed}")
                if key in raw:
                    raise CodecError(f"parameter {key!r} given twice in codec preset {preset!r}")
                raw[key] = _parse_value(value)
        params = dict(codec_cls.defaults)
        params.update(raw)
        return cls(name=name, params=tuple(sorted(params.items())))

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.params:
            if k == key:
                return v
        return default

    def __getitem__(self, key: str) -> Any:
        for k, v in self.params:
            if k == key:
                return v
        raise KeyError(key)

    def replace(self, **changes: Any) -> "CodecConfig":
        params = dict(self.params)
        params.update(changes)
        return CodecConfig(self.name, tuple(sorted(params.items())))

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in self.params)

    @property
    def slug(self) -> str:
        """Filesystem-safe name, e.g. `octopus_b3_joint1_norm32`."""
        parts = [self.name.replace("-", "")] + [f"{k}{_fmt(v)}" for k, v in self.params]
        return "_".join(parts).replace(".", "p")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params), "preset": str(self)}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


# ----------------------------------------------------------------------------------------------------------------
# Encoded bundle


@dataclass
class Encoded:
    """What a codec stores for one span of vectors: packed payload and side information, all real tensors.

    `tensors` holds every stored tensor (and only those); `meta` holds small Python facts needed to decode (original
    shape, dtype, token count), which a real cache keeps once per layer rather than per unit.
    """

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def effective_bits(self) -> float:
        """Stored bits per encoded value, measured from the bytes really held."""
        return 8.0 * self.nbytes / max(self.numel, 1)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def to(self, device: torch.device | str) -> "Encoded":
        return dataclasses.replace(self, tensors={k: t.to(device) for k, t in self.tensors.items()})


# ----------------------------------------------------------------------------------------------------------------
# Seeds


def derive_seed(seed: int, *keys: Any) -> int:
    """A 63-bit seed derived from `seed` and any keys (stable across processes, platforms and Python versions)."""
    text = repr((int(seed),) + tuple(keys)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def private_generator(seed: int, *keys: Any) -> torch.Generator:
    """A CPU generator that never touches the global RNG stream."""
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(seed, *keys))
    return g


# ----------------------------------------------------------------------------------------------------------------
# Codec base class and registry

_REGISTRY: dict[str, type["Codec"]] = {}


def register(cls: type["Codec"]) -> type["Codec"]:
    """Class decorator: make a codec available by its `name`."""
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} has no codec name")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    # Importing the package registers every built-in codec.
    import mmkv.codecs  # noqa: F401


def get_codec_class(name: str) -> type["Codec"]:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(names())}") from None


def names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def build(
    config: "str | CodecConfig",
    *,
    head_dim: int,
    num_heads: int = 1,
    layer: int = 0,
    seed: int = 0,
) -> "Codec":
    """Build a codec instance for one layer (and its `num_heads` KV heads) from a preset or config."""
    cfg = CodecConfig.parse(config)
    return get_codec_class(cfg.name)(cfg, head_dim=head_dim, num_heads=num_heads, layer=layer, seed=seed)


_LAYOUTS: dict[tuple, dict[str, tuple[int, Fraction]]] = {}


def token_layout(codec: "Codec", lead: int) -> dict[str, tuple[int, Fraction]]:
    """For each tensor a token-local codec stores, (the axis that grows with the token count, entries per token),
    found once per codec and leading rank by encoding two probe lengths on the CPU (shapes never depend on values).
    Fields with a fixed part (not proportional to the token count) are left out: they cannot be concatenated.
    Kept per (codec class, config, head_dim, num_heads, lead), not per instance: a store builds its codecs afresh for
    each rollout, and the probes (the torch reference encode) cost up to 14 ms a codec (OCTOPUS), 0.5 s per rollout
    of a 30-layer model."""
    key = (type(codec), str(codec.config), codec.head_dim, codec.num_heads, lead)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    g = torch.Generator().manual_seed(0)
    heads = [codec.num_heads] if lead >= 1 and codec.num_heads > 1 else [1] * min(lead, 1)
    dims = [1] * (lead - len(heads)) + heads
    probes = []
    for t in (16, 32):
        # the class's encode, not an instance attribute (tests and simulate_peak_nbytes wrap that to count units)
        enc = type(codec).encode(codec, torch.randn(*dims, t, codec.head_dim, generator=g))
        probes.append({k: tuple(v.shape) for k, v in enc.tensors.items()})
    layout = {}
    for k, s1 in probes[0].items():
        s2 = probes[1][k]
        diff = [i for i, (a, b) in enumerate(zip(s1, s2)) if a != b]
        if len(diff) == 1:
            rate = Fraction(s2[diff[0]] - s1[diff[0]], 16)
            if rate * 16 == s1[diff[0]]:  # proportional: no fixed part
                layout[k] = (diff[0], rate)
    _LAYOUTS[key] = layout
    return layout


def concat_tokens(codec: "Codec", encs: list[Encoded]) -> Encoded | None:
    """One encoding of the concatenated tokens of `encs` (consecutive encodings of a token-local codec, same leading
    dims), built by concatenating the stored tensors, or None when that would not be exact: a field whose size is not
    proportional to its tokens (a packed row padded to a byte), differing metadata, or a codec that is not
    token-local. Decoding it equals concatenating the decodes, bit for bit."""
    if not getattr(codec, "token_local", False) or len(encs) < 2:
        return None
    first = encs[0]
    lead = len(first.shape) - 2
    if any(tuple(e.shape[:-2]) != tuple(first.shape[:-2]) or e.meta != first.meta or e.codec != first.codec
           or list(e.tensors) != list(first.tensors) for e in encs):
        return None
    layout = token_layout(codec, lead)
    if set(layout) != set(first.tensors):
        return None
    for e in encs:
        t = e.shape[-2]
        for k, (axis, rate) in layout.items():
            if rate * t != e.tensors[k].shape[axis]:
                return None
    tensors = {k: torch.cat([e.tensors[k] for e in encs], dim=layout[k][0]) for k in first.tensors}
    shape = (*first.shape[:-2], sum(e.shape[-2] for e in encs), first.shape[-1])
    return Encoded(first.codec, shape, first.dtype, tensors, dict(first.meta))


def stack_units(encs: list[Encoded]) -> Encoded | None:
    """One encoding of equal-length units stacked on a new axis after the batch axis: each of `encs` is one unit's
    [B, H, T, D] encoding or an earlier stack [B, n, H, T, D]; the result is [B, sum n, H, T, D], every stored tensor
    stacked (or concatenated) the same way on its axis 1. For codecs whose leading dims are independent rows (KIVI
    and OScaR, whose keys group over tokens and so cannot be joined along the token axis): decoding the stack
    decodes each unit as it would alone. None when the units' layouts differ (shapes, dtypes, metadata)."""
    if len(encs) < 2:
        return None
    unit = lambda e: tuple(e.shape) if len(e.shape) == 4 else (e.shape[0], *e.shape[2:])  # noqa: E731
    first = encs[0]
    if len(first.shape) not in (4, 5):
        return None
    fields = {k: (t.dtype, t.shape if len(first.shape) == 4 else t.shape[:1] + t.shape[2:])
              for k, t in first.tensors.items()}
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in fields}
    units = 0
    for e in encs:
        if len(e.shape) not in (4, 5) or unit(e) != unit(first) or e.codec != first.codec or e.dtype != first.dtype \
                or e.meta != first.meta or set(e.tensors) != set(fields):
            return None
        for k, t in e.tensors.items():
            per = t.shape if len(e.shape) == 4 else t.shape[:1] + t.shape[2:]
            if (t.dtype, per) != fields[k] or t.dim() < 1:
                return None
            parts[k].append(t.unsqueeze(1) if len(e.shape) == 4 else t)
        units += 1 if len(e.shape) == 4 else e.shape[1]
    tensors = {k: torch.cat(ts, dim=1) for k, ts in parts.items()}
    b, h, t, d = unit(first)
    return Encoded(first.codec, (b, units, h, t, d), first.dtype, tensors, dict(first.meta))


# Device copies shared by codec instances whose tables are equal (the same codec, layer and seed in the next store
# of a sweep): a host-to-device copy from pageable memory is a host sync, and a store is built per rollout.
_SHARED: dict[tuple, list[tuple[dict, dict]]] = {}
_SHARED_PER_KEY = 512


def to_device_shared(tables: dict[str, torch.Tensor], device: torch.device, key: str) -> dict[str, torch.Tensor]:
    """Contiguous copies of `tables` on `device`; reused, with no copy, when an earlier call had tables equal to
    these (same names, dtypes, shapes and values, compared on the host). Tables already on the device are copied
    fresh (comparing them would be a host sync)."""
    if device.type == "cpu" or any(t.device.type != "cpu" for t in tables.values()):
        return {name: t.to(device).contiguous() for name, t in tables.items()}
    sig = (str(device), key, tuple((name, t.dtype, tuple(t.shape)) for name, t in tables.items()))
    seen = _SHARED.setdefault(sig, [])
    for host, dev in seen:
        if all(torch.equal(host[name], t) for name, t in tables.items()):
            return dev
    dev = {name: t.to(device).contiguous() for name, t in tables.items()}
    if len(seen) >= _SHARED_PER_KEY:
        seen.pop(0)
    seen.append(({name: t.clone() for name, t in tables.items()}, dev))
    return dev


def check_or_defer(bad: torch.Tensor, message: Callable[[], str], defer: list | None) -> None:
    """A validity check whose answer lives on the device: `bad` is a 0-d bool tensor. Without `defer`, read it now (a
    host sync) and raise `CodecError(message())` if it is set; with `defer` (a list the caller reads once, for many
    encodes: `mmkv.cache.KVStore.append`), append (bad, message) instead."""
    if defer is not None:
        defer.append((bad, message))
    elif bool(bad):
        raise CodecError(message())


def check_out(codec: "Codec", enc: Encoded, dtype: torch.dtype, out: torch.Tensor) -> None:
    """`out` of `Codec.decode`: a tensor of the encoded shape in the decode dtype, on the encoding's device."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(enc.shape) or out.dtype != dtype \
            or out.device != enc.device:
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise CodecError(f"codec {codec.config}: decode out must be {tuple(enc.shape)} {dtype} on {enc.device}, "
                         f"got {got}")


def _kernel(codec: "Codec", op: str, device: torch.device):
    """The Triton kernel for `op` ("encode"/"decode") of this codec on CUDA, else None (torch reference).

    `mmkv.kernels.dispatch.lookup(op, codec)` decides (it also honours MMKV_KERNELS=0); CPU tensors never dispatch.
    """
    if device.type != "cuda":
        return None
    try:
        from mmkv.kernels import dispatch
    except ImportError:
        return None
    return dispatch.lookup(op, codec)


class Codec:
    """One codec for one layer's K or V. Subclasses implement `_encode` and `_decode` (the torch reference)."""

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}
    aliases: ClassVar[dict[str, str]] = {}
    requires_pow2: ClassVar[bool] = False
    has_scores: ClassVar[bool] = False  # True when the paper defines its own score estimator (QJL family)
    # Codecs whose encoding of a unit depends on other units (QVG) set this; the store then encodes spans jointly.
    span_codec: ClassVar[bool] = False
    # True when every token is encoded on its own, so encoding a run of units decodes bit for bit like encoding them
    # one by one (the store then merges them: CacheConfig.merge_units). Codecs grouping over tokens leave it False.
    token_local: bool = False
    # True when the leading dims of an encoding are independent rows whose decode does not depend on how many there
    # are, so the store may stack equal-length units' encodings and decode them in one call (`stack_units`).
    stackable: bool = False

    def __init__(self, config: CodecConfig, *, head_dim: int, num_heads: int = 1, layer: int = 0, seed: int = 0):
        if config.name != self.name:
            raise CodecError(f"config for {config.name!r} given to codec {self.name!r}")
        if not isinstance(head_dim, int) or head_dim < 1:
            raise CodecError(f"head_dim must be a positive int, got {head_dim!r}")
        if self.requires_pow2 and (head_dim & (head_dim - 1)) != 0:
            raise CodecError(
                f"codec {self.name!r} needs a power-of-two head dim (its Walsh-Hadamard rotation does); got "
                f"{head_dim}. Supported: 16, 32, 64, 128, 256, ..."
            )
        if num_heads < 1:
            raise CodecError(f"num_heads must be >= 1, got {num_heads}")
        self.config = config
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.layer = layer
        self.seed = seed
        self.setup()

    # -- to override -------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Validate parameters and build per-instance state (codebooks, rotations)."""

    def _encode(self, x: torch.Tensor) -> Encoded:  # x: float32, validated
        raise NotImplementedError

    def _decode(self, enc: Encoded) -> torch.Tensor:  # returns float32 of enc.shape
        raise NotImplementedError

    # -- public protocol ---------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, assume_finite: bool = False, defer: list | None = None) -> Encoded:
        """Encode x [..., T, D]. `assume_finite=True` skips the NaN/Inf scan (a host sync on CUDA): for callers that
        have already checked x, as `mmkv.cache.KVStore` does once per append for all the units it encodes. `defer`: a
        list to which a Triton encoder appends its device-side checks (side information overflowing fp16) as
        (bad flag, message) instead of reading them at once; the caller must read them before using the result."""
        self.check_input(x, finite=not assume_finite)
        kernel = _kernel(self, "encode", x.device)
        if kernel is not None:
            enc = kernel(self, x) if defer is None else kernel(self, x, defer=defer)
        else:
            enc = self._encode(x.float())
        enc.shape = tuple(x.shape)
        enc.dtype = x.dtype
        enc.codec = str(self.config)
        return enc

    def decode(self, enc: Encoded, dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The decode of `enc` in `dtype` (default: the encoded input's dtype). `out`: a [..., T, D] tensor of that
        shape and dtype to write into and return, e.g. a token slice of an attention gather buffer; a kernel writes
        it directly when its rows are evenly strided with unit channel stride, otherwise the decode is copied in."""
        if enc.codec != str(self.config):
            raise CodecError(f"cannot decode data encoded by {enc.codec!r} with codec {self.config}")
        dtype = dtype or enc.dtype
        if out is not None:
            check_out(self, enc, dtype, out)
        kernel = _kernel(self, "decode", enc.device)
        if kernel is not None:
            if out is None:
                return kernel(self, enc, dtype)
            try:
                return kernel(self, enc, dtype, out=out)
            except ValueError as err:  # a layout the kernel cannot write (decode_out): decode, then copy
                if isinstance(err, CodecError):
                    raise
                return out.copy_(kernel(self, enc, dtype))
        res = self._decode(enc).to(dtype)
        return res if out is None else out.copy_(res)

    def nbytes(self, enc: Encoded) -> int:
        return enc.nbytes

    def effective_bits(self, enc: Encoded) -> float:
        return enc.effective_bits

    def scores(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """Estimated q·k for every stored key: q[..., Tq, D] -> [..., Tq, T] (fp32). Default: exact on the decode."""
        k = self._decode(enc)
        return torch.matmul(q.float(), k.transpose(-1, -2))

    # -- helpers -----------------------------------------------------------------------------------------------
    @classmethod
    def value_config(cls, config: CodecConfig, group: int = 32) -> CodecConfig:
        """The V codec this (key) codec pairs with: by default per-token groups of `group` channels, asymmetric
        min-max at the key's nominal bits (codecs.md A9). Codecs with their own V recipe (KIVI, OScaR) override."""
        bits = config.get("bits", config.get("b", 4))
        return CodecConfig.parse(f"groupquant:bits={int(round(float(bits)))},group={group}")

    def check_input(self, x: torch.Tensor, finite: bool = True) -> None:
        where = f"codec {self.config} (layer {self.layer})"
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"{where}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise CodecError(f"{where}: expected a float tensor (float32/float16/bfloat16), got {x.dtype}")
        if x.dim() < 2:
            raise CodecError(f"{where}: expected shape [..., T, D] with at least 2 dims, got {tuple(x.shape)}")
        if x.shape[-1] != self.head_dim:
            raise CodecError(f"{where}: head dim {x.shape[-1]} does not match the codec's head_dim {self.head_dim}")
        if self.num_heads > 1 and (x.dim() < 3 or x.shape[-3] != self.num_heads):
            raise CodecError(
                f"{where}: built for {self.num_heads} heads, expected shape [..., {self.num_heads}, T, "
                f"{self.head_dim}], got {tuple(x.shape)}"
            )
        if finite and x.numel() and not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).sum())
            raise CodecError(f"{where}: input has {bad} NaN/Inf values of {x.numel()}; refusing to encode them")

    def check_bits(self, bits: Any, allowed: tuple[int, ...], key: str = "bits") -> int:
        if not isinstance(bits, int) or isinstance(bits, bool) or bits not in allowed:
            raise CodecError(f"codec {self.name!r}: unsupported {key}={bits!r}; supported: {list(allowed)}")
        return bits

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config}, head_dim={self.head_dim}, num_heads={self.num_heads})"


# ----------------------------------------------------------------------------------------------------------------
# K/V pairing


def kv_configs(preset: "str | CodecConfig", value_group: int = 32) -> tuple[CodecConfig, CodecConfig]:
    """The (K, V) codec configs a rollout preset stands for.

    `KEY/VALUE` names both explicitly (`octopus:b=2/groupquant:bits=2,group=16`); a single preset names the key codec
    and the value codec it pairs with in its paper's recipe (`Codec.value_config`), with `value_group` channels per
    value group (32 for video, 16 for audio, per the OCTOPUS seed).
    """
    if isinstance(preset, CodecConfig):
        k = preset
        return k, get_codec_class(k.name).value_config(k, value_group)
    text = preset.strip()
    if "/" in text:
        k_text, _, v_text = text.partition("/")
        return CodecConfig.parse(k_text), CodecConfig.parse(v_text)
    k = CodecConfig.parse(text)
    return k, get_codec_class(k.name).value_config(k, value_group)
