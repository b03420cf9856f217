"""`mmkv train all` on the CPU (micro config): both lanes run every stage, the eval and the audio release; a rerun
skips what is done, a killed stage is trained again with everything after it, and other settings are refused."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mmkv.assets import trained_audio_assets
from mmkv.cli import main
from mmkv.pipelines import train_all
from mmkv.pipelines.common import sha256_file


def _argv(out, *extra):
    return ["train", "all", "--out", str(out), "--config", "micro", "--device", "cpu", "--eval-prompts", "1",
            *map(str, extra)]


@pytest.fixture(scope="module")
def one_thread_a_process():
    """One torch thread in each stage process this module starts (OMP_NUM_THREADS, read at torch's start): a run
    trains its two lanes side by side and `later` two runs, on the 2-core CI machine, where processes of two threads
    each oversubscribe the cores and OpenMP's spinning waits slow every one (two evals side by side: 30 s each,
    against 12 s alone; `run` 60 -> 47 s). The thread count may move the stages' last digits, which no test here
    reads against fixed numbers."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("MKL_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread_a_process):
    out = tmp_path_factory.mktemp("train_all") / "run"
    assert main(_argv(out)) == 0
    return out


# The runs that continue `run` (inits from it, copies of it cut or killed by hand), each the subject of one test:
# name -> (job(run, folder) -> what its test reads, its stage processes one after another). `later` trains them.
LATER = {}


def _later(processes):
    def register(job):
        LATER[job.__name__.lstrip("_")] = job, processes
        return job
    return register


@pytest.fixture(scope="module")
def later(run, tmp_path_factory):
    """The `LATER` runs, two at a time, the longest first; {name: its finished future}. They start 13 stage processes
    (~10 s each, mostly imports, one torch thread), and one run at a time leaves the 2-core CI machine's other core
    idle: ~130 s one after another, ~70 s so. A job only reads `run` and writes its own folder; its test reads its
    outputs (`.result()` re-raises what the job raised, in that test)."""
    root = tmp_path_factory.mktemp("later")
    longest_first = sorted(LATER.items(), key=lambda item: -item[1][1])
    with ThreadPoolExecutor(max_workers=2) as pool:  # at most three stage processes (~1 GB each) at once
        jobs = {name: pool.submit(job, run, root / name) for name, (job, _) in longest_first}
    return jobs  # leaving the pool waited for every job


def _mtimes(root):  # the outputs (not the logs, nor summary.txt, which every run rewrites)
    return {p: p.stat().st_mtime_ns for p in root.rglob("*")
            if p.is_file() and p.suffix != ".log" and p.name != "summary.txt"}


def test_both_lanes_train_every_stage_then_eval_and_release(run):
    for lane, stages in train_all.STAGES.items():
        for k, stage in enumerate(stages):
            rec = json.loads((run / lane / stage / "train.json").read_text())
            assert rec["stage"] == stage and rec["seed"] == k and rec["steps"] > 0
    assert json.loads((run / "video" / "dit" / "train.json").read_text())["source"] == str(run / "video" / "vae")
    ev = json.loads((run / "video" / "eval.json").read_text())
    assert {r["model"] for r in ev["runs"]} == {"trained", "random DiT"} and any(r["no_past"] for r in ev["runs"])
    assert ev["ckpt"]["sha256"] == sha256_file(run / "video" / "distill" / "causvid" / "model.pt")
    assert not (run / "video" / "eval.json.partial").exists()  # the runs kept as they landed, gone once whole
    shipped = trained_audio_assets(run / "audio" / "release")  # checked against its SHA256SUMS
    assert shipped is not None and (shipped["root"] / "AAR_micro.pth").is_file()
    assert (run / "audio" / "release" / "train.json").read_bytes() == (run / "audio" / "aar" / "train.json").read_bytes()
    assert json.loads((run / "plan.json").read_text())["lanes"] == ["video", "audio"]
    summary = (run / "summary.txt").read_text()
    for line in ("video/vae: 16 steps", "video/distill:", "audio/sat:", "audio/aar:", "rollouts_no_past adherence",
                 "video/eval: VAE", "random DiT", "video: ok", "audio: ok"):
        assert line in summary, line
    # the one held-out prompt names a cross: each eval row says whether the rollout drew one
    assert re.search(r"(?m)^  causvid .*; shapes cross [01]/1$", summary)


def test_a_rerun_with_the_same_settings_skips_what_is_done(run, capsys):
    before = _mtimes(run)
    assert main(_argv(run)) == 0
    assert _mtimes(run) == before
    assert capsys.readouterr().out.count("done already") == 8  # 3 + eval, 3 + release


@_later(2)
def _killed(run, folder):
    copy = folder / "run"
    shutil.copytree(run, copy)
    (copy / "video" / "distill" / "train.json").unlink()  # as a stage killed before its end leaves its folder
    (copy / "video" / "distill" / "stale").write_text("left by the killed run")
    before = _mtimes(copy)
    return copy, before, main(_argv(copy))


def test_a_killed_stage_is_trained_again_with_every_step_after_it(later):
    copy, before, code = later["killed"].result()
    assert code == 0
    after = _mtimes(copy)
    assert not (copy / "video" / "distill" / "stale").exists()
    assert (copy / "video" / "distill" / "train.json").is_file()
    assert after[copy / "video" / "eval.json"] > before[copy / "video" / "eval.json"]  # its input changed
    untouched = [p for p in before if "distill" not in p.parts and p.name != "eval.json"]
    assert all(after[p] == before[p] for p in untouched)


def test_other_settings_on_a_started_run_are_refused(run, capsys):
    assert main(_argv(run, "--seed", "1")) == 2
    assert "started with other settings (seed: 0 then, 1 now)" in capsys.readouterr().err


@pytest.mark.parametrize("bad, match", [
    (["--lanes", "video,speech"], "--lanes"), (["--budget", "0"], "--budget"), (["--eval-prompts", "-1"], "eval"),
    (["--video-set", "first_block_share"], "video lane: --set"), (["--audio-set", "no_such=1"], "audio lane"),
    (["--config", "huge"], "unknown training config"), (["--shares", "vae=0.9"], "the video lane's stages take 1.51"),
    (["--shares", "vae=0"], "--shares 'vae=0'"), (["--shares", "unet=0.5"], "STAGE one of vae"),
])
def test_bad_arguments_are_named(tmp_path, capsys, bad, match):
    assert main(_argv(tmp_path / "x", *bad)) == 2
    assert match in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_an_init_must_hold_every_model_of_its_lane(run, tmp_path, capsys):
    assert main(_argv(tmp_path / "x", "--video-init", run / "video" / "vae")) == 2
    assert "is the output of the 'vae' stage" in capsys.readouterr().err
    assert main(_argv(tmp_path / "y", "--audio-init", run / "audio" / "clap")) == 2
    assert "is the output of the 'clap' stage" in capsys.readouterr().err


def test_an_init_continues_every_stage_but_distillation(run, tmp_path):
    args = argparse.Namespace(config="micro", seed=4, device="cpu", budget=600.0, eval_prompts=2,
                              video_init=str(run / "video" / "distill"), audio_init=str(run / "audio" / "aar"),
                              video_set=["first_block_share=0.8"], audio_set=[])
    for lane in train_all.LANES:
        steps = train_all.lane_commands(lane, tmp_path, args)
        for (name, _, cmd), k in zip(steps, range(len(train_all.STAGES[lane]))):
            assert cmd[cmd.index("--seed") + 1] == str(4 + k)
            assert float(cmd[cmd.index("--budget") + 1]) == pytest.approx(600 * train_all.SHARES[name], abs=1)
            assert ("--init" in cmd) == (name != "distill")
            assert ("--set" in cmd) == (lane == "video")
    plan = train_all.plan_record(args, list(train_all.LANES))
    assert plan["overrides"] == {"video": ["first_block_share=0.8"]} and set(plan["inits"]) == {"video", "audio"}
    assert sum(train_all.SHARES[s] for s in train_all.STAGES["video"]) < 1  # room for the eval
    assert sum(train_all.SHARES[s] for s in train_all.STAGES["audio"]) < 1  # and the release


def test_ship_video_keeps_the_releases_own_eval_and_refuses_another(run, tmp_path, capsys):
    from mmkv.assets import demo_ready, trained_video_assets
    from mmkv.cli import main

    distill, ev = run / "video" / "distill", run / "video" / "eval.json"
    dest = tmp_path / "video"
    assert main(["ship", "video", "--from", str(distill), "--eval", str(ev), "--out", str(dest)]) == 0
    assert (dest / "eval.json").read_bytes() == ev.read_bytes()
    found = trained_video_assets(dest)  # eval.json is recorded in SHA256SUMS with the weights
    ready, score = demo_ready("video", found)
    assert not ready and "held-out prompts' free CausVid rollouts" in score  # a micro model is far from the bar
    other = json.loads(ev.read_text())
    other["ckpt"]["sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["ship", "video", "--from", str(distill), "--eval", str(tmp_path / "other.json"),
                 "--out", str(tmp_path / "x")]) == 2
    assert "scored other weights" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_shares_move_the_budget_between_a_lanes_stages(tmp_path):
    args = argparse.Namespace(config="micro", seed=0, device="cpu", budget=1000.0, eval_prompts=2, video_init=None,
                              audio_init=None, video_set=[], audio_set=[], shares="vae=0.55,dit=0.3, distill=0.1")
    budgets = {name: float(cmd[cmd.index("--budget") + 1])
               for lane in train_all.LANES for name, _, cmd in train_all.lane_commands(lane, tmp_path, args)
               if "--budget" in cmd}
    assert budgets == {"vae": 550, "dit": 300, "distill": 100, "clap": 80, "sat": 500, "aar": 360}
    plan = train_all.plan_record(args, list(train_all.LANES))
    assert plan["shares"] == {"vae": 0.55, "dit": 0.3, "distill": 0.1}  # what a restart must give again


def test_vae_decoder_only_reaches_the_vae_stage_alone_and_needs_a_video_init(run, tmp_path, capsys):
    args = argparse.Namespace(config="micro", seed=0, device="cpu", budget=600.0, eval_prompts=2,
                              video_init=str(run / "video" / "distill"), audio_init=None, video_set=[], audio_set=[],
                              vae_decoder_only=True)
    cmds = {name: cmd for name, _, cmd in train_all.lane_commands("video", tmp_path, args)}
    assert [name for name, cmd in cmds.items() if "--decoder-only" in cmd] == ["vae"]
    assert train_all.plan_record(args, ["video"])["vae_decoder_only"] is True
    args.vae_decoder_only = False  # a plan without the flag stays as it was before the flag existed
    assert "vae_decoder_only" not in train_all.plan_record(args, ["video"])
    assert main(_argv(tmp_path / "z", "--vae-decoder-only")) == 2
    assert "--vae-decoder-only fine-tunes an existing VAE's decoder: give --video-init" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


@_later(2)
def _decoder_only(run, folder):
    out = folder / "dec"
    argv = ["train", "all", "--out", str(out), "--config", "micro", "--device", "cpu", "--eval-prompts", "1",
            "--lanes", "video", "--video-init", str(run / "video" / "distill"), "--vae-decoder-only", "--stop-after",
            "vae"]
    return out, argv, main(argv)


def test_stop_after_vae_scores_and_ships_the_inits_dit_with_a_fine_tuned_decoder(run, later, tmp_path, capsys):
    """`--vae-decoder-only --stop-after vae`: the decoder alone trains; the encoder (so the latents the DiT learned)
    and the DiT are the init's, and the stage's release pairs them with the new decoder for the eval and `ship`."""
    from safetensors.torch import load_file

    init = run / "video" / "distill"
    out, argv, code = later["decoder_only"].result()
    assert code == 0
    assert sorted(p.name for p in (out / "video").iterdir() if p.is_dir()) == ["vae"]
    release = out / "video" / "vae" / "release"
    assert (release / "causvid" / "model.pt").read_bytes() == (init / "causvid" / "model.pt").read_bytes()
    for name in ("text_encoder", "tokenizer", "transformer"):
        assert sorted(p.name for p in (release / "base" / name).iterdir()) == \
            sorted(p.name for p in (init / "base" / name).iterdir())
    before, after = (load_file(next((d / "base" / "vae").glob("*.safetensors"))) for d in (init, release))
    assert before.keys() == after.keys()
    kept = [k for k in before if not k.startswith(("decoder.", "post_quant_conv."))]
    assert kept and all(torch.equal(before[k], after[k]) for k in kept)  # the encoder: the DiT's latents
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))
    assert json.loads((release / "base" / "vae" / "config.json").read_text())["latents_mean"] == \
        json.loads((init / "base" / "vae" / "config.json").read_text())["latents_mean"]
    record = json.loads((release / "train.json").read_text())
    vae_rec = json.loads((out / "video" / "vae" / "train.json").read_text())
    assert vae_rec["source"] is None and vae_rec["init"] == str(init)  # the first stage: no --from
    assert record["stage"] == "distill" and [r["steps"] for r in record["vae_decoder_runs"]] == [vae_rec["steps"]]
    assert vae_rec["decoder_only"] and vae_rec["release_bytes"] > 0
    ev = json.loads((out / "video" / "eval.json").read_text())
    assert ev["ckpt"]["sha256"] == sha256_file(init / "causvid" / "model.pt")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["stop_after"] == {"video": "vae"}
    assert train_all.replay_pins(out, plan, ["video"]).keys() == {"vae"}
    shipped = tmp_path / "shipped"
    assert main(["ship", "video", "--from", str(release), "--eval", str(out / "video" / "eval.json"),
                 "--out", str(shipped)]) == 0
    assert (shipped / "train.json").read_bytes() == (release / "train.json").read_bytes()
    capsys.readouterr()
    assert main(argv) == 0 and capsys.readouterr().out.count("done already") == 2  # vae, eval


def test_stop_after_dit_scores_the_teacher(tmp_path):
    args = argparse.Namespace(config="micro", seed=0, device="cpu", budget=100.0, eval_prompts=2, video_init=None,
                              audio_init=None, video_set=[], audio_set=[], stop_after_lanes={"video": "dit"})
    cmds = {name: cmd for name, _, cmd in train_all.lane_commands("video", tmp_path, args)}
    assert list(cmds) == ["vae", "dit", "eval"]
    assert cmds["eval"][cmds["eval"].index("--ckpt") + 1] == str(tmp_path / "video" / "dit" / "causvid")
    assert "--from" not in cmds["vae"]
    budgets = {name: float(cmd[cmd.index("--budget") + 1]) for name, cmd in cmds.items() if "--budget" in cmd}
    assert budgets == {"vae": 33, "dit": 45}  # the stages it trains keep their shares


@pytest.mark.parametrize("extra, match", [
    (["--stop-after", "vae"], "--stop-after vae keeps the --video-init's DiT"),
    (["--stop-after", "sat"], "--stop-after 'sat': expected one of vae, dit"),
    (["--stop-after", "dit", "--lanes", "audio"], "the video lane is not run"),
])
def test_stop_after_names_what_it_needs(tmp_path, capsys, extra, match):
    assert main(_argv(tmp_path / "x", *extra)) == 2
    assert match in capsys.readouterr().err and not (tmp_path / "x").exists()


CUTS = {"vae": 4, "dit": 6, "distill": 5}
# the budget's re-plans, which the learning-rate schedule followed (the dit record is one from before they were kept:
# its final count alone is pinned)
PLANS = {"vae": [[0, 9], [2, 6], [3, 4]], "distill": [[0, 5]]}


@_later(4)
def _replay(run, folder):
    copy = folder / "cut"
    shutil.copytree(run, copy)
    for stage, steps in CUTS.items():
        path = copy / "video" / stage / "train.json"
        rec = json.loads(path.read_text())
        rec["steps"] = steps
        rec.pop("step_plan")
        if stage in PLANS:
            rec["step_plan"] = PLANS[stage]
        if stage == "distill":
            rec["ode_trajectories"] = {"3-frame blocks": 2, "1-frame blocks": 0}
        path.write_text(json.dumps(rec))
    out = folder / "replay"
    return copy, out, main(["train", "all", "--out", str(out), "--replay", str(copy), "--lanes", "video", "--device",
                            "cpu"])


def test_a_replay_pins_every_stage_to_what_the_run_trained(later):
    """`--replay`: a budgeted run's stages end where its clock cut them; the replay reads each stage's record and
    trains exactly that (steps, DiT dataset, teacher trajectories of each kind), with no budget. Here the records of
    a copy are cut by hand (`_replay`: `CUTS`, `PLANS`), as a budget would have cut them."""
    copy, out, code = later["replay"].result()
    assert code == 0
    for stage, steps in CUTS.items():
        rec = json.loads((out / "video" / stage / "train.json").read_text())
        assert rec["steps"] == steps and rec["budget_s"] is None
        assert rec["step_plan"] == PLANS.get(stage, [[0, steps]])  # the run's re-plans, step for step
        assert rec["seed"] == train_all.STAGES["video"].index(stage)  # the run's seeds
    distill = json.loads((out / "video" / "distill" / "train.json").read_text())
    assert distill["ode_trajectories"] == {"3-frame blocks": 2}
    assert json.loads((out / "video" / "dit" / "train.json").read_text())["dataset_clips"] == 8
    plan = json.loads((out / "plan.json").read_text())
    assert plan["lanes"] == ["video"] and plan["budget_s"] is None and plan["config"] == "micro"
    assert plan["replay_of"]["plan_sha256"] == sha256_file(copy / "plan.json")
    assert plan["pins"]["distill"][-1] == "ode_frame_trajectories=0"
    assert plan["pins"]["vae"] == ["--step-plan", "0:9,2:6,3:4"] and plan["pins"]["dit"][:2] == ["--steps", "6"]
    assert (out / "video" / "eval.json").is_file() and not (out / "audio").exists()
    assert "--budget" not in (out / "video" / "vae.log").read_text().splitlines()[0]


@pytest.mark.parametrize("extra,message", [
    (["--seed", "3"], "--replay takes every setting from"),
    (["--budget", "60"], "(got --budget)"),
    (["--video-init", "elsewhere"], "its video lane started from scratch; --video-init has nothing to relocate"),
    (["--video-set", "vae_lr=1e-3"], "(got --video-set)"),
    (["--lanes", "video,nope"], "it ran the lanes video, audio, not nope"),
])
def test_a_replay_refuses_settings_of_its_own(run, tmp_path, capsys, extra, message):
    assert main(["train", "all", "--out", str(tmp_path / "r"), "--replay", str(run), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_replay_needs_a_finished_run(run, tmp_path, capsys):
    assert main(["train", "all", "--out", str(tmp_path / "r"), "--replay", str(tmp_path)]) == 2
    assert "no plan.json there" in capsys.readouterr().err
    copy = tmp_path / "unfinished"
    shutil.copytree(run, copy)
    (copy / "audio" / "sat" / "train.json").unlink()
    assert main(["train", "all", "--out", str(tmp_path / "r"), "--replay", str(copy)]) == 2
    assert "its audio stage 'sat' did not finish" in capsys.readouterr().err


def test_a_replay_refuses_an_init_that_changed(run, tmp_path, capsys):
    copy = tmp_path / "from_init"
    shutil.copytree(run, copy)
    plan = json.loads((copy / "plan.json").read_text())
    init = run / "video" / "distill"
    plan["inits"] = {"video": {"folder": str(init), "train_json_sha256": "0" * 64}}
    (copy / "plan.json").write_text(json.dumps(plan))
    assert main(["train", "all", "--out", str(tmp_path / "r"), "--replay", str(copy), "--lanes", "video"]) == 2
    assert f"its --video-init {init} is not the set it continued" in capsys.readouterr().err
    plan["inits"]["video"]["train_json_sha256"] = sha256_file(init / "train.json")  # the set, found elsewhere now
    (copy / "plan.json").write_text(json.dumps(plan))
    moved = tmp_path / "moved"
    shutil.copytree(init, moved)
    (moved / "train.json").write_text("{}")
    assert main(["train", "all", "--out", str(tmp_path / "r2"), "--replay", str(copy), "--lanes", "video",
                 "--video-init", str(moved)]) == 2
    assert f"its --video-init {moved} is not the set it continued" in capsys.readouterr().err


def test_a_replay_takes_an_init_replayed_elsewhere_by_its_weights(run, tmp_path):
    """A run that continued a run replays from that run's replay: same weights, other seconds in its train.json.
    plan.json records the init's weights digest (every file but the records), and the replay accepts a folder whose
    train.json differs when its weights are those; one changed byte of a weight is refused."""
    from mmkv.pipelines.train_all import add_arguments, apply_replay, weights_digest

    init = run / "video" / "distill"
    copy = tmp_path / "continued"
    shutil.copytree(run, copy)
    plan = json.loads((copy / "plan.json").read_text())
    plan["inits"] = {"video": {"folder": str(init), "train_json_sha256": sha256_file(init / "train.json"),
                               "weights_sha256": weights_digest(init)}}
    (copy / "plan.json").write_text(json.dumps(plan))
    replayed = tmp_path / "replayed"
    shutil.copytree(init, replayed)
    (replayed / "train.json").write_text('{"seconds": 1}')  # a replay's own timings
    assert weights_digest(replayed) == weights_digest(init)

    def replay(folder):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(["--out", str(tmp_path / "r"), "--replay", str(copy), "--lanes", "video",
                                  "--video-init", str(folder)])
        apply_replay(args)
        return args

    assert replay(replayed).video_init == str(replayed)
    weight = next(p for p in sorted(replayed.rglob("*.safetensors")))
    data = bytearray(weight.read_bytes())
    data[-1] ^= 1
    weight.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="nor are its weights those recorded"):
        replay(replayed)


@_later(2)
def _start_at(run, folder):
    out = folder / "later"
    argv = _argv(out, "--video-init", run / "video" / "distill", "--audio-init", run / "audio" / "release",
                 "--start-at", "dit,aar", "--eval-prompts", 0)
    return out, argv, main(argv)


def test_start_at_trains_a_lanes_later_stages_on_its_inits_models(run, later, capsys):
    """`--start-at dit,aar`: a run that fits one device call. The skipped stages' models come from the inits as they
    are (the dit stage reads its VAE from the video init, the aar stage its SAT and CLAP from the audio release),
    each trained stage keeps its seed, and the plan records the start so that a restart must give it again."""
    video, audio = run / "video" / "distill", run / "audio" / "release"
    out, argv, code = later["start_at"].result()
    assert code == 0
    assert sorted(p.name for p in (out / "video").iterdir() if p.is_dir()) == ["distill", "dit"]
    assert sorted(p.name for p in (out / "audio").iterdir() if p.is_dir()) == ["aar", "release"]
    dit = json.loads((out / "video" / "dit" / "train.json").read_text())
    assert dit["source"] == str(video) and dit["init"] == str(video) and dit["seed"] == 1
    aar = json.loads((out / "audio" / "aar" / "train.json").read_text())
    assert aar["source"] == str(audio) and aar["seed"] == 2
    assert json.loads((out / "plan.json").read_text())["start_at"] == {"video": "dit", "audio": "aar"}
    assert trained_audio_assets(out / "audio" / "release") is not None
    capsys.readouterr()
    assert main(argv) == 0 and capsys.readouterr().out.count("done already") == 4  # dit, distill; aar, release
    assert main(argv[:-4] + ["--eval-prompts", "0"]) == 2  # the same run without --start-at
    assert "start_at: {'video': 'dit', 'audio': 'aar'} then, None now" in capsys.readouterr().err
    plan = json.loads((out / "plan.json").read_text())
    assert train_all.replay_pins(out, plan, ["video", "audio"]).keys() == {"dit", "distill", "aar"}


@pytest.mark.parametrize("extra, match", [
    (["--start-at", "vae"], "--start-at 'vae': expected one of dit, distill, sat, aar"),
    (["--start-at", "distill"], "the video lane's earlier stages come from --video-init"),
    (["--start-at", "dit"], "the video lane's earlier stages come from --video-init"),
    (["--start-at", "sat,aar", "--audio-init", "x"], "names two audio stages (sat, aar)"),
    (["--start-at", "dit", "--lanes", "audio"], "the video lane is not run"),
])
def test_start_at_names_what_it_needs(tmp_path, capsys, extra, match):
    assert main(_argv(tmp_path / "x", *extra)) == 2
    assert match in capsys.readouterr().err and not (tmp_path / "x").exists()


@_later(1)
def _start_at_distill(run, folder):
    out = folder / "d"
    return out, main(_argv(out, "--lanes", "video", "--start-at", "distill", "--video-init", run / "video" / "dit",
                           "--eval-prompts", 0))


def test_start_at_distill_distils_a_dit_output_and_nothing_else(run, later, tmp_path, capsys):
    """`--start-at distill`: a DiT trained for one device call (`--stop-after dit`) distilled by a run of its own in
    the next (`_start_at_distill`), its init the teacher; a distill output (a student) is refused."""
    student = run / "video" / "distill"
    argv = _argv(tmp_path / "no", "--lanes", "video", "--start-at", "distill", "--video-init", student)
    assert main(argv) == 2 and not (tmp_path / "no").exists()
    assert "is a 'distill' output; the distillation needs its teacher, a dit output" in capsys.readouterr().err
    teacher = run / "video" / "dit"
    out, code = later["start_at_distill"].result()
    assert code == 0
    assert sorted(p.name for p in (out / "video").iterdir() if p.is_dir()) == ["distill"]
    rec = json.loads((out / "video" / "distill" / "train.json").read_text())
    assert rec["source"] == str(teacher) and rec["init"] is None and rec["seed"] == 2
    plan = json.loads((out / "plan.json").read_text())
    assert plan["start_at"] == {"video": "distill"} and plan["inits"]["video"]["folder"] == str(teacher.resolve())
    # a replay pins the distillation alone (test_a_replay_pins_every_stage_to_what_the_run_trained replays one)
    pins = train_all.replay_pins(out, plan, ["video"])
    made = rec["ode_trajectories"]["3-frame blocks"]
    assert pins.keys() == {"distill"} and f"ode_chunk_trajectories={made}" in pins["distill"]


def test_start_at_shares_the_budget_among_the_stages_it_trains(run, tmp_path, capsys):
    args = argparse.Namespace(config="micro", seed=0, device="cpu", budget=400.0, eval_prompts=2,
                              video_init=str(run / "video" / "distill"), audio_init=str(run / "audio" / "release"),
                              video_set=[], audio_set=[], shares="dit=0.6,distill=0.4,aar=1",
                              start_at_lanes={"video": "dit", "audio": "aar"})
    cmds = {name: cmd for lane in train_all.LANES for name, _, cmd in train_all.lane_commands(lane, tmp_path, args)}
    assert list(cmds) == ["dit", "distill", "eval", "aar", "release"]
    budgets = {name: float(cmd[cmd.index("--budget") + 1]) for name, cmd in cmds.items() if "--budget" in cmd}
    assert budgets == {"dit": 240, "distill": 160, "aar": 400}
    assert cmds["dit"][cmds["dit"].index("--from") + 1] == args.video_init
    assert cmds["aar"][cmds["aar"].index("--from") + 1] == args.audio_init
    # the same shares for a run of every stage overfill its lanes (vae 0.33 + 1)
    assert main(_argv(tmp_path / "x", "--budget", 400, "--shares", "dit=0.6,distill=0.4,aar=1")) == 2
    assert "the video lane's stages take 1.33 of the budget" in capsys.readouterr().err


def test_deterministic_reaches_every_stage_the_plan_and_its_replay(run, tmp_path, capsys):
    args = argparse.Namespace(config="micro", seed=0, device="cpu", budget=None, eval_prompts=1, video_init=None,
                              audio_init=None, video_set=[], audio_set=[], shares=None, deterministic=True)
    cmds = [cmd for lane in train_all.LANES for _, _, cmd in train_all.lane_commands(lane, tmp_path, args)]
    stages = [cmd for cmd in cmds if "--stage" in cmd]
    assert len(stages) == 6 and all("--deterministic" in cmd for cmd in stages)
    assert not any("--deterministic" in cmd for cmd in cmds if "--stage" not in cmd)  # the eval and the release
    assert train_all.plan_record(args, list(train_all.LANES))["deterministic"] is True
    args.deterministic = False
    assert "deterministic" not in train_all.plan_record(args, list(train_all.LANES))  # earlier plans unchanged
    # a replay takes the setting from the run's plan.json, and refuses it on the command line
    copy = tmp_path / "det"
    shutil.copytree(run, copy)
    plan = json.loads((copy / "plan.json").read_text())
    (copy / "plan.json").write_text(json.dumps({**plan, "deterministic": True}))
    replay = argparse.Namespace(replay=str(copy), budget=None, shares=None, video_set=[], audio_set=[],
                                vae_decoder_only=False, seed=0, config="tiny", lanes="video", video_init=None,
                                audio_init=None, deterministic=False, device="cpu", eval_prompts=1)
    train_all.apply_replay(replay)
    assert replay.deterministic is True
    assert all("--deterministic" in cmd for _, _, cmd in train_all.lane_commands("video", tmp_path / "r", replay)
               if "--stage" in cmd)
    assert main(["train", "all", "--out", str(tmp_path / "r2"), "--replay", str(run), "--deterministic"]) == 2
    assert "(got --deterministic)" in capsys.readouterr().err


def test_the_distillation_scores_its_teacher_on_held_out_prompts_without_changing_the_student(run, tmp_path):
    """`teacher_eval`: the teacher's own ODE rollouts of held-out captions, scored by the detector; its noise is its
    own, so the student trains on the same draws and comes out byte for byte the same."""
    from mmkv.pipelines.wan import scenes
    from mmkv.pipelines.wan.distill import distill
    from mmkv.pipelines.wan.train import get_config

    outs = {}
    for n in (0, 2):
        cfg = get_config("micro", teacher_eval=n, distill_steps=3)
        stats = distill(cfg, run / "video" / "dit", tmp_path / str(n), device=torch.device("cpu"), seed=7,
                        budget_s=None, log=lambda _: None)
        outs[n] = (stats, (tmp_path / str(n) / "causvid" / "model.pt").read_bytes())
    assert outs[0][0]["teacher_eval"] is None
    ev = outs[2][0]["teacher_eval"]
    assert [c["seed"] for c in ev["clips"]] == scenes.held_out_seeds(2)
    assert ev["summary"]["clips"] == 2 and ev["ode_steps"] == len(outs[2][0]["ode_grid"]) - 1
    assert ev["guidance"] == 2.0 and {"colour_pct", "shape_pct", "direction_pct"} <= ev["summary"].keys()
    assert outs[0][1] == outs[2][1]
