"""`mmkv report` on runs whose prompts are procedural captions: every rollout, the reference included, is scored for
prompt adherence and scene consistency from its own frames, in every table format and in the gallery; other
prompts get no adherence columns, and a run mixing both says which items the scores are over."""

import csv
import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from test_report import _report, make_run

from mmkv.pipelines.wan import scenes as S

pytestmark = pytest.mark.usefixtures("one_thread")

# Fixed held-out scenes, so the reference reads 100% every time (the detector is right on ~98% of scenes).
SEEDS = (S.HELD_OUT_SEED_START, S.HELD_OUT_SEED_START + 1)
STRIPES, COLOUR = "turboquant_b2", "polarquant_b2"
PRESETS = [("turboquant-mse:b=2", STRIPES, 2, 0.0, 3.2, 2.7), ("polarquant:b=2", COLOUR, 2, 0.0, 3.3, 2.6)]
REPORT = ["--lpips", "off", "--device", "cpu", "--no-plots"]


def _u8(scene) -> np.ndarray:
    return (S.render(scene)[0] * 255).round().to(torch.uint8).numpy()


def _renderer(scenes):
    """Frames per (item, variant): the reference draws the caption's scene; STRIPES shifts the stripes by half a
    period from frame 33 (block 4) on; COLOUR draws the object in another palette colour throughout."""

    def render(i, variant):
        scene = scenes[i % len(scenes)]
        if variant == COLOUR:
            return _u8(dataclasses.replace(scene, colour=next(c for c in S.COLOURS if c != scene.colour)))
        frames = _u8(scene)
        if variant == STRIPES:
            bg = scene.background
            shifted = dataclasses.replace(scene, background=dataclasses.replace(bg, phase=(bg.phase + 0.5) % 1))
            frames[33:] = _u8(shifted)[33:]
        return frames

    return render


@pytest.fixture(scope="module")
def scenes():
    return [S.sample_scene(s) for s in SEEDS]


def _run(path, scenes, texts):
    make_run([(path, 0, 1)], n_items=len(texts), frames=S.FRAMES, presets=PRESETS, texts=texts,
             render=_renderer(scenes))
    return path


def _md_rows(md: str, title: str) -> dict[str, dict[str, str]]:
    """codec -> {header: cell, best / runner-up marks dropped} of one markdown table of the report."""
    lines = md.split(f"**{title}")[1].split("\n\n")[1].splitlines()
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = [[c.strip().strip("*").removeprefix("<u>").removesuffix("</u>") for c in ln.strip("|").split("|")]
            for ln in lines[2:]]
    return {r[head.index("codec")]: dict(zip(head, r)) for r in rows}


def test_reference_and_codecs_are_scored_in_every_format(tmp_path, scenes, capsys):
    run = _run(tmp_path / "run", scenes, [S.caption(s) for s in scenes])
    outs = [tmp_path / "out_a", tmp_path / "out_b"]
    for out in outs:
        rc, _, err = _report([run, "--format", "md,csv,json,latex,html", "--out", out, *REPORT], capsys)
        assert rc == 0 and "problem" not in err, err
    out = outs[0]

    md = _md_rows((out / "table.md").read_text(), "Compressed-KV")
    assert list(md) == ["reference", "TurboQuant-MSE", "PolarQuant"]  # the reference first, in a row of its own
    assert md["reference"]["adherence↑ μ"] == "100%" and md["reference"]["consistency↑ μ"] == "100%"
    assert md["reference"]["PSNR↑ μ"] == "–" and md["reference"]["n"] == "2"
    assert md["PolarQuant"]["adherence↑ μ"] == "80%"  # colour wrong, shape, size, direction and speed right
    assert md["TurboQuant-MSE"]["adherence↑ μ"] == "100%" and md["TurboQuant-MSE"]["consistency↑ μ"] == "33%"  # 2 of 6
    # Against the reference's checks: PolarQuant's colour check alone differs (4 of 5 named attributes agree).
    assert md["reference"]["checks=ref↑ μ"] == "–"
    assert md["PolarQuant"]["checks=ref↑ μ"] == "80%" and md["TurboQuant-MSE"]["checks=ref↑ μ"] == "100%"

    table = json.loads((out / "table.json").read_text())
    rows = {r["codec"]: r for r in table["rows"]}
    assert rows["reference"]["causvid/adherence/mean"] == 1.0 and rows["reference"]["causvid/psnr/mean"] is None
    assert rows["PolarQuant"]["causvid/adherence/max"] == pytest.approx(0.8)
    assert rows["PolarQuant"]["causvid/consistency/mean"] == 1.0
    assert rows["TurboQuant-MSE"]["causvid/consistency/mean"] == pytest.approx(2 / 6)
    assert rows["PolarQuant"]["causvid/attribute_match/mean"] == pytest.approx(0.8)
    assert rows["reference"]["causvid/attribute_match/mean"] is None
    assert "rank" not in rows["reference"]  # never marked best: it is not a codec
    assert rows["TurboQuant-MSE"]["rank"]["causvid/adherence/mean"] == 1
    assert any("adherence: the share of the caption's named attributes" in n for n in table["notes"])

    windows = {r["codec"]: r for r in json.loads((out / "windows.json").read_text())["rows"]}
    for block, want in (("block 2", 1.0), ("block 3", 1.0), ("block 4", 0.0), ("block 7", 0.0)):
        assert windows["TurboQuant-MSE"][f"causvid/block_consistency/{block}"] == want, block
        assert windows["reference"][f"causvid/block_consistency/{block}"] == 1.0
    assert windows["reference"]["causvid/block_background_psnr/block 5"] == 100.0  # the cap: unchanged
    assert windows["TurboQuant-MSE"]["causvid/block_background_psnr/block 5"] < 30
    assert "| block 4 |" not in (out / "windows.md").read_text()  # a column, not a row
    assert "consistency↑ block 4" in (out / "windows.md").read_text()

    csv_rows = {r["codec"]: r for r in csv.DictReader(io.StringIO((out / "table.csv").read_text()))}
    assert float(csv_rows["reference"]["causvid/adherence/mean"]) == 1.0
    assert r"100\%" in (out / "table.tex").read_text() and "adherence" in (out / "table.tex").read_text()
    rollouts = list(csv.DictReader(io.StringIO((out / "rollouts.csv").read_text())))
    assert [r["variant"] for r in rollouts] == ["reference", COLOUR, STRIPES] * 2
    assert {r["colour_ok"] for r in rollouts if r["variant"] == COLOUR} == {"False"}

    page = (out / "index.html").read_text()
    assert page.count("native cache (reference) · adherence 100% · consistency 100%") == 2
    assert page.count("adherence 80% · consistency 100% · checks=ref 80%") == 2
    assert page.count("consistency 33% · checks=ref 100%") == 2
    assert "(reference) · adherence 100% · consistency 100% · checks" not in page  # nothing against itself
    assert "adherence↑" in page  # the html tables

    # Identical runs give identical reports.
    for name in ("table.md", "table.csv", "table.json", "table.tex", "windows.md", "windows.json",
                 "rollouts.csv", "index.html"):
        assert (outs[0] / name).read_text() == (outs[1] / name).read_text(), name


def test_other_prompts_get_no_adherence_and_a_mixed_run_says_which_items_count(tmp_path, scenes, capsys):
    plain = _run(tmp_path / "plain", scenes, ["a red fox runs through snow"])
    rc, out, err = _report([plain, "--format", "md,json", *REPORT], capsys)
    assert rc == 0 and "problem" not in err, err
    assert "adherence" not in out and "consistency" not in out and "| reference |" not in out

    mixed = _run(tmp_path / "mixed", scenes + scenes[:1], [S.caption(s) for s in scenes] + ["a red fox"])
    rc, out, err = _report([mixed, "--format", "json", *REPORT], capsys)
    assert rc == 0 and "problem" not in err, err
    table = json.loads(out)["tables"][0]
    rows = {r["codec"]: r for r in table["rows"]}
    assert rows["reference"]["causvid/n"] == 3 and rows["reference"]["causvid/adherence/mean"] == 1.0
    assert rows["PolarQuant"]["causvid/adherence/mean"] == pytest.approx(0.8)  # p0002 not counted as 0
    assert ("causvid: adherence and consistency are over the 2 item(s) whose prompt is a procedural caption "
            "(p0000, p0001) only; the other 1 (p0002) name no scene and are not scored.") in table["notes"]


def test_attribute_agreement_counts_every_change_of_a_check_against_the_reference():
    from mmkv.report.adherence import attribute_agreement

    ref = {"named": ["colour", "shape", "direction"], "colour_ok": True, "shape_ok": False, "direction_ok": None,
           "size_ok": None, "speed_ok": None}
    same = dict(ref)
    assert attribute_agreement(ref, same) == 1.0
    # A wrong shape turned right is a change, as is a check the detector could not make (None) turned into one.
    changed = {**ref, "shape_ok": True, "direction_ok": False, "size_ok": True}  # size is not named: not counted
    assert attribute_agreement(ref, changed) == pytest.approx(1 / 3)
    assert attribute_agreement({**ref, "named": []}, changed) is None
