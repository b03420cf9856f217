"""The one table writer: a `Table` (columns with multi-level headers, rows of raw values, best / runner-up marks)
rendered as Markdown, CSV, JSON, LaTeX (booktabs) or an HTML <table>.

Text formats (md, latex, html) show each column's formatted value and its mark; machine formats (csv, json) keep
full-precision values (non-finite as "inf" / "-inf" / "nan") and the mark as a rank (1 = best, 2 = runner-up).
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("md", "csv", "json", "latex", "html")
EXTENSIONS = {"md": "md", "csv": "csv", "json": "json", "latex": "tex", "html": "html"}
MISSING = "–"


@dataclass
class Column:
    key: str  # machine name (csv header, json key)
    header: tuple[str, ...]  # header levels, top to bottom; equal neighbours merge in latex/html
    fmt: str = "{}"  # format for text outputs
    better: str | None = None  # "lower" / "higher": mark best and runner-up of this column within each block
    show: bool = True  # False: only in csv/json


@dataclass
class Table:
    name: str
    title: str
    columns: list[Column]
    rows: list[list[Any]]
    block: str | None = None  # key of the column whose value change starts a new block (ranking scope, rules)
    notes: list[str] = field(default_factory=list)
    unranked: set[int] = field(default_factory=set)  # rows never marked, each a block of its own (the reference)

    def index(self, key: str) -> int:
        for i, c in enumerate(self.columns):
            if c.key == key:
                return i
        raise KeyError(key)

    def marks(self) -> list[list[str | None]]:
        """'best' / 'second' per cell: dense ranking of the displayed values within each block."""
        out: list[list[str | None]] = [[None] * len(self.columns) for _ in self.rows]
        blocks = self._blocks()
        for j, col in enumerate(self.columns):
            if col.better not in ("lower", "higher"):
                continue
            for rows in blocks:
                vals = {}
                for i in (i for i in rows if i not in self.unranked):
                    v = self.rows[i][j]
                    if _is_number(v) and not math.isnan(v):
                        vals[i] = _display_key(col, v)
                distinct = sorted(set(vals.values()), reverse=col.better == "higher")
                if len(vals) < 2:
                    continue
                for i, v in vals.items():
                    if v == distinct[0]:
                        out[i][j] = "best"
                    elif len(distinct) > 1 and v == distinct[1]:
                        out[i][j] = "second"
        return out

    def starts_block(self, i: int) -> bool:
        """Whether row i starts a new block (ranking scope; a rule above it in latex and html)."""
        if i == 0:
            return True
        if (i in self.unranked) != (i - 1 in self.unranked):
            return True
        if self.block is None:
            return False
        j = self.index(self.block)
        return self.rows[i][j] != self.rows[i - 1][j]

    def _blocks(self) -> list[list[int]]:
        blocks: list[list[int]] = []
        for i in range(len(self.rows)):
            if self.starts_block(i):
                blocks.append([])
            blocks[-1].append(i)
        return blocks


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _display_key(col: Column, v: float) -> float:
    # Rank what the reader sees: values equal after formatting tie.
    if math.isinf(v):
        return v
    try:
        return float(col.fmt.format(v).rstrip("×%").strip())
    except ValueError:
        return v


def format_value(col: Column, v: Any) -> str:
    if v is None:
        return MISSING
    if _is_number(v):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return col.fmt.format(v)
    return str(v)


def _machine(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


# ----------------------------------------------------------------------------------------------------------------
# Markdown


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(t: Table) -> str:
    cols = [j for j, c in enumerate(t.columns) if c.show]
    marks = t.marks()
    head = [" ".join(h for h in t.columns[j].header if h) for j in cols]
    lines = [f"**{_md_escape(t.title)}**", "", "| " + " | ".join(_md_escape(h) for h in head) + " |",
             "|" + "|".join("---" if _is_text_col(t, j) else "---:" for j in cols) + "|"]
    for i, row in enumerate(t.rows):
        cells = []
        for j in cols:
            s = _md_escape(format_value(t.columns[j], row[j]))
            if marks[i][j] == "best":
                s = f"**{s}**"
            elif marks[i][j] == "second":
                s = f"<u>{s}</u>"
            cells.append(s)
        lines.append("| " + " | ".join(cells) + " |")
    if t.notes:
        lines.append("")
        lines += [f"- {_md_escape(n)}" for n in t.notes]
    return "\n".join(lines) + "\n"


def _is_text_col(t: Table, j: int) -> bool:
    return not any(_is_number(r[j]) for r in t.rows)


# ----------------------------------------------------------------------------------------------------------------
# CSV and JSON


def to_csv(t: Table) -> str:
    marks = t.marks()
    ranked = [j for j, c in enumerate(t.columns) if c.better]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = []
    for j, c in enumerate(t.columns):
        header.append(c.key)
        if j in ranked:
            header.append(c.key + ":rank")
    w.writerow(header)
    for i, row in enumerate(t.rows):
        out = []
        for j, v in enumerate(row):
            out.append("" if v is None else _machine(v))
            if j in ranked:
                out.append({"best": 1, "second": 2}.get(marks[i][j], ""))
        w.writerow(out)
    return buf.getvalue()


def to_dict(t: Table) -> dict:
    marks = t.marks()
    rows = []
    for i, row in enumerate(t.rows):
        rec = {c.key: _machine(v) for c, v in zip(t.columns, row)}
        ranks = {c.key: {"best": 1, "second": 2}[m] for c, m in zip(t.columns, marks[i]) if m}
        if ranks:
            rec["rank"] = ranks
        rows.append(rec)
    return {
        "name": t.name,
        "title": t.title,
        "columns": [{"key": c.key, "header": list(c.header), "better": c.better} for c in t.columns],
        "rows": rows,
        "notes": list(t.notes),
    }


def to_json(t: Table) -> str:
    return json.dumps(to_dict(t), indent=1, ensure_ascii=False) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# LaTeX (booktabs)

_TEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
_TEX_UNICODE = {"↓": r"$\downarrow$", "↑": r"$\uparrow$", "μ": r"$\mu$", "×": r"$\times$", "–": "--",
                "†": r"$^\dagger$", "σ": r"$\sigma$", "≤": r"$\leq$", "≥": r"$\geq$", "·": r"$\cdot$", "²": r"$^2$"}


def tex_escape(text: str) -> str:
    out = []
    for ch in str(text):
        out.append(_TEX_SPECIAL.get(ch) or _TEX_UNICODE.get(ch) or ch)
    return "".join(out)


def _spans(values: list[str]) -> list[tuple[str, int, int]]:
    """Runs of equal neighbours: (text, first index, length)."""
    spans: list[tuple[str, int, int]] = []
    for i, v in enumerate(values):
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1], spans[-1][2] + 1)
        else:
            spans.append((v, i, 1))
    return spans


def _header_grid(t: Table, cols: list[int]) -> list[list[str]]:
    """Header levels as rows; shorter headers are padded at the top so the last level holds the leaf names."""
    depth = max(len(t.columns[j].header) for j in cols)
    padded = [("",) * (depth - len(t.columns[j].header)) + tuple(t.columns[j].header) for j in cols]
    return [[p[lvl] for p in padded] for lvl in range(depth)]


def to_latex(t: Table) -> str:
    cols = [j for j, c in enumerate(t.columns) if c.show]
    marks = t.marks()
    grid = _header_grid(t, cols)
    align = "".join("l" if _is_text_col(t, j) else "r" for j in cols)
    lines = ["% generated by `mmkv report`; needs \\usepackage{booktabs}", r"\begin{table}[t]", r"\centering",
             r"\footnotesize", rf"\caption{{{tex_escape(t.title)}}}", rf"\begin{{tabular}}{{{align}}}", r"\toprule"]
    for lvl, level in enumerate(grid):
        last = lvl == len(grid) - 1
        if not last and not any(level):
            continue
        # merge a header cell over its neighbours only where the levels above agree too
        keys = [tuple(grid[k][c] for k in range(lvl + 1)) for c in range(len(cols))]
        cells, rules = [], []
        for key, start, n in _spans(keys) if not last else [(k, i, 1) for i, k in enumerate(keys)]:
            text = tex_escape(key[-1])
            cells.append(text if n == 1 else rf"\multicolumn{{{n}}}{{c}}{{{text}}}")
            if key[-1] and n > 1:
                rules.append(rf"\cmidrule(lr){{{start + 1}-{start + n}}}")
        lines.append(" & ".join(cells) + r" \\")
        if rules:
            lines.append(" ".join(rules))
    lines.append(r"\midrule")
    for i, row in enumerate(t.rows):
        if i > 0 and t.starts_block(i):
            lines.append(r"\midrule")
        cells = []
        for j in cols:
            v = row[j]
            s = r"$\infty$" if _is_number(v) and math.isinf(v) and v > 0 else tex_escape(format_value(t.columns[j], v))
            if marks[i][j] == "best":
                s = rf"\textbf{{{s}}}"
            elif marks[i][j] == "second":
                s = rf"\underline{{{s}}}"
            cells.append(s)
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if t.notes:
        lines.append(r"\par\smallskip\raggedright " + " ".join(tex_escape(n) for n in t.notes))
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# HTML


def to_html(t: Table) -> str:
    cols = [j for j, c in enumerate(t.columns) if c.show]
    marks = t.marks()
    grid = _header_grid(t, cols)
    out = [f'<table class="report" id="table-{html.escape(t.name)}">',
           f"<caption>{html.escape(t.title)}</caption>", "<thead>"]
    for lvl, level in enumerate(grid):
        last = lvl == len(grid) - 1
        if not last and not any(level):
            continue
        keys = [tuple(grid[k][c] for k in range(lvl + 1)) for c in range(len(cols))]
        spans = _spans(keys) if not last else [(k, i, 1) for i, k in enumerate(keys)]
        out.append("<tr>" + "".join(f'<th colspan="{n}">{html.escape(k[-1])}</th>' if n > 1
                                    else f"<th>{html.escape(k[-1])}</th>" for k, _, n in spans) + "</tr>")
    out.append("</thead><tbody>")
    for i, row in enumerate(t.rows):
        new_block = i > 0 and t.starts_block(i)
        cells = []
        for j in cols:
            s = html.escape(format_value(t.columns[j], row[j]))
            if marks[i][j] == "best":
                s = f"<b>{s}</b>"
            elif marks[i][j] == "second":
                s = f"<u>{s}</u>"
            cls = "txt" if _is_text_col(t, j) else "num"
            cells.append(f'<td class="{cls}">{s}</td>')
        tr = '<tr class="block">' if new_block else "<tr>"
        out.append(tr + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    if t.notes:
        out.append('<ul class="notes">' + "".join(f"<li>{html.escape(n)}</li>" for n in t.notes) + "</ul>")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def render(t: Table, fmt: str) -> str:
    """One table in one format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown table format {fmt!r}; choose from {', '.join(FORMATS)}")
    return {"md": to_markdown, "csv": to_csv, "json": to_json, "latex": to_latex, "html": to_html}[fmt](t)


def render_many(tables: list[Table], fmt: str, problems: list[str] | None = None) -> str:
    """Several tables (and the problem list) as one document: JSON gets one object, the text formats concatenate."""
    if fmt == "json":
        doc = {"tables": [to_dict(t) for t in tables], "problems": list(problems or [])}
        return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    parts = [render(t, fmt) for t in tables]
    if problems and fmt == "md":
        parts.append("**Problems**\n\n" + "\n".join(f"- {_md_escape(p)}" for p in problems) + "\n")
    if problems and fmt == "latex":
        parts.append("\n".join(f"% problem: {p}" for p in problems) + "\n")
    return "\n".join(parts)
