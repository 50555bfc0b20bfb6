"""The ``long_video`` reward: long streaming clips of the moving-shapes world whose prompt switches mid-stream.

A *stream* is one long clip (32-64 frames) of the same objects -- one, or two of different classes and colours --
whose prompt changes 1-3 times: at a switch the objects keep their place and change their motion (direction, speed,
or standing still) to what the new segment's prompt says. Its metadata is a JSON dict (the generator, renderer and
prompt files are :mod:`flowgrpo.world.streams`)::

    {"num_frames": 49, "tag": "one_object_stream", "prompt": "a red circle moving left; then a red circle ...",
     "segments": [{"start": 0,  "tag": "motion", "prompt": "a red circle moving left",
                   "include": [{"class": "circle", "count": 1, "color": "red", "motion": "left"}]},
                  {"start": 17, "tag": "static", "prompt": "a red circle standing still",
                   "include": [{"class": "circle", "count": 1, "color": "red", "motion": "still"}]}]}

Each segment is a ``video_geneval`` metadata dict (:mod:`rewards.geneval.video`) of tag ``motion``,
``two_object_motion``, ``speed`` or ``static`` (:data:`STREAM_SEGMENT_TAGS`) plus its first frame ``start``; it runs
up to the next segment's start. Every segment names the same objects in the same order (class and colour; count 1),
each with a ``motion``; consecutive segments ask different motions (:func:`asks_differ`). The top-level ``tag``
(``one_object_stream`` / ``two_object_stream``) and ``prompt`` (the segment prompts joined, for display) are
optional. :func:`validate_stream_metadata` checks all of this and names the offending key.

How a stream of ``T`` frames is judged -- version 2 of the rules (:data:`VERSION`; what changed since version 1
is at the end). Every frame's detections come from the ``video_geneval`` detector, ``shapes`` by default; speeds
and distances are in px (per frame) at 64 px, measured ones divided by ``sqrt(H W) / 64``.

- **Object trajectories** (:meth:`LongVideoReward.track`): the stream's objects are followed together, frame by
  frame. Each object predicts its place (last position plus its velocity over its last ``velocity_frames`` = 4
  sightings) and takes a detection *of its colour*: the nearest one within ``match_radius`` (8 px, the
  ``video_geneval`` linking radius; plus ``gap_radius`` = 2 px per frame it has been unseen) of the prediction,
  whatever its class or score (a merged, cut or smeared blob still says where the object is; a wrong class costs
  4 px more distance, a score under the threshold 2 px), else a confident one (its class and colour, score above
  ``threshold`` = 0.3) anywhere: where the object is first seen (the best-scoring one) or where it jumped (its
  velocity starts afresh). Detections go to objects cheapest first, one object each. Its position is the
  detection's centroid weighted by the coverage of its colour over its mask grown by 2 px (sub-pixel, where a
  binary mask's centroid moves in steps; ``soft_centroids=False`` uses the mask's centroid). An object not seen
  with its class -- unseen, or a sliver read as another class -- is *hidden* in a frame where it lies on or
  against another object's detection (its predicted place within 2 px of that mask, or its own mask touching
  it): two objects that touch or overlap are followed through it, and neither jumps nor swaps. Hidden frames
  count as seen for identity and are left out of every motion and consistency rule (a sliver says little about
  where the object is).
- **Judged frames of a segment**: its frames, minus the first ``grace`` (4: one latent frame of the video VAE)
  after a switch, where a model may still be turning; the first segment has no grace.
- **Per object, then the mean over objects** for every motion and identity rule: a two-object stream with one
  object right earns half.

Components of the :class:`~rewards.RewardOutput` (``[B]`` float32; the eight *scored* components are in [0, 1],
1 = as asked):

=================  ================================================================================================
``direction``      per segment and object, the velocity fitted to its positions on the judged frames (least
                   squares, one outlier-free refit: :func:`~rewards.geneval.video.fit_velocity`): a direction earns
                   ``max(0, cos(angle to it))`` times how much the speed counts as moving -- 0 up to
                   ``still_speed`` (0.3), 1 from ``moving_speed`` (0.5), linear between; ``still`` earns the
                   complement (1 below 0.3, 0 from 0.5); an unseen object earns 0. Mean over objects, then over
                   segments. A stream that does not move earns nothing for a segment that asks motion.
``speed``          the same velocities: for a direction, the speed *along* it against the asked band -- ``slowly``
                   0.5-1.8, ``quickly`` >= 2.2 (``video_geneval``'s bands), an unnamed speed ``unnamed_speed`` =
                   0.5-3.5 (the world's 1-3 with 0.5 of margin) -- 1 inside, falling linearly to 0 at
                   ``speed_margin`` (0.5 px/frame) outside, and 0 below ``still_speed`` along it (standing still,
                   or moving another way); for ``still``, the speed against 0-0.3. Mean over objects and segments.
``adherence``      per segment, what is shown -- ``video_geneval``'s frame checks of the segment's metadata on its
                   judged frames (``object``: its classes seen; ``color``: in their colours), each object followed
                   (seen with its class and colour, or hidden) on ``track_fraction`` (0.8) of the judged frames,
                   and the ``speed`` credit of objects whose prompt names a speed word -- as the mean of those
                   credits, *times the segment's* ``direction`` credit: a segment moving the wrong way, or not at
                   all, has little adherence (a static segment's gate is standing still). Mean over segments.
                   ``segments_strict``: the fraction of segments where every one holds fully (each object within
                   ``direction_tolerance`` = 45 degrees of its direction at ``>= moving_speed``, below
                   ``still_speed`` for ``still``, inside its named speed band).
``identity``       per object, the frames in which it is seen with its class and colour, or hidden, over
                   ``identity_fraction`` (0.9) of the ``T`` frames, capped at 1; mean over objects. An object
                   that changes colour (or vanishes) is no longer seen from then on; one that changes class is
                   followed, but no longer seen with its class.
``teleport``       no teleport: every object's steps between consecutive sightings (distance over the frames
                   between them) are graded 0 up to ``jump_ok`` (5 px/frame, the world's fastest motion is 3) and 1
                   from ``jump_bad`` (10); the credit is ``1 - (mean grade) / teleport_fraction`` (0.1), floored at
                   0 -- one full jump in 48 steps costs 0.21, a jump in every tenth step everything. Pooled over
                   the objects' steps (an object seen longer weighs more; an object never seen is identity's to
                   judge); 0 when no object is seen twice.
``smoothness``     likewise for every object's second differences (px/frame^2) over frames seen three in a row,
                   leaving out the turns the prompt asks for (from the frame before each switch to the end of its
                   grace): graded 0 up to ``jerk_ok`` (1.0), 1 from ``jerk_bad`` (2.0); credit ``1 - (mean grade)
                   / smooth_fraction`` (0.5). A rendered stream's second differences stay under 0.1; an object
                   jittering in place, or moving in steps, has most of its frames rough.
``recovery``       per switch at frame ``s`` and object, the latency ``L`` in frames until the new motion holds:
                   windows of ``recovery_window`` (5) frames start at ``s - 1, s, ...`` (the step into frame ``s``
                   is the new segment's); ``L`` counts the windows before the first of ``recovery_hold`` (4) in a
                   row whose least-squares velocity moves as the new segment asks (in the ``speed`` band and within
                   ``recovery_tolerance`` = 20 degrees of the direction, or below ``still_speed``). Credit
                   ``max(0, 1 - L / recovery_horizon)`` (horizon 8 frames), 0 when it never holds, *times* the
                   ``direction`` credit of the old motion on the window just before the switch (frames ``s - 5``
                   to ``s - 1``): a switch is only recovered from a motion that was shown, so a frozen stream earns
                   none. A window with one step of the old motion in four already holds (a right-angle turn one step
                   late bends the fit by about 16 degrees), so a stream that turns ``d`` frames late measures ``L =
                   d - 1``. Mean over objects, then over switches (1 for a stream without one).
``anti_freeze``    per object, over the judged frames of the segments that ask it to move, the fraction in which it
                   moves: its step into the frame is at least ``still_speed``, and so is its velocity fitted over
                   ``freeze_window`` (7) frames of the segment around it (a jitter in place has steps but no
                   velocity; an object moving in jumps has a velocity but mostly no steps); unseen is not moving.
                   Mean over the objects asked to move somewhere (1 when none is). The tracked objects' motion,
                   not pixel change anywhere: a flickering patch or noise on a frozen frame moves no object. (The
                   role of VBench's dynamic degree, arXiv 2311.17982: consistency alone is won by a frozen video.)
=================  ================================================================================================

Also: ``consistency`` (mean of ``identity``, ``teleport``, ``smoothness``); per segment ``k < 4``,
``segment<k>/adherence``, ``segment<k>/direction``, ``segment<k>/speed`` and ``segment<k>/recovery`` (the switch into
segment k; NaN for segment 0), NaN where the stream has fewer segments; and measurements that are not scores:
``recovery_frames`` (mean over switches of the latency of the slowest object, the segment's length when one never
recovered; NaN without a switch), ``max_jump_px`` (largest step, px/frame) and ``jerk_px`` (mean second-difference
norm over the objects). A stream whose metadata names a ``window`` ``[start, end)`` (frames) also gets
``window/direction``, ``window/speed`` and ``window/adherence``: those rules on the window's frames alone, in the
segment of its last frame, without a grace (a part of a stream: KVPO's routed frames); streams of the batch without
one get NaN there, and a batch where none names one has no such component. Likewise a stream with *resumed*
segments (``"resume": true``: a segment after a pause whose prompt says only "moving again" and whose ``include``
asks the motion shown before the pause, as :func:`validate_stream_metadata` checks) gets ``resume/direction``,
``resume/speed`` and ``resume/adherence``: the segment rules' mean over its resumed segments.

``scores`` is the weighted mean of the eight scored components (``weights``, all 1 by default: prompt adherence
counts three times -- ``adherence``, ``direction``, ``speed`` -- temporal consistency three times, switching and
freezing once each), or one component alone with ``score="<component>"``: each is a reward of its own, e.g.
``rewards.load("long_video", score="recovery")``.

A degenerate stream (every frame uniform or pure noise: :func:`rewards.images.degenerate`) scores 0 on every scored
component (measurements NaN); streams holding NaN or inf raise ``ValueError`` naming them, as every video reward
does. A stream's frame count must equal its metadata's ``num_frames``.

Measured on rendered streams of the held-out prompts (``tests/test_stream_rewards.py``): positives score 1.00, clean
or blurred (Gaussian, sigma 1 px); negatives of every kind score clearly lower, each with the component that judges
it low; and a ladder holds on every stream tried, one object and two: the stream as asked (1.00) > every motion at
a wrong speed > in a wrong direction > frozen > black or noise (0). Streams made to game the rules -- a flickering
patch or noise on a frozen frame, a jitter or blink in place, a teleport to the right place at every switch,
every motion reversed, an oscillation, steps instead of motion -- score no higher than the honest stream each
imitates (frozen, a wrong direction, or below the stream as asked).

**Version 2** (the rules above) against version 1: motion-dependent credit needs the motion -- adherence is gated
by the direction (version 1: ``video_geneval``'s partial credit, so a frozen stream kept about three quarters of
it), the speed is measured along the asked direction (a reversed stream kept its speed credit), a speed under
``still_speed`` earns no direction (version 1: ``min(1, speed / moving_speed)``) and a switch counts only after
the old motion was shown; ``anti_freeze`` follows the tracked objects (version 1: any 6 pixels changing, which a
flickering patch won); ``teleport`` and ``smoothness`` are fractions of steps and frames (version 1: the largest
jump, and the mean second difference, so one frame decided them); the objects are followed together by colour
and predicted place with gaps allowed while merged and sub-pixel centroids (version 1: each by class and colour
separately, the nearest detection however far, so merged blobs read as jumps); and objects are averaged (version
1: the worst object, so a two-object stream scored 0 on direction, speed and recovery unless both objects were
right).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from scipy import ndimage

from .base import RewardOutput, register
from .geneval.rules import Detection
from .geneval.shapes import PALETTE
from .geneval.video import DIRECTIONS, VideoGenEval, VideoVerdict, _centroid, fit_velocity, validate_video_metadata
from .images import degenerate
from .video import to_video

__all__ = [
    "COMPONENTS",
    "VERSION",
    "NAMES",
    "SEGMENT_COMPONENTS",
    "WINDOW_NAMES",
    "RESUME_NAMES",
    "STREAM_SEGMENT_TAGS",
    "STREAM_TAGS",
    "LongVideoReward",
    "StreamVerdict",
    "Tracks",
    "asks_differ",
    "segment_asks",
    "segment_bounds",
    "validate_stream_metadata",
]

STREAM_SEGMENT_TAGS: tuple[str, ...] = ("motion", "two_object_motion", "speed", "static")
STREAM_TAGS: tuple[str, ...] = ("one_object_stream", "two_object_stream")
#: the scored components, in [0, 1]; ``scores`` is their weighted mean (module doc)
COMPONENTS: tuple[str, ...] = ("adherence", "direction", "speed", "identity", "teleport", "smoothness", "recovery",
                               "anti_freeze")
#: the rules' version: 1 until the motion-gated rules, tracker and robust statistics of version 2 (module doc)
VERSION = 2
SEGMENT_COMPONENTS = 4  # segment<k>/<name> for k < 4 (the world's streams have at most 3 switches)
PER_SEGMENT: tuple[str, ...] = ("adherence", "direction", "speed", "recovery")
MEASUREMENTS: tuple[str, ...] = ("recovery_frames", "max_jump_px", "jerk_px")
#: every component name, in the order of RewardOutput.components
NAMES: tuple[str, ...] = (*COMPONENTS, "consistency", "segments_strict",
                          *(f"segment{k}/{n}" for k in range(SEGMENT_COMPONENTS) for n in PER_SEGMENT), *MEASUREMENTS)
#: the components of a stream's window (its metadata's ``window``), after :data:`NAMES` when some stream names one
WINDOW_NAMES: tuple[str, ...] = ("window/adherence", "window/direction", "window/speed")
#: the components of a stream's resumed segments (``"resume": true``), after those when some stream has one
RESUME_NAMES: tuple[str, ...] = ("resume/adherence", "resume/direction", "resume/speed")


# ------------------------------------------------------------------------------------------------- metadata


def segment_bounds(metadata: Mapping) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the frames ``start <= t < end`` of every segment of a (valid) stream."""
    starts = [int(s["start"]) for s in metadata["segments"]]
    return list(zip(starts, starts[1:] + [int(metadata["num_frames"])]))


def segment_asks(segment: Mapping) -> tuple[tuple[str, str | None], ...]:
    """What a segment asks of each object, in clause order: ``((motion, speed or None), ...)``."""
    return tuple((c.get("motion"), c.get("speed")) for c in segment["include"])


def asks_differ(before: Sequence[tuple[str, str | None]], after: Sequence[tuple[str, str | None]]) -> bool:
    """Whether a switch from ``before`` to ``after`` (:func:`segment_asks`) asks a visible change: some object
    changes its motion word (a direction, or ``still``), or keeps its direction but changes a named speed
    (``slowly`` <-> ``quickly``). ``moving left`` -> ``moving quickly to the left`` is no switch: the first allows
    the second's speed."""
    for (m0, s0), (m1, s1) in zip(before, after):
        if m0 != m1 or (s0 is not None and s1 is not None and s0 != s1):
            return True
    return False


def validate_stream_metadata(metadata: object, classes: Sequence[str] | None = None,
                             colors: Sequence[str] | None = None, where: str = "metadata",
                             require_switches: bool = True) -> dict:
    """Check one stream metadata dict (module doc); raise ``ValueError`` naming the offending key.

    ``require_switches=False`` accepts consecutive segments that ask the same motion: the metadata of what a
    corrupted or negative stream *shows* (:func:`flowgrpo.world.streams.corrupt_stream`), not of a prompt."""
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{where}: expected a stream metadata dict, got {type(metadata).__name__}")
    T = metadata.get("num_frames")
    if not isinstance(T, (int, np.integer)) or isinstance(T, bool) or T < 2:
        raise ValueError(f"{where}.num_frames: expected an int >= 2, got {T!r}")
    tag = metadata.get("tag")
    if tag is not None and tag not in STREAM_TAGS:
        raise ValueError(f"{where}.tag: expected one of {STREAM_TAGS} (or no tag), got {tag!r}")
    prompt = metadata.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}.prompt: expected a string, got {type(prompt).__name__}")
    segments = metadata.get("segments")
    if not isinstance(segments, Sequence) or isinstance(segments, str) or len(segments) == 0:
        raise ValueError(f"{where}.segments: expected a non-empty list of segments, got {segments!r}")
    objects = None
    previous = None
    for k, segment in enumerate(segments):
        here = f"{where}.segments[{k}]"
        if not isinstance(segment, Mapping):
            raise ValueError(f"{here}: expected a segment dict, got {type(segment).__name__}")
        start = segment.get("start")
        if not isinstance(start, (int, np.integer)) or isinstance(start, bool):
            raise ValueError(f"{here}.start: expected an int frame index, got {start!r}")
        if k == 0 and start != 0:
            raise ValueError(f"{here}.start: the first segment starts at frame 0, got {start}")
        if k > 0 and start <= previous:
            raise ValueError(f"{here}.start: segments start in increasing order, got {start} after {previous}")
        if start >= T:
            raise ValueError(f"{here}.start: {start} is past the stream's last frame ({where}.num_frames={T})")
        previous = start
        validate_video_metadata(segment, classes, colors, where=here)
        if segment["tag"] not in STREAM_SEGMENT_TAGS:
            raise ValueError(f"{here}.tag: a stream segment is one of {STREAM_SEGMENT_TAGS}, got {segment['tag']!r}")
        if segment.get("exclude"):
            raise ValueError(f"{here}.exclude: stream segments have no exclude clauses")
        mine = []
        for j, clause in enumerate(segment["include"]):
            if int(clause["count"]) != 1:
                raise ValueError(f"{here}.include[{j}].count: every object of a stream is one object, got "
                                 f"{clause['count']!r}")
            if clause.get("motion") is None:
                raise ValueError(f"{here}.include[{j}].motion: every object of a stream segment needs a motion "
                                 f"({tuple(DIRECTIONS)} or 'still')")
            if clause.get("color") is None:
                raise ValueError(f"{here}.include[{j}].color: the objects of a stream are named by class and colour")
            mine.append((clause["class"], clause["color"]))
        if len(set(mine)) != len(mine):
            raise ValueError(f"{here}.include: two objects of the same class and colour {mine}; a stream's objects "
                             "must be told apart")
        if objects is None:
            objects = mine
        elif mine != objects:
            j = next((j for j, (a, b) in enumerate(zip(mine, objects)) if a != b), min(len(mine), len(objects)))
            raise ValueError(f"{here}.include[{j}]: a stream keeps its objects (class, colour, order) in every "
                             f"segment: {mine} after {objects} in {where}.segments[0]")
        resume = segment.get("resume", False)
        if not isinstance(resume, bool):
            raise ValueError(f"{here}.resume: expected true or false, got {resume!r}")
        if resume:
            moved = [s for s in segments[:k] if any(m != "still" for m, _ in segment_asks(s))]
            if k < 2 or any(m != "still" for m, _ in segment_asks(segments[k - 1])) or not moved:
                raise ValueError(f"{here}.resume: a resumed segment follows a segment standing still, after one "
                                 "that moved")
            if segment_asks(segment) != segment_asks(moved[-1]):
                raise ValueError(f"{here}.resume: a resumed segment asks the motion shown before the pause "
                                 f"({segment_asks(moved[-1])}), got {segment_asks(segment)}")
        if require_switches and k > 0 and not asks_differ(segment_asks(segments[k - 1]), segment_asks(segment)):
            raise ValueError(f"{here}: asks the same motion as {where}.segments[{k - 1}] "
                             f"({segment_asks(segment)}); consecutive segments must ask different motions")
    window = metadata.get("window")
    if window is not None:
        if (not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 2
                or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in window)
                or not 0 <= window[0] <= window[1] - 2 or window[1] > T):
            raise ValueError(f"{where}.window: expected [start, end] frames with 0 <= start, end - start >= 2 and "
                             f"end <= num_frames ({T}), got {window!r}")
    return dict(metadata)


# ---------------------------------------------------------------------------------------------------- verdict


@dataclass
class StreamVerdict:
    """The judgement of one stream: ``components`` (every component of the module doc, floats), ``segments``
    (``video_geneval``'s verdict per segment, on its judged frames), ``velocities`` (per segment, per object, the
    fitted ``(vx, vy)`` in px/frame at 64 px, None where unseen), ``latencies`` (per switch, frames until the new
    motion held, None when it never did), ``trajectories`` (per object ``[T, 2]`` centroids in px, NaN where
    unseen) and ``reason`` (what fell short, ``""`` when nothing did)."""

    components: dict[str, float]
    segments: list[VideoVerdict] = field(default_factory=list, repr=False)
    velocities: list[list[tuple[float, float] | None]] = field(default_factory=list, repr=False)
    latencies: list[int | None] = field(default_factory=list)
    trajectories: list[np.ndarray] = field(default_factory=list, repr=False)
    reason: str = ""


def _ramp(x: float, ok: float, bad: float) -> float:
    """1 up to ``ok``, linearly down to 0 at ``bad``."""
    return float(min(1.0, max(0.0, (bad - x) / (bad - ok))))


@dataclass
class Tracks:
    """The objects of one stream followed through its frames (:meth:`LongVideoReward.track`): ``positions``
    ``[J, T, 2]`` centroids in px (NaN where unseen), ``right`` ``[J, T]`` (seen with its class and colour above the
    detection threshold) and ``hidden`` ``[J, T]`` (not seen with its class while on or against another object's
    detection: hidden by it or merged with it, module doc)."""

    positions: np.ndarray
    right: np.ndarray
    hidden: np.ndarray


def _window_fits(u: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares velocities of the seen points of ``u`` (``[T, 2]``, NaN where unseen) over the frame windows
    ``[lo_i, hi_i)``, all at once: ``([N, 2] velocities, [N] points per window)`` (0 where fewer than 2 points)."""
    seen = ~np.isnan(u[:, 0])
    t = np.arange(len(u), dtype=np.float64)
    m = seen.astype(np.float64)
    x, y = np.where(seen, u[:, 0], 0.0), np.where(seen, u[:, 1], 0.0)
    sums = np.vstack([np.zeros(7), np.cumsum(np.stack([m, t * m, t * t * m, x, y, t * x, t * y], 1), axis=0)])
    n, st, stt, sx, sy, stx, sty = (sums[np.asarray(hi)] - sums[np.asarray(lo)]).T
    den = n * stt - st * st
    safe = np.where(den > 1e-9, den, 1.0)
    v = np.stack([(n * stx - st * sx) / safe, (n * sty - st * sy) / safe], 1)
    return np.where((den > 1e-9)[:, None], v, 0.0), n.astype(int)


_WHITE = np.array([255.0, 255.0, 255.0])
_INKS = np.array(list(PALETTE.values()), dtype=np.float64) - _WHITE  # [K, 3]: white -> each palette colour
_INK_NORMS = (_INKS * _INKS).sum(1)
_INK_INDEX = {name: k for k, name in enumerate(PALETTE)}


def _soft_centroid(frame: np.ndarray, det: Detection, color: str) -> np.ndarray:
    """The centroid of a detection weighted by its colour's coverage (white blended with the colour, as the
    ``shapes`` detector explains pixels) over its mask grown by 2 px, on the pixels best explained by that colour:
    sub-pixel, where a binary mask's centroid moves in steps. The mask centroid for a colour outside the palette
    or a detection without a mask."""
    if color not in PALETTE or det.mask is None or not det.mask.any():
        return np.asarray(_centroid(det))
    h, w = det.mask.shape
    x1, y1, x2, y2 = det.box[:4]
    i0, i1 = max(int(y1) - 3, 0), min(int(math.ceil(y2)) + 3, h)
    j0, j1 = max(int(x1) - 3, 0), min(int(math.ceil(x2)) + 3, w)
    pix = frame[i0:i1, j0:j1].astype(np.float64) - _WHITE  # [h, w, 3]
    proj = pix @ _INKS.T / _INK_NORMS  # [h, w, K]: coverage of each colour before clipping
    alpha = np.clip(proj, 0.0, 1.0)
    # squared distance to the segment white -> colour: |p|^2 - 2 a (p . c) + a^2 |c|^2 with p . c = proj |c|^2
    resid = alpha * (alpha - 2.0 * proj) * _INK_NORMS
    k = _INK_INDEX[color]
    region = ndimage.binary_dilation(det.mask[i0:i1, j0:j1], iterations=2)
    weight = alpha[..., k] * (resid.argmin(-1) == k) * region
    total = weight.sum()
    if total < 1.0:
        return np.asarray(_centroid(det))
    yy, xx = np.mgrid[i0:i1, j0:j1]
    return np.array([(weight * (xx + 0.5)).sum() / total, (weight * (yy + 0.5)).sum() / total])


def _grown(det: Detection, pixels: int) -> np.ndarray:
    return ndimage.binary_dilation(det.mask, iterations=pixels)


def _covers(det: Detection, x: float, y: float, pad: float) -> bool:
    """Whether the point ``(x, y)`` (px) lies on the detection's mask grown by ``pad`` px (its box without a mask)."""
    if det.mask is None:
        x1, y1, x2, y2 = det.box[:4]
        return x1 - pad <= x <= x2 + pad and y1 - pad <= y <= y2 + pad
    h, w = det.mask.shape
    i, j = int(math.floor(y)), int(math.floor(x))
    r = int(math.ceil(pad))
    window = det.mask[max(0, i - r): i + r + 1, max(0, j - r): j + r + 1]
    if not window.any():
        return False
    ys, xs = np.nonzero(window)
    return bool((np.hypot(xs + max(0, j - r) + 0.5 - x, ys + max(0, i - r) + 0.5 - y) <= pad + 0.5).any())


@register("long_video")
class LongVideoReward:
    """Long streaming moving-shapes clips with prompt switches: ``reward(videos, prompts, metadata) ->
    RewardOutput`` (module doc). ``metadata`` is one stream metadata dict per video.

    Args:
        detector: the per-frame detector, as for :class:`~rewards.geneval.VideoGenEval` (``"shapes"`` default).
        score: ``"mean"`` (weighted mean of :data:`COMPONENTS`, default) or one component's name.
        weights: ``{component: weight}`` for ``score="mean"``; missing components weigh 1.
        grace: frames after a switch left out of the per-segment judgements.
        identity_fraction: share of frames an object must be seen in for full ``identity`` credit.
        jump_ok, jump_bad: a step's ``teleport`` grade goes from 0 to 1 between them (px/frame at 64 px).
        jerk_ok, jerk_bad: a frame's ``smoothness`` grade goes from 0 to 1 between them (px/frame^2 at 64 px).
        teleport_fraction, smooth_fraction: the mean grade at which ``teleport`` / ``smoothness`` reach 0.
        recovery_window, recovery_hold, recovery_horizon: ``recovery`` (frames).
        recovery_tolerance: largest angle (degrees) between a window's velocity and the asked direction.
        speed_margin: px/frame outside a speed band over which ``speed`` credit falls to 0.
        unnamed_speed: the band of a direction without a speed word (px/frame).
        freeze_window: frames of the velocity fit that tells ``anti_freeze`` an object moves.
        gap_radius, velocity_frames, soft_centroids: the tracker (module doc): px/frame the search radius grows
            while an object is unseen, sightings its predicted velocity spans, coverage-weighted centroids.
        **geneval_kwargs: passed to :class:`~rewards.geneval.VideoGenEval` (its thresholds: ``moving_speed``,
            ``still_speed``, ``direction_tolerance``, ``speed_bands``, ``threshold``, ... -- shared by the
            ``direction``, ``speed`` and ``recovery`` rules here), and detector kwargs.

    >>> import numpy as np, rewards
    >>> clip = np.full((32, 64, 64, 3), 255, np.uint8)
    >>> for t in range(32):                      # a red square: right for 16 frames, then down
    ...     x, y = 12 + 2 * min(t, 15), 12 + 2 * max(0, t - 15)
    ...     clip[t, y - 5 : y + 5, x - 5 : x + 5] = (220, 30, 30)
    >>> seg = lambda start, motion: {"start": start, "tag": "motion", "prompt": f"a red square moving {motion}",
    ...     "include": [{"class": "square", "count": 1, "color": "red", "motion": motion}]}
    >>> meta = {"num_frames": 32, "segments": [seg(0, "right"), seg(16, "down")]}
    >>> out = rewards.load("long_video")([clip], None, [meta])
    >>> round(out.scores.item(), 2), out.components["recovery"].item(), out.components["anti_freeze"].item()
    (1.0, 1.0, 1.0)
    >>> late = {"num_frames": 32, "segments": [seg(0, "right"), seg(8, "down")]}    # it turned 8 frames late
    >>> rewards.load("long_video", score="recovery")([clip], None, [late]).scores.item()   # 7 frames: 1 - 7/8
    0.125
    """

    modality = "video"  # scores clips [B, T, 3, H, W]: a trainer refuses it with an image model
    name = "long_video"
    version = VERSION  # raised whenever the same stream scores differently; results record it

    def __init__(
        self,
        detector: str | object = "shapes",
        *,
        score: str = "mean",
        weights: Mapping[str, float] | None = None,
        grace: int = 4,
        identity_fraction: float = 0.9,
        jump_ok: float = 5.0,
        jump_bad: float = 10.0,
        jerk_ok: float = 1.0,
        jerk_bad: float = 2.0,
        recovery_window: int = 5,
        recovery_hold: int = 4,
        recovery_horizon: int = 8,
        recovery_tolerance: float = 20.0,
        speed_margin: float = 0.5,
        unnamed_speed: Sequence[float] = (0.5, 3.5),
        teleport_fraction: float = 0.1,
        smooth_fraction: float = 0.5,
        freeze_window: int = 7,
        gap_radius: float = 2.0,
        velocity_frames: int = 4,
        soft_centroids: bool = True,
        **geneval_kwargs,
    ):
        if score != "mean" and score not in COMPONENTS:
            raise ValueError(f"long_video score={score!r} is not 'mean' or one of {', '.join(COMPONENTS)}")
        unknown = sorted(set(weights or {}) - set(COMPONENTS))
        if unknown:
            raise ValueError(f"long_video weights: unknown component(s) {unknown}; expected some of {COMPONENTS}")
        self.weights = {name: float((weights or {}).get(name, 1.0)) for name in COMPONENTS}
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"long_video weights must be >= 0 with a positive sum, got {self.weights}")
        for name, value in (("grace", grace), ("recovery_window", recovery_window - 2),
                            ("recovery_hold", recovery_hold - 1), ("recovery_horizon", recovery_horizon - 1),
                            ("freeze_window", freeze_window - 3), ("velocity_frames", velocity_frames - 2)):
            if int(value) != value or value < 0:
                raise ValueError(f"long_video {name} is too small or not an int (grace >= 0, recovery_window >= 2, "
                                 f"recovery_hold >= 1, recovery_horizon >= 1, freeze_window >= 3, "
                                 f"velocity_frames >= 2)")
        for name, (ok, bad) in (("jump_ok/jump_bad", (jump_ok, jump_bad)), ("jerk_ok/jerk_bad", (jerk_ok, jerk_bad))):
            if not 0 <= ok < bad:
                raise ValueError(f"long_video {name} must satisfy 0 <= ok < bad, got {ok}, {bad}")
        if not 0.0 < identity_fraction <= 1.0:
            raise ValueError(f"long_video identity_fraction={identity_fraction} must be in (0, 1]")
        if len(unnamed_speed) != 2 or not 0 <= unnamed_speed[0] < unnamed_speed[1]:
            raise ValueError(f"long_video unnamed_speed must be [lo, hi] with 0 <= lo < hi, got {unnamed_speed!r}")
        if speed_margin <= 0:
            raise ValueError(f"long_video speed_margin={speed_margin} must be > 0")
        for name, value in (("teleport_fraction", teleport_fraction), ("smooth_fraction", smooth_fraction)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"long_video {name}={value} must be in (0, 1]")
        if gap_radius < 0:
            raise ValueError(f"long_video gap_radius={gap_radius} must be >= 0")
        self.geneval = VideoGenEval(detector, score="partial", **geneval_kwargs)
        self.score = score
        self.grace = int(grace)
        self.identity_fraction = float(identity_fraction)
        self.jump_ok, self.jump_bad = float(jump_ok), float(jump_bad)
        self.jerk_ok, self.jerk_bad = float(jerk_ok), float(jerk_bad)
        self.recovery_window = int(recovery_window)
        self.recovery_hold = int(recovery_hold)
        self.recovery_horizon = int(recovery_horizon)
        self.recovery_tolerance = float(recovery_tolerance)
        self.speed_margin = float(speed_margin)
        self.unnamed_speed = (float(unnamed_speed[0]), float(unnamed_speed[1]))
        self.teleport_fraction = float(teleport_fraction)
        self.smooth_fraction = float(smooth_fraction)
        self.freeze_window = int(freeze_window)
        self.match_radius = float(self.geneval.match_radius)
        self.gap_radius = float(gap_radius)
        self.velocity_frames = int(velocity_frames)
        self.soft_centroids = bool(soft_centroids)

    def describe(self) -> str:
        """One line naming the reward, its version and the training scalar, e.g. ``long_video v2 (score=mean)``."""
        weights = {n: w for n, w in self.weights.items() if w != 1.0}
        what = f"score={self.score}" + (f", weights={weights}" if weights and self.score == "mean" else "")
        return f"{self.name} v{self.version} ({what})"

    # ------------------------------------------------------------------------------------------------ checks

    def check_metadata(self, metadata: dict) -> None:
        """Raise ``ValueError`` naming the key when one stream metadata record does not fit this reward (lets a
        trainer check a prompt file up front)."""
        detector = self.geneval.detector
        validate_stream_metadata(metadata, getattr(detector, "classes", None), getattr(detector, "colors", None),
                                 where="record")

    def _band(self, motion: str, speed: str | None) -> tuple[float, float]:
        if motion == "still":
            return 0.0, self.geneval.still_speed
        if speed is not None:
            return self.geneval.speed_bands[speed]
        return self.unnamed_speed

    def _moving(self, s: float) -> float:
        """How much a speed ``s`` (px/frame) counts as moving: 0 up to ``still_speed``, 1 from ``moving_speed``."""
        moving, still = self.geneval.moving_speed, self.geneval.still_speed
        return 1.0 - _ramp(s, still, moving) if moving > still else float(s >= moving)

    def _direction_credit(self, v: tuple[float, float], motion: str) -> float:
        """Moving as asked: ``max(0, cos(angle to the direction))``, times how much the speed counts as moving
        (:meth:`_moving`); ``still``: 1 below ``still_speed``, falling to 0 at ``moving_speed``."""
        s = math.hypot(*v)
        if motion == "still":
            return 1.0 - self._moving(s)
        if s == 0:
            return 0.0
        ux, uy = DIRECTIONS[motion]
        return max(0.0, (v[0] * ux + v[1] * uy) / s) * self._moving(s)

    def _speed_credit(self, v: tuple[float, float], motion: str, speed: str | None) -> float:
        """The speed *along the asked direction* (the speed for ``still``) against the asked band, 1 inside and
        falling to 0 at ``speed_margin`` outside; a direction's credit is 0 when the object moves less than
        ``still_speed`` along it (the wrong way, or not at all)."""
        lo, hi = self._band(motion, speed)
        if motion == "still":
            s = math.hypot(*v)
        else:
            ux, uy = DIRECTIONS[motion]
            s = v[0] * ux + v[1] * uy
            if s < self.geneval.still_speed:
                return 0.0
        off = max(lo - s, s - hi, 0.0)
        return max(0.0, 1.0 - off / self.speed_margin)

    def _holds(self, v: tuple[float, float], motion: str, speed: str | None) -> bool:
        """The window velocity ``v`` moves as asked: in the speed band, within ``recovery_tolerance`` of the
        direction (or below ``still_speed``)."""
        s = math.hypot(*v)
        lo, hi = self._band(motion, speed)
        if not lo <= s <= hi:
            return False
        if motion == "still":
            return True
        if s < self.geneval.moving_speed:
            return False
        ux, uy = DIRECTIONS[motion]
        return (v[0] * ux + v[1] * uy) / s >= math.cos(math.radians(self.recovery_tolerance)) - 1e-12

    def _as_asked(self, v: tuple[float, float], motion: str, speed: str | None) -> bool:
        """``video_geneval``'s verdict on one object's velocity: ``still`` below ``still_speed``; a direction at
        ``>= moving_speed`` within ``direction_tolerance`` of it, and along it inside the band of a named speed."""
        s = math.hypot(*v)
        if motion == "still":
            return s < self.geneval.still_speed
        ux, uy = DIRECTIONS[motion]
        along = v[0] * ux + v[1] * uy
        if s < self.geneval.moving_speed or along < s * math.cos(math.radians(self.geneval.direction_tolerance)):
            return False
        lo, hi = self._band(motion, speed) if speed is not None else (0.0, math.inf)
        return lo <= along <= hi

    # ------------------------------------------------------------------------------------------------ judging

    def judge(self, videos, metadata: Sequence[dict] | None) -> list[StreamVerdict]:
        """Per-stream verdicts (every component, per-segment verdicts, velocities, latencies, trajectories)."""
        u8 = to_video(videos, reward="long_video")
        if metadata is None:
            raise ValueError("long_video needs one stream metadata dict per video (argument 'metadata'), got None")
        if isinstance(metadata, Mapping):
            raise ValueError("metadata must be a list with one stream metadata dict per video, got a single dict")
        metadata = list(metadata)
        B, T = u8.shape[:2]
        if len(metadata) != B:
            raise ValueError(f"got {B} videos but {len(metadata)} metadata dicts")
        detector = self.geneval.detector
        classes, colors = getattr(detector, "classes", None), getattr(detector, "colors", None)
        metadata = [validate_stream_metadata(m, classes, colors, where=f"metadata[{i}]")
                    for i, m in enumerate(metadata)]
        for i, m in enumerate(metadata):
            if int(m["num_frames"]) != T:
                raise ValueError(f"metadata[{i}].num_frames is {m['num_frames']} but the videos have {T} frames")
            for k, (start, end) in enumerate(segment_bounds(m)):
                judged = end - start - (self.grace if k else 0)
                if judged < 2:
                    raise ValueError(f"metadata[{i}].segments[{k}]: {end - start} frames leave {judged} to judge "
                                     f"after the grace of {self.grace} frames; a segment needs at least 2")
        flags = degenerate(u8)
        clips = u8.permute(0, 1, 3, 4, 2).numpy()  # uint8 [B, T, H, W, 3]
        content = [b for b in range(B) if flags[b] is None]
        frames, frame_meta = [], []
        for b in content:
            index = np.zeros(T, dtype=int)
            for k, (start, _) in enumerate(segment_bounds(metadata[b])):
                index[start:] = k
            frames += [clips[b, t] for t in range(T)]
            frame_meta += [metadata[b]["segments"][k] for k in index]
        found = detector(frames, frame_meta) if content else []
        verdicts = []
        for b in range(B):
            if flags[b] is not None:
                verdicts.append(self._degenerate(metadata[b], flags[b]))
                continue
            k = content.index(b)
            verdicts.append(self.judge_stream(found[k * T : (k + 1) * T], clips[b], metadata[b]))
        return verdicts

    @staticmethod
    def _degenerate(metadata: Mapping, why: str) -> StreamVerdict:
        comps = {name: 0.0 for name in COMPONENTS} | {"consistency": 0.0, "segments_strict": 0.0}
        comps |= {name: math.nan for name in MEASUREMENTS}
        comps |= {f"segment{k}/{n}": 0.0 if k < len(metadata["segments"]) and (k or n != "recovery") else math.nan
                  for k in range(SEGMENT_COMPONENTS) for n in PER_SEGMENT}
        if metadata.get("window") is not None:
            comps |= {name: 0.0 for name in WINDOW_NAMES}
        if any(seg.get("resume") for seg in metadata["segments"]):
            comps |= {name: 0.0 for name in RESUME_NAMES}
        return StreamVerdict(comps, reason=f"degenerate stream ({why} frames): no content, scored 0")

    def track(self, detections: Sequence[Mapping[str, Sequence[Detection]]], frames: np.ndarray,
              objects: Sequence[tuple[str, str]]) -> Tracks:
        """Follow every object of a stream through its frames at once (module doc, *object trajectories*)."""
        T, H, W = frames.shape[:3]
        scale = math.sqrt(H * W) / 64.0
        J = len(objects)
        out = Tracks(np.full((J, T, 2), np.nan), np.zeros((J, T), dtype=bool), np.zeros((J, T), dtype=bool))
        recent: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(J)]  # sightings since the last jump
        threshold = self.geneval.threshold
        for t, dets in enumerate(detections):
            found = [(cls, d, np.asarray(_centroid(d))) for cls, ds in dets.items() for d in ds]
            pairs = []
            for j, (cls_j, color_j) in enumerate(objects):
                pred = gate = None
                if recent[j]:
                    (t0, p0), (t1, p1) = recent[j][0], recent[j][-1]
                    v = (p1 - p0) / (t1 - t0) if t1 > t0 else np.zeros(2)
                    pred = p1 + v * (t - t1)
                    gate = (self.match_radius + self.gap_radius * (t - t1 - 1)) * scale
                for i, (cls, d, c) in enumerate(found):
                    if d.color != color_j:
                        continue
                    sure = cls == cls_j and float(d.score) > threshold
                    if pred is not None and np.hypot(*(c - pred)) <= gate:  # near the prediction: any class, score
                        cost = float(np.hypot(*(c - pred))) / scale + 4.0 * (cls != cls_j) + 2.0 * (not sure)
                        pairs.append((cost, j, i, True))
                    elif sure:  # a confident sighting elsewhere: where it starts, or a jump
                        far = float(np.hypot(*(c - pred))) / scale if pred is not None else -float(d.score)
                        pairs.append((1000.0 + far, j, i, False))
            taken: dict[int, int] = {}  # object -> detection
            for _, j, i, near in sorted(pairs):
                if j in taken or i in taken.values():
                    continue
                taken[j] = i
                cls, d, c = found[i]
                p = _soft_centroid(frames[t], d, objects[j][1]) if self.soft_centroids else c
                recent[j] = (recent[j] if near else []) + [(t, p)]
                recent[j] = recent[j][-self.velocity_frames:]
                out.positions[j, t] = p
                out.right[j, t] = cls == objects[j][0] and float(d.score) > threshold
            # not seen with its class (unseen, or a sliver read as another class) where it lies on or against
            # another object's blob: hidden by it, or merged with it -- not lost
            for j in range(J):
                if out.right[j, t] or not recent[j]:
                    continue
                others = [found[i][1] for k, i in taken.items() if k != j]
                if j in taken:
                    mine = found[taken[j]][1]
                    near = _grown(mine, 1) if mine.mask is not None else None
                    out.hidden[j, t] = near is not None and any(o.mask is not None and (near & o.mask).any()
                                                                for o in others)
                else:
                    (t0, p0), (t1, p1) = recent[j][0], recent[j][-1]
                    x, y = p1 + ((p1 - p0) / (t1 - t0) if t1 > t0 else 0.0) * (t - t1)
                    out.hidden[j, t] = any(_covers(o, x, y, 2.0 * scale) for o in others)
        return out

    def judge_stream(self, detections: Sequence[Mapping[str, Sequence[Detection]]], frames: np.ndarray,
                     metadata: Mapping) -> StreamVerdict:
        """The verdict of one stream from its per-frame detections and its uint8 ``[T, H, W, 3]`` frames."""
        T, H, W = frames.shape[:3]
        scale = math.sqrt(H * W) / 64.0
        segments = list(metadata["segments"])
        bounds = segment_bounds(metadata)
        judged = [(start + (self.grace if k else 0), end) for k, (start, end) in enumerate(bounds)]
        objects = [(c["class"], c["color"]) for c in segments[0]["include"]]
        names = [f"{color} {cls}" for cls, color in objects]
        asks = [segment_asks(seg) for seg in segments]  # [segment][object] -> (motion, speed word)
        reasons: list[str] = []
        comps: dict[str, float] = {}

        tracks = self.track(detections, frames, objects)
        units = tracks.positions / scale  # px at 64 px, [J, T, 2]
        units[tracks.hidden] = np.nan  # a sliver of a hidden object says little about where it is
        seen = ~np.isnan(units[..., 0])
        t_all = np.arange(T)

        def velocity(j: int, lo: int, hi: int) -> tuple[float, float] | None:
            at = t_all[lo:hi][seen[j, lo:hi]]
            if len(at) < 2:
                return None
            return fit_velocity(at.tolist(), [tuple(p) for p in units[j, at]], outlier_px=1.5)

        # motion per segment and object: direction (gates adherence), speed along the direction
        velocities, direction, speed, speed_credits = [], [], [], []
        for k, (lo, hi) in enumerate(judged):
            per_object, d_k, s_k = [], [], []
            for j, (motion, word) in enumerate(asks[k]):
                v = velocity(j, lo, hi)
                per_object.append(v)
                d_k.append(0.0 if v is None else self._direction_credit(v, motion))
                s_k.append(0.0 if v is None else self._speed_credit(v, motion, word))
                if d_k[-1] < 0.99 or s_k[-1] < 0.99:
                    shown = "unseen" if v is None else f"moves ({v[0]:+.2f}, {v[1]:+.2f}) px/frame"
                    asked = motion if word is None else f"{motion} {word}"
                    reasons.append(f"segment {k} {names[j]}: asked {asked}, {shown}")
            velocities.append(per_object)
            speed_credits.append(s_k)
            direction.append(float(np.mean(d_k)))
            speed.append(float(np.mean(s_k)))
        comps["direction"], comps["speed"] = float(np.mean(direction)), float(np.mean(speed))

        # prompt adherence per segment: what is shown -- video_geneval's frame checks (every object's class and its
        # colour in enough frames), each object followed through the segment (identity) and the speed word where
        # the prompt names one -- gated by the segment's direction credit (standing still for a static one)
        seg_verdicts = [self.geneval.judge_clip(detections[lo:hi], seg, (H, W))
                        for (lo, hi), seg in zip(judged, segments)]
        fraction = self.geneval.track_fraction
        adherence, strict = [], []
        for k, ((lo, hi), v) in enumerate(zip(judged, seg_verdicts)):
            kept = (tracks.right[:, lo:hi] | tracks.hidden[:, lo:hi]).sum(1) / (hi - lo)  # per object
            shown = [v.credits["object"], v.credits.get("color", 1.0), float(np.minimum(1.0, kept / fraction).mean())]
            worded = [speed_credits[k][j] for j, (_, word) in enumerate(asks[k]) if word is not None]
            if worded:
                shown.append(float(np.mean(worded)))
            adherence.append(direction[k] * float(np.mean(shown)))
            framed = all(v.checks.get(name, True) for name in ("object", "color"))
            strict.append(framed and bool((kept >= fraction).all())
                          and all(vel is not None and self._as_asked(vel, motion, word)
                                  for vel, (motion, word) in zip(velocities[k], asks[k])))
            if not strict[-1]:
                missing = [f"{names[j]} followed in {kept[j]:.0%} of its frames" for j in range(len(objects))
                           if kept[j] < fraction]
                said = "; ".join(filter(None, [v.reason if not framed else "", *missing]))
                if said:
                    reasons.append(f"segment {k} ({segments[k]['prompt']!r}): {said}")
        comps["adherence"] = float(np.mean(adherence))
        resumed = [k for k, seg in enumerate(segments) if seg.get("resume")]
        if resumed:  # the segments told only to move "again": the motion shown before their pause
            for name, values in (("adherence", adherence), ("direction", direction), ("speed", speed)):
                comps[f"resume/{name}"] = float(np.mean([values[k] for k in resumed]))
        comps["segments_strict"] = float(np.mean(strict))
        if metadata.get("window") is not None:
            comps |= self._judge_window(metadata, bounds, asks, detections, tracks, velocity, (H, W))

        # temporal consistency: identity per object; teleport and smoothness as fractions of every object's steps
        # and frames seen (pooled: an object seen longer weighs more; one never seen is identity's to judge)
        identity, jumps, jerks, bad_steps, rough_frames = [], [], [], [], []
        turns = np.zeros(T, dtype=bool)
        for start, _ in bounds[1:]:
            turns[max(0, start - 1) : start + self.grace] = True
        for j in range(len(objects)):
            shown = int((tracks.right[j] | tracks.hidden[j]).sum())
            identity.append(min(1.0, shown / (self.identity_fraction * T)))
            if identity[-1] < 1.0:
                reasons.append(f"identity: {names[j]} seen in {int(tracks.right[j].sum())}/{T} frames "
                               f"(+{int(tracks.hidden[j].sum())} merged with another object)")
            at = np.nonzero(seen[j])[0]
            step = np.linalg.norm(np.diff(units[j, at], axis=0), axis=1) / np.diff(at) if len(at) >= 2 else np.zeros(0)
            jumps.append(float(step.max()) if len(step) else math.nan)
            bad_steps.append(1.0 - np.clip((self.jump_bad - step) / (self.jump_bad - self.jump_ok), 0.0, 1.0))
            if (step > self.jump_ok).any():
                reasons.append(f"teleport: {names[j]} jumps in {int((step > self.jump_ok).sum())} of {len(step)} "
                               f"steps (largest {step.max():.1f} px/frame)")
            mid = np.nonzero(seen[j, :-2] & seen[j, 1:-1] & seen[j, 2:] & ~turns[1:-1])[0] + 1
            second = np.linalg.norm(units[j, mid + 1] - 2 * units[j, mid] + units[j, mid - 1], axis=1)
            jerks.append(float(second.mean()) if len(mid) else math.nan)
            rough_frames.append(1.0 - np.clip((self.jerk_bad - second) / (self.jerk_bad - self.jerk_ok), 0.0, 1.0))
            if (second > self.jerk_ok).any():
                reasons.append(f"smoothness: {names[j]} turns or jitters in {int((second > self.jerk_ok).sum())} "
                               f"of {len(mid)} frames (second differences {jerks[-1]:.2f} px/frame^2 on average)")
        bad_steps, rough_frames = np.concatenate(bad_steps), np.concatenate(rough_frames)
        comps["identity"] = float(np.mean(identity))
        comps["teleport"] = max(0.0, 1.0 - float(bad_steps.mean()) / self.teleport_fraction) if len(bad_steps) else 0.0
        comps["smoothness"] = (max(0.0, 1.0 - float(rough_frames.mean()) / self.smooth_fraction)
                               if len(rough_frames) else 0.0)
        comps["consistency"] = float(np.mean([comps["identity"], comps["teleport"], comps["smoothness"]]))
        comps["max_jump_px"] = float(max(jumps)) if all(math.isfinite(x) for x in jumps) else math.nan
        comps["jerk_px"] = float(np.nanmean(jerks)) if not all(math.isnan(x) for x in jerks) else math.nan

        # switch recovery: the old motion shown before the switch, then the new one held soon after it
        latencies: list[int | None] = []
        credits = []
        w, hold = self.recovery_window, self.recovery_hold
        for k in range(1, len(segments)):
            start, end = bounds[k]
            worst: int | None = 0
            per_object = []
            for j, (motion, word) in enumerate(asks[k]):
                first = np.arange(start - 1, end - w + 1)  # the step into frame `start` is the new segment's
                v, n = _window_fits(units[j], first, first + w)
                ok = [n[i] >= w - 1 and self._holds(tuple(v[i]), motion, word) for i in range(len(first))]
                latency = next((i for i in range(len(ok)) if all(ok[i : i + hold])), None)
                worst = None if latency is None or worst is None else max(worst, latency)
                v_before, n_before = _window_fits(units[j], np.array([max(0, start - w)]), np.array([start]))
                before = self._direction_credit(tuple(v_before[0]), asks[k - 1][j][0]) if n_before[0] >= w - 1 else 0.0
                soon = 0.0 if latency is None else max(0.0, 1.0 - latency / self.recovery_horizon)
                per_object.append(before * soon)
                if per_object[-1] < 0.99:
                    said = "never" if latency is None else f"after {latency} frames"
                    reasons.append(f"recovery: switch to segment {k} (frame {start}), {names[j]}: new motion held "
                                   f"{said}, old motion shown before it {before:.2f}")
            latencies.append(worst)
            credits.append(float(np.mean(per_object)))
        comps["recovery"] = float(np.mean(credits)) if credits else 1.0
        per_segment = {"adherence": adherence, "direction": direction, "speed": speed,
                       "recovery": [math.nan, *credits]}
        for k in range(SEGMENT_COMPONENTS):
            for name, values in per_segment.items():
                comps[f"segment{k}/{name}"] = float(values[k]) if k < len(segments) else math.nan
        comps["recovery_frames"] = (float(np.mean([end - start if lat is None else lat for lat, (start, end)
                                                   in zip(latencies, bounds[1:])])) if latencies else math.nan)

        # anti-freeze: the tracked objects keep moving where their segment asks them to (windowed velocity)
        moving = []
        half, still = self.freeze_window // 2, self.geneval.still_speed
        for j in range(len(objects)):
            hits = []
            for k, (lo, hi) in enumerate(judged):
                if asks[k][j][0] == "still":
                    continue
                t = np.arange(max(lo, 1), hi)
                t = t[~tracks.hidden[j, t]]  # hidden by another object: neither moving nor frozen
                first = np.clip(t - half, lo, max(lo, hi - self.freeze_window))  # whole windows inside the segment
                v, n = _window_fits(units[j], first, np.minimum(first + self.freeze_window, hi))
                step = np.linalg.norm(units[j, t] - units[j, t - 1], axis=1)  # NaN (not moving) where unseen
                hits.append((n >= 3) & (np.linalg.norm(v, axis=1) >= still) & (np.nan_to_num(step) >= still))
            if hits:
                hits = np.concatenate(hits)
                moving.append(float(hits.mean()))
                if moving[-1] < 1.0:
                    reasons.append(f"anti_freeze: {names[j]} stands still (or is unseen) in "
                                   f"{int((~hits).sum())} of {len(hits)} frames asked to move")
        comps["anti_freeze"] = float(np.mean(moving)) if moving else 1.0
        return StreamVerdict(comps, seg_verdicts, velocities, latencies, list(tracks.positions), "; ".join(reasons))

    def _judge_window(self, metadata: Mapping, bounds, asks, detections, tracks: Tracks, velocity,
                      frame_size: tuple[int, int]) -> dict[str, float]:
        """``window/direction``, ``window/speed`` and ``window/adherence`` of a stream whose metadata names a
        ``window`` ``[start, end)``: the rules of ``direction``, ``speed`` and ``adherence`` on the window's frames in
        the segment of its last frame (from that segment's start at the earliest), without a grace: what a part of
        the stream shows, e.g. the frames a KVPO branch routed (arXiv 2605.14278 scores its fork's chunk)."""
        start, end = (int(t) for t in metadata["window"])
        k = max(i for i, (s, _) in enumerate(bounds) if s < end)
        lo = max(start, bounds[k][0])
        d_k, s_k, worded = [], [], []
        for j, (motion, word) in enumerate(asks[k]):
            v = velocity(j, lo, end)
            d_k.append(0.0 if v is None else self._direction_credit(v, motion))
            s_k.append(0.0 if v is None else self._speed_credit(v, motion, word))
            if word is not None:
                worded.append(s_k[-1])
        verdict = self.geneval.judge_clip(detections[lo:end], metadata["segments"][k], frame_size)
        kept = (tracks.right[:, lo:end] | tracks.hidden[:, lo:end]).sum(1) / (end - lo)
        shown = [verdict.credits["object"], verdict.credits.get("color", 1.0),
                 float(np.minimum(1.0, kept / self.geneval.track_fraction).mean()), *([np.mean(worded)] if worded else [])]
        direction = float(np.mean(d_k))
        return {"window/adherence": direction * float(np.mean(shown)), "window/direction": direction,
                "window/speed": float(np.mean(s_k))}

    # ------------------------------------------------------------------------------------------------ reward

    def combine(self, components: Mapping[str, float]) -> float:
        """The training scalar of one stream's components: the weighted mean, or the chosen component."""
        if self.score != "mean":
            return float(components[self.score])
        total = sum(self.weights.values())
        return float(sum(self.weights[n] * components[n] for n in COMPONENTS) / total)

    def __call__(self, videos, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None) -> RewardOutput:
        verdicts = self.judge(videos, metadata)
        if prompts is not None and len(prompts) != len(verdicts):
            raise ValueError(f"got {len(verdicts)} videos but {len(prompts)} prompts")
        names = NAMES + (WINDOW_NAMES if any("window/direction" in v.components for v in verdicts) else ())
        names += RESUME_NAMES if any("resume/direction" in v.components for v in verdicts) else ()
        components = {name: torch.tensor([v.components.get(name, math.nan) for v in verdicts], dtype=torch.float32)
                      for name in names}
        scores = torch.tensor([self.combine(v.components) for v in verdicts], dtype=torch.float32)
        return RewardOutput(scores=scores, components=components)
