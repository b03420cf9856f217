"""The static HTML report: for each model, a grid with a row per item (prompt or clip) and a column per variant —
the reference first, then every codec in table order — with the video (or audio) player and the metric values
under each; then the tables and the plots.

Players point at the run folders' own mp4 / wav files by relative path (nothing is copied). Each video gets a poster
still (its last frame, where autoregressive drift is largest) and each clip a log-mel picture, both made from the
lossless outputs and written under `OUT/stills/`, so the page shows the grid before anything plays.
"""

from __future__ import annotations

import html
import math
import os
from importlib import resources
from pathlib import Path
from string import Template
from urllib.parse import quote

import numpy as np

from mmkv.report.plots import slug
from mmkv.io import atomic_write_text
from mmkv.report.runs import REFERENCE, Rollout, RunSet
from mmkv.report.summary import ADHERENCE_METRICS, LPIPS_NOTE, METRICS, Summary, metric_label

STILL_WIDTH = 320  # px; posters are area-averaged down to at most this width
CAPTION_METRICS = {"video": ("lpips", "psnr", "ssim"), "audio": ("lsd_db", "snr_db", "log_mel_mse")}
SPEC_RANGE = (-5.0, 2.0)  # log10 mel range shown (the 1e-5 floor up to loud content)
# Against the reference: nothing to say on the reference itself.
AGAINST_REFERENCE = ("attribute_match", "onset_match", "onset_error_ms")


def _url(path: Path, base: Path) -> str:
    return "/".join(quote(p) for p in Path(os.path.relpath(path, base)).parts)


def _fresh(target: Path, source: Path) -> bool:
    return target.is_file() and target.stat().st_mtime_ns >= source.stat().st_mtime_ns


def _downscale(frame: np.ndarray, width: int = STILL_WIDTH) -> np.ndarray:
    f = max(1, math.ceil(frame.shape[1] / width))
    h, w = frame.shape[0] // f * f, frame.shape[1] // f * f
    x = frame[:h, :w].reshape(h // f, f, w // f, f, 3).astype(np.float64).mean(axis=(1, 3))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def _video_still(r: Rollout, target: Path) -> bool:
    import imageio.v3 as iio

    src = r.file("frames")
    if src is None:
        return False
    if not _fresh(target, src):
        frames = np.load(src, mmap_mode="r", allow_pickle=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        iio.imwrite(target, _downscale(np.asarray(frames[-1])), extension=".png")
    return True


def _audio_still(r: Rollout, target: Path) -> bool:
    import imageio.v3 as iio
    import soundfile as sf
    from matplotlib import colormaps

    from mmkv.metrics import log_mel

    src = r.file("audio")
    if src is None:
        return False
    if not _fresh(target, src):
        data, sr = sf.read(str(src), dtype="float64", always_2d=False)
        mel = log_mel(data, sr)[0].numpy()[::-1]  # first channel, low frequencies at the bottom
        lo, hi = SPEC_RANGE
        rgba = colormaps["magma"](np.clip((mel - lo) / (hi - lo), 0, 1))
        target.parent.mkdir(parents=True, exist_ok=True)
        iio.imwrite(target, (rgba[..., :3] * 255).astype(np.uint8), extension=".png")
    return True


def _fmt_metric(key: str, v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return METRICS[key].format.format(v)


def _cell(r: Rollout | None, label: str, metrics: dict | None, kind: str, out: Path, still: Path,
          score: dict | None = None) -> str:
    if r is None:
        return (f'<figure class="cell missing"><div class="ph">missing</div><figcaption><span class="name">'
                f"{html.escape(label)}</span></figcaption></figure>")
    parts = []
    if kind == "video":
        has_still = _video_still(r, still)
        poster = f' poster="{_url(still, out)}"' if has_still else ""
        mp4 = r.file("video")
        if mp4 is not None:
            parts.append(f'<video class="clip" preload="none" muted loop playsinline controls{poster} '
                         f'src="{_url(mp4, out)}"></video>')
        elif has_still:
            parts.append(f'<img class="still" alt="last frame" src="{_url(still, out)}">')
    else:
        if _audio_still(r, still):
            parts.append(f'<img class="spec" alt="log-mel spectrogram" src="{_url(still, out)}">')
        wav = r.file("audio")
        if wav is not None:
            parts.append(f'<audio controls preload="none" src="{_url(wav, out)}"></audio>')
    if metrics is not None:
        s = metrics["summary"]
        random = str(metrics.get("config", {}).get("lpips_trunk") or "").startswith("random")
        line = " · ".join(f"{metric_label(k, random)} {_fmt_metric(k, s.get(k))}" for k in CAPTION_METRICS[kind]
                          if k in s)
    elif r.is_reference:
        line = "native cache (reference)"
    else:
        line = "not measured"
    if score is not None:  # a procedural caption: adherence of this rollout alone, the reference's too
        keys = [k for k in ADHERENCE_METRICS[kind] if not (r.is_reference and k in AGAINST_REFERENCE)]
        line += " · " + " · ".join(f"{METRICS[k].label} {_fmt_metric(k, score.get(k))}" for k in keys)
    cls = "cell reference" if r.is_reference else "cell"
    return (f'<figure class="{cls}" data-variant="{html.escape(r.variant)}">{"".join(parts)}<figcaption>'
            f'<span class="name">{html.escape(label)}</span><span class="m">{html.escape(line)}</span>'
            "</figcaption></figure>")


def gallery_sections(s: Summary, rs: RunSet, out: Path, max_items: int | None = None) -> str:
    measured = {(m.test.group_key, m.test.item, m.test.preset): m for m in s.measured}
    sections = []
    for g in s.groups:
        rollouts = [r for r in rs.rollouts if r.group_key == g.key]
        by_item: dict[str, dict[str, Rollout]] = {}
        order: dict[str, tuple] = {}
        for r in rollouts:
            by_item.setdefault(r.item, {})[REFERENCE if r.is_reference else r.preset] = r
            order[r.item] = r.sort_key
        items = sorted(by_item, key=lambda i: order[i])[: max_items or None]
        rows = [r for r in s.rows if r.preset != REFERENCE  # the reference has its own column, first
                and (s.cell(g, r) is not None or any(r.preset in v for v in by_item.values()))]
        heads = ["reference"] + [r.label + ("" if r.bits is None else f" (b={r.bits:g})") for r in rows]
        gs = slug(g.label)
        out_rows = []
        for item in items:
            have = by_item[item]
            ref = have.get(REFERENCE)
            info = (ref or next(iter(have.values()))).info
            text = info.get("caption") or info.get("text") or ""  # an audio clip's caption, else its path
            cells = [f'<div class="rowhead"><b>{html.escape(item)}</b><p>{html.escape(str(text)[:300])}</p></div>',
                     _cell(ref, "reference", None, g.kind, out, out / "stills" / gs / item / f"{REFERENCE}.png",
                           s.score(g, item, REFERENCE))]
            for r, head in zip(rows, heads[1:]):
                t = have.get(r.preset)
                m = measured.get((g.key, item, r.preset))
                cells.append(_cell(t, head, m.metrics if m else None, g.kind, out,
                                   out / "stills" / gs / item / f"{t.variant if t else 'missing'}.png",
                                   s.score(g, item, t.variant) if t else None))
            out_rows.append(f'<div class="row" data-item="{html.escape(item)}">' + "".join(cells) + "</div>")
        cols = f"grid-template-columns: minmax(7rem, 12rem) repeat({len(heads)}, minmax(8rem, 1fr));"
        head_html = '<div class="row"><div></div>' + "".join(f'<div class="colhead">{html.escape(h)}</div>'
                                                               for h in heads) + "</div>"
        more = len(by_item) - len(items)
        note = f'<p class="sources">{more} more items not shown (--gallery-items)</p>' if more > 0 else ""
        if g.random_lpips:
            note += f'<p class="sources">{html.escape(LPIPS_NOTE)}.</p>'
        sections.append(f'<section class="gallery" id="gallery-{gs}"><h2>{html.escape(g.label)}</h2>'
                        f'<div class="grid" style="{cols}">{head_html}{"".join(out_rows)}</div>{note}</section>')
    return "\n".join(sections)


def write_report(out: Path, s: Summary, rs: RunSet, tables_html: list[str], plots: list[Path],
                 problems: list[str], *, max_items: int | None = None, title: str = "mmkv report") -> Path:
    """Write OUT/index.html (and the stills it shows); returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    body = []
    if problems:
        body.append(f'<section class="problems"><h2>Problems ({len(problems)})</h2><ul>'
                    + "".join(f"<li>{html.escape(p)}</li>" for p in problems) + "</ul></section>")
    body.append(gallery_sections(s, rs, out, max_items))
    if tables_html:
        body.append('<section class="tables"><h2>Tables</h2>' + "\n".join(tables_html) + "</section>")
    if plots:
        body.append('<section class="plots"><h2>Plots</h2>' + "".join(
            f'<a href="{_url(p, out)}"><img alt="{html.escape(p.stem)}" src="{_url(p, out)}" width="560"></a>'
            for p in plots) + "</section>")
    template = Template(resources.files("mmkv.report").joinpath("templates", "report.html").read_text("utf-8"))
    page = template.substitute(title=html.escape(title),
                               sources=html.escape("runs: " + ", ".join(str(p) for p in rs.runs)),
                               body="\n".join(body))
    path = out / "index.html"
    atomic_write_text(path, page)
    return path
