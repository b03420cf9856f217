"""Shipped Lloyd-Max codebooks: one small JSON data file per family, regenerated bit-identically by
`mmkv codebooks build`.

A codec module registers a builder with `@codebook_family("name")`; the builder returns `{key: [floats]}` computed
deterministically (float64, fixed seeds). `load(family, key)` reads the shipped file, and computes (then caches) a key
the file lacks, e.g. a head dim nobody shipped, with the same builder function `compute(family, key)`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch

from mmkv.io import atomic_write_text

DATA_DIR = Path(__file__).with_name("data")

# family -> (list of shipped keys, function key -> list of float)
_FAMILIES: dict[str, tuple[list[str], Callable[[str], list[float]]]] = {}
_CACHE: dict[tuple[str, str], torch.Tensor] = {}
_FILES: dict[str, dict[str, list[float]]] = {}


def codebook_family(name: str, keys: list[str]):
    """Decorator: register `fn(key) -> list[float]` as the builder of family `name`, shipping `keys`."""

    def deco(fn: Callable[[str], list[float]]):
        _FAMILIES[name] = (list(keys), fn)
        return fn

    return deco


def _families() -> dict[str, tuple[list[str], Callable[[str], list[float]]]]:
    import mmkv.codecs  # noqa: F401  (registers every family)

    return _FAMILIES


def _file(family: str) -> dict[str, list[float]]:
    if family not in _FILES:
        path = DATA_DIR / f"{family}.json"
        _FILES[family] = json.loads(path.read_text())["codebooks"] if path.exists() else {}
    return _FILES[family]


def compute(family: str, key: str) -> list[float]:
    fams = _families()
    if family not in fams:
        raise KeyError(f"unknown codebook family {family!r}; known: {sorted(fams)}")
    return [float(v) for v in fams[family][1](key)]


def load(family: str, key: str) -> torch.Tensor:
    """A codebook as a float32 tensor (CPU); shipped values if present, else computed once and cached."""
    ck = (family, key)
    if ck not in _CACHE:
        values = _file(family).get(key)
        if values is None:
            values = compute(family, key)
        _CACHE[ck] = torch.tensor(values, dtype=torch.float64).to(torch.float32)
    return _CACHE[ck]


def render(family: str) -> str:
    keys, fn = _families()[family]
    books = {k: [float(v) for v in fn(k)] for k in keys}
    return json.dumps({"family": family, "codebooks": books}, indent=1, sort_keys=True) + "\n"


def build(out_dir: Path = DATA_DIR, families: list[str] | None = None) -> list[Path]:
    """Write every family's data file atomically; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fam in families or sorted(_families()):
        written.append(atomic_write_text(out_dir / f"{fam}.json", render(fam)))
    _FILES.clear()
    _CACHE.clear()
    return written


# -- CLI: `mmkv codebooks build` ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="folder to write the JSON files (default: the package's)")
    parser.add_argument("--family", action="append", help="only this family (repeatable); default: all")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a shipped file differs")


def run(args: argparse.Namespace) -> int:
    fams = args.family or sorted(_families())
    if args.check:
        bad = [f for f in fams if not (DATA_DIR / f"{f}.json").exists() or (DATA_DIR / f"{f}.json").read_text() != render(f)]
        for f in bad:
            print(f"codebook family {f!r} differs from its shipped file {DATA_DIR / (f + '.json')}")
        print("codebooks: all shipped files regenerate bit-identically" if not bad else "codebooks: MISMATCH")
        return 1 if bad else 0
    for path in build(args.out, fams):
        print(f"wrote {path}")
    return 0
