"""The one way mmkv writes files: to a hidden temp file in the same folder, fsync, then `os.replace` (atomic on
POSIX), so a run killed at any point leaves either the old file or the new one, never half of one.

Files get the user's umask (the temp file is created 0666 & ~umask, as `open` would), a failed write (disk full,
read-only filesystem) raises `WriteError` naming the file, and the bytes written depend only on the data: safetensors
headers have a fixed key order and WAV files carry no timestamped chunk, so identical runs write identical files.
A temp file left by a process killed mid-write (SIGKILL skips every cleanup) matches `temp_glob(path)`;
`remove_stale_temps` deletes them when a later run opens the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any, Callable, Iterator


class WriteError(OSError, ValueError):
    """A file that could not be written (disk full, read-only filesystem, ...); the message names the file.

    A ValueError too, so the CLI prints it as a one-line error instead of a traceback. `WriteError(errno, message)`;
    `errno` may be None (e.g. ffmpeg failed without saying why)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def temp_glob(path: str | os.PathLike) -> str:
    """Glob pattern (in `path`'s folder) of the temp files `atomic_path(path)` creates: `.{stem}.*.tmp{suffix}`."""
    path = Path(path)
    return f".{path.stem}.*.tmp{path.suffix}"


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Delete temp files of `path` left by a killed writer; call only where no other process writes `path`."""
    path = Path(path)
    stale = sorted(path.parent.glob(temp_glob(path))) if path.parent.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _create_temp(path: Path) -> Path:
    # os.open with 0o666 applies the umask, as open() does (tempfile.mkstemp would force 0600 on every output).
    for _ in range(100):
        tmp = path.parent / f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp file name next to {path}")


def _write_error(path: Path, err: OSError) -> WriteError:
    reason = err.strerror or str(err) or type(err).__name__
    return WriteError(err.errno, f"cannot write {path}: {reason}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it is renamed onto `path`, on error it is removed.

    For writers that want a file name (ffmpeg, numpy). The temp name keeps the suffix so format sniffing works. An
    OSError while writing, syncing or renaming becomes a `WriteError` naming `path`.
    """
    path = Path(path)
    tmp_path: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = _create_temp(path)
        yield tmp_path
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_path, path)
    except WriteError:
        raise
    except OSError as err:
        raise _write_error(path, err) from err
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
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


def safetensors_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file whose bytes depend only on its content.

    safetensors serialises `__metadata__` from a hash map, so its key order (and the file's bytes) changes from run
    to run; the data layout is already fixed (tensors sorted by dtype and name). The header is rewritten here with
    `__metadata__` first and sorted, the tensors in data order, padded with spaces to 8 bytes as the library does.
    """
    from safetensors.torch import save

    raw = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=metadata)
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8: 8 + n])
    meta = header.pop("__metadata__", None)
    ordered: dict[str, Any] = {} if meta is None else {"__metadata__": dict(sorted(meta.items()))}
    ordered.update(sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"][0], kv[0])))
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    return atomic_write_bytes(path, safetensors_bytes(tensors, metadata))


def wav_bytes(samples, sample_rate: int) -> bytes:
    """A 32-bit float WAV (WAVE_FORMAT_IEEE_FLOAT: fmt, fact and data chunks) of `[N]` or `[N, C]` samples.

    Written here rather than by libsndfile, which adds a PEAK chunk holding the write time to every float WAV.
    """
    import numpy as np

    x = np.asarray(samples, dtype="<f4")
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"WAV samples must be [N] or [N, channels], got shape {tuple(x.shape)}")
    frames, channels = x.shape
    data = np.ascontiguousarray(x).tobytes()
    block = 4 * channels
    fmt = struct.pack("<HHIIHHH", 3, channels, int(sample_rate), int(sample_rate) * block, block, 32, 0)
    chunks = (b"fmt " + struct.pack("<I", len(fmt)) + fmt
              + b"fact" + struct.pack("<II", 4, frames)
              + b"data" + struct.pack("<I", len(data)) + data + b"\0" * (len(data) % 2))
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def atomic_save_wav(path: str | os.PathLike, samples, sample_rate: int) -> Path:
    return atomic_write_bytes(path, wav_bytes(samples, sample_rate))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_pretrained(obj: Any, folder: str | os.PathLike) -> Path:
    """`obj.save_pretrained(folder)` (a transformers / diffusers model, tokenizer or feature extractor), then give
    the files it wrote the user's umask: transformers 5 writes `model.safetensors` through a 0600 temp file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()}
    obj.save_pretrained(str(folder))
    mode = 0o666 & ~_umask()
    for p in folder.iterdir():
        if p.is_file() and before.get(p.name) != p.stat().st_mtime_ns and p.stat().st_mode & 0o777 != mode:
            os.chmod(p, mode)
    return folder
