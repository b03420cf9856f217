"""Run-folder utilities shared by the video and audio pipelines.

Everything a generation command needs besides the model: atomic file writes, prompt files, codec lists, torchrun
sharding, seeded noise with a SHA-256 of every byte drawn, and the run-folder layout the metrics read (see
`mmkv.pipelines.run_folder`). Files and hashes live in `mmkv.pipelines.files`, checkpoint reading in
`mmkv.pipelines.checkpoints`; their names are re-exported here.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from mmkv.codecs.config import CodecConfig, CodecError, split_preset_list
from mmkv.codecs.registry import kv_configs
from mmkv.codecs.seeds import derive_seed
from mmkv.pipelines.checkpoints import (  # noqa: F401
    CHECKPOINT_FORMATS, _SAFE_CONTENTS, _data_only_globals, _named_globals, _unsafe_globals, check_checkpoint_file,
    checkpoint_format, read_checkpoint_file,
)
from mmkv.pipelines.files import (  # noqa: F401
    _SHA256_CACHE, RunError, WriteError, _atomic_write_json, _git_commit, _json_default, _tensor_bytes, atomic_path,
    atomic_save_npy, atomic_save_safetensors, atomic_save_wav, atomic_write_bytes, atomic_write_json,
    atomic_write_text, check_finite, read_json, remove_stale_temps, sha256_file, sha256_tensors, sha256_tree, versions,
)
from mmkv.pipelines.run_folder import (  # noqa: F401
    _RUN_CLOCK, FAILED_FILE, TIMINGS_FILE, Manifest, NonFiniteError, RunFolder, _jsonable, _read_timings,
    check_out_dir, failure_record, identity_mismatch, item_name, nonfinite_outputs, rollout_line, say,
)

REFERENCE = "reference"  # variant name of the native (uncompressed) cache rollout


# ----------------------------------------------------------------------------------------------------------------
# Prompt files

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def read_prompts(path: str | os.PathLike, *, max_chars: int = 4000) -> list[str]:
    """One prompt per line; blank lines and lines starting with `#` are skipped. Inner whitespace is collapsed.

    Raises `RunError` naming the file (and line) for a missing file, a file that is not UTF-8 text, control
    characters, over-long lines, or no prompt at all.
    """
    path = Path(path)
    if not path.exists():
        raise RunError(f"prompt file {path} does not exist")
    if path.is_dir():
        raise RunError(f"prompt file {path} is a directory; expected a text file with one prompt per line")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise RunError(
            f"prompt file {path} is not UTF-8 text (byte {err.start}); expected one prompt per line"
        ) from None
    prompts: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if _CONTROL.search(stripped):
            raise RunError(f"prompt file {path}, line {lineno}: contains control characters; is it a binary file?")
        if len(stripped) > max_chars:
            raise RunError(f"prompt file {path}, line {lineno}: {len(stripped)} characters (max {max_chars})")
        prompts.append(" ".join(stripped.split()))
    if not prompts:
        raise RunError(f"prompt file {path} has no prompts (only blank lines or # comments); expected one per line")
    return prompts


# ----------------------------------------------------------------------------------------------------------------
# Codec lists

def split_codec_list(text: str) -> list[str]:
    """Split `kivi:bits=2,group=32,octopus:b=3,identity` into presets, keeping commas inside a preset."""
    try:
        return split_preset_list(text)
    except CodecError as err:
        raise RunError(str(err)) from None


@dataclass(frozen=True)
class CodecSpec:
    """One compressed-cache variant of a run: the user's preset, its K and V configs, and its folder name."""

    preset: str  # canonical preset string (`K` or `K/V`)
    k: CodecConfig
    v: CodecConfig
    explicit_v: bool

    @property
    def variant(self) -> str:
        """Run-folder name: the K config's slug, or `kslug__vslug` when V was named explicitly."""
        return f"{self.k.slug}__{self.v.slug}" if self.explicit_v else self.k.slug

    @property
    def nominal_bits(self) -> float | None:
        """Nominal bits of the K codec (None when it has none, e.g. identity)."""
        return self.k.nominal_bits


def parse_codec(preset: str, value_group: int) -> CodecSpec:
    explicit_v = "/" in preset
    try:
        k, v = kv_configs(preset, value_group=value_group)
    except ValueError as err:  # CodecError is a ValueError
        raise RunError(f"bad codec preset {preset!r}: {err}") from None
    canonical = f"{k}/{v}" if explicit_v else str(k)
    return CodecSpec(preset=canonical, k=k, v=v, explicit_v=explicit_v)


def parse_codec_list(
    lists: str | Sequence[str] | None = None, repeated: Sequence[str] | None = None, *, value_group: int = 32
) -> list[CodecSpec]:
    """Codec specs from `--codecs A,B,...` (one or more such strings) and repeated `--codec A` flags, in order,
    duplicates (same folder name) dropped. Each preset is validated by parsing it."""
    presets: list[str] = []
    if isinstance(lists, str):
        lists = [lists]
    for text in lists or ():
        presets.extend(split_codec_list(text))
    for one in repeated or ():
        if not one or not one.strip():
            raise RunError("empty --codec value; expected e.g. --codec kivi:bits=2,group=32")
        presets.append(one.strip())
    specs: list[CodecSpec] = []
    seen: set[str] = set()
    for p in presets:
        spec = parse_codec(p, value_group)
        if spec.variant in seen:
            continue
        if spec.variant == REFERENCE:
            raise RunError(f"codec preset {p!r} collides with the reference folder name")
        seen.add(spec.variant)
        specs.append(spec)
    return specs


# ----------------------------------------------------------------------------------------------------------------
# Sizes

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {"": 2**30, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
               "gb": 10**9, "tb": 10**12}


def parse_size(text: str, *, what: str = "size") -> int:
    """Bytes from `2GiB`, `512MiB`, `1.5` (GiB when no unit), `48KiB`, `3e9B`; floors to a whole byte."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise RunError(f"{what} {text!r} is not a size; expected e.g. 2GiB, 512MiB, 48KiB or a number of GiB")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise RunError(f"{what} {text!r} is less than one byte")
    return value


# ----------------------------------------------------------------------------------------------------------------
# torchrun sharding


def rank_info() -> tuple[int, int]:
    """(rank, world_size) from torchrun's RANK / WORLD_SIZE environment variables; (0, 1) when absent."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise RunError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not integers"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise RunError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    return rank, world


def shard(n_items: int, rank: int, world_size: int) -> list[int]:
    """Item indices for this rank: round-robin, so every item goes to exactly one rank and loads stay balanced."""
    return list(range(rank, n_items, world_size))


def local_device(rank: int) -> torch.device:
    """The CUDA device of this rank (LOCAL_RANK, else rank modulo the device count), or CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local % torch.cuda.device_count())


DEVICES = "cpu, cuda or cuda:N"  # what mmkv is tested on


def parse_device(text: str | None, rank: int = 0) -> torch.device:
    """The torch device of `--device` (None: this rank's GPU, else CPU; `cuda`: this rank's GPU), checked to exist
    on this machine."""
    if text is None:
        return local_device(rank)
    m = re.fullmatch(r"\s*(cpu|cuda)(?::(\d+))?\s*", str(text))
    if m is None or (m[1] == "cpu" and m[2] is not None):
        raise RunError(f"--device {text!r} is not a device mmkv runs on; expected {DEVICES}")
    if m[1] == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RunError(f"--device {text}: torch sees no CUDA GPU on this machine (torch {torch.__version__}, built "
                       f"for CUDA {torch.version.cuda}); use --device cpu")
    count = torch.cuda.device_count()
    if m[2] is not None and int(m[2]) >= count:
        raise RunError(f"--device {text}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", int(m[2])) if m[2] is not None else local_device(rank)  # cuda: this rank's GPU


# ----------------------------------------------------------------------------------------------------------------
# Seeded noise


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device`. To CUDA through pinned memory, asynchronously: a copy from pageable memory waits for
    the GPU to finish its queued work (a host sync), which would keep the host from running ahead of the GPU, as a
    rollout's CUDA graphs need it to (pipelines/wan/graphs.py). The bytes are the same either way."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


class NoiseStream:
    """Every random draw of one rollout, from a private generator seeded by (seed, item index), hashed as drawn.

    Draws are made on the CPU in float32 and then moved/cast, so the bytes are the same on every device and for every
    codec; `sha256` covers every float32 byte drawn, in order. The reference and each codec build a fresh stream with
    the same (seed, index) and so consume identical noise.
    """

    def __init__(self, seed: int, index: int, stream: str = "noise"):
        self.seed = int(seed)
        self.index = int(index)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(derive_seed(self.seed, stream, self.index))
        self._hash = hashlib.sha256()
        self.count = 0  # values drawn

    def randn(
        self, *shape: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.generator, dtype=torch.float32)
        self._hash.update(_tensor_bytes(x))
        self.count += x.numel()
        return to_device(x, device).to(dtype)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# Progress


def progress(iterable: Iterable | None = None, *, desc: str = "", total: int | None = None, rank: int = 0, leave=True):
    """A tqdm bar that hides itself off a terminal (CI logs) and stacks one line per rank."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, position=rank, leave=leave, disable=None, file=sys.stderr)
