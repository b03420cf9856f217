"""The release layout `mmkv train video` writes and `mmkv generate video` reads: a diffusers Wan base folder and a
CausVid-style `model.pt`; and `mmkv ship video`, which copies one into an asset folder with its SHA-256 sums."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from mmkv.io import save_pretrained
from mmkv.pipelines.training import frozen_copy

if TYPE_CHECKING:
    from mmkv.pipelines.wan.train import VideoTrainConfig

# Package data for the shipped video set (the VAE, text encoder, tokenizer and DiT in `mmkv/assets/video/`).
VIDEO_PACKAGE_BYTES = 20_000_000

# ----------------------------------------------------------------------------------------------------------------
# Release layout


def write_release(out: Path, cfg: VideoTrainConfig, *, vae, encoder, tokenizer, dit,
                  base_from: Path | None = None) -> int:
    """`out/base` (diffusers Wan folder) and `out/causvid/model.pt` (bf16 CausVid generator), as the loaders read.

    The VAE and text encoder are stored in bf16 (the DiT's dtype in CausVid's release; loaders cast to the run's
    dtype), keeping the whole model under the package-data budget. Returns the release's bytes."""
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
        dit_cfg["num_layers"] = dit.num_layers  # the model's own (`dit_layers`, or an init's)
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
    return release_nbytes(out)


def has_release(folder: Path | None) -> bool:
    """Whether `folder` holds a whole release (`base/` with its VAE and `causvid/model.pt`)."""
    return folder is not None and (folder / "causvid" / "model.pt").is_file() and \
        (folder / "base" / "vae" / "config.json").is_file()


def write_decoder_release(out: Path, vae_dir: Path, init: Path, record: dict) -> int:
    """The release of a decoder-only `vae` stage whose init is a release (a `dit` or `distill` output, or a shipped
    set), into `out`: the init's `base/` and `causvid/model.pt` with `base/vae` replaced by the VAE in `vae_dir` in
    bf16. The encoder and its latent statistics are the init's, so the DiT, trained on those latents, goes with the
    new decoder unchanged. Its `train.json` is the init's (the DiT's record, so that the release is an init and a
    ship source like any distill output) with this stage's `record` appended to `vae_decoder_runs`. Written into a
    hidden folder and renamed onto `out` at the end. Returns the release's bytes."""
    from diffusers import AutoencoderKLWan

    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(init / "base", staging / "base", ignore=shutil.ignore_patterns("vae"))
    shutil.copytree(init / "causvid", staging / "causvid")
    vae = AutoencoderKLWan.from_pretrained(vae_dir, torch_dtype=torch.float32, local_files_only=True)
    save_pretrained(_to_cpu_bf16(vae), staging / "base" / "vae")
    base_record = json.loads((init / "train.json").read_text())
    base_record["vae_decoder_runs"] = [*base_record.get("vae_decoder_runs", []), record]
    (staging / "train.json").write_text(json.dumps(base_record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return release_nbytes(out)


def release_nbytes(root: Path) -> int:
    """Bytes of a release's model files: everything under `root/base` and `root/causvid`."""
    return sum(p.stat().st_size for d in (root / "base", root / "causvid") for p in d.rglob("*") if p.is_file())


def note_release_size(nbytes: int, log: Callable[[str], None]) -> None:
    """Say so in the stage's log when a release is over the video set's package-data budget, which `mmkv ship
    video` enforces: it can be scored and used from its folder, not shipped in the package."""
    if nbytes > VIDEO_PACKAGE_BYTES:
        log(f"note: this release is {nbytes / 1e6:.2f} MB, over the {VIDEO_PACKAGE_BYTES / 1e6:g} MB package-data "
            "budget of the shipped video set: `mmkv ship video` will refuse it (fewer `dit_layers` fit)")


def _to_cpu_bf16(module: torch.nn.Module) -> torch.nn.Module:
    return frozen_copy(module).to("cpu", torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# `mmkv ship video`: a trained release into the package's asset folder


def check_eval_record(path: Path, source: Path) -> dict:
    """The `mmkv eval video` record at `path`, refused unless it scored this release: its DiT file's SHA-256 is the
    one of `source/causvid/model.pt` and its VAE's is one of `source/base/`'s files."""
    from mmkv.pipelines.common import read_json, sha256_file
    from mmkv.pipelines.files import RunError

    record = read_json(path)
    if not isinstance(record, dict) or not record.get("runs") or not isinstance(record.get("ckpt"), dict):
        raise RunError(f"--eval {path} is not the JSON `mmkv eval video --out` writes (no runs or ckpt)")
    dit = sha256_file(source / "causvid" / "model.pt")
    base = {sha256_file(p) for p in (source / "base").rglob("*") if p.is_file()}
    vae = [f.get("sha256") for f in (record.get("vae") or {}).get("files", [])]
    if record["ckpt"].get("sha256") != dit or not vae or not set(vae) <= base:
        raise RunError(f"--eval {path} scored other weights (DiT SHA-256 {record['ckpt'].get('sha256')}, VAE "
                       f"{', '.join(map(str, vae)) or 'not recorded'}) than --from {source}; give the eval of this "
                       "release (`mmkv eval video --ckpt FROM/causvid --base FROM/base`)")
    return record


def ship_video(source: str | Path, dest: str | Path, eval_path: str | Path | None = None, *,
               max_bytes: int | None = VIDEO_PACKAGE_BYTES) -> Path:
    """Copy the release of a `dit` or `distill` stage output (`base/`, `causvid/model.pt`, and its `train.json`, the
    record of how it was trained, which also lets `mmkv train ... --init` continue from the shipped folder) to
    `dest` with its `SHA256SUMS` (`mmkv.assets.record_sums`), the layout `mmkv.assets.trained_video_assets` checks.
    The release is loaded through the loaders first, so one that would not load is refused before anything is
    written; everything is written into a hidden folder beside `dest` and renamed onto it at the end. `dest` must
    not exist or be empty. `eval_path`, the release's own held-out scores (`mmkv eval video`, checked by
    `check_eval_record`), ships as `eval.json`: the demo reads them to decide whether to use the set by default
    (`mmkv.assets.demo_ready`). A release over `max_bytes` in all (the package-data budget; None: no limit) is
    refused before anything is written: the tiny config's DiT is about 2.1 MB a layer in bf16, so with its VAE
    and text encoder at most 6 layers fit in 20 MB."""
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
    if max_bytes is not None:
        size = release_nbytes(source) + record.stat().st_size
        size += Path(eval_path).stat().st_size if eval_path is not None and Path(eval_path).is_file() else 0
        if size > max_bytes:
            raise RunError(f"--from {source}: the release would be {size / 1e6:.2f} MB, over the "
                           f"{max_bytes / 1e6:g} MB package-data budget (--max-mb); ship a smaller model, or give "
                           "--max-mb 0 for a folder outside the package")
    load_wan(source / "causvid", source / "base", device="cpu", dtype=torch.float32)  # refuses what cannot load
    if eval_path is not None:
        check_eval_record(Path(eval_path), source)
    with release_folder(dest) as staging:
        shutil.copytree(source / "base", staging / "base")
        shutil.copytree(source / "causvid", staging / "causvid")
        shutil.copy2(record, staging / "train.json")
        if eval_path is not None:
            shutil.copy2(eval_path, staging / "eval.json")
    return dest


def add_arguments(parser) -> None:
    parser.add_argument("--from", dest="source", required=True, metavar="DIR",
                        help="a `mmkv train video` distill (or dit) output folder")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="release folder to create (new or empty), e.g. mmkv/assets/video/")
    parser.add_argument("--eval", default=None, metavar="FILE",
                        help="this release's held-out scores (`mmkv eval video --out FILE`), shipped as eval.json; "
                             "the demo uses the set by default only when they clear its bar")
    parser.add_argument("--max-mb", type=float, default=VIDEO_PACKAGE_BYTES / 1e6, metavar="MB",
                        help="refuse a release larger than this in all (default: the package-data budget, "
                             f"{VIDEO_PACKAGE_BYTES / 1e6:g} MB); 0: no limit")


def run(args) -> int:
    from mmkv.pipelines.files import RunError

    if args.max_mb < 0:
        raise RunError(f"--max-mb {args.max_mb:g}: expected a size in MB > 0, or 0 for no limit")
    dest = ship_video(args.source, args.out, args.eval, max_bytes=int(args.max_mb * 1e6) if args.max_mb else None)
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    for p in files:
        print(f"  {p.stat().st_size:>10,d}  {p.relative_to(dest)}")
    print(f"wrote {dest}/: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.2f} MB")
    return 0
