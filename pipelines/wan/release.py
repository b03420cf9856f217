"""The release layout `mmkv train video` writes and `mmkv generate video` reads: a diffusers Wan base folder and a
CausVid-style `model.pt`."""

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
