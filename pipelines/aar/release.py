"""`mmkv ship audio`: the release folder of trained audio models, the layout `mmkv.assets.trained_audio_assets` checks.

    mmkv ship audio --aar AAR_tiny.pth --sat SAT_tiny.pth --clap CLAP_DIR --out DEST

writes

    DEST/AAR_<name>.pth   {"model_state_dict": ...}       floating tensors bf16, integer buffers (lvl_1L) kept
    DEST/SAT_<name>.pth   {"generator_state_dict": ...}   floating tensors bf16
    DEST/clap/            the transformers CLAP, weights bf16 (`mmkv.io.save_pretrained`), its feature extractor and
                          tokenizer files as they were
    DEST/SHA256SUMS       `mmkv.assets.record_sums`

The checkpoints leave out `loaders.release_drops`, state inference never reads (the AAR's training mask, the SAT
codebooks' EMA k-means sums, the SAT's encoder: rollouts only decode), which the loaders rebuild or stub; they load
the bf16 tensors into the fp32 models. The inputs are read as `mmkv compare audio` reads them
(`torch.load(weights_only=True)`, no code unpickled) and loaded once into the models, so a checkpoint that would
not load is refused before anything is written. Everything is written into a
hidden folder beside DEST, renamed onto DEST at the end: a killed run leaves no half release. DEST must not exist or
be empty.
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

import torch

from mmkv.io import atomic_write_bytes, save_pretrained
from mmkv.pipelines.aar.loaders import (
    AAR_CONTAINER_KEY, SAT_CONTAINER_KEY, CheckpointError, load_aar, load_sat, read_state_dict, release_drops,
)

CLAP_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "config.json")  # rewritten by save_pretrained


def release_state(sd: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """A state dict as shipped: `release_drops` left out, floating tensors in bf16, integer ones kept."""
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
            for k, v in sd.items() if not release_drops(k, what)}


def _release_name(path: Path, what: str) -> str:
    """`AAR_tiny.pth` keeps its name; any other file becomes AAR_<stem>.pth, the pattern the loaders look for."""
    return f"{path.stem}.pth" if path.name.upper().startswith(what) else f"{what}_{path.stem}.pth"


def _save_checkpoint(sd: dict[str, torch.Tensor], key: str, path: Path) -> None:
    # Through a buffer: torch.save names the zip's records after the file, here a random temp name, so the bytes
    # (and the release's sums) would differ from run to run.
    buffer = io.BytesIO()
    torch.save({key: sd}, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _ship_clap(src: Path, dest: Path) -> None:
    from transformers import ClapModel

    if not (src / "config.json").is_file():
        raise CheckpointError(f"--clap {src} must be a transformers CLAP folder (config.json + model.safetensors)")
    model = ClapModel.from_pretrained(str(src), local_files_only=True, dtype=torch.float32)
    save_pretrained(model.to(torch.bfloat16).eval(), dest)
    for p in sorted(src.iterdir()):  # the feature extractor and tokenizer, byte for byte
        if p.is_file() and p.name not in CLAP_WEIGHTS and not p.name.startswith("."):
            atomic_write_bytes(dest / p.name, p.read_bytes())


def ship_audio(aar: str | os.PathLike, sat: str | os.PathLike, clap: str | os.PathLike,
               dest: str | os.PathLike) -> Path:
    """Write the bf16 release of an AAR checkpoint, its SAT and CLAP folder to `dest` (see the module docstring);
    returns `dest`. Raises CheckpointError for inputs that do not load or do not belong together, RunError for a
    non-empty `dest`."""
    from mmkv.assets import check_release_dest, release_folder
    from mmkv.pipelines.aar.loaders import check_pair

    aar, sat, clap, dest = Path(aar), Path(sat), Path(clap), Path(dest)
    check_release_dest(dest)
    for path, what in ((aar, "--aar"), (sat, "--sat")):
        if not path.is_file():
            raise CheckpointError(f"{what} {path} is not a checkpoint file (expected AAR_*.pth / SAT_*.pth)")
    aar_model = load_aar(aar)  # refuses what the release could not load, before anything is written
    check_pair(aar_model, load_sat(sat, multi_scale=aar_model.patch_nums), aar, sat)
    with release_folder(dest) as stage:
        _save_checkpoint(release_state(read_state_dict(aar, AAR_CONTAINER_KEY), "AAR"), AAR_CONTAINER_KEY,
                         stage / _release_name(aar, "AAR"))
        _save_checkpoint(release_state(read_state_dict(sat, SAT_CONTAINER_KEY), "SAT"), SAT_CONTAINER_KEY,
                         stage / _release_name(sat, "SAT"))
        _ship_clap(clap, stage / "clap")
    return dest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--aar", required=True, metavar="PTH", help="trained AAR checkpoint (model_state_dict)")
    parser.add_argument("--sat", required=True, metavar="PTH", help="its SAT checkpoint (generator_state_dict)")
    parser.add_argument("--clap", required=True, metavar="DIR", help="its transformers CLAP folder")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="release folder to create (new or empty), e.g. for mmkv/assets/audio/")


def run(args: argparse.Namespace) -> int:
    dest = ship_audio(args.aar, args.sat, args.clap, args.out)
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    for p in files:
        print(f"  {p.stat().st_size:>10,d}  {p.relative_to(dest)}")
    print(f"wrote {dest}/: {len(files)} files, {total / 1e6:.2f} MB")
    return 0
