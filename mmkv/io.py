"""The one way mmkv writes files: to a hidden temp file in the same folder, fsync, then `os.replace` (atomic on
POSIX), so a run killed at any point leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it is renamed onto `path`, on error it is removed.

    For writers that want a file name (imageio, soundfile). The temp name keeps the suffix so format sniffing works.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, default: Callable[[Any], Any] | None = None) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, default=default) + "\n")


def atomic_save_npy(path: str | os.PathLike, array) -> Path:
    import numpy as np

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(array), allow_pickle=False)
    return Path(path)


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    return Path(path)
