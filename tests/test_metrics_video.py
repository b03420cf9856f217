"""Video metrics: known answers, agreement with scikit-image, LPIPS without downloads, windows."""

import math

import numpy as np
import pytest
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from mmkv.metrics import (
    ALEXNET_FILE,
    LPIPSWeightsNotFound,
    latent_cosine,
    load_lpips,
    lpips_frames,
    psnr_frames,
    ssim_frames,
    video_metrics,
    window_bounds,
    windowed_means,
)
from mmkv.metrics.video import _ALEX_SLICES


def _frames(rng, f=3, h=29, w=41):
    return rng.integers(0, 256, (f, h, w, 3), dtype=np.uint8)


def _noisy(rng, x, sigma):
    return np.clip(x.astype(np.float64) + rng.normal(0, sigma, x.shape), 0, 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def rand_lpips():
    return load_lpips(random_trunk=True, seed=1, device="cpu")


def test_psnr_ssim_match_scikit_image():
    rng = np.random.default_rng(1039)
    for sigma in (3.0, 25.0, 90.0):
        a = _frames(rng)
        b = _noisy(rng, a, sigma)
        p = psnr_frames(a, b, device="cpu")
        s = ssim_frames(a, b, device="cpu", chunk=2)  # chunking must not change anything
        for i in range(a.shape[0]):
            want_p = peak_signal_noise_ratio(a[i], b[i], data_range=255)
            want_s = structural_similarity(a[i], b[i], gaussian_weights=True, sigma=1.5,
                                           use_sample_covariance=False, data_range=255, channel_axis=-1)
            assert abs(p[i] - want_p) < 1e-4
            assert abs(s[i] - want_s) < 1e-4


def test_identical_frames_known_answers(rand_lpips):
    rng = np.random.default_rng(1054)
    a = _frames(rng, f=2, h=64, w=64)
    lat = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    out = video_metrics(a, a.copy(), lat, lat.clone(), lpips_net=rand_lpips, device="cpu")
    assert all(math.isinf(v) and v > 0 for v in out["per_frame"]["psnr"])
    assert out["summary"]["psnr"] == math.inf and out["summary"]["psnr_frame_mean"] == math.inf
    assert out["summary"]["ssim"] == pytest.approx(1.0, abs=1e-12)
    assert out["summary"]["lpips"] == 0.0
    assert out["summary"]["latent_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert out["summary"]["identical_frames"] == 2
    assert out["config"]["lpips_trunk"] == "random(seed=1)"


def test_pooled_psnr_is_finite_when_only_some_frames_match():
    rng = np.random.default_rng(1068)
    a = _frames(rng, f=4)
    b = a.copy()
    b[2:] = _noisy(rng, a[2:], 20.0)  # the first frames never read the compressed cache
    out = video_metrics(a, b, device="cpu")
    mse = np.asarray(out["per_frame"]["mse"])
    assert out["summary"]["identical_frames"] == 2
    assert out["summary"]["psnr_frame_mean"] == math.inf
    assert out["summary"]["psnr"] == pytest.approx(10 * math.log10(255**2 / mse.mean()), rel=1e-12)


def test_lpips_random_trunk_zero_and_monotone(rand_lpips):
    rng = np.random.default_rng(1080)
    a = _frames(rng, f=2, h=64, w=64)
    assert np.all(lpips_frames(rand_lpips, a, a.copy()) == 0.0)
    values = [lpips_frames(rand_lpips, a, _noisy(rng, a, s)).mean() for s in (4.0, 24.0, 96.0)]
    assert 0 < values[0] < values[1] < values[2]


def test_load_lpips_leaves_global_rng_alone():
    state = torch.random.get_rng_state().clone()
    load_lpips(random_trunk=True, seed=5)
    assert torch.equal(state, torch.random.get_rng_state())


def test_missing_trunk_error_names_file_and_place(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    with pytest.raises(LPIPSWeightsNotFound) as err:
        load_lpips()
    msg = str(err.value)
    assert ALEXNET_FILE in msg and str(tmp_path / "th" / "hub" / "checkpoints" / ALEXNET_FILE) in msg
    assert "--lpips-weights" in msg
    with pytest.raises(LPIPSWeightsNotFound, match="--lpips-weights"):
        load_lpips(tmp_path / "nowhere.pth")


def test_trunk_file_loads_into_lpips_slices(tmp_path, rand_lpips):
    # A torchvision-named AlexNet state dict (features.{i}.*) built from a random trunk: it must land in the slices.
    source = load_lpips(random_trunk=True, seed=7)
    tv_state = {}
    for key, value in source.net.state_dict().items():
        _, i, leaf = key.split(".")
        assert _ALEX_SLICES[int(i)] == int(key[5])
        tv_state[f"features.{i}.{leaf}"] = value.clone()
    tv_state["classifier.1.weight"] = torch.zeros(2, 2)  # the classifier is ignored
    path = tmp_path / ALEXNET_FILE
    torch.save(tv_state, path)
    with pytest.raises(ValueError, match="7be5be79"):
        load_lpips(path)  # not the real file: the hash check says so
    net = load_lpips(path, check_hash=False)
    for key, value in source.net.state_dict().items():
        assert torch.equal(net.net.state_dict()[key], value)
    assert net.trunk_id.startswith("alexnet sha256:")
    rng = np.random.default_rng(1121)
    a = _frames(rng, f=1, h=64, w=64)
    b = _noisy(rng, a, 30.0)
    assert lpips_frames(net, a, b)[0] == pytest.approx(lpips_frames(source, a, b)[0], rel=1e-6)
    assert lpips_frames(net, a, b)[0] != pytest.approx(lpips_frames(rand_lpips, a, b)[0], rel=1e-3)


def test_windowed_means_are_means_of_per_frame_values():
    rng = np.random.default_rng(1129)
    n = int(rng.integers(90, 200))
    bounds = window_bounds(n, fps=16)
    assert [w["first_frame"] for w in bounds][:3] == [0, 32, 80]
    assert bounds[0]["first_frame"] == 0 and bounds[-1]["end_frame"] == n
    assert all(x["end_frame"] == y["first_frame"] for x, y in zip(bounds, bounds[1:]))
    per_frame = {"mse": rng.uniform(1, 50, n), "psnr": rng.uniform(20, 40, n), "ssim": rng.uniform(0, 1, n),
                 "lpips": rng.uniform(0, 1, n)}
    for w in windowed_means(per_frame, fps=16):
        sl = slice(w["first_frame"], w["end_frame"])
        assert w["ssim"] == pytest.approx(per_frame["ssim"][sl].mean(), rel=1e-12)
        assert w["lpips"] == pytest.approx(per_frame["lpips"][sl].mean(), rel=1e-12)
        assert w["psnr_frame_mean"] == pytest.approx(per_frame["psnr"][sl].mean(), rel=1e-12)
        assert w["psnr"] == pytest.approx(10 * math.log10(255**2 / per_frame["mse"][sl].mean()), rel=1e-12)
    with pytest.raises(ValueError, match="start at 0"):
        window_bounds(10, edges_s=[1, 2])


def test_latent_cosine():
    g = torch.Generator().manual_seed(int(np.random.default_rng(1148).integers(1 << 30)))
    a, b = torch.randn(3, 5, 7, generator=g), torch.randn(3, 5, 7, generator=g)
    u, v = a.double().flatten().numpy(), b.double().flatten().numpy()
    want = float(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))
    assert latent_cosine(a, b) == pytest.approx(want, abs=1e-12)
    assert latent_cosine(a, -a) == pytest.approx(-1.0, abs=1e-12)
    with pytest.raises(ValueError, match="shapes differ"):
        latent_cosine(a, b[:2])


def test_bad_frames_are_refused():
    rng = np.random.default_rng(1159)
    a = _frames(rng)
    with pytest.raises(ValueError, match="uint8"):
        psnr_frames(a.astype(np.float32), a.astype(np.float32))
    with pytest.raises(ValueError, match="differ in shape"):
        ssim_frames(a, a[:2])
    with pytest.raises(ValueError, match="at least 11x11"):
        ssim_frames(a[:, :8, :8], a[:, :8, :8])
