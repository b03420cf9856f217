"""Shipped Lloyd-Max codebooks: one small JSON data file per family, written by `mmkv codebooks build`.

A codec module registers a builder with `@codebook_family("name")`; the builder returns `{key: [floats]}` computed
deterministically (float64, fixed seeds). `load(family, key)` reads the shipped file, and computes (then caches) a key
the file lacks, e.g. a head dim nobody shipped, with the same builder function `compute(family, key)`.

`build --check` regenerates every key and compares it with the shipped file within `TOLERANCE`, not bit for bit:
numpy's and torch's SIMD kernels (AVX2 against AVX-512) evaluate the densities and sums in another order, which moves
the last bits (up to ~2e-13 seen), while a real change to a builder moves values by far more.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable

import torch

from mmkv.io import atomic_write_text

DATA_DIR = Path(__file__).with_name("data")
# Values agree when |a - b| <= 1e-12, or 1e-12 relative for values above 1 (math.isclose with both tolerances).
TOLERANCE = 1e-12
TOLERANCE_TEXT = f"{TOLERANCE:g} (absolute, relative for values above 1)"

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
    from mmkv.codecs.registry import get_codec_class, names

    for name in names():  # importing a codec module registers its families
        get_codec_class(name)
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
    parser.add_argument("--check", action="store_true",
                        help=f"do not write; exit 1 if a shipped value differs by more than {TOLERANCE_TEXT}")


def differences(fresh: dict[str, list[float]], shipped: dict[str, list[float]]) -> list[str]:
    """What differs between freshly computed and shipped codebooks beyond `TOLERANCE`, one line per key."""
    out = [f"key {k!r} is missing from the shipped file" for k in sorted(set(fresh) - set(shipped))]
    out += [f"key {k!r} is shipped but no longer built" for k in sorted(set(shipped) - set(fresh))]
    for k in sorted(set(fresh) & set(shipped)):
        a, b = fresh[k], shipped[k]
        if len(a) != len(b):
            out.append(f"key {k!r} has {len(a)} values, the shipped file {len(b)}")
            continue
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not math.isclose(x, y, rel_tol=TOLERANCE, abs_tol=TOLERANCE)]
        if bad:
            worst = max(bad, key=lambda i: abs(a[i] - b[i]))
            out.append(f"key {k!r}: {len(bad)} of {len(a)} values differ, the most at index {worst} "
                       f"({a[worst]!r} computed, {b[worst]!r} shipped)")
    return out


def check(family: str) -> list[str]:
    """`differences` of a whole family against its shipped file (a missing file is one difference)."""
    path = DATA_DIR / f"{family}.json"
    if not path.exists():
        return [f"no shipped file {path}"]
    return differences(json.loads(render(family))["codebooks"], json.loads(path.read_text())["codebooks"])


def run(args: argparse.Namespace) -> int:
    fams = args.family or sorted(_families())
    unknown = sorted(set(fams) - set(_families()))
    if unknown:
        raise ValueError(f"unknown codebook family {unknown[0]!r}; known: {sorted(_families())}")
    if args.check:
        bad = 0
        for f in fams:
            found = check(f)
            bad += bool(found)
            for line in found:
                print(f"codebook family {f!r} differs from {DATA_DIR / (f + '.json')}: {line}")
        if bad:
            print(f"codebooks: MISMATCH in {bad} of {len(fams)} families (compared within {TOLERANCE_TEXT}); "
                  "run `mmkv codebooks build` to rewrite the files if the change is intended")
            return 1
        print(f"codebooks: every shipped file ({', '.join(fams)}) regenerates within {TOLERANCE_TEXT}")
        return 0
    for path in build(args.out, fams):
        print(f"wrote {path}")
    return 0
