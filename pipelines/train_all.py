"""`mmkv train all`: every stage of the tiny video and audio models in one resumable command.

    mmkv train all --out DIR --budget 1500 [--video-init RUN] [--audio-init RUN]

runs two lanes side by side (the tiny models are launch-bound, so one GPU has room for both; docs/training.md):

* video: `train video --stage vae`, `dit`, `distill` (each `--from` the one before), then `eval video` on held-out
  prompts (free rollouts, continuations of each clip's own first block, both with and without the past, and a random
  DiT of the same architecture) into `DIR/video/eval.json`;
* audio: `train audio --stage clap`, `sat`, `aar`, then `ship audio --training-state` into `DIR/audio/release/` (the
  bf16 release with its `SHA256SUMS`, the layout `mmkv/assets/audio/` ships, keeping what more training needs, so
  that it is also an `--audio-init`; `ship audio` without the flag writes the slimmer one from `DIR/audio/aar`).

Each stage is its own process (`DIR/<lane>/<stage>/`, its log beside it as `<stage>.log`) and gets a share of
`--budget` seconds (`SHARES`). A stage whose `train.json` exists is done and is skipped on a rerun; a folder without
one is what a killed stage left and is trained again from its start, so a run killed at any point and restarted
finishes what is left. At the end every finished step's headline numbers are printed and written to
`DIR/summary.txt`. `DIR/plan.json` records the settings (and the SHA-256 of each init's `train.json`): a restart
with other settings is refused. `--video-init` / `--audio-init` continue every stage of a lane from an earlier
run's outputs (weights only, each stage with a new seed, as `--init` does): the latest trained video model, which
the repository keeps in `mmkv/assets/video/` with its `train.json` (docs/decisions.md, "Trained weights are
committed at the end of every session that trains them"), is such an init. Seeds: stage k of a lane draws with
`--seed + k`. `--start-at dit,aar` (or `sat`) trains a lane's later stages only, the earlier stages' models taken
from its init as they are, so that a run fits one 10-minute device call (docs/training.md, "One run a device call");
`--start-at distill` distils a `dit` output (the init, its teacher), so that a DiT trained for a whole call
(`--stop-after dit`) is distilled by a second run in the next.
`--stop-after vae --vae-decoder-only` fine-tunes the video init's VAE decoder alone and scores the init's DiT with
it (`DIR/video/vae/release/`, a set `mmkv ship video` takes); `--stop-after dit` scores the teacher.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from mmkv.pipelines.common import atomic_write_json, atomic_write_text, sha256_file

LANES = ("video", "audio")
TRAIN_MODULES = {"video": "mmkv.pipelines.wan.train", "audio": "mmkv.pipelines.aar.train"}
STAGES = {"video": ("vae", "dit", "distill"), "audio": ("clap", "sat", "aar")}
# The stages whose output holds every model of the lane, so that each stage can continue from it.
INIT_STAGES = {"video": ("dit", "distill"), "audio": ("aar",)}  # (an audio release with its training state: aar)
# `--start-at`: the stages a lane may start from, taking the earlier stages' models from its init as they are (an
# init holds every model of its lane). Distillation starts only from a `dit` output, its teacher (a distill output
# holds a student): a DiT trained for one device call (`--stop-after dit`) is distilled in the next.
START_AT = {"video": ("dit", "distill"), "audio": ("sat", "aar")}
# `--stop-after`: the stages a lane may end with, its eval scoring that stage's release: the teacher (`dit`), or a
# decoder-only `vae` stage's (the init's DiT with the new decoder, `VAE_RELEASE` in the stage's folder).
STOP_AFTER = {"video": ("vae", "dit")}
VAE_RELEASE = "release"
# Share of --budget each stage trains for. Video: the VAE and the DiT are the long stages (docs/training.md, the
# fifth and sixth runs); eval runs after, unbudgeted (one prompt at a time, 6 of its 12 runs took 9 minutes on the
# seventh run's shared H200; it now rolls out 32 prompts together). Audio: the SAT is the long one.
SHARES = {"vae": 0.33, "dit": 0.45, "distill": 0.16, "clap": 0.08, "sat": 0.5, "aar": 0.36}


def parse_shares(text: str | None, start_at: dict[str, str] | None = None,
                 stop_after: dict[str, str] | None = None) -> dict[str, float]:
    """SHARES with `--shares STAGE=FRACTION,...` in place of the named stages' defaults; the shares of the stages each
    lane trains (all, or those from its `--start-at` stage on, up to its `--stop-after` stage) must add up to at most
    1 (its budget)."""
    shares = dict(SHARES)
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        stage, _, value = item.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if stage not in SHARES or not 0 < share <= 1:
            raise ValueError(f"--shares {item!r}: expected STAGE=FRACTION with STAGE one of {', '.join(SHARES)} and "
                             "0 < FRACTION <= 1")
        shares[stage] = share
    for lane in STAGES:
        total = sum(shares[s] for s in lane_stages(lane, start_at, stop_after))
        if total > 1 + 1e-9:
            raise ValueError(f"--shares: the {lane} lane's stages take {total:.2f} of the budget; at most 1")
    return shares


def _stage_per_lane(flag: str, text: str | None, table: dict[str, tuple[str, ...]], lanes: list[str],
                    hint: str) -> dict[str, str]:
    """{lane: stage} from `flag STAGE[,STAGE]`, each stage one of `table`'s, at most one a lane, its lane run."""
    picked: dict[str, str] = {}
    for stage in filter(None, (x.strip() for x in (text or "").split(","))):
        lane = next((ln for ln, stages in table.items() if stage in stages), None)
        if lane is None:
            names = ", ".join(s for v in table.values() for s in v)
            raise ValueError(f"{flag} {stage!r}: expected one of {names} ({hint})")
        if lane in picked:
            raise ValueError(f"{flag} names two {lane} stages ({picked[lane]}, {stage}); give at most one a lane")
        if lane not in lanes:
            raise ValueError(f"{flag} {stage}: the {lane} lane is not run (--lanes {','.join(lanes)})")
        picked[lane] = stage
    return picked


def parse_start_at(text: str | None, inits: dict[str, str | None], lanes: list[str]) -> dict[str, str]:
    """`--start-at STAGE[,STAGE]`: {lane: the stage it starts from}, for the lanes that skip their first stages."""
    start = _stage_per_lane("--start-at", text, START_AT, lanes, "a lane's first stage needs no --start-at")
    for lane, stage in start.items():
        if inits.get(lane) is None:
            raise ValueError(f"--start-at {stage}: the {lane} lane's earlier stages come from --{lane}-init; give it")
        if stage == "distill":
            record = Path(inits[lane]) / "train.json"
            made = json.loads(record.read_text()).get("stage") if record.is_file() else None
            if made != "dit":
                raise ValueError(f"--start-at distill: --video-init {inits[lane]} is "
                                 f"{'no stage output' if made is None else f'a {made!r} output'}; the distillation "
                                 "needs its teacher, a dit output (DIR/video/dit of a --stop-after dit run)")
    return start


def parse_stop_after(text: str | None, lanes: list[str], start_at: dict[str, str],
                     decoder_only: bool) -> dict[str, str]:
    """`--stop-after STAGE`: {lane: the stage it ends with}."""
    stop = _stage_per_lane("--stop-after", text, STOP_AFTER, lanes, "a lane's last stage needs no --stop-after")
    for lane, stage in stop.items():
        if stage == "vae" and not decoder_only:
            raise ValueError("--stop-after vae keeps the --video-init's DiT, which is valid only on the latents it "
                             "learned: give --vae-decoder-only (the encoder stays) or let the dit stage run")
        first = start_at.get(lane)
        if first and STAGES[lane].index(stage) < STAGES[lane].index(first):
            raise ValueError(f"--stop-after {stage} comes before --start-at {first}; the {lane} lane would train "
                             "nothing")
    return stop


def lane_stages(lane: str, start_at: dict[str, str] | None,
                stop_after: dict[str, str] | None = None) -> tuple[str, ...]:
    """The stages a lane trains: all of them, or those from its `--start-at` stage on, up to its `--stop-after`."""
    stages = STAGES[lane]
    first, last = (start_at or {}).get(lane), (stop_after or {}).get(lane)
    stages = stages[:stages.index(last) + 1] if last else stages
    return stages[stages.index(first):] if first else stages


def stage_done(folder: Path) -> bool:
    return (folder / "train.json").is_file()


def _python() -> list[str]:
    return [sys.executable, "-m", "mmkv.cli"]


def lane_commands(lane: str, out: Path, args: argparse.Namespace) -> list[tuple[str, Path, list[str]]]:
    """(step name, the folder or file it writes, command) for each step of a lane, in order."""
    root = out / lane
    init = getattr(args, f"{lane}_init")
    device = ["--device", args.device] if args.device else []
    steps: list[tuple[str, Path, list[str]]] = []
    previous: Path | None = None
    stop_after = getattr(args, "stop_after_lanes", None)
    trained = lane_stages(lane, getattr(args, "start_at_lanes", None), stop_after)
    shares = parse_shares(getattr(args, "shares", None), getattr(args, "start_at_lanes", None), stop_after)
    if trained[0] != STAGES[lane][0]:
        previous = Path(init)  # the init stands for the stages before --start-at (it holds their models)
    for k, stage in enumerate(STAGES[lane]):
        if stage not in trained:
            continue
        folder = root / stage
        cmd = _python() + ["train", lane, "--stage", stage, "--config", args.config, "--out", str(folder),
                           "--seed", str(args.seed + k)] + device
        if args.budget is not None:
            cmd += ["--budget", f"{shares[stage] * args.budget:.0f}"]
        if previous is not None:
            cmd += ["--from", str(previous)]
        if init is not None and not (lane == "video" and stage == "distill"):  # distill starts from its teacher
            cmd += ["--init", str(init)]
        for item in getattr(args, f"{lane}_set"):
            cmd += ["--set", item]
        if stage == "vae" and getattr(args, "vae_decoder_only", False):
            cmd += ["--decoder-only"]
        if getattr(args, "deterministic", False):
            cmd += ["--deterministic"]
        cmd += (getattr(args, "replay_pins", None) or {}).get(stage, [])
        steps.append((stage, folder, cmd))
        previous = folder
    if previous is not None and previous.name == "vae" and lane == "video":  # --stop-after vae: its release
        previous = previous / VAE_RELEASE
    if lane == "video" and args.eval_prompts:
        from mmkv.pipelines.wan.train import get_config

        cfg = get_config(args.config)
        steps.append(("eval", root / "eval.json", _python() + [
            "eval", "video", "--ckpt", str(previous / "causvid"), "--base", str(previous / "base"),
            "-n", str(args.eval_prompts), "--frames", str(cfg.frames), "--height", str(cfg.height),
            "--width", str(cfg.width), "--no-past", "--random-dit", "--given-first-block", "--batch", "32",
            "--out", str(root / "eval.json")] + device))
    if lane == "audio":
        steps.append(("release", root / "release", _python() + [
            "ship", "audio", "--aar", str(previous / f"AAR_{args.config}.pth"),
            "--sat", str(previous / f"SAT_{args.config}.pth"), "--clap", str(previous / "clap"),
            "--out", str(root / "release"), "--training-state"]))
    return steps


def _finished(name: str, target: Path) -> bool:
    if name == "eval":
        return target.is_file()
    if name == "release":
        return (target / "SHA256SUMS").is_file()
    return stage_done(target)


def run_lane(lane: str, out: Path, args: argparse.Namespace, results: dict[str, str]) -> None:
    """Run a lane's steps in order, skipping finished ones up to the first that is not; from there on every step
    runs (its inputs are new), over whatever an earlier run left. A failed step stops the lane (its log says why)."""
    fresh = False
    for name, target, cmd in lane_commands(lane, out, args):
        if not fresh and _finished(name, target):
            print(f"[{lane}] {name}: done already ({target})", flush=True)
            continue
        fresh = True
        if target.is_dir():  # what a killed stage left (no train.json: no usable weights), or outputs now stale
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        log = out / lane / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{lane}] {name}: running, log {log}", flush=True)
        t0 = time.perf_counter()
        with log.open("a") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
        if code != 0:
            results[lane] = f"{name} failed (exit {code}); see {log}"
            print(f"[{lane}] {name}: FAILED (exit {code}) after {time.perf_counter() - t0:.0f} s; see {log}",
                  flush=True)
            return
        print(f"[{lane}] {name}: finished in {time.perf_counter() - t0:.0f} s", flush=True)
    results[lane] = "ok"


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _loss(rec: dict) -> str:
    curve = rec.get("loss_curve") or [[0, float("nan")]]
    return f"{rec['steps']} steps ({rec['planned_steps']} planned), {rec['ms_per_step']} ms a step, loss {curve[-1][1]:.4g}"


def summary_lines(out: Path) -> list[str]:
    """The headline of every finished step, one line each (what a GPU session's last call prints)."""
    from mmkv.pipelines.wan.evaluate import shapes_text

    lines = []
    for lane in LANES:
        for stage in STAGES[lane]:
            rec = _read(out / lane / stage / "train.json")
            if rec is None:
                continue
            extra = ""
            if stage == "vae":
                extra = f"; held-out PSNR {rec['held_out_psnr_db']} dB, object {rec['held_out']['object_psnr_db']} dB"
            elif stage == "clap":
                extra = f"; retrieval, all named: {rec['retrieval']['text_to_audio_top1']['all_named']['accuracy']}"
            elif stage == "sat":
                h = rec["heldout"]
                extra = (f"; SI-SNR {h['si_snr_db']} dB, log-mel L1 {h['log_mel_l1']}, fewest codes used "
                         f"{min(u['used'] for u in h['codebook_usage'])} of {h['codebook_usage'][0]['of']}")
            elif stage == "aar":
                h = rec["heldout"]
                extra = f"; CE {h['ce_cond']} with the condition, {h['ce_uncond']} without"
                if "ce_cond_no_past" in h:
                    extra += f", {h['ce_cond_no_past']} with the condition and no past"
                for key in ("rollouts", "rollouts_no_past", "rollouts_random_aar"):
                    if key in h:
                        extra += f"; {key} adherence {h[key]['adherence']}"
            lines.append(f"{lane}/{stage}: {_loss(rec)}{extra}")
    ev = _read(out / "video" / "eval.json")
    if ev is not None:
        lines.append(f"video/eval: VAE {ev['vae_held_out_psnr_db']} dB; preset, model, first block, past: found / "
                     "colour / shape / direction / consistency %, background dB")
        for r in ev["runs"]:
            m = r["summary"]
            lines.append(f"  {r['preset']:<22} {r['model']:<11} {r['first_block']:<9} "
                         f"{'no past' if r['no_past'] else 'cache':<8} {m['found_pct']} / {m['colour_pct']} / "
                         f"{m['shape_pct']} / {m['direction_pct']} / {m['consistency_pct']}, "
                         f"{m['background_psnr_db']}" + (f"; shapes {shapes_text(m)}" if shapes_text(m) else ""))
    return lines


def replay_pins(run: Path, plan: dict, lanes: list[str]) -> dict[str, list[str]]:
    """The stage arguments that make a replay of `run` draw what it drew: each stage's steps as it ran them (with the
    budget's re-plans, which the learning-rate schedule followed, where train.json keeps them), the
    DiT's dataset size and the distillation's teacher trajectories of each kind (the counts a budget cut), read from
    each stage's `train.json`."""
    from mmkv.pipelines.wan.train import get_config

    pins: dict[str, list[str]] = {}
    for lane in lanes:
        for stage in lane_stages(lane, plan.get("start_at"), plan.get("stop_after")):
            rec = _read(run / lane / stage / "train.json")
            if rec is None:
                raise ValueError(f"--replay {run}: its {lane} stage {stage!r} did not finish (no {lane}/{stage}/"
                                 "train.json); only a finished run can be replayed")
            if rec.get("step_plan"):  # the re-plans too, which the schedule followed (`--step-plan`)
                if int(rec["step_plan"][-1][1]) != int(rec["steps"]):
                    raise ValueError(f"--replay {run}: {lane}/{stage}/train.json's step_plan ends at "
                                     f"{rec['step_plan'][-1][1]} steps but the stage ran {rec['steps']}")
                pins[stage] = ["--step-plan", ",".join(f"{done}:{total}" for done, total in rec["step_plan"])]
            else:  # a record from before step plans were kept: the final count (the schedule's plans differ)
                pins[stage] = ["--steps", str(int(rec["steps"]))]
            if stage == "dit":
                pins[stage] += ["--set", f"dit_clips={int(rec['dataset_clips'])}"]
            if stage == "distill":
                made = rec["ode_trajectories"]
                fpb = get_config(plan["config"]).frames_per_block
                pins[stage] += ["--set", f"ode_chunk_trajectories={int(made.get(f'{fpb}-frame blocks', 0))}",
                                "--set", f"ode_frame_trajectories={int(made.get('1-frame blocks', 0))}"]
    return pins


def apply_replay(args: argparse.Namespace) -> None:
    """`--replay RUN`: every setting from RUN's plan.json (its inits checked against the SHA-256 recorded there, and
    found where plan.json says unless `--video-init` / `--audio-init` say where they are now), no budget, and each
    stage pinned to what it ran (`replay_pins`), so that a rerun of a budgeted run trains the same steps on the same
    draws; `--lanes` may pick some of RUN's lanes."""
    run = Path(args.replay)
    plan = _read(run / "plan.json")
    if plan is None:
        raise ValueError(f"--replay {run}: no plan.json there; give the --out folder of an earlier `mmkv train all`")
    given = [flag for flag, value in (("--budget", args.budget), ("--shares", args.shares),
                                      ("--video-set", args.video_set), ("--audio-set", args.audio_set),
                                      ("--vae-decoder-only", args.vae_decoder_only), ("--seed", args.seed != 0),
                                      ("--deterministic", getattr(args, "deterministic", False)),
                                      ("--start-at", getattr(args, "start_at", None)),
                                      ("--stop-after", getattr(args, "stop_after", None)),
                                      ("--config", args.config != "tiny")) if value]
    if given:
        raise ValueError(f"--replay takes every setting from {run}/plan.json; give only --out, --lanes, --device and "
                         f"where its inits are now (--video-init, --audio-init) (got {', '.join(given)})")
    lanes = [x.strip() for x in args.lanes.split(",") if x.strip()] if args.lanes else plan["lanes"]
    missing = [x for x in lanes if x not in plan["lanes"]]
    if missing:
        raise ValueError(f"--replay {run}: it ran the lanes {', '.join(plan['lanes'])}, not {', '.join(missing)}")
    inits: dict[str, str | None] = {}
    for lane in LANES:
        moved, init = getattr(args, f"{lane}_init"), plan["inits"].get(lane)
        if moved is not None and init is None:
            raise ValueError(f"--replay {run}: its {lane} lane started from scratch; --{lane}-init has nothing to "
                             "relocate")
        inits[lane] = None if init is None else (moved or init["folder"])
        record = Path(inits[lane]) / "train.json" if inits[lane] else None
        if lane in lanes and record is not None and (
                not record.is_file() or sha256_file(record) != init["train_json_sha256"]) and (
                "weights_sha256" not in init or weights_digest(Path(inits[lane])) != init["weights_sha256"]):
            weights = (f" nor are its weights those recorded ({init['weights_sha256'][:12]}…)"
                       if "weights_sha256" in init else "")
            raise ValueError(f"--replay {run}: its --{lane}-init {inits[lane]} is not the set it continued (its "
                             f"train.json is missing or has another SHA-256 than {init['train_json_sha256'][:12]}…"
                             f"{weights}); give that set's folder, or its replay's, with --{lane}-init")
    args.lanes = ",".join(lanes)
    args.config, args.seed, args.budget = plan["config"], plan["seed"], None
    args.eval_prompts = plan["eval_prompts"]
    for lane in LANES:
        setattr(args, f"{lane}_init", inits[lane])
        setattr(args, f"{lane}_set", list(plan["overrides"].get(lane, [])))
    args.vae_decoder_only = bool(plan.get("vae_decoder_only", False))
    args.deterministic = bool(plan.get("deterministic", False))
    args.start_at = ",".join(v for k, v in plan.get("start_at", {}).items() if k in lanes) or None
    args.stop_after = ",".join(v for k, v in plan.get("stop_after", {}).items() if k in lanes) or None
    args.replay_pins = replay_pins(run, plan, lanes)
    args.replay_of = {"folder": str(run.resolve()), "plan_sha256": sha256_file(run / "plan.json")}


_NOT_WEIGHTS = {"train.json", "eval.json", "SHA256SUMS"}


def weights_digest(folder: Path) -> str:
    """SHA-256 over the relative path and SHA-256 of every file of a set but its records (train.json, eval.json,
    SHA256SUMS, logs): what a stage reads from an init. A replayed set has the same digest as the run it replays
    (same weights, other seconds in its train.json), so a replay of a run that continued a run can start from the
    earlier run's replay."""
    folder = Path(folder)
    lines = [f"{p.relative_to(folder).as_posix()} {sha256_file(p)}\n" for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name not in _NOT_WEIGHTS and p.suffix not in (".log", ".partial")]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def plan_record(args: argparse.Namespace, lanes: list[str]) -> dict:
    """The settings a restart must match: everything that changes what the stages compute."""
    inits = {}
    for lane in lanes:
        init = getattr(args, f"{lane}_init")
        if init is not None:
            record = Path(init) / "train.json"
            if not record.is_file():
                raise ValueError(f"--{lane}-init {init} holds no train.json: give the output folder of a `mmkv "
                                 f"train {lane}` stage (or of `mmkv train all`'s {lane}/ lane, one stage of it)")
            stage = json.loads(record.read_text()).get("stage")
            if stage not in INIT_STAGES[lane]:
                raise ValueError(f"--{lane}-init {init} is the output of the {stage!r} stage; every {lane} stage "
                                 f"continues from it only if it is a {' or '.join(INIT_STAGES[lane])} output")
            inits[lane] = {"folder": str(Path(init).resolve()), "train_json_sha256": sha256_file(record),
                           "weights_sha256": weights_digest(Path(init))}
    sets = {lane: list(getattr(args, f"{lane}_set")) for lane in lanes if getattr(args, f"{lane}_set")}
    return {"lanes": lanes, "config": args.config, "seed": args.seed, "budget_s": args.budget,
            "shares": {s: v for s, v in parse_shares(getattr(args, "shares", None),
                                                     getattr(args, "start_at_lanes", None),
                                                     getattr(args, "stop_after_lanes", None)).items()
                       if v != SHARES[s]},
            "device": args.device, "eval_prompts": args.eval_prompts, "inits": inits, "overrides": sets,
            **({"vae_decoder_only": True} if getattr(args, "vae_decoder_only", False) else {}),
            **({"deterministic": True} if getattr(args, "deterministic", False) else {}),
            **({"start_at": args.start_at_lanes} if getattr(args, "start_at_lanes", None) else {}),
            **({"stop_after": args.stop_after_lanes} if getattr(args, "stop_after_lanes", None) else {}),
            **({"replay_of": args.replay_of, "pins": args.replay_pins} if getattr(args, "replay_of", None) else {})}


def check_plan(out: Path, plan: dict) -> None:
    path = out / "plan.json"
    if path.is_file():
        before = json.loads(path.read_text())
        diff = sorted(k for k in set(plan) | set(before) if plan.get(k) != before.get(k))
        if diff:
            what = "; ".join(f"{k}: {before.get(k)!r} then, {plan.get(k)!r} now" for k in diff)
            raise ValueError(f"{out} was started with other settings ({what}); rerun with the same ones to resume, "
                             "or choose another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, plan)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (a rerun with the same settings resumes it)")
    parser.add_argument("--budget", type=float, default=None,
                        help="wall-clock seconds of training per lane, shared among its stages (default: every "
                             "stage runs its config's steps)")
    parser.add_argument("--lanes", default=None, help="which lanes to run (default: video,audio; with --replay, the "
                                                      "run's)")
    parser.add_argument("--shares", default=None, metavar="STAGE=FRACTION,...",
                        help="the budget's share of the named stages, in place of the defaults (" +
                             ", ".join(f"{k} {v}" for k, v in SHARES.items()) + "); a lane's add up to at most 1")
    parser.add_argument("--config", default="tiny", help="model shapes and settings of both lanes (tiny; micro is "
                                                         "the CPU smoke test's)")
    parser.add_argument("--seed", type=int, default=0, help="stage k of a lane draws with seed + k")
    parser.add_argument("--video-init", default=None, metavar="DIR",
                        help="continue the video stages from this earlier output (a dit or distill folder: its VAE, "
                             "text encoder and DiT)")
    parser.add_argument("--audio-init", default=None, metavar="DIR",
                        help="continue the audio stages from this earlier output (an aar folder: its CLAP, SAT and "
                             "AAR)")
    for lane in LANES:
        parser.add_argument(f"--{lane}-set", action="append", default=[], metavar="FIELD=VALUE",
                            help=f"override a config field in every {lane} stage (repeatable; `mmkv train {lane} "
                                 "--set`): arms of a sweep are runs with other --out folders, side by side")
    parser.add_argument("--vae-decoder-only", action="store_true",
                        help="the vae stage trains the --video-init VAE's decoder alone and keeps its encoder and "
                             "latent statistics, so that the DiT continues on the latents it learned")
    parser.add_argument("--start-at", default=None, metavar="STAGE[,STAGE]",
                        help="start a lane at this stage (" + ", ".join(s for v in START_AT.values() for s in v) +
                             "), its earlier stages' models taken from its --video-init / --audio-init as they are: "
                             "a run that fits one 10-minute device call (docs/training.md)")
    parser.add_argument("--stop-after", default=None, metavar="STAGE",
                        help="end the video lane with this stage (" + ", ".join(STOP_AFTER["video"]) + ") and score "
                             "its release: dit, the teacher; vae with --vae-decoder-only, the --video-init's DiT with "
                             "the fine-tuned decoder (in DIR/video/vae/" + VAE_RELEASE + "/, a set to ship)")
    parser.add_argument("--eval-prompts", type=int, default=32,
                        help="held-out prompts `eval video` scores after distillation (0: no eval)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--deterministic", action="store_true",
                        help="every stage with deterministic GPU kernels (`mmkv train video --help`), so that a "
                             "--replay of the run on the same card and software repeats its weights byte for byte")
    parser.add_argument("--replay", default=None, metavar="RUN",
                        help="train again what the finished run RUN trained: its settings, its inits (checked; "
                             "--video-init / --audio-init say where they are now), no budget, and each stage pinned "
                             "to the steps, dataset and teacher trajectories it ran (docs/training.md, reproducing a "
                             "run); --lanes may pick some of its lanes")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "replay", None):
        apply_replay(args)
    if args.lanes is None:
        args.lanes = ",".join(LANES)
    lanes = [x.strip() for x in args.lanes.split(",") if x.strip()]
    bad = [x for x in lanes if x not in LANES]
    if bad or not lanes or len(set(lanes)) != len(lanes):
        raise ValueError(f"--lanes {args.lanes!r}: expected a comma-separated subset of {', '.join(LANES)}")
    if args.budget is not None and args.budget <= 0:
        raise ValueError(f"--budget must be a positive number of seconds, got {args.budget}")
    if getattr(args, "vae_decoder_only", False) and (args.video_init is None or "video" not in lanes):
        raise ValueError("--vae-decoder-only fine-tunes an existing VAE's decoder: give --video-init (and the video "
                         "lane)")
    args.start_at_lanes = parse_start_at(getattr(args, "start_at", None),
                                         {lane: getattr(args, f"{lane}_init") for lane in LANES}, lanes)
    if getattr(args, "vae_decoder_only", False) and "video" in args.start_at_lanes:
        raise ValueError(f"--vae-decoder-only trains the vae stage, which --start-at {args.start_at_lanes['video']} "
                         "skips; give one of them")
    args.stop_after_lanes = parse_stop_after(getattr(args, "stop_after", None), lanes, args.start_at_lanes,
                                             getattr(args, "vae_decoder_only", False))
    parse_shares(args.shares, args.start_at_lanes, args.stop_after_lanes)
    if args.eval_prompts < 0:
        raise ValueError(f"--eval-prompts must be >= 0, got {args.eval_prompts}")
    for lane in lanes:  # a bad config name or field fails here, not minutes later in a stage's process
        train = importlib.import_module(TRAIN_MODULES[lane])
        try:
            train.parse_overrides(train.get_config(args.config), getattr(args, f"{lane}_set"))
        except ValueError as err:
            raise ValueError(f"{lane} lane: {err}") from None
    out = Path(args.out)
    check_plan(out, plan_record(args, lanes))
    results: dict[str, str] = {}
    threads = [threading.Thread(target=run_lane, args=(lane, out, args, results)) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = {lane: why for lane, why in results.items() if why != "ok"}
    lines = summary_lines(out) + [f"{lane}: {results.get(lane, 'did not finish')}" for lane in lanes]
    atomic_write_text(out / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed or len(results) != len(lanes) else 0
