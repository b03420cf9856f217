"""Measuring the rollouts `mmkv.report.runs` read: frames, latents and audio against their reference, with a
metrics.json cache beside each rollout."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmkv.io import atomic_write_text
from mmkv.metrics.video import LPIPSWeightsNotFound


from mmkv.report.runs import (
    ROLLOUT_FILE, METRICS_FILE, METRICS_VERSION, FILES, TENSOR_KEYS, Rollout, RunSet, from_jsonable, pair_rollouts, to_jsonable,
)


# ----------------------------------------------------------------------------------------------------------------
# Measuring, with a metrics.json cache beside each rollout


def _load_tensor(path: Path, key: str):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if key not in keys:
            raise ValueError(f"{path}: no tensor {key!r} (has {keys})")
        return f.get_tensor(key)


def _load_frames(path: Path) -> np.ndarray:
    frames = np.load(path, allow_pickle=False)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"{path}: expected uint8 frames [F, H, W, 3], got {frames.dtype} {frames.shape}")
    return frames


def _load_wav(path: Path, sample_rate: Any) -> tuple[np.ndarray, int]:
    import soundfile as sf

    data, sr = sf.read(str(path), dtype="float64", always_2d=False)
    if isinstance(sample_rate, (int, float)) and int(sample_rate) != sr:
        raise ValueError(f"{path}: sample rate {sr} Hz, but rollout.json says {int(sample_rate)} Hz")
    return data, sr


class LpipsChoice:
    """Which LPIPS trunk to use (`alexnet`, `random`, `off`) and where its weights are; loads lazily, once."""

    def __init__(self, mode: str = "alexnet", weights: str | os.PathLike | None = None, seed: int = 0,
                 device=None):
        if mode not in ("alexnet", "random", "off"):
            raise ValueError(f"unknown LPIPS mode {mode!r}; choose alexnet, random or off")
        self.mode, self.weights, self.seed, self.device = mode, weights, seed, device
        self._net = None

    def accepts(self, trunk_id: str | None) -> bool:
        """Whether cached LPIPS values computed with `trunk_id` are what this choice would compute."""
        if self.mode == "off":
            return True
        if trunk_id is None:
            return False
        if self.mode == "random":
            return trunk_id == f"random(seed={self.seed})"
        return trunk_id.startswith("alexnet sha256:")  # load_lpips checks the hash of every trunk it accepts

    def net(self):
        if self.mode == "off":
            return None
        if self._net is None:
            from mmkv.metrics import load_lpips

            self._net = load_lpips(self.weights, random_trunk=self.mode == "random", seed=self.seed,
                                   device=self.device)
        return self._net


class Measurer:
    """Computes (or reads from metrics.json) the metrics of (reference, test) pairs."""

    def __init__(self, lpips: LpipsChoice | None = None, device=None, use_cache: bool = True):
        self.lpips = lpips or LpipsChoice("off")
        self.device = device
        self.use_cache = use_cache
        self._ref_key: Path | None = None
        self._ref_data: dict | None = None

    def _inputs(self, ref: Rollout, test: Rollout) -> dict[str, list[int]]:
        sig = {}
        for r in (ref, test):
            paths = [r.dir / ROLLOUT_FILE] + [p for role in FILES[r.kind] if role != "video"
                                              and (p := r.file(role)) is not None]
            for p in paths:
                st = p.stat()
                sig[os.path.relpath(p, test.dir)] = [st.st_mtime_ns, st.st_size]
        return sig

    def _cached(self, ref: Rollout, test: Rollout, inputs: dict) -> dict | None:
        path = test.dir / METRICS_FILE
        if not self.use_cache or not path.is_file():
            return None
        try:
            m = from_jsonable(json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None
        if not isinstance(m, dict) or m.get("version") != METRICS_VERSION or m.get("inputs") != inputs:
            return None
        if m.get("kind") == "video" and not self.lpips.accepts(m.get("config", {}).get("lpips_trunk")):
            return None
        newest = max(v[0] for v in inputs.values())
        if path.stat().st_mtime_ns < newest:
            return None
        return m

    def _load(self, r: Rollout) -> dict:
        if r.kind == "video":
            out = {"frames": _load_frames(r.file("frames"))}
            if (p := r.file("latents")) is not None:
                out["latents"] = _load_tensor(p, TENSOR_KEYS["latents"])
        else:
            out = {}
            out["audio"], out["sample_rate"] = _load_wav(r.file("audio"), r.info.get("sample_rate"))
            for role in ("latent", "tokens"):
                if (p := r.file(role)) is not None:
                    out[role] = _load_tensor(p, TENSOR_KEYS[role])
        return out

    def _reference(self, ref: Rollout) -> dict:
        if self._ref_key != ref.dir:  # codec rollouts come grouped by item: keep the last reference in memory
            self._ref_data, self._ref_key = self._load(ref), ref.dir
        return self._ref_data

    def measure(self, ref: Rollout, test: Rollout) -> dict:
        """Metrics of `test` against `ref` (see mmkv.metrics), from cache when its inputs are unchanged."""
        if ref.kind != test.kind:
            raise ValueError(f"{test.where()} is {test.kind} but its reference is {ref.kind}")
        inputs = self._inputs(ref, test)
        cached = self._cached(ref, test, inputs)
        if cached is not None:
            return self._drop_lpips(cached)
        from mmkv import metrics

        a, b = self._reference(ref), self._load(test)
        if test.kind == "video":
            result = metrics.video_metrics(a["frames"], b["frames"], a.get("latents"), b.get("latents"),
                                           lpips_net=self.lpips.net(), device=self.device,
                                           fps=float(test.info.get("fps") or metrics.DEFAULT_FPS))
            result.pop("windows")  # windows are cut at report time from per-frame values (edges are a report option)
        else:
            if a["sample_rate"] != b["sample_rate"]:
                raise ValueError(f"{test.where()}: sample rate {b['sample_rate']} differs from the reference's "
                                 f"{a['sample_rate']}")
            result = metrics.audio_metrics(a["audio"], b["audio"], b["sample_rate"], a.get("latent"),
                                           b.get("latent"), a.get("tokens"), b.get("tokens"))
        record = {"version": METRICS_VERSION, "reference": os.path.relpath(ref.dir, test.dir), "inputs": inputs,
                  **result}
        if self.use_cache:
            try:
                atomic_write_text(test.dir / METRICS_FILE, json.dumps(to_jsonable(record), indent=1) + "\n")
            except OSError:
                pass  # a read-only run folder: measure again next time
        return self._drop_lpips(record)

    def _drop_lpips(self, m: dict) -> dict:
        if self.lpips.mode == "off" and m.get("kind") == "video":
            m = dict(m)
            m["per_frame"] = {k: v for k, v in m["per_frame"].items() if k != "lpips"}
            m["summary"] = {k: v for k, v in m["summary"].items() if k != "lpips"}
            m["config"] = {**m.get("config", {}), "lpips_trunk": None}
        return m


@dataclass
class Measured:
    """A codec rollout, its reference, and the metrics of the pair."""

    ref: Rollout
    test: Rollout
    metrics: dict


def measure_all(rs: RunSet, measurer: Measurer, progress=None) -> list[Measured]:
    """Metrics for every (reference, test) pair; a pair that fails becomes a problem line, the rest go on."""
    pairs = pair_rollouts(rs)
    out = []
    for ref, test in (progress(pairs) if progress else pairs):
        try:
            out.append(Measured(ref, test, measurer.measure(ref, test)))
        except LPIPSWeightsNotFound:
            raise  # a setup problem for every video rollout: stop and say where the weights go
        except (ValueError, OSError, RuntimeError) as err:
            rs.problems.append(f"{test.where()}: metrics failed: {err}")
    return out
