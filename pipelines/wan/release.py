"""The release layout `mmkv train video` writes and `mmkv generate video` reads: a diffusers Wan base folder and a
CausVid-style `model.pt`; and `mmkv ship video`, which copies one into an asset folder with its SHA-256 sums."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmkv.io import save_pretrained
from mmkv.pipelines.training import frozen_copy

if TYPE_CHECKING:
    from mmkv.pipelines.wan.train import VideoTrainConfig

# ----------------------------------------------------------------------------------------------------------------
# Release layout


def write_release(out: Path, cfg: VideoTrainConfig, *, vae, encoder, tokenizer, dit,
                  base_from: Path | None = None) -> None:
    """`out/base` (diffusers Wan folder) and `out/causvid/model.pt` (bf16 CausVid generator), as the loaders read.

    The VAE and text encoder are stored in bf16 (the DiT's dtype in CausVid's release; loaders cast to the run's
    dtype), keeping the whole model under the package-data budget."""
    from mmkv.pipelines.wan.tiny import original_state_dict

    base = out / "base"
    if base_from is not None and base_from.resolve() != base.resolve():
        if base.exists():
            shutil.rmtree(base)
        shutil.copytree(base_from, base)
    else:
        base.mkdir(parents=True, exist_ok=True)
        save_pretrained(_to_cpu_bf16(vae), base / "vae")
        save_pretrained(_to_cpu_bf16(encoder), base / "text_encoder")
        save_pretrained(tokenizer, base / "tokenizer")
        (base / "transformer").mkdir(exist_ok=True)
        dit_cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.dit.items()}
        (base / "transformer" / "config.json").write_text(json.dumps(
            {"_class_name": "WanTransformer3DModel", **dit_cfg, "text_len": cfg.text_len}, indent=2) + "\n")
        (base / "model_index.json").write_text(json.dumps({
            "_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"], "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        }, indent=2) + "\n")
    sd = original_state_dict(dit.transformer)
    (out / "causvid").mkdir(parents=True, exist_ok=True)
    torch.save({"generator": {"model." + k: v.to("cpu", torch.bfloat16).contiguous() for k, v in sorted(sd.items())}},
               out / "causvid" / "model.pt")


def _to_cpu_bf16(module: torch.nn.Module) -> torch.nn.Module:
    return frozen_copy(module).to("cpu", torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# `mmkv ship video`: a trained release into the package's asset folder


def ship_video(source: str | Path, dest: str | Path) -> Path:
    """Copy the release of a `dit` or `distill` stage output (`base/`, `causvid/model.pt`, and its `train.json`, the
    record of how it was trained, which also lets `mmkv train ... --init` continue from the shipped folder) to
    `dest` with its `SHA256SUMS` (`mmkv.assets.record_sums`), the layout `mmkv.assets.trained_video_assets` checks.
    The release is loaded through the loaders first, so one that would not load is refused before anything is
    written; everything is written into a hidden folder beside `dest` and renamed onto it at the end. `dest` must
    not exist or be empty."""
    from mmkv.assets import check_release_dest, release_folder
    from mmkv.pipelines.files import RunError
    from mmkv.pipelines.wan.loaders import load_wan

    source, dest = Path(source), Path(dest)
    record = source / "train.json"
    stage = json.loads(record.read_text()).get("stage") if record.is_file() else None
    if stage not in ("dit", "distill"):
        raise RunError(f"--from {source} is not the output of a `mmkv train video` dit or distill stage (its "
                       f"train.json names {stage!r}); give the folder holding base/, causvid/ and train.json")
    check_release_dest(dest)
    load_wan(source / "causvid", source / "base", device="cpu", dtype=torch.float32)  # refuses what cannot load
    with release_folder(dest) as staging:
        shutil.copytree(source / "base", staging / "base")
        shutil.copytree(source / "causvid", staging / "causvid")
        shutil.copy2(record, staging / "train.json")
    return dest


def add_arguments(parser) -> None:
    parser.add_argument("--from", dest="source", required=True, metavar="DIR",
                        help="a `mmkv train video` distill (or dit) output folder")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="release folder to create (new or empty), e.g. mmkv/assets/video/")


def run(args) -> int:
    dest = ship_video(args.source, args.out)
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    for p in files:
        print(f"  {p.stat().st_size:>10,d}  {p.relative_to(dest)}")
    print(f"wrote {dest}/: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.2f} MB")
    return 0
