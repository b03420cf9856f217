"""Model weights shipped inside the package, checked against their recorded SHA-256 before use.

The trained tiny video model (docs/training.md) ships as `mmkv/assets/video/`, the release layout `mmkv train video`
writes: `base/` (a diffusers Wan folder: VAE, umT5 encoder, tokenizer, DiT config) and `causvid/model.pt` (the DiT as
CausVid's `{"generator": ...}`, read by both the chunk-wise and the frame-wise loops), beside `SHA256SUMS`, which
records every file in `sha256sum` format (`<hex>  <path relative to the folder>` a line), and the `train.json` of
the stage that made it (how it was trained; with it the folder is also an `--init` for more training). Shipping new
weights is `mmkv ship video --from DISTILL_OUTPUT --out mmkv/assets/video`, which copies the three and writes the
sums (`record_sums(folder)`). Every file is checked on use, so a truncated download or a file swapped after install is
refused rather than rendered.

The trained tiny audio models (docs/training.md) will ship the same way as `mmkv/assets/audio/`, the folder
`mmkv train audio --stage aar` writes: `AAR_tiny.pth`, `SAT_tiny.pth` and `clap/` (a local CLAP folder), beside
their `SHA256SUMS`; `trained_audio_assets` checks them, and `mmkv compare audio` reads them when no `--aar` is
given.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

VIDEO_ASSETS = Path(__file__).resolve().parent / "assets" / "video"
AUDIO_ASSETS = Path(__file__).resolve().parent / "assets" / "audio"
SUMS = "SHA256SUMS"
CHECKPOINT = "causvid/model.pt"
AUDIO_FILES = ("AAR_*.pth", "SAT_*.pth", "clap/config.json")  # glob patterns: one file must match each
_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")  # sha256sum's text (two spaces) and binary (" *") forms
_FIX = "reinstall mmkv, or run `mmkv demo --random` for the random tiny models"


class AssetError(ValueError):
    """Shipped weights that are incomplete or differ from their recorded SHA-256 (printed without a traceback)."""


def read_sums(path: Path) -> dict[str, str]:
    """{relative posix path: lower-case SHA-256} from a `sha256sum` file; blank and `#` lines are skipped."""
    sums: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _LINE.fullmatch(line.rstrip())
        rel = PurePosixPath(m.group(2)) if m else None
        if rel is None or rel.is_absolute() or ".." in rel.parts:
            raise AssetError(f"{path}:{n}: expected '<64 hex digits>  <path inside {path.parent}>', got {line!r}")
        sums[rel.as_posix()] = m.group(1).lower()
    return sums


def record_sums(root: str | Path) -> Path:
    """Write root/SHA256SUMS over every other file under `root` (what shipping new weights needs)."""
    from mmkv.pipelines.common import atomic_write_text, sha256_file

    root = Path(root)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != SUMS)
    return atomic_write_text(root / SUMS, "".join(f"{sha256_file(root / f)}  {f}\n" for f in files))


def check_release_dest(dest: Path) -> None:
    """Refuse a release destination that holds anything (a release is written whole, never merged)."""
    from mmkv.pipelines.files import RunError

    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise RunError(f"--out {dest} exists and is not an empty folder; give a new (or empty) folder for the release")


@contextmanager
def release_folder(dest: str | Path) -> Iterator[Path]:
    """Write a release folder whole or not at all: yields a hidden staging folder beside `dest` (new or empty);
    when the block ends without error, records its SHA256SUMS (`record_sums`) and renames it onto `dest`; a failure
    (or a kill: the next call clears it) leaves no half release."""
    dest = Path(dest)
    check_release_dest(dest)
    staging = dest.parent / f".{dest.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)  # left by a killed run
    staging.mkdir(parents=True)
    try:
        yield staging
        record_sums(staging)
        os.replace(staging, dest)  # an empty dest folder is replaced too
    finally:
        if staging.exists():
            shutil.rmtree(staging)


# A release's training state (`mmkv ship audio --training-state`: what only `--init` reads) lies under this folder.
# Its files are recorded in SHA256SUMS and checked when present; the installed package leaves them out.
TRAINING_PREFIX = "training/"


def checked_assets(root: Path, required: tuple[str, ...], required_prefix: str | None = None
                   ) -> tuple[dict[str, str], str] | None:
    """({relative path: SHA-256}, SHA-256 of SHA256SUMS) of a shipped folder whose every file is recorded and
    matches, holding a file for each of the `required` glob patterns (and one under `required_prefix`); None when
    the folder holds no files. Raises AssetError, one line naming the file, when a file is missing, unrecorded or
    differs."""
    from mmkv.pipelines.common import sha256_file

    sums_path = root / SUMS
    on_disk = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != SUMS) \
        if root.is_dir() else []
    if not sums_path.is_file():
        if on_disk:
            raise AssetError(f"{root} holds model files ({on_disk[0]}, ...) but no {SUMS} recording their SHA-256; "
                             + _FIX)
        return None
    sums = read_sums(sums_path)
    if any(not fnmatch.filter(sums, pattern) for pattern in required) or (
            required_prefix is not None and not any(f.startswith(required_prefix) for f in sums)):
        what = " and ".join(filter(None, [", ".join(required), required_prefix and f"the files of {required_prefix}"]))
        raise AssetError(f"{sums_path} must record {what}; it lists {sorted(sums)}")
    unrecorded = [f for f in on_disk if f not in sums]
    if unrecorded:
        raise AssetError(f"{root / unrecorded[0]} is not recorded in {sums_path}: every shipped file must be; " + _FIX)
    for rel, want in sums.items():
        path = root / rel
        if not path.is_file() and rel.startswith(TRAINING_PREFIX):
            continue  # only training reads it, and the installed package leaves it out (pyproject.toml)
        if not path.is_file():
            raise AssetError(f"{path} is recorded in {sums_path} but missing (an incomplete install); " + _FIX)
        have = sha256_file(path)
        if have != want:
            raise AssetError(f"{path}: SHA-256 {have} differs from {want} recorded in {sums_path}; " + _FIX)
    return sums, hashlib.sha256(sums_path.read_bytes()).hexdigest()


# The demo uses a shipped set by default only once its own held-out scores are far above chance (docs/decisions.md);
# below that its videos and clips would show a weak model as if it were what mmkv compares codecs on. Video: the
# CausVid loop's free rollouts draw the named colour (of 8: chance 12.5%) in at least half of the held-out prompts
# (the release's eval.json, `mmkv eval video`). Audio: the AAR's held-out rollouts' adherence (the detector's share
# of named attributes heard, `mmkv.metrics.adherence`; a random AAR scores about 0.17-0.25) at least 0.5 (the
# release's train.json, written by the aar stage).
DEMO_BARS = {"video": 50.0, "audio": 0.5}


def demo_ready(kind: str, found: dict[str, Any]) -> tuple[bool, str]:
    """(whether the demo uses this shipped set by default, a phrase giving the score it is judged by) for `kind`
    "video" or "audio" and a set found by `trained_video_assets` / `trained_audio_assets`."""
    import json

    bar = DEMO_BARS[kind]
    if kind == "video":
        path = Path(found["root"]) / "eval.json"
        runs = json.loads(path.read_text())["runs"] if path.is_file() else []
        free = [r for r in runs if r.get("model") == "trained" and r.get("preset") == "causvid"
                and r.get("first_block") == "generated" and not r.get("no_past")]
        if not free:
            return False, f"no held-out scores shipped with it ({path} lacks the causvid free rollouts)"
        summary = free[0]["summary"]
        score = summary.get("colour_pct") or 0.0
        return score >= bar, (f"colour {score}% on {summary['clips']} held-out prompts' free CausVid rollouts "
                              f"(chance 12.5%; the demo asks {bar}%)")
    path = Path(found["root"]) / "train.json"
    held = json.loads(path.read_text()).get("heldout", {}) if path.is_file() else {}
    rollouts = held.get("rollouts")
    if not rollouts:
        return False, f"no held-out rollout scores shipped with it ({path} lacks heldout.rollouts)"
    chance = (held.get("rollouts_random_aar") or {}).get("adherence")
    return rollouts["adherence"] >= bar, (
        f"adherence {rollouts['adherence']} on {rollouts['clips']} held-out rollouts"
        + (f" (a random AAR: {chance})" if chance is not None else "") + f"; the demo asks {bar}")


def trained_video_assets(root: str | Path | None = None) -> dict[str, Any] | None:
    """The shipped trained video model, checked: {"root", "base" (folder), "causvid" (model.pt), "sums_sha256" (of
    SHA256SUMS: names this set of weights)}, or None when no weights are shipped. Raises AssetError, one line naming
    the file, when a file is missing, unrecorded or its SHA-256 differs from the recorded one."""
    root = VIDEO_ASSETS if root is None else Path(root)
    found = checked_assets(root, (CHECKPOINT,), "base/")
    if found is None:
        return None
    return {"root": root, "base": root / "base", "causvid": root / CHECKPOINT, "sums_sha256": found[1]}


def trained_audio_assets(root: str | Path | None = None) -> dict[str, Any] | None:
    """The shipped trained audio models, checked as `trained_video_assets` checks the video one: {"root", "aar"
    (the folder `load_models` reads), "clap" (the local CLAP folder), "sums_sha256"}, or None when none is shipped."""
    root = AUDIO_ASSETS if root is None else Path(root)
    found = checked_assets(root, AUDIO_FILES)
    if found is None:
        return None
    return {"root": root, "aar": root, "clap": root / "clap", "sums_sha256": found[1]}
