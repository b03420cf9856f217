"""`mmkv bench synthetic`: the OCTOPUS section 4.1 synthetic probe, its App. D bit-allocation sweep, and an iso-rate
TurboQuant baseline the papers do not run.

Protocol (the OCTOPUS paper, section 4.1 and Table 1):
- reconstruction: per seed, n = 1024 keys and 16 queries drawn from N(0, I_d); per codec, MSE = mean
  ||k - k_hat||^2 / ||k||^2, cosine = mean cos(k, k_hat), IP error = mean |q.k - score(q, k)| over all query-key pairs
  with the codec's own score estimator (`Codec.scores`: the QJL estimators for the QJL family, q.k_hat otherwise);
  effective bits per coordinate are measured from the bytes the codec really stores (`Encoded.nbytes`).
- needle: per seed, one needle key planted at a random position among T = 2048 distractors, all drawn from N(0, I_d)
  and scaled to norm sqrt(d); the query is the needle plus noise of 10% of its norm; logits q.k / sqrt(d); we report the
  softmax mass on the needle. The fp32 baseline is 0.960 at d = 128 (e^sqrt(d) against 2048 * e^(1/2)).
- App. D sweep: OCTOPUS at (b_dir, b_nrm) = (b + delta, b - delta), delta in -2..2, around each b; the total rate moves
  with delta (3b + delta bits per triplet), so each row carries its measured effective bits.
- iso-rate: TurboQuant-MSE with `hi` of its d rotated coordinates at one more bit, `hi` chosen so that its measured
  effective bits equal each default OCTOPUS point's: codecs are compared at equal measured bits, not equal
  nominal b (TurboQuant's own 2.5-bit outlier split already mixes two widths; docs/decisions.md, "Which presets").
  TCQ likewise (when it is among the codecs run), with `hi` of its d/2 trellis steps at one more bit and OCTOPUS's
  norm precision for its gain.

Seeds and speed: seed s of each section gets its own single-head codec built with seed = derive_seed(--seed, section,
s), hence its own rotation (a seeded randomised Hadamard transform), sketch or k-means init; data come from private generators keyed by the
seed, so seed s sees the same keys whatever --seeds is. We measured the alternatives on 2 shared cores: stacking seeds
on the head axis (dim -3) in chunks of 8 was ~1.5x slower than one seed per call (temporaries above glibc's 32 MB mmap
threshold page-fault on every call), and would need care for OScaR (one token norm over all heads) and PolarQuant (one
rotation shared by all heads). What is parallel is codec configs: `--jobs` worker threads with one intra-op thread
each (two OpenMP threads per op were 2-3x slower than one on the contended box).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mmkv.bench.synthetic_output import (  # noqa: F401
    _COLUMNS, _table, render_markdown, tables, write_csv, write_json, write_plot,
)
from mmkv.bench.synthetic_probe import (  # noqa: F401
    ROW_FIELDS, Protocol, _gen, _mean_se, _scores, encode_seeds, measure_needle, measure_reconstruction,
    needle_data, needle_mass_from_scores, reconstruction_data,
)
from mmkv.codecs.config import CodecConfig, CodecError
from mmkv.codecs.registry import build, get_codec_class, names

# Codecs left out of the default run: the byte-exact baseline.
EXCLUDED_BY_DEFAULT = ("identity",)

# Preset templates per codec at nominal bits {b}; several templates give several rows (OCTOPUS with and without
# joint rounding). A registered codec missing here runs with its `bits` parameter set to {b}.
PRESETS: dict[str, tuple[str, ...]] = {
    "octopus": ("octopus:b={b},joint=0", "octopus:b={b},joint=1"),
    "octopus-qjl": ("octopus-qjl:b={b}",),
    "turboquant-mse": ("turboquant-mse:b={b}",),
    "turboquant-prod": ("turboquant-prod:b={b}",),
    "qjl": ("qjl:bits={b}",),
    "polarquant": ("polarquant:b={b}",),
    "kivi": ("kivi:bits={b},group=32",),
    "oscar": ("oscar:bits={b},group=32",),
    "groupquant": ("groupquant:bits={b},group=32",),
    # QVG (a span codec) at its released per-chunk setting; the probe's 1024 (2049) keys per seed form one span.
    "qvg": ("qvg:bits={b}",),
}


# ----------------------------------------------------------------------------------------------------------------
# Which configs


def default_codecs() -> list[str]:
    """Every registered codec except the byte-exact baseline."""
    return [n for n in names() if n not in EXCLUDED_BY_DEFAULT]


def presets_for(name_or_preset: str, bits: list[int]) -> list[tuple[int | None, str]]:
    """(nominal bits, preset) rows for a codec name (expanded over `bits`) or one explicit preset."""
    if ":" in name_or_preset:
        return [(CodecConfig.parse(name_or_preset).get("bits"), name_or_preset)]
    name = name_or_preset.strip().lower()
    templates = PRESETS.get(name)
    if templates is None:
        if "bits" not in get_codec_class(name).config_class.field_names():
            return [(None, name)]
        templates = (f"{name}:bits={{b}}",)
    return [(b, t.format(b=b)) for b in bits for t in templates]


def octopus_sweep_configs(b: int) -> list[tuple[int, CodecConfig]]:
    """App. D: (b_dir, b_nrm) = (b + delta, b - delta), delta in -2..2, without joint rounding; widths the codec
    rejects (e.g. a 0-bit direction) are skipped."""
    out = []
    for delta in range(-2, 3):
        try:
            cfg = CodecConfig.parse(f"octopus:bits={b},joint=0,dir={b + delta},rho={b - delta}")
            build(cfg, head_dim=8, seed=0)
        except CodecError:
            continue
        out.append((delta, cfg))
    return out


def canonical(cfg: CodecConfig) -> str:
    """A config string with OCTOPUS's "auto" widths resolved, so a sweep point equal to a default row is measured once."""
    if cfg.name in ("octopus", "octopus-qjl"):
        cfg = cfg.replace(dir=cfg.bits + 1 if cfg.dir == "auto" else cfg.dir,
                          rho=cfg.bits - 1 if cfg.rho == "auto" else cfg.rho)
    return str(cfg)


def iso_rate_config(target_bits: float, p: Protocol) -> CodecConfig:
    """TurboQuant-MSE mixing b_lo and b_lo + 1 bits over channels (`hi` channels at b_lo + 1) whose measured effective
    bits come closest to `target_bits` (the iso-rate rows)."""
    # Measured on as many tokens as the probe encodes per seed, so row padding is accounted as in the run.
    probe = torch.randn(1, p.keys, p.dim, generator=torch.Generator().manual_seed(0))
    best: tuple[float, CodecConfig] | None = None
    b_lo = max(1, int(math.floor(target_bits)) - 1)
    for b in (b_lo, b_lo + 1):
        try:
            base = build(f"turboquant-mse:b={b}", head_dim=p.dim)
        except CodecError:
            continue
        e0 = base.encode(probe).effective_bits
        hi = int(round((target_bits - e0) * p.dim))
        for h in sorted({min(max(hi + j, 0), p.dim) for j in (-1, 0, 1)}):
            try:
                cfg = CodecConfig.parse(f"turboquant-mse:bits={b},hi={h}")
                eff = build(cfg, head_dim=p.dim).encode(probe).effective_bits
            except CodecError:
                continue
            if best is None or abs(eff - target_bits) < abs(best[0] - target_bits):
                best = (eff, cfg)
    if best is None:
        raise CodecError(f"no turboquant-mse preset reaches {target_bits:.3f} effective bits at d={p.dim}")
    return best[1]


def tcq_iso_rate_config(octopus: CodecConfig, p: Protocol) -> CodecConfig:
    """TCQ at an OCTOPUS point's measured effective bits, with OCTOPUS's norm precision: b bits a coordinate and
    `hi` trellis steps at 2b + 1 bits, `hi` chosen so that the measured bits come closest (the iso-rate rows)."""
    target = probe_bits(octopus, p)
    base = CodecConfig.parse(f"tcq:bits={octopus.bits},norm={octopus.norm}")
    hi = min(max(int(round((target - probe_bits(base, p)) * p.dim)), 0), p.dim // 2)  # one bit a wide step
    if probe_bits(base.replace(hi=hi), p) == target:
        return base.replace(hi=hi)
    best = min((abs(probe_bits(base.replace(hi=h), p) - target), h)
               for h in sorted({min(max(hi + j, 0), p.dim // 2) for j in (-1, 0, 1)}))
    return base.replace(hi=best[1])


# ----------------------------------------------------------------------------------------------------------------
# The run


def _row(section: str, cfg: CodecConfig, bits: int | None, p: Protocol, **extra: Any) -> dict:
    row = {f: None for f in ROW_FIELDS}
    row.update(section=section, codec=cfg.name, config=str(cfg), bits=bits, dim=p.dim, seeds=p.seeds)
    row.update(extra)
    return row


def probe_bits(config: CodecConfig, p: Protocol) -> float:
    """Effective bits of `config` on one seed's worth of keys (rows are packed per seed, so this is the run's)."""
    x = torch.randn(1, p.keys, p.dim, generator=torch.Generator().manual_seed(0))
    return build(config, head_dim=p.dim).encode(x).effective_bits


def run_protocol(p: Protocol, codecs: list[str], bits: list[int], *, needle: bool = True, sweep: bool = True,
                 iso_rate: bool = True, jobs: int = 1, log=None, notes: list[str] | None = None) -> list[dict]:
    """Every row of the benchmark as a list of dicts (fields `ROW_FIELDS`).

    A codec named (not given as a preset) that rejects one of the bit widths or the head dim (QVG has only 2 and 4
    bits) is skipped there, with a line appended to `notes`. Configs run on `jobs` worker threads with one intra-op
    thread each (torch ops release the GIL; on a shared 2-core machine OpenMP's two intra-op threads were 2-3x
    slower than one); each config's numbers do not depend on `jobs`.
    """
    log = log or (lambda msg: None)
    notes = notes if notes is not None else []
    # Resolve every config before drawing data, so a bad name or preset fails at once.
    tasks: list[tuple[str, CodecConfig, int | None, bool, dict]] = []  # (section, config, bits, needle, extra)
    for name in codecs:
        for b, preset in presets_for(name, bits):
            try:
                cfg = CodecConfig.parse(preset)
                build(cfg, head_dim=p.dim)
            except CodecError as err:
                if ":" in name:  # an explicit preset is the user's: no silent skip
                    raise
                notes.append(f"skipped {preset} at d={p.dim}: {err}")
                log(f"  {notes[-1]}")
                continue
            tasks.append(("table1", cfg, b, needle, {}))
    octopus_points = [(b, cfg) for sec, cfg, b, _, _ in tasks if cfg.name == "octopus" and not cfg.joint]
    if sweep and "octopus" in names():
        for b in bits:
            for delta, cfg in octopus_sweep_configs(b):
                # App. D is an MSE landscape: reconstruction only, no needle.
                tasks.append(("sweep", cfg, b, False, {"delta": delta, "b_dir": cfg.dir, "b_nrm": cfg.rho}))
    if iso_rate and "turboquant-mse" in names():
        for b, ocfg in octopus_points:
            tasks.append(("iso-rate", iso_rate_config(probe_bits(ocfg, p), p), b, needle, {"matches": str(ocfg)}))
    if iso_rate and "tcq" in {c.partition(":")[0].strip().lower() for c in codecs}:  # TCQ's encoder is slow on CPU
        for b, ocfg in octopus_points:
            tasks.append(("iso-rate", tcq_iso_rate_config(ocfg, p), b, needle, {"matches": str(ocfg)}))

    keys, queries = reconstruction_data(p)
    nk = nq = npos = None
    if needle:
        nk, nq, npos = needle_data(p)

    # One unit of work per distinct codec (a sweep point may equal a default row): reconstruction, maybe the needle.
    work: dict[str, list] = {}
    for _, cfg, _, with_needle, _ in tasks:
        unit = work.setdefault(canonical(cfg), [cfg, False])
        unit[1] = unit[1] or with_needle

    def measure(key: str) -> dict:
        cfg, with_needle = work[key]
        t0 = time.perf_counter()
        stats = measure_reconstruction(cfg, keys, queries, p)
        if with_needle:
            stats["needle_mass"], stats["needle_mass_se"] = measure_needle(cfg, nk, nq, npos, p)
        log(f"  {str(cfg):<58} {time.perf_counter() - t0:6.2f} s")
        return stats

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if jobs > 1:
            with ThreadPoolExecutor(jobs) as pool:
                results = dict(zip(work, pool.map(measure, work)))
        else:
            results = {key: measure(key) for key in work}
        fp32 = measure_needle(None, nk, nq, npos, p) if needle else None
    finally:
        torch.set_num_threads(threads)

    rows: list[dict] = []
    if fp32 is not None:
        rows.append({**{f: None for f in ROW_FIELDS}, "section": "table1", "codec": "fp32", "config": "fp32",
                     "bits": 32, "effective_bits": 32.0, "mse": 0.0, "mse_se": 0.0, "cosine": 1.0, "ip_error": 0.0,
                     "ip_error_se": 0.0, "ip_bias": 0.0, "needle_mass": fp32[0], "needle_mass_se": fp32[1],
                     "dim": p.dim, "seeds": p.seeds, "needle_seeds": p.needle_seeds})
    for section, cfg, b, with_needle, extra in tasks:
        stats = dict(results[canonical(cfg)])
        if not with_needle:
            stats.pop("needle_mass", None)
            stats.pop("needle_mass_se", None)
        row = _row(section, cfg, b, p, **stats, **extra)
        if with_needle:
            row["needle_seeds"] = p.needle_seeds
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# CLI


def _int_list(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one bit width")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=int, default=128, help="head dim d (default 128)")
    parser.add_argument("--seeds", type=int, default=64, help="seeds for the reconstruction probe (default 64)")
    parser.add_argument("--bits", type=_int_list, default=[2, 3, 4], help="nominal bit widths (default 2,3,4)")
    parser.add_argument("--codecs", default=None,
                        help="comma-separated codec names or presets (';'-separated if a preset has commas); default: "
                             "every registered codec except identity")
    parser.add_argument("--keys", type=int, default=1024, help="keys per seed (default 1024)")
    parser.add_argument("--queries", type=int, default=16, help="queries per seed (default 16)")
    parser.add_argument("--needle-tokens", type=int, default=2048, help="needle distractors T (default 2048)")
    parser.add_argument("--needle-seeds", type=int, default=128, help="needle seeds (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="base seed for data and rotations (default 0)")
    parser.add_argument("--no-needle", action="store_true", help="skip the needle experiment")
    parser.add_argument("--no-sweep", action="store_true", help="skip the OCTOPUS App. D bit-allocation sweep")
    parser.add_argument("--no-iso-rate", action="store_true", help="skip the iso-rate TurboQuant rows")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as a JSON list")
    parser.add_argument("--csv", type=Path, default=None, help="write the rows as CSV")
    parser.add_argument("--plot", type=Path, default=None, help="plot MSE and needle mass against effective bits")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="codec configs measured concurrently, one thread each (default: min(2, CPUs))")
    parser.add_argument("--quiet", action="store_true", help="no per-config progress on stderr")


def _codec_list(text: str | None) -> list[str]:
    if text is None:
        return default_codecs()
    if ";" in text:
        return [t.strip() for t in text.split(";") if t.strip()]
    # Commas separate codecs unless they sit inside a preset's parameter list (`name:k=v,k=v`).
    items: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if items and ":" in items[-1] and "=" in part and ":" not in part:
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def run(args: argparse.Namespace) -> int:
    if args.dim < 2:
        raise ValueError(f"--dim must be >= 2, got {args.dim}")
    for flag in ("seeds", "keys", "queries", "needle_tokens", "needle_seeds", "jobs"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    p = Protocol(dim=args.dim, seeds=args.seeds, keys=args.keys, queries=args.queries,
                 needle_tokens=args.needle_tokens, needle_seeds=args.needle_seeds, seed=args.seed, device=args.device)
    codecs = _codec_list(args.codecs)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    notes: list[str] = []
    rows = run_protocol(p, codecs, list(args.bits), needle=not args.no_needle,
                        sweep=not args.no_sweep and (args.codecs is None or "octopus" in codecs),
                        iso_rate=not args.no_iso_rate, jobs=args.jobs, log=log, notes=notes)
    seconds = time.perf_counter() - t0
    sys.stdout.write(render_markdown(rows, p, seconds, notes))
    if args.json:
        write_json(rows, args.json)
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        write_plot(rows, args.plot, p)
    return 0
