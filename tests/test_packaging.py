"""pipelines/, kernels/ and metrics/ install as mmkv.pipelines, mmkv.kernels and mmkv.metrics, never top-level."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("mmkv.pipelines", "mmkv.kernels", "mmkv.metrics")
FOLDERS = {"mmkv.pipelines": "pipelines", "mmkv.kernels": "kernels", "mmkv.metrics": "metrics"}


def _where(python_path: str | None) -> dict[str, str]:
    code = (
        "import importlib, json, importlib.util as u\n"
        f"mods = {SUBPACKAGES!r}\n"
        "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))\n"
        "assert all(u.find_spec(n) is None or 'site-packages' not in (u.find_spec(n).origin or '') "
        "for n in ('kernels', 'metrics', 'pipelines'))\n"
    )
    env = {"PATH": "/usr/bin:/bin"}
    if python_path:
        env["PYTHONPATH"] = python_path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def test_editable_install_maps_folders_to_subpackages():
    where = _where(None)
    for mod, folder in FOLDERS.items():
        assert Path(where[mod]).resolve() == (ROOT / folder / "__init__.py").resolve(), (mod, where[mod])


@pytest.mark.slow
def test_regular_install_maps_folders_to_subpackages(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(ROOT)],
        capture_output=True, text=True,
    )
    if build.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{build.stderr[-2000:]}")
    (wheel,) = wheel_dir.glob("mmkv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"mmkv"}, f"the wheel installs top-level packages besides mmkv: {sorted(tops)}"
    for folder in FOLDERS.values():
        assert f"mmkv/{folder}/__init__.py" in names
    shipped = {n for n in names if n.startswith("mmkv/codecs/data/") and n.endswith(".json")}
    local = {f"mmkv/codecs/data/{p.name}" for p in (ROOT / "mmkv" / "codecs" / "data").glob("*.json")}
    assert local <= shipped, f"codebook data files missing from the wheel: {sorted(local - shipped)}"
    # the trained sets ship whole but for the audio release's training state, each within its 20 MB
    assets = ROOT / "mmkv" / "assets"
    files = [p for p in assets.rglob("*") if p.is_file()]
    wanted = {f"mmkv/{p.relative_to(ROOT / 'mmkv').as_posix()}" for p in files if "training" not in p.parts}
    assert wanted <= set(names), f"shipped asset files missing from the wheel: {sorted(wanted - set(names))}"
    assert not [n for n in names if n.startswith("mmkv/assets/") and "/training/" in n]
    infos = zipfile.ZipFile(wheel).infolist()
    for kind in ("video", "audio"):
        size = sum(i.file_size for i in infos if i.filename.startswith(f"mmkv/assets/{kind}/"))
        assert size <= 20e6, f"the {kind} set takes {size / 1e6:.1f} MB of package data; the budget is 20 MB"
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )
    assert inst.returncode == 0, inst.stderr
    where = _where(str(target))
    from mmkv.assets import trained_audio_assets, trained_video_assets

    if (assets / "audio" / "SHA256SUMS").is_file():  # installed without training/, still a checked release
        assert trained_audio_assets(target / "mmkv" / "assets" / "audio") is not None
    if (assets / "video" / "SHA256SUMS").is_file():
        assert trained_video_assets(target / "mmkv" / "assets" / "video") is not None
    for mod, folder in FOLDERS.items():
        assert Path(where[mod]).resolve() == (target / "mmkv" / folder / "__init__.py").resolve(), (mod, where[mod])
