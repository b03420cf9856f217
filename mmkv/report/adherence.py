"""Prompt adherence and scene consistency of the rollouts of a video run whose prompts are procedural captions
(`mmkv.pipelines.wan.scenes`): what `mmkv.metrics.adherence.score_clip` reads from each rollout's own lossless
frames. A score needs no reference, so the reference rollout is scored like every codec's, and it shows how well
the model itself follows a caption (what the codecs are then held to).

A rollout whose prompt is not a procedural caption is not scored (and that is no problem); a run mixing both kinds
is scored over the procedural ones, and the tables say so. Scores take ~30 ms a clip, so they are computed on each
report rather than cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmkv.report.runs import Measured, Rollout, _load_frames

ATTRIBUTES = ("colour", "shape", "size", "direction", "speed")


@dataclass
class Scores:
    """Scores of the rollouts of procedural captions, and which items of each group have such a caption."""

    by_rollout: dict[tuple, dict] = field(default_factory=dict)  # (group key, item, variant) -> score
    procedural: dict[tuple, set[str]] = field(default_factory=dict)  # group key -> items with a procedural caption
    other: dict[tuple, set[str]] = field(default_factory=dict)  # group key -> items with any other prompt

    def get(self, r: Rollout) -> dict | None:
        return self.by_rollout.get((r.group_key, r.item, r.variant))


def caption_attributes(r: Rollout) -> dict[str, str] | None:
    """The attributes the rollout's prompt names, or None when the prompt is not a procedural caption."""
    from mmkv.pipelines.wan.scenes import parse_caption

    return parse_caption(r.info.get("text")) if r.kind == "video" else None


def score_rollout(r: Rollout, named: dict[str, str]) -> dict:
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
        "blocks": [{k: w.get(k) for k in ("label", "first_frame", "end_frame", "match", "background_psnr",
                                          "stripe_agreement")} for w in full["windows"][1:]],
    }


def score_all(measured: list[Measured], problems: list[str], progress=None) -> Scores:
    """Scores of every video rollout the measured pairs use (each reference once) whose prompt is a procedural
    caption; a rollout that cannot be scored becomes a problem line and the rest go on."""
    rollouts: dict[tuple, Rollout] = {}
    for m in measured:
        for r in (m.ref, m.test):
            if r.kind == "video":
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
    return scores
