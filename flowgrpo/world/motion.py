"""The moving-shapes world: text-to-video clips of the shapes world, their prompts and their metadata.

Clips are ``num_frames`` (13 by default) RGB frames of 64 x 64 on white, drawn with the image world's renderer
(classes, colours, circumradius 6-12 px, anti-aliasing: :mod:`flowgrpo.world.render`). Every object moves in a
straight line at a constant velocity for the whole clip:

- a **direction** ``left / right / up / down`` (``y`` grows downwards, so ``up`` is ``-y``) or ``still``;
- a **speed** in px per frame: ``slowly`` 1.0-1.4, ``quickly`` 2.6-3.0, unnamed 1.0-3.0 (uniform);
- objects stay inside the frame in every frame and never overlap (circumcircles at least ``gap`` = 4 px
  apart in every frame);
- where a prompt names no motion, each object gets a random direction (one of the four) and speed.

Prompts (tags), GenEval-style metadata with one more clause field, ``motion`` (a direction or ``"still"``), and
``speed`` (``"slowly"`` / ``"quickly"``) where the prompt names one:

=================  ===========================================================  =============================
tag                prompt                                                       include (and exclude)
=================  ===========================================================  =============================
motion             a red circle moving left                                     [red circle x1, left]
two_object_motion  a blue square moving up and a yellow triangle moving right   [blue square up, yellow ...]
counting           three green circles                                          [green circle x3], excl. x4
colors             a red circle                                                 [red circle x1]
speed              a black square moving quickly to the right                   [black square, right, quickly]
static             a purple triangle standing still                             [purple triangle, still]
=================  ===========================================================  =============================

``counting`` holds its count in every frame (objects move, in random directions). ``two_object_motion`` uses two
different classes and two different colours. :func:`split_motion_prompts` splits every distinct prompt into
disjoint train / held-out sets per tag (``scripts/make_prompts.py`` writes ``assets/prompts/motion_*.jsonl``).

The renderer draws any metadata, so tests draw negatives by perturbing metadata (:func:`perturb_motion`) or by
editing the :class:`Track` list of a clip (:func:`draw_clip` takes explicit tracks, and :func:`draw_frames`
explicit per-frame shapes: an object that vanishes mid-clip, two objects that swap colours).

Pretraining's caption flaw (web captions that get motion wrong) is :func:`corrupt_motion`: the clip of a
caption that names a direction moves the opposite way, or not at all, with given probabilities.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from .prompts import COUNT_WORDS, _a, _plural
from .render import CLASSES, PALETTE, Shape, draw

__all__ = [
    "DIRECTIONS",
    "MOTION_PERTURBATIONS",
    "MOTION_TAGS",
    "NUM_FRAMES",
    "SPEEDS",
    "SPEED_RANGES",
    "Track",
    "all_motion_metadata",
    "corrupt_motion",
    "draw_clip",
    "draw_frames",
    "motion_metadata_for",
    "motion_prompt_for",
    "perturb_motion",
    "render_clip",
    "sample_tracks",
    "split_motion_prompts",
]

MOTION_TAGS: tuple[str, ...] = ("motion", "two_object_motion", "counting", "colors", "speed", "static")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
SPEEDS: tuple[str, ...] = ("slowly", "quickly")
NUM_FRAMES = 13  # 4k + 1: what Wan's causal VAE with 4x temporal compression takes
# Speed ranges (px per frame) the renderer draws from; None: a prompt that names no speed.
SPEED_RANGES: dict[str | None, tuple[float, float]] = {"slowly": (1.0, 1.4), "quickly": (2.6, 3.0), None: (1.0, 3.0)}
UNIT = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0), "still": (0.0, 0.0)}
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
COUNTS: tuple[int, ...] = (2, 3, 4)
TWO_OBJECT_PROMPTS = 120  # seeded subset of the 6 x 30 x 16 = 2880 two-object combinations
MOTION_PERTURBATIONS: tuple[str, ...] = ("direction", "color", "class", "count", "still", "moving", "speed")


def _motion_words(clause: dict) -> str:
    motion, speed = clause.get("motion"), clause.get("speed")
    if motion is None:
        return ""
    if motion == "still":
        return " standing still"
    if speed is None:
        return f" moving {motion}"
    where = f"to the {motion}" if motion in ("left", "right") else motion
    return f" moving {speed} {where}"


def motion_prompt_for(metadata: dict) -> str:
    """The sentence of a metadata dict (also valid for perturbed metadata)."""
    tag, inc = metadata["tag"], metadata["include"]
    if tag == "counting":
        c = inc[0]
        n = c["count"]
        noun = c["class"] if n == 1 else _plural(c["class"])
        return f"{COUNT_WORDS[n]} {c['color']} {noun}{_motion_words(c)}"
    if tag in MOTION_TAGS:
        return " and ".join(f"{_a(c['color'])} {c['class']}{_motion_words(c)}" for c in inc)
    raise ValueError(f"metadata field 'tag' is {tag!r}; expected one of {MOTION_TAGS}")


def motion_metadata_for(
    tag: str,
    classes: str | tuple[str, ...],
    colors: str | tuple[str, ...],
    motions: str | tuple[str, ...] | None = None,
    speed: str | None = None,
    count: int | None = None,
) -> dict:
    """Build one metadata dict. ``two_object_motion``: ``classes``, ``colors``, ``motions`` are pairs."""
    classes = (classes,) if isinstance(classes, str) else tuple(classes)
    colors = (colors,) if isinstance(colors, str) else tuple(colors)
    motions = (motions,) if isinstance(motions, str) or motions is None else tuple(motions)
    for c in classes:
        if c not in CLASSES:
            raise ValueError(f"class {c!r} is not a shapes-world class {CLASSES}")
    for c in colors:
        if c not in PALETTE:
            raise ValueError(f"colour {c!r} is not a palette colour {tuple(PALETTE)}")
    for m in motions:
        if m is not None and m not in UNIT:
            raise ValueError(f"motion {m!r} is not one of {tuple(UNIT)}")
    if speed is not None and speed not in SPEEDS:
        raise ValueError(f"speed {speed!r} is not one of {SPEEDS}")

    def clause(i: int, motion: str | None = None, n: int = 1) -> dict:
        out = {"class": classes[i], "count": n, "color": colors[i]}
        if motion is not None:
            out["motion"] = motion
        return out

    meta: dict = {"tag": tag}
    if tag == "motion":
        if motions[0] not in DIRECTIONS:
            raise ValueError(f"tag 'motion' needs motions= one of {DIRECTIONS}")
        meta["include"] = [clause(0, motions[0])]
    elif tag == "two_object_motion":
        if len(classes) != 2 or len(colors) != 2 or len(motions) != 2 or not set(motions) <= set(DIRECTIONS):
            raise ValueError("tag 'two_object_motion' needs two classes, two colours and two directions")
        meta["include"] = [clause(0, motions[0]), clause(1, motions[1])]
    elif tag == "counting":
        if count is None:
            raise ValueError("tag 'counting' needs count=")
        meta["include"] = [clause(0, n=int(count))]
        meta["exclude"] = [{"class": classes[0], "count": int(count) + 1}]
    elif tag == "colors":
        meta["include"] = [clause(0)]
    elif tag == "speed":
        if motions[0] not in DIRECTIONS or speed is None:
            raise ValueError(f"tag 'speed' needs motions= one of {DIRECTIONS} and speed= one of {SPEEDS}")
        meta["include"] = [clause(0, motions[0]) | {"speed": speed}]
    elif tag == "static":
        meta["include"] = [clause(0, "still")]
    else:
        raise ValueError(f"unknown tag {tag!r}; expected one of {MOTION_TAGS}")
    meta["prompt"] = motion_prompt_for(meta)
    return meta


def all_motion_metadata(tag: str | None = None, seed: int = 0) -> list[dict]:
    """Every distinct prompt of one tag (or all six), fixed order; ``two_object_motion`` is a seeded subset of
    :data:`TWO_OBJECT_PROMPTS` of its 2880 combinations (in which every class pair, colour and direction occurs)."""
    tags = MOTION_TAGS if tag is None else (tag,)
    out: list[dict] = []
    singles = [(c, k) for c in CLASSES for k in PALETTE]
    for t in tags:
        if t == "motion":
            out += [motion_metadata_for(t, c, k, d) for c, k in singles for d in DIRECTIONS]
        elif t == "two_object_motion":
            combos = [
                (cls, cols, dirs)
                for cls in itertools.permutations(CLASSES, 2)
                for cols in itertools.permutations(PALETTE, 2)
                for dirs in itertools.product(DIRECTIONS, repeat=2)
            ]
            pick = np.random.default_rng(seed).choice(len(combos), TWO_OBJECT_PROMPTS, replace=False)
            out += [motion_metadata_for(t, *combos[i]) for i in sorted(pick.tolist())]
        elif t == "counting":
            out += [motion_metadata_for(t, c, k, count=n) for c, k in singles for n in COUNTS]
        elif t == "colors":
            out += [motion_metadata_for(t, c, k) for c, k in singles]
        elif t == "speed":
            out += [motion_metadata_for(t, c, k, d, speed=s) for c, k in singles for d in DIRECTIONS for s in SPEEDS]
        elif t == "static":
            out += [motion_metadata_for(t, c, k, "still") for c, k in singles]
        else:
            raise ValueError(f"unknown tag {t!r}; expected one of {MOTION_TAGS}")
    return out


def _words(meta: dict) -> set[tuple[str, object]]:
    words: set[tuple[str, object]] = set()
    for c in meta["include"]:
        words |= {("class", c["class"]), ("color", c["color"])}
        for key in ("motion", "speed"):
            if key in c:
                words.add((key, c[key]))
        if c["count"] != 1:
            words.add(("count", c["count"]))
    return words


def split_motion_prompts(seed: int = 0, test_fraction: float = 1 / 3, tries: int = 1000) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) split of :func:`all_motion_metadata`, per tag, seeded; the train part of every tag
    contains every class, colour, direction, speed and count of that tag (held-out prompts are new combinations)."""
    rng = np.random.default_rng(seed)
    train: list[dict] = []
    test: list[dict] = []
    for tag in MOTION_TAGS:
        items = all_motion_metadata(tag, seed=seed)
        n_test = min(len(items) - 1, max(1, int(round(len(items) * test_fraction))))
        required = set().union(*(_words(m) for m in items))
        best, best_cover = None, -1
        for _ in range(tries):
            order = rng.permutation(len(items))
            cover = len(set().union(*(_words(items[i]) for i in order[n_test:])) & required)
            if cover > best_cover:
                best, best_cover = order, cover
            if best_cover == len(required):
                break
        train += [items[i] for i in sorted(best[n_test:].tolist())]
        test += [items[i] for i in sorted(best[:n_test].tolist())]
    return train, test


# ---------------------------------------------------------------------------------------------- renderer
@dataclass(frozen=True)
class Track:
    """One object of a clip: its shape in frame 0 and its velocity ``(vx, vy)`` in px per frame."""

    shape: Shape
    vx: float
    vy: float

    def at(self, frame: int) -> Shape:
        return replace(self.shape, cx=self.shape.cx + frame * self.vx, cy=self.shape.cy + frame * self.vy)

    @property
    def speed(self) -> float:
        return math.hypot(self.vx, self.vy)


def _velocity(clause: dict, rng: np.random.Generator, scale: float) -> tuple[float, float]:
    motion = clause.get("motion")
    if motion == "still":
        return 0.0, 0.0
    if motion is None:
        motion = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    lo, hi = SPEED_RANGES[clause.get("speed")]
    speed = float(rng.uniform(lo, hi)) * scale
    ux, uy = UNIT[motion]
    return ux * speed, uy * speed


def _min_distance(a: Track, b: Track, frames: int) -> float:
    """Smallest centre distance of two linear tracks over frames 0..frames-1 (closest approach, clamped)."""
    dx, dy = a.shape.cx - b.shape.cx, a.shape.cy - b.shape.cy
    ux, uy = a.vx - b.vx, a.vy - b.vy
    uu = ux * ux + uy * uy
    t = 0.0 if uu == 0 else min(max(-(dx * ux + dy * uy) / uu, 0.0), frames - 1.0)
    return math.hypot(dx + t * ux, dy + t * uy)


def sample_tracks(
    metadata: dict,
    rng: np.random.Generator | int | None = None,
    num_frames: int = NUM_FRAMES,
    size: int = 64,
    radius: tuple[float, float] = (6.0, 12.0),
    gap: float = 4.0,
    max_restarts: int = 300,
) -> list[Track]:
    """A random clip satisfying ``metadata`` (classes, counts, colours, motions, speeds; see module doc).

    Velocities are drawn first, then positions such that the whole path stays inside the frame and no two
    objects come closer than ``gap`` in any frame; the largest radius is lowered step by step when layouts keep
    failing (four moving objects), and ``RuntimeError`` is raised only if even the smallest radii do not fit.
    """
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    include = metadata.get("include")
    if not isinstance(include, list) or not include:
        raise ValueError("metadata field 'include' must be a non-empty list of clauses")
    objects = []
    for index, clause in enumerate(include):
        if clause.get("class") not in CLASSES:
            raise ValueError(f"metadata field 'include[{index}].class' is {clause.get('class')!r}; expected one of {CLASSES}")
        colour = clause.get("color")
        if colour is not None and colour not in PALETTE:
            raise ValueError(f"metadata field 'include[{index}].color' is {colour!r}; expected one of {tuple(PALETTE)}")
        if clause.get("motion") not in (None, *UNIT):
            raise ValueError(f"metadata field 'include[{index}].motion' is {clause.get('motion')!r}; expected one of {tuple(UNIT)}")
        if clause.get("speed") not in (None, *SPEEDS):
            raise ValueError(f"metadata field 'include[{index}].speed' is {clause.get('speed')!r}; expected one of {SPEEDS}")
        count = clause.get("count", 1)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"metadata field 'include[{index}].count' must be a positive int, got {count!r}")
        objects += [clause] * count
    scale = size / 64.0
    r_min, r_max, margin, gap = radius[0] * scale, radius[1] * scale, 1.0 * scale, gap * scale
    for attempt in range(max_restarts):
        hi = max(r_min, r_max - (r_max - r_min) * min(1.0, attempt / (0.5 * max_restarts)))
        placed: list[Track] = []
        for clause in objects:
            colour = clause.get("color") or tuple(PALETTE)[int(rng.integers(len(PALETTE)))]
            vx, vy = _velocity(clause, rng, scale)
            for _ in range(100):
                r = float(rng.uniform(r_min, hi))
                # Start positions whose whole path fits: frame 0 and the last frame inside (straight line).
                span_x, span_y = (num_frames - 1) * vx, (num_frames - 1) * vy
                x_lo, x_hi = r + margin - min(span_x, 0.0), size - r - margin - max(span_x, 0.0)
                y_lo, y_hi = r + margin - min(span_y, 0.0), size - r - margin - max(span_y, 0.0)
                if x_lo > x_hi or y_lo > y_hi:
                    continue
                track = Track(Shape(clause["class"], colour, float(rng.uniform(x_lo, x_hi)), float(rng.uniform(y_lo, y_hi)), r), vx, vy)
                if any(_min_distance(track, other, num_frames) < r + other.shape.r + gap for other in placed):
                    continue
                placed.append(track)
                break
            else:
                break
        else:
            return placed
    raise RuntimeError(f"could not lay out a clip for metadata {metadata!r} in {max_restarts} attempts")


def draw_frames(frames: list[list[Shape]], size: int = 64, supersample: int = 4) -> np.ndarray:
    """Draw explicit per-frame shape lists: uint8 ``[len(frames), size, size, 3]``."""
    return np.stack([draw(shapes, size=size, supersample=supersample) for shapes in frames])


def draw_clip(tracks: list[Track], num_frames: int = NUM_FRAMES, size: int = 64, supersample: int = 4) -> np.ndarray:
    """Draw tracks over ``num_frames`` frames: uint8 ``[num_frames, size, size, 3]``."""
    return draw_frames([[t.at(f) for t in tracks] for f in range(num_frames)], size=size, supersample=supersample)


def render_clip(
    metadata: dict,
    seed: int | None = None,
    rng: np.random.Generator | None = None,
    num_frames: int = NUM_FRAMES,
    size: int = 64,
    supersample: int = 4,
    **track_kwargs,
) -> np.ndarray:
    """A random clip for ``metadata``: uint8 ``[num_frames, size, size, 3]``, seeded by ``seed`` or ``rng``."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    tracks = sample_tracks(metadata, rng, num_frames=num_frames, size=size, **track_kwargs)
    return draw_clip(tracks, num_frames=num_frames, size=size, supersample=supersample)


# ---------------------------------------------------------------------------------------------- negatives, caption noise
def _retag(meta: dict) -> dict:
    meta["prompt"] = motion_prompt_for(meta)
    return meta


def perturb_motion(metadata: dict, kind: str, rng: np.random.Generator | int | None = None) -> dict | None:
    """Metadata of a clip that fails ``metadata`` in one way, or ``None`` if ``kind`` does not apply. The tag is
    kept and the prompt rewritten to describe the perturbed clip.

    ``direction`` (a clause's direction -> another one: opposite or perpendicular), ``color``, ``class``, ``count``
    (counting: n +- 1), ``still`` (a moving clause stands still), ``moving`` (a still clause moves), ``speed``
    (slowly <-> quickly)."""
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    meta = copy.deepcopy(metadata)
    inc = meta["include"]

    def pick(clauses):
        return clauses[int(rng.integers(len(clauses)))] if clauses else None

    if kind == "direction":
        clause = pick([c for c in inc if c.get("motion") in DIRECTIONS])
        if clause is None:
            return None
        clause["motion"] = pick([d for d in DIRECTIONS if d != clause["motion"]])
    elif kind == "color":
        clause = pick(inc)
        used = {c["color"] for c in inc}
        clause["color"] = pick([k for k in PALETTE if k not in used])
    elif kind == "class":
        clause = pick(inc)
        used = {c["class"] for c in inc}
        old, clause["class"] = clause["class"], pick([c for c in CLASSES if c not in used])
        for ex in meta.get("exclude", []):
            if ex["class"] == old:
                ex["class"] = clause["class"]
    elif kind == "count":
        if meta["tag"] != "counting":
            return None
        n = inc[0]["count"]
        inc[0]["count"] = pick([m for m in (n - 1, n + 1) if m >= 1])
        for ex in meta.get("exclude", []):
            ex["count"] = inc[0]["count"] + 1
    elif kind == "still":
        clause = pick([c for c in inc if c.get("motion") in DIRECTIONS])
        if clause is None:
            return None
        clause["motion"] = "still"
        clause.pop("speed", None)
    elif kind == "moving":
        clause = pick([c for c in inc if c.get("motion") == "still"])
        if clause is None:
            return None
        clause["motion"] = pick(list(DIRECTIONS))
    elif kind == "speed":
        clause = pick([c for c in inc if c.get("speed") in SPEEDS])
        if clause is None:
            return None
        clause["speed"] = "quickly" if clause["speed"] == "slowly" else "slowly"
    else:
        raise ValueError(f"unknown perturbation {kind!r}; expected one of {MOTION_PERTURBATIONS}")
    return _retag(meta)


def corrupt_motion(metadata: dict, rng: np.random.Generator, opposite: float, still: float) -> dict:
    """What a mislabelled training clip shows for a caption (``metadata``): per clause that names a direction,
    with probability ``opposite`` the clip moves the opposite way and with probability ``still`` it does not move.
    Returns the metadata to *render* (the caption stays ``metadata['prompt']``); other clauses are unchanged."""
    if opposite < 0 or still < 0 or opposite + still > 1:
        raise ValueError(f"corrupt_motion needs opposite, still >= 0 with opposite + still <= 1; got {opposite}, {still}")
    shown = copy.deepcopy(metadata)
    for clause in shown["include"]:
        if clause.get("motion") not in DIRECTIONS:
            continue
        u = float(rng.random())
        if u < opposite:
            clause["motion"] = OPPOSITE[clause["motion"]]
        elif u < opposite + still:
            clause["motion"] = "still"
            clause.pop("speed", None)
    return shown
