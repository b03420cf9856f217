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

With `--training-state` the SAT's left-out state (its encoder and codebook statistics, bf16) goes to
`DEST/training/SAT_<name>.pth` and the `train.json` beside `--aar` is copied too, so that DEST is also what `mmkv
train audio --init` (and `mmkv train all --audio-init`) continue from: that state is what a later SAT stage, and the
tokenising of a later AAR stage, need, and the loaders read it back from `training/` (`loaders.TRAINING_DIR`). The
installed package leaves `training/` out (pyproject.toml): the package data stays the inference release (18 MB for
the `tiny` models; 23 MB with the training state), a checkout keeps all of it. The AAR's left-out training mask is
rebuilt from its levels by the loader, so it is not kept. A session's checkout keeps only what git holds
(docs/decisions.md), and the fp32 `aar` folder is 45 MB.
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

import torch

from mmkv.io import atomic_write_bytes, save_pretrained
from mmkv.pipelines.aar.loaders import (
    AAR_CONTAINER_KEY, SAT_CONTAINER_KEY, SAT_ENCODER, CheckpointError, load_aar, load_sat, read_with_training_state,
    release_drops, training_state_file,
)

CLAP_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "config.json")  # rewritten by save_pretrained


def release_state(sd: dict[str, torch.Tensor], what: str, keep_all: bool = False) -> dict[str, torch.Tensor]:
    """A state dict as shipped: `release_drops` left out (unless `keep_all`), floating tensors in bf16, integer ones
    kept."""
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
            for k, v in sd.items() if keep_all or not release_drops(k, what)}


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
               dest: str | os.PathLike, training_state: bool = False) -> Path:
    """Write the bf16 release of an AAR checkpoint, its SAT and CLAP folder to `dest` (see the module docstring;
    `training_state`: the SAT's left-out state under `training/` too, and the `train.json` beside the AAR
    checkpoint); returns `dest`. Raises CheckpointError for inputs that do not load or do not belong together,
    RunError for a non-empty `dest`. The inputs may be such a release with its training state (their `training/`
    files are read with them)."""
    from mmkv.assets import check_release_dest, release_folder
    from mmkv.pipelines.aar.loaders import check_pair

    aar, sat, clap, dest = Path(aar), Path(sat), Path(clap), Path(dest)
    check_release_dest(dest)
    for path, what in ((aar, "--aar"), (sat, "--sat")):
        if not path.is_file():
            raise CheckpointError(f"{what} {path} is not a checkpoint file (expected AAR_*.pth / SAT_*.pth)")
    record = aar.parent / "train.json"
    if training_state and not record.is_file():
        raise CheckpointError(f"--training-state copies the train.json beside --aar {aar} (the output folder of a "
                              "`mmkv train audio --stage aar`), and there is none")
    aar_model = load_aar(aar)  # refuses what the release could not load, before anything is written
    check_pair(aar_model, load_sat(sat, multi_scale=aar_model.patch_nums), aar, sat)
    states = {"AAR": read_with_training_state(aar, AAR_CONTAINER_KEY),
              "SAT": read_with_training_state(sat, SAT_CONTAINER_KEY)}
    if training_state and not any(k.startswith(SAT_ENCODER) for k in states["SAT"]):
        raise CheckpointError(f"--training-state needs the full SAT checkpoint, and --sat {sat} is a release "
                              "without its encoder")
    with release_folder(dest) as stage:
        for path, key, what in ((aar, AAR_CONTAINER_KEY, "AAR"), (sat, SAT_CONTAINER_KEY, "SAT")):
            _save_checkpoint(release_state(states[what], what), key, stage / _release_name(path, what))
        _ship_clap(clap, stage / "clap")
        if training_state:
            kept = {k: v for k, v in release_state(states["SAT"], "SAT", keep_all=True).items()
                    if release_drops(k, "SAT")}
            _save_checkpoint(kept, SAT_CONTAINER_KEY, training_state_file(stage / _release_name(sat, "SAT")))
            atomic_write_bytes(stage / "train.json", record.read_bytes())
    return dest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--aar", required=True, metavar="PTH", help="trained AAR checkpoint (model_state_dict)")
    parser.add_argument("--sat", required=True, metavar="PTH", help="its SAT checkpoint (generator_state_dict)")
    parser.add_argument("--clap", required=True, metavar="DIR", help="its transformers CLAP folder")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="release folder to create (new or empty), e.g. for mmkv/assets/audio/")
    parser.add_argument("--training-state", action="store_true",
                        help="keep what only training reads (the SAT's encoder and codebook statistics) and the "
                             "aar stage's train.json, so that the folder is also an --init for more training")


def run(args: argparse.Namespace) -> int:
    dest = ship_audio(args.aar, args.sat, args.clap, args.out, training_state=args.training_state)
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    for p in files:
        print(f"  {p.stat().st_size:>10,d}  {p.relative_to(dest)}")
    print(f"wrote {dest}/: {len(files)} files, {total / 1e6:.2f} MB")
    return 0
