"""Run-folder utilities shared by the video and audio pipelines.

Everything a generation command needs besides the model: atomic file writes, prompt files, codec lists, torchrun
sharding, seeded noise with a SHA-256 of every byte drawn, and the run-folder layout the metrics read:

    RUN/manifest.rank{R}.json                 run config, versions, checkpoint hashes, rollouts this rank wrote
    RUN/timings.rank{R}.json                  wall times of this rank: when each run started and ended, per rollout
    RUN/rollouts/<item>/<variant>/...         one folder per (prompt or clip, reference or codec)
    RUN/rollouts/<item>/<variant>/rollout.json   written LAST, atomically: its presence marks the rollout complete
    RUN/rollouts/<item>/<variant>/timings.json   the rollout's wall times, written just after rollout.json
    RUN/rollouts/<item>/<variant>/failed.json    instead, when the rollout ran but its output holds NaN / Inf

Wall times live only in the two timings files, so two identical runs write identical bytes in every other file. A
timings file may be missing (a run killed between the two writes, or deleted): readers show no time then, and a
rollout without one is still complete.

A rerun of the same command skips complete rollouts and redoes incomplete (and failed) ones, so a sweep killed at any
point and restarted loses nothing and duplicates nothing; it must use the same checkpoints (their SHA-256 are
recorded in the manifest and in every rollout.json) or it is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import platform
import re
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from mmkv.codecs.config import CodecConfig, CodecError, split_preset_list
from mmkv.codecs.registry import kv_configs
from mmkv.codecs.seeds import derive_seed

REFERENCE = "reference"  # variant name of the native (uncompressed) cache rollout


class RunError(ValueError):
    """Bad input to a run (prompt file, codec list, run folder); the message names the file and the problem."""


# ----------------------------------------------------------------------------------------------------------------
# Atomic writes (mmkv.io; re-exported here for the pipelines)

from mmkv.io import atomic_path, atomic_save_npy, atomic_save_safetensors, atomic_write_bytes  # noqa: E402,F401
from mmkv.io import WriteError, atomic_save_wav, atomic_write_text, remove_stale_temps  # noqa: E402,F401
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


_SHA256_CACHE: dict[tuple[str, int, int], str] = {}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes, cached in this process by (path, size, mtime): a run hashes its multi-GB
    checkpoints once, though the resume check and the loaders both ask."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA256_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
        _SHA256_CACHE[key] = h.hexdigest()
    return _SHA256_CACHE[key]


def sha256_tree(root: str | os.PathLike, files: Iterable[str | os.PathLike]) -> str:
    """One SHA-256 for a set of files under `root`: over `relative path <TAB> file SHA-256` lines, sorted, so it
    changes when any file's bytes, name or presence changes and not with the folder's location."""
    root = os.path.abspath(root)  # not resolved: files may be links into a cache (Hugging Face snapshots)
    lines = sorted(f"{Path(os.path.relpath(os.path.abspath(f), root)).as_posix()}\t{sha256_file(f)}\n" for f in files)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def check_finite(tensors: dict[str, torch.Tensor], source: str, *, allow_inf: Iterable[str] = ()) -> None:
    """Refuse weights holding NaN or Inf (a diverged or corrupt checkpoint), naming the first such tensor: such a
    model renders NaN everywhere, which would be reported as a codec's failure. Tensors named in `allow_inf` (buffers
    such as an additive attention mask, -inf by design) may hold +-Inf but not NaN."""
    allow_inf = set(allow_inf)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        bad_mask = torch.isnan(t) if name in allow_inf else ~torch.isfinite(t)
        if bool(bad_mask.any()):
            raise RunError(f"{source}: tensor {name!r} holds {int(bad_mask.sum())} non-finite value(s) (NaN or Inf) "
                           f"of {t.numel()}; the checkpoint is corrupt or its training diverged")


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


FAILED_FILE = "failed.json"  # beside rollout.json: a rollout that ran and failed (reason inside), never both
TIMINGS_FILE = "timings.json"  # beside rollout.json: its wall times, kept apart so rollout.json depends only on inputs


class NonFiniteError(ValueError):
    """A rollout output (latents, decoded frames, waveform) holding NaN or Inf; the rollout is recorded as failed."""


def nonfinite_outputs(outputs: dict[str, torch.Tensor]) -> str | None:
    """Why a rollout's outputs cannot be used (`latents: 37 of 3456 values are NaN or Inf`), or None when all are
    finite. A NaN rollout decodes to a black video or silence that would otherwise be scored as a result."""
    problems = []
    for name, t in outputs.items():
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            problems.append(f"{name}: {bad} of {t.numel()} values are NaN or Inf")
    return "; ".join(problems) or None


def failure_record(kind: str, item: str, index: int, variant: str, preset: str | None, reason: str,
                   error: str, **facts: Any) -> dict[str, Any]:
    """The failed.json record (and the manifest's `failures` entry) of a rollout that ran but failed."""
    return {"kind": kind, "status": "failed", "item": item, "item_index": index, "variant": variant,
            "preset": preset, "reason": reason, "error": error, **facts}


def say(text: str) -> None:
    """One line of run output on stdout, whether or not it is a terminal (progress bars stay terminal-only); printed
    through tqdm so an active bar is redrawn below it."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def rollout_line(item: str, variant: str, seconds: float | None, kv_bytes: int | None,
                 peak_kv_bytes: int | None = None) -> str:
    """`p0000 reference: 12.3 s, KV 1,234,567 B (peak 2,345,678 B)`: the line printed after each rollout."""
    secs = "-" if seconds is None else f"{seconds:.2f} s"
    kv = "-" if kv_bytes is None else f"{int(kv_bytes):,} B"
    peak = "" if peak_kv_bytes is None else f" (peak {int(peak_kv_bytes):,} B)"
    return f"{item} {variant}: {secs}, KV {kv}{peak}"


def item_name(index: int) -> str:
    """Folder name of prompt / clip `index`: `p0003`."""
    return f"p{int(index):04d}"


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Fail early, without creating anything, when folder `path` cannot be created or written: a path under a file,
    or a read-only / not writable nearest existing folder."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:  # a relative path whose every parent is missing: the working directory holds it
        existing = Path.cwd()
    if not existing.is_dir():
        where = "exists and is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise RunError(f"{flag} {path} {where}, not a directory; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunError(f"{flag} {path} cannot be written: {existing} is read-only or not writable by this user; "
                       f"choose another {flag}")
    return path


class RunFolder:
    """The run folder: rollout paths, completion checks, and this rank's manifest (merged across restarts)."""

    def __init__(self, root: str | os.PathLike, rank: int = 0, world_size: int = 1):
        self.root = check_out_dir(root)
        self.rank = rank
        self.world_size = world_size
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # e.g. a race with another process, or a filesystem that refuses the name
            raise RunError(f"--out {self.root} cannot be created ({err.strerror or err}); choose another "
                           "--out") from None

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

    def rollout_timings(self, item: str, variant: str) -> dict[str, Any] | None:
        """The wall times of a rollout (its timings.json), or None when it is missing or unreadable."""
        try:
            timings = json.loads((self.rollout_dir(item, variant) / TIMINGS_FILE).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None
        return timings if isinstance(timings, dict) else None

    def write_rollout(self, item: str, variant: str, record: dict[str, Any],
                      timings: dict[str, Any] | None = None) -> Path:
        """Write rollout.json last and atomically, then its `timings`; call only after every file it lists is in
        place. A failure record of an earlier attempt is removed: this one succeeded."""
        path = self.rollout_dir(item, variant) / "rollout.json"
        # an older attempt's times must not pass as this rollout's if the run is killed between the two writes
        (path.parent / TIMINGS_FILE).unlink(missing_ok=True)
        atomic_write_json(path, record)
        (path.parent / FAILED_FILE).unlink(missing_ok=True)
        if timings is not None:
            atomic_write_json(path.parent / TIMINGS_FILE, timings)
        return path

    def write_failure(self, item: str, variant: str, record: dict[str, Any]) -> Path:
        """Record a rollout that ran but produced no usable output (e.g. NaN latents) as `failed.json`, so the report
        can list it; no rollout.json is written, so the rollout stays incomplete and a rerun tries it again."""
        (self.rollout_dir(item, variant) / TIMINGS_FILE).unlink(missing_ok=True)  # an older attempt's
        return atomic_write_json(self.rollout_dir(item, variant) / FAILED_FILE, record)

    # -- manifest ------------------------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / f"manifest.rank{self.rank}.json"

    @property
    def timings_path(self) -> Path:
        return self.root / f"timings.rank{self.rank}.json"

    def open_manifest(self, config: dict[str, Any], *, identity_keys: Sequence[str] = (),
                      labels: dict[str, str] | None = None) -> "Manifest":
        """Load this rank's manifest (or start one). When resuming, the values of `identity_keys` in the stored config
        must equal the new ones (a rerun with another seed, model or checkpoint must not mix into the same folder);
        `labels` names the input behind a `*_sha256` key in the error. Temp files of this rank's manifest and timings
        left by a killed write are removed first (only this rank writes them)."""
        remove_stale_temps(self.manifest_path)
        remove_stale_temps(self.timings_path)
        return Manifest(self.manifest_path, config, identity_keys, labels, timings_path=self.timings_path)

    def check_identity(self, item: str, variant: str, record: dict[str, Any], expected: dict[str, Any],
                       labels: dict[str, str] | None = None) -> None:
        """Refuse a finished rollout whose recorded inputs (`expected`: key -> value, e.g. checkpoint hashes) differ
        from this run's: it may have been written by another rank's earlier run, which this rank's manifest does not
        know."""
        where = self.rollout_dir(item, variant) / "rollout.json"
        for key, want in expected.items():
            if record.get(key) != want:
                raise RunError(identity_mismatch(where, key, record.get(key), want, labels))


def identity_mismatch(where: Path, key: str, old: Any, new: Any, labels: dict[str, str] | None = None) -> str:
    """The one-line error for a resume whose inputs differ from those the run folder was made with."""
    if key.endswith("_sha256"):
        label = (labels or {}).get(key, key[: -len("_sha256")])
        return (f"{where}: this run folder was made from a {label} with SHA-256 {old or '(not recorded)'}, the command "
                f"now gives one with SHA-256 {new}; resuming would mix the two in one table: give another --out "
                f"folder for this {label}, or the same {label} to resume")
    return (f"{where}: this run folder was made with {key}={old!r}, the command now asks for {new!r}; "
            f"use another --out folder or the same settings to resume")


class Manifest:
    """One rank's manifest: run config, versions, extra facts (checkpoint hashes), rollouts written; saved
    atomically, with this rank's wall times (`timings`: run start and end, per-rollout times) in a file of their own.

    `runs` in the manifest lists each invocation's settings; the timings file's `runs` entry `{"run": i, "started",
    "finished"}` gives the times of the manifest's `runs[i]`, and its `rollouts` maps `item/variant` to that rollout's
    timings.json."""

    def __init__(self, path: Path, config: dict[str, Any], identity_keys: Sequence[str] = (),
                 labels: dict[str, str] | None = None, *, timings_path: Path):
        self.path = path
        self.timings_path = timings_path
        self.data: dict[str, Any] = {"config": config, "versions": versions(), "rollouts": [], "runs": []}
        self.timings: dict[str, Any] = _read_timings(self.timings_path)
        if path.exists():
            old = read_json(path)
            if not isinstance(old, dict) or "config" not in old:
                raise RunError(f"{path}: not an mmkv run manifest (no 'config'); use another --out folder")
            for key in identity_keys:
                a, b = old["config"].get(key), _jsonable(config.get(key))
                if a != b:
                    raise RunError(identity_mismatch(path, key, a, b, labels))
            self.data["rollouts"] = list(old.get("rollouts", []))
            self.data["runs"] = list(old.get("runs", []))
            for k, v in old.items():
                self.data.setdefault(k, v)
            self._move_old_wall_times()

    def _move_old_wall_times(self) -> None:
        """Manifests written before the timings file held the times inline: move them there."""
        for i, run in enumerate(self.data["runs"]):
            clock = {k: run.pop(k) for k in _RUN_CLOCK if isinstance(run, dict) and k in run}
            if clock:
                self.timings["runs"].append({"run": i, **clock})
        for entry in self.data["rollouts"]:
            if isinstance(entry, dict) and ("timings" in entry or "seconds" in entry):
                old = entry.pop("timings", None) or {"total": entry.get("seconds")}
                entry.pop("seconds", None)
                self.timings["rollouts"].setdefault(f"{entry.get('item')}/{entry.get('variant')}", old)

    def start_run(self, facts: dict[str, Any]) -> dict[str, Any]:
        """Record one invocation: its `facts` (settings, versions) in the manifest, its start time in the timings;
        returns that timings entry, where the caller may set `finished`."""
        self.data["runs"].append(dict(facts))
        clock = {"run": len(self.data["runs"]) - 1, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.timings["runs"].append(clock)
        return clock

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def add_rollout(self, entry: dict[str, Any], timings: dict[str, Any] | None = None) -> None:
        """Record a rollout (replacing an earlier entry for the same item and variant) and its wall times, when known
        (a finished rollout whose timings.json is gone keeps the times recorded here before)."""
        key = (entry["item"], entry["variant"])
        self.data["rollouts"] = [r for r in self.data["rollouts"] if (r["item"], r["variant"]) != key]
        self.data["rollouts"].append(entry)
        if timings is not None:
            self.timings["rollouts"][f"{key[0]}/{key[1]}"] = timings

    def save(self) -> Path:
        atomic_write_json(self.path, self.data)
        atomic_write_json(self.timings_path, self.timings)
        return self.path


_RUN_CLOCK = ("started", "finished")  # the wall-clock keys of a `runs` entry


def _read_timings(path: Path) -> dict[str, Any]:
    """A rank's timings file, or an empty one when it is missing or unreadable: times are never worth refusing a
    resume over."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        old = None
    old = old if isinstance(old, dict) else {}
    runs, rollouts = old.get("runs"), old.get("rollouts")
    return {"runs": runs if isinstance(runs, list) else [], "rollouts": rollouts if isinstance(rollouts, dict) else {}}


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=_json_default))


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint files (both pipelines read them the same way)

CHECKPOINT_FORMATS = "a torch.save file (zip or legacy pickle, e.g. .pt / .pth) or a .safetensors file"
_SAFE_CONTENTS = "tensors, dicts / lists / tuples of them, numbers, strings, numpy scalars and argparse.Namespace"


def checkpoint_format(path: str | os.PathLike) -> str | None:
    """'torch-zip', 'torch-pickle' or 'safetensors', read off a file's first bytes; None when it is none of them."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # pickle's PROTO opcode: torch's legacy format
        return "torch-pickle"
    if len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= path.stat().st_size - 8:
        return "safetensors"  # an 8-byte little-endian header length, then the JSON header
    return None


def _data_only_globals() -> list:
    """Types that training scripts pickle beside the weights and that torch's weights_only unpickler rebuilds without
    running any other code: numpy scalars (step counters, losses) and argparse.Namespace (the run's arguments)."""
    import argparse

    dtypes = [t for t in vars(np.dtypes).values() if isinstance(t, type) and issubclass(t, np.dtype)]
    return [argparse.Namespace, np._core.multiarray.scalar, np.dtype, *dtypes]


def check_checkpoint_file(path: str | os.PathLike, *, error: type[Exception] = RunError) -> str:
    """The format of checkpoint file `path` (see `checkpoint_format`), from its first bytes only; raises `error`
    naming the file when it is missing, empty or of no format mmkv reads."""
    path = Path(path)
    if not path.is_file():
        raise error(f"checkpoint file {path} does not exist")
    if path.stat().st_size == 0:
        raise error(f"checkpoint file {path} is empty")
    fmt = checkpoint_format(path)
    if fmt is None:
        what = "a readable safetensors file" if path.suffix == ".safetensors" else "a PyTorch or safetensors file"
        raise error(f"checkpoint file {path} is not {what} (its first bytes match neither format); expected "
                    f"{CHECKPOINT_FORMATS}")
    return fmt


def read_checkpoint_file(path: str | os.PathLike, *, error: type[Exception] = RunError) -> Any:
    """What a checkpoint file holds, by its content (not its suffix): a safetensors file as a flat dict of tensors, a
    torch.save file through `torch.load(weights_only=True)`, which never runs pickled code. Raises `error` with a
    message naming the file: missing, empty, not a checkpoint at all, corrupt, or holding other pickled objects."""
    path = Path(path)
    fmt = check_checkpoint_file(path, error=error)
    if fmt == "safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as err:  # safetensors raises its own SafetensorError
            raise error(f"checkpoint file {path} is not a readable safetensors file ({err})") from None
    try:
        with torch.serialization.safe_globals(_data_only_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=fmt == "torch-zip")
    except pickle.UnpicklingError as err:
        names = _unsafe_globals(path, str(err)) if fmt == "torch-zip" else _named_globals(str(err))
        if not names:  # torch's text here is advice about weights_only, never worth passing on
            raise error(f"checkpoint file {path} is corrupt or truncated (its pickle stream cannot be read)") from None
        raise error(
            f"checkpoint file {path} holds pickled objects other than tensors and plain containers "
            f"({', '.join(names)}); refusing to execute pickled code, which unpickling them would do. Readable "
            f"contents: {_SAFE_CONTENTS}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError, IndexError) as err:
        detail = (str(err).splitlines() or [""])[0].split(". ")[0]  # torch's first sentence names the damage
        detail = "" if "weights_only" in detail else f" ({type(err).__name__}: {detail})"
        raise error(f"checkpoint file {path} is corrupt or truncated, or not a torch.save file{detail}") from None


def _named_globals(message: str) -> list[str]:
    """The disallowed globals or classes a weights_only error names."""
    found = re.findall(r"GLOBAL (\S+) was not an allowed global", message)
    found += re.findall(r"but got <class '([^']+)'>", message)
    return sorted(set(found))


def _unsafe_globals(path: Path, message: str) -> list[str]:
    """Every disallowed global in a torch zip checkpoint (torch's error names only the first)."""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _data_only_globals()}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a damaged archive: fall back to the one name in the error
        return _named_globals(message)
    return sorted(set(found) - allowed) or _named_globals(message)


# ----------------------------------------------------------------------------------------------------------------
# Progress


def progress(iterable: Iterable | None = None, *, desc: str = "", total: int | None = None, rank: int = 0, leave=True):
    """A tqdm bar that hides itself off a terminal (CI logs) and stacks one line per rank."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, position=rank, leave=leave, disable=None, file=sys.stderr)
