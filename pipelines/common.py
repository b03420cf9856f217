"""Run-folder utilities shared by the video and audio pipelines.

Everything a generation command needs besides the model: atomic file writes, prompt files, codec lists, torchrun
sharding, seeded noise with a SHA-256 of every byte drawn, and the run-folder layout the metrics read:

    RUN/manifest.rank{R}.json                 run config, versions, checkpoint hashes, rollouts this rank wrote
    RUN/rollouts/<item>/<variant>/...         one folder per (prompt or clip, reference or codec)
    RUN/rollouts/<item>/<variant>/rollout.json   written LAST, atomically: its presence marks the rollout complete

A rerun of the same command skips complete rollouts and redoes incomplete ones, so a sweep killed at any point and
restarted loses nothing and duplicates nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from mmkv.codecs.base import CodecConfig, derive_seed, kv_configs

REFERENCE = "reference"  # variant name of the native (uncompressed) cache rollout


class RunError(ValueError):
    """Bad input to a run (prompt file, codec list, run folder); the message names the file and the problem."""


# ----------------------------------------------------------------------------------------------------------------
# Atomic writes (mmkv.io; re-exported here for the pipelines)

from mmkv.io import atomic_path, atomic_save_npy, atomic_save_safetensors, atomic_write_bytes  # noqa: E402,F401
from mmkv.io import atomic_write_text  # noqa: E402,F401
from mmkv.io import atomic_write_json as _atomic_write_json  # noqa: E402


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return _atomic_write_json(path, obj, default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (Path, torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, CodecConfig):
        return str(obj)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RunError(f"{path}: not valid JSON ({err})") from None


# ----------------------------------------------------------------------------------------------------------------
# Hashes and versions


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tensors(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the raw bytes of tensors, in order (CPU, contiguous, their own dtype)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bf16; hash the same 2-byte words
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def versions() -> dict[str, str | None]:
    """Versions of everything that can change a number: Python, torch, CUDA, GPU, and the model libraries."""
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("mmkv", "torch", "numpy", "diffusers", "transformers", "safetensors", "imageio", "imageio-ffmpeg"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["cuda"] = torch.version.cuda
    out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    out["git_commit"] = _git_commit()
    return out


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent.parent
    head = here / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref_path = here / ".git" / ref[5:]
            if ref_path.exists():
                return ref_path.read_text().strip()
            packed = here / ".git" / "packed-refs"
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref[5:]):
                    return line.split()[0]
            return None
        return ref
    except OSError:
        return None


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

# A comma-separated token starts a new codec when it begins with a bare name followed by ':' or the end of the token
# (`kivi:bits=2`, `identity`); tokens containing `key=value` first continue the previous preset (`group=32`).
_NEW_CODEC = re.compile(r"^\s*[A-Za-z][\w.-]*\s*(:|$)")


def split_codec_list(text: str) -> list[str]:
    """Split `kivi:bits=2,group=32,octopus:b=3,identity` into presets, keeping commas inside a preset."""
    if not isinstance(text, str) or not text.strip():
        raise RunError(f"empty codec list {text!r}; expected e.g. 'octopus:b=3,kivi:bits=2,group=32'")
    presets: list[str] = []
    for token in text.split(","):
        if not token.strip():
            raise RunError(f"empty entry in codec list {text!r} (two commas in a row or a trailing comma?)")
        if _NEW_CODEC.match(token) or not presets:
            presets.append(token.strip())
        else:
            presets[-1] += "," + token.strip()
    return presets


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
        """Nominal bits from the K preset's `b`/`bits` parameter (None when it has none, e.g. identity)."""
        bits = self.k.get("bits", self.k.get("b"))
        return float(bits) if isinstance(bits, (int, float)) and not isinstance(bits, bool) else None


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


# ----------------------------------------------------------------------------------------------------------------
# Seeded noise


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
        return x.to(device=device, dtype=dtype)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# Run folders


def item_name(index: int) -> str:
    """Folder name of prompt / clip `index`: `p0003`."""
    return f"p{int(index):04d}"


class RunFolder:
    """The run folder: rollout paths, completion checks, and this rank's manifest (merged across restarts)."""

    def __init__(self, root: str | os.PathLike, rank: int = 0, world_size: int = 1):
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        if self.root.exists() and not self.root.is_dir():
            raise RunError(f"run folder {self.root} exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)

    # -- rollouts ------------------------------------------------------------------------------------------------
    def rollout_dir(self, item: str, variant: str) -> Path:
        return self.root / "rollouts" / item / variant

    def rollout_record(self, item: str, variant: str) -> dict[str, Any] | None:
        """The rollout.json of a complete rollout (all its listed files present), else None."""
        path = self.rollout_dir(item, variant) / "rollout.json"
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None  # a torn file cannot happen with atomic writes, but never trust it: redo the rollout
        files = record.get("files", {}) if isinstance(record, dict) else {}
        values = files.values() if isinstance(files, dict) else files
        if any(not (path.parent / name).is_file() for name in values):
            return None
        return record

    def is_complete(self, item: str, variant: str) -> bool:
        return self.rollout_record(item, variant) is not None

    def write_rollout(self, item: str, variant: str, record: dict[str, Any]) -> Path:
        """Write rollout.json last and atomically; call only after every file it lists is in place."""
        path = self.rollout_dir(item, variant) / "rollout.json"
        atomic_write_json(path, record)
        return path

    # -- manifest ------------------------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / f"manifest.rank{self.rank}.json"

    def open_manifest(self, config: dict[str, Any], *, identity_keys: Sequence[str] = ()) -> "Manifest":
        """Load this rank's manifest (or start one). When resuming, the values of `identity_keys` in the stored config
        must equal the new ones (a rerun with another seed or model must not mix into the same folder)."""
        return Manifest(self.manifest_path, config, identity_keys)


class Manifest:
    """One rank's manifest: run config, versions, extra facts (checkpoint hashes), rollouts written; saved
    atomically."""

    def __init__(self, path: Path, config: dict[str, Any], identity_keys: Sequence[str] = ()):
        self.path = path
        self.data: dict[str, Any] = {"config": config, "versions": versions(), "rollouts": [], "runs": []}
        if path.exists():
            old = read_json(path)
            if not isinstance(old, dict) or "config" not in old:
                raise RunError(f"{path}: not an mmkv run manifest (no 'config'); use another --out folder")
            for key in identity_keys:
                a, b = old["config"].get(key), _jsonable(config.get(key))
                if a != b:
                    raise RunError(
                        f"{path}: this run folder was made with {key}={a!r}, the command now asks for {b!r}; "
                        f"use another --out folder or the same settings to resume"
                    )
            self.data["rollouts"] = list(old.get("rollouts", []))
            self.data["runs"] = list(old.get("runs", []))
            for k, v in old.items():
                self.data.setdefault(k, v)

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def add_rollout(self, entry: dict[str, Any]) -> None:
        """Record a rollout (replacing an earlier entry for the same item and variant)."""
        key = (entry["item"], entry["variant"])
        self.data["rollouts"] = [r for r in self.data["rollouts"] if (r["item"], r["variant"]) != key]
        self.data["rollouts"].append(entry)

    def save(self) -> Path:
        return atomic_write_json(self.path, self.data)


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=_json_default))


# ----------------------------------------------------------------------------------------------------------------
# Progress


def progress(iterable: Iterable | None = None, *, desc: str = "", total: int | None = None, rank: int = 0, leave=True):
    """A tqdm bar that hides itself off a terminal (CI logs) and stacks one line per rank."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, position=rank, leave=leave, disable=None, file=sys.stderr)
