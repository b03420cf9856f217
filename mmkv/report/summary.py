"""From measured pairs to the numbers a paper prints: per (model, codec preset), min / mean / max of each metric
across items, measured KV× and effective bits, windowed means and per-frame curves; then the Table-3-shaped tables.

Aggregation is order-free (values are sorted by item before any sum), so a run split over torchrun shards, or over
several run folders, gives exactly the report of the same run unsplit. Codecs are ranked on equal footing: within a
model, every statistic is taken over the items that every codec has; where codecs cover different items, the ones
left out are named in the tables' notes, in csv/json columns and as a problem line (and where no item is common to
all codecs, each codec's own items are used and nothing is ranked).

Where prompts are procedural captions, each cell also holds the adherence and consistency (audio: adherence and
onset agreement with the reference) of its rollouts (`mmkv.report.adherence`), and the reference, scored the same
way, gets a row of its own that is never ranked.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmkv.codecs.config import CodecError, split_preset
from mmkv.codecs.registry import display_name, get_codec_class, table_order
from mmkv.metrics.video import DEFAULT_FPS, psnr_from_mse, windowed_means
from mmkv.report.adherence import ONSET_TOLERANCE_S
from mmkv.report.runs import REFERENCE, Measured
from mmkv.report.tables import Column, Table


@dataclass(frozen=True)
class MetricSpec:
    key: str
    label: str
    better: str  # "lower" or "higher"
    digits: int
    fmt: str | None = None  # text format of a value; default: `digits` decimals

    @property
    def header(self) -> str:
        return self.label + ("↓" if self.better == "lower" else "↑")

    @property
    def format(self) -> str:
        return self.fmt or "{:.%df}" % self.digits


METRICS = {
    "lpips": MetricSpec("lpips", "LPIPS", "lower", 3),
    "psnr": MetricSpec("psnr", "PSNR", "higher", 1),
    "psnr_frame_mean": MetricSpec("psnr_frame_mean", "PSNR(frame mean)", "higher", 1),
    "ssim": MetricSpec("ssim", "SSIM", "higher", 3),
    "latent_cosine": MetricSpec("latent_cosine", "cos", "higher", 4),
    "lsd_db": MetricSpec("lsd_db", "LSD", "lower", 2),
    "snr_db": MetricSpec("snr_db", "SNR", "higher", 1),
    "log_mel_mse": MetricSpec("log_mel_mse", "mel MSE", "lower", 3),
    "token_agreement": MetricSpec("token_agreement", "tokens=", "higher", 3),
    # Of each rollout alone (mmkv.report.adherence), where the prompts are procedural captions; shown in percent.
    "adherence": MetricSpec("adherence", "adherence", "higher", 2, "{:.0%}"),
    "consistency": MetricSpec("consistency", "consistency", "higher", 2, "{:.0%}"),
    # Audio: a codec rollout's onsets against its reference's (the reference's own row shows –).
    "onset_match": MetricSpec("onset_match", "onsets≈", "higher", 2, "{:.0%}"),
    "onset_error_ms": MetricSpec("onset_error_ms", "onset Δms", "lower", 1),
}
ADHERENCE_METRICS = {"video": ("adherence", "consistency"), "audio": ("adherence", "onset_match", "onset_error_ms")}
DEFAULT_METRICS = {"video": ("lpips", "psnr", "ssim", "latent_cosine") + ADHERENCE_METRICS["video"],
                   "audio": ("lsd_db", "snr_db", "log_mel_mse", "latent_cosine") + ADHERENCE_METRICS["audio"]}
# Per block after block 1 of a procedural clip: whether it matches block 1 (share of items), its background's PSNR.
BLOCK_METRICS = {"consistency": METRICS["consistency"],
                 "background_psnr": MetricSpec("background_psnr", "background PSNR", "higher", 1)}
WINDOW_METRICS = ("lpips", "psnr", "ssim")
CURVE_METRICS = ("lpips", "psnr", "ssim")

def parse_preset(preset: str) -> tuple[str, dict[str, str]]:
    """`name:k=v,...` (or `K/V` with two such parts) -> (name, params); V's params get a `v.` prefix."""
    names, params = [], {}
    for n, part in enumerate(str(preset).split("/", 1)):
        name, items = split_preset(part)
        names.append(name)
        params.update((("v." if n else "") + k, v) for k, v in items)
    return "/".join(names), params


def width_keys(name: str) -> list[str]:
    """The parameter keys that spell the nominal width of a `K` or `K/V` preset's key codec (`b`, `bits`)."""
    try:
        return get_codec_class(name.split("/")[0]).config_class.spellings("bits")
    except CodecError:  # a codec this version does not know: the usual spellings
        return ["b", "bits"]


def codec_display(name: str) -> str:
    return "/".join(display_name(n) for n in name.split("/"))


def _codec_rank(name: str) -> tuple:
    """Registered codecs in the registry's table order (baselines first), others after, by name."""
    order = table_order()
    first = name.split("/")[0]
    return (order.index(first) if first in order else len(order), name)


# ----------------------------------------------------------------------------------------------------------------
# Data model


@dataclass
class Group:
    key: tuple
    kind: str
    model: str
    residual_window: Any
    label: str = ""
    fps: float = DEFAULT_FPS
    lpips_trunks: set = field(default_factory=set)
    common_items: list[str] = field(default_factory=list)  # the items every codec of the group has
    uneven: bool = False  # codecs measured different items
    comparable: bool = True  # False: no item common to all codecs; values are over each codec's own items
    scored_items: list[str] = field(default_factory=list)  # items with a procedural caption (adherence scored)
    unscored_items: list[str] = field(default_factory=list)  # items with any other prompt

    @property
    def random_lpips(self) -> bool:
        return any(t.startswith("random") for t in self.lpips_trunks)


@dataclass
class Row:
    preset: str
    codec: str
    bits: float | None
    label: str = ""


@dataclass
class Cell:
    """One (group, preset): the items compared and what they measured."""

    items: list[str]  # the items its statistics are over
    values: dict[str, list[float]]  # metric -> per-item values (item order)
    kv_ratio: float | None
    effective_bits: float | None
    snr_at_cap: float | None = None
    windows: list[dict] = field(default_factory=list)  # [{"label", "start_s", "end_s", metric: mean over items}]
    curves: dict[str, np.ndarray] = field(default_factory=dict)  # metric -> per-frame mean over items
    left_out: list[str] = field(default_factory=list)  # measured items not in the group's common set
    blocks: list[dict] = field(default_factory=list)  # [{"label", "first_frame", "end_frame", block metric: mean}]

    @property
    def n(self) -> int:
        return len(self.items)

    def stat(self, metric: str) -> tuple[float, float, float] | None:
        v = [x for x in self.values.get(metric, []) if x is not None and not math.isnan(x)]
        if not v:
            return None
        a = np.asarray(v, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            return float(a.min()), float(a.mean()), float(a.max())


@dataclass
class Summary:
    groups: list[Group]
    rows: list[Row]
    cells: dict[tuple, Cell]  # (group key, preset) -> Cell
    measured: list[Measured]
    problems: list[str] = field(default_factory=list)  # codecs compared over different items
    adherence: Any = None  # mmkv.report.adherence.Scores of the rollouts, or None

    def score(self, g: Group, item: str, variant: str) -> dict | None:
        """Adherence score of one rollout (the reference's variant is "reference"), or None."""
        return None if self.adherence is None else self.adherence.by_rollout.get((g.key, item, variant))

    def cell(self, g: Group, r: Row) -> Cell | None:
        return self.cells.get((g.key, r.preset))


def _mean(values) -> float | None:
    v = [float(x) for x in values if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def summarize(measured: list[Measured], *, window_edges_s=None, adherence=None) -> Summary:
    """Cells of every (group, codec preset) over the items all its codecs have. `adherence`
    (`mmkv.report.adherence.Scores`) adds adherence and consistency (audio: adherence and onset agreement) to every
    cell, and a reference row (whose rollouts are scored too) to each group with a procedural caption."""
    by_cell: dict[tuple, list[Measured]] = {}
    groups: dict[tuple, Group] = {}
    rows: dict[str, Row] = {}
    for m in measured:
        t = m.test
        g = groups.setdefault(t.group_key, Group(t.group_key, t.kind, t.model, t.info.get("residual_window")))
        trunk = m.metrics.get("config", {}).get("lpips_trunk")
        if t.kind == "video" and trunk:
            g.lpips_trunks.add(trunk)
        g.fps = float(t.info.get("fps") or m.metrics.get("fps") or DEFAULT_FPS)
        name, _ = parse_preset(t.preset)
        rows.setdefault(t.preset, Row(t.preset, name, t.bits))
        by_cell.setdefault((t.group_key, t.preset), []).append(m)

    group_list = sorted(groups.values(), key=lambda g: (g.kind != "video", g.model, str(g.residual_window)))
    models = [g.model for g in group_list]
    for g in group_list:
        base = Path(g.model).name if ("/" in g.model or "\\" in g.model) else g.model
        g.label = base if models.count(g.model) == 1 else f"{base} (window {g.residual_window})"
    row_list = sorted(rows.values(), key=lambda r: (r.bits is not None, -(r.bits or 0), _codec_rank(r.codec),
                                                    r.preset))
    _label_rows(row_list)

    cells = {}
    problems = []
    for g in group_list:
        mine = {r.preset: sorted(by_cell[g.key, r.preset], key=lambda m: m.test.sort_key) for r in row_list
                if (g.key, r.preset) in by_cell}
        covered = {p: {m.test.item for m in ms} for p, ms in mine.items()}
        common = set.intersection(*covered.values())
        order = {m.test.item: m.test.sort_key for ms in mine.values() for m in ms}
        g.common_items = sorted(common, key=order.get)
        g.uneven = len({frozenset(c) for c in covered.values()}) > 1
        g.comparable = bool(common) or len(mine) == 1
        for preset, ms in mine.items():
            used = [m for m in ms if m.test.item in common] if common else ms
            cells[g.key, preset] = _cell(used, g, window_edges_s)
            cells[g.key, preset].left_out = [m.test.item for m in ms if common and m.test.item not in common]
            if adherence is not None:
                _add_adherence(cells[g.key, preset], [adherence.get(m.test) for m in used], g.kind)
        if g.uneven:
            problems.append(_uneven_line(g, [r for r in row_list if r.preset in mine], covered))
        if adherence is not None:
            refs = {m.test.item: m.ref for ms in mine.values() for m in ms}
            items = g.common_items or sorted(refs, key=order.get)
            g.scored_items = [i for i in items if i in adherence.procedural.get(g.key, ())]
            g.unscored_items = [i for i in items if i in adherence.other.get(g.key, ())]
            ref = Cell(items=items, values={}, kv_ratio=_mean(refs[i].info.get("kv_ratio") for i in items),
                       effective_bits=_mean(refs[i].info.get("effective_bits") for i in items),
                       left_out=[i for i in sorted(refs, key=order.get) if i not in items])
            if _add_adherence(ref, [adherence.get(refs[i]) for i in items], g.kind):
                cells[g.key, REFERENCE] = ref
    if any(k[1] == REFERENCE for k in cells):
        row_list.insert(0, Row(REFERENCE, REFERENCE, None, label=REFERENCE))
    return Summary(group_list, row_list, cells, measured, problems, adherence)


def _add_adherence(cell: Cell, scores: list[dict | None], kind: str) -> bool:
    """Adds the per-item adherence scores of a cell's rollouts (None: not a procedural caption, or not scored) and,
    for video, the per-block means over items; False when none of them is scored."""
    if not any(scores):
        return False
    for key in ADHERENCE_METRICS[kind]:
        cell.values[key] = [None if sc is None else sc[key] for sc in scores]
    blocks: dict[str, dict] = {}
    for sc in scores:
        for b in sc.get("blocks", []) if sc else []:
            e = blocks.setdefault(b["label"], {"label": b["label"], "first_frame": b["first_frame"],
                                               "end_frame": b["end_frame"], "match": [], "background_psnr": []})
            e["match"].append(b["match"])
            e["background_psnr"].append(b["background_psnr"])
    for e in sorted(blocks.values(), key=lambda e: e["first_frame"]):
        matches = [float(x) for x in e.pop("match") if x is not None]
        psnrs = [x for x in e.pop("background_psnr") if x is not None]
        cell.blocks.append({**e, "consistency": float(np.mean(matches)) if matches else None,
                            "background_psnr": float(np.mean(psnrs)) if psnrs else None, "n_items": len(matches)})
    return True


def _uneven_line(g: Group, rows: list[Row], covered: dict[str, set]) -> str:
    """One line: which codec lacks which items, and what the statistics are over instead."""
    everything = set().union(*covered.values())
    gaps = "; ".join(f"{r.label}{'' if r.bits is None else f' (b={r.bits:g})'} lacks "
                     f"{', '.join(sorted(everything - covered[r.preset]))}"
                     for r in rows if everything - covered[r.preset])
    ns = ", ".join(str(len(covered[r.preset])) for r in rows)
    if g.comparable:
        return (f"{g.label}: codecs measured different items (n = {ns}): {gaps}; every statistic uses only the "
                f"{len(g.common_items)} item(s) all have ({', '.join(g.common_items)})")
    return (f"{g.label}: codecs measured different items (n = {ns}) and no item is common to all: {gaps}; each "
            "codec's statistics are over its own items, not comparable, and not ranked")


def _label_rows(rows: list[Row]) -> None:
    """Codec display name; parameters are added only where two presets of one codec share a bit width."""
    by = {}
    for r in rows:
        by.setdefault((r.bits, r.codec), []).append(r)
    for (_, codec), rs in by.items():
        if len(rs) == 1:
            rs[0].label = codec_display(codec)
            continue
        params = [parse_preset(r.preset)[1] for r in rs]
        keys = sorted({k for p in params for k in p if k not in width_keys(codec)})
        differ = [k for k in keys if len({p.get(k) for p in params}) > 1]
        for r, p in zip(rs, params):
            extra = ",".join(f"{k}={p.get(k, '-')}" for k in differ)
            r.label = codec_display(codec) + (f" ({extra})" if extra else "")


def _cell(ms: list[Measured], g: Group, window_edges_s) -> Cell:
    values: dict[str, list[float]] = {}
    for m in ms:
        for k, v in m.metrics["summary"].items():
            if k in METRICS:
                values.setdefault(k, []).append(_num(v) if v is not None else None)
    cell = Cell(items=[m.test.item for m in ms], values=values,
                kv_ratio=_mean(m.test.info.get("kv_ratio") for m in ms),
                effective_bits=_mean(m.test.info.get("effective_bits") for m in ms))
    if g.kind == "audio":
        caps = [bool(m.metrics["summary"].get("snr_at_cap")) for m in ms if m.metrics["summary"].get("snr_db")
                is not None and not math.isnan(m.metrics["summary"]["snr_db"])]
        cell.snr_at_cap = sum(caps) / len(caps) if caps else None
        return cell
    # Video: windows per item (means of per-frame values), then the mean over items; per-frame curves.
    per_item = [windowed_means(m.metrics["per_frame"], g.fps, window_edges_s) for m in ms]
    labels: dict[str, dict] = {}
    for wins in per_item:
        for w in wins:
            labels.setdefault(w["label"], {"label": w["label"], "start_s": w["start_s"], "end_s": w["end_s"]})
    for label, w in sorted(labels.items(), key=lambda kv: kv[1]["start_s"]):
        entry = dict(w)
        for metric in WINDOW_METRICS + ("psnr_frame_mean",):
            vals = [x[metric] for wins in per_item for x in wins if x["label"] == label and metric in x]
            entry[metric] = float(np.mean(vals)) if vals else None
        entry["n_items"] = sum(1 for wins in per_item if any(x["label"] == label for x in wins))
        cell.windows.append(entry)
    n = max(len(m.metrics["per_frame"]["mse"]) for m in ms)
    stack = {}
    for metric in ("mse", "ssim", "lpips"):
        rowsv = [m.metrics["per_frame"].get(metric) for m in ms]
        if any(r is None for r in rowsv):
            continue
        a = np.full((len(rowsv), n), np.nan)
        for i, r in enumerate(rowsv):
            a[i, : len(r)] = r
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a frame no item reaches stays NaN
            stack[metric] = np.nanmean(a, axis=0)
    if "mse" in stack:
        # PSNR per frame across items from the pooled MSE: finite unless every item's frame is identical.
        cell.curves["psnr"] = np.asarray(psnr_from_mse(stack.pop("mse")), dtype=np.float64)
    cell.curves.update(stack)
    cell.curves["time_s"] = np.arange(n) / g.fps
    return cell


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
        "b: nominal bits of the preset; KV×: bf16 KV bytes / bytes really stored; bits: measured effective bits per "
        "KV element (payload, side information and native residual window).",
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
                  "marked): how well the model itself follows the captions."]
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
    """Windowed means (issue 7): μ over items of each video's mean over [a, b) seconds, per metric and window."""
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
