"""`mmkv demo`: the whole harness offline on tiny models, on a CPU, in a few minutes.

    mmkv demo [--random | --trained] [--out DIR] [--seed 0] [--quick]

By default the video runs use the trained tiny video model shipped in the package (`mmkv/assets/video/`, checked
against its SHA-256 sums by `mmkv.assets.trained_video_assets`; docs/training.md) at its own size, 64 x 96 px and 81
frames, prompted with captions of held-out procedural scenes (`scenes.held_out_seeds`), so the report also scores
prompt adherence and scene consistency; that is, when its own held-out scores clear the demo's bar
(`mmkv.assets.demo_ready`), or with `--trained`. Without shipped weights, below the bar, or with `--random`, it runs
the tiny random models below. A trained video rollout costs ~15 random ones, so the trained plan runs every codec
(QVG and TCQ too) on two CausVid prompts and OCTOPUS 2-bit on the frame-wise loop. With the eighth training run's shipped video set (the
default since it cleared the bar) and random audio models, the whole demo took 137 s on two cores and two threads:
CausVid 91 s, frame-wise 18 s, audio 11 s, report 13 s (one prompt: 61 s; three: 165 s). One prompt was too few:
the first held-out caption is one of the two of 32 where that set's reference draws no object, so every row's
adherence was 0. With the fourth training run's video release placed in a
temporary asset folder (not shipped) and the random audio models, the whole demo took 141 s on two idle cores
with two torch threads (`TRAINED_THREADS`): the CausVid run 82 s, the frame-wise run 14 s, audio 19 s, report 15 s.
On one thread the CausVid run took 108 s (5-6 s a rollout, 3.3 s of it the VAE decode of 81 frames; TCQ 13 s at 2
bits and 25 s at 4 bits). Before the VAE's convolutions went through oneDNN
(`mmkv.pipelines.wan.loaders.onednn_conv3d_`) and the TCQ rows to fewer trellis states (`TCQ` below), the same demo
took 281 s on one thread. Its RMS norms as a sum of squares (`mmkv.pipelines.wan.loaders.cpu_vae_paths_`) took the
decode from 2.5 to 1.85 s on one thread (2026-12-07, DEMO_VERSION 5). With the fifth run's audio models beside it
(`mmkv ship audio` into a temporary `mmkv/assets/audio/`), the whole demo took 151 s: CausVid 79 s, frame-wise
15 s, `compare audio` 36 s, report 15 s.
With the nineteenth run's 6-layer DiT (and the shipped audio set) the CausVid run took 126 s on two threads and the
demo 185 s; as two single-threaded rank processes, one prompt each (`_mmkv_ranks`), the CausVid run took 101 s.

The audio half likewise uses the trained tiny audio models shipped in the package (`mmkv/assets/audio/`, the release
`mmkv ship audio` writes, checked by `mmkv.assets.trained_audio_assets`) when they are installed and --random is not
given: `mmkv compare audio` reads them through its own default (no --aar), on held-out procedural clips
(`sounds.held_out_seeds`, rendered at the models' rate and clip length) whose captions lie beside them, so the report
scores audio adherence too. With `mmkv train audio`'s `tiny` models (a depth-4 AAR, 1.2-1.4 s a rollout on one core)
and the random video models, the full demo took 175 s, `compare audio` 52 s of it, on two busy shared cores and
one torch thread (before the speed-ups above). Without
them, or with --random, the audio half runs the tiny random models on the synthetic clips below.
Trained and random demos go to separate default folders (runs/demo, runs/demo-random); one folder never mixes them.

1. Writes tiny randomly initialised checkpoints of the real architectures, in their original release formats, to
   OUT/assets/: a base Wan2.1 directory (original layout: Wan2.1_VAE.pth, the umT5 encoder .pth, a tokenizer,
   config.json), the DiT as a CausVid `model.pt` and as a Causal Forcing `framewise.pt`, AAR + SAT `.pth` containers,
   a small random transformers CLAP directory (no CLAP weights exist offline), a few synthetic clips (chirp, chord,
   noise bursts, clicks) and a prompt file picked from prompts/prompts.txt. The tiny DiT is drawn with
   `kv_sensitive=True` (sharp self-attention whose output dominates the residual stream; see
   `mmkv.pipelines.wan.tiny.kv_sensitive_`), so video rollouts depend on the cached past and 2-bit caches visibly
   drift, as the tiny AAR's re-init does for audio (`mmkv.pipelines.aar.tiny`).
2. Runs the real commands on them: `mmkv generate video` (CausVid chunk-wise and Causal Forcing frame-wise) and
   `mmkv compare audio`, each with the reference (native cache) and identity plus four codecs at 2 and 4 bits.
3. Runs `mmkv report` over all runs: tables (md, csv, json, latex), plots and the HTML gallery in OUT/report/.
4. Prints where everything is and the headline tables.

Every step goes through `mmkv.cli.main`, exactly as typed on the command line (each command's output is kept in
OUT/logs/). A rerun resumes: assets are written once, finished rollouts are skipped, cached metrics are reused.
In trained mode, step 1 writes only the audio assets and the prompt file; the video runs read the shipped weights in
place. With shipped audio models, step 1 writes the held-out clips (and their captions) only, and `demo.json` records
the audio release (`audio_weights`: its SHA256SUMS' SHA-256), so a folder of one set of audio weights never takes runs
of another or of the random ones.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmkv.cli import UsageError
from mmkv.io import save_pretrained

DEFAULT_OUT = "runs/demo"  # trained video model
DEFAULT_OUT_RANDOM = "runs/demo-random"
DEMO_VERSION = 5  # bump when the assets, the plan or the CPU decode path change, so old OUT folders are not mixed
PROMPTS_FILE = Path(__file__).resolve().parent.parent / "prompts" / "prompts.txt"

# identity (bit-exact with the reference: the metrics' ideal values) and four codecs at two bit widths.
CODECS = ("identity", "octopus:b=2", "octopus:b=4", "oscar:bits=2", "oscar:bits=4", "turboquant-mse:b=2",
          "turboquant-mse:b=4", "kivi:bits=2,group=32", "kivi:bits=4,group=32")
QUICK_CODECS = ("identity", "octopus:b=2", "turboquant-mse:b=4", "kivi:bits=2,group=32")
# The trained model adds QVG (a span codec made for video caches, mmkv/codecs/qvg.py) with 16 centres a span where
# the release has 256: its spans are 2-3 latent frames of 96 tokens here, not 4680-token chunks, and 256 bf16 centres
# over 288 tokens store more than the bf16 cache (KV x 0.9 at INT2, measured). 16 / 288 keeps the release's centres
# per token (256 / 4680), so its bits per value too (3.1 at INT2 on a 288-token span; KV x 3.6 measured).
QVG = ("qvg:bits=2,centroids=16", "qvg:bits=4,centroids=16")
# and TCQ at OCTOPUS b=2's and b=4's effective bits (2.602 and 4.617 at head dim 128, fp32 norms on both sides: the
# synthetic bench's iso-rate rows), so the trained table compares them at equal stored bits. With fewer trellis
# states than L = 11 (4 bits' default): the torch Viterbi encoder costs 2^L state updates a step, and at L = 11 one
# trained rollout took 52 s on two cores against 8 s for OCTOPUS. Encoding one block's [1, 2, 288, 128] keys on two
# cores: 119 ms at 2 bits and L = 8 (1118 ms at L = 11), 360 ms at 4 bits and L = 10 (687 ms); relative MSE on
# N(0, 1) vectors 0.057 and 0.0053 (L = 11: 0.048 and 0.0044; OCTOPUS b=2 / b=4: 0.083 / 0.0067). Both tables ship.
TCQ = ("tcq:bits=2,hi=45,norm=32,L=8", "tcq:bits=4,hi=47,norm=32,L=10")
TRAINED_CODECS = (*CODECS, *QVG, *TCQ)
TRAINED_QUICK_CODECS = ("identity", "octopus:b=2", QVG[0])
# The trained model's clips (docs/training.md): 21 latent frames of 16 x 24, 96 tokens a frame.
TRAINED_VIDEO = {"frames": 81, "height": 64, "width": 96}


@dataclass(frozen=True)
class VideoModel:
    preset: str  # `mmkv generate video --model`
    checkpoint: str  # key of the assets: "causvid" (model.pt) or "causal_forcing" (framewise.pt)
    codecs: tuple[str, ...] | None = None  # None: the plan's codecs


@dataclass(frozen=True)
class Plan:
    """What one demo mode runs. Sizes are chosen so the default finishes in about three minutes on two cores."""

    mode: str
    video: tuple[VideoModel, ...]
    prompts: int
    audio_model: str  # `mmkv.pipelines.aar.tiny` configuration
    clips: int
    codecs: tuple[str, ...]  # audio's, and each video model's unless it names its own

    def video_codecs(self, vm: VideoModel) -> tuple[str, ...]:
        return self.codecs if vm.codecs is None else vm.codecs


PLANS = {
    "full": Plan("full", (VideoModel("causvid", "causvid"), VideoModel("causal-forcing-frame", "causal_forcing")),
                 prompts=4, audio_model="tiny", clips=4, codecs=CODECS),
    "quick": Plan("quick", (VideoModel("causvid", "causvid"),), prompts=2, audio_model="tiny", clips=2,
                  codecs=QUICK_CODECS),
    # The shipped trained video model (`mmkv.assets`). One of its rollouts takes 5-6 s on one torch thread (a random
    # one 0.5 s), 3.3 s of it the VAE decode of 81 frames, so the trained plan runs every codec on two CausVid
    # prompts and one codec on the frame-wise loop: 28 + 4 rollouts, 137 s in all on two cores. The
    # frame-wise loop reads the same checkpoint: the distilled model learned both loops' timesteps
    # (docs/training.md).
    "trained-full": Plan("trained-full", (VideoModel("causvid", "causvid", TRAINED_CODECS),
                                          VideoModel("causal-forcing-frame", "causvid", ("octopus:b=2",))),
                         prompts=2, audio_model="tiny", clips=4, codecs=CODECS),
    "trained-quick": Plan("trained-quick", (VideoModel("causvid", "causvid", TRAINED_QUICK_CODECS),),
                          prompts=2, audio_model="tiny", clips=2, codecs=QUICK_CODECS),
}

# A tiny CLAP: 512-d projection as in laion/larger_clap_general, tiny towers
# (audio hidden = patch_embeds_hidden_size * 2**(stages - 1) = 128).
TINY_CLAP_AUDIO = dict(patch_embeds_hidden_size=16, depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 4, 8],
                       hidden_size=128, projection_dim=512)
TINY_CLAP_TEXT = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=1,
                      intermediate_size=16, projection_dim=512, max_position_embeddings=32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pick = parser.add_mutually_exclusive_group()
    pick.add_argument("--random", action="store_true",
                      help="tiny random models (fast) instead of the trained tiny models shipped in the package (the "
                           "default when they are installed and their held-out scores clear the demo's bar)")
    pick.add_argument("--trained", action="store_true",
                      help="the shipped trained tiny models even where their held-out scores are below the demo's "
                           "bar (mmkv.assets.DEMO_BARS)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"demo folder: assets, runs, report, logs (default {DEFAULT_OUT}, or "
                             f"{DEFAULT_OUT_RANDOM} for the random models; reruns resume)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny models, clips and rollout noise")
    parser.add_argument("--quick", action="store_true",
                        help="even smaller (one video model, two prompts, two clips, a few codecs): for tests")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="random models only: prompt file to pick the demo prompts from (default: the "
                             "repository's prompts/prompts.txt; the trained model gets held-out scene captions)")
    parser.add_argument("--lpips", choices=("auto", "alexnet", "random", "off"), default="auto",
                        help="LPIPS trunk for the report: auto = torchvision's ImageNet AlexNet when it is in the "
                             "torch hub cache, else a seeded random trunk (marked †, not LPIPS)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: GPU if present, else CPU)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch intra-op CPU threads (default: 1 for the random models, whose ops are too small "
                             "to gain from more and whose extra threads spin-wait on a busy machine; 2 for the "
                             "trained video model, at most the CPUs there are, whose CPU runs of many codecs then "
                             "go as that many single-threaded processes, one a prompt; 0 = torch's default, "
                             "in one process)")


# ----------------------------------------------------------------------------------------------------------------
# Assets


def _pick_prompts(path: str | Path, n: int) -> list[str]:
    """n prompts spread evenly over the file, so the demo sees several kinds of motion (the file is grouped by
    kind)."""
    from mmkv.pipelines.common import read_prompts

    if not Path(path).is_file():
        raise UsageError(f"prompt file {path} not found; pass --prompts FILE (one prompt per line)")
    prompts = read_prompts(path)
    idx = np.linspace(0, len(prompts) - 1, num=min(n, len(prompts))).round().astype(int)
    return [prompts[i] for i in dict.fromkeys(idx.tolist())]


def synthetic_clips(seed: int, n: int) -> list[tuple[str, np.ndarray, int]]:
    """(name, samples [N] or [N, C] float32 in [-1, 1], sample rate): a log chirp, a tremolo chord (stereo),
    band-limited noise bursts and decaying clicks, at the sample rates clips come in, 2-3 s each. Random parts draw
    from a numpy Generator seeded by `seed` (never a global RNG)."""
    rng = np.random.default_rng([seed, 0x6D6D6B76])
    clips = []

    sr = 48_000
    t = np.arange(int(3.0 * sr)) / sr
    f0, f1 = 80.0, 8_000.0
    phase = 2 * np.pi * f0 * 3.0 / np.log(f1 / f0) * (np.exp(t / 3.0 * np.log(f1 / f0)) - 1)
    clips.append(("chirp", 0.4 * np.sin(phase), sr))

    sr = 44_100
    t = np.arange(int(2.5 * sr)) / sr
    chord = sum(np.sin(2 * np.pi * f * t) for f in (220.0, 277.18, 329.63)) / 3
    trem = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t)
    clips.append(("chord", 0.5 * np.stack([chord * trem, chord * (1 - 0.5 * trem)], axis=1), sr))

    sr = 16_000
    t = np.arange(int(2.0 * sr)) / sr
    noise = np.convolve(rng.standard_normal(t.size), np.hanning(9) / np.hanning(9).sum(), mode="same")
    gate = (np.sin(2 * np.pi * 3.0 * t) > 0.3).astype(np.float64)
    clips.append(("noise_bursts", 0.8 * noise * gate, sr))

    sr = 22_050
    t = np.arange(int(2.0 * sr)) / sr
    clicks = np.zeros_like(t)
    for onset in np.sort(rng.uniform(0, 1.8, size=8)):
        k = t >= onset
        clicks[k] += np.exp(-(t[k] - onset) * 40.0) * np.sin(2 * np.pi * rng.uniform(150, 600) * (t[k] - onset))
    clips.append(("clicks", 0.9 * clicks / np.abs(clicks).max(), sr))

    return [(name, np.clip(x, -1, 1).astype(np.float32), sr) for name, x, sr in clips[:n]]


def write_tiny_clap(directory: str | Path, seed: int = 0) -> Path:
    """A random transformers `ClapModel` with a 512-d projection, saved like laion/larger_clap_general together with
    its feature extractor, for the offline CLAP path. Weights are drawn from a private generator."""
    import torch
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

    from mmkv.pipelines.wan.tiny import reinit_

    with torch.random.fork_rng(devices=[]):  # transformers initialises from the global RNG: leave it untouched
        model = ClapModel(ClapConfig(text_config=TINY_CLAP_TEXT, audio_config=TINY_CLAP_AUDIO, projection_dim=512))
    reinit_(model, seed, "clap").eval()
    d = Path(directory)
    save_pretrained(model, d)
    # larger_clap_general's preprocessor: rand_trunc + repeatpad (the CLI truncates first, so rand_trunc never runs)
    save_pretrained(ClapFeatureExtractor(truncation="rand_trunc", padding="repeatpad"), d)
    return d


def held_out_captions(n: int) -> list[str]:
    """Captions of the first n held-out scene seeds (never trained on): the procedural prompts the report scores for
    adherence."""
    from mmkv.pipelines.wan import scenes

    return [scenes.caption(scenes.sample_scene(s)) for s in scenes.held_out_seeds(n)]


def _identity(plan: Plan, seed: int, trained: dict[str, Any] | None,
              audio: dict[str, Any] | None = None) -> dict[str, Any]:
    """What one demo folder is made of. `video_weights` (and `audio_weights`, present only with shipped audio
    models, so a random folder's files stay as they were) name the shipped weights by their sums' SHA-256, so a
    folder of one trained release never takes runs of another (nor of the random models)."""
    identity = {"version": DEMO_VERSION, "mode": plan.mode, "seed": seed,
                "video_weights": trained["sums_sha256"] if trained else "random"}
    if audio:
        identity["audio_weights"] = audio["sums_sha256"]
    return identity


def _same_identity(have: Any, want: dict[str, Any]) -> bool:
    """`have` (a stored identity) is `want`; a missing `audio_weights` means the random audio models."""
    return isinstance(have, dict) and all(have.get(k) == want.get(k) for k in {*want, "audio_weights"})


def held_out_sounds(n: int, sample_rate: int, samples: int) -> list[tuple[str, np.ndarray, str]]:
    """(name, samples [samples] float32, caption) of the first n held-out procedural sounds
    (`sounds.held_out_seeds`, never trained on), rendered at the audio models' rate and clip length."""
    from mmkv.pipelines.aar import sounds

    seeds = sounds.held_out_seeds(n)
    drawn = [sounds.sample_sound(seed) for seed in seeds]
    waves = sounds.render(drawn, sample_rate, samples / sample_rate).numpy()
    return [(f"heldout_{seed}", wave, sounds.caption(sound)) for seed, sound, wave in zip(seeds, drawn, waves)]


def write_held_out_clips(directory: Path, n: int, models: dict[str, Any]) -> list[str]:
    """The held-out sounds as float WAVs at the rate of the shipped models (`mmkv.assets.trained_audio_assets`),
    each with its caption beside it (`<stem>.txt`, which `mmkv compare audio` records for the report's adherence
    score); the paths of the WAVs."""
    from mmkv.pipelines.aar.conditioning import CAPTION_SUFFIX
    from mmkv.pipelines.aar.loaders import load_models
    from mmkv.pipelines.common import atomic_save_wav, atomic_write_text

    _, sat, _ = load_models(models["aar"])
    paths = []
    for name, wave, caption in held_out_sounds(n, sat.config.sample_rate, sat.config.num_samples):
        atomic_write_text(directory / f"{name}{CAPTION_SUFFIX}", caption + "\n")
        paths.append(str(atomic_save_wav(directory / f"{name}.wav", wave, sat.config.sample_rate)))
    return paths


def write_assets(root: Path, plan: Plan, seed: int, prompts_file: str | Path | None,
                 trained: dict[str, Any] | None = None, audio: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write every input of the demo under `root` (skipped when root/assets.json says it is complete) and return
    the paths, as written to assets.json (last, atomically). With `trained` (`mmkv.assets.trained_video_assets`),
    the video entries point at the shipped weights and the prompts are held-out scene captions; with `audio`
    (`mmkv.assets.trained_audio_assets`), the audio entries point at the shipped models and the clips are held-out
    procedural sounds with their captions."""
    import soundfile as sf

    from mmkv.pipelines.aar.tiny import write_tiny_checkpoints
    from mmkv.pipelines.common import atomic_path, atomic_write_json, atomic_write_text, read_json
    from mmkv.pipelines.wan.tiny import write_tiny_assets

    marker = root / "assets.json"
    identity = _identity(plan, seed, trained, audio)
    if marker.is_file():
        done = read_json(marker)
        if _same_identity(done, identity) and all(Path(p).exists() for p in _paths(done)):
            return done
    if trained:
        prompts, source = held_out_captions(plan.prompts), f"scenes.held_out_seeds({plan.prompts})"
        video = {"wan_base": str(trained["base"]), "causvid": str(trained["causvid"])}
    else:
        prompts_file = prompts_file or PROMPTS_FILE
        prompts, source = _pick_prompts(prompts_file, plan.prompts), str(prompts_file)
        # kv_sensitive: the plain tiny DiT barely reads its cache (2-bit caches ~46 dB PSNR, LPIPS 0.000)
        tiny = write_tiny_assets(root / "wan", layout="original", seed=seed, kv_sensitive=True)
        video = {"wan_base": str(tiny["base"]), "causvid": str(tiny["causvid"]),
                 "causal_forcing": str(tiny["causal_forcing"])}
    clips_dir = root / "clips"
    if audio:
        from mmkv.pipelines.aar.loaders import find_checkpoints

        aar, sat = find_checkpoints(audio["aar"])
        clap = audio["clap"]
        clips = write_held_out_clips(clips_dir, plan.clips, audio)
    else:
        aar, sat = write_tiny_checkpoints(root / "aar", plan.audio_model, seed=seed)
        clap = write_tiny_clap(root / "clap", seed)
        clips = []
        for name, samples, sr in synthetic_clips(seed, plan.clips):
            path = clips_dir / f"{name}.wav"
            with atomic_path(path) as tmp:
                sf.write(str(tmp), samples, sr, subtype="PCM_16", format="WAV")
            clips.append(str(path))
    prompt_path = atomic_write_text(root / "prompts.txt", "".join(p + "\n" for p in prompts))
    assets = {**identity, "prompts_source": source, "prompts": str(prompt_path), **video,
              "aar_dir": str(aar.parent), "aar": str(aar), "sat": str(sat), "clap": str(clap),
              "clips_dir": str(clips_dir), "clips": clips}
    if audio:
        assets["clips_source"] = f"sounds.held_out_seeds({plan.clips})"
    atomic_write_json(marker, assets)
    return assets


def _paths(assets: dict[str, Any]) -> list[str]:
    keys = ("prompts", "wan_base", "causvid", "causal_forcing", "aar", "sat", "clap")
    return [assets[k] for k in keys if k in assets] + list(assets.get("clips", []))


# ----------------------------------------------------------------------------------------------------------------
# Running the commands


def _mmkv(argv: list[str], log: Path, *, step: str) -> float:
    """`mmkv ARGV` in this process, its stdout kept in `log` (progress bars stay on stderr); seconds taken."""
    from mmkv.cli import main

    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ mmkv " + shlex.join(argv) + "\n\n")
        f.flush()
        with contextlib.redirect_stdout(f):
            rc = main(argv)
    seconds = time.perf_counter() - t0
    if rc != 0:
        tail = "".join(log.read_text(encoding="utf-8").splitlines(keepends=True)[-20:])
        raise UsageError(f"step '{step}' failed (exit {rc}): mmkv {shlex.join(argv)}\n--- end of {log} ---\n{tail}")
    print(f"  {step:<46} {seconds:6.1f} s   (log: {log})", flush=True)
    return seconds


def _mmkv_ranks(argv: list[str], ranks: int, log: Path, *, step: str) -> float:
    """`mmkv ARGV` as `ranks` processes at once, rank r of WORLD_SIZE `ranks` (the sharding of a `torchrun` sweep: each
    rank renders the prompts i with i % ranks == r and writes its own manifest, which `mmkv report` merges), each on
    one torch thread: on two cores two single-threaded rollouts at once beat one rollout on two threads (the trained
    CausVid run 126 -> 94 s, docs/perf.md "Demo"). `log` gets the command; rank r's output goes to LOG.rank{r}.log. A
    failed rank fails the step with its log's tail; an interrupted step stops every rank."""
    import os
    import subprocess
    import sys

    log.parent.mkdir(parents=True, exist_ok=True)
    rank_logs = [log.with_suffix(f".rank{r}.log") for r in range(ranks)]
    log.write_text("$ mmkv " + shlex.join(argv) + f"\n\n{ranks} ranks, one torch thread each: "
                   + ", ".join(str(p) for p in rank_logs) + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    procs: list[subprocess.Popen] = []
    try:
        for r, rank_log in enumerate(rank_logs):
            env = {**os.environ, **_KEEP_FREED_ENV, "RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r),
                   "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            with open(rank_log, "w", encoding="utf-8") as f:
                f.write("$ " + shlex.join([f"RANK={r}", f"WORLD_SIZE={ranks}", "mmkv", *argv]) + "\n\n")
                f.flush()
                procs.append(subprocess.Popen([sys.executable, "-m", "mmkv.cli", *argv], stdout=f,
                                              stderr=subprocess.STDOUT, env=env))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    seconds = time.perf_counter() - t0
    for r, rc in enumerate(codes):
        if rc != 0:
            tail = "".join(rank_logs[r].read_text(encoding="utf-8").splitlines(keepends=True)[-20:])
            raise UsageError(f"step '{step}' failed on rank {r} of {ranks} (exit {rc}): mmkv {shlex.join(argv)}\n"
                             f"--- end of {rank_logs[r]} ---\n{tail}")
    print(f"  {step:<46} {seconds:6.1f} s   (log: {log}, {ranks} ranks)", flush=True)
    return seconds


# A rank process pays about 6 s to start (imports, loading the model), what two or three trained rollouts gain from
# running beside another: the frame-wise run's four rollouts took 20.6 s in this process and 24.7 s as two ranks.
RANK_MIN_CODECS = 4


def _video_ranks(plan: Plan, vm: VideoModel, trained: bool, device: str | None, threads: int) -> int:
    """Processes for a trained video run: one a torch thread the demo was given (`threads`, 0 = torch's default:
    one process), at most one a prompt, on a CPU only (a GPU runs one process) and for a run of at least
    RANK_MIN_CODECS codecs; 1 = in this process."""
    from mmkv.pipelines.common import parse_device

    if not trained or len(plan.video_codecs(vm)) < RANK_MIN_CODECS or parse_device(device).type != "cpu":
        return 1
    return max(1, min(threads, plan.prompts))


def _lpips_mode(choice: str) -> str:
    if choice != "auto":
        return choice
    from mmkv.metrics import default_alexnet_path

    return "alexnet" if default_alexnet_path().is_file() else "random"


def _check_identity(out: Path, want: dict[str, Any]) -> None:
    """One demo folder holds one (mode, seed, video weights, audio weights): resuming with other settings would mix
    incomparable runs (trained and random ones among them)."""
    from mmkv.pipelines.common import atomic_write_json, read_json

    path = out / "demo.json"
    if path.is_file():
        have = read_json(path)
        if not _same_identity(have, want):
            raise UsageError(f"{out} holds a demo made with {have}; this command asks for {want}. Use another --out "
                             "(or the same options to resume)")
    else:
        atomic_write_json(path, want)


# glibc's malloc settings while the demo runs (mallopt(3)): every block from the heap, which keeps what is freed
# unless over 1 GiB is free at its top; the same as environment variables (MALLOC_<NAME>_) for child processes.
_KEEP_FREED = {"MMAP_MAX": 0, "TRIM_THRESHOLD": 1 << 30, "TOP_PAD": 64 << 20}
_GLIBC_DEFAULTS = {"MMAP_MAX": 65536, "TRIM_THRESHOLD": 128 << 10, "TOP_PAD": 128 << 10}
_MALLOPT = {"TRIM_THRESHOLD": -1, "TOP_PAD": -2, "MMAP_MAX": -4}  # glibc's malloc.h
_KEEP_FREED_ENV = {f"MALLOC_{name}_": str(value) for name, value in _KEEP_FREED.items()}


@contextlib.contextmanager
def _keep_freed_memory(enabled: bool):
    """Let glibc keep freed memory for reuse instead of handing it back to the kernel, while the block runs. At the
    trained model's size every VAE convolution allocates and frees im2col buffers of up to 64 MB; glibc maps and
    unmaps each one (and trims its heap), and every page is faulted in again: 1.5-2 M page faults, a third of a
    rollout's time measured (one decode 8.5 -> 5.0 s). glibc's defaults come back after, so in-process callers (the
    tests) are unaffected; a no-op where the C library has no `mallopt`."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt if enabled else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is not None:
        for name, value in _KEEP_FREED.items():
            mallopt(_MALLOPT[name], value)
    try:
        yield
    finally:
        if mallopt is not None:
            for name, value in _GLIBC_DEFAULTS.items():
                mallopt(_MALLOPT[name], value)


# The trained video model's ops are large enough for a second thread: on two idle cores its CausVid run took 108 s
# on one thread and 82 s on two (the fourth training run's release, every codec of the trained plan), the frame-wise
# run 16.2 and 13.7 s; the random models' runs do not gain.
TRAINED_THREADS = 2


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads is not None and args.threads < 0:
        raise UsageError(f"--threads must be >= 0, got {args.threads}")
    before = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(before)


def _set_threads(args: argparse.Namespace, trained: bool) -> int:
    """Sets this process's torch threads from --threads (or the mode's default); returns the count (0: torch's
    default, left as it is)."""
    import os

    import torch

    threads = args.threads
    if threads is None:
        threads = min(TRAINED_THREADS, os.cpu_count() or 1) if trained else 1
    if threads:
        torch.set_num_threads(threads)
    return threads


def _choose_models(args: argparse.Namespace) -> dict[str, Any] | None:
    """The shipped trained video model unless --random or it is not installed (then one line says so); a broken
    install fails here (`mmkv.assets.AssetError`)."""
    from mmkv.assets import VIDEO_ASSETS, trained_video_assets

    if args.random:
        return None
    trained = trained_video_assets()
    if trained is None:
        print(f"mmkv demo: the trained tiny video model is not installed (no weights in {VIDEO_ASSETS}): using the "
              "tiny random models, as --random does", flush=True)
        return None
    trained = _unless_below_bar(args, "video", trained)
    if trained is not None and args.prompts is not None:
        raise UsageError("--prompts is for the random models: the trained model is prompted with held-out scene "
                         "captions. Add --random to use your prompts, or drop --prompts")
    return trained


def _choose_audio_models(args: argparse.Namespace) -> dict[str, Any] | None:
    """The shipped trained audio models unless --random or none is installed; a broken install fails here
    (`mmkv.assets.AssetError`, one line naming the file)."""
    from mmkv.assets import trained_audio_assets

    if args.random:
        return None
    found = trained_audio_assets()
    return None if found is None else _unless_below_bar(args, "audio", found)


def _unless_below_bar(args: argparse.Namespace, kind: str, found: dict[str, Any]) -> dict[str, Any] | None:
    """A shipped set, unless its held-out scores are below the demo's bar (`mmkv.assets.demo_ready`) and --trained
    was not given: then one line says so and the random models stand in."""
    from mmkv.assets import demo_ready

    ready, score = demo_ready(kind, found)
    if ready or args.trained:
        return found
    what = "models score" if kind == "audio" else "model scores"
    print(f"mmkv demo: the shipped trained tiny {kind} {what} {score}: using the tiny random {kind} models "
          "(--trained uses the shipped ones anyway)", flush=True)
    return None


def _run(args: argparse.Namespace) -> int:
    from mmkv.pipelines.common import check_out_dir, parse_device

    trained = _choose_models(args)
    audio = _choose_audio_models(args)
    threads = _set_threads(args, trained is not None)
    size_name = "quick" if args.quick else "full"
    plan = PLANS[f"trained-{size_name}" if trained else size_name]
    out = check_out_dir(args.out or (DEFAULT_OUT if trained else DEFAULT_OUT_RANDOM))  # also: read-only, under a file
    parse_device(args.device)  # a device this machine lacks fails here, not inside the first step
    out.mkdir(parents=True, exist_ok=True)
    _check_identity(out, _identity(plan, args.seed, trained, audio))
    with _keep_freed_memory(enabled=trained is not None):
        return _render(args, plan, trained, out, audio, threads)


def _models_line(trained: bool, audio: bool) -> str:
    if not audio:
        return "the trained tiny video model, random audio models" if trained else "tiny random models"
    return ("the trained tiny video and audio models" if trained
            else "tiny random video models, the trained tiny audio models")


def _render(args: argparse.Namespace, plan: Plan, trained: dict[str, Any] | None, out: Path,
            audio: dict[str, Any] | None = None, threads: int = 1) -> int:
    from mmkv.pipelines.wan.tiny import TINY_VIDEO

    lpips = _lpips_mode(args.lpips)
    device = ["--device", args.device] if args.device else []
    logs = out / "logs"
    size = TRAINED_VIDEO if trained else TINY_VIDEO
    # Trained: each compressed unit decoded once a rollout, not on every attention call (bit-identical outputs, KV
    # bytes unchanged; docs/decisions.md): 0.4 s less a CausVid rollout, 3 s less a frame-wise one.
    reuse = ["--reuse-decoded"] if trained else []
    t_start = time.perf_counter()
    what = _models_line(trained is not None, audio is not None)
    n_codecs = len(set().union(plan.codecs, *(plan.video_codecs(vm) for vm in plan.video)))
    print(f"mmkv demo ({plan.mode}): {what}, reference + {n_codecs} codecs, into {out}/", flush=True)

    t0 = time.perf_counter()
    assets = write_assets(out / "assets", plan, args.seed, args.prompts, trained, audio)
    print(f"  {'assets':<46} {time.perf_counter() - t0:6.1f} s   ({out / 'assets'})", flush=True)

    video_runs = []
    for vm in plan.video:
        run_dir = out / "runs" / vm.preset
        # random: the tiny grid, 33 x 32 x 48 pixels -> 9 x 4 x 6 latents, 2 s at 16 fps; trained: 81 x 64 x 96
        # pixels -> 21 x 16 x 24 latents, 5 s
        argv = ["generate", "video", "--model", vm.preset, "--ckpt", assets[vm.checkpoint], "--base",
                assets["wan_base"], "--prompts", assets["prompts"],
                "--codecs", ",".join(plan.video_codecs(vm)), "--frames", str(size["frames"]),
                "--height", str(size["height"]), "--width", str(size["width"]), "--seed", str(args.seed),
                "--out", str(run_dir), *reuse, *device]
        log, step = logs / f"generate_video_{vm.preset}.log", f"generate video --model {vm.preset}"
        ranks = _video_ranks(plan, vm, trained is not None, args.device, threads)
        if ranks > 1:
            _mmkv_ranks(argv, ranks, log, step=step)
        else:
            _mmkv(argv, log, step=step)
        video_runs.append(run_dir)
    codecs = ",".join(plan.codecs)
    audio_run = out / "runs" / "audio"
    # Shipped audio models: compare audio's own default (no --aar / --clap) reads and checks them.
    models = [] if audio else ["--aar", assets["aar_dir"], "--clap", assets["clap"]]
    _mmkv(["compare", "audio", *models, "--clips", assets["clips_dir"],
           "--codecs", codecs, "--seed", str(args.seed), "--out", str(audio_run), *device],
          logs / "compare_audio.log", step="compare audio")
    runs = [str(r) for r in [*video_runs, audio_run]]

    report = out / "report"
    common = ["--lpips", lpips, *device]
    _mmkv(["report", *runs, "--format", "md,csv,json,latex,html", "--out", str(report), *common],
          logs / "report.log", step="report (tables, plots, gallery)")
    # Headline: the Markdown tables of each run on its own (one model per table stays readable in a terminal),
    # from the metrics the report just cached beside each rollout.
    headlines = []
    for r in [*video_runs, audio_run]:
        log = logs / f"headline_{r.name}.log"
        _mmkv(["report", str(r), "--format", "md", "--no-plots", *common], log, step=f"headline table ({r.name})")
        headlines.append(_strip_log_header(log.read_text(encoding="utf-8")))
    total = time.perf_counter() - t_start

    print(_where(out, video_runs, audio_run, report, lpips, total, trained is not None, audio))
    for text in headlines:
        print(text.rstrip() + "\n")
    return 0


def _strip_log_header(text: str) -> str:
    return text.split("\n\n", 1)[1] if text.startswith("$ mmkv ") else text


def _where(out: Path, video_runs: list[Path], audio_run: Path, report: Path, lpips: str, total: float,
           trained: bool, audio: dict[str, Any] | None = None) -> str:
    plots = sorted((report / "plots").glob("*.png"))
    if audio:
        video_note = "the trained TINY model on held-out captions" if trained else "tiny RANDOM models"
        assets_note = (("held-out captions" if trained else "tiny random video checkpoints, prompts")
                       + "; held-out procedural clips with captions; the trained models are read in place")
        caveat = (f"Video: {video_note}; audio: the trained TINY models of {audio['root']} (SHA256SUMS "
                  f"{audio['sums_sha256'][:12]}) on held-out procedural clips (adherence is scored). The numbers "
                  "show the harness works, not how a codec behaves on the real models.")
    elif trained:
        assets_note = "random audio checkpoints, CLAP, clips, held-out captions; the video model is read in place"
        caveat = ("Video: the trained TINY model on held-out captions (adherence is scored); audio: tiny RANDOM "
                  "models. The numbers show the harness works, not how a codec behaves on the real models.")
    else:
        assets_note = "tiny random checkpoints in release formats, CLAP, clips, prompts"
        caveat = "Tiny RANDOM models: the numbers show the harness works, not how good a codec is on the real models."
    lines = [
        "",
        f"done in {total:.0f} s. Everything is under {out}/:",
        f"  gallery      {report / 'index.html'}   (open in a browser: players, stills, tables, plots)",
        f"  tables       {report}/table.{{md,csv,json,tex}}, windows.*, rollouts.csv, frames.csv",
        f"  plots        {report / 'plots'}/ ({len(plots)} PNG: rate-quality and per-frame curves)",
        *[f"  video run    {r}/rollouts/<prompt>/<variant>/{{video.mp4, frames.npy, latents.safetensors}}"
          for r in video_runs],
        f"  audio run    {audio_run}/rollouts/<clip>/<variant>/{{audio.wav, tokens, latent}}",
        f"  assets       {out / 'assets'}/ ({assets_note})",
        f"  logs         {out / 'logs'}/",
        "",
        caveat,
    ]
    if lpips == "random":
        lines.append("LPIPS† uses a seeded random AlexNet trunk (no ImageNet AlexNet in the torch hub cache): not "
                     "LPIPS. Put alexnet-owt-7be5be79.pth there for real LPIPS.")
    lines.append(f"Rerun `mmkv report {' '.join(str(r) for r in [*video_runs, audio_run])}` for other formats.")
    lines.append("")
    return "\n".join(lines)
