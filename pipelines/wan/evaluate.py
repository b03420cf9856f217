"""`mmkv eval video`: how well a video model follows held-out procedural prompts, and whether it reads its cache.

Rolls a model out on the captions of held-out scene seeds (`scenes.held_out_seeds`: never trained on), with the
native cache, through the same pipeline as `mmkv generate video` (one rollout a prompt, noise from
`NoiseStream(seed, index)`), and scores every clip with the rule-based detector (`mmkv.metrics.adherence`): colour,
shape, size, direction and speed accuracy against the caption, and the consistency of the attributes the caption does
not state with block 1. Two controls:

* `--no-past`: every block attends only to itself (the store is emptied after each commit). A model that reads its
  cache loses the unnamed attributes' consistency here; one that ignores its past does not.
* `--random-dit`: the DiT re-initialised at random (same architecture), with the same VAE and text encoder: the
  chance level of every score.

`--given-first-block` adds continuations: the held-out clip's own first CausVid block (pixel frames 0-8, 3 latent
frames through the VAE) opens the video and the model generates the rest (Self-Forcing's `initial_latent`), with the
cache and, with `--no-past`, without it. A free rollout mixes two questions, whether the model can draw a first
block from the caption and whether later blocks read it back; a given first block isolates the second, the one a
KV codec's error reaches. The named attributes are then partly given too: read them from the free rollouts.

It also measures the VAE's held-out reconstruction PSNR. The result is one JSON (`--out`), the numbers
`docs/training.md` reports for the shipped weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmkv.pipelines.common import NoiseStream, atomic_write_json, parse_device, versions
from mmkv.pipelines.wan import scenes

ATTRS = ("colour", "shape", "size", "direction", "speed")
GIVEN_LATENT_FRAMES = 3  # one CausVid block (pixel frames 0-8); a whole number of the frame-wise loop's blocks too


def _accuracy(values: list[bool | None]) -> float | None:
    known = [v for v in values if v is not None]
    # A clip where no object was found counts as wrong: the model failed to draw what was asked.
    return None if not values else round(100.0 * sum(bool(v) for v in known) / len(values), 2)


def summarize(scores: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy (%) per named attribute over all clips, the share of clips with an object found, and the mean
    consistency and background PSNR of the unnamed attributes."""
    out: dict[str, Any] = {"clips": len(scores)}
    out["found_pct"] = round(100.0 * sum(bool(s["found"]) for s in scores) / max(1, len(scores)), 2)
    for attr in ATTRS:
        out[f"{attr}_pct"] = _accuracy([s.get(f"{attr}_ok") for s in scores])
    cons = [s["consistency"] for s in scores if s.get("consistency") is not None]
    out["consistency_pct"] = round(100.0 * float(np.mean(cons)), 2) if cons else None
    psnr = [w["background_psnr"] for s in scores for w in s.get("windows", [])[1:]
            if w.get("background_psnr") is not None]
    out["background_psnr_db"] = round(float(np.mean(psnr)), 3) if psnr else None
    if any(s.get("prompt") for s in scores):
        out["shape_by_named"] = shape_table(scores)
    return out


def shape_table(scores: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per shape the prompts name: the clips, how many the detector read as that shape, and what it read in each
    ("none": no object found). A shape accuracy of 44% can be four shapes at 44% or three right and one never drawn
    (the trained sets of 2026-12-06 drew no square: docs/training.md); this says which."""
    table: dict[str, dict[str, Any]] = {}
    for s in scores:
        named = (scenes.parse_caption(s.get("prompt")) or {}).get("shape")
        if named is None:
            continue
        row = table.setdefault(named, {"clips": 0, "right": 0, "read_as": {}})
        row["clips"] += 1
        row["right"] += bool(s.get("shape_ok"))
        read = (s.get("shape") if s.get("found") else None) or "none"
        row["read_as"][read] = row["read_as"].get(read, 0) + 1
    return {k: {**table[k], "read_as": dict(sorted(table[k]["read_as"].items()))} for k in sorted(table)}


def random_dit_like(dit, seed: int):
    """A DiT of the same configuration with diffusers' default random initialisation (seeded, global RNG untouched)."""
    from diffusers import WanTransformer3DModel

    from mmkv.pipelines.wan.model import CausalWan

    cfg = {k: v for k, v in dit.config.items() if not k.startswith("_")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(**cfg)
    return CausalWan(transformer.to(device=dit.device, dtype=dit.dtype).eval().requires_grad_(False))


@torch.no_grad()
def first_block_latents(vae, scene_seed: int, *, height: int, width: int) -> torch.Tensor:
    """Normalised latents [1, GIVEN_LATENT_FRAMES, C, h, w] of a scene's first pixel frames, encoded on their own
    (the VAE is causal: the same as the first latent frames of the whole clip's encode)."""
    from mmkv.pipelines.wan.train import encode_latents, render_pixels

    pixels, _ = render_pixels([scene_seed], frames=1 + 4 * (GIVEN_LATENT_FRAMES - 1), height=height, width=width,
                              device=next(vae.parameters()).device)
    return encode_latents(vae, pixels)


class StackedNoise:
    """The `NoiseStream`s of several rollouts drawn as one batch: row i of every draw is what stream i alone would
    have drawn (each draws its [1, ...] share in turn), so a batched rollout sees each prompt's own noise."""

    def __init__(self, streams: list[NoiseStream]):
        self.streams = streams

    def randn(self, *shape: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
        if shape[0] != len(self.streams):
            raise ValueError(f"a draw of batch {shape[0]} from {len(self.streams)} stacked noise streams")
        return torch.cat([s.randn(1, *shape[1:], device=device, dtype=dtype) for s in self.streams])


@torch.no_grad()
def evaluate_preset(comps, preset_name: str, prompts: list[tuple[int, str]], *, frames: int, height: int,
                    width: int, seed: int, no_past: bool = False, given_first_block: bool = False,
                    keep_frames: int = 0, batch: int = 1) -> dict[str, Any]:
    """Roll out and score every prompt, `batch` prompts a rollout (each with its own `NoiseStream(seed, index)`:
    the same draws at any batch; the results agree up to the floating-point order of batched kernels)."""
    from mmkv.metrics.adherence import score_clip
    from mmkv.pipelines.wan.loop import get_preset
    from mmkv.pipelines.wan.pipeline import WanVideoPipeline

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    pipe = WanVideoPipeline(comps, get_preset(preset_name))
    grid = pipe.grid(frames, height, width)
    scores, kept = [], []
    t0 = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = list(enumerate(prompts))[first:first + batch]
        store = pipe.make_store(None, residual_window=1)
        on_block = (lambda b, n: store.reset()) if no_past else None
        prefix = torch.cat([first_block_latents(comps.vae, scene_seed, height=height, width=width)
                            for _, (scene_seed, _) in group]) if given_first_block else None
        noise = StackedNoise([NoiseStream(seed, index) for index, _ in group])
        res = pipe.generate(pipe.encode_text([text for _, (_, text) in group]), noise, store, grid,
                            on_block=on_block, prefix=prefix)
        videos = pipe.decode(res.latents)
        for (index, (scene_seed, text)), video in zip(group, videos):
            s = score_clip(video, scenes.parse_caption(text), scenes.PALETTE)
            scores.append({"seed": scene_seed, "prompt": text, **{k: v for k, v in s.items() if k != "windows"},
                           "windows": s["windows"]})
            if index < keep_frames:
                kept.append(video)
    return {"preset": preset_name, "no_past": no_past,
            "first_block": "given" if given_first_block else "generated", "seconds": round(time.perf_counter() - t0, 2),
            "summary": summarize(scores), "clips": [_slim(s) for s in scores], "frames": kept}


def _slim(score: dict[str, Any]) -> dict[str, Any]:
    keep = ("seed", "prompt", "found", "adherence", "consistency") + ATTRS + tuple(f"{a}_ok" for a in ATTRS)
    return {k: score.get(k) for k in keep}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="CausVid-style checkpoint (folder or file)")
    parser.add_argument("--base", required=True, help="Wan base folder (VAE, text encoder, tokenizer, DiT config)")
    parser.add_argument("--presets", default="causvid,causal-forcing-frame",
                        help="comma-separated loop presets to evaluate (default: %(default)s)")
    parser.add_argument("-n", "--num-prompts", type=int, default=32, help="held-out prompts (default: %(default)s)")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0, help="noise seed of the rollouts")
    parser.add_argument("--no-past", action="store_true", help="also score rollouts whose blocks attend only to "
                                                                "themselves (does the model read its cache?)")
    parser.add_argument("--random-dit", action="store_true", help="also score a randomly initialised DiT of the "
                                                                   "same architecture (chance level)")
    parser.add_argument("--given-first-block", action="store_true",
                        help="also score continuations of each held-out clip's own first block (pixel frames 0-8): "
                             "does the model keep what its cache holds?")
    parser.add_argument("--vae-clips", type=int, default=16, help="held-out clips for the VAE's PSNR (0: skip)")
    parser.add_argument("--batch", type=int, default=1,
                        help="prompts rolled out together, each with its own noise; the scores agree up to the "
                             "floating-point order of batched kernels. For a GPU, where a tiny model's rollout is "
                             "bound by kernel launches (not yet timed); on two CPU cores 8 prompts took as long in "
                             "one batch as one at a time")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU where there is one, "
                                                       "else the CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", required=True, help="the JSON file to write")


def run(args: argparse.Namespace) -> int:
    from mmkv.pipelines.wan.loaders import load_wan

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give the path of the JSON file to write")
    device = parse_device(args.device)  # None: the GPU where there is one, as the help says
    if args.threads:
        torch.set_num_threads(args.threads)
    comps = load_wan(args.ckpt, args.base, device=device)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    prompts = [(s, scenes.caption(scenes.sample_scene(s))) for s in scenes.held_out_seeds(args.num_prompts)]
    shape = {"frames": args.frames, "height": args.height, "width": args.width, "seed": args.seed}
    batch = {"batch": args.batch}
    # The files scored, with their SHA-256 (`mmkv ship video --eval` checks that a release's scores are its own).
    record: dict[str, Any] = {"ckpt": comps.files.get("dit"), "base": comps.files.get("base"),
                              "vae": comps.files.get("vae"), "text_encoder": comps.files.get("text_encoder"),
                              **shape, **batch, "device": str(device), "presets": presets,
                              "controls": {"no_past": args.no_past, "random_dit": args.random_dit,
                                           "given_first_block": args.given_first_block},
                              "held_out_seeds": [s for s, _ in prompts], "versions": versions(), "runs": []}
    # Each finished run is kept in OUT.partial as it lands (a kill loses only the run in progress), and a rerun with
    # the same settings continues from it; OUT itself is written once, whole, at the end (`mmkv train all` takes it
    # as the eval's done marker).
    partial = out.with_name(out.name + ".partial")
    record["runs"] = resumed_runs(partial, record)
    done = {_run_key(r) for r in record["runs"]}
    starts = [False] + ([True] if args.given_first_block else [])
    variants = [(given, no_past) for given in starts for no_past in ([False, True] if args.no_past else [False])]
    todo = [("trained", preset, given, no_past) for preset in presets for given, no_past in variants]
    if args.random_dit:
        todo += [("random DiT", preset, given, False) for preset in presets for given in starts]
    trained = comps.dit
    for model, preset, given, no_past in todo:
        if (model, preset, given, no_past) in done:
            print(f"{preset:<24} {_label(given, _kind(model, no_past))} (from {partial.name})", flush=True)
            continue
        if model == "random DiT" and comps.dit is trained:
            comps.dit = random_dit_like(trained, seed=args.seed)
        res = evaluate_preset(comps, preset, prompts, no_past=no_past, given_first_block=given, **shape, **batch)
        res.pop("frames")
        record["runs"].append({"model": model, **res})
        atomic_write_json(partial, record)
        print(f"{preset:<24} {_label(given, _kind(model, no_past))} {_line(res['summary'])}", flush=True)
    comps.dit = trained
    order = {key: i for i, key in enumerate(todo)}
    record["runs"].sort(key=lambda r: order[_run_key(r)])
    if args.vae_clips:
        from mmkv.pipelines.wan.train import vae_held_out

        held_out = vae_held_out(comps.vae, scenes.held_out_seeds(args.vae_clips), frames=args.frames,
                                height=args.height, width=args.width, device=device)
        record["vae_held_out_psnr_db"], record["vae_held_out"] = held_out["psnr_db"], held_out
        print(f"VAE held-out PSNR {held_out['psnr_db']} dB over {args.vae_clips} clips (on the object "
              f"{held_out['object_psnr_db']} dB, found in {held_out['detector']['found_pct']}% of them)")
    atomic_write_json(out, record)
    partial.unlink(missing_ok=True)
    return 0


def _run_key(run: dict[str, Any]) -> tuple[str, str, bool, bool]:
    return run["model"], run["preset"], run["first_block"] == "given", bool(run["no_past"])


def _kind(model: str, no_past: bool) -> str:
    return "random" if model != "trained" else "no past" if no_past else "cache"


def resumed_runs(partial: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The finished runs an earlier, killed `eval video` with the same settings left in `partial` (none if there is
    no such file). Rows are only merged when every setting that could change a score matches: the scored files'
    SHA-256, the shape, the seed, the batch, the prompts, the device and the library versions; else the rerun is
    refused, so that a file never mixes two settings' rows."""
    if not partial.is_file():
        return []
    import json

    try:
        old = json.loads(partial.read_text())
        runs = list(old["runs"])
        for run in runs:
            _run_key(run)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{partial} is not a partial `mmkv eval video` result ({e}); remove it to start "
                         "over") from None
    differ = [k for k in record if k != "runs" and old.get(k) != record[k]]
    if differ:
        raise ValueError(f"{partial} holds runs of other settings (they differ in {', '.join(differ)}); remove it "
                         f"to start over, or rerun with the settings it was made with")
    return runs


def _label(given: bool, kind: str) -> str:
    return f"{'given 1st, ' if given else ''}{kind:<8}".ljust(19)


def _line(s: dict[str, Any]) -> str:
    line = " ".join(f"{k.removesuffix('_pct')} {s[k]}" for k in ("found_pct", "colour_pct", "shape_pct",
                                                                  "direction_pct", "speed_pct", "consistency_pct"))
    line += f" bgPSNR {s['background_psnr_db']}"
    if s.get("shape_by_named"):
        line += " shapes " + shapes_text(s)
    return line


def shapes_text(summary: dict[str, Any]) -> str:
    """`circle 6/7, cross 6/10, ...`: each named shape's clips read as it (`shape_by_named`; "" without one)."""
    return ", ".join(f"{k} {v['right']}/{v['clips']}" for k, v in (summary.get("shape_by_named") or {}).items())
