"""The trained models shipped in `mmkv/assets/` (none in some versions: then these skip): every file matches its
recorded SHA-256, the set loads through the release-format loaders, its `train.json` says how it was made, and
docs/training.md names exactly this set (the SHA-256 of its SHA256SUMS), so the scores written there are its own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mmkv.assets import trained_audio_assets, trained_video_assets
from mmkv.pipelines.wan.release import VIDEO_PACKAGE_BYTES as VIDEO_BUDGET  # bytes of package data, `ship` enforces

DOCS = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def _named_in_docs(root: Path) -> None:
    digest = hashlib.sha256((root / "SHA256SUMS").read_bytes()).hexdigest()
    assert digest in DOCS.read_text(encoding="utf-8"), (
        f"docs/training.md does not name the shipped set {root} (SHA-256 of its SHA256SUMS: {digest})")


def test_the_shipped_video_model_is_whole_loads_and_is_documented():
    found = trained_video_assets()  # raises on a missing, unrecorded or changed file
    if found is None:
        pytest.skip("no trained video model is shipped in this version")
    from mmkv.pipelines.wan.loaders import load_wan

    comps = load_wan(found["causvid"], found["base"], device="cpu")
    assert comps.dit.head_dim == 128  # Wan 1.3B's head width: the codecs' 128-d codebooks apply
    record = json.loads((found["root"] / "train.json").read_text())
    assert record["stage"] in ("dit", "distill") and record["config"]["name"] == "tiny"
    size = sum(p.stat().st_size for p in found["root"].rglob("*") if p.is_file())
    assert size <= VIDEO_BUDGET, f"the shipped video set is {size:,} bytes, over the {VIDEO_BUDGET:,}-byte budget"
    _named_in_docs(found["root"])


def test_the_shipped_audio_models_are_whole_load_and_are_documented():
    found = trained_audio_assets()
    if found is None:
        pytest.skip("no trained audio models are shipped in this version")
    from mmkv.pipelines.aar.clap import ClapEmbedder
    from mmkv.pipelines.aar.loaders import load_models

    aar, sat, _ = load_models(found["aar"])
    assert aar.config.head_dim == 64 and sat.codebook_size == 1024
    ClapEmbedder(found["clap"])
    _named_in_docs(found["root"])
