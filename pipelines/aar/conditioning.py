"""The condition of an audio rollout: CLAP audio embeddings of reference clips, precomputed embeddings, or a seeded
random condition for the tiny random models (`mmkv compare audio`, `mmkv inspect kv`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from mmkv.pipelines.common import RunError, atomic_save_safetensors, remove_stale_temps, sha256_file

CAPTION_SUFFIX = ".txt"  # <clip stem>.txt beside a clip holds its caption


# ----------------------------------------------------------------------------------------------------------------
# Conditioning: CLAP (lazy), or precomputed embeddings; cached per clip in RUN/conditions/


class Conditioner:
    def __init__(self, args: argparse.Namespace, device: torch.device):
        from mmkv.pipelines.aar import clap

        self.clap = clap
        self.args, self.device = args, device
        self.source = None
        self._embedder = None
        # `key` must match when a run folder is resumed; each rollout also records its embedding's SHA-256.
        if args.embeddings:
            self.source = clap.EmbeddingSource(args.embeddings)
            p = Path(args.embeddings)
            files = [p] if p.is_file() else [
                f for f in sorted(p.iterdir()) if f.is_file() and f.suffix.lower() in (".npy", ".safetensors")
            ]
            self.key = {"backend": "precomputed", "sha256": clap.sha256_files(files)}
            self.identity = {**self.key, "path": str(args.embeddings)}
        elif args.clap:
            p = Path(args.clap)
            if not p.exists():
                raise RunError(f"--clap {p} does not exist")
            files = [p] if p.is_file() else [
                f for f in sorted(p.iterdir())
                if f.is_file() and (f.suffix in (".bin", ".safetensors", ".pt") or f.name.endswith("config.json"))
            ]
            self.key = {"backend": args.clap_backend, "sha256": clap.sha256_files(files),
                        "preprocessing": clap.PREPROCESSING_VERSION}
            self.identity = {**self.key, "path": str(p)}
        else:
            raise RunError("give --clap DIR (a local laion/larger_clap_general) or --embeddings PATH")

    def _get_embedder(self):
        if self._embedder is None:
            if self.args.clap_backend == "laion":
                self._embedder = self.clap.LaionClapEmbedder(self.args.clap, self.device)
            else:
                self._embedder = self.clap.ClapEmbedder(self.args.clap, self.device)
        return self._embedder

    def get(self, item: str, path: Path | None, cache_dir: Path) -> tuple[torch.Tensor, dict[str, Any]]:
        clap = self.clap
        if self.source is not None:
            key = item if (path is None or item in self.source.keys()) else clap.sanitize(path.stem)
            emb, info = self.source.lookup(key)
            info["clip"] = None if path is None else str(path)
            return emb, info
        clip_sha = sha256_file(path) if path is not None and path.is_file() else None
        cached = cache_dir / f"{item}.safetensors"
        want = {"clip_sha256": clip_sha, "conditioner_sha256": self.key["sha256"],
                "preprocessing": clap.PREPROCESSING_VERSION}
        if cached.is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(cached), "pt") as f:
                    meta = f.metadata() or {}
                    if all(meta.get(k) == str(v) for k, v in want.items()):
                        return f.get_tensor("embedding"), json.loads(meta.get("info", "{}"))
            except Exception:
                pass  # unreadable cache: recompute
        emb, info = self._get_embedder().embed(path)
        info.update({"clip_sha256": clip_sha, "backend": self.identity["backend"]})
        remove_stale_temps(cached)  # left by a run killed mid-write; clips are sharded, so no other rank writes it
        atomic_save_safetensors(cached, {"embedding": emb},
                                metadata={**{k: str(v) for k, v in want.items()}, "info": json.dumps(info)})
        return emb, info


FULL_SCALE = 1.0  # float PCM full scale


def clip_warnings(path: Path | None, info: dict[str, Any]) -> list[str]:
    """What a user should hear about a clip that is used anyway: samples beyond full scale. Such a clip is not an
    error (float files hold any amplitude and CLAP's log-mel front end takes it), but CLAP saw audio within [-1, 1],
    so the embedding may be off; the clip is used as it is, neither clipped nor rescaled."""
    peak = info.get("peak")
    if peak is not None and peak > FULL_SCALE:
        return [f"clip {path} peaks at {peak:.4g} (mono mix), above full scale {FULL_SCALE:g}; CLAP was trained on "
                f"audio within [-1, 1], so its embedding may be off (the clip is used unscaled)"]
    return []


def clip_caption(path: Path | None) -> str | None:
    """The caption in the `<clip stem>.txt` beside a clip (surrounding whitespace dropped), or None where there is
    none. Raises ClipError when that file is not UTF-8 text."""
    from mmkv.pipelines.aar.clap import ClipError

    side = None if path is None else path.with_suffix(CAPTION_SUFFIX)
    if side is None or not side.is_file():
        return None
    try:
        return side.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError) as err:
        raise ClipError(f"caption {side} cannot be read as UTF-8 text ({err}); fix or remove it") from None
