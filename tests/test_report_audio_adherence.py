"""`mmkv report` on audio runs whose clips carry procedural captions (`mmkv.pipelines.aar.sounds`): every rollout,
the reference included, is scored for adherence from its own waveform, and each codec rollout for how well its onsets
agree with the reference's, in every table format and in the gallery (beside each clip's spectrogram); clips without
a procedural caption get no such columns. Also: `mmkv compare audio` records a clip's caption from the
`<clip stem>.txt` beside it."""

import csv
import dataclasses
import io
import json

import numpy as np
import pytest
import soundfile as sf
import torch
from test_report import _report, make_run

from mmkv.cli import main as mmkv_main
from mmkv.pipelines.aar import sounds as S
from mmkv.report.adherence import onset_agreement

pytestmark = pytest.mark.usefixtures("one_thread")

# Held-out sounds the detector reads right: a sustained square Eb3 note (clip_a) and four clicks (clip_b).
NOTE_SEED, CLICKS_SEED = 10_000_014, 10_000_003
PITCH, CLICK = "turboquant_b2", "polarquant_b2"
PRESETS = [("turboquant-mse:b=2", PITCH, 2, 0.0, 3.2, 2.7), ("polarquant:b=2", CLICK, 2, 0.0, 3.3, 2.6)]
REPORT = ["--lpips", "off", "--device", "cpu", "--no-plots"]


@pytest.fixture(scope="module")
def sounds():
    return [S.sample_sound(NOTE_SEED), S.sample_sound(CLICKS_SEED)]


def _renderer(sounds):
    """Waveform per (item, variant): the reference is the caption's sound; PITCH plays a note 4 semitones up; CLICK
    leaves out the second click. Each leaves the other clip as the reference has it."""
    notes = list(S.NOTES)

    def render(i, variant):
        s = sounds[i]
        if variant == PITCH and s.kind == "note":
            s = dataclasses.replace(s, note=notes[notes.index(s.note) + 4])
        if variant == CLICK and s.kind == "clicks":
            s = dataclasses.replace(s, count=s.count - 1, click_times=s.click_times[:1] + s.click_times[2:],
                                    click_gains=s.click_gains[:1] + s.click_gains[2:])
        return S.render(s)[0].numpy()

    return render


def _run(path, sounds, captions=None):
    make_run([(path, 0, 1)], kind="audio", n_items=len(sounds), presets=PRESETS, render=_renderer(sounds),
             captions=captions)
    return path


def _md_rows(md: str) -> dict[str, dict[str, str]]:
    """codec -> {header: cell, best / runner-up marks dropped} of the report's main markdown table."""
    lines = md.split("**Compressed-KV")[1].split("\n\n")[1].splitlines()
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = [[c.strip().strip("*").removeprefix("<u>").removesuffix("</u>") for c in ln.strip("|").split("|")]
            for ln in lines[2:]]
    return {r[head.index("codec")]: dict(zip(head, r)) for r in rows}


def test_onset_agreement_pairs_one_to_one_within_the_tolerance():
    assert onset_agreement([0.1, 0.3], [0.105, 0.3]) == (1.0, pytest.approx(2.5))
    assert onset_agreement([0.1, 0.104], [0.1])[0] == 0.5  # one test onset cannot stand for two
    assert onset_agreement([0.1, 0.3, 0.5], [0.1, 0.5])[0] == pytest.approx(2 / 3)
    assert onset_agreement([0.1], [0.2]) == (0.0, pytest.approx(100.0))
    assert onset_agreement([0.1], []) == (0.0, None) and onset_agreement([], [0.1]) == (None, None)


def test_reference_and_codecs_are_scored_in_every_format(tmp_path, sounds, capsys):
    run = _run(tmp_path / "run", sounds, [S.caption(s) for s in sounds])
    outs = [tmp_path / "out_a", tmp_path / "out_b"]
    for out in outs:
        rc, _, err = _report([run, "--format", "md,csv,json,latex,html", "--out", out, *REPORT], capsys)
        assert rc == 0 and "problem" not in err, err
    out = outs[0]

    md = _md_rows((out / "table.md").read_text())
    assert list(md) == ["reference", "TurboQuant-MSE", "PolarQuant"]  # the reference first, in a row of its own
    assert md["reference"]["adherence↑ μ"] == "100%" and md["reference"]["n"] == "2"
    assert md["reference"]["LSD↓ μ"] == md["reference"]["onsets≈↑ μ"] == md["reference"]["onset Δms↓ μ"] == "–"
    assert md["TurboQuant-MSE"]["adherence↑ μ"] == "88%"  # the note's pitch wrong (3 of 4), the clicks right
    assert md["TurboQuant-MSE"]["onsets≈↑ μ"] == "100%" and md["TurboQuant-MSE"]["onset Δms↓ μ"] == "0.0"
    assert md["PolarQuant"]["adherence↑ μ"] == "75%"  # the click count wrong (1 of 2), the note right
    assert md["PolarQuant"]["onsets≈↑ μ"] == "88%"  # 3 of the 4 clicks, and the note's onset
    assert "LSD↓ μ" in md["PolarQuant"] and md["PolarQuant"]["LSD↓ μ"] != "–"

    table = json.loads((out / "table.json").read_text())
    rows = {r["codec"]: r for r in table["rows"]}
    assert rows["reference"]["aar/adherence/mean"] == 1.0 and rows["reference"]["aar/lsd_db/mean"] is None
    assert rows["reference"]["aar/onset_match/mean"] is None
    assert rows["TurboQuant-MSE"]["aar/adherence/min"] == 0.75 and rows["TurboQuant-MSE"]["aar/adherence/mean"] == 0.875
    assert rows["PolarQuant"]["aar/adherence/min"] == 0.5 and rows["PolarQuant"]["aar/onset_match/min"] == 0.75
    # The click left out is 160 ms from the nearest one left: the mean over the clips' reference onsets.
    assert rows["PolarQuant"]["aar/onset_error_ms/max"] == pytest.approx(160 / 4, abs=1.0)
    assert "rank" not in rows["reference"]  # never marked best: it is not a codec
    assert rows["TurboQuant-MSE"]["rank"]["aar/adherence/mean"] == 1
    assert any(n.startswith("Audio adherence: the share of the caption's named attributes") for n in table["notes"])

    csv_rows = {r["codec"]: r for r in csv.DictReader(io.StringIO((out / "table.csv").read_text()))}
    assert float(csv_rows["reference"]["aar/adherence/mean"]) == 1.0
    tex = (out / "table.tex").read_text()
    assert r"100\%" in tex and "adherence" in tex and "onset" in tex
    rollouts = list(csv.DictReader(io.StringIO((out / "rollouts.csv").read_text())))
    assert [r["variant"] for r in rollouts] == ["reference", CLICK, PITCH] * 2
    by = {(r["item"], r["variant"]): r for r in rollouts}
    assert by["clip_a", PITCH]["pitch_ok"] == "False" and by["clip_a", PITCH]["waveform_ok"] == "True"
    assert by["clip_b", CLICK]["count_ok"] == "False" and by["clip_b", CLICK]["onset_count"] == "3"
    assert by["clip_b", "reference"]["onset_count"] == "4" and by["clip_b", "reference"]["onset_match"] == ""

    page = (out / "index.html").read_text()
    assert page.count("native cache (reference) · adherence 100%</span>") == 2  # no onsets against itself
    assert "adherence 50% · onsets≈ 75% · onset Δms" in page and "adherence 75% · onsets≈ 100% · onset Δms 0.0" in page
    assert "<p>" + S.caption(sounds[0]) + "</p>" in page  # the caption heads the clip's row
    assert "onsets≈↑" in page  # the html tables

    # A spectrogram beside every player, and identical runs give identical reports, pictures included.
    n = 2 * (1 + len(PRESETS))
    assert page.count('<img class="spec"') == page.count("<audio controls") == n
    stills = sorted(p.relative_to(out) for p in (out / "stills").rglob("*.png"))
    assert len(stills) == n
    for name in ["table.md", "table.csv", "table.json", "table.tex", "rollouts.csv", "index.html", *stills]:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_clips_without_a_procedural_caption_get_no_adherence(tmp_path, sounds, capsys):
    for name, captions in (("plain", None), ("other", ["a dog barks twice", "rain on a tin roof"])):
        run = _run(tmp_path / name, sounds, captions)
        rc, out, err = _report([run, "--format", "md,json", *REPORT], capsys)
        assert rc == 0 and "problem" not in err, err
        assert "adherence" not in out and "onset" not in out and "| reference |" not in out, name

    mixed = _run(tmp_path / "mixed", sounds, [S.caption(sounds[0]), "a dog barks twice"])
    rc, out, err = _report([mixed, "--format", "json", *REPORT], capsys)
    assert rc == 0 and "problem" not in err, err
    table = json.loads(out)["tables"][0]
    rows = {r["codec"]: r for r in table["rows"]}
    assert rows["reference"]["aar/n"] == 2 and rows["reference"]["aar/adherence/mean"] == 1.0
    assert rows["TurboQuant-MSE"]["aar/adherence/mean"] == 0.75  # clip_b not counted as 0
    assert ("aar: adherence and onset agreement are over the 1 item(s) whose prompt is a procedural caption "
            "(clip_a) only; the other 1 (clip_b) have no procedural caption and are not scored.") in table["notes"]


def test_compare_audio_records_the_caption_beside_each_clip(tmp_path, capsys, request):
    from mmkv.pipelines.aar.tiny import random_condition, write_tiny_checkpoints

    write_tiny_checkpoints(tmp_path / "models", "micro", seed=5)
    (tmp_path / "emb").mkdir()
    (tmp_path / "clips").mkdir()
    for i, vec in enumerate(random_condition(2, seed=2).numpy()):
        np.save(tmp_path / "emb" / f"clip{i}.npy", vec)
        sf.write(tmp_path / "clips" / f"clip{i}.wav", np.full(2400, 0.01, np.float32), 24000)
    caption = S.caption(S.sample_sound(NOTE_SEED))
    (tmp_path / "clips" / "clip0.txt").write_text(f"  {caption}\n", encoding="utf-8")
    run = tmp_path / "run"
    request.addfinalizer(lambda threads=torch.get_num_threads(): torch.set_num_threads(threads))
    torch.set_num_threads(1)  # tiny models: thread start-up costs more than it saves
    argv = ["compare", "audio", "--aar", str(tmp_path / "models"), "--embeddings", str(tmp_path / "emb"), "--clips",
            str(tmp_path / "clips"), "--codecs", "identity", "--out", str(run), "--device", "cpu"]
    assert mmkv_main(argv) == 0
    for variant in ("reference", "identity_dtypenative"):
        assert json.loads((run / "rollouts/clip0" / variant / "rollout.json").read_text())["caption"] == caption
        assert json.loads((run / "rollouts/clip1" / variant / "rollout.json").read_text())["caption"] is None
    capsys.readouterr()
    rc, _, err = _report([run, "--format", "json", *REPORT], capsys)
    # The report reads the caption: the micro model's 67 ms rollouts are too short to score, and it says so.
    problems = [ln for ln in err.splitlines() if ln.startswith("  - ")]
    assert rc == 0 and len(problems) == 2, err
    assert all("rollouts/clip0/" in ln and "adherence not scored: score_audio needs at least 0.1 s" in ln
               for ln in problems), err

    (tmp_path / "clips" / "clip1.txt").write_bytes(b"\xff\xfe not utf-8")
    rc = mmkv_main([*argv[:-4], "--out", str(tmp_path / "run2"), "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 1 and "caption" in out and "clip1.txt cannot be read as UTF-8 text" in out
