"""The report's data model and its aggregation: per (model, codec preset), min / mean / max of each metric across
items, measured KV× and effective bits, windowed means and per-frame curves (`summarize`); the tables are drawn from
it in `mmkv.report.summary`.

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
from mmkv.report.measure import Measured
from mmkv.report.runs import REFERENCE


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
    # Video: a codec rollout's attribute checks against its reference's (the reference's own row shows –).
    "attribute_match": MetricSpec("attribute_match", "checks=ref", "higher", 2, "{:.0%}"),
    # Audio: a codec rollout's onsets against its reference's (the reference's own row shows –).
    "onset_match": MetricSpec("onset_match", "onsets≈", "higher", 2, "{:.0%}"),
    "onset_error_ms": MetricSpec("onset_error_ms", "onset Δms", "lower", 1),
}
ADHERENCE_METRICS = {"video": ("adherence", "consistency", "attribute_match"),
                     "audio": ("adherence", "onset_match", "onset_error_ms")}
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
