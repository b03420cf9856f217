"""`mmkv compare audio`: AAR rollouts with the native KV cache and with each codec, side by side, per clip.

For every clip: a CLAP embedding of the clip (or a precomputed one) conditions AAR; the reference rollout (native fp32
cache) and one rollout per codec run from the same sampling uniforms (same seed and clip); each writes

    RUN/rollouts/<clip stem>/<reference | codec slug>/{audio.wav, tokens.safetensors, latent.safetensors, rollout.json}

with rollout.json last (atomic), so a rerun skips finished rollouts, and the rollout's wall times just after it in
timings.json. The KV cache lives in an `mmkv.cache.KVStore` whose unit is one scale; `--residual-window` counts scales
including the current one (1 = only the current scale is native). Clips are sharded round-robin over
torchrun ranks; each rank writes manifest.rank{R}.json (and its wall times in timings.rank{R}.json) and prints a table
per clip and overall (LSD, log-mel MSE, SNR, latent cosine; min / mean / max).

A clip that cannot be used (corrupt, empty, wrong embedding size) is reported with its file name and skipped; the
other clips finish and the command exits 1. So does a rollout whose waveform or latent holds NaN / Inf: it writes
failed.json (with the reason) instead of rollout.json and is listed in the manifest's `failures`. A rerun must give the
same AAR / SAT checkpoints and conditioner (their SHA-256 are in the manifest and every rollout.json).

A clip's caption, when a UTF-8 `<clip stem>.txt` lies beside it (e.g. `clips/k03.wav` and `clips/k03.txt`), is
recorded as `caption` in each of its rollout.json files (None otherwise); AAR itself is conditioned on the clip's
CLAP embedding only. `mmkv report` scores the rollouts of a procedural caption (`mmkv.pipelines.aar.sounds`) for
adherence. The caption is no part of a resume's identity: finished rollouts keep the caption they recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmkv.cache.flags import add_cache_arguments
from mmkv.pipelines.common import (
    REFERENCE,
    CodecSpec,
    RunError,
    RunFolder,
    atomic_save_safetensors,
    check_out_dir,
    parse_codec_list,
    parse_device,
    progress,
    rank_info,
    sha256_file,
    shard,
    versions,
)

from mmkv.pipelines.common import (  # noqa: E402
    atomic_save_wav, failure_record, nonfinite_outputs, rollout_line, say,
)
from mmkv.pipelines.aar.conditioning import (  # noqa: F401  (re-exported)
    CAPTION_SUFFIX, Conditioner, clip_caption, clip_warnings,
)

AUDIO_FILES = {"audio": "audio.wav", "tokens": "tokens.safetensors", "latent": "latent.safetensors"}
# The inputs a resume must share with the run that made the folder, by SHA-256 (rollout.json records them too).
HASH_LABELS = {"aar_sha256": "AAR checkpoint", "sat_sha256": "SAT checkpoint",
               "conditioner_sha256": "conditioner (--clap / --embeddings)"}


def add_model_arguments(models, conditioning, *, required: bool, shipped_default: bool = False) -> None:
    """The AAR / SAT / CLAP flags, shared by `mmkv compare audio` and `mmkv inspect kv`."""
    models.add_argument("--aar", required=required, metavar="DIR",
                        help="directory with AAR_d16_bs2048.pth and SAT_d128_lat128.pth (or one AAR*/SAT* checkpoint "
                             "each)" + ("; default: the trained tiny models shipped in the package, with their CLAP "
                                        "(mmkv/assets/audio/, when installed)" if shipped_default else ""))
    models.add_argument("--sat", metavar="FILE", help="SAT checkpoint, when it is not in --aar")
    conditioning.add_argument("--clap", metavar="DIR",
                              help="local laion/larger_clap_general directory (transformers); with --clap-backend "
                                   "laion, a laion-clap .pt checkpoint")
    conditioning.add_argument("--clap-backend", choices=("transformers", "laion"), default="transformers",
                              help="CLAP implementation (default transformers, what AAR was trained with)")
    conditioning.add_argument("--embeddings", metavar="PATH",
                              help="precomputed 512-d CLAP embeddings instead of --clap: a folder of <clip "
                                   "stem>.npy/.safetensors or one .safetensors/.npz file keyed by clip stem")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("models")
    g = parser.add_argument_group("conditioning")
    add_model_arguments(models, g, required=False, shipped_default=True)
    g.add_argument("--clips", nargs="+", metavar="DIR|FILE",
                   help="audio clips (any common format and sample rate) or folders searched recursively; may be "
                        "omitted with --embeddings (one rollout per embedding). A <clip stem>.txt beside a clip is "
                        "its caption, recorded for `mmkv report`")
    g.add_argument("--limit", type=int, metavar="N", help="only the first N clips (in sorted order)")
    g = parser.add_argument_group("codecs and cache")
    add_cache_arguments(g, ("--codecs", "--codec", "--residual-window", "--value-group", "--reuse-decoded",
                            "--protected-layers", "--codec-seed", "--attention"),
                        units="scales (the current one included)", value_group=16)
    g = parser.add_argument_group("sampling")
    g.add_argument("--seed", type=int, default=42, help="base sampling seed; each clip derives its own (default 42)")
    g.add_argument("--cfg", type=float, default=4.0, help="classifier-free guidance at the last scale (default 4)")
    g.add_argument("--top-k", type=int, default=200)
    g.add_argument("--top-p", type=float, default=0.95)
    g = parser.add_argument_group("run")
    g.add_argument("--out", required=True, metavar="RUN", help="run folder (created; rerun to resume)")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: this rank's GPU, else cpu)")


# ----------------------------------------------------------------------------------------------------------------
# One rollout


@dataclass
class Context:
    args: argparse.Namespace
    aar: Any
    sat: Any
    device: torch.device
    folder: RunFolder
    model_name: str
    rank: int
    stores: dict[str, Any]
    sampling: Any
    versions: dict[str, Any]
    hashes: dict[str, str] | None = None  # SHA-256 of the inputs (HASH_LABELS), recorded in every rollout.json


def _make_store(ctx_args: argparse.Namespace, aar, spec: CodecSpec | None):
    from mmkv.cache import CacheConfig, KVStore

    cfg = CacheConfig(
        codec=None if spec is None else spec.preset,
        value_group=ctx_args.value_group,
        residual_window=ctx_args.residual_window,
        protected_layers=ctx_args.protected_layers,
        seed=ctx_args.codec_seed,
        attention=ctx_args.attention,
        reuse_decoded=ctx_args.reuse_decoded,
    )
    return KVStore(cfg, num_layers=aar.depth, num_heads=aar.num_heads, head_dim=aar.config.head_dim)


def _effective_bits(stats: dict[str, Any]) -> float | None:
    """Measured bits per encoded K/V element (payload + side information); the held average when nothing is
    encoded (the native cache: 32 for fp32)."""
    k, v = stats.get("k_effective_bits"), stats.get("v_effective_bits")
    if k is not None and v is not None:
        return (k + v) / 2
    return stats.get("effective_bits")


def run_variant(ctx: Context, item: str, index: int, text: str, cond: torch.Tensor, cond_info: dict[str, Any],
                spec: CodecSpec | None, caption: str | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Render one rollout and write its files, rollout.json last, then timings.json; returns the record and the wall
    times. A rollout whose waveform or latent holds NaN/Inf writes only failed.json and returns that record
    (`status: failed`) and None."""
    from mmkv.pipelines.aar.clap import embedding_sha256
    from mmkv.pipelines.aar.sample import rollout

    variant = REFERENCE if spec is None else spec.variant
    out_dir = ctx.folder.rollout_dir(item, variant)
    for stale in out_dir.glob(".*.tmp*"):  # temp files of a run killed mid-write (SIGKILL skips their cleanup)
        stale.unlink()
    store = ctx.stores[variant]
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    r = rollout(ctx.aar, ctx.sat, cond[None], seed=ctx.args.seed, key=item, sampling=ctx.sampling, store=store)
    reason = nonfinite_outputs({"waveform": r.audio, "latent": r.latent})
    if reason:
        record = failure_record("audio", item, index, variant, None if spec is None else spec.preset,
                                "non-finite output", reason, noise_sha256=r.noise_sha256, rank=ctx.rank,
                                **(ctx.hashes or {}))
        ctx.folder.write_failure(item, variant, record)
        return record, None
    peak_mem = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None
    stats = store.stats()
    t0 = time.perf_counter()
    sr = ctx.sat.config.sample_rate
    atomic_save_wav(out_dir / AUDIO_FILES["audio"], r.audio[0, 0].numpy(), sr)  # float32, no timestamped chunk
    tokens = {"tokens": r.tokens_flat[0].contiguous()}
    tokens.update({f"scale_{si:02d}": t[0].contiguous() for si, t in enumerate(r.tokens)})
    atomic_save_safetensors(out_dir / AUDIO_FILES["tokens"], tokens,
                            metadata={"patch_nums": json.dumps(list(ctx.aar.patch_nums))})
    atomic_save_safetensors(out_dir / AUDIO_FILES["latent"], {"latent": r.latent})
    timings = dict(r.timings, write_s=time.perf_counter() - t0)
    record = {
        "kind": "audio",
        "item": item,
        "item_index": index,
        "text": text,
        "caption": caption,
        "variant": variant,
        "preset": None if spec is None else spec.preset,
        "k_codec": None if spec is None else str(spec.k),
        "v_codec": None if spec is None else str(spec.v),
        "bits": None if spec is None else spec.nominal_bits,
        "effective_bits": _effective_bits(stats),
        "k_effective_bits": stats.get("k_effective_bits"),
        "v_effective_bits": stats.get("v_effective_bits"),
        "kv_bytes": store.nbytes(),
        "bf16_kv_bytes": store.bf16_nbytes(),
        "kv_ratio": stats.get("kv_ratio"),
        "peak_kv_bytes": store.peak_nbytes,
        "noise_sha256": r.noise_sha256,
        "scale_noise_sha256": r.scale_noise_sha256,
        "scale_logits_sha256": r.scale_logits_sha256,
        "tokens_sha256": r.tokens_sha256,
        "seed": ctx.args.seed,
        "sampling_seed": r.sampling_seed,
        "sampling": ctx.sampling.to_dict(),
        "model": ctx.model_name,
        "residual_window": ctx.args.residual_window,
        "sample_rate": sr,
        "num_samples": int(r.audio.shape[-1]),
        "patch_nums": list(ctx.aar.patch_nums),
        "condition": dict(cond_info),
        "condition_sha256": embedding_sha256(cond),
        "cache": store.manifest(),
        "peak_memory_bytes": peak_mem,
        "device": str(ctx.device),
        "rank": ctx.rank,
        "files": dict(AUDIO_FILES),
        "versions": ctx.versions,
        **(ctx.hashes or {}),
    }
    ctx.folder.write_rollout(item, variant, record, timings)
    return record, timings


# ----------------------------------------------------------------------------------------------------------------
# Metrics and tables

METRICS = (("lsd_db", "LSD dB"), ("log_mel_mse", "log-mel MSE"), ("snr_db", "SNR dB"),
           ("latent_cosine", "latent cos"), ("token_agreement", "tokens ="))


def _read_rollout(folder: RunFolder, item: str, variant: str):
    import soundfile as sf
    from safetensors.torch import load_file

    d = folder.rollout_dir(item, variant)
    audio, sr = sf.read(str(d / AUDIO_FILES["audio"]), dtype="float32")
    latent = load_file(str(d / AUDIO_FILES["latent"]))["latent"]
    return audio, sr, latent, load_file(str(d / AUDIO_FILES["tokens"]))["tokens"]


def clip_metrics(folder: RunFolder, item: str, variant: str) -> dict[str, Any]:
    """Metrics of one codec rollout against the clip's reference, read back from the files written."""
    from mmkv.metrics.audio import audio_metrics

    ref, test = folder.rollout_record(item, REFERENCE), folder.rollout_record(item, variant)
    for key in ("condition_sha256", "noise_sha256"):
        if ref.get(key) != test.get(key):
            raise ValueError(f"{key} differs from the reference's (rollouts from another condition or seed); delete "
                             f"{folder.rollout_dir(item, variant)} to redo it")
    ref_audio, sr, ref_lat, ref_tok = _read_rollout(folder, item, REFERENCE)
    audio, _, lat, tok = _read_rollout(folder, item, variant)
    return audio_metrics(ref_audio, audio, sr, ref_lat, lat, ref_tok, tok)["summary"]


def _fmt(x: Any, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def text_table(header: list[str], rows: list[list[str]], title: str = "") -> str:
    """Pre-formatted cells through the project's one table writer (Markdown)."""
    from mmkv.report.tables import Column, Table, to_markdown

    cols = [Column(key=f"c{i}", header=(h,)) for i, h in enumerate(header)]
    text = to_markdown(Table(name="audio", title=title, columns=cols, rows=[list(r) for r in rows]))
    return text if title else text.split("\n", 2)[2]


def clip_table(records: dict[str, dict[str, Any]], metrics: dict[str, dict[str, Any]],
               timings: dict[str, dict[str, Any] | None]) -> str:
    """One clip's rollouts; `timings` holds each variant's timings.json, None (shown as '-') where it is missing."""
    header = ["variant", "KVx", "bits", *(m[1] for m in METRICS), "time s"]
    rows = []
    for variant, rec in records.items():
        m = metrics.get(variant, {})
        rows.append([variant, _fmt(rec.get("kv_ratio")), _fmt(rec.get("effective_bits")),
                     *(_fmt(m.get(k)) for k, _ in METRICS), _fmt((timings.get(variant) or {}).get("total_s"), ".2f")])
    return text_table(header, rows)


def overall_table(per_clip: dict[str, dict[str, dict[str, Any]]], variants: list[str]) -> str:
    header = ["variant", "clips", *(f"{name} min/mean/max" for _, name in METRICS), "SNR@cap"]
    rows = []
    for v in variants:
        ms = [clip[v] for clip in per_clip.values() if v in clip]
        cells = [v, str(len(ms))]
        for key, _ in METRICS:
            vals = [m[key] for m in ms if m.get(key) is not None and not math.isnan(m[key])]
            cells.append("/".join(_fmt(f(vals)) for f in (min, np.mean, max)) if vals else "-")
        capped = sum(bool(m.get("snr_at_cap")) for m in ms)
        cells.append(f"{capped}/{len(ms)}")
        rows.append(cells)
    return text_table(header, rows)


# ----------------------------------------------------------------------------------------------------------------
# The command


def _items(args: argparse.Namespace, cond: Conditioner) -> tuple[list[str], list[Path | None]]:
    from mmkv.pipelines.aar import clap

    if args.clips:
        try:
            paths: list[Path | None] = list(clap.discover_clips(args.clips))
        except clap.ClipError as err:
            raise RunError(str(err)) from None
        names = clap.item_names(paths)
    elif cond.source is not None:
        names = cond.source.keys()
        paths = [None] * len(names)
    else:
        raise RunError("give --clips DIR|FILE... (or --embeddings PATH to condition on precomputed embeddings only)")
    if args.limit is not None:
        if args.limit < 1:
            raise RunError(f"--limit must be >= 1, got {args.limit}")
        names, paths = names[: args.limit], paths[: args.limit]
    return names, paths


def use_shipped_models(args: argparse.Namespace) -> None:
    """Without --aar: the trained tiny models shipped in the package (`mmkv.assets.trained_audio_assets`), and their
    CLAP unless --clap or --embeddings is given; a clear error when none is installed or a file fails its check."""
    from mmkv.assets import AssetError, trained_audio_assets

    if args.aar is not None:
        return
    if args.sat is not None:
        raise RunError("--sat needs --aar (the shipped models come as a pair)")
    try:
        shipped = trained_audio_assets()
    except AssetError as err:
        raise RunError(str(err)) from None
    if shipped is None:
        raise RunError("give --aar DIR: no trained audio models are shipped in this installation (mmkv/assets/audio/)")
    args.aar = str(shipped["aar"])
    if args.clap is None and args.embeddings is None:
        args.clap = str(shipped["clap"])


def run(args: argparse.Namespace) -> int:
    from mmkv.pipelines.aar.clap import ClipError
    from mmkv.pipelines.aar.loaders import load_models
    from mmkv.pipelines.aar.sample import SamplingConfig

    rank, world = rank_info()
    device = parse_device(args.device, rank)
    check_out_dir(args.out)  # a path under a file or a read-only folder fails before any model is loaded
    if args.residual_window < 1:
        raise RunError(f"--residual-window counts scales including the current one; must be >= 1, got "
                       f"{args.residual_window}")
    specs = parse_codec_list(args.codecs, args.codec, value_group=args.value_group)
    if not specs:
        raise RunError("give at least one codec: --codecs identity,octopus:b=3 (the reference is always run)")
    sampling = SamplingConfig(cfg=args.cfg, top_k=args.top_k, top_p=args.top_p)
    use_shipped_models(args)
    conditioner = Conditioner(args, device)
    names, paths = _items(args, conditioner)

    aar, sat, model_info = load_models(args.aar, sat=args.sat, device=device)
    aar_path, sat_path = Path(model_info["aar_path"]), Path(model_info["sat_path"])
    model_name = f"{aar_path.stem}+{sat_path.stem}"
    folder = RunFolder(args.out, rank, world)
    hashes = {"aar_sha256": sha256_file(aar_path), "sat_sha256": sha256_file(sat_path),
              "conditioner_sha256": conditioner.key["sha256"]}
    config = {
        "command": "compare audio",
        "kind": "audio",
        "model": model_name,
        "aar_checkpoint": str(aar_path),
        "sat_checkpoint": str(sat_path),
        **hashes,
        "aar_config": model_info["aar_config"],
        "sat_config": model_info["sat_config"],
        "conditioner": conditioner.identity,
        "conditioner_key": conditioner.key,
        "seed": args.seed,
        "sampling": sampling.to_dict(),
        "residual_window": args.residual_window,
        "value_group": args.value_group,
        "protected_layers": list(args.protected_layers),
        "codec_seed": args.codec_seed,
        "attention": args.attention,
        "codecs": [s.preset for s in specs],
        "sample_rate": sat.config.sample_rate,
        "world_size": world,
        "clips": [None if p is None else str(p) for p in paths],
    }
    manifest = folder.open_manifest(config, identity_keys=(
        "aar_sha256", "sat_sha256", "conditioner_sha256", "conditioner_key", "seed", "sampling", "residual_window",
        "value_group", "protected_layers", "codec_seed"), labels=HASH_LABELS)
    clock = manifest.start_run({"rank": rank, "world_size": world, "device": str(device),
                                "codecs": [s.preset for s in specs]})
    # (item, variant) -> failure; variant None: the clip itself could not be used
    failures = {(f["item"], f.get("variant")): f for f in manifest.data.get("failures", []) if isinstance(f, dict)}
    vers = versions()
    for pkg in ("soundfile", "soxr", "scipy"):
        try:
            import importlib.metadata as md

            vers[pkg] = md.version(pkg)
        except Exception:
            vers[pkg] = None
    stores = {REFERENCE: _make_store(args, aar, None)}
    stores.update({s.variant: _make_store(args, aar, s) for s in specs})
    ctx = Context(args, aar, sat, device, folder, model_name, rank, stores, sampling, vers, hashes=hashes)
    variants: list[tuple[str, CodecSpec | None]] = [(REFERENCE, None)] + [(s.variant, s) for s in specs]

    mine = shard(len(names), rank, world)
    per_clip_metrics: dict[str, dict[str, dict[str, Any]]] = {}
    rendered = 0
    bar = progress(total=len(mine) * len(variants), desc=f"audio rank {rank}", rank=rank)
    try:
        for index in mine:
            item, path = names[index], paths[index]
            text = str(path) if path is not None else f"embedding:{item}"
            records: dict[str, dict[str, Any]] = {}
            timings: dict[str, dict[str, Any] | None] = {}
            cond = cond_info = None
            try:
                caption = clip_caption(path)
                for variant, spec in variants:
                    bar.set_postfix_str(f"{item} / {variant}", refresh=False)
                    rec = folder.rollout_record(item, variant)
                    if rec is not None:
                        folder.check_identity(item, variant, rec, hashes, HASH_LABELS)
                        timings[variant] = folder.rollout_timings(item, variant)
                    else:
                        if cond is None:
                            cond, cond_info = conditioner.get(item, path, folder.root / "conditions")
                            for warning in clip_warnings(path, cond_info):
                                print(f"warning: {warning}", flush=True)
                            if cond_info.get("silent"):
                                print(f"warning: clip {path} is silent; its CLAP embedding carries no information",
                                      flush=True)
                        rec, timings[variant] = run_variant(ctx, item, index, text, cond, cond_info, spec, caption)
                        if rec.get("status") == "failed":
                            failures[item, variant] = rec
                            say(f"{item} {variant}: failed: {rec['error']}")
                            bar.update(1)
                            continue
                        failures.pop((item, variant), None)
                        rendered += 1
                        say(rollout_line(item, variant, timings[variant].get("total_s"), rec["kv_bytes"],
                                         rec["peak_kv_bytes"]))
                    records[variant] = rec
                    bar.update(1)
            except ClipError as err:
                failures[item, None] = {"item": item, "item_index": index, "variant": None, "path": text,
                                        "reason": "unusable clip", "error": str(err)}
                print(f"error: {err} (skipped; other clips go on)", flush=True)
                bar.update(len(variants) - len(records))
                manifest["failures"] = list(failures.values())
                manifest.save()
                continue
            failures.pop((item, None), None)
            metrics: dict[str, dict[str, Any]] = {}
            for variant, spec in variants[1:]:
                if variant not in records or REFERENCE not in records:
                    continue  # a failed rollout (listed in failures) has nothing to score
                try:
                    metrics[variant] = clip_metrics(folder, item, variant)
                except ValueError as err:  # e.g. audio too short for the STFT: say so, do not invent numbers
                    metrics[variant] = {}
                    print(f"warning: {item}/{variant}: metrics not computed ({err})", flush=True)
            per_clip_metrics[item] = metrics
            for variant, rec in records.items():
                manifest.add_rollout({
                    "item": item, "item_index": index, "variant": variant, "text": text,
                    "dir": str(folder.rollout_dir(item, variant).relative_to(folder.root)),
                    "noise_sha256": rec.get("noise_sha256"), "tokens_sha256": rec.get("tokens_sha256"),
                    "kv_ratio": rec.get("kv_ratio"), "effective_bits": rec.get("effective_bits"),
                    "peak_kv_bytes": rec.get("peak_kv_bytes"), "metrics": metrics.get(variant),
                }, timings.get(variant))
            manifest["failures"] = list(failures.values())
            manifest.save()
            bar.write(f"\n{item} ({text})\n{clip_table(records, metrics, timings)}")
    finally:
        bar.close()
    clock["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    manifest["failures"] = list(failures.values())
    manifest.save()

    say(f"\nrank {rank}: {rendered} rollout(s) rendered, {len(per_clip_metrics)} clip(s) scored, "
        f"{len(failures)} failure(s), in {folder.root}")
    print(f"\noverall, rank {rank} ({len(per_clip_metrics)} clips; LSD in dB, SNR capped at 120 dB)")
    print(overall_table(per_clip_metrics, [v for v, _ in variants[1:]]))
    if failures:
        print(f"\n{len(failures)} clip(s) or rollout(s) failed:")
        for f in failures.values():
            where = f["path"] if f.get("variant") is None else f"{f['item']} {f['variant']}"
            print(f"  {where}: {f['error']}")
        return 1
    return 0
