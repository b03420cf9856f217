"""Run folders in, measured comparisons out.

A run folder (written by `mmkv generate video` / `mmkv compare audio`, possibly by several torchrun ranks)::

    RUN/manifest.rank{R}.json                 run config, versions, the rollouts rank R completed
    RUN/rollouts/<item>/<variant>/rollout.json   written last, atomically: the rollout is complete
    RUN/rollouts/<item>/<variant>/frames.npy, latents.safetensors, video.mp4        (video)
    RUN/rollouts/<item>/<variant>/audio.wav, latent.safetensors, tokens.safetensors  (audio)

`read_runs` collects every complete rollout of one or more run folders (shards of one run, or several runs) and
reports what is missing, partial or failed, against every rollout the runs' configs say they render (every prompt or
clip x the reference and every codec), so a sweep killed half way, or a rank that never started, shows;
`pair_rollouts` matches each codec rollout with its item's reference;
`Measurer` computes the metrics of a pair from the lossless files and caches them in `metrics.json` beside the
rollout (atomically; recomputed when an input file changed or the metric settings differ).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


REFERENCE = "reference"
ROLLOUT_FILE = "rollout.json"
FAILED_FILE = "failed.json"  # instead of rollout.json: the rollout ran but its outputs are unusable (e.g. NaN)
METRICS_FILE = "metrics.json"
METRICS_VERSION = 1
# role -> default file name; `files` in rollout.json may name them differently
FILES = {
    "video": {"frames": "frames.npy", "latents": "latents.safetensors", "video": "video.mp4"},
    "audio": {"audio": "audio.wav", "latent": "latent.safetensors", "tokens": "tokens.safetensors"},
}
REQUIRED = {"video": "frames", "audio": "audio"}  # what metrics cannot do without
TENSOR_KEYS = {"latents": "latents", "latent": "latent", "tokens": "tokens"}
# A codec rollout is comparable with its reference only if these agree (where both record them): same initial
# noise, same conditioning.
SAME_AS_REFERENCE = ("noise_sha256", "condition_sha256")


# ----------------------------------------------------------------------------------------------------------------
# JSON with non-finite floats as strings ("inf" is a legitimate PSNR; bare Infinity is not JSON)


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, (np.floating,)):
        return to_jsonable(float(obj))
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def from_jsonable(obj: Any) -> Any:
    if isinstance(obj, str) and obj in _NONFINITE:
        return _NONFINITE[obj]
    if isinstance(obj, dict):
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------------------------
# Rollouts


@dataclass
class Rollout:
    """One complete rollout folder and its rollout.json."""

    run: Path
    dir: Path
    info: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.info["kind"]

    @property
    def item(self) -> str:
        return str(self.info["item"])

    @property
    def item_index(self) -> int:
        idx = self.info.get("item_index")
        return int(idx) if isinstance(idx, (int, float)) and not isinstance(idx, bool) else -1

    @property
    def variant(self) -> str:
        return str(self.info["variant"])

    @property
    def is_reference(self) -> bool:
        return self.variant == REFERENCE

    @property
    def model(self) -> str:
        return str(self.info.get("model") or "unknown model")

    @property
    def preset(self) -> str:
        return str(self.info.get("preset") or self.variant)

    @property
    def bits(self) -> float | None:
        b = self.info.get("bits")
        return float(b) if isinstance(b, (int, float)) and not isinstance(b, bool) else None

    @property
    def group_key(self) -> tuple:
        """Rollouts are tabulated together when they share modality, model and residual window."""
        return (self.kind, self.model, self.info.get("residual_window"))

    @property
    def sort_key(self) -> tuple:
        return (self.item_index, self.item)

    def file(self, role: str) -> Path | None:
        """The path of a role's file (frames, latents, video, audio, latent, tokens), or None if it is absent."""
        files = self.info.get("files")
        name = None
        if isinstance(files, dict):
            name = files.get(role)
            if name is None:  # keys may be file names rather than roles
                default = FILES[self.kind].get(role)
                name = next((v for v in files.values() if isinstance(v, str) and Path(v).name == default), None)
        name = name or FILES[self.kind].get(role)
        if name is None:
            return None
        path = self.dir / name
        return path if path.is_file() else None

    def where(self) -> str:
        return f"{self.run.name}/rollouts/{self.item}/{self.variant}"


@dataclass
class RunSet:
    runs: list[Path]
    rollouts: list[Rollout] = field(default_factory=list)
    manifests: dict[str, dict] = field(default_factory=dict)  # "RUN/manifest.rankR.json" -> parsed manifest
    problems: list[str] = field(default_factory=list)


def _failure(info: dict) -> str | None:
    """Why a rollout record says it failed (`failed: true`, an `error`, or a `status` other than complete), else
    None. Such a record is final, but its outputs are not a result (e.g. non-finite frames)."""
    status = info.get("status")
    bad_status = status is not None and str(status).lower() not in ("complete", "ok")
    if not (info.get("failed") or info.get("error") or bad_status):
        return None
    reason = info.get("error") or info.get("reason") or (f"status {status!r}" if bad_status else None)
    return str(reason or "marked failed")


def expected_rollouts(config: Any) -> tuple[tuple, list[str], list[str]] | None:
    """(group key, items, variants) that a run's config says it renders; None when the config does not say (not a
    pipeline's config, or audio conditioned on precomputed embeddings alone, whose names only the embeddings hold).

    Video configs record `num_prompts` (items `pNNNN`) and a planned window per variant; audio configs record the
    clip list and the codec presets, whose folder names are derived as the pipelines derive them. Raises ValueError
    when a codec cannot be named (a preset this version of mmkv does not know)."""
    from mmkv.pipelines.common import RunError, item_name, parse_codec

    if not isinstance(config, dict) or config.get("kind") not in FILES or not config.get("model"):
        return None
    key = (config["kind"], str(config["model"]), config.get("residual_window"))
    items = config.get("items")  # when a config lists them
    if not isinstance(items, list):
        if isinstance(config.get("num_prompts"), int):
            items = [item_name(i) for i in range(config["num_prompts"])]
        elif isinstance(config.get("clips"), list) and config["clips"] and None not in config["clips"]:
            from mmkv.pipelines.aar.clap import item_names

            items = item_names([Path(c) for c in config["clips"]])
        else:
            return None
    if isinstance(config.get("windows"), dict):
        variants = list(config["windows"])
    elif isinstance(config.get("codecs"), list):
        try:
            variants = [REFERENCE] + [parse_codec(str(p), int(config.get("value_group") or 32)).variant
                                      for p in config["codecs"]]
        except RunError as err:
            raise ValueError(f"cannot tell which rollouts its config expects ({err})") from None
    else:
        return None
    return key, [str(i) for i in items], [str(v) for v in variants]


def _manifest_entries(manifest: Any) -> list[tuple[str, str]]:
    """(item, variant) pairs a manifest lists; entries may be dicts (item, variant) or 'item/variant' paths."""
    out = []
    entries = manifest.get("rollouts", []) if isinstance(manifest, dict) else []
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, dict) and "item" in e and "variant" in e:
            out.append((str(e["item"]), str(e["variant"])))
        elif isinstance(e, dict) and isinstance(e.get("path") or e.get("dir"), str):
            parts = Path(e.get("path") or e.get("dir")).parts
            if len(parts) >= 2:
                out.append((parts[-2], parts[-1]))
        elif isinstance(e, str) and len(Path(e).parts) >= 2:
            out.append((Path(e).parts[-2], Path(e).parts[-1]))
    return out


def _read_rollout(run: Path, d: Path, problems: list[str]) -> Rollout | None:
    where = f"{run.name}/rollouts/{d.parent.name}/{d.name}"
    rj = d / ROLLOUT_FILE
    if not rj.is_file() and (d / FAILED_FILE).is_file():
        try:
            info = json.loads((d / FAILED_FILE).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
            info = {"error": f"unreadable {FAILED_FILE} ({err})"}
        info = info if isinstance(info, dict) else {}
        problems.append(f"{where}: failed: {_failure({**info, 'status': 'failed'})}")
        return None
    if not rj.is_file():
        present = sorted(p.name for p in d.iterdir() if not p.name.startswith("."))
        problems.append(
            f"{where}: partial rollout: {ROLLOUT_FILE} is missing (it is written last, so this rollout never "
            f"finished); files present: {', '.join(present) or 'none'}"
        )
        return None
    try:
        info = json.loads(rj.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        problems.append(f"{where}: unreadable {ROLLOUT_FILE} ({err})")
        return None
    if not isinstance(info, dict):
        problems.append(f"{where}: {ROLLOUT_FILE} is not a JSON object")
        return None
    missing_keys = [k for k in ("kind", "item", "variant") if k not in info]
    if missing_keys:
        problems.append(f"{where}: {ROLLOUT_FILE} lacks {', '.join(missing_keys)}")
        return None
    if info["kind"] not in FILES:
        problems.append(f"{where}: unknown kind {info['kind']!r} in {ROLLOUT_FILE}; expected 'video' or 'audio'")
        return None
    if (str(info["item"]), str(info["variant"])) != (d.parent.name, d.name):
        problems.append(f"{where}: {ROLLOUT_FILE} says item {info['item']!r}, variant {info['variant']!r}; "
                        "the folder name disagrees (moved or copied by hand?)")
        return None
    if (reason := _failure(info)) is not None:
        problems.append(f"{where}: failed: {reason}")
        return None
    info = from_jsonable(info)
    files = info.get("files")
    listed = list(files.values()) if isinstance(files, dict) else list(files) if isinstance(files, list) else []
    absent = [str(n) for n in listed if not (d / str(n)).is_file()]
    r = Rollout(run=run, dir=d, info=info)
    need = REQUIRED[r.kind]
    if r.file(need) is None and FILES[r.kind][need] not in absent:
        absent.append(FILES[r.kind][need])
    if absent:
        problems.append(f"{where}: partial rollout: {', '.join(absent)} missing (listed in {ROLLOUT_FILE} or "
                        f"required for {r.kind} metrics)")
        return None
    return r


def _read_manifests(run: Path, rs: RunSet, expected: dict, ranks: dict) -> tuple[dict, set, dict]:
    """One run folder's manifests: the rollouts they list (-> manifest name), the group keys their configs name, and
    the failures they record ((item, variant) -> entry; variant None: the clip itself was unusable). The rollouts the
    configs expect go into `expected` and the ranks seen into `ranks` (both across run folders)."""
    listed: dict[tuple[str, str], str] = {}
    groups: set[tuple] = set()
    failed: dict[tuple[str, str | None], dict] = {}
    manifests = sorted(run.glob("manifest.rank*.json"))
    if not manifests:
        rs.problems.append(f"{run.name}: no manifest.rank*.json (not an mmkv run folder, or no rank started)")
    for m in manifests:
        try:
            data = json.loads(m.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
            rs.problems.append(f"{run.name}/{m.name}: unreadable manifest ({err})")
            continue
        rs.manifests[f"{run.name}/{m.name}"] = data
        for key in _manifest_entries(data):
            listed.setdefault(key, m.name)
        config = data.get("config") if isinstance(data, dict) else None
        try:
            plan = expected_rollouts(config)
        except ValueError as err:
            rs.problems.append(f"{run.name}/{m.name}: {err}; rollouts never started are not listed")
            plan = None
        if plan is not None:
            gk, items, variants = plan
            groups.add(gk)
            _, have, _ = ranks.setdefault(gk, (int(config.get("world_size") or 1), set(), run.name))
            if (rank := re.fullmatch(r"manifest\.rank(\d+)\.json", m.name)) is not None:
                have.add(int(rank.group(1)))
            for item in items:
                for variant in variants:
                    expected.setdefault((gk, item, variant), f"{run.name}/{m.name}")
        failures = data.get("failures") if isinstance(data, dict) else None
        for f in failures if isinstance(failures, list) else []:
            if isinstance(f, dict) and "item" in f:
                failed.setdefault((str(f["item"]), None if f.get("variant") is None else str(f["variant"])), f)
    return listed, groups, failed


def read_runs(paths) -> RunSet:
    """Every complete rollout of the given run folders, plus a problem line for each missing, partial or failed one:
    a rollout folder without a complete record, one listed in a manifest but gone, a clip the run could not use, and
    every (item, variant) a run's config expects that no folder given holds (never started)."""
    runs = [Path(p) for p in paths]
    rs = RunSet(runs=runs)
    seen: dict[tuple, Rollout] = {}
    # (group key, item, variant) -> "RUN/manifest.rankR.json" that expects it; and which of them have a folder
    expected: dict[tuple, str] = {}
    present: set[tuple] = set()
    ranks: dict[tuple, tuple[int, set[int], str]] = {}  # group key -> (world size, ranks with a manifest, run)
    for run in runs:
        if not run.is_dir():
            rs.problems.append(f"{run}: not a directory (expected a run folder with manifest.rank*.json and "
                               "rollouts/)")
            continue
        listed, groups, failed = _read_manifests(run, rs, expected, ranks)
        root = run / "rollouts"
        found: set[tuple[str, str]] = set()
        if not root.is_dir():
            rs.problems.append(f"{run.name}: no rollouts/ folder")
        for item_dir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
            for d in sorted(p for p in item_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
                found.add((item_dir.name, d.name))
                r = _read_rollout(run, d, rs.problems)
                if r is None:
                    continue
                key = (r.group_key, r.item, r.variant)
                present.add(key)
                if key in seen:
                    rs.problems.append(f"{r.where()}: duplicate of {seen[key].where()} (same model, item and "
                                       f"variant); using the first")
                    continue
                seen[key] = r
                rs.rollouts.append(r)
        # A folder without a usable record was already named above; a listed one that is gone is named here.
        present.update((gk, item, variant) for gk in groups for item, variant in found | set(listed))
        for (item, variant), mname in sorted(listed.items()):
            if (item, variant) not in found:
                rs.problems.append(f"{run.name}/rollouts/{item}/{variant}: missing: listed in {mname} but the "
                                   "folder is gone")
        # The pipelines drop an entry once its rollout succeeds; a failed rollout's folder (failed.json) is named above.
        for (item, variant), f in sorted(failed.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            reason = _failure({**f, "status": "failed"})
            if variant is None:
                present.update(k for k in expected if k[0] in groups and k[1] == item)
                rs.problems.append(f"{run.name}/rollouts/{item}: failed: clip {f.get('path') or item} could not be "
                                   f"used ({reason}); none of its rollouts were rendered")
            elif (item, variant) not in found:
                present.update((gk, item, variant) for gk in groups)
                rs.problems.append(f"{run.name}/rollouts/{item}/{variant}: failed: {reason}")
    for gk, (world, have, name) in ranks.items():
        if absent := sorted(set(range(world)) - have):
            rs.problems.append(f"{name}: no manifest from rank(s) {', '.join(map(str, absent))} of world size {world} "
                               f"({gk[1]}): those ranks never started; their rollouts are listed as missing")
    for (gk, item, variant), source in sorted(expected.items(), key=lambda kv: (str(kv[0][0]), kv[0][1:])):
        if (gk, item, variant) not in present:
            rs.problems.append(f"{source.split('/')[0]}/rollouts/{item}/{variant}: missing: never rendered "
                               f"({source}'s config expects it; no run folder given holds it)")
    return rs


def pair_rollouts(rs: RunSet) -> list[tuple[Rollout, Rollout]]:
    """(reference, test) for every codec rollout whose item has a comparable reference; problems otherwise."""
    refs = {(r.group_key, r.item): r for r in rs.rollouts if r.is_reference}
    pairs = []
    for r in sorted((r for r in rs.rollouts if not r.is_reference), key=lambda r: (r.group_key, r.sort_key,
                                                                                     r.variant)):
        ref = refs.get((r.group_key, r.item))
        if ref is None:
            rs.problems.append(f"{r.where()}: no reference rollout for item {r.item} of {r.model}; not compared")
            continue
        clash = next((k for k in SAME_AS_REFERENCE if ref.info.get(k) and r.info.get(k)
                      and ref.info[k] != r.info[k]), None)
        if clash:
            rs.problems.append(f"{r.where()}: {clash} differs from {ref.where()}'s ({str(r.info[clash])[:12]} vs "
                               f"{str(ref.info[clash])[:12]}): not the same rollout, not compared")
            continue
        pairs.append((ref, r))
    return pairs
