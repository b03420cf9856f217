"""Video metrics of a compressed-cache rollout against the bf16-cache reference: per frame, then per video.

Inputs are the lossless uint8 frames `[F, H, W, 3]` the pipeline dumps (`frames.npy`), never the lossy mp4
(as VideoSys eval/pab/common_metrics/batch_eval.py computes them). Conventions, each pinned so that numbers are
comparable:

* PSNR: scikit-image's `peak_signal_noise_ratio(data_range=255)` per frame (MSE over pixels and channels in float64);
  an identical frame gives +inf. The per-video (and per-window) PSNR is 10·log10(255² / mean_f MSE_f), i.e. the PSNR
  of the pooled MSE, finite unless every frame is identical; `psnr_frame_mean` is the mean of per-frame dB values
  (VideoSys' aggregation), which is +inf as soon as one frame is identical (the first chunk of a causal rollout often
  is: it never reads the compressed cache).
* SSIM: scikit-image's `structural_similarity` with Wang et al.'s settings, `gaussian_weights=True, sigma=1.5,
  use_sample_covariance=False, data_range=255, channel_axis=-1` (11-tap Gaussian, K1 0.01, K2 0.03, mean of the SSIM
  map over the valid region, then over channels). Computed here batched in torch float64; the tests check it equals
  scikit-image.
* LPIPS: `lpips` 0.1 (the linear heads shipped in the package) on the AlexNet trunk, frames scaled to [-1, 1],
  spatial mean (`spatial=False`). The trunk is torchvision's ImageNet AlexNet `alexnet-owt-7be5be79.pth`, read from
  `--lpips-weights PATH` or `$TORCH_HOME/hub/checkpoints/` (never downloaded). A seeded random trunk exists for tests
  and smoke runs; its numbers are not LPIPS and carry `lpips_trunk = "random(seed=...)"`.
* Latent cosine: `metrics.latent.latent_cosine` on the rollouts' latents.
* Windows: means of per-frame values over time windows [a, b) seconds at the video's fps (default edges 0, 2, 5, 10,
  then every 10 s), so a windowed mean equals the mean of the per-frame values in that window by construction.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from mmkv.metrics.latent import latent_cosine

DATA_RANGE = 255.0
SSIM_SIGMA = 1.5
SSIM_TRUNCATE = 3.5  # scikit-image's choice for gaussian_weights=True: 2*int(3.5*1.5 + 0.5) + 1 = 11 taps
SSIM_K1, SSIM_K2 = 0.01, 0.03
DEFAULT_FPS = 16
DEFAULT_WINDOW_EDGES_S = (0.0, 2.0, 5.0, 10.0)
WINDOW_STEP_S = 10.0  # windows continue in 10 s steps after the last edge

ALEXNET_FILE = "alexnet-owt-7be5be79.pth"
ALEXNET_URL = "https://download.pytorch.org/models/" + ALEXNET_FILE
ALEXNET_SHA256_PREFIX = "7be5be79"  # torchvision names its files after the first hex digits of their SHA-256
# torchvision AlexNet `features.{i}` -> lpips `net.slice{k}.{i}`: the slices keep torchvision's layer indices.
_ALEX_SLICES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 2, 5: 3, 6: 3, 7: 3, 8: 4, 9: 4, 10: 5, 11: 5}

VIDEO_METRIC_CONFIG = {
    "psnr": "skimage peak_signal_noise_ratio, data_range=255, per frame; video/window PSNR from the pooled MSE",
    "ssim": "skimage structural_similarity, gaussian_weights=True, sigma=1.5, use_sample_covariance=False, "
    "data_range=255, channel_axis=-1",
    "lpips": "lpips 0.1 alex, inputs in [-1,1], spatial mean",
    "latent_cosine": "cosine of the flattened latents, float64",
}


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def resolve_device(device=None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _frames(x, name: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected uint8 frames as a numpy array or torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.uint8:
        raise ValueError(
            f"{name}: expected lossless uint8 frames [F, H, W, 3], got dtype {x.dtype}; metrics are computed on "
            "the uint8 frames the pipeline wrote (frames.npy), not on floats or a re-read mp4"
        )
    if x.dim() != 4 or x.shape[-1] != 3:
        raise ValueError(f"{name}: expected frames of shape [F, H, W, 3], got {tuple(x.shape)}")
    return x


def _pair(ref, test) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _frames(ref, "reference frames"), _frames(test, "test frames")
    if a.shape != b.shape:
        raise ValueError(f"frame arrays differ in shape: reference {tuple(a.shape)} vs test {tuple(b.shape)}")
    if a.shape[0] == 0:
        raise ValueError("no frames to compare (F = 0)")
    return a, b


def _frames_per_chunk(shape, device: torch.device, chunk: int | None) -> int:
    if chunk is not None:
        return max(1, int(chunk))
    per_frame = int(np.prod(shape[1:]))
    budget = 2**27 if device.type == "cuda" else 2**22  # elements per chunk; SSIM holds ~12 float64 maps of this size
    return max(1, budget // per_frame)


def _to_nchw(x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return x.to(device, non_blocking=True).permute(0, 3, 1, 2).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# PSNR / SSIM


def mse_frames(ref, test, *, device=None, chunk: int | None = None) -> np.ndarray:
    """Mean squared error per frame over pixels and channels, in uint8 units, float64 ([F])."""
    a, b = _pair(ref, test)
    dev = resolve_device(device)
    n = _frames_per_chunk(a.shape, dev, chunk)
    out = []
    for s in range(0, a.shape[0], n):
        d = a[s : s + n].to(dev).double() - b[s : s + n].to(dev).double()
        out.append((d * d).mean(dim=(1, 2, 3)).cpu())
    return torch.cat(out).numpy()


def psnr_from_mse(mse, data_range: float = DATA_RANGE):
    """10·log10(R² / MSE), +inf where MSE is 0 (identical), elementwise for arrays."""
    mse = np.asarray(mse, dtype=np.float64)
    with np.errstate(divide="ignore"):
        out = 10.0 * np.log10(data_range**2 / mse)
    return float(out) if out.ndim == 0 else out


def psnr_frames(ref, test, *, device=None, chunk: int | None = None) -> np.ndarray:
    """Per-frame PSNR in dB (scikit-image convention, data_range 255); +inf for identical frames."""
    return psnr_from_mse(mse_frames(ref, test, device=device, chunk=chunk))


def _gaussian_taps(sigma: float = SSIM_SIGMA, truncate: float = SSIM_TRUNCATE) -> np.ndarray:
    # scipy.ndimage.gaussian_filter's kernel: radius int(truncate*sigma + 0.5), exp(-x²/2σ²) normalised to sum 1.
    r = int(truncate * sigma + 0.5)
    x = np.arange(-r, r + 1, dtype=np.float64)
    k = np.exp(-0.5 * (x / sigma) ** 2)
    return k / k.sum()


def _valid_gaussian(z: torch.Tensor, taps: np.ndarray) -> torch.Tensor:
    """Separable Gaussian filter over the last two dims at valid positions only, accumulated in place from shifted
    views (float64 conv2d is slow on CPU; this is as fast as scipy's filter and runs on any device)."""
    k = len(taps)
    h, w = z.shape[-2] - k + 1, z.shape[-1] - k + 1
    rows = torch.zeros(z.shape[:-2] + (h, z.shape[-1]), dtype=z.dtype, device=z.device)
    for i, t in enumerate(taps):
        rows.add_(z[..., i : i + h, :], alpha=float(t))
    out = torch.zeros(z.shape[:-2] + (h, w), dtype=z.dtype, device=z.device)
    for i, t in enumerate(taps):
        out.add_(rows[..., :, i : i + w], alpha=float(t))
    return out


def ssim_frames(ref, test, *, device=None, chunk: int | None = None) -> np.ndarray:
    """Per-frame SSIM, equal to scikit-image's `structural_similarity(gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, data_range=255, channel_axis=-1)`.

    scikit-image filters with mode='reflect' and then drops a border of the filter radius, so only "valid"
    positions survive the crop: a valid-mode separable filter gives the same map without any padding.
    """
    a, b = _pair(ref, test)
    H, W = a.shape[1], a.shape[2]
    taps = _gaussian_taps()
    win = taps.size
    if H < win or W < win:
        raise ValueError(f"SSIM needs frames of at least {win}x{win} pixels (its Gaussian window); got {H}x{W}")
    dev = resolve_device(device)
    c1, c2 = (SSIM_K1 * DATA_RANGE) ** 2, (SSIM_K2 * DATA_RANGE) ** 2
    n = _frames_per_chunk(a.shape, dev, chunk)
    out = []
    for s in range(0, a.shape[0], n):
        x = _to_nchw(a[s : s + n], dev, torch.float64)
        y = _to_nchw(b[s : s + n], dev, torch.float64)
        m = _valid_gaussian(torch.stack([x, y, x * x, y * y, x * y]), taps)
        ux, uy, uxx, uyy, uxy = m.unbind(0)
        vx, vy, vxy = uxx - ux * ux, uyy - uy * uy, uxy - ux * uy  # population covariance (Wang et al.)
        smap = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))
        out.append(smap.flatten(1).mean(dim=1).cpu())
    return torch.cat(out).numpy()


# ----------------------------------------------------------------------------------------------------------------
# LPIPS


class LPIPSWeightsNotFound(FileNotFoundError):
    """The AlexNet trunk LPIPS needs is not on disk; the message says which file goes where."""


def default_alexnet_path() -> Path:
    """Where torchvision caches the AlexNet trunk: `$TORCH_HOME/hub/checkpoints/alexnet-owt-7be5be79.pth`."""
    return Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_FILE


def _missing_trunk_message(path: Path, explicit: bool) -> str:
    where = f"--lpips-weights {path}" if explicit else f"the torch hub cache, {path}"
    return (
        f"LPIPS needs torchvision's ImageNet AlexNet trunk '{ALEXNET_FILE}' (233 MB, SHA-256 starting with "
        f"{ALEXNET_SHA256_PREFIX}), and it is not at {where}. Nothing is downloaded here: fetch {ALEXNET_URL} on a "
        f"machine with internet and put it at {default_alexnet_path()} (the directory follows $TORCH_HOME, currently "
        f"{torch.hub.get_dir()}), or pass --lpips-weights PATH. The small LPIPS linear heads come with the `lpips` "
        "package. To skip LPIPS instead, use --lpips off."
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _read_trunk(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    # weights_only: a plain state dict of tensors; never unpickle code.
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict (name -> tensor), got {type(state).__name__}")
    return state


def _trunk_state(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    mapped = {}
    for key, value in state.items():
        if key.startswith("classifier."):
            continue  # the classifier head is not part of the LPIPS trunk
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != "features" or not parts[1].isdigit() or int(parts[1]) not in _ALEX_SLICES:
            raise ValueError(
                f"{path}: unexpected key {key!r}; expected torchvision AlexNet keys features.{{i}}.weight/bias "
                f"(i = 0, 3, 6, 8, 10) and classifier.*"
            )
        i = int(parts[1])
        mapped[f"slice{_ALEX_SLICES[i]}.{i}.{parts[2]}"] = value
    return mapped


def load_lpips(
    weights: str | os.PathLike | None = None,
    *,
    random_trunk: bool = False,
    seed: int = 0,
    device=None,
    check_hash: bool = True,
):
    """LPIPS-alex (v0.1 linear heads from the `lpips` package) with the AlexNet trunk read from `weights`, or from
    the torch hub cache when `weights` is None. `random_trunk=True` builds a seeded random trunk instead (tests,
    offline smoke runs): its values are not LPIPS. The returned module has `.trunk_id` naming what was loaded.

    Building happens inside `torch.random.fork_rng`, so the global RNG stream is left exactly as it was.
    """
    import lpips  # imported here: it pulls in torchvision, which `mmkv.metrics` users may not need

    explicit = weights is not None
    path = Path(weights) if explicit else default_alexnet_path()
    if not random_trunk and not path.is_file():
        raise LPIPSWeightsNotFound(_missing_trunk_message(path, explicit))
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # torchvision warns about the legacy `pretrained=` argument lpips passes; the trunk is built untrained.
        warnings.simplefilter("ignore", UserWarning)
        torch.manual_seed(seed)
        net = lpips.LPIPS(net="alex", version="0.1", pnet_rand=True, verbose=False)
    if random_trunk:
        net.trunk_id = f"random(seed={seed})"
    else:
        digest = _sha256(path)
        if check_hash and not digest.startswith(ALEXNET_SHA256_PREFIX):
            raise ValueError(
                f"{path}: SHA-256 {digest[:16]}... does not start with {ALEXNET_SHA256_PREFIX}; this is not "
                f"torchvision's ImageNet AlexNet '{ALEXNET_FILE}' (fetch {ALEXNET_URL})"
            )
        mapped = _trunk_state(_read_trunk(path), path)
        missing, unexpected = net.net.load_state_dict(mapped, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: AlexNet trunk keys do not match: missing {missing}, unexpected {unexpected}")
        net.trunk_id = f"alexnet sha256:{digest}"
    net = net.eval().to(resolve_device(device))
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def lpips_frames(net, ref, test, *, chunk: int | None = None) -> np.ndarray:
    """Per-frame LPIPS on the device `net` lives on; frames go from uint8 to [-1, 1] (x/127.5 - 1)."""
    a, b = _pair(ref, test)
    dev = next(net.parameters()).device
    n = chunk or max(1, (2**24 if dev.type == "cuda" else 2**20) // int(np.prod(a.shape[1:])))
    out = []
    with torch.inference_mode():
        for s in range(0, a.shape[0], n):
            x = _to_nchw(a[s : s + n], dev, torch.float32) / 127.5 - 1.0
            y = _to_nchw(b[s : s + n], dev, torch.float32) / 127.5 - 1.0
            out.append(net(x, y).reshape(-1).double().cpu())
    return torch.cat(out).numpy()


# ----------------------------------------------------------------------------------------------------------------
# Windows and aggregation


def window_bounds(n_frames: int, fps: float = DEFAULT_FPS, edges_s=None) -> list[dict]:
    """Time windows [a, b) seconds over `n_frames` frames at `fps`: the given edges (default 0, 2, 5, 10), then
    10 s steps until every frame is covered. Frame f (time f/fps) is in [a, b) when a·fps <= f < b·fps."""
    if n_frames < 1:
        raise ValueError(f"n_frames must be >= 1, got {n_frames}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    edges = [float(e) for e in (DEFAULT_WINDOW_EDGES_S if edges_s is None else edges_s)]
    if len(edges) < 1 or edges[0] != 0.0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"window edges must start at 0 and increase strictly, got {edges}")
    duration = n_frames / fps
    while edges[-1] < duration or len(edges) < 2:
        edges.append(edges[-1] + WINDOW_STEP_S)
    out = []
    for a, b in zip(edges, edges[1:]):
        f0 = math.ceil(a * fps - 1e-9)
        f1 = min(math.ceil(b * fps - 1e-9), n_frames)
        if f0 >= n_frames:
            break
        out.append({"label": f"{a:g}–{b:g} s", "start_s": a, "end_s": b, "first_frame": f0, "end_frame": f1,
                    "n_frames": f1 - f0})
    return out


def aggregate_frames(per_frame: dict, first: int = 0, end: int | None = None) -> dict:
    """Means of per-frame values over frames [first, end). PSNR per frame averages to `psnr_frame_mean`; `psnr` is
    the PSNR of the mean MSE (pooled). Identical frames are counted in `identical_frames`."""
    out: dict = {}
    for name, values in per_frame.items():
        v = np.asarray(values, dtype=np.float64)[first:end]
        if v.size == 0:
            raise ValueError(f"empty frame range [{first}, {end}) for {name}")
        out["psnr_frame_mean" if name == "psnr" else name] = float(v.mean())
    if "mse" in per_frame:
        mse = np.asarray(per_frame["mse"], dtype=np.float64)[first:end]
        out["psnr"] = psnr_from_mse(mse.mean())
        out["identical_frames"] = int((mse == 0).sum())
        out["n_frames"] = int(mse.size)
    return out


def windowed_means(per_frame: dict, fps: float = DEFAULT_FPS, edges_s=None) -> list[dict]:
    """`aggregate_frames` over each window of `window_bounds`; each entry also carries its bounds."""
    n = len(next(iter(per_frame.values())))
    return [{**w, **aggregate_frames(per_frame, w["first_frame"], w["end_frame"])}
            for w in window_bounds(n, fps, edges_s)]


def video_metrics(
    ref_frames,
    test_frames,
    ref_latents=None,
    test_latents=None,
    lpips_net=None,
    *,
    fps: float = DEFAULT_FPS,
    window_edges_s=None,
    device=None,
) -> dict:
    """Compare a rollout's frames (and latents) with the reference rollout's.

    Returns {"per_frame": {"mse", "psnr", "ssim"[, "lpips"]: [F floats]}, "summary": {"psnr" (pooled),
    "psnr_frame_mean", "mse", "ssim"[, "lpips"], "latent_cosine", "identical_frames", "n_frames"}, "windows": [...],
    "fps", "n_frames", "config"}. LPIPS is computed only when `lpips_net` (from `load_lpips`) is given.
    """
    a, b = _pair(ref_frames, test_frames)
    mse = mse_frames(a, b, device=device)
    per_frame = {
        "mse": mse.tolist(),
        "psnr": psnr_from_mse(mse).tolist(),
        "ssim": ssim_frames(a, b, device=device).tolist(),
    }
    config = dict(VIDEO_METRIC_CONFIG)
    if lpips_net is not None:
        per_frame["lpips"] = lpips_frames(lpips_net, a, b).tolist()
        config["lpips_trunk"] = getattr(lpips_net, "trunk_id", "unknown")
    else:
        config["lpips_trunk"] = None
    summary = aggregate_frames(per_frame)
    summary["latent_cosine"] = (
        latent_cosine(ref_latents, test_latents) if ref_latents is not None and test_latents is not None else None
    )
    return {
        "kind": "video",
        "n_frames": int(a.shape[0]),
        "fps": fps,
        "per_frame": per_frame,
        "summary": summary,
        "windows": windowed_means(per_frame, fps, window_edges_s),
        "config": config,
    }
