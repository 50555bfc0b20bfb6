"""Streams of the moving-shapes world: long clips (32-64 frames) whose prompt switches 1-3 times mid-stream.

A streaming video generator makes a long clip block by block and may take a new prompt between blocks. A *stream*
here is such a clip of the moving-shapes world (:mod:`flowgrpo.world.motion`, same renderer, classes, colours,
speeds):

- **the same objects for the whole stream** -- one, or two of different classes and colours -- so class, colour
  and count persist across switches (identity continuity);
- **segments**, each with its own prompt and metadata in the motion world's format (:func:`motion_metadata_for`,
  tags ``motion``, ``two_object_motion``, ``speed``, ``static``) plus its first frame ``start``; a segment runs up
  to the next one's start. Inside a segment every object moves in a straight line at a constant velocity; at a
  switch the objects keep their position and take the motion the new prompt asks (direction, speed, standing
  still). Consecutive segments ask different motions (:func:`rewards.streams.asks_differ`).

Metadata (a JSON-able dict; :func:`rewards.streams.validate_stream_metadata` checks it and names the bad key)::

    {"num_frames": 49, "tag": "one_object_stream",
     "prompt": "a red circle moving left; then a red circle standing still",
     "segments": [{"start": 0, "tag": "motion", "include": [...], "prompt": "a red circle moving left"},
                  {"start": 17, "tag": "static", "include": [...], "prompt": "a red circle standing still"}]}

**Frames and switches.** ``num_frames`` is 4k + 1 (the video VAE compresses 4 frames into one latent frame after
a first frame of its own), 32-64, 49 by default. Latent frame 0 is pixel frame 0 and latent frame ``j >= 1``
pixel frames ``4j - 3 .. 4j``, so a switch that starts a new latent frame starts at a pixel frame ``4m + 1``
(1, 5, 9, ..., 17, ...): the generator places switches there, and every segment is at least 12 frames (3 latent
frames) long. :func:`latent_segments` gives the segment of every latent frame.

**Motion at a switch.** The position of an object in frame ``t`` is its position in frame 0 plus, for every step
``t' - 1 -> t'`` up to ``t``, the velocity of the segment holding frame ``t'``: a segment's frames lie on one line,
and the step into its first frame already moves as it asks.

**Fitting the frame.** At 1-3 px/frame a 49-frame stream travels far more than 64 px if it keeps one direction,
so the generator (:func:`sample_stream_metadata`) keeps only sequences whose every object's path, at the slowest
speeds its prompts allow, spans at most ``max_span`` = 32 px per axis (64 - 2 x (12 + 1) = 38 px would hold the
largest object at exactly those speeds; 6 px are left for faster ones), and, with two objects, where two objects of
radius ``pair_radius`` = 9 px at those speeds can be placed 4 px apart in every frame (a grid search over their
offset). The renderer (:func:`sample_stream_tracks`) then draws an object's radius, then candidate speeds (each
segment's speed uniform in the prompt's range; candidates whose path does not fit are dropped, so long segments
tend to be slower) and a start position for each (uniform among those that keep the path inside), and keeps the
first candidate whose circumcircle stays ``gap`` = 4 px from the objects already placed in every frame, lowering the
largest radius step by step when layouts keep failing -- the clip world's :func:`sample_tracks`, per segment. Two
objects sharing the frame for 49 frames are therefore smaller on average (radius about 7 px, one object about
9). Metadata whose path cannot fit at all raises ``ValueError`` saying which object travels how far along which axis.

**Prompt sets.** :func:`split_stream_prompts` draws distinct prompt *sequences* (a sequence is the list of
segment prompts, whatever its switch frames), seeded, and splits them into disjoint train / held-out sets
(``scripts/make_prompts.py`` writes ``assets/prompts/streams_{train,val,test}.jsonl``).

**Negatives and caption noise.** :func:`perturb_stream` gives the metadata of what a failing stream *shows* --
a wrong direction in one segment, a switch ignored (the old motion kept), a switch taken late, a moving segment
standing still, a wrong speed -- to render with :func:`render_stream`; :func:`draw_stream` draws explicit
:class:`StreamTrack` lists, and :func:`~flowgrpo.world.draw_frames` explicit per-frame shapes (an object that
teleports or changes colour). :func:`corrupt_stream` is pretraining's caption flaw per segment (the clip world's
:func:`corrupt_motion`), and :func:`stream_training_samples` draws (metadata, clip) pairs for pretraining.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np

from rewards.streams import asks_differ, segment_asks, segment_bounds, validate_stream_metadata

from .motion import (
    DIRECTIONS,
    SPEED_RANGES,
    SPEEDS,
    UNIT,
    corrupt_motion,
    draw_frames,
    motion_metadata_for,
    motion_prompt_for,
)
from .render import CLASSES, PALETTE, Shape

__all__ = [
    "MIN_SEGMENT",
    "STREAM_NUM_FRAMES",
    "STREAM_PERTURBATIONS",
    "StreamTrack",
    "corrupt_stream",
    "draw_stream",
    "frame_segments",
    "held_out_sequences",
    "latent_segments",
    "perturb_stream",
    "render_stream",
    "sample_stream_metadata",
    "sample_stream_tracks",
    "sequence_key",
    "split_stream_prompts",
    "more_held_out_streams",
    "one_object_held_out",
    "stream_fits",
    "stream_metadata_for",
    "stream_training_samples",
]

STREAM_NUM_FRAMES = 49  # 4 x 12 + 1: what the video VAE takes; 12 latent frames after the first
FRAME_RANGE = (32, 64)  # num_frames the generator accepts (4k + 1 inside)
MIN_SEGMENT = 12  # frames (3 latent frames)
TEMPORAL_COMPRESSION = 4  # pixel frames per latent frame (after the first)
MAX_SPAN = 32.0  # px per axis at the slowest speeds: 64 - 2 x (12 + 1) = 38 holds the largest object, less 6 px
PAIR_RADIUS = 9.0  # px: two objects of this radius must fit together at their slowest speeds (the middle of 6-12)
STREAM_PERTURBATIONS: tuple[str, ...] = ("direction", "ignore_switch", "late", "still", "speed")
# segment tags of a one-object stream and their shares in the generator
ONE_OBJECT_TAGS: tuple[tuple[str, float], ...] = (("motion", 0.4), ("speed", 0.35), ("static", 0.25))


# ---------------------------------------------------------------------------------------------- metadata
def stream_metadata_for(segments: Sequence[dict], starts: Sequence[int], num_frames: int = STREAM_NUM_FRAMES,
                        require_switches: bool = True) -> dict:
    """Stream metadata from motion metadata dicts (:func:`motion_metadata_for`) and their start frames; validated
    (``ValueError`` naming the key)."""
    if len(segments) != len(starts):
        raise ValueError(f"got {len(segments)} segments but {len(starts)} start frames")
    segs = [{"start": int(s)} | copy.deepcopy(dict(m)) for s, m in zip(starts, segments)]
    n = len(segs[0]["include"]) if segs and segs[0].get("include") else 0
    meta = {"num_frames": int(num_frames), "tag": "two_object_stream" if n == 2 else "one_object_stream",
            "segments": segs, "prompt": "; then ".join(str(s.get("prompt")) for s in segs)}
    return validate_stream_metadata(meta, CLASSES, tuple(PALETTE), require_switches=require_switches)


def frame_segments(metadata: dict) -> list[int]:
    """The segment index of every pixel frame of a stream."""
    out: list[int] = []
    for k, (start, end) in enumerate(segment_bounds(metadata)):
        out += [k] * (end - start)
    return out


def latent_segments(metadata: dict, compression: int = TEMPORAL_COMPRESSION) -> list[int]:
    """The segment index of every latent frame (latent 0 = pixel frame 0, latent ``j >= 1`` = pixel frames
    ``c(j-1)+1 .. cj``). Raises ``ValueError`` naming ``num_frames`` when it is not ``c k + 1``, or the segment
    whose start splits a latent frame."""
    T = int(metadata["num_frames"])
    if (T - 1) % compression:
        raise ValueError(f"metadata.num_frames={T} is not {compression}k + 1: its frames do not fill latent frames")
    for k, seg in enumerate(metadata["segments"][1:], 1):
        if (int(seg["start"]) - 1) % compression:
            raise ValueError(f"metadata.segments[{k}].start={seg['start']} splits a latent frame; a switch starts "
                             f"at a pixel frame {compression}m + 1")
    per_frame = frame_segments(metadata)
    return [per_frame[0]] + [per_frame[compression * (j - 1) + 1] for j in range(1, (T - 1) // compression + 1)]


def sequence_key(metadata: dict) -> tuple[str, ...]:
    """A stream's prompt sequence (its segments' prompts, whatever the switch frames): what the splits compare."""
    return tuple(s["prompt"] for s in metadata["segments"])


def _speed_range(motion: str, speed: str | None) -> tuple[float, float]:
    return (0.0, 0.0) if motion == "still" else SPEED_RANGES[speed]


def _steps(metadata: dict) -> list[int]:
    """Steps ``t - 1 -> t`` that move with each segment's velocity (module doc)."""
    return [end - max(start, 1) for start, end in segment_bounds(metadata)]


def _min_spans(metadata: dict) -> list[tuple[float, float]]:
    """Per object, the path's extent per axis (px at 64 px) at the slowest speeds its segments allow."""
    steps = _steps(metadata)
    out = []
    for j in range(len(metadata["segments"][0]["include"])):
        pos = [np.zeros(2)]
        for n, seg in zip(steps, metadata["segments"]):
            motion, speed = segment_asks(seg)[j]
            pos.append(pos[-1] + n * _speed_range(motion, speed)[0] * np.asarray(UNIT[motion]))
        pos = np.array(pos)
        out.append(tuple(float(v) for v in pos.max(0) - pos.min(0)))
    return out


def _min_paths(metadata: dict) -> list[np.ndarray]:
    """Per object, its offsets ``[T, 2]`` from frame 0 (px at 64 px) at the slowest speeds its prompts allow."""
    segments = metadata["segments"]
    segment_of_step = np.array(frame_segments(metadata)[1:], dtype=int)
    out = []
    for j in range(len(segments[0]["include"])):
        asks = [segment_asks(s)[j] for s in segments]
        speeds = np.array([[_speed_range(m, s)[0] for m, s in asks]])
        out.append(_paths(speeds, np.array([UNIT[m] for m, _ in asks], dtype=float), segment_of_step)[0])
    return out


def _pair_fits(metadata: dict, r: float, gap: float = 4.0, margin: float = 1.0, size: float = 64.0) -> bool:
    """Whether two objects of radius ``r`` at their slowest speeds can be placed inside the frame and ``gap``
    apart in every frame (grid search, 1 px, over the offset between their start positions)."""
    a, b = _min_paths(metadata)
    boxes = []
    for path in (a, b):
        lo, hi = r + margin - path.min(axis=0), size - r - margin - path.max(axis=0)
        if (lo > hi).any():
            return False
        boxes.append((lo, hi))
    (lo_a, hi_a), (lo_b, hi_b) = boxes
    gx = np.arange(lo_b[0] - hi_a[0], hi_b[0] - lo_a[0] + 1e-9, 1.0)
    gy = np.arange(lo_b[1] - hi_a[1], hi_b[1] - lo_a[1] + 1e-9, 1.0)
    d0 = np.stack(np.meshgrid(gx, gy), axis=-1).reshape(-1, 1, 2)  # [G, 1, 2]
    return bool((np.linalg.norm(d0 + (b - a)[None], axis=2).min(axis=1) >= 2 * r + gap).any())


def stream_fits(metadata: dict, radius: tuple[float, float] = (6.0, 12.0), margin: float = 1.0) -> bool:
    """Whether every object's path fits in a 64-px frame at the slowest speeds its prompts allow, for the smallest
    radius (then a path fits; :func:`sample_stream_tracks` finds a layout by sampling)."""
    room = 64.0 - 2 * (radius[0] + margin)
    return all(max(span) <= room + 1e-9 for span in _min_spans(metadata))


def _sample_segment(rng: np.random.Generator, classes: tuple[str, ...], colors: tuple[str, ...]) -> dict:
    if len(classes) == 2:
        dirs = tuple(DIRECTIONS[int(i)] for i in rng.integers(len(DIRECTIONS), size=2))
        return motion_metadata_for("two_object_motion", classes, colors, dirs)
    tags, shares = zip(*ONE_OBJECT_TAGS)
    tag = tags[int(rng.choice(len(tags), p=np.asarray(shares) / sum(shares)))]
    direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    if tag == "static":
        return motion_metadata_for("static", classes, colors, "still")
    if tag == "speed":
        return motion_metadata_for("speed", classes, colors, direction, speed=SPEEDS[int(rng.integers(len(SPEEDS)))])
    return motion_metadata_for("motion", classes, colors, direction)


def _switch_layouts(num_frames: int, switches: int, min_segment: int) -> list[tuple[int, ...]]:
    """Every choice of ``switches`` start frames at latent boundaries leaving segments of ``>= min_segment``."""
    candidates = range(1, num_frames, TEMPORAL_COMPRESSION)
    out = []
    for combo in itertools.combinations(candidates, switches):
        edges = (0, *combo, num_frames)
        if all(b - a >= min_segment for a, b in zip(edges, edges[1:])):
            out.append(combo)
    return out


def sample_stream_metadata(
    rng: np.random.Generator | int | None = None,
    num_frames: int = STREAM_NUM_FRAMES,
    *,
    objects: int | None = None,
    switches: int | None = None,
    min_segment: int = MIN_SEGMENT,
    max_span: float = MAX_SPAN,
    pair_radius: float = PAIR_RADIUS,
    tries: int = 2000,
) -> dict:
    """One random stream's metadata (module doc), seeded by ``rng``.

    Args:
        num_frames: 4k + 1 in [32, 64].
        objects: 1 or 2 (random, even odds, when None): the same objects for the whole stream; two objects have
            different classes and colours (the ``two_object_motion`` prompts).
        switches: 1-3 (random among those the frame count allows when None).
        min_segment: shortest segment in frames; switches start at pixel frames ``4m + 1``.
        max_span: largest extent (px per axis) of an object's path at the slowest speeds of its prompts.
        pair_radius: two objects must fit, at their slowest speeds, with this radius (px) each, inside the frame
            and 4 px apart in every frame.

    One-object segments are ``motion`` / ``speed`` / ``static`` prompts (shares 0.4 / 0.35 / 0.25), two-object
    segments ``two_object_motion``; each differs from the one before (:func:`rewards.streams.asks_differ`);
    sequences whose path does not fit ``max_span`` are drawn again.
    """
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    lo, hi = FRAME_RANGE
    if not lo <= num_frames <= hi or (num_frames - 1) % TEMPORAL_COMPRESSION:
        raise ValueError(f"num_frames={num_frames}: a stream has 4k + 1 frames in [{lo}, {hi}] (33, 37, ..., 61)")
    layouts = {k: _switch_layouts(num_frames, k, min_segment) for k in (1, 2, 3)}
    allowed = [k for k, found in layouts.items() if found]
    if switches is not None and switches not in allowed:
        raise ValueError(f"switches={switches}: {num_frames} frames with segments of >= {min_segment} frames allow "
                         f"{allowed or 'no'} switches")
    if not allowed:
        raise ValueError(f"min_segment={min_segment}: {num_frames} frames hold no switch with segments that long")
    if objects is None:
        objects = int(rng.integers(1, 3))
    if objects not in (1, 2):
        raise ValueError(f"objects={objects}: a stream has 1 or 2 objects")
    picks = rng.choice(len(CLASSES), objects, replace=False), rng.choice(len(PALETTE), objects, replace=False)
    classes = tuple(CLASSES[int(i)] for i in picks[0])
    colors = tuple(tuple(PALETTE)[int(i)] for i in picks[1])
    for _ in range(tries):
        k = switches if switches is not None else allowed[int(rng.integers(len(allowed)))]
        starts = (0, *layouts[k][int(rng.integers(len(layouts[k])))])
        segments = [_sample_segment(rng, classes, colors)]
        while len(segments) < len(starts):
            seg = _sample_segment(rng, classes, colors)
            if asks_differ(segment_asks(segments[-1]), segment_asks(seg)):
                segments.append(seg)
        meta = stream_metadata_for(segments, starts, num_frames)
        if all(max(span) <= max_span for span in _min_spans(meta)) and (objects == 1 or _pair_fits(meta, pair_radius)):
            return meta
    raise RuntimeError(f"no stream of {num_frames} frames fits max_span={max_span} px in {tries} tries")


def _words(metadata: dict) -> set[tuple[str, object]]:
    words: set[tuple[str, object]] = set()
    for seg in metadata["segments"]:
        for c in seg["include"]:
            words |= {("class", c["class"]), ("color", c["color"]), ("motion", c["motion"])}
            if "speed" in c:
                words.add(("speed", c["speed"]))
        words.add(("tag", seg["tag"]))
    words.add(("switches", len(metadata["segments"]) - 1))
    return words


def split_stream_prompts(seed: int = 0, n_train: int = 300, n_test: int = 100,
                         num_frames: int = STREAM_NUM_FRAMES) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) stream prompt sets, seeded: ``n_train + n_test`` streams of distinct prompt
    sequences (:func:`sample_stream_metadata`), split at random; no sequence of segment prompts is in both, and
    the train set holds every class, colour, motion, speed, segment tag and number of switches. Each list is in
    generation order."""
    rng = np.random.default_rng(seed)
    rows = _distinct_streams(rng, n_train + n_test, num_frames, set())
    required = set().union(*(_words(m) for m in rows))
    for _ in range(1000):
        order = rng.permutation(len(rows))
        if set().union(*(_words(rows[i]) for i in order[n_test:])) == required:
            break
    else:
        raise RuntimeError("no split whose train part holds every word")
    test = sorted(order[:n_test].tolist())
    train = sorted(order[n_test:].tolist())
    return [rows[i] for i in train], [rows[i] for i in test]


def one_object_held_out(n: int = 100, seed: int = 1, exclude: Sequence[dict] = (),
                        num_frames: int = STREAM_NUM_FRAMES) -> list[dict]:
    """``n`` one-object streams of distinct prompt sequences, seeded, none of whose sequence is in ``exclude``
    (e.g. both parts of :func:`split_stream_prompts`): a held-out set of streams the training split does not hold,
    in generation order. Switches 1-3 as :func:`sample_stream_metadata` draws them."""
    return more_held_out_streams(n, seed, exclude, num_frames, objects=1)


def more_held_out_streams(n: int, seed: int, exclude: Sequence[dict], num_frames: int = STREAM_NUM_FRAMES,
                          **kwargs) -> list[dict]:
    """``n`` streams (:func:`sample_stream_metadata` with ``kwargs``, e.g. ``objects=1``) of distinct prompt
    sequences, seeded, none of whose sequence is in ``exclude``: another held-out set (a test set beside the
    validation set), in generation order."""
    return _distinct_streams(np.random.default_rng(seed), n, num_frames, {sequence_key(m) for m in exclude}, **kwargs)


def _distinct_streams(rng: np.random.Generator, n: int, num_frames: int, seen: set, sample=None,
                      **kwargs) -> list[dict]:
    """``n`` streams (``sample``, :func:`sample_stream_metadata` by default, with ``kwargs``) whose prompt sequences
    differ from each other and from ``seen`` (which gains theirs), in generation order; ``RuntimeError`` after
    ``100 n`` draws."""
    sample = sample or sample_stream_metadata
    rows: list[dict] = []
    for _ in range(100 * n):
        if len(rows) == n:
            return rows
        meta = sample(rng, num_frames, **kwargs)
        if sequence_key(meta) not in seen:
            seen.add(sequence_key(meta))
            rows.append(meta)
    if len(rows) == n:
        return rows
    raise RuntimeError(f"could not draw {n} distinct stream prompt sequences ({kwargs or 'any objects'}) outside "
                       f"the {len(seen) - len(rows)} already taken")


# ---------------------------------------------------------------------------------------------- renderer
@dataclass(frozen=True)
class StreamTrack:
    """One object of a stream: its shape in frame 0, its velocity ``(vx, vy)`` (px/frame) in each segment and the
    segments' start frames (``starts[0] == 0``). The step into frame ``t`` moves with the velocity of the segment
    holding ``t`` (module doc). Give ``starts`` other than the metadata's to draw a switch taken early or late."""

    shape: Shape
    velocities: tuple[tuple[float, float], ...]
    starts: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.velocities) != len(self.starts) or not self.starts or self.starts[0] != 0:
            raise ValueError(f"StreamTrack needs one velocity per segment and starts[0] == 0, got "
                             f"{len(self.velocities)} velocities, starts {self.starts}")

    def velocity(self, frame: int) -> tuple[float, float]:
        """The velocity of the step ``frame - 1 -> frame``."""
        k = int(np.searchsorted(self.starts, frame, side="right")) - 1
        return self.velocities[k]

    def offset(self, frame: int) -> tuple[float, float]:
        dx = dy = 0.0
        edges = (*self.starts[1:], math.inf)
        for (vx, vy), start, end in zip(self.velocities, self.starts, edges):
            n = max(0, min(frame, end - 1) - max(start, 1) + 1)
            dx, dy = dx + n * vx, dy + n * vy
        return dx, dy

    def at(self, frame: int) -> Shape:
        dx, dy = self.offset(frame)
        return replace(self.shape, cx=self.shape.cx + dx, cy=self.shape.cy + dy)


def _paths(speeds: np.ndarray, units: np.ndarray, segment_of_step: np.ndarray) -> np.ndarray:
    """Offsets ``[N, T, 2]`` of ``N`` candidate speed vectors ``[N, S]`` (per segment), directions ``[S, 2]``."""
    v = speeds[:, :, None] * units[None]  # [N, S, 2]
    steps = v[:, segment_of_step]  # [N, T-1, 2]
    return np.concatenate([np.zeros((len(speeds), 1, 2)), np.cumsum(steps, axis=1)], axis=1)


def sample_stream_tracks(
    metadata: dict,
    rng: np.random.Generator | int | None = None,
    size: int = 64,
    radius: tuple[float, float] = (6.0, 12.0),
    gap: float = 4.0,
    max_restarts: int = 300,
    candidates: int = 256,
) -> list[StreamTrack]:
    """A random layout of a stream satisfying ``metadata`` (module doc): one :class:`StreamTrack` per object in
    clause order, inside the frame and ``gap`` apart in every frame.

    ``metadata`` may ask the same motion in consecutive segments (what a negative or corrupted stream shows).
    Raises ``ValueError`` when a path cannot fit even at the slowest speeds, ``RuntimeError`` when no layout was
    found in ``max_restarts`` attempts (the largest radius shrinks to the smallest along the way)."""
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    meta = validate_stream_metadata(metadata, CLASSES, tuple(PALETTE), require_switches=False)
    T = int(meta["num_frames"])
    segments = meta["segments"]
    starts = tuple(int(s["start"]) for s in segments)
    scale = size / 64.0
    r_min, r_max, margin, gap = radius[0] * scale, radius[1] * scale, 1.0 * scale, gap * scale
    room = size - 2 * (r_min + margin)
    for j, span in enumerate(_min_spans(meta)):
        axis = int(np.argmax(span))
        if span[axis] * scale > room + 1e-9:
            c = segments[0]["include"][j]
            raise ValueError(f"metadata.segments[*].include[{j}] ({c['color']} {c['class']}): at the slowest speeds "
                             f"its segments allow the path spans {span[axis] * scale:.1f} px along {'xy'[axis]}, but a "
                             f"{size}-px frame leaves {room:.1f} px; make its segments shorter or turn it back")
    segment_of_step = np.array(frame_segments(meta)[1:], dtype=int)
    objects = []
    for j, clause in enumerate(segments[0]["include"]):
        asks = [segment_asks(s)[j] for s in segments]
        ranges = np.array([_speed_range(m, s) for m, s in asks]) * scale
        units = np.array([UNIT[m] for m, _ in asks], dtype=float)
        objects.append((clause["class"], clause["color"], ranges, units))
    for attempt in range(max_restarts):
        hi = max(r_min, r_max - (r_max - r_min) * min(1.0, attempt / (0.5 * max_restarts)))
        placed: list[tuple[StreamTrack, np.ndarray]] = []
        for cls, colour, ranges, units in objects:
            for _ in range(20):
                # candidates at once: radius, speeds (those whose path fits), a start position for each
                r = float(rng.uniform(r_min, hi))
                speeds = rng.uniform(ranges[:, 0], ranges[:, 1], size=(candidates, len(ranges)))
                paths = _paths(speeds, units, segment_of_step)
                keep = ((paths.max(axis=1) - paths.min(axis=1)) <= size - 2 * (r + margin)).all(axis=1)
                if not keep.any():
                    continue
                speeds, paths = speeds[keep], paths[keep]
                lo = r + margin - paths.min(axis=1)  # [M, 2]
                hi_ = size - r - margin - paths.max(axis=1)
                centres = rng.uniform(lo, hi_)[:, None, :] + paths  # [M, T, 2]
                ok = np.ones(len(centres), dtype=bool)
                for track, other in placed:
                    ok &= (np.linalg.norm(centres - other[None], axis=2) >= r + track.shape.r + gap).all(axis=1)
                if not ok.any():
                    continue
                i = int(np.argmax(ok))
                velocities = tuple((float(s * u[0]), float(s * u[1])) for s, u in zip(speeds[i], units))
                shape = Shape(cls, colour, float(centres[i, 0, 0]), float(centres[i, 0, 1]), r)
                placed.append((StreamTrack(shape, velocities, starts), centres[i]))
                break
            else:
                break
        else:
            return [track for track, _ in placed]
    raise RuntimeError(f"could not lay out stream {meta['prompt']!r} ({T} frames) in {max_restarts} attempts")


def draw_stream(tracks: Sequence[StreamTrack], num_frames: int, size: int = 64, supersample: int = 4) -> np.ndarray:
    """Draw stream tracks over ``num_frames`` frames: uint8 ``[num_frames, size, size, 3]``."""
    return draw_frames([[t.at(f) for t in tracks] for f in range(num_frames)], size=size, supersample=supersample)


def render_stream(
    metadata: dict,
    seed: int | None = None,
    rng: np.random.Generator | None = None,
    size: int = 64,
    supersample: int = 4,
    **track_kwargs,
) -> np.ndarray:
    """A random stream for ``metadata``: uint8 ``[num_frames, size, size, 3]``, seeded by ``seed`` or ``rng``."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    tracks = sample_stream_tracks(metadata, rng, size=size, **track_kwargs)
    return draw_stream(tracks, int(metadata["num_frames"]), size=size, supersample=supersample)


# ---------------------------------------------------------------------------------------- negatives, caption noise
def _retag(meta: dict) -> dict:
    for seg in meta["segments"]:
        seg["prompt"] = motion_prompt_for(seg)
    meta["prompt"] = "; then ".join(s["prompt"] for s in meta["segments"])
    return meta


def perturb_stream(metadata: dict, kind: str, rng: np.random.Generator | int | None = None,
                   delay: int = 8) -> dict | None:
    """Metadata of what a stream failing ``metadata`` in one way shows, or ``None`` if ``kind`` does not apply
    (or its path could not fit: :func:`stream_fits`). Prompts are rewritten to describe the shown stream; render
    it with :func:`render_stream` and judge it against ``metadata``.

    ``direction`` (one object of one segment moves another way: opposite or perpendicular), ``ignore_switch`` (a
    segment keeps the motion of the one before), ``late`` (a switch taken ``delay`` frames late; the segment
    keeps at least 2 frames), ``still`` (a moving object of one segment stands still), ``speed`` (slowly <->
    quickly in one segment)."""
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    meta = copy.deepcopy(metadata)
    segs = meta["segments"]

    def pick(items):
        return items[int(rng.integers(len(items)))] if items else None

    clauses = [(k, c) for k, s in enumerate(segs) for c in s["include"]]
    if kind == "direction":
        found = pick([(k, c) for k, c in clauses if c["motion"] in DIRECTIONS])
        if found is None:
            return None
        found[1]["motion"] = pick([d for d in DIRECTIONS if d != found[1]["motion"]])
    elif kind == "ignore_switch":
        k = pick(list(range(1, len(segs))))
        if k is None:
            return None
        kept = {key: copy.deepcopy(value) for key, value in segs[k - 1].items() if key != "start"}
        segs[k] = {"start": segs[k]["start"]} | kept
    elif kind == "late":
        bounds = segment_bounds(meta)
        k = pick([k for k in range(1, len(segs)) if bounds[k][1] - bounds[k][0] - delay >= 2])
        if k is None:
            return None
        segs[k]["start"] += int(delay)
    elif kind == "still":
        found = pick([(k, c) for k, c in clauses if c["motion"] in DIRECTIONS])
        if found is None:
            return None
        found[1]["motion"] = "still"
        found[1].pop("speed", None)
        if segs[found[0]]["tag"] in ("motion", "speed"):
            segs[found[0]]["tag"] = "static"
    elif kind == "speed":
        found = pick([(k, c) for k, c in clauses if c.get("speed") in SPEEDS])
        if found is None:
            return None
        found[1]["speed"] = "quickly" if found[1]["speed"] == "slowly" else "slowly"
    else:
        raise ValueError(f"unknown perturbation {kind!r}; expected one of {STREAM_PERTURBATIONS}")
    meta = _retag(meta)
    validate_stream_metadata(meta, CLASSES, tuple(PALETTE), require_switches=False)
    return meta if stream_fits(meta) else None


def corrupt_stream(metadata: dict, rng: np.random.Generator, opposite: float, still: float) -> dict:
    """What a mislabelled training stream shows for a caption (``metadata``): :func:`corrupt_motion` on every
    segment -- per object of a segment that names a direction, with probability ``opposite`` it moves the
    opposite way and with probability ``still`` it does not move. Returns the metadata to *render* (prompts are
    the caption's); consecutive segments may then show the same motion, and the path may no longer fit
    (:func:`stream_fits`).

    A resumed segment (``"resume": true``, told only to move "again" after a pause: :mod:`flowgrpo.world.resume`)
    starts from the motion *shown* before its pause, what a model can see, then takes its own flaw."""
    shown = copy.deepcopy(metadata)
    segments: list[dict] = []
    for seg in metadata["segments"]:
        if seg.get("resume"):
            seg = {k: v for k, v in seg.items() if k != "resume"}
            moved = [s for s in segments if any(c.get("motion") != "still" for c in s["include"])]
            if moved:  # the last motion shown before the pause (the caption's speed word kept)
                seg["include"] = [c | {"motion": m["motion"]} for c, m in zip(seg["include"], moved[-1]["include"])]
        segments.append({"start": seg["start"]} | corrupt_motion(seg, rng, opposite, still))
    shown["segments"] = segments
    return shown


@functools.lru_cache(maxsize=1)
def held_out_sequences() -> frozenset[tuple[str, ...]]:
    """The prompt sequences of the held-out split (seed 0), which pretraining never shows."""
    return frozenset(sequence_key(m) for m in split_stream_prompts()[1])


def stream_training_samples(
    n: int | None,
    seed: int,
    *,
    pool: Sequence[dict] | None = None,
    num_frames: int = STREAM_NUM_FRAMES,
    opposite: float = 0.0,
    still: float = 0.0,
    size: int = 64,
    supersample: int = 4,
    tries: int = 100,
) -> Iterator[tuple[dict, np.ndarray]]:
    """``n`` (forever when None) pretraining samples ``(metadata, clip)``: the caption's stream metadata and a
    uint8 ``[num_frames, size, size, 3]`` clip, seeded by ``seed``.

    Captions are drawn uniformly from ``pool`` when given, else fresh from :func:`sample_stream_metadata`
    (``num_frames`` frames) leaving out every prompt sequence of the held-out set (:func:`split_stream_prompts`).
    With ``opposite`` / ``still`` > 0 the clip shows :func:`corrupt_stream` of its caption (the caption flaw of
    the clip world's pretraining); a corruption whose path cannot fit is drawn again (up to ``tries`` times,
    then the clean stream is shown), so the realised share of corrupted objects is a little below the asked one.
    """
    if opposite < 0 or still < 0 or opposite + still > 1:
        raise ValueError(f"stream_training_samples needs opposite, still >= 0 with opposite + still <= 1; got "
                         f"{opposite}, {still}")
    rng = np.random.default_rng(seed)
    held_out = set() if pool is not None else held_out_sequences()
    if pool is not None and len(pool) == 0:
        raise ValueError("stream_training_samples: pool is empty")
    made = 0
    while n is None or made < n:
        if pool is not None:
            meta = copy.deepcopy(pool[int(rng.integers(len(pool)))])
        else:
            meta = sample_stream_metadata(rng, num_frames)
            while sequence_key(meta) in held_out:
                meta = sample_stream_metadata(rng, num_frames)
        shown = meta
        if opposite or still:
            for _ in range(tries):
                candidate = corrupt_stream(meta, rng, opposite, still)
                if stream_fits(candidate):
                    shown = candidate
                    break
        yield meta, render_stream(shown, rng=rng, size=size, supersample=supersample)
        made += 1
