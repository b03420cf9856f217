"""Prompt adherence of the rollouts of a run whose prompts are procedural captions, read from each rollout's own
lossless output: for video, what `mmkv.metrics.adherence.score_clip` reads from the frames of a caption of
`mmkv.pipelines.wan.scenes` (and the consistency of what the caption leaves out); for audio, what
`mmkv.metrics.audio_adherence.score_audio` reads from the waveform of a caption of `mmkv.pipelines.aar.sounds`
(the clip's caption, which `mmkv compare audio` records from a sidecar `<clip stem>.txt`). A score needs no
reference, so the reference rollout is scored like every codec's, and it shows how well the model itself follows a
caption (what the codecs are then held to). Video rollouts are also held to their reference's reading of the
caption (`attribute_match`: the share of the named attributes whose check, held or not, is the reference's, so a
codec that turns a wrong shape right counts as a change, as one that turns it wrong does); audio rollouts to their
reference's onset times: the share of its onsets matched within ONSET_TOLERANCE_S, and the mean distance from each to
the nearest onset.

A rollout whose prompt is not a procedural caption is not scored (and that is no problem); a run mixing both kinds
is scored over the procedural ones, and the tables say so. Scores take ~30 ms a clip, so they are computed on each
report rather than cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmkv.report.measure import Measured, _load_frames, _load_wav
from mmkv.report.runs import REFERENCE, Rollout

ATTRIBUTES = ("colour", "shape", "size", "direction", "speed")
ONSET_TOLERANCE_S = 0.010  # a codec's onset within 10 ms of the reference's counts as the same event


@dataclass
class Scores:
    """Scores of the rollouts of procedural captions, and which items of each group have such a caption."""

    by_rollout: dict[tuple, dict] = field(default_factory=dict)  # (group key, item, variant) -> score
    procedural: dict[tuple, set[str]] = field(default_factory=dict)  # group key -> items with a procedural caption
    other: dict[tuple, set[str]] = field(default_factory=dict)  # group key -> items with any other prompt

    def get(self, r: Rollout) -> dict | None:
        return self.by_rollout.get((r.group_key, r.item, r.variant))


def caption_attributes(r: Rollout) -> dict | None:
    """The attributes the rollout's caption names, or None when it is not a procedural caption (video: the prompt,
    `text`; audio: `caption`, since an audio rollout's `text` is its clip's path)."""
    if r.kind == "video":
        from mmkv.pipelines.wan.scenes import parse_caption

        return parse_caption(r.info.get("text"))
    from mmkv.pipelines.aar.sounds import parse_caption

    return parse_caption(r.info.get("caption"))


def _score_video(r: Rollout, named: dict) -> dict:
    """The report's view of `score_clip` on one rollout's frames: adherence, consistency, each attribute's check and,
    per block after block 1, whether it matches block 1 and its background PSNR against block 1's."""
    from mmkv.metrics.adherence import score_clip
    from mmkv.pipelines.wan.scenes import PALETTE

    full = score_clip(_load_frames(r.file("frames")), named, PALETTE)
    # No object of a named colour anywhere: none of the caption is followed (the detector says None, "cannot tell";
    # left out, a codec that wipes the object would look better than one that merely recolours it).
    adherence = full["adherence"] if full["found"] else 0.0
    return {
        "adherence": adherence, "consistency": full["consistency"], "object_found": bool(full["found"]),
        **{f"{a}_ok": full[f"{a}_ok"] for a in ATTRIBUTES},
        "named": [a for a in ATTRIBUTES if named.get(a) is not None], "attribute_match": None,
        "blocks": [{k: w.get(k) for k in ("label", "first_frame", "end_frame", "match", "background_psnr",
                                          "stripe_agreement")} for w in full["windows"][1:]],
    }


def _score_audio(r: Rollout, named: dict) -> dict:
    """The report's view of `score_audio` on one rollout's waveform: adherence, each named attribute's check, the
    onset times (onset_match / onset_error_ms against the reference are added by `score_all`)."""
    from mmkv.metrics.audio_adherence import OK_FIELDS, score_audio
    from mmkv.pipelines.aar.sounds import TABLES

    wave, sr = _load_wav(r.file("audio"), r.info.get("sample_rate"))
    full = score_audio(wave.mean(axis=1) if wave.ndim == 2 else wave, sr, named, TABLES)
    # A silent rollout follows none of its caption (the detector says None, "cannot tell"), as for video.
    adherence = full["adherence"] if full["found"] else 0.0
    return {"adherence": adherence, "sound_found": bool(full["found"]),
            **{f: full[f] for f in OK_FIELDS.values()}, "onset_count": full["count"],
            "onset_times": [float(t) for t in full["onset_times"]], "onset_match": None, "onset_error_ms": None}


def score_rollout(r: Rollout, named: dict) -> dict:
    return _score_video(r, named) if r.kind == "video" else _score_audio(r, named)


def onset_agreement(ref: list[float], test: list[float], tol: float = ONSET_TOLERANCE_S) -> tuple:
    """(share of `ref` onsets paired one to one with a `test` onset within `tol` s, closest pairs first; mean over
    `ref` onsets of the distance to the nearest `test` onset, in ms). The share is None without reference onsets,
    the distance also without test onsets."""
    if not ref:
        return None, None
    if not test:
        return 0.0, None
    d = np.abs(np.asarray(ref)[:, None] - np.asarray(test)[None, :])
    used_r, used_t = set(), set()
    for i, j in sorted(zip(*np.nonzero(d <= tol)), key=lambda ij: (d[ij], ij)):
        if i not in used_r and j not in used_t:
            used_r.add(i)
            used_t.add(j)
    return len(used_r) / len(ref), float(d.min(axis=1).mean() * 1000)


def attribute_agreement(ref: dict, test: dict) -> float | None:
    """Share of the caption's named attributes whose check in `test` (held, failed, or unreadable: None) is the one
    in `ref`, both video scores of the same caption; None when the caption names none."""
    named = ref["named"]
    if not named:
        return None
    return sum(test[f"{a}_ok"] == ref[f"{a}_ok"] for a in named) / len(named)


def score_all(measured: list[Measured], problems: list[str], progress=None) -> Scores:
    """Scores of every rollout the measured pairs use (each reference once) whose prompt is a procedural caption;
    a rollout that cannot be scored becomes a problem line and the rest go on."""
    rollouts: dict[tuple, Rollout] = {}
    for m in measured:
        for r in (m.ref, m.test):
            rollouts.setdefault((r.group_key, r.item, r.variant), r)
    scores = Scores()
    todo = []
    for key, r in sorted(rollouts.items(), key=lambda kv: (str(kv[0][0]), kv[1].sort_key, kv[0][2])):
        named = caption_attributes(r)
        (scores.procedural if named is not None else scores.other).setdefault(r.group_key, set()).add(r.item)
        if named is not None:
            todo.append((key, r, named))
    for key, r, named in (progress(todo) if progress else todo):
        try:
            scores.by_rollout[key] = score_rollout(r, named)
        except (ValueError, OSError) as err:
            problems.append(f"{r.where()}: adherence not scored: {err}")
    for (group, item, variant), sc in scores.by_rollout.items():
        ref = scores.by_rollout.get((group, item, REFERENCE))
        if variant == REFERENCE or ref is None:
            continue
        if "onset_times" in sc:
            sc["onset_match"], sc["onset_error_ms"] = onset_agreement(ref["onset_times"], sc["onset_times"])
        else:
            sc["attribute_match"] = attribute_agreement(ref, sc)
    return scores
