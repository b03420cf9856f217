"""Prompt adherence and scene consistency of a generated clip, by hand-written rules with no learned parts
(installed as `mmkv.metrics.adherence`).

The clips are those of `mmkv.pipelines.wan.scenes`: one named object of a bright palette colour moving along x or y
and bouncing off the borders, over a dark striped background, with possibly a second muted object and a static
near-black bar. This module never imports the pipelines: the caller passes the palette (`scenes.PALETTE`).

Adherence (what the caption names), from the uint8 frames [T, H, W, 3]:

* Segmentation: a pixel belongs to a named colour when it is within `colour_tol` (Euclidean, RGB 0-255) of it and its
  largest channel is at least `min_brightness`; the clip's colour is the one with the most such pixels over all
  frames. Each frame keeps that colour's pixels within a box around their median (stray pixels elsewhere drop out);
  the frame counts as showing the object when enough remain, they fill at least `min_fill` of their bounding box
  and that box is object-sized (a frame-filling field of colour is no object).
  A clip showing it in fewer than `min_found_fraction` of its frames has no object: every *_ok is None.
* Direction: centroid velocity over the first `early_frames` frames (the scenes start every object far enough from a
  wall), as the Theil-Sen slope (median over frame pairs), dominant axis and sign; y grows downwards, so "up" is a
  negative y velocity.
* Speed: mean |velocity| along that axis over consecutive unoccluded frames (10% trimmed at each end); the nearest
  palette speed in log space.
* Shape and size, per unoccluded frame away from the borders, then a vote (shape) or a median (size). Unoccluded:
  the box, grown by a pixel, holds no bar pixel (near black in half the frames), and the pixel count is at least
  `unoccluded_fraction` of the 90th percentile of such frames. Triangles (apex up) have their centroid a third of
  the half-height below the box centre, the other shapes none; then the bounding-box fill ratio separates squares
  (1) from circles (pi/4 = 0.785) from crosses (0.556 for bars a third of the half-extent wide). Measured on the
  thresholded masks of rendered clips: triangles' offset 0.25-0.35 against |offset| <= 0.06 for the rest; fill
  0.47-0.62 (cross), 0.73-0.86 (circle), >= 0.91 (square).
  Size: (box width + box height) / 4 against the palette's half-extents, nearest in log space.

Consistency (what the caption leaves to the model), per window: block 1 is frames [0, first_block), then windows of
`block` frames (the CausVid loop's 3 latent frames = 1 + 4 + 4 pixel frames first, then 12). In each window:

* Stripe colours: two medians of the dark, non-object, non-bar pixels, split by luminance (k-medians, k = 2).
* Background pixels: those within `background_tol` of the segment between the window's two stripe colours (the
  stripes' anti-aliased edges lie on it), away from named-colour pixels (dilated 3 px) and from the bar. Block 1's
  background is their per-pixel median; a later frame's background PSNR is taken over its background pixels where
  block 1 has one (capped at PSNR_CAP), and `stripe_agreement` is the fraction of those whose nearer stripe colour
  (dark or light) is the same as in block 1: a phase shift lowers it, a colour change lowers the PSNR.
* Second object: pixels at least `second_distance` from the stripe segment, brighter than the dark stripes (so not
  the bar or its fringe), away from named pixels, after a 2x2 opening; present when the window's median frame has
  at least `min_second_pixels` of them; its colour is their median.
* Bar: columns (or rows) at least half of whose pixels are near black (every channel <= `bar_max`) in at least half
  of the window's frames; its axis and centre.

A later window matches block 1 when its background PSNR >= `psnr_tol`, stripe agreement >= `agreement_tol`, stripe
colours within `stripe_tol` (largest channel difference), second-object presence agrees (colour within `second_tol`
if present), and the bar agrees (presence, axis, centre within `bar_tol` px). `consistency` is the fraction of later
windows that match; None when block 1 shows no striped background (noise, say) or the clip has no later window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

PSNR_CAP = 100.0  # dB; identical backgrounds read as this instead of +inf
DIRECTIONS = ("left", "right", "up", "down")  # -x, +x, -y, +y: image rows grow downwards
SHAPES = ("circle", "square", "triangle", "cross")


@dataclass(frozen=True)
class Palette:
    """The named attribute values the detector knows: colour name -> RGB (0-255), size name -> half-extent in
    pixels, speed name -> pixels per frame."""

    colours: Mapping[str, tuple[int, int, int]]
    sizes: Mapping[str, float]
    speeds: Mapping[str, float]

    def __post_init__(self):
        for name, table in (("colours", self.colours), ("sizes", self.sizes), ("speeds", self.speeds)):
            if not table:
                raise ValueError(f"Palette {name} is empty; give at least one named value")
        for name, rgb in self.colours.items():
            if len(rgb) != 3 or not all(0 <= c <= 255 for c in rgb):
                raise ValueError(f"Palette colour {name!r} must be an RGB triple in 0..255, got {rgb!r}")
        for name, table in (("sizes", self.sizes), ("speeds", self.speeds)):
            for key, value in table.items():
                if not value > 0:
                    raise ValueError(f"Palette {name} {key!r} must be positive, got {value!r}")


@dataclass(frozen=True)
class Thresholds:
    """Every tolerance of the detector; the defaults are set for the scenes' drawing (see the module docstring)."""

    colour_tol: float = 40.0
    min_brightness: int = 150
    min_pixels: int = 12
    min_fill: float = 0.3
    min_found_fraction: float = 0.25
    early_frames: int = 12
    min_motion: float = 0.1  # px / frame; slower reads as "not moving": direction_ok False
    unoccluded_fraction: float = 0.93
    triangle_offset: float = 0.15
    square_fill: float = 0.885
    circle_fill: float = 0.68
    first_block: int = 9
    block: int = 12
    bar_max: int = 16
    background_tol: float = 14.0
    min_background_fraction: float = 0.5
    second_distance: float = 40.0
    min_second_pixels: int = 10
    psnr_tol: float = 30.0
    agreement_tol: float = 0.9
    stripe_tol: float = 12.0
    second_tol: float = 24.0
    bar_tol: float = 1.5

    def __post_init__(self):
        if self.first_block < 1 or self.block < 1:
            raise ValueError(f"Thresholds first_block and block must be >= 1 frame, got {self.first_block}, "
                             f"{self.block}")


DEFAULT_THRESHOLDS = Thresholds()


def window_bounds(n_frames: int, first_block: int = 9, block: int = 12) -> list[tuple[int, int]]:
    """[(first, end), ...]: block 1 = [0, first_block), then `block` frames a window (the last may be shorter)."""
    bounds = [(0, min(first_block, n_frames))]
    while bounds[-1][1] < n_frames:
        start = bounds[-1][1]
        bounds.append((start, min(start + block, n_frames)))
    return bounds


# ----------------------------------------------------------------------------------------------------------------
# Adherence


@dataclass
class _Track:
    """Per-frame view of the named object, [T] arrays (entries of frames where it is not seen are meaningless)."""

    valid: np.ndarray  # bool: the object is seen
    count: np.ndarray  # its pixels
    centre: np.ndarray  # [T, 2] (x, y) centroid
    box: np.ndarray  # [T, 4] x0, y0, x1, y1, inclusive
    border: np.ndarray  # bool: the box touches the frame edge


def _segment(frames: np.ndarray, palette: Palette, th: Thresholds) -> tuple[np.ndarray, np.ndarray]:
    """Nearest named colour index [T, H, W] (-1 where no named colour) and the named-pixel mask."""
    flat = frames.reshape(-1, 3)
    brightest = np.maximum(np.maximum(flat[:, 0], flat[:, 1]), flat[:, 2])
    bright = np.flatnonzero(brightest >= th.min_brightness)  # usually a few percent of the pixels
    rgb = flat[bright].astype(np.float32).T
    cols = np.asarray(list(palette.colours.values()), dtype=np.float32)
    d2 = np.stack([sum((rgb[c] - col[c]) ** 2 for c in range(3)) for col in cols], axis=1)
    nearest = d2.argmin(1)
    near = np.take_along_axis(d2, nearest[:, None], 1)[:, 0] <= th.colour_tol ** 2
    index = np.full(len(flat), -1, dtype=np.int64)
    index[bright[near]] = nearest[near]
    index = index.reshape(frames.shape[:3])
    return index, index >= 0


def _static_black(frames: np.ndarray, th: Thresholds) -> np.ndarray:
    """Fraction of the frames [T, H, W, 3] (uint8) in which each pixel [H, W] is near black (a bar)."""
    brightest = np.maximum(np.maximum(frames[..., 0], frames[..., 1]), frames[..., 2])
    return (brightest <= th.bar_max).mean(0)


def _dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    """Dilation of [..., H, W] masks by a (2 radius + 1)^2 square (separable, by shifts)."""
    out = mask.copy()
    for axis in (-1, -2):
        src = out.copy()
        n = src.shape[axis]
        for k in range(1, radius + 1):
            lead = [slice(None)] * src.ndim
            lag = [slice(None)] * src.ndim
            lead[axis], lag[axis] = slice(k, n), slice(0, n - k)
            out[tuple(lead)] |= src[tuple(lag)]
            out[tuple(lag)] |= src[tuple(lead)]
    return out


def _open2(mask: np.ndarray) -> np.ndarray:
    """Opening of [..., H, W] masks by a 2x2 square: keeps the pixels of some all-set 2x2 block, so isolated pixels
    and one-pixel lines drop out."""
    core = mask[..., :-1, :-1] & mask[..., 1:, :-1] & mask[..., :-1, 1:] & mask[..., 1:, 1:]
    out = np.zeros_like(mask)
    for dy in (0, 1):
        for dx in (0, 1):
            out[..., dy:dy + core.shape[-2], dx:dx + core.shape[-1]] |= core
    return out


def _lower_median(hist: np.ndarray) -> np.ndarray:
    """Lower median coordinate of each row of a histogram [T, N] (0 for empty rows)."""
    cum = hist.cumsum(1)
    return (cum < (cum[:, -1:] + 1) // 2).sum(1)


def _first_last(any_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = any_.shape[1]
    return any_.argmax(1), n - 1 - any_[:, ::-1].argmax(1)


def _track(mask: np.ndarray, reach: float, th: Thresholds) -> _Track:
    """The object in each frame of `mask` [T, H, W]: its pixels within `reach` of their median (stray pixels
    elsewhere drop out), seen when enough remain and they fill `min_fill` of their box."""
    t, h, w = mask.shape
    mx, my = _lower_median(mask.sum(1)), _lower_median(mask.sum(2))
    cols = np.abs(np.arange(w)[None] - mx[:, None]) <= reach
    rows = np.abs(np.arange(h)[None] - my[:, None]) <= reach
    kept = mask & rows[:, :, None] & cols[:, None, :]
    col_hist, row_hist = kept.sum(1), kept.sum(2)  # [T, W], [T, H]
    count = col_hist.sum(1)
    safe = np.maximum(count, 1)
    centre = np.stack([col_hist @ np.arange(w) / safe, row_hist @ np.arange(h) / safe], axis=1)
    (x0, x1), (y0, y1) = _first_last(col_hist > 0), _first_last(row_hist > 0)
    area = (x1 - x0 + 1) * (y1 - y0 + 1)
    # An object fits its reach with room to spare; a mask filling the whole box is a field of colour, not an object.
    small = (x1 - x0 < 1.5 * reach) & (y1 - y0 < 1.5 * reach)
    valid = (count >= th.min_pixels) & (count >= th.min_fill * area) & small
    border = (x0 == 0) | (y0 == 0) | (x1 == w - 1) | (y1 == h - 1)
    return _Track(valid, count.astype(np.float64), centre, np.stack([x0, y0, x1, y1], 1).astype(np.float64), border)


def _theil_sen(tr: _Track, frames: range) -> np.ndarray | None:
    """Median over pairs of seen frames among `frames` of (c_j - c_i) / (j - i): the (x, y) velocity, robust to a
    few occluded frames and to the one-pixel steps of a thresholded mask; None with fewer than 2 seen frames."""
    idx = np.asarray([i for i in frames if tr.valid[i]])
    if len(idx) < 2:
        return None
    i, j = np.triu_indices(len(idx), 1)
    return np.median((tr.centre[idx[j]] - tr.centre[idx[i]]) / (idx[j] - idx[i])[:, None], axis=0)


def _shapes(tr: _Track, frames: np.ndarray, th: Thresholds) -> list[str]:
    """Shape read from the box of each of `frames` (indices)."""
    x0, y0, x1, y1 = tr.box[frames].T
    bw, bh = x1 - x0 + 1, y1 - y0 + 1
    offset = (tr.centre[frames, 1] - (y0 + y1) / 2) / (bh / 2)
    fill = tr.count[frames] / (bw * bh)
    shape = np.where(fill >= th.square_fill, "square", np.where(fill >= th.circle_fill, "circle", "cross"))
    return np.where(offset >= th.triangle_offset, "triangle", shape).tolist()


def _nearest_log(value: float, table: Mapping[str, float]) -> str:
    lv = math.log(max(value, 1e-6))
    return min(table, key=lambda k: abs(lv - math.log(table[k])))


def _touches(tr: _Track, mask: np.ndarray) -> np.ndarray:
    """[T] bool: the object's box, grown by 1 px, contains a pixel of the static `mask` [H, W]."""
    h, w = mask.shape
    ii = np.pad(mask.astype(np.int64).cumsum(0).cumsum(1), ((1, 0), (1, 0)))  # integral image
    x0, y0, x1, y1 = tr.box.astype(np.int64).T
    xa, ya, xb, yb = np.maximum(x0 - 1, 0), np.maximum(y0 - 1, 0), np.minimum(x1 + 2, w), np.minimum(y1 + 2, h)
    return (ii[yb, xb] - ii[ya, xb] - ii[yb, xa] + ii[ya, xa]) > 0


def _adherence(index: np.ndarray, bar: np.ndarray, palette: Palette, th: Thresholds) -> dict:
    t = index.shape[0]
    names = list(palette.colours)
    counts = np.bincount(index[index >= 0], minlength=len(names))
    none = {"found": False, "colour": None, "shape": None, "size": None, "direction": None, "speed": None,
            "speed_px": None, "frames_seen": 0}
    if counts.max(initial=0) == 0:
        return none
    k = int(counts.argmax())
    tr = _track(index == k, 1.6 * max(palette.sizes.values()) + 2, th)
    seen = int(tr.valid.sum())
    if seen < max(3, th.min_found_fraction * t):
        return {**none, "frames_seen": seen}

    out = {"found": True, "colour": names[k], "frames_seen": seen, "direction": None, "speed": None,
           "speed_px": None}
    # Unoccluded: clear of the bar, and not much smaller than usual (in case something else hides it).
    free = tr.valid & ~_touches(tr, bar)
    if not free.any():
        free = tr.valid
    clear = free & (tr.count >= th.unoccluded_fraction * np.percentile(tr.count[free], 90))
    clean = clear & ~tr.border
    shape_frames = np.nonzero(clean if clean.any() else tr.valid)[0]
    votes = _shapes(tr, shape_frames, th)
    out["shape"] = max(SHAPES, key=votes.count)
    extent = (tr.box[shape_frames, 2] - tr.box[shape_frames, 0] + tr.box[shape_frames, 3] - tr.box[shape_frames, 1]
              + 2) / 4
    out["size"] = _nearest_log(float(np.median(extent)), palette.sizes)

    v = _theil_sen(tr, range(min(th.early_frames, t)))
    if v is not None and np.abs(v).max() >= th.min_motion:
        axis = int(np.abs(v).argmax())
        out["direction"] = DIRECTIONS[2 * axis + int(v[axis] > 0)]
        # Mean |step| over consecutive unoccluded frames, 10% trimmed at each end: a slow object's mask steps by 0 or
        # 1 px a frame, so a median would read 0 or 1; a bounce costs at most one step.
        starts = np.nonzero(clear[:-1] & clear[1:])[0]
        if len(starts) < 3:
            starts = np.nonzero(tr.valid[:-1] & tr.valid[1:])[0]
        if len(starts):
            steps = np.sort(np.abs(tr.centre[starts + 1, axis] - tr.centre[starts, axis]))
            cut = len(steps) // 10
            out["speed_px"] = float(steps[cut:len(steps) - cut].mean())
            out["speed"] = _nearest_log(out["speed_px"], palette.speeds)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Consistency


# Frames here are planar float32 [3, T, H, W]: numpy reduces a trailing axis of 3 channels slowly.


def _max_channel(planes: np.ndarray) -> np.ndarray:
    return np.maximum(np.maximum(planes[0], planes[1]), planes[2])


def _two_colours(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Dark and light medians of [3, N] pixels, split by luminance (k-medians, k = 2), or None if too few."""
    if pixels.shape[1] < 64:
        return None
    lum = pixels.mean(0)
    lo, hi = np.percentile(lum, [5, 95])
    split = float(lo + hi) / 2  # not the median: one colour may cover most pixels
    for _ in range(6):
        dark, light = pixels[:, lum <= split], pixels[:, lum > split]
        if dark.shape[1] == 0 or light.shape[1] == 0:
            c = np.median(pixels, axis=1)
            return c, c
        a, b = np.median(dark, axis=1), np.median(light, axis=1)
        new = (a.mean() + b.mean()) / 2
        if new == split:
            break
        split = new
    return a, b


def _project(planes: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position along the segment a -> b in [0, 1], squared distance to it) of planar pixels [3, ...]."""
    ab = (b - a).astype(np.float32)
    denom = float(ab @ ab)
    d = [planes[c] - np.float32(a[c]) for c in range(3)]
    if denom < 1e-6:
        s = np.zeros_like(d[0])
    else:
        s = np.clip((d[0] * ab[0] + d[1] * ab[1] + d[2] * ab[2]) / np.float32(denom), 0.0, 1.0)
    dist2 = sum((d[c] - s * ab[c]) ** 2 for c in range(3))
    return s, dist2


def _bar(black_fraction: np.ndarray) -> tuple[str, float] | None:
    """(axis, centre px) of a bar across the frame, from the fraction of a window's frames in which each pixel
    [H, W] is near black; None if there is none."""
    black = black_fraction >= 0.5
    cols, rows = np.nonzero(black.mean(0) >= 0.5)[0], np.nonzero(black.mean(1) >= 0.5)[0]
    if len(cols) == 0 and len(rows) == 0:
        return None
    return ("x", float(cols.mean())) if len(cols) >= len(rows) else ("y", float(rows.mean()))


def _window(planes: np.ndarray, named: np.ndarray, th: Thresholds) -> dict:
    """One window's estimates: stripe colours, background mask [T, H, W], second object, bar."""
    t = planes.shape[1]
    brightest = _max_channel(planes)
    black = brightest <= th.bar_max
    black_fraction = black.mean(0)
    objects = _dilate(named, 3)
    free = ~objects & ~_dilate(black_fraction >= 0.5, 2)[None]
    candidates = np.flatnonzero(free & (brightest < th.min_brightness) & ~black)
    # An even subsample is plenty for two medians.
    stripes = _two_colours(planes.reshape(3, -1)[:, candidates[:: max(1, len(candidates) // 4096)]])
    w = {"bar": _bar(black_fraction), "stripes": stripes, "background": np.zeros(named.shape, bool),
         "position": None, "second_object": False, "second_colour": None,
         "free_pixels": int(t * named[0].size - objects.sum())}
    if stripes is None:
        return w
    position, dist2 = _project(planes, *stripes)
    w["background"] = free & (dist2 <= th.background_tol ** 2)
    w["position"] = position
    # Off the stripes and brighter than their dark colour (the bar and its fringe are darker): the second object may
    # cross the bar, in front of it.
    lum = planes.mean(0)
    other = _open2(~objects & (dist2 > th.second_distance ** 2) & (lum > float(stripes[0].mean()) + 10))
    w["second_object"] = float(np.median(other.reshape(t, -1).sum(1))) >= th.min_second_pixels
    if w["second_object"]:
        w["second_colour"] = np.median(planes[:, other], axis=1)
    return w


def _masked_median(planes: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per-pixel (lower) median [3, H, W] over the frames where `mask` [T, H, W] holds; 0 where it never does."""
    values = np.where(mask[None], planes, np.inf)
    values.sort(axis=1)  # masked-out frames sort last
    n = mask.sum(0)
    ref = np.take_along_axis(values, (np.maximum(n - 1, 0) // 2)[None, None].repeat(3, 0), 1)[:, 0]
    return np.where(n[None] > 0, ref, 0.0).astype(np.float32)


def _psnr(mse: float) -> float:
    if mse <= 255.0 ** 2 / 10 ** (PSNR_CAP / 10):
        return PSNR_CAP
    return 10 * math.log10(255.0 ** 2 / mse)


def _consistency(planes: np.ndarray, named: np.ndarray, th: Thresholds) -> tuple[float | None, list[dict]]:
    windows, first = [], None
    for k, (a, b) in enumerate(window_bounds(planes.shape[1], th.first_block, th.block)):
        w = _window(planes[:, a:b], named[a:b], th)
        row = {"label": f"block {k + 1}", "first_frame": a, "end_frame": b, "n_frames": b - a,
               "background_fraction": float(w["background"].sum() / max(1, w["free_pixels"])),
               "stripe_colours": None if w["stripes"] is None else [c.round(1).tolist() for c in w["stripes"]],
               "second_object": w["second_object"],
               "second_colour": None if w["second_colour"] is None else w["second_colour"].round(1).tolist(),
               "bar": None if w["bar"] is None else {"axis": w["bar"][0], "centre": w["bar"][1]},
               "background_psnr": None, "stripe_agreement": None, "match": None}
        windows.append(row)
        has_background = w["stripes"] is not None and row["background_fraction"] >= th.min_background_fraction
        if k == 0:
            if not has_background:
                break  # nothing to hold later windows to
            seen = w["background"].any(0)
            ref = _masked_median(planes[:, a:b], w["background"])
            position = _project(ref, *w["stripes"])[0]
            first = (w, ref, seen, position < 0.5, np.abs(position - 0.5) >= 0.25)
            row["background_psnr"], row["stripe_agreement"], row["match"] = PSNR_CAP, 1.0, True
            continue
        w1, ref, seen, ref_dark, ref_sure = first
        checks = {"background": False, "stripes": False}
        if has_background:
            use = w["background"] & seen[None]
            if use.any():
                sq = sum((planes[c, a:b] - ref[c][None]) ** 2 for c in range(3))
                row["background_psnr"] = _psnr(float(sq[use].astype(np.float64).mean()) / 3)
                sure = use & ref_sure[None] & (np.abs(w["position"] - 0.5) >= 0.25)
                agree = (w["position"] < 0.5) == ref_dark[None]
                row["stripe_agreement"] = float(agree[sure].mean()) if sure.any() else 0.0
                checks["background"] = row["background_psnr"] >= th.psnr_tol
                checks["stripes"] = row["stripe_agreement"] >= th.agreement_tol and all(
                    float(np.abs(c - c1).max()) <= th.stripe_tol for c, c1 in zip(w["stripes"], w1["stripes"]))
        checks["second_object"] = w["second_object"] == w1["second_object"] and (
            not w["second_object"] or float(np.abs(w["second_colour"] - w1["second_colour"]).max()) <= th.second_tol)
        b1, bk = w1["bar"], w["bar"]
        checks["bar"] = (b1 is None and bk is None) or (
            b1 is not None and bk is not None and b1[0] == bk[0] and abs(b1[1] - bk[1]) <= th.bar_tol)
        row["checks"] = checks
        row["match"] = all(checks.values())
    if first is None or len(windows) < 2:
        return None, windows
    return float(np.mean([w["match"] for w in windows[1:]])), windows


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def _check_frames(frames) -> np.ndarray:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        got = f"{type(frames).__name__} {getattr(frames, 'dtype', '')} {getattr(frames, 'shape', '')}"
        raise ValueError(f"score_clip needs uint8 frames shaped [T, H, W, 3] (a frames.npy dump), got {got}")
    if frames.shape[0] < 2:
        raise ValueError(f"score_clip needs at least 2 frames to see motion, got {frames.shape[0]}")
    return frames


def score_clip(frames: np.ndarray, named: Mapping[str, str] | None, palette: Palette,
               thresholds: Thresholds = DEFAULT_THRESHOLDS) -> dict:
    """Adherence to the named attributes and consistency of the unnamed ones, for one clip.

    frames: uint8 [T, H, W, 3]. named: the caption's attributes (`scenes.parse_caption`), any subset of shape,
    colour, size, direction, speed, or None. Returns the detected values ("colour", "shape", "size", "direction",
    "speed", "speed_px", "found", "frames_seen"), "<attr>_ok" for each of the five (None when the object is not found
    or the caption does not name it), "adherence" (fraction of the non-None *_ok that hold, or None),
    "consistency" (see the module docstring) and "windows" (per-window estimates and checks)."""
    frames = _check_frames(frames)
    if named is not None and not isinstance(named, Mapping):
        raise ValueError(f"score_clip needs the caption's attributes as a dict (scenes.parse_caption(text)) or None, "
                         f"got {type(named).__name__}")
    named = dict(named or {})
    th = thresholds
    index, named_mask = _segment(frames, palette, th)
    bar = _dilate(_static_black(frames, th) >= 0.5, 1)
    out = _adherence(index, bar, palette, th)
    oks = []
    for attr in ("colour", "shape", "size", "direction", "speed"):
        ok = None
        if out["found"] and named.get(attr) is not None:
            ok = out[attr] == named[attr]
            oks.append(ok)
        out[f"{attr}_ok"] = ok
    out["adherence"] = float(np.mean(oks)) if oks else None
    planes = np.ascontiguousarray(frames.transpose(3, 0, 1, 2)).astype(np.float32)  # transposing uint8 is cheaper
    out["consistency"], out["windows"] = _consistency(planes, named_mask, th)
    out["n_frames"] = int(frames.shape[0])
    return out
