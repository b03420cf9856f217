"""Output of `mmkv bench synthetic`: the paper-style tables, Markdown, JSON, CSV and the plot of its rows."""

from __future__ import annotations

import json
from pathlib import Path

from mmkv.codecs.registry import get_codec_class, names

from mmkv.bench.synthetic_probe import ROW_FIELDS, Protocol

# ----------------------------------------------------------------------------------------------------------------
# Output


# (field, header, format) of every row field; `show=False` fields go to CSV/JSON only.
_COLUMNS: dict[str, tuple[str, str]] = {
    "section": ("section", "{}"), "codec": ("codec", "{}"), "config": ("config", "{}"), "bits": ("b", "{}"),
    "effective_bits": ("eff. bits", "{:.3f}"), "mse": ("MSE", "{:.4f}"), "mse_se": ("MSE s.e.", "{:.1e}"),
    "cosine": ("cosine", "{:.4f}"), "ip_error": ("IP error", "{:.3f}"), "ip_error_se": ("IP s.e.", "{:.1e}"),
    "ip_bias": ("IP bias", "{:+.3f}"), "needle_mass": ("needle", "{:.3f}"), "needle_mass_se": ("needle s.e.", "{:.1e}"),
    "dim": ("d", "{}"), "seeds": ("seeds", "{}"), "needle_seeds": ("needle seeds", "{}"), "delta": ("δ", "{:+d}"),
    "b_dir": ("b_dir", "{}"), "b_nrm": ("b_nrm", "{}"), "matches": ("matches", "{}"),
}


def _table(name: str, title: str, rows: list[dict], shown: list[str], notes: list[str] | None = None):
    from mmkv.report.tables import Column, Table

    fields = shown + [f for f in ROW_FIELDS if f not in shown]
    columns = [Column(f, (_COLUMNS[f][0],), _COLUMNS[f][1], show=f in shown) for f in fields]
    return Table(name, title, columns, [[r.get(f) for f in fields] for r in rows], notes=list(notes or []))


def tables(rows: list[dict], p: Protocol, notes: list[str] | None = None) -> list:
    """The report tables (`mmkv.report.tables.Table`): matched nominal b, the App. D sweep, the iso-rate rows."""
    main = ["codec", "config", "bits", "effective_bits", "mse", "cosine", "ip_error", "needle_mass"]
    t1 = sorted((r for r in rows if r["section"] == "table1"),
                key=lambda r: (r["codec"] != "fp32", r["bits"] is None, r["bits"] or 0, r["codec"], r["config"]))
    out = [_table(
        "synthetic", f"Synthetic probe (OCTOPUS 4.1), d={p.dim}: {p.keys} N(0,I) keys x {p.queries} queries x "
        f"{p.seeds} seeds; needle: 1 in T={p.needle_tokens} distractors x {p.needle_seeds} seeds", t1, main,
        ["eff. bits: measured from the stored bytes, side information included.",
         "IP error: mean |q.k - score| with the codec's own estimator; needle: softmax mass on the needle."]
        + [f"{n}: a span codec; its per-span tables are amortised over one seed's {p.keys} keys ({p.needle_tokens + 1} "
           f"in the needle), not over the longer spans it is designed for" for n in sorted(
               {r["codec"] for r in t1 if r["codec"] in names() and get_codec_class(r["codec"]).span_codec})]
        + list(notes or []))]
    sw = [r for r in rows if r["section"] == "sweep"]
    if sw:
        out.append(_table("synthetic_sweep", "OCTOPUS bit-allocation sweep (App. D): (b_dir, b_nrm) = (b+δ, b-δ), "
                          "no joint rounding; the rate moves with δ", sw,
                          ["bits", "delta", "b_dir", "b_nrm", "effective_bits", "mse", "cosine", "ip_error"]))
    iso = [r for r in rows if r["section"] == "iso-rate"]
    if iso:
        title = "Iso-rate: TurboQuant-MSE with `hi` channels at b+1 bits"
        if any(r["codec"] == "tcq" for r in iso):
            title += ", TCQ with `hi` trellis steps at 2b+1 bits"
        out.append(_table("synthetic_iso_rate", f"{title}, at each OCTOPUS point's effective bits", iso,
                          ["bits", "matches", "config", "effective_bits", "mse", "cosine", "ip_error", "needle_mass"]))
    return out


def render_markdown(rows: list[dict], p: Protocol, seconds: float | None = None, notes: list[str] | None = None) -> str:
    from mmkv.report.tables import to_markdown

    text = "\n".join(to_markdown(t) for t in tables(rows, p, notes))
    if seconds is not None:
        text += f"\nRuntime: {seconds:.1f} s\n"
    return text


def write_json(rows: list[dict], path: Path) -> None:
    """A JSON list of rows (every `ROW_FIELDS` key; non-finite numbers as strings, the table writer's convention)."""
    from mmkv.io import atomic_write_text
    from mmkv.report.tables import to_dict

    records = to_dict(_table("synthetic_all", "all rows", rows, list(ROW_FIELDS)))["rows"]
    atomic_write_text(path, json.dumps(records, indent=1, ensure_ascii=False) + "\n")


def write_csv(rows: list[dict], path: Path) -> None:
    """All rows in one CSV, columns `ROW_FIELDS`."""
    from mmkv.io import atomic_write_text
    from mmkv.report.tables import to_csv

    atomic_write_text(path, to_csv(_table("synthetic_all", "all rows", rows, list(ROW_FIELDS))))


def write_plot(rows: list[dict], path: Path, p: Protocol) -> None:
    """MSE (log) and needle mass against measured effective bits, one series per codec (and per section)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmkv.io import atomic_path

    fig, (ax_m, ax_n) = plt.subplots(1, 2, figsize=(13, 5.2))
    series: dict[str, list[dict]] = {}
    for r in rows:
        if r["codec"] == "fp32":
            continue
        label = r["codec"] if r["section"] == "table1" else f"{r['codec']} ({r['section']})"
        if r["codec"] == "octopus" and r["section"] == "table1":
            label = "octopus joint" if "joint=1" in r["config"] else "octopus"
        series.setdefault(label, []).append(r)
    colors = plt.get_cmap("tab20").colors
    for i, (label, rs) in enumerate(sorted(series.items())):
        style = dict(color=colors[(2 * i) % 20 + (2 * i) // 20 % 2], marker="osD^v<>ph*"[i % 10], ms=4,
                     ls="--" if "iso-rate" in label else "-")
        # A sweep is one curve per b (delta runs along it); everything else one curve along its bits.
        groups = [[r for r in rs if r["bits"] == b] for b in sorted({r["bits"] for r in rs})] if "sweep" in label \
            else [rs]
        if "sweep" in label:
            style["ls"] = ":"
        for j, g in enumerate(groups):
            g = sorted(g, key=lambda r: r["effective_bits"])
            kw = dict(style, label=label if j == 0 else None)
            ax_m.plot([r["effective_bits"] for r in g], [max(r["mse"], 1e-12) for r in g], **kw)
            nd = [r for r in g if r["needle_mass"] is not None]
            if nd:
                ax_n.plot([r["effective_bits"] for r in nd], [r["needle_mass"] for r in nd], **kw)
    fp32 = [r for r in rows if r["codec"] == "fp32"]
    if fp32:
        ax_n.axhline(fp32[0]["needle_mass"], color="k", lw=0.8, ls="--", label="fp32")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("MSE  ||k - k_hat||^2 / ||k||^2")
    ax_n.set_ylabel("softmax mass on the needle")
    ax_m.set_title(f"reconstruction, d={p.dim}, {p.seeds} seeds")
    ax_n.set_title(f"needle, T={p.needle_tokens}, {p.needle_seeds} seeds")
    for ax in (ax_m, ax_n):
        ax.set_xlabel("effective bits per coordinate (measured)")
        ax.grid(alpha=0.3)
    ax_m.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format=(path.suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)
