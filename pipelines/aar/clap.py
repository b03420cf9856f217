"""Clips in, 512-d CLAP audio embeddings out: the condition AAR was trained on (AAR inference_AAR.py,
datasets/audioset.py).

* Decoding: soundfile (wav, flac, ogg/opus, mp3, aiff, ...); other containers (m4a, aac, mp4, webm, wma) through the
  ffmpeg binary shipped with imageio-ffmpeg. Channels are averaged to mono; NaN/Inf or empty files are errors that
  name the file.
* Resampling to CLAP's 48 kHz with soxr 'HQ' (librosa's default, what AAR's preprocessing used, AAR
  datasets/audioset.py), with scipy's polyphase filter as a fallback when soxr is missing (recorded in every record).
* The waveform is truncated to 480 000 samples (10 s) BEFORE the feature extractor, so its random crop
  (`rand_trunc`) never runs and embeddings are deterministic (mteb clap_models.py does the same); shorter clips are
  tiled by its `repeatpad`.
* transformers backend (the default, what AAR used): `ClapModel` from a local `laion/larger_clap_general` directory
  with `local_files_only=True`; the embedding is computed explicitly as L2-normalise(audio_projection(audio_model(
  ...).pooler_output)), which is v4's `get_audio_features` on every transformers version (v5 returns a model output
  instead), and its width is asserted (512).
* laion-clap backend (optional extra `mmkv[clap]`): imported lazily inside `LaionClapEmbedder`, never at module import
  (importing it contacts the Hugging Face hub). Its torchlibrosa front end is close to, not identical with, the
  embeddings AAR saw (LAION-AI/CLAP src/laion_clap/hook.py).
* Precomputed embeddings (`read_embeddings`): a folder of `<clip stem>.npy` / `.safetensors`, or one `.safetensors` /
  `.npz` file keyed by clip stem.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

CLAP_SAMPLE_RATE = 48_000
CLAP_MAX_SAMPLES = 480_000  # 10 s at 48 kHz (preprocessor_config.json nb_max_samples)
EMBED_DIM = 512
PREPROCESSING_VERSION = "mono-mean/soxr-HQ-or-polyphase/48k/trunc480000/v1"
SOUNDFILE_SUFFIXES = (".wav", ".wave", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aif", ".aiff", ".aifc", ".au",
                      ".snd", ".caf", ".w64", ".rf64")
FFMPEG_SUFFIXES = (".m4a", ".aac", ".mp4", ".webm", ".wma", ".mka", ".ac3", ".amr")
AUDIO_SUFFIXES = SOUNDFILE_SUFFIXES + FFMPEG_SUFFIXES
EMBEDDING_SUFFIXES = (".npy", ".safetensors", ".npz")


class ClipError(ValueError):
    """A clip (or its embedding) that cannot be used; the message names the file. Other clips go on."""


# ----------------------------------------------------------------------------------------------------------------
# Finding and naming clips


def discover_clips(paths: list[str | os.PathLike]) -> list[Path]:
    """Audio files under the given folders (recursive, case-insensitive suffixes) plus the files named, sorted per
    argument and de-duplicated. Raises ClipError when a path does not exist or nothing is found."""
    out: list[Path] = []
    seen: set[Path] = set()
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in AUDIO_SUFFIXES)
            if not found:
                raise ClipError(f"no audio files under {p} (looked recursively for {', '.join(AUDIO_SUFFIXES)})")
        elif p.is_file():
            found = [p]
        else:
            raise ClipError(f"clip path {p} does not exist")
        for f in found:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                out.append(f)
    if not out:
        raise ClipError("no clips given")
    return out


def sanitize(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "clip"
    return s[:120]


def item_names(paths: list[Path]) -> list[str]:
    """Folder-safe unique names: the sanitised stem, plus 8 hex digits of the path's hash where stems collide."""
    stems = [sanitize(p.stem) for p in paths]
    counts: dict[str, int] = {}
    for s in stems:
        counts[s] = counts.get(s, 0) + 1
    names = [s if counts[s] == 1 else f"{s}-{hashlib.sha256(str(p).encode()).hexdigest()[:8]}"
             for s, p in zip(stems, paths)]
    return names


# ----------------------------------------------------------------------------------------------------------------
# Decoding and resampling


def load_audio(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """(mono float32 waveform, sample rate) of any common audio file; ClipError naming the file on failure."""
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        raise ClipError(f"clip {path} does not exist")
    if path.stat().st_size == 0:
        raise ClipError(f"clip {path} is an empty file (0 bytes)")
    if path.suffix.lower() in FFMPEG_SUFFIXES:
        data, sr = _load_with_ffmpeg(path)
    else:
        check_wav_length(path)
        try:
            data, sr = sf.read(str(path), dtype="float32", always_2d=True)
        except Exception as err:  # libsndfile raises LibsndfileError/RuntimeError/TypeError depending on the damage
            raise ClipError(f"clip {path} cannot be decoded ({type(err).__name__}: {err}); is it a corrupt or "
                            f"unsupported audio file?") from None
    if data.shape[0] == 0:
        raise ClipError(f"clip {path} holds no samples")
    if not np.isfinite(data).all():
        raise ClipError(f"clip {path} has NaN/Inf samples")
    return data.mean(axis=1, dtype=np.float64).astype(np.float32), int(sr)


def check_wav_length(path: str | os.PathLike) -> None:
    """Refuse a RIFF/WAVE file whose `data` chunk declares more sample bytes than the file holds: a copy cut short.
    libsndfile reads what is there without a word, so a 2 s clip would silently condition as a few milliseconds.
    Other files, and WAVs written as streams (declared length 0 or 0xFFFFFFFF: unknown), are left to the decoder."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] not in (b"RIFF", b"RIFX") or head[8:12] != b"WAVE":
            return
        order = "<" if head[:4] == b"RIFF" else ">"
        pos, block_align = 12, 0
        while pos + 8 <= size:
            f.seek(pos)
            chunk, length = struct.unpack(order + "4sI", f.read(8))
            if chunk == b"fmt " and length >= 14:
                block_align = struct.unpack(order + "H", f.read(14)[12:14])[0]
            elif chunk == b"data":
                present = size - pos - 8
                if length in (0, 0xFFFFFFFF) or length <= present:
                    return
                unit = f"{length // block_align} frames" if block_align else f"{length} bytes"
                have = f"{present // block_align} frames" if block_align else f"{present} bytes"
                raise ClipError(f"clip {path} is truncated: its WAV header declares {unit} of audio but the file "
                                f"holds only {have} ({size} bytes in all); copy or export it again")
            pos += 8 + length + (length & 1)  # chunks are padded to an even length


def _load_with_ffmpeg(path: Path) -> tuple[np.ndarray, int]:
    import soundfile as sf

    try:
        import imageio_ffmpeg
    except ImportError:
        raise ClipError(f"clip {path}: decoding {path.suffix} files needs imageio-ffmpeg (pip install imageio-ffmpeg)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decoded.wav"
        cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-v", "error", "-i", str(path), "-vn",
               "-c:a", "pcm_f32le", "-f", "wav", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            tail = proc.stderr.strip().splitlines()[-3:]
            raise ClipError(f"clip {path} cannot be decoded by ffmpeg: {' | '.join(tail) or 'no audio stream'}")
        data, sr = sf.read(str(out), dtype="float32", always_2d=True)
    return data, int(sr)


def resampler_name() -> str:
    try:
        import soxr  # noqa: F401

        return "soxr-HQ"
    except ImportError:
        return "scipy-resample_poly"


def resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """float32 mono resampling: soxr 'HQ' (librosa's default), else scipy's polyphase filter."""
    if sr_in == sr_out:
        return np.asarray(x, dtype=np.float32)
    try:
        import soxr

        return soxr.resample(np.asarray(x, dtype=np.float32), sr_in, sr_out, quality="HQ").astype(np.float32)
    except ImportError:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(sr_in, sr_out)
        return resample_poly(np.asarray(x, dtype=np.float64), sr_out // g, sr_in // g).astype(np.float32)


@dataclass
class ClapInput:
    """The 48 kHz mono waveform handed to CLAP, and facts about the clip worth recording."""

    wave: np.ndarray
    info: dict[str, Any]


def prepare_clip(path: str | os.PathLike, max_samples: int = CLAP_MAX_SAMPLES) -> ClapInput:
    wave, sr = load_audio(path)
    x = resample(wave, sr, CLAP_SAMPLE_RATE)
    if x.size == 0:
        raise ClipError(f"clip {path} is too short to resample ({wave.size} samples at {sr} Hz)")
    info = {
        "path": str(path),
        "sample_rate": sr,
        "num_samples": int(wave.size),
        "duration_s": wave.size / sr,
        "resampler": resampler_name() if sr != CLAP_SAMPLE_RATE else None,
        "truncated": bool(x.size > max_samples),
        # Shorter than the CLAP window: the feature extractor tiles it ("repeatpad"), as in AAR's training.
        "shorter_than_clap_window": bool(x.size < max_samples),
        # All-zero clips still embed (CLAP's log-mel has a floor), but the condition carries no information.
        "silent": bool(not np.any(wave)),
        "peak": float(np.abs(wave).max()),
    }
    return ClapInput(wave=x[:max_samples], info=info)


# ----------------------------------------------------------------------------------------------------------------
# Embedders


def _check_embedding(emb: torch.Tensor, where: str, dim: int = EMBED_DIM) -> torch.Tensor:
    emb = emb.reshape(-1) if emb.dim() > 1 and emb.shape[0] == 1 else emb
    if emb.dim() != 1 or emb.shape[0] != dim:
        raise ClipError(f"{where}: expected a {dim}-d CLAP embedding, got shape {tuple(emb.shape)}")
    if not torch.isfinite(emb).all():
        raise ClipError(f"{where}: the CLAP embedding has NaN/Inf values")
    return emb.float()


def sha256_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


class ClapEmbedder:
    """transformers `ClapModel` from a local directory, offline (the conditioner AAR was trained with)."""

    backend = "transformers"

    def __init__(self, directory: str | os.PathLike, device: torch.device | str = "cpu", dim: int = EMBED_DIM):
        from transformers import ClapFeatureExtractor, ClapModel

        d = Path(directory)
        if not d.is_dir() or not (d / "config.json").is_file():
            raise ClipError(f"CLAP directory {d} must hold a transformers ClapModel (config.json + weights), e.g. a "
                            f"local copy of laion/larger_clap_general")
        self.directory, self.device, self.dim = d, torch.device(device), dim
        # fp32 whatever the folder stores (a bf16 release included), as the AAR / SAT loaders do
        self.model = ClapModel.from_pretrained(str(d), local_files_only=True, dtype=torch.float32)
        self.model = self.model.to(self.device).eval()
        self.features = ClapFeatureExtractor.from_pretrained(str(d), local_files_only=True)
        if self.features.sampling_rate != CLAP_SAMPLE_RATE:
            raise ClipError(f"CLAP directory {d}: feature extractor expects {self.features.sampling_rate} Hz; AAR's "
                            f"CLAP runs at {CLAP_SAMPLE_RATE} Hz")
        if getattr(self.model.config.audio_config, "enable_fusion", False):
            # Fusion picks random crops with numpy's global RNG; AAR's larger_clap_general is unfused.
            raise ClipError(f"CLAP directory {d}: fusion CLAP models are not supported (AAR used the unfused "
                            f"laion/larger_clap_general)")
        if self.model.config.projection_dim != dim:
            raise ClipError(f"CLAP directory {d}: projection_dim {self.model.config.projection_dim}, AAR needs {dim}")
        self.max_samples = min(CLAP_MAX_SAMPLES, int(self.features.nb_max_samples))
        weights = [p for p in d.iterdir() if p.is_file() and (p.suffix in (".bin", ".safetensors")
                                                                or p.name.endswith(".json"))]
        self.identity = {"backend": self.backend, "directory": str(d), "sha256": sha256_files(weights),
                         "preprocessing": PREPROCESSING_VERSION, "max_samples": self.max_samples}

    @torch.no_grad()
    def embed_wave(self, wave48k: np.ndarray, where: str = "clip") -> torch.Tensor:
        if wave48k.size > self.max_samples:
            raise ClipError(f"{where}: {wave48k.size} samples, more than the CLAP window of {self.max_samples}")
        # larger_clap_general's preprocessing, named explicitly: never the random "fusion" crops; rand_trunc is a
        # no-op because the input is at most max_samples long.
        feats = self.features(wave48k.astype(np.float32), sampling_rate=CLAP_SAMPLE_RATE, return_tensors="pt",
                              truncation="rand_trunc", padding="repeatpad")
        out = self.model.audio_model(input_features=feats["input_features"].to(self.device),
                                     is_longer=feats["is_longer"].to(self.device))
        emb = F.normalize(self.model.audio_projection(out.pooler_output), dim=-1)[0]
        return _check_embedding(emb.cpu(), where, self.dim)

    def embed(self, path: str | os.PathLike) -> tuple[torch.Tensor, dict[str, Any]]:
        clip = prepare_clip(path, self.max_samples)
        return self.embed_wave(clip.wave, str(path)), clip.info


class LaionClapEmbedder:
    """laion-clap `CLAP_Module` (HTSAT-base) from a local checkpoint; optional, needs `pip install 'mmkv[clap]'`.

    Not bit-identical to the transformers embeddings AAR was trained on (torchlibrosa front end, int16 round trip
    skipped via use_tensor=True); its constructor also loads `roberta-base`, which must be in the local HF cache.
    """

    backend = "laion-clap"

    def __init__(self, checkpoint: str | os.PathLike, device: torch.device | str = "cpu", dim: int = EMBED_DIM,
                 amodel: str = "HTSAT-base"):
        ckpt = Path(checkpoint)
        if not ckpt.is_file():
            raise ClipError(f"laion-clap checkpoint {ckpt} does not exist (e.g. music_speech_audioset_epoch_15_esc_89.98.pt)")
        try:
            import laion_clap  # lazy: importing it reaches out to the HF hub
        except ImportError:
            raise ClipError("the laion-clap backend needs the optional extra: pip install 'mmkv[clap]'") from None
        self.device, self.dim = torch.device(device), dim
        self.model = laion_clap.CLAP_Module(enable_fusion=False, amodel=amodel, device=str(self.device))
        self.model.load_ckpt(str(ckpt))
        self.max_samples = CLAP_MAX_SAMPLES
        self.identity = {"backend": self.backend, "checkpoint": str(ckpt), "sha256": sha256_files([ckpt]),
                         "amodel": amodel, "preprocessing": PREPROCESSING_VERSION}

    @torch.no_grad()
    def embed_wave(self, wave48k: np.ndarray, where: str = "clip") -> torch.Tensor:
        x = torch.from_numpy(wave48k.astype(np.float32))[None].to(self.device)
        emb = self.model.get_audio_embedding_from_data(x, use_tensor=True)
        return _check_embedding(F.normalize(emb.float(), dim=-1)[0].cpu(), where, self.dim)

    def embed(self, path: str | os.PathLike) -> tuple[torch.Tensor, dict[str, Any]]:
        clip = prepare_clip(path, self.max_samples)
        return self.embed_wave(clip.wave, str(path)), clip.info


# ----------------------------------------------------------------------------------------------------------------
# Precomputed embeddings


class EmbeddingSource:
    """Precomputed CLAP embeddings keyed by clip stem: a folder of `<stem>.npy|.safetensors` or one keyed file."""

    backend = "precomputed"

    def __init__(self, path: str | os.PathLike, dim: int = EMBED_DIM):
        self.path, self.dim = Path(path), dim
        self._files: dict[str, Path] = {}
        self._table: dict[str, np.ndarray] | None = None
        if self.path.is_dir():
            for f in sorted(self.path.iterdir()):
                if f.is_file() and f.suffix.lower() in (".npy", ".safetensors"):
                    self._files.setdefault(sanitize(f.stem), f)
            if not self._files:
                raise ClipError(f"embedding folder {self.path} holds no <clip stem>.npy or .safetensors files")
        elif self.path.is_file():
            self._table = self._read_table(self.path)
        else:
            raise ClipError(f"embeddings path {self.path} does not exist")
        self.identity = {"backend": self.backend, "path": str(self.path)}

    def _read_table(self, path: Path) -> dict[str, np.ndarray]:
        try:
            if path.suffix == ".safetensors":
                from safetensors.numpy import load_file

                table = load_file(str(path))
            elif path.suffix == ".npz":
                with np.load(path, allow_pickle=False) as z:
                    table = {k: z[k] for k in z.files}
            else:
                raise ClipError(f"embeddings file {path}: expected .safetensors or .npz keyed by clip stem "
                                f"(or a folder of <stem>.npy files)")
        except ClipError:
            raise
        except Exception as err:
            raise ClipError(f"embeddings file {path} cannot be read ({type(err).__name__}: {err})") from None
        if not table:
            raise ClipError(f"embeddings file {path} holds no embeddings")
        return {sanitize(k): v for k, v in table.items()}

    def keys(self) -> list[str]:
        return sorted(self._files) if self._table is None else sorted(self._table)

    def lookup(self, item: str) -> tuple[torch.Tensor, dict[str, Any]]:
        if self._table is not None:
            if item not in self._table:
                raise ClipError(f"embeddings file {self.path} has no entry {item!r} (keys: {self.keys()[:8]} ...)")
            arr, where = self._table[item], f"embeddings file {self.path}, key {item!r}"
        else:
            f = self._files.get(item)
            if f is None:
                raise ClipError(f"embedding folder {self.path} has no {item}.npy or {item}.safetensors")
            where = f"embedding file {f}"
            try:
                if f.suffix == ".npy":
                    arr = np.load(f, allow_pickle=False)
                else:
                    from safetensors.numpy import load_file

                    tensors = load_file(str(f))
                    if len(tensors) != 1 and "embedding" not in tensors:
                        raise ClipError(f"{where}: expected one tensor or a key 'embedding', found {sorted(tensors)}")
                    arr = tensors.get("embedding", next(iter(tensors.values())))
            except ClipError:
                raise
            except Exception as err:
                raise ClipError(f"{where} cannot be read ({type(err).__name__}: {err})") from None
        if not np.issubdtype(np.asarray(arr).dtype, np.floating):
            raise ClipError(f"{where}: expected float values, got dtype {np.asarray(arr).dtype}")
        emb = _check_embedding(torch.from_numpy(np.array(arr, dtype=np.float32)), where, self.dim)
        return emb, {"embedding_source": where, "norm": float(emb.norm())}


def embedding_sha256(emb: torch.Tensor) -> str:
    return hashlib.sha256(emb.detach().cpu().float().contiguous().numpy().tobytes()).hexdigest()
