"""The Table-3-shaped tables the report prints, drawn from the aggregation in `mmkv.report.aggregate` (whose
docstring says how items are matched across codecs and shards).
"""

from __future__ import annotations

from typing import Any

from mmkv.codecs.config import CodecError, split_preset  # noqa: F401
from mmkv.codecs.registry import display_name, get_codec_class, table_order  # noqa: F401
from mmkv.metrics.video import DEFAULT_FPS, psnr_from_mse, windowed_means  # noqa: F401
from mmkv.report.adherence import ONSET_TOLERANCE_S
from mmkv.report.measure import Measured  # noqa: F401
from mmkv.report.runs import REFERENCE  # noqa: F401
from mmkv.report.tables import Column, Table
from mmkv.report.aggregate import (  # noqa: F401
    ADHERENCE_METRICS, BLOCK_METRICS, CURVE_METRICS, DEFAULT_METRICS, METRICS, WINDOW_METRICS, Cell, Group,
    MetricSpec, Row, Summary, _add_adherence, _cell, _codec_rank, _label_rows, _mean, _num, _uneven_line,
    codec_display, parse_preset, summarize, width_keys,
)

# ----------------------------------------------------------------------------------------------------------------
# Tables


def _lpips_note(groups: list[Group]) -> list[str]:
    notes = []
    for g in groups:
        random = sorted(t for t in g.lpips_trunks if t.startswith("random"))
        if random:
            notes.append(f"{g.label}: LPIPS† uses a random AlexNet trunk ({', '.join(random)}), not the ImageNet "
                         "weights: not LPIPS, a smoke-test number only.")
        if len(g.lpips_trunks) > 1:
            notes.append(f"{g.label}: LPIPS values come from different trunks ({', '.join(sorted(g.lpips_trunks))})"
                         "; recompute with one --lpips setting.")
    return notes


def metric_label(key: str, random_lpips: bool) -> str:
    """A metric's display name; LPIPS from the random trunk is not LPIPS, so it shows as LPIPS† (see LPIPS_NOTE)."""
    label = METRICS[key].label
    return label + "†" if key == "lpips" and random_lpips else label


LPIPS_NOTE = "LPIPS†: a random AlexNet trunk, not the ImageNet weights: not LPIPS, a smoke-test number only"


def _metric_header(spec: MetricSpec, g: Group) -> str:
    return metric_label(spec.key, g.random_lpips) + ("↓" if spec.better == "lower" else "↑")


def _coverage_notes(groups: list[Group]) -> list[str]:
    notes = []
    for g in groups:
        if g.uneven and g.comparable:
            notes.append(f"{g.label}: codecs measured different items; n, min / μ / max and every other value are "
                         f"over the {len(g.common_items)} item(s) all codecs have ({', '.join(g.common_items)}); the "
                         "items left out are listed under Problems and in the csv/json column left_out.")
        elif not g.comparable:
            notes.append(f"{g.label}: NOT COMPARABLE: no item was measured for every codec, so each codec's values "
                         "are over its own items (see n and Problems) and nothing is marked best.")
    return notes


def _coverage_columns(g: Group, gl: str) -> list[Column]:
    """csv/json-only columns: the items a row's statistics are over, and the measured ones left out."""
    return [Column(f"{g.label}/items", (gl, "", "items"), show=False),
            Column(f"{g.label}/left_out", (gl, "", "left out"), show=False)]


def _coverage_values(c: Cell | None) -> list[Any]:
    return [None, None] if c is None else [" ".join(c.items), " ".join(c.left_out)]


def main_table(s: Summary, metrics: dict[str, tuple[str, ...]] | None = None) -> Table:
    """Table 3's shape: a row per (bits, codec); per model, n, KV×, effective bits and min / μ / max per metric."""
    metrics = metrics or DEFAULT_METRICS
    multi = len(s.groups) > 1
    cols = [Column("bits", ("", "", "b"), "{:g}"), Column("codec", ("", "", "codec")),
            Column("preset", ("", "", "preset"), show=False)]
    getters = []
    for g in s.groups:
        gl = g.label if multi else ""
        cols += [Column(f"{g.label}/n", (gl, "", "n"), "{:d}"),
                 Column(f"{g.label}/kv_ratio", (gl, "", "KV×"), "{:.2f}×"),
                 Column(f"{g.label}/effective_bits", (gl, "", "bits"), "{:.2f}"), *_coverage_columns(g, gl)]
        getters += [(g, "n"), (g, "kv_ratio"), (g, "effective_bits"), (g, "coverage")]
        for key in metrics.get(g.kind, ()):
            spec = METRICS[key]
            if not any((c := s.cell(g, r)) is not None and c.stat(key) for r in s.rows):
                continue  # nobody measured it (e.g. no latents saved)
            fmt = spec.format
            h = _metric_header(spec, g)
            cols += [Column(f"{g.label}/{key}/min", (gl, h, "min"), fmt),
                     Column(f"{g.label}/{key}/mean", (gl, h, "μ"), fmt,
                            better=spec.better if g.comparable else None),
                     Column(f"{g.label}/{key}/max", (gl, h, "max"), fmt)]
            getters += [(g, (key, 0)), (g, (key, 1)), (g, (key, 2))]
            if key == "snr_db":
                cols.append(Column(f"{g.label}/snr_db/at_cap", (gl, h, "@cap"), "{:.0%}"))
                getters.append((g, "snr_at_cap"))
    table_rows = []
    for r in s.rows:
        row: list[Any] = [r.bits, r.label, r.preset]
        for g, what in getters:
            c = s.cell(g, r)
            if what == "coverage":
                row += _coverage_values(c)
            elif c is None:
                row.append(None)
            elif what == "n":
                row.append(c.n)
            elif what in ("kv_ratio", "effective_bits", "snr_at_cap"):
                row.append(getattr(c, what))
            else:
                st = c.stat(what[0])
                row.append(None if st is None else st[what[1]])
        table_rows.append(row)
    notes = [
        "min / μ / max across the items (prompts or clips) of each codec, each compared with the same item's "
        "native-cache reference rollout (uncompressed: bf16 on GPU, fp32 on CPU; same seed, byte-identical initial noise). μ: bold = best, underlined = "
        "runner-up within a bit-width block.",
        "b: nominal bits of the preset; KV×: bf16 KV bytes / bytes really stored (the native residual window "
        "included, fp32 on CPU); bits: measured bits per encoded K/V element (payload and side information; the "
        "native window is not in it; for the reference, bits per held element).",
    ]
    kinds = {g.kind for g in s.groups}
    if "video" in kinds:
        lpips = any(g.lpips_trunks for g in s.groups)
        notes.append("Video, from the lossless frames: PSNR (dB) from the MSE pooled over a video's frames (inf only "
                     "if every frame is identical); SSIM Gaussian σ=1.5 (scikit-image, Wang et al.); "
                     + ("LPIPS-alex v0.1; " if lpips else "") + "per-video means over frames; cos = latent cosine.")
    if "audio" in kinds:
        notes.append("Audio: LSD in dB (10 × log10-power LSD, Hann, n_fft 2048, hop 512); SNR in dB capped at 120 "
                     "(= bit-identical), @cap = share of clips at the cap; mel MSE = log10-mel MSE (80 Slaney mels, "
                     "n_fft 1024, hop 256); cos = SAT latent cosine.")
    shown = [g for g in s.groups if set(metrics.get(g.kind, ())) & set(ADHERENCE_METRICS[g.kind])]
    notes += _lpips_note(s.groups) + _coverage_notes(s.groups) + _adherence_notes(s, shown, per_block=False)
    title = "Compressed-KV rollouts against the native-cache reference" + (
        f" ({', '.join(g.label for g in s.groups)})" if s.groups else "")
    return Table("main", title, cols, table_rows, block="bits", notes=notes, unranked=_reference_rows(s))


def _reference_rows(s: Summary) -> set[int]:
    return {i for i, r in enumerate(s.rows) if r.preset == REFERENCE}


def _adherence_notes(s: Summary, groups: list[Group], per_block: bool) -> list[str]:
    """What adherence and consistency are, and over which items, for the groups that show them."""
    groups = [g for g in groups if (g.key, REFERENCE) in s.cells]
    if not groups:
        return []
    notes = []
    if per_block:
        notes += ["consistency / background PSNR per block, for procedural captions (blocks after block 1, which is "
                  "frames 0–8; then 12 frames a block, the CausVid blocks): the share of items whose block shows "
                  "block 1's unnamed scene (stripe colours and phase, second object, bar), and the mean PSNR (dB, "
                  "capped at 100 = unchanged) of its background pixels against block 1's per-pixel median. Each "
                  "rollout is scored alone, so the reference has its own row (never marked)."]
    if not per_block and any(g.kind == "video" for g in groups):
        notes += ["adherence: the share of the caption's named attributes (colour, shape, size, direction, speed) "
                  "that mmkv.metrics.adherence reads from a rollout's own frames (0 when no object of a named colour "
                  "is found); consistency: the share of the blocks after block 1 whose unnamed scene (stripes, second "
                  "object, bar) matches block 1's (– where block 1 shows no striped background). Each rollout is "
                  "scored alone, against its caption, so the reference (native cache) has its own row (never "
                  "marked): how well the model itself follows the captions. checks=ref: the share of the named "
                  "attributes whose check (held, failed or unreadable) is the reference rollout's, so a codec that "
                  "turns a wrong attribute right counts as a change as much as one that turns a right one wrong "
                  "(– for the reference itself)."]
    if not per_block and any(g.kind == "audio" for g in groups):
        notes += ["Audio adherence: the share of the caption's named attributes (kind; a note's pitch within 50 "
                  "cents, waveform and envelope; a chirp's direction; a burst's band; the number of clicks) that "
                  "mmkv.metrics.audio_adherence reads from a rollout's own waveform (0 when it is silent), each "
                  "rollout alone against its clip's caption, so the reference has its own row (never marked); "
                  f"onsets≈: the share of the reference's onsets that the codec's rollout matches within "
                  f"{ONSET_TOLERANCE_S * 1000:g} ms (one to one); onset Δms: the mean distance from each reference "
                  "onset to the rollout's nearest (– without onsets, and for the reference itself)."]
    for g in groups:
        if g.unscored_items:
            what, why = (("adherence and consistency", "name no scene") if g.kind == "video" else
                         ("adherence and onset agreement", "have no procedural caption"))
            notes.append(f"{g.label}: {what} are over the {len(g.scored_items)} item(s) whose "
                         f"prompt is a procedural caption ({', '.join(g.scored_items)}) only; the other "
                         f"{len(g.unscored_items)} ({', '.join(g.unscored_items)}) {why} and are not scored.")
    return notes


def windows_table(s: Summary) -> Table | None:
    """Windowed means: μ over items of each video's mean over [a, b) seconds, per metric and window."""
    video = [g for g in s.groups if g.kind == "video"]
    if not video:
        return None
    multi = len(video) > 1
    cols = [Column("bits", ("", "", "b"), "{:g}"), Column("codec", ("", "", "codec")),
            Column("preset", ("", "", "preset"), show=False)]
    getters = []
    for g in video:
        cols += _coverage_columns(g, g.label if multi else "")
        getters.append((g, "coverage", None, None))
        labels: dict[str, float] = {}
        for r in s.rows:
            c = s.cell(g, r)
            for w in c.windows if c else []:
                labels.setdefault(w["label"], w["start_s"])
        ordered = sorted(labels, key=labels.get)
        for key in WINDOW_METRICS:
            spec = METRICS[key]
            if not any((c := s.cell(g, r)) is not None and any(w.get(key) is not None for w in c.windows)
                       for r in s.rows):
                continue
            head = (g.label + " " if multi else "") + _metric_header(spec, g)
            for label in ordered:
                cols.append(Column(f"{g.label}/{key}/{label}", (head, label), spec.format,
                                   better=spec.better if g.comparable else None))
                getters.append((g, key, label, "windows"))
        # Procedural captions: each block after block 1 against block 1 (frame blocks, not the time windows).
        blocks: dict[str, int] = {}
        for r in s.rows:
            c = s.cell(g, r)
            for b in c.blocks if c else []:
                blocks.setdefault(b["label"], b["first_frame"])
        for key, spec in BLOCK_METRICS.items():
            head = (g.label + " " if multi else "") + spec.header
            for label in sorted(blocks, key=blocks.get):
                cols.append(Column(f"{g.label}/block_{key}/{label}", (head, label), spec.format,
                                   better=spec.better if g.comparable else None))
                getters.append((g, key, label, "blocks"))
    rows = []
    for r in s.rows:
        row: list[Any] = [r.bits, r.label, r.preset]
        for g, key, label, where in getters:
            c = s.cell(g, r)
            if key == "coverage":
                row += _coverage_values(c)
                continue
            w = next((w for w in getattr(c, where) if w["label"] == label), None) if c else None
            row.append(None if w is None else w.get(key))
        rows.append(row)
    fps = sorted({g.fps for g in video})
    notes = [f"Each entry: the mean over items of one video's mean of per-frame values in the window [a, b) s at "
             f"{', '.join(f'{f:g}' for f in fps)} fps (PSNR: from the window's pooled MSE). The last window may be "
             "partly filled. Bold / underlined: best / runner-up within a bit-width block."] + _lpips_note(video)
    notes += _coverage_notes(video) + _adherence_notes(s, video, per_block=True)
    return Table("windows", "Windowed means over time (per-frame metrics averaged within each window)", cols, rows,
                 block="bits", notes=notes, unranked=_reference_rows(s))


def rollouts_table(s: Summary) -> Table:
    """Long form, one row per compared rollout: what the pipelines recorded and every summary metric; where prompts
    are procedural captions, each rollout's adherence scores too, and a row per scored reference rollout."""
    keys = []
    for m in s.measured:
        for k in m.metrics["summary"]:
            if k not in keys:
                keys.append(k)
    info_keys = ["bits", "effective_bits", "kv_ratio", "kv_bytes", "bf16_kv_bytes", "peak_kv_bytes", "seed",
                 "noise_sha256", "rank"]
    scores = s.adherence.by_rollout if s.adherence is not None else {}
    # Every scalar a score holds (video and audio scores hold different checks); lists (blocks, onsets) stay out.
    score_keys = list(dict.fromkeys(k for sc in scores.values() for k, v in sc.items()
                                    if not isinstance(v, (list, dict))))
    cols = [Column(k, (k,)) for k in ["kind", "model", "residual_window", "item", "item_index", "variant", "preset"]
            + info_keys + keys + ["lpips_trunk"] + score_keys]
    entries = [(m.test, m) for m in s.measured]
    refs = {(m.ref.group_key, m.ref.item): m.ref for m in s.measured}
    entries += [(r, None) for _, r in sorted(refs.items(), key=lambda kv: kv[1].sort_key)
                if (r.group_key, r.item, r.variant) in scores]
    rows = []
    for t, m in sorted(entries, key=lambda e: (e[0].group_key, e[0].sort_key, not e[0].is_reference, e[0].variant)):
        summary = m.metrics["summary"] if m else {}
        sc = scores.get((t.group_key, t.item, t.variant), {})
        trunk = m.metrics.get("config", {}).get("lpips_trunk") if m else None
        rows.append([t.kind, t.model, t.info.get("residual_window"), t.item, t.item_index, t.variant, t.preset]
                    + [t.info.get(k) for k in info_keys] + [summary.get(k) for k in keys] + [trunk]
                    + [sc.get(k) for k in score_keys])
    return Table("rollouts", "Per-rollout metrics", cols, rows)


def frames_table(s: Summary) -> Table:
    """Long form, one row per frame of every compared video rollout (per-frame curves for plotting elsewhere)."""
    cols = [Column(k, (k,)) for k in ("model", "item", "variant", "preset", "frame", "time_s", "mse", "psnr", "ssim",
                                       "lpips")]
    rows = []
    for m in sorted(s.measured, key=lambda m: (m.test.group_key, m.test.sort_key, m.test.variant)):
        if m.test.kind != "video":
            continue
        pf = m.metrics["per_frame"]
        fps = float(m.test.info.get("fps") or m.metrics.get("fps") or DEFAULT_FPS)
        for f in range(len(pf["mse"])):
            rows.append([m.test.model, m.test.item, m.test.variant, m.test.preset, f, f / fps]
                        + [pf[k][f] if k in pf else None for k in ("mse", "psnr", "ssim", "lpips")])
    return Table("frames", "Per-frame metrics", cols, rows)
