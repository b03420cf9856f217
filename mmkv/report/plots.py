"""Rate–quality plots (each metric against measured effective bits, a line per codec) and per-frame curves (each
video metric against time, a line per codec, a panel per bit width), as PNG through matplotlib's Agg canvas.

Figures are built with `matplotlib.figure.Figure` + `FigureCanvasAgg`, never pyplot: no global backend switch, no
figure registry, nothing left open.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from mmkv.report.summary import (CURVE_METRICS, DEFAULT_METRICS, LPIPS_NOTE, METRICS, Summary, codec_display,
                                 metric_label, parse_preset, width_keys)

DPI = 120


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", str(text)).strip("_").lower() or "x"


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _footnote(fig, key: str, random_lpips: bool) -> None:
    """The dagger's meaning under a figure whose LPIPS came from the random trunk."""
    if key == "lpips" and random_lpips:
        fig.supxlabel(LPIPS_NOTE, fontsize=7, color="0.3")


def _series(s: Summary) -> dict[str, list]:
    """Rows grouped into lines: the same preset except for its bit width."""
    out: dict[str, list] = {}
    for r in s.rows:
        name, params = parse_preset(r.preset)
        widths = {*width_keys(name), *(f"v.{k}" for k in width_keys(name.split("/")[-1]))}
        rest = ",".join(f"{k}={v}" for k, v in sorted(params.items()) if k not in widths)
        out.setdefault(f"{name}:{rest}", []).append(r)
    # Label a line by its codec; add its other parameters only where two lines share the codec.
    names = [k.split(":", 1)[0] for k in out]
    labelled = {}
    for key, rows in out.items():
        name, rest = key.split(":", 1)
        labelled[codec_display(name) + (f" ({rest})" if names.count(name) > 1 and rest else "")] = rows
    return labelled


def rate_quality(s: Summary, out_dir: Path, metrics: dict | None = None) -> list[Path]:
    """One PNG per (model, metric): mean across items against effective bits, min–max as error bars."""
    metrics = metrics or DEFAULT_METRICS
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    series = _series(s)
    for g in s.groups:
        for key in metrics.get(g.kind, ()):
            spec = METRICS[key]
            fig = _figure(5.6, 3.8)
            ax = fig.add_subplot()
            drawn = 0
            for label, rows in series.items():
                pts = []
                for r in rows:
                    c = s.cell(g, r)
                    st = c.stat(key) if c else None
                    if c is None or st is None or c.effective_bits is None or not all(map(math.isfinite, st)):
                        continue  # identical rollouts (PSNR = inf) have no place on a finite axis
                    pts.append((c.effective_bits, *st))
                if not pts:
                    continue
                pts.sort()
                x, lo, mean, hi = (np.array(v) for v in zip(*pts))
                ax.errorbar(x, mean, yerr=[mean - lo, hi - mean], marker="o", capsize=3, lw=1.4, label=label)
                drawn += 1
            if not drawn:
                continue
            label = metric_label(key, g.random_lpips)
            ax.set_xlabel("effective bits per KV element (measured)")
            ax.set_ylabel(f"{label} ({spec.better} is better)")
            ax.set_title(f"{g.label}: {label} vs rate (mean, min–max over items)", fontsize=9)
            _footnote(fig, key, g.random_lpips)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            path = out_dir / f"rate_{slug(g.label)}_{key}.png"
            fig.savefig(path, dpi=DPI)
            paths.append(path)
    return paths


def frame_curves(s: Summary, out_dir: Path) -> list[Path]:
    """One PNG per (video model, metric): per-frame mean over items against time, a panel per bit width, window
    edges dotted. PSNR per frame is the PSNR of the MSE pooled over items."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for g in (g for g in s.groups if g.kind == "video"):
        blocks: list = []
        for r in s.rows:
            if s.cell(g, r) is not None and r.bits not in blocks:
                blocks.append(r.bits)
        for key in CURVE_METRICS:
            if not any((c := s.cell(g, r)) is not None and key in c.curves for r in s.rows):
                continue
            spec = METRICS[key]

            def finite(r) -> bool:
                c = s.cell(g, r)
                return c is not None and key in c.curves and bool(np.isfinite(c.curves[key]).any())

            # A codec identical to the reference at every frame (PSNR inf) has no curve: name it instead of
            # drawing an empty panel.
            identical = [r.label for r in s.rows if s.cell(g, r) is not None and key in s.cell(g, r).curves
                         and not finite(r)]
            panels = [b for b in blocks if any(finite(r) for r in s.rows if r.bits == b)]
            if not panels:
                continue
            fig = _figure(max(4.6, 3.6 * len(panels)), 3.4)
            axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
            for ax, bits in zip(axes, panels):
                edges = set()
                for r in (r for r in s.rows if r.bits == bits):
                    c = s.cell(g, r)
                    if c is None or key not in c.curves:
                        continue
                    x, y = c.curves["time_s"], c.curves[key]
                    ok = np.isfinite(y)
                    ax.plot(x[ok], y[ok], lw=1.2, label=r.label)
                    edges.update(w["start_s"] for w in c.windows if w["start_s"] > 0)
                for e in sorted(edges):
                    ax.axvline(e, color="0.6", lw=0.8, ls=":")
                ax.set_title("unquantised / other" if bits is None else f"b = {bits:g}", fontsize=9)
                ax.set_xlabel("time (s)")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            label = metric_label(key, g.random_lpips)
            axes[0].set_ylabel(f"{label} ({spec.better} is better)")
            note = f"\n(identical to the reference at every frame: {', '.join(identical)})" if identical else ""
            fig.suptitle(f"{g.label}: per-frame {label}, mean over items{note}", fontsize=10)
            _footnote(fig, key, g.random_lpips)
            path = out_dir / f"frames_{slug(g.label)}_{key}.png"
            fig.savefig(path, dpi=DPI)
            paths.append(path)
    return paths
