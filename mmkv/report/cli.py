"""`mmkv report RUN [RUN...]`: tables (md, csv, json, latex), plots and an HTML gallery from run folders.

Several RUN folders (torchrun shards written to separate folders, or separate runs) are merged: rollouts are keyed by
(modality, model, residual window, item, variant). Metrics are computed from the lossless outputs and cached as
metrics.json beside each rollout. Every rollout a run's config expects that is missing, partial or failed is listed
(which rollout, which file, why) and everything else is still tabulated, over the items every codec has; --strict
exits 1 on any of it.

Where a video run's prompts are procedural captions (`mmkv.pipelines.wan.scenes`), every rollout, the reference
included, is also scored for prompt adherence and scene consistency from its own frames (`mmkv.report.adherence`);
where an audio run's clips carry procedural captions (`mmkv.pipelines.aar.sounds`, recorded by `mmkv compare audio`
from a `<clip stem>.txt` beside each clip), for adherence from its own waveform, and each codec rollout for how
well its onsets agree with the reference's.

Without --out, the tables go to stdout in the first text format asked for. With --out DIR: DIR/table.<ext> and
DIR/windows.<ext> per format, DIR/rollouts.csv and DIR/frames.csv (long form), DIR/problems.txt (when any),
DIR/plots/*.png and, for html, DIR/index.html.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmkv.cli import UsageError
from mmkv.report import tables as T

DEFAULT_OUT = "report"  # under the first run folder, for html and plots when --out is not given


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run folders (shards of one run, or several)")
    p.add_argument("--format", default="md", metavar="FMT",
                   help="md, csv, json, latex or html; comma-separate several (default md)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"write files here (default: stdout for text formats; RUN/{DEFAULT_OUT} for html)")
    p.add_argument("--lpips", choices=("alexnet", "random", "off"), default="alexnet",
                   help="LPIPS trunk: torchvision's ImageNet AlexNet (default), a seeded random trunk (smoke tests; "
                        "not LPIPS, marked †), or no LPIPS")
    p.add_argument("--lpips-weights", type=Path, default=None, metavar="PATH",
                   help="alexnet-owt-7be5be79.pth (default: $TORCH_HOME/hub/checkpoints/)")
    p.add_argument("--device", default="auto", help="device for the metrics: auto (cuda if present), cpu, cuda:N")
    p.add_argument("--windows", default=None, metavar="EDGES",
                   help="window edges in seconds for the windowed means, e.g. 0,2,5,10 (default; then every 10 s)")
    p.add_argument("--metrics", default=None, metavar="LIST",
                   help="metrics in the main table, e.g. lpips,psnr,lsd_db,snr_db (default: lpips, psnr, ssim, "
                        "latent_cosine, adherence, consistency, attribute_match for video (the last three where "
                        "prompts are procedural captions); lsd_db, snr_db, log_mel_mse, latent_cosine, adherence, "
                        "onset_match, onset_error_ms for audio (the last three where clips have procedural "
                        "captions))")
    p.add_argument("--gallery-items", type=int, default=None, metavar="N", help="show at most N items per model")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-cache", action="store_true", help="recompute metrics and do not write metrics.json")
    p.add_argument("--strict", action="store_true",
                   help="exit with status 1 on any problem: a rollout missing, partial or failed, or codecs measured "
                        "over different items")


def parse_formats(text: str) -> list[str]:
    names = [f.strip().lower() for f in str(text).split(",") if f.strip()]
    aliases = {"markdown": "md", "tex": "latex"}
    names = [aliases.get(n, n) for n in names]
    bad = [n for n in names if n not in T.FORMATS]
    if bad or not names:
        raise UsageError(f"unknown report format {', '.join(map(repr, bad)) or repr(text)}; choose from "
                         f"{', '.join(T.FORMATS)} (comma-separate several, e.g. --format md,latex)")
    return list(dict.fromkeys(names))


def parse_windows(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        edges = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--windows {text!r}: expected comma-separated seconds, e.g. 0,2,5,10") from None
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise UsageError(f"--windows {text!r}: edges must start at 0 and increase, e.g. 0,2,5,10")
    return edges


def parse_metrics(text: str | None) -> dict[str, tuple[str, ...]] | None:
    from mmkv.report.summary import DEFAULT_METRICS, METRICS

    if text is None:
        return None
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise UsageError(f"--metrics: unknown metric(s) {bad or text!r}; choose from {', '.join(METRICS)}")
    video = {"lpips", "psnr", "psnr_frame_mean", "ssim", "latent_cosine", "adherence", "consistency",
             "attribute_match"}
    audio = {"lsd_db", "snr_db", "log_mel_mse", "latent_cosine", "token_agreement", "adherence", "onset_match",
             "onset_error_ms"}
    return {"video": tuple(m for m in names if m in video) or DEFAULT_METRICS["video"],
            "audio": tuple(m for m in names if m in audio) or DEFAULT_METRICS["audio"]}


def check_out(out: Path) -> None:
    """--out must be a folder or creatable as one; said before any metric is computed."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory; give a folder (it is created if absent)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {out}: cannot create the folder ({err.strerror or err}); give a writable folder") \
            from None


def run(args: argparse.Namespace) -> int:
    formats = parse_formats(args.format)
    edges = parse_windows(args.windows)
    metric_sel = parse_metrics(args.metrics)
    out = args.out
    if out is None and "html" in formats:
        if not args.runs[0].is_dir():
            raise UsageError(f"{args.runs[0]} is not a run folder, so the html report has no default place; give "
                             "--out DIR")
        out = args.runs[0] / DEFAULT_OUT
    if out is not None:
        check_out(out)

    from mmkv.metrics.video import resolve_device
    from mmkv.report import summary as S
    from mmkv.io import atomic_write_text
    from mmkv.report.measure import LpipsChoice, Measurer, measure_all
    from mmkv.report.runs import read_runs

    try:
        device = resolve_device(args.device)
    except RuntimeError as err:
        raise UsageError(f"--device {args.device!r}: {err}") from None
    rs = read_runs(args.runs)
    measurer = Measurer(LpipsChoice(args.lpips, args.lpips_weights, device=device), device=device,
                        use_cache=not args.no_cache)
    from tqdm.auto import tqdm

    measured = measure_all(rs, measurer, progress=lambda it: tqdm(it, desc="metrics", disable=None,
                                                                   file=sys.stderr))
    from mmkv.report.adherence import score_all

    scores = score_all(measured, rs.problems, progress=lambda it: tqdm(it, desc="adherence", disable=None,
                                                                       file=sys.stderr))
    s = S.summarize(measured, window_edges_s=edges, adherence=scores)
    tables = [S.main_table(s, metric_sel)]
    win = S.windows_table(s)
    if win is not None:
        tables.append(win)
    problems = list(rs.problems) + s.problems

    if out is None:
        text_formats = [f for f in formats if f != "html"]
        for f in text_formats:
            sys.stdout.write(T.render_many(tables, f, problems))
    else:
        for f in formats:
            if f == "html":
                continue
            for t in tables:
                atomic_write_text(out / f"table.{T.EXTENSIONS[f]}" if t.name == "main"
                                  else out / f"{t.name}.{T.EXTENSIONS[f]}", T.render(t, f))
        atomic_write_text(out / "rollouts.csv", T.render(S.rollouts_table(s), "csv"))
        problems_file = out / "problems.txt"
        if problems:
            atomic_write_text(problems_file, "".join(p + "\n" for p in problems))
        elif problems_file.exists():
            problems_file.unlink()  # from an earlier report of the same folder
        if any(g.kind == "video" for g in s.groups):
            atomic_write_text(out / "frames.csv", T.render(S.frames_table(s), "csv"))
        plots = []
        if not args.no_plots and measured:
            from mmkv.report import plots as P

            plots = P.rate_quality(s, out / "plots", metric_sel) + P.frame_curves(s, out / "plots")
        if "html" in formats:
            from mmkv.report.gallery import write_report

            page = write_report(out, s, rs, [T.render(t, "html") for t in tables], plots, problems,
                                max_items=args.gallery_items)
            print(f"mmkv report: wrote {page}", file=sys.stderr)
        print(f"mmkv report: wrote {out}/ ({', '.join(formats)}; {len(plots)} plots)", file=sys.stderr)

    if problems:
        print(f"mmkv report: {len(problems)} problem(s); compared the other {len(measured)} rollout(s):",
              file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    if not measured:
        print("mmkv report: nothing to compare (no complete codec rollout with a reference)", file=sys.stderr)
        return 1
    return 1 if (args.strict and problems) else 0
