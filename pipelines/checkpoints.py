"""Checkpoint files, read the same way by both pipelines: by content (safetensors or torch.save), never running
pickled code."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmkv.pipelines.files import RunError


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
