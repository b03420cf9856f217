"""Procedural captioned clips for training and scoring the tiny CausVid-architecture video model.

A clip shows one named object (shape, colour, size, direction, speed: what the caption says) moving in a straight
line and bouncing off the frame borders, over a scene the caption never mentions: a striped background, an optional
second smaller object in a muted colour, and an optional static dark bar that the named object passes behind and
the second object in front of. The unnamed attributes are the model's to choose in the first generated block (pixel
frames 0-8) and to keep afterwards, which only its KV cache can do; `mmkv.metrics.adherence.score_clip` measures
both (pass it `PALETTE`). Installed as `mmkv.pipelines.wan.scenes`.

Conventions:

* Frames are `height x width` RGB, pixel centres at integer coordinates, x to the right and y down, so "up" is
  towards row 0. Sizes are half-extents in pixels and speeds are pixels per pixel-frame; both stay in pixels at any
  frame size, while positions are fractions of the frame (pixel = fraction * (size - 1)), sampled for the canonical
  64 x 96 clip: at other sizes the layout scales and the guarantees below hold only approximately.
* The named object's centre stays in [r + 1, size - 2 - r] along each axis (r its half-extent) and reflects off
  those bounds. It starts with room for 16 frames of motion before its first bounce, so the first 12 frames show its
  direction. The second object moves parallel to it, slowly, in a band that never overlaps its path; the bar lies
  across its path where it is at a random frame in [20, 60] of the canonical clip, chosen among those that leave
  the object clear of the bar in at least 20 frames.
* Edges are anti-aliased: coverage is a smooth step of the signed distance over one pixel, centred on the edge.
* Seeds: training uses [0, TRAIN_SEED_END); `held_out_seeds(n)` returns n seeds from HELD_OUT_SEED_START = 10**7 up,
  which training never draws. `sample_scene(seed)` draws from a private CPU generator keyed by the seed, so a seed
  gives the same scene on every machine and never touches the global RNG.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from mmkv.codecs.base import private_generator
from mmkv.pipelines.training import HELD_OUT_SEED_START, TRAIN_SEED_END, held_out_seeds  # noqa: F401
from mmkv.metrics.adherence import Palette

RGB = tuple[int, int, int]

SHAPES = ("circle", "square", "triangle", "cross")
# Bright, saturated and at least 90 apart in RGB (orange-yellow is the closest pair), so a colour survives a VAE.
COLOURS: dict[str, RGB] = {
    "red": (230, 30, 40),
    "orange": (255, 140, 0),
    "yellow": (250, 230, 20),
    "green": (40, 230, 40),
    "cyan": (20, 220, 230),
    "blue": (40, 70, 250),
    "purple": (170, 50, 230),
    "white": (245, 245, 245),
}
SIZES: dict[str, float] = {"small": 7.0, "large": 11.0}  # half-extent, pixels
DIRECTIONS = ("left", "right", "up", "down")
# Pixels per pixel-frame: a fast object travels 100 px in 81 frames, more than any free range, so it bounces.
SPEEDS: dict[str, float] = {"slow": 0.5, "fast": 1.25}

# Unnamed palettes: every stripe colour is dark and dull (max channel <= 88), any two of a set at least 18 apart in
# some channel; every second-object colour muted (max channel <= 145); the bar near black. None is within 90 of a
# named colour, which all have a channel >= 230.
STRIPE_DARK: tuple[RGB, ...] = ((22, 24, 44), (44, 28, 20), (22, 42, 26), (40, 22, 42))
STRIPE_LIGHT: tuple[RGB, ...] = ((56, 64, 88), (88, 68, 52), (58, 86, 58), (82, 58, 84))
SECOND_COLOURS: tuple[RGB, ...] = (
    (140, 100, 100), (100, 135, 105), (100, 110, 145), (140, 130, 90), (125, 100, 140), (95, 130, 135),
)
OCCLUDER_COLOUR: RGB = (6, 6, 8)

STRIPE_PERIOD = (8.0, 20.0)  # pixels, uniform
STRIPE_ANGLES = (0, 45, 90, 135)  # degrees of the stripes' normal from the x axis; 0 = vertical stripes
SECOND_HALF_EXTENT = 5.0
SECOND_SPEED = 0.25
SECOND_PROB = 0.7
OCCLUDER_PROB = 0.5
OCCLUDER_WIDTH = (3.0, 5.0)  # pixels, uniform: narrower than any named object, which therefore never vanishes
OCCLUDER_FRAME = (20, 60)  # the bar lies where the named object is at a frame drawn in this range ...
OCCLUDER_CLEAR_FRAMES = 20  # ... among those leaving it this many frames clear of the bar
EARLY_ROOM_FRAMES = 16

FRAMES, HEIGHT, WIDTH = 81, 64, 96

# The detector's view of the named attributes.
PALETTE = Palette(colours=COLOURS, sizes=SIZES, speeds=SPEEDS)

# Caption grammar: a format string over the named attributes and the words this template uses for each speed.
TEMPLATES: tuple[tuple[str, dict[str, str]], ...] = (
    ("a {size} {colour} {shape} moving {direction} {speed}", {"slow": "slowly", "fast": "quickly"}),
    ("a {size} {colour} {shape} drifts {direction} {speed}", {"slow": "slow", "fast": "fast"}),
    ("a {speed} {size} {colour} {shape} heading {direction}", {"slow": "slow", "fast": "fast"}),
    ("the {colour} {shape} is {size} and moves {direction} {speed}", {"slow": "slowly", "fast": "quickly"}),
    ("a {colour} {shape} of {size} size travelling {direction} at {speed} speed", {"slow": "low", "fast": "high"}),
)


@dataclass(frozen=True)
class Stripes:
    """The background: bands of two colours, `period` pixels apart along the direction `angle` (degrees from the x
    axis), shifted by `phase` periods."""

    colours: tuple[RGB, RGB]
    period: float
    angle: int
    phase: float


@dataclass(frozen=True)
class SecondObject:
    """A smaller object in a muted colour; it moves parallel to the named one, off its path, in front of the bar."""

    shape: str
    colour: RGB
    half_extent: float
    x0: float  # start centre, fractions of the frame
    y0: float
    vx: float  # pixels per frame
    vy: float


@dataclass(frozen=True)
class Occluder:
    """A static bar over the named object, under the second one: across the frame at `position` (a fraction of the
    width for axis "x", a vertical bar; of the height for axis "y", a horizontal one), `width` pixels wide."""

    axis: str
    position: float
    width: float
    colour: RGB


@dataclass(frozen=True)
class Scene:
    """One clip. The first five fields are what a caption names; the rest is unnamed."""

    shape: str
    colour: str
    size: str
    direction: str
    speed: str
    x0: float  # start centre of the named object, fractions of the frame
    y0: float
    background: Stripes
    second: SecondObject | None
    occluder: Occluder | None
    template: int

    def __post_init__(self):
        for field, value, allowed in (
            ("shape", self.shape, SHAPES), ("colour", self.colour, tuple(COLOURS)), ("size", self.size, tuple(SIZES)),
            ("direction", self.direction, DIRECTIONS), ("speed", self.speed, tuple(SPEEDS)),
        ):
            if value not in allowed:
                raise ValueError(f"Scene {field} {value!r} is not one of {', '.join(allowed)}")
        if not 0 <= self.template < len(TEMPLATES):
            raise ValueError(f"Scene template {self.template} is not in 0..{len(TEMPLATES) - 1}")

    @property
    def named(self) -> dict[str, str]:
        """The attributes a caption states (what `parse_caption` returns)."""
        return {"shape": self.shape, "colour": self.colour, "size": self.size, "direction": self.direction,
                "speed": self.speed}


# ----------------------------------------------------------------------------------------------------------------
# Sampling


def _axis(direction: str) -> tuple[int, float]:
    """(axis, sign) of a direction: axis 0 is x, 1 is y; y grows downwards."""
    return {"left": (0, -1.0), "right": (0, 1.0), "up": (1, -1.0), "down": (1, 1.0)}[direction]


def _bounce(p: float, lo: float, hi: float) -> float:
    span = hi - lo
    u = (p - lo) % (2 * span)
    return lo + (u if u <= span else 2 * span - u)


def sample_scene(seed: int) -> Scene:
    """The scene of one seed: uniform over the named attributes, the unnamed ones as the module docstring says."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"scene seed must be a non-negative int, got {seed!r}")
    # One fixed-length draw keeps every attribute's value independent of how the others are used.
    u = iter(torch.rand(32, generator=private_generator(seed, "scenes"), dtype=torch.float64).tolist())

    def pick(options):
        return options[min(int(next(u) * len(options)), len(options) - 1)]

    def uniform(lo, hi):
        return lo + (hi - lo) * next(u)

    shape, colour, size = pick(SHAPES), pick(tuple(COLOURS)), pick(tuple(SIZES))
    direction, speed = pick(DIRECTIONS), pick(tuple(SPEEDS))
    r, v = SIZES[size], SPEEDS[speed]
    axis, sign = _axis(direction)
    dims = (WIDTH, HEIGHT)
    along, across = dims[axis], dims[1 - axis]

    # Named object: leave EARLY_ROOM_FRAMES of motion before the first bounce.
    lo, hi = r + 1, along - 2 - r
    room = EARLY_ROOM_FRAMES * v
    p0 = uniform(lo, hi - room) if sign > 0 else uniform(lo + room, hi)
    q0 = uniform(r + 1, across - 2 - r)

    background = Stripes(
        colours=(pick(STRIPE_DARK), pick(STRIPE_LIGHT)),
        period=uniform(*STRIPE_PERIOD), angle=pick(STRIPE_ANGLES), phase=next(u),
    )

    second = None
    present, s_shape, s_colour = next(u) < SECOND_PROB, pick(SHAPES), pick(SECOND_COLOURS)
    s_along, s_across, s_sign = next(u), next(u), 1.0 if next(u) < 0.5 else -1.0
    if present:
        rd = SECOND_HALF_EXTENT
        gap = r + rd + 4  # 4 px between the two objects' boxes
        # Its band across the motion avoids the named object's band: [rd + 1, q0 - gap] or [q0 + gap, across - 2 - rd].
        bands = [(rd + 1, q0 - gap), (q0 + gap, across - 2 - rd)]
        bands = [(a, b) for a, b in bands if b > a]
        total = sum(b - a for a, b in bands)
        t = s_across * total
        for a, b in bands:
            if t <= b - a:
                qd = a + t
                break
            t -= b - a
        else:  # only float rounding lands past the last band's end
            qd = bands[-1][1]
        pd = rd + 1 + s_along * (along - 2 * rd - 3)
        pos = [0.0, 0.0]
        pos[axis], pos[1 - axis] = pd / (along - 1), qd / (across - 1)
        vel = [0.0, 0.0]
        vel[axis] = s_sign * SECOND_SPEED
        second = SecondObject(s_shape, s_colour, rd, pos[0], pos[1], vel[0], vel[1])

    occluder = None
    present, frame, width = next(u) < OCCLUDER_PROB, next(u), uniform(*OCCLUDER_WIDTH)
    if present:
        path = [_bounce(p0 + sign * v * t, lo, hi) for t in range(FRAMES)]
        # Only where the object is also seen whole for OCCLUDER_CLEAR_FRAMES frames, so its shape stays readable.
        places = [path[t] for t in range(OCCLUDER_FRAME[0], OCCLUDER_FRAME[1] + 1)
                  if sum(abs(p - path[t]) >= r + width / 2 + 2 for p in path) >= OCCLUDER_CLEAR_FRAMES]
        if places:
            where = places[min(int(frame * len(places)), len(places) - 1)]
            occluder = Occluder("x" if axis == 0 else "y", where / (along - 1), width, OCCLUDER_COLOUR)

    template = pick(tuple(range(len(TEMPLATES))))
    start = [0.0, 0.0]
    start[axis], start[1 - axis] = p0 / (along - 1), q0 / (across - 1)
    return Scene(shape, colour, size, direction, speed, start[0], start[1], background, second, occluder, template)


# ----------------------------------------------------------------------------------------------------------------
# Captions


def caption(scene: Scene) -> str:
    """The scene's caption in its template, built from the named attributes only."""
    text, speed_words = TEMPLATES[scene.template]
    return text.format(shape=scene.shape, colour=scene.colour, size=scene.size, direction=scene.direction,
                       speed=speed_words[scene.speed])


def _template_regex(text: str, speed_words: dict[str, str]) -> re.Pattern:
    choices = {"shape": SHAPES, "colour": tuple(COLOURS), "size": tuple(SIZES), "direction": DIRECTIONS,
               "speed": tuple(speed_words.values())}
    parts = re.split(r"\{(\w+)\}", text)  # literal, field, literal, field, ...
    pattern = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{'|'.join(choices[p])})"
                      for i, p in enumerate(parts))
    return re.compile(pattern)


_PARSERS = [(_template_regex(text, words), {w: s for s, w in words.items()}) for text, words in TEMPLATES]


def parse_caption(text: str) -> dict[str, str] | None:
    """The named attributes of a caption `caption()` could have written (case, surrounding spaces, repeated spaces
    and a final full stop are ignored), or None for any other prompt."""
    if not isinstance(text, str):
        return None
    text = " ".join(text.lower().split()).removesuffix(".").strip()
    for regex, speed_of_word in _PARSERS:
        m = regex.fullmatch(text)
        if m:
            named = m.groupdict()
            named["speed"] = speed_of_word[named["speed"]]
            return named
    return None


def vocabulary() -> list[str]:
    """Every word a caption can contain, sorted (a word-level tokenizer's vocabulary)."""
    words = set(SHAPES) | set(COLOURS) | set(SIZES) | set(DIRECTIONS)
    for text, speed_words in TEMPLATES:
        words |= set(speed_words.values())
        words |= {w for w in re.sub(r"\{\w+\}", " ", text).split()}
    return sorted(words)


# ----------------------------------------------------------------------------------------------------------------
# Rendering


def _smoothstep(sdf: torch.Tensor) -> torch.Tensor:
    """Coverage of a pixel whose centre lies at signed distance `sdf` (negative inside): 1 px wide, centred on 0."""
    t = (0.5 - sdf).clamp(0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _box(dx, dy, hx, hy):
    qx, qy = dx.abs() - hx, dy.abs() - hy
    outside = torch.sqrt(qx.clamp(min=0) ** 2 + qy.clamp(min=0) ** 2)
    return outside + torch.maximum(qx, qy).clamp(max=0)


def _circle(dx, dy, r):
    return torch.sqrt(dx * dx + dy * dy) - r


def _square(dx, dy, r):
    return _box(dx, dy, r, r)


_INV_SQRT5 = 1.0 / math.sqrt(5.0)


def _triangle(dx, dy, r):
    # Apex (0, -r) at the top, base from (-r, r) to (r, r): the largest of the three edge distances (exact inside and
    # along the edges, which is all a 1 px smooth step sees).
    base = dy - r
    left = (-2.0 * dx - dy - r) * _INV_SQRT5
    right = (2.0 * dx - dy - r) * _INV_SQRT5
    return torch.maximum(base, torch.maximum(left, right))


CROSS_ARM = 1.0 / 3.0  # half-width of a cross's bars over its half-extent: fill ratio 2/3 - 1/9 = 0.556 of its box


def _cross(dx, dy, r):
    a = r * CROSS_ARM
    return torch.minimum(_box(dx, dy, r, a), _box(dx, dy, a, r))


_SDFS = (_circle, _square, _triangle, _cross)  # in SHAPES order


def _stamp(under: torch.Tensor, clips: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, shape_id: torch.Tensor,
           r: torch.Tensor, rgb: torch.Tensor, reach: int) -> None:
    """Composite one object over each of the clips `clips` [b] of `under` [B, T, H, W, 3], in place, inside a
    (2 reach + 1)^2 patch around its centre [b, T] (the patch covers the object and its anti-aliased edge, so nothing
    outside it changes)."""
    b, (t, h, w) = len(clips), under.shape[1:4]
    size = 2 * reach + 1
    ox = (cx.round() - reach).clamp(0, w - size).long()  # [b, T]
    oy = (cy.round() - reach).clamp(0, h - size).long()
    ramp = torch.arange(size, device=under.device)
    xs = ox[..., None, None] + ramp.view(1, 1, 1, size)  # [b, T, 1, S]
    ys = oy[..., None, None] + ramp.view(1, 1, size, 1)  # [b, T, S, 1]
    dx, dy = xs.float() - cx[..., None, None], ys.float() - cy[..., None, None]
    sdf = torch.empty(b, t, size, size, device=under.device)
    for k, fn in enumerate(_SDFS):
        sel = shape_id == k
        if bool(sel.any()):
            sdf[sel] = fn(dx[sel], dy[sel], r[sel].view(-1, 1, 1, 1))
    alpha = _smoothstep(sdf)[..., None]
    frame = clips[:, None] * t + torch.arange(t, device=under.device)  # [b, T]
    flat_index = ((frame[..., None, None] * h + ys) * w + xs).reshape(-1)
    flat = under.view(-1, 3)
    patch = flat[flat_index].view(b, t, size, size, 3)
    patch = patch + alpha * (rgb.view(b, 1, 1, 1, 3) - patch)
    flat.index_put_((flat_index,), patch.reshape(-1, 3))


def _track(p0: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, frames: int) -> torch.Tensor:
    """Positions [B, T] of a point starting at p0 with velocity v (per frame), reflected off lo and hi (float64)."""
    span = (hi - lo)[:, None]
    t = torch.arange(frames, dtype=torch.float64)
    u = torch.remainder(p0[:, None] + v[:, None] * t - lo[:, None], 2 * span)
    return lo[:, None] + torch.where(u <= span, u, 2 * span - u)


def _colour_tensor(colours, device) -> torch.Tensor:
    return torch.tensor(colours, dtype=torch.float32, device=device) / 255.0


def render(scenes: Scene | Sequence[Scene], frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH,
           device: str | torch.device = "cpu") -> torch.Tensor:
    """Clips [B, frames, height, width, 3], float32 in [0, 1], of the given scenes (one Scene gives B = 1).

    Layers, back to front: stripes, named object, bar, second object. Trajectories are computed on the CPU in float64
    and every pixel operation is elementwise, so CPU and CUDA agree to float32 rounding."""
    if isinstance(scenes, Scene):
        scenes = [scenes]
    scenes = list(scenes)
    if not scenes or not all(isinstance(s, Scene) for s in scenes):
        raise ValueError("render needs a non-empty sequence of Scene objects (from sample_scene)")
    reach = int(math.ceil(max(SIZES.values()))) + 2
    for name, value, least in (("frames", frames, 1), ("height", height, 2 * reach + 1),
                               ("width", width, 2 * reach + 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"render {name} must be an int >= {least}, got {value!r}")
    device = torch.device(device)
    n = len(scenes)
    dims = torch.tensor([width, height], dtype=torch.float64)

    # Stripes, static.
    ys = torch.arange(height, device=device, dtype=torch.float32).view(1, height, 1)
    xs = torch.arange(width, device=device, dtype=torch.float32).view(1, 1, width)
    bg = [s.background for s in scenes]
    angle = torch.tensor([math.radians(s.angle) for s in bg], dtype=torch.float64)
    cos, sin = (torch.cos(angle).float().to(device).view(n, 1, 1), torch.sin(angle).float().to(device).view(n, 1, 1))
    period = torch.tensor([s.period for s in bg], device=device).view(n, 1, 1)
    phase = torch.tensor([s.phase for s in bg], device=device).view(n, 1, 1)
    cycles = (xs * cos + ys * sin) / period + phase
    # Distance (in periods) to the centre of the light band, wrapped: a continuous triangle wave.
    centre = (torch.remainder(cycles - 0.25 + 0.5, 1.0) - 0.5).abs()
    light = _smoothstep(period * (centre - 0.25))[..., None]
    dark_rgb = _colour_tensor([s.colours[0] for s in bg], device).view(n, 1, 1, 3)
    light_rgb = _colour_tensor([s.colours[1] for s in bg], device).view(n, 1, 1, 3)
    stripes = dark_rgb + light * (light_rgb - dark_rgb)
    out = stripes[:, None].expand(n, frames, height, width, 3).contiguous()

    # Named objects.
    r = torch.tensor([SIZES[s.size] for s in scenes], dtype=torch.float64)
    lo, hi = r + 1, dims.view(1, 2) - 2 - r[:, None]
    start = torch.tensor([[s.x0, s.y0] for s in scenes], dtype=torch.float64) * (dims - 1)
    vel = torch.zeros(n, 2, dtype=torch.float64)
    for i, s in enumerate(scenes):
        axis, sign = _axis(s.direction)
        vel[i, axis] = sign * SPEEDS[s.speed]
    cx = _track(start[:, 0], vel[:, 0], lo, hi[:, 0], frames)
    cy = _track(start[:, 1], vel[:, 1], lo, hi[:, 1], frames)
    _stamp(out, torch.arange(n, device=device), cx.float().to(device), cy.float().to(device),
           torch.tensor([SHAPES.index(s.shape) for s in scenes], device=device), r.float().to(device),
           _colour_tensor([COLOURS[s.colour] for s in scenes], device), reach)

    # Bars, over the named objects: only the rows or columns they touch change.
    for i, s in enumerate(scenes):
        occ = s.occluder
        if occ is None:
            continue
        along = width if occ.axis == "x" else height
        centre_px = occ.position * (along - 1)
        first = max(0, int(math.floor(centre_px - occ.width / 2 - 1)))
        end = min(along, int(math.ceil(centre_px + occ.width / 2 + 1)) + 1)
        coords = torch.arange(first, end, device=device, dtype=torch.float32)
        alpha = _smoothstep((coords - centre_px).abs() - occ.width / 2)
        rgb = _colour_tensor(occ.colour, device)
        if occ.axis == "x":
            view, alpha = out[i, :, :, first:end], alpha.view(1, 1, -1, 1)
        else:
            view, alpha = out[i, :, first:end], alpha.view(1, -1, 1, 1)
        view.add_(alpha * (rgb - view))

    # Second objects, in front (they never meet the named object, and the bar never hides them).
    has_second = [i for i, s in enumerate(scenes) if s.second is not None]
    if has_second:
        sec = [scenes[i].second for i in has_second]
        rd = torch.tensor([o.half_extent for o in sec], dtype=torch.float64)
        lo, hi = rd + 1, dims.view(1, 2) - 2 - rd[:, None]  # [m, 2]
        start = torch.tensor([[o.x0, o.y0] for o in sec], dtype=torch.float64) * (dims - 1)
        vel = torch.tensor([[o.vx, o.vy] for o in sec], dtype=torch.float64)
        cx = _track(start[:, 0], vel[:, 0], lo, hi[:, 0], frames)
        cy = _track(start[:, 1], vel[:, 1], lo, hi[:, 1], frames)
        _stamp(out, torch.tensor(has_second, device=device), cx.float().to(device), cy.float().to(device),
               torch.tensor([SHAPES.index(o.shape) for o in sec], device=device),
               rd.float().to(device), _colour_tensor([o.colour for o in sec], device),
               int(math.ceil(SECOND_HALF_EXTENT)) + 2)
    return out
