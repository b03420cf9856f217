"""The codec protocol: `Codec`, the class every codec subclasses, and the checks it shares.

A codec turns `x[..., T, D]` (keys or values of one layer) into an `Encoded` bundle of real packed tensors and back.
`nbytes` counts every stored byte, so effective bits are measured, never nominal. A codec is built from its frozen
config (`mmkv.codecs.config`), parsed from strings such as `octopus:b=3` or `kivi:bits=2,group=32`.

Layout convention: when a codec is built with `num_heads > 1`, dim -3 of its input is the (KV) head axis, so per-head
state (rotation signs) and per-token cross-head statistics (OScaR's omni-token norm) are well defined.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections import OrderedDict
from typing import Any, Callable, ClassVar

import torch

from mmkv.codecs.checks import check_or_defer, encode_scope, in_scope, inputs_checked  # noqa: F401
from mmkv.codecs.config import CodecConfig, CodecError
from mmkv.codecs.encoded import FLOAT_DTYPES, Encoded
# Re-exported: the cache and older callers import these from here.
from mmkv.codecs.registry import build, get_codec_class, kv_configs, names, register  # noqa: F401
from mmkv.codecs.seeds import derive_seed, private_generator  # noqa: F401
from mmkv.codecs.segments import concat_tokens, stack_units, token_layout  # noqa: F401


# Device copies shared by codec instances whose tables are equal (the same codec, layer and seed in the next store
# of a sweep): a host-to-device copy from pageable memory is a host sync, and a store is built per rollout. Keyed by
# the tables' names, dtypes, shapes and a digest of their bytes, so a lookup hashes the tables once rather than
# comparing them with every earlier entry of their shape (a codec's tables, one set a layer and K / V: hundreds).
_SHARED: OrderedDict[tuple, tuple[dict, dict]] = OrderedDict()
_SHARED_MAX = 4096


def _digest(tables: dict[str, torch.Tensor]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in tables.values():
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def to_device_shared(tables: dict[str, torch.Tensor], device: torch.device, key: str) -> dict[str, torch.Tensor]:
    """Contiguous copies of `tables` on `device`; reused, with no copy, when an earlier call had tables equal to
    these (same names, dtypes, shapes and values, compared on the host). Tables already on the device are copied
    fresh (comparing them would be a host sync)."""
    if device.type == "cpu" or any(t.device.type != "cpu" for t in tables.values()):
        return {name: t.to(device).contiguous() for name, t in tables.items()}
    sig = (str(device), key, tuple((name, t.dtype, tuple(t.shape)) for name, t in tables.items()), _digest(tables))
    hit = _SHARED.get(sig)
    if hit is not None and all(torch.equal(hit[0][name], t) for name, t in tables.items()):  # a digest collision
        _SHARED.move_to_end(sig)                                                             # fails this
        return hit[1]
    dev = {name: t.to(device).contiguous() for name, t in tables.items()}
    if hit is None:
        _SHARED[sig] = ({name: t.clone() for name, t in tables.items()}, dev)
        if len(_SHARED) > _SHARED_MAX:
            _SHARED.popitem(last=False)
    return dev


def check_out(codec: "Codec", enc: Encoded, dtype: torch.dtype, out: torch.Tensor) -> None:
    """`out` of `Codec.decode`: a tensor of the encoded shape in the decode dtype, on the encoding's device."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(enc.shape) or out.dtype != dtype \
            or out.device != enc.device:
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise CodecError(f"codec {codec.config}: decode out must be {tuple(enc.shape)} {dtype} on {enc.device}, "
                         f"got {got}")


# The kernel registry (kernels/dispatch.py, imported with the `mmkv` package) installs its `lookup(op, codec)`
# here, so codecs never import kernels; without it every codec runs its torch reference.
_KERNEL_LOOKUP: Callable | None = None


def use_kernels(lookup: Callable | None) -> None:
    """Install the kernel lookup `lookup(op, codec) -> callable | None` that `Codec.encode/decode` ask on CUDA."""
    global _KERNEL_LOOKUP
    _KERNEL_LOOKUP = lookup


def _kernel(codec: "Codec", op: str, device: torch.device):
    """The Triton kernel for `op` ("encode"/"decode") of this codec on CUDA, else None (torch reference).

    The installed lookup decides (it also honours MMKV_KERNELS=0); CPU tensors never dispatch.
    """
    if device.type != "cuda" or _KERNEL_LOOKUP is None:
        return None
    return _KERNEL_LOOKUP(op, codec)


@functools.lru_cache(maxsize=None)
def _nonfinite_flag(kernel: Callable) -> Callable | None:
    """The `nonfinite(codec, enc)` of an encode kernel's module, None when it has none. It returns a 0-d bool tensor
    set whenever the input held a NaN/Inf (and possibly for a finite input whose norm overflows), read from the
    encoding, or None when the kernel's own checks (`check_or_defer`) already see every NaN/Inf."""
    return getattr(sys.modules.get(getattr(kernel, "__module__", None) or ""), "nonfinite", None)


class Codec:
    """One codec for one layer's K or V. Subclasses implement `_encode` and `_decode` (the torch reference)."""

    config_class: ClassVar[type[CodecConfig]] = CodecConfig  # its parameters; the codec's name is the config's
    name: ClassVar[str] = ""  # set from config_class
    display_name: ClassVar[str] = ""  # as tables print it (`OCTOPUS`); the name when not given
    requires_pow2: ClassVar[bool] = False
    has_scores: ClassVar[bool] = False  # True when the paper defines its own score estimator (QJL family)
    # Codecs whose encoding of a unit depends on other units (QVG) set this; the store then encodes spans jointly.
    span_codec: ClassVar[bool] = False
    # True when every token is encoded on its own, so encoding a run of units decodes bit for bit like encoding them
    # one by one (the store then merges them: CacheConfig.merge_units). Codecs grouping over tokens leave it False.
    token_local: bool = False
    # The stored fields that are dense bit streams over a row's tokens (`mmkv.codecs.packing`: each token's codes
    # straight after the previous token's, the row padded to a byte only at its end). A store joins consecutive
    # units' streams bit by bit where their bits do not end on a byte (`concat_tokens`).
    bit_streams: tuple[str, ...] = ()
    # True when the leading dims of an encoding are independent rows whose decode does not depend on how many there
    # are, so the store may stack equal-length units' encodings and decode them in one call (`stack_units`); its
    # decode kernel then writes the stack straight into token order (`Codec.decode(out=...)` of the transposed view).
    stackable: bool = False
    # The axis on which `stack_units` stacks each stored field: after the batch axis (1) unless named here (QVG's
    # per-stage ids and centres lead with the stage axis, so theirs is 2).
    stack_axes: ClassVar[dict[str, int]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.config_class.name
        if "display_name" not in cls.__dict__:
            cls.display_name = cls.name

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
    def encode(self, x: torch.Tensor) -> Encoded:
        """Encode x [..., T, D]. Inside an `mmkv.codecs.checks.encode_scope` the NaN/Inf scan and the device-side
        checks follow the scope (read together by its owner, in one host sync); outside, all are read at once: in
        one host sync and with no scan of its own when the kernel's encoding flags NaN/Inf (`_encode_checked`)."""
        self._check_once(x)
        kernel = _kernel(self, "encode", x.device)
        flag = _nonfinite_flag(kernel) if kernel is not None and not in_scope() else None
        if not inputs_checked() and flag is None:
            self.check_finite(x)
        if flag is not None:
            enc = self._encode_checked(kernel, flag, x)
        elif kernel is not None:
            enc = kernel(self, x)
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

    def _check_once(self, x: torch.Tensor) -> None:
        """`check_input` without the NaN/Inf scan, done once per (dtype, shape) of this instance: a store encodes the
        same unit shapes all rollout long."""
        if not isinstance(x, torch.Tensor):
            self.check_input(x, finite=False)
        key = (x.dtype, tuple(x.shape))
        seen = self.__dict__.setdefault("_checked_inputs", set())
        if key not in seen:
            self.check_input(x, finite=False)
            seen.add(key)

    def _encode_checked(self, kernel: Callable, flag: Callable, x: torch.Tensor) -> Encoded:
        """A plain `encode(x)` on a kernel whose encoding shows any NaN/Inf of its input (`flag(enc)`): its checks
        and that flag are read in one host sync, with no separate scan of x. When one is set, x is scanned and the
        kernel re-run outside the scope, so the error is the one a scan-first encode raises (with the kernel's own
        message); a flag set by a finite input (a norm overflowing fp32) raises nothing and the encoding stands."""
        with encode_scope(inputs_checked=True, collect=True) as pending:
            enc = kernel(self, x)
        flags = [f for f in [flag(self, enc)] if f is not None] + [bad.reshape(()) for bad, _ in pending]
        if flags and bool(torch.stack(flags).any()):
            self.check_finite(x)
            kernel(self, x)
        return enc

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
        min-max at the key's nominal bits. Codecs with their own V recipe (KIVI, OScaR) override."""
        bits = config.nominal_bits
        return CodecConfig.parse(f"groupquant:bits={int(round(4.0 if bits is None else bits))},group={group}")

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
        if finite:
            self.check_finite(x)

    def check_finite(self, x: torch.Tensor) -> None:
        """The NaN/Inf scan of `check_input` (a host sync on CUDA)."""
        if x.numel() and not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).sum())
            raise CodecError(f"codec {self.config} (layer {self.layer}): input has {bad} NaN/Inf values of "
                             f"{x.numel()}; refusing to encode them")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config}, head_dim={self.head_dim}, num_heads={self.num_heads})"
