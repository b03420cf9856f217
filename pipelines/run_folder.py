"""The run-folder layout the metrics read, and the manifest of each rank:

    RUN/manifest.rank{R}.json                 run config, versions, checkpoint hashes, rollouts this rank wrote
    RUN/timings.rank{R}.json                  wall times of this rank: when each run started and ended, per rollout
    RUN/rollouts/<item>/<variant>/...         one folder per (prompt or clip, reference or codec)
    RUN/rollouts/<item>/<variant>/rollout.json   written LAST, atomically: its presence marks the rollout complete
    RUN/rollouts/<item>/<variant>/timings.json   the rollout's wall times, written just after rollout.json
    RUN/rollouts/<item>/<variant>/failed.json    instead, when the rollout ran but its output holds NaN / Inf

Wall times live only in the two timings files, so two identical runs write identical bytes in every other file. A
timings file may be missing (a run killed between the two writes, or deleted): readers show no time then, and a
rollout without one is still complete.

A rerun of the same command skips complete rollouts and redoes incomplete (and failed) ones, so a sweep killed at any
point and restarted loses nothing and duplicates nothing; it must use the same checkpoints (their SHA-256 are
recorded in the manifest and in every rollout.json) or it is refused.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from mmkv.pipelines.files import RunError, _json_default, atomic_write_json, read_json, remove_stale_temps, versions


FAILED_FILE = "failed.json"  # beside rollout.json: a rollout that ran and failed (reason inside), never both
TIMINGS_FILE = "timings.json"  # beside rollout.json: its wall times, kept apart so rollout.json depends only on inputs


class NonFiniteError(ValueError):
    """A rollout output (latents, decoded frames, waveform) holding NaN or Inf; the rollout is recorded as failed."""


def nonfinite_outputs(outputs: dict[str, torch.Tensor]) -> str | None:
    """Why a rollout's outputs cannot be used (`latents: 37 of 3456 values are NaN or Inf`), or None when all are
    finite. A NaN rollout decodes to a black video or silence that would otherwise be scored as a result."""
    problems = []
    for name, t in outputs.items():
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            problems.append(f"{name}: {bad} of {t.numel()} values are NaN or Inf")
    return "; ".join(problems) or None


def failure_record(kind: str, item: str, index: int, variant: str, preset: str | None, reason: str,
                   error: str, **facts: Any) -> dict[str, Any]:
    """The failed.json record (and the manifest's `failures` entry) of a rollout that ran but failed."""
    return {"kind": kind, "status": "failed", "item": item, "item_index": index, "variant": variant,
            "preset": preset, "reason": reason, "error": error, **facts}


def say(text: str) -> None:
    """One line of run output on stdout, whether or not it is a terminal (progress bars stay terminal-only); printed
    through tqdm so an active bar is redrawn below it."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def rollout_line(item: str, variant: str, seconds: float | None, kv_bytes: int | None,
                 peak_kv_bytes: int | None = None) -> str:
    """`p0000 reference: 12.3 s, KV 1,234,567 B (peak 2,345,678 B)`: the line printed after each rollout."""
    secs = "-" if seconds is None else f"{seconds:.2f} s"
    kv = "-" if kv_bytes is None else f"{int(kv_bytes):,} B"
    peak = "" if peak_kv_bytes is None else f" (peak {int(peak_kv_bytes):,} B)"
    return f"{item} {variant}: {secs}, KV {kv}{peak}"


def item_name(index: int) -> str:
    """Folder name of prompt / clip `index`: `p0003`."""
    return f"p{int(index):04d}"


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Fail early, without creating anything, when folder `path` cannot be created or written: a path under a file,
    or a read-only / not writable nearest existing folder."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:  # a relative path whose every parent is missing: the working directory holds it
        existing = Path.cwd()
    if not existing.is_dir():
        where = "exists and is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise RunError(f"{flag} {path} {where}, not a directory; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunError(f"{flag} {path} cannot be written: {existing} is read-only or not writable by this user; "
                       f"choose another {flag}")
    return path


class RunFolder:
    """The run folder: rollout paths, completion checks, and this rank's manifest (merged across restarts)."""

    def __init__(self, root: str | os.PathLike, rank: int = 0, world_size: int = 1):
        self.root = check_out_dir(root)
        self.rank = rank
        self.world_size = world_size
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # e.g. a race with another process, or a filesystem that refuses the name
            raise RunError(f"--out {self.root} cannot be created ({err.strerror or err}); choose another "
                           "--out") from None

    # -- rollouts ------------------------------------------------------------------------------------------------
    def rollout_dir(self, item: str, variant: str) -> Path:
        return self.root / "rollouts" / item / variant

    def rollout_record(self, item: str, variant: str) -> dict[str, Any] | None:
        """The rollout.json of a complete rollout (all its listed files present), else None."""
        path = self.rollout_dir(item, variant) / "rollout.json"
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None  # a torn file cannot happen with atomic writes, but never trust it: redo the rollout
        files = record.get("files", {}) if isinstance(record, dict) else {}
        values = files.values() if isinstance(files, dict) else files
        if any(not (path.parent / name).is_file() for name in values):
            return None
        return record

    def is_complete(self, item: str, variant: str) -> bool:
        return self.rollout_record(item, variant) is not None

    def rollout_timings(self, item: str, variant: str) -> dict[str, Any] | None:
        """The wall times of a rollout (its timings.json), or None when it is missing or unreadable."""
        try:
            timings = json.loads((self.rollout_dir(item, variant) / TIMINGS_FILE).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None
        return timings if isinstance(timings, dict) else None

    def write_rollout(self, item: str, variant: str, record: dict[str, Any],
                      timings: dict[str, Any] | None = None) -> Path:
        """Write rollout.json last and atomically, then its `timings`; call only after every file it lists is in
        place. A failure record of an earlier attempt is removed: this one succeeded."""
        path = self.rollout_dir(item, variant) / "rollout.json"
        # an older attempt's times must not pass as this rollout's if the run is killed between the two writes
        (path.parent / TIMINGS_FILE).unlink(missing_ok=True)
        atomic_write_json(path, record)
        (path.parent / FAILED_FILE).unlink(missing_ok=True)
        if timings is not None:
            atomic_write_json(path.parent / TIMINGS_FILE, timings)
        return path

    def write_failure(self, item: str, variant: str, record: dict[str, Any]) -> Path:
        """Record a rollout that ran but produced no usable output (e.g. NaN latents) as `failed.json`, so the report
        can list it; no rollout.json is written, so the rollout stays incomplete and a rerun tries it again."""
        (self.rollout_dir(item, variant) / TIMINGS_FILE).unlink(missing_ok=True)  # an older attempt's
        return atomic_write_json(self.rollout_dir(item, variant) / FAILED_FILE, record)

    # -- manifest ------------------------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / f"manifest.rank{self.rank}.json"

    @property
    def timings_path(self) -> Path:
        return self.root / f"timings.rank{self.rank}.json"

    def open_manifest(self, config: dict[str, Any], *, identity_keys: Sequence[str] = (),
                      labels: dict[str, str] | None = None) -> "Manifest":
        """Load this rank's manifest (or start one). When resuming, the values of `identity_keys` in the stored config
        must equal the new ones (a rerun with another seed, model or checkpoint must not mix into the same folder);
        `labels` names the input behind a `*_sha256` key in the error. Temp files of this rank's manifest and timings
        left by a killed write are removed first (only this rank writes them)."""
        remove_stale_temps(self.manifest_path)
        remove_stale_temps(self.timings_path)
        return Manifest(self.manifest_path, config, identity_keys, labels, timings_path=self.timings_path)

    def check_identity(self, item: str, variant: str, record: dict[str, Any], expected: dict[str, Any],
                       labels: dict[str, str] | None = None) -> None:
        """Refuse a finished rollout whose recorded inputs (`expected`: key -> value, e.g. checkpoint hashes) differ
        from this run's: it may have been written by another rank's earlier run, which this rank's manifest does not
        know."""
        where = self.rollout_dir(item, variant) / "rollout.json"
        for key, want in expected.items():
            if record.get(key) != want:
                raise RunError(identity_mismatch(where, key, record.get(key), want, labels))


def identity_mismatch(where: Path, key: str, old: Any, new: Any, labels: dict[str, str] | None = None) -> str:
    """The one-line error for a resume whose inputs differ from those the run folder was made with."""
    if key.endswith("_sha256"):
        label = (labels or {}).get(key, key[: -len("_sha256")])
        return (f"{where}: this run folder was made from a {label} with SHA-256 {old or '(not recorded)'}, the command "
                f"now gives one with SHA-256 {new}; resuming would mix the two in one table: give another --out "
                f"folder for this {label}, or the same {label} to resume")
    return (f"{where}: this run folder was made with {key}={old!r}, the command now asks for {new!r}; "
            f"use another --out folder or the same settings to resume")


class Manifest:
    """One rank's manifest: run config, versions, extra facts (checkpoint hashes), rollouts written; saved
    atomically, with this rank's wall times (`timings`: run start and end, per-rollout times) in a file of their own.

    `runs` in the manifest lists each invocation's settings; the timings file's `runs` entry `{"run": i, "started",
    "finished"}` gives the times of the manifest's `runs[i]`, and its `rollouts` maps `item/variant` to that rollout's
    timings.json."""

    def __init__(self, path: Path, config: dict[str, Any], identity_keys: Sequence[str] = (),
                 labels: dict[str, str] | None = None, *, timings_path: Path):
        self.path = path
        self.timings_path = timings_path
        self.data: dict[str, Any] = {"config": config, "versions": versions(), "rollouts": [], "runs": []}
        self.timings: dict[str, Any] = _read_timings(self.timings_path)
        if path.exists():
            old = read_json(path)
            if not isinstance(old, dict) or "config" not in old:
                raise RunError(f"{path}: not an mmkv run manifest (no 'config'); use another --out folder")
            for key in identity_keys:
                a, b = old["config"].get(key), _jsonable(config.get(key))
                if a != b:
                    raise RunError(identity_mismatch(path, key, a, b, labels))
            self.data["rollouts"] = list(old.get("rollouts", []))
            self.data["runs"] = list(old.get("runs", []))
            for k, v in old.items():
                self.data.setdefault(k, v)
            self._move_old_wall_times()

    def _move_old_wall_times(self) -> None:
        """Manifests written before the timings file held the times inline: move them there."""
        for i, run in enumerate(self.data["runs"]):
            clock = {k: run.pop(k) for k in _RUN_CLOCK if isinstance(run, dict) and k in run}
            if clock:
                self.timings["runs"].append({"run": i, **clock})
        for entry in self.data["rollouts"]:
            if isinstance(entry, dict) and ("timings" in entry or "seconds" in entry):
                old = entry.pop("timings", None) or {"total": entry.get("seconds")}
                entry.pop("seconds", None)
                self.timings["rollouts"].setdefault(f"{entry.get('item')}/{entry.get('variant')}", old)

    def start_run(self, facts: dict[str, Any]) -> dict[str, Any]:
        """Record one invocation: its `facts` (settings, versions) in the manifest, its start time in the timings;
        returns that timings entry, where the caller may set `finished`."""
        self.data["runs"].append(dict(facts))
        clock = {"run": len(self.data["runs"]) - 1, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.timings["runs"].append(clock)
        return clock

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def add_rollout(self, entry: dict[str, Any], timings: dict[str, Any] | None = None) -> None:
        """Record a rollout (replacing an earlier entry for the same item and variant) and its wall times, when known
        (a finished rollout whose timings.json is gone keeps the times recorded here before)."""
        key = (entry["item"], entry["variant"])
        self.data["rollouts"] = [r for r in self.data["rollouts"] if (r["item"], r["variant"]) != key]
        self.data["rollouts"].append(entry)
        if timings is not None:
            self.timings["rollouts"][f"{key[0]}/{key[1]}"] = timings

    def save(self) -> Path:
        atomic_write_json(self.path, self.data)
        atomic_write_json(self.timings_path, self.timings)
        return self.path


_RUN_CLOCK = ("started", "finished")  # the wall-clock keys of a `runs` entry


def _read_timings(path: Path) -> dict[str, Any]:
    """A rank's timings file, or an empty one when it is missing or unreadable: times are never worth refusing a
    resume over."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        old = None
    old = old if isinstance(old, dict) else {}
    runs, rollouts = old.get("runs"), old.get("rollouts")
    return {"runs": runs if isinstance(runs, list) else [], "rollouts": rollouts if isinstance(rollouts, dict) else {}}


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=_json_default))
