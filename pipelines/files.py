"""Files, hashes and versions shared by the pipelines: the run error, atomic writes (from mmkv.io), JSON with the
pipelines' value types, SHA-256 of files, trees and tensors, and the library versions a run records."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from mmkv.codecs.config import CodecConfig


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
    """The checkout's HEAD commit; in an install from a copy without `.git` (a device machine's working tree), the
    commit named by the MMKV_GIT_COMMIT variable (`MMKV_GIT_COMMIT=$(git rev-parse HEAD)` where the copy was made)."""
    if os.environ.get("MMKV_GIT_COMMIT"):
        return os.environ["MMKV_GIT_COMMIT"]
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
