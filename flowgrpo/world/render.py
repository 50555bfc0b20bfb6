"""Renderer of the shapes world, exactly to the specification below.

- Canvas ``size`` x ``size`` RGB (64 by default), background white (255, 255, 255).
- Classes ``circle``, ``square`` (axis-aligned), ``triangle`` (upright, equilateral: apex up, base down).
- Size: circumradius 6-12 px at 64 px (scaled with ``size / 64`` for other sizes).
- Objects never overlap: circumcircles are at least ``gap`` px apart (4 px by default, so that even a
  blurred or generated image keeps them separate), and lie inside the canvas.
- Colours: the six GenEval names with the RGB values of :data:`PALETTE`; interiors carry the exact RGB.
- **Anti-aliased**: every pixel is the white background blended with the shape colour by the shape's
  coverage of that pixel, estimated on a ``supersample`` x ``supersample`` grid (4 x 4 by default). Edge
  pixels are therefore mixtures of the exact colour and white; set ``supersample=1`` for hard edges.

Coordinates are continuous with pixel ``(row i, column j)`` covering ``[j, j+1] x [i, i+1]``; ``y`` grows
downwards, as in GenEval's position rule.

A scene is drawn from a GenEval metadata dict (see :mod:`flowgrpo.world.prompts`): every include clause
contributes ``count`` objects of its ``class``, coloured ``color`` if the clause names one and a random
palette colour otherwise; a ``position`` clause ``[relation, target]`` places each of its objects in that
relation to every object of clause ``target``, measured with GenEval's own rule on the exact geometric
boxes and with a safety margin (the direction component along the relation >= 0.7 and across it
<= 0.3, against GenEval's 0.5), so that the relation survives blur and is exclusive: a scene drawn for
"above" is never also "left of". Because the renderer accepts any metadata, it draws negatives as
well: perturb a metadata dict (:func:`flowgrpo.world.perturb`) and render the perturbed one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from rewards.geneval.rules import position_direction
from rewards.geneval.shapes import CLASSES, PALETTE  # one definition of the world's spec (flowgrpo -> rewards)

__all__ = ["BACKGROUND", "CLASSES", "PALETTE", "Shape", "draw", "render", "render_array", "sample_scene", "shape_box"]

BACKGROUND: tuple[int, int, int] = (255, 255, 255)

_SQRT3 = math.sqrt(3.0)
# Safety margins on GenEval's direction components (its own thresholds are +-0.5).
_ALONG_MIN = 0.7
_ACROSS_MAX = 0.3
_RELATION_AXIS = {"left of": (0, -1.0), "right of": (0, 1.0), "above": (1, -1.0), "below": (1, 1.0)}


@dataclass(frozen=True)
class Shape:
    """One object: its class, colour name, circumcentre ``(cx, cy)`` and circumradius ``r`` in pixels."""

    cls: str
    color: str
    cx: float
    cy: float
    r: float


def shape_box(shape: Shape) -> tuple[float, float, float, float]:
    """Exact geometric bounding box ``(x1, y1, x2, y2)`` of a shape."""
    cx, cy, r = shape.cx, shape.cy, shape.r
    if shape.cls == "circle":
        return (cx - r, cy - r, cx + r, cy + r)
    if shape.cls == "square":
        h = r / math.sqrt(2.0)
        return (cx - h, cy - h, cx + h, cy + h)
    if shape.cls == "triangle":
        w = r * _SQRT3 / 2.0
        return (cx - w, cy - r, cx + w, cy + r / 2.0)
    raise ValueError(f"unknown shape class {shape.cls!r}; expected one of {CLASSES}")


def _inside(cls: str, x: np.ndarray, y: np.ndarray, cx: float, cy: float, r: float) -> np.ndarray:
    if cls == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    if cls == "square":
        h = r / math.sqrt(2.0)
        return (np.abs(x - cx) <= h) & (np.abs(y - cy) <= h)
    if cls == "triangle":
        # Upright equilateral triangle: apex (cx, cy - r), base at y = cy + r/2; the half-width grows
        # linearly from the apex with slope tan(30 deg) = 1/sqrt(3).
        return (y >= cy - r) & (y <= cy + r / 2.0) & (np.abs(x - cx) <= (y - cy + r) / _SQRT3)
    raise ValueError(f"unknown shape class {cls!r}; expected one of {CLASSES}")


def draw(shapes: list[Shape], size: int = 64, supersample: int = 4) -> np.ndarray:
    """Draw shapes on a white canvas; returns uint8 ``[size, size, 3]`` (anti-aliased, see module doc)."""
    canvas = np.full((size, size, 3), 255.0, dtype=np.float64)
    s = int(supersample)
    offsets = (np.arange(s) + 0.5) / s
    for shape in shapes:
        if shape.color not in PALETTE:
            raise ValueError(f"unknown colour {shape.color!r}; expected one of {tuple(PALETTE)}")
        x1, y1, x2, y2 = shape_box(shape)
        j0, j1 = max(int(math.floor(x1)), 0), min(int(math.ceil(x2)), size)
        i0, i1 = max(int(math.floor(y1)), 0), min(int(math.ceil(y2)), size)
        if j1 <= j0 or i1 <= i0:
            continue
        xs = (np.arange(j0, j1)[:, None] + offsets[None, :]).reshape(-1)  # [(j1-j0)*s]
        ys = (np.arange(i0, i1)[:, None] + offsets[None, :]).reshape(-1)
        inside = _inside(shape.cls, xs[None, :], ys[:, None], shape.cx, shape.cy, shape.r)
        cover = inside.reshape(i1 - i0, s, j1 - j0, s).mean(axis=(1, 3))[..., None]
        colour = np.asarray(PALETTE[shape.color], dtype=np.float64)
        patch = canvas[i0:i1, j0:j1]
        canvas[i0:i1, j0:j1] = patch * (1.0 - cover) + colour * cover
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


def _relation_ok(shape: Shape, target: Shape, relation: str) -> bool:
    if relation not in _RELATION_AXIS:
        raise ValueError(f"unknown relation {relation!r}; expected one of {tuple(_RELATION_AXIS)}")
    direction = position_direction(shape_box(shape), shape_box(target))
    if direction is None:
        return False
    axis, sign = _RELATION_AXIS[relation]
    along, across = sign * direction[axis], direction[1 - axis]
    return along >= _ALONG_MIN and abs(across) <= _ACROSS_MAX


def _objects_of(metadata: dict, rng: np.random.Generator) -> list[tuple[int, str, str]]:
    """(clause index, class, colour) per object to draw."""
    include = metadata.get("include")
    if not isinstance(include, list) or not include:
        raise ValueError("metadata field 'include' must be a non-empty list of clauses")
    colours = tuple(PALETTE)
    objects = []
    for index, clause in enumerate(include):
        cls = clause.get("class")
        if cls not in CLASSES:
            raise ValueError(f"metadata field 'include[{index}].class' is {cls!r}; expected one of {CLASSES}")
        count = clause.get("count", 1)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"metadata field 'include[{index}].count' must be a positive int, got {count!r}")
        colour = clause.get("color")
        if colour is not None and colour not in PALETTE:
            raise ValueError(f"metadata field 'include[{index}].color' is {colour!r}; expected one of {colours}")
        position = clause.get("position")
        if position is not None and not (0 <= int(position[1]) < index):
            raise ValueError(
                f"metadata field 'include[{index}].position' targets clause {position[1]}, which is not an earlier clause"
            )
        for _ in range(count):
            objects.append((index, cls, colour if colour is not None else colours[rng.integers(len(colours))]))
    for clause in metadata.get("exclude", []) or []:
        drawn = sum(1 for _, cls, _ in objects if cls == clause["class"])
        if drawn >= clause["count"]:
            raise ValueError(
                f"metadata is contradictory: include clauses draw {drawn} {clause['class']}(s) but an exclude clause "
                f"forbids {clause['count']} or more"
            )
    return objects


def sample_scene(
    metadata: dict,
    rng: np.random.Generator | int | None = None,
    size: int = 64,
    radius: tuple[float, float] = (6.0, 12.0),
    gap: float = 4.0,
    max_restarts: int = 200,
) -> list[Shape]:
    """Random layout satisfying ``metadata`` (classes, counts, colours, positions; see module doc).

    ``radius`` is the circumradius range at 64 px; it is scaled by ``size / 64``. If a layout cannot be
    found, the largest radius is lowered step by step (crowded scenes such as four objects); a
    ``RuntimeError`` is raised only if even the smallest radii do not fit.
    """
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    include = metadata.get("include") or []
    objects = _objects_of(metadata, rng)
    scale = size / 64.0
    r_min, r_max = radius[0] * scale, radius[1] * scale
    margin = 1.0 * scale
    gap = gap * scale
    for attempt in range(max_restarts):
        # Shrink the largest radius gradually when layouts keep failing.
        hi = max(r_min, r_max - (r_max - r_min) * min(1.0, attempt / (0.5 * max_restarts)))
        placed: list[tuple[int, Shape]] = []
        for clause_index, cls, colour in objects:
            position = include[clause_index].get("position")
            targets = [s for i, s in placed if position is not None and i == int(position[1])]
            for _ in range(100):
                r = float(rng.uniform(r_min, hi))
                cx = float(rng.uniform(r + margin, size - r - margin))
                cy = float(rng.uniform(r + margin, size - r - margin))
                shape = Shape(cls, colour, cx, cy, r)
                if any(math.hypot(cx - s.cx, cy - s.cy) < r + s.r + gap for _, s in placed):
                    continue
                if position is not None and not all(_relation_ok(shape, t, position[0]) for t in targets):
                    continue
                placed.append((clause_index, shape))
                break
            else:
                break
        else:
            return [s for _, s in placed]
    raise RuntimeError(f"could not lay out a scene for metadata {metadata!r} in {max_restarts} attempts")


def render_array(
    metadata: dict,
    seed: int | None = None,
    rng: np.random.Generator | None = None,
    size: int = 64,
    supersample: int = 4,
    **scene_kwargs,
) -> np.ndarray:
    """Draw a random scene for ``metadata``: uint8 ``[size, size, 3]``. Seeded by ``seed`` or ``rng``."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    return draw(sample_scene(metadata, rng, size=size, **scene_kwargs), size=size, supersample=supersample)


def render(
    metadata: dict, seed: int | None = None, rng: np.random.Generator | None = None, size: int = 64, **kwargs
) -> Image.Image:
    """Like :func:`render_array`, as a PIL RGB image."""
    return Image.fromarray(render_array(metadata, seed=seed, rng=rng, size=size, **kwargs))
