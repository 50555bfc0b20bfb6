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

How a stream of ``T`` frames is judged (every frame's detections come from the ``video_geneval`` detector,
``shapes`` by default; speeds and distances are in px (per frame) at 64 px, measured ones divided by
``sqrt(H W) / 64``):

- **Object trajectories.** Each object is followed by its class and colour: per frame, the detections of its class
  and colour above ``threshold`` (0.3); the one nearest to the object's predicted position (last position plus last
  velocity) is its centroid in that frame, the best-scoring one before the object was first seen. Frames without
  such a detection are gaps.
- **Judged frames of a segment**: its frames, minus the first ``grace`` (4: one latent frame of the video VAE)
  after a switch, where a model may still be turning; the first segment has no grace.

Components of the :class:`~rewards.RewardOutput` (``[B]`` float32; the eight *scored* components are in [0, 1],
1 = as asked):

=================  ================================================================================================
``adherence``      prompt adherence: per segment, ``video_geneval``'s partial credit (object, colour, identity,
                   motion / speed / still checks) on the segment's judged frames with the segment's metadata;
                   mean over segments. ``segments_strict``: the fraction of segments whose verdict is strict.
``direction``      motion word per segment and object, from the velocity fitted to its centroids on the judged
                   frames (least squares, one outlier-free refit: :func:`~rewards.geneval.video.fit_velocity`):
                   a direction earns ``max(0, cos(angle to it)) * min(1, speed / moving_speed)`` (moving_speed
                   0.5 px/frame); ``still`` earns 1 below ``still_speed`` (0.3), falling linearly to 0 at
                   ``moving_speed``; an unseen object earns 0. A segment's credit is its worst object's (the
                   segment moves as asked when every object does); mean over segments.
``speed``          the same velocities against the asked speed band: ``slowly`` 0.5-1.8, ``quickly`` >= 2.2
                   (``video_geneval``'s bands), an unnamed speed ``unnamed_speed`` = 0.5-3.5 (the world's 1-3 with
                   0.5 of margin), ``still`` 0-0.3; 1 inside, falling linearly to 0 at ``speed_margin`` (0.5
                   px/frame) outside. Worst object per segment, mean over segments.
``identity``       identity persistence: per object, the fraction of the ``T`` frames in which its class and colour
                   are seen, over ``identity_fraction`` (0.9), capped at 1. An object that changes colour or class
                   mid-stream (or vanishes) is no longer seen from then on.
``teleport``       no teleport: per object, its largest centroid jump between consecutive sightings (divided by
                   the frames between them); 1 up to ``jump_ok`` (5 px/frame, the world's fastest motion is 3),
                   falling linearly to 0 at ``jump_bad`` (10).
``smoothness``     per object, the mean norm of the second differences of its centroids (px/frame^2) over frames
                   seen three in a row, leaving out the turns the prompt asks for (from the frame before each
                   switch to the end of its grace); 1 up to ``jerk_ok`` (1.0), falling linearly to 0 at
                   ``jerk_bad`` (2.0). A piecewise-linear path scores 1 (rendered streams: at most 0.75, the
                   centroid of a pixel mask moving a fraction of a pixel per frame jitters); a jittering or
                   teleporting one does not. For these three a stream is as good as its worst object.
``recovery``       switch recovery: per switch at frame ``s``, the latency ``L`` in frames until the new motion
                   holds: windows of ``recovery_window`` (5) frames start at ``s - 1, s, ...`` (the step into
                   frame ``s`` is the new segment's); ``L`` counts the windows before the first of
                   ``recovery_hold`` (4) in a row whose fitted velocity moves as the new segment asks (in the
                   ``speed`` band and within ``recovery_tolerance`` = 20 degrees of the direction, or below
                   ``still_speed``); worst object of the switch. Credit ``max(0, 1 - L / recovery_horizon)``
                   (horizon 8 frames), 0 when it never holds. A window with one step of the old motion in four
                   already holds (a right-angle turn one step late bends the fit by 14 degrees), so a stream that
                   turns ``d`` frames late measures ``L = d - 1`` (one frame late counts as on time). Mean over
                   switches (1 for a stream without one).
``anti_freeze``    over the consecutive frame pairs whose later frame lies in a segment that asks some object to
                   move (leaving out each switch's grace), the fraction in which the frame changed: at least
                   ``freeze_pixels`` (6, at 64 x 64) pixels differ by more than ``freeze_level`` (24 of 255) in some
                   channel. A stream that stops where it should move scores the share of its motion it still shows.
                   Pixels, not tracks: a stream whose objects cannot be followed is still judged. (The role of
                   VBench's dynamic degree, arXiv 2311.17982: consistency alone is won by a frozen video.)
=================  ================================================================================================

Also: ``consistency`` (mean of ``identity``, ``teleport``, ``smoothness``); per segment ``k < 4``,
``segment<k>/adherence``, ``segment<k>/direction``, ``segment<k>/speed`` and ``segment<k>/recovery`` (the switch into
segment k; NaN for segment 0), NaN where the stream has fewer segments; and measurements that are not scores:
``recovery_frames`` (mean latency over switches, the segment's length when never recovered; NaN without a switch),
``max_jump_px`` (largest jump, px/frame) and ``jerk_px`` (mean second-difference norm over the objects).

``scores`` is the weighted mean of the eight scored components (``weights``, all 1 by default: prompt adherence
counts three times -- ``adherence``, ``direction``, ``speed`` -- temporal consistency three times, switching and
freezing once each), or one component alone with ``score="<component>"``: each is a reward of its own, e.g.
``rewards.load("long_video", score="recovery")``.

A degenerate stream (every frame uniform or pure noise: :func:`rewards.images.degenerate`) scores 0 on every scored
component (measurements NaN); streams holding NaN or inf raise ``ValueError`` naming them, as every video reward
does. A stream's frame count must equal its metadata's ``num_frames``.

Measured on rendered streams of the held-out prompts (``tests/test_stream_rewards.py``; 30 positives, 10 negatives
per kind): positives score 1.00, clean or blurred (Gaussian, sigma 1 px); the highest-scoring negative of each kind:
a wrong direction in one segment 0.965, a switch taken 8 frames late 0.96, a switch ignored 0.92, an object changing
class 0.92 or colour 0.77 mid-stream, a teleport 0.875, motion frozen after a switch 0.83, a frozen stream 0.65 --
each with the component that judges it low (the test states the margins). An error in one segment of a four-segment
stream costs that segment's share of the mean: pick ``score=`` or ``weights=`` to weigh one failure more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from .base import RewardOutput, register
from .geneval.rules import Detection
from .geneval.video import DIRECTIONS, VideoGenEval, VideoVerdict, _centroid, fit_velocity, validate_video_metadata
from .images import degenerate
from .video import to_video

__all__ = [
    "COMPONENTS",
    "NAMES",
    "SEGMENT_COMPONENTS",
    "STREAM_SEGMENT_TAGS",
    "STREAM_TAGS",
    "LongVideoReward",
    "StreamVerdict",
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
SEGMENT_COMPONENTS = 4  # segment<k>/<name> for k < 4 (the world's streams have at most 3 switches)
PER_SEGMENT: tuple[str, ...] = ("adherence", "direction", "speed", "recovery")
MEASUREMENTS: tuple[str, ...] = ("recovery_frames", "max_jump_px", "jerk_px")
#: every component name, in the order of RewardOutput.components
NAMES: tuple[str, ...] = (*COMPONENTS, "consistency", "segments_strict",
                          *(f"segment{k}/{n}" for k in range(SEGMENT_COMPONENTS) for n in PER_SEGMENT), *MEASUREMENTS)


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
        if require_switches and k > 0 and not asks_differ(segment_asks(segments[k - 1]), segment_asks(segment)):
            raise ValueError(f"{here}: asks the same motion as {where}.segments[{k - 1}] "
                             f"({segment_asks(segment)}); consecutive segments must ask different motions")
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
        jump_ok, jump_bad: ``teleport`` ramp (px/frame at 64 px).
        jerk_ok, jerk_bad: ``smoothness`` ramp (px/frame^2 at 64 px).
        recovery_window, recovery_hold, recovery_horizon: ``recovery`` (frames).
        recovery_tolerance: largest angle (degrees) between a window's velocity and the asked direction.
        speed_margin: px/frame outside a speed band over which ``speed`` credit falls to 0.
        unnamed_speed: the band of a direction without a speed word (px/frame).
        freeze_level, freeze_pixels: what counts as a changed frame for ``anti_freeze`` (grey levels of 255;
            pixels at 64 x 64, scaled with the frame area).
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
        freeze_level: float = 24.0,
        freeze_pixels: float = 6.0,
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
                            ("recovery_hold", recovery_hold - 1), ("recovery_horizon", recovery_horizon - 1)):
            if int(value) != value or value < 0:
                raise ValueError(f"long_video {name} is too small or not an int (grace >= 0, recovery_window >= 2, "
                                 f"recovery_hold >= 1, recovery_horizon >= 1)")
        for name, (ok, bad) in (("jump_ok/jump_bad", (jump_ok, jump_bad)), ("jerk_ok/jerk_bad", (jerk_ok, jerk_bad))):
            if not 0 <= ok < bad:
                raise ValueError(f"long_video {name} must satisfy 0 <= ok < bad, got {ok}, {bad}")
        if not 0.0 < identity_fraction <= 1.0:
            raise ValueError(f"long_video identity_fraction={identity_fraction} must be in (0, 1]")
        if len(unnamed_speed) != 2 or not 0 <= unnamed_speed[0] < unnamed_speed[1]:
            raise ValueError(f"long_video unnamed_speed must be [lo, hi] with 0 <= lo < hi, got {unnamed_speed!r}")
        if speed_margin <= 0:
            raise ValueError(f"long_video speed_margin={speed_margin} must be > 0")
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
        self.freeze_level = float(freeze_level)
        self.freeze_pixels = float(freeze_pixels)

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

    def _direction_credit(self, v: tuple[float, float], motion: str) -> float:
        s = math.hypot(*v)
        moving, still = self.geneval.moving_speed, self.geneval.still_speed
        if motion == "still":
            return _ramp(s, still, moving) if moving > still else float(s <= still)
        if s == 0:
            return 0.0
        ux, uy = DIRECTIONS[motion]
        return max(0.0, (v[0] * ux + v[1] * uy) / s) * (min(1.0, s / moving) if moving > 0 else 1.0)

    def _speed_credit(self, v: tuple[float, float], motion: str, speed: str | None) -> float:
        s = math.hypot(*v)
        lo, hi = self._band(motion, speed)
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
        return StreamVerdict(comps, reason=f"degenerate stream ({why} frames): no content, scored 0")

    def _trajectory(self, detections: Sequence[Mapping[str, Sequence[Detection]]], cls: str, color: str) -> np.ndarray:
        """``[T, 2]`` centroids (px) of one object followed by class and colour; NaN where unseen (module doc)."""
        out = np.full((len(detections), 2), np.nan)
        last, velocity, seen_at = None, np.zeros(2), None
        for t, dets in enumerate(detections):
            mine = [d for d in dets.get(cls, []) if float(d.score) > self.geneval.threshold and d.color == color]
            if not mine:
                continue
            points = np.array([_centroid(d) for d in mine])
            if last is None:
                j = int(np.argmax([float(d.score) for d in mine]))
            else:
                j = int(np.argmin(np.linalg.norm(points - (last + velocity * (t - seen_at)), axis=1)))
            if last is not None:
                velocity = (points[j] - last) / (t - seen_at)
            last, seen_at = points[j], t
            out[t] = points[j]
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
        reasons: list[str] = []
        comps: dict[str, float] = {}

        # prompt adherence per segment: video_geneval on the judged frames
        seg_verdicts = [self.geneval.judge_clip(detections[lo:hi], seg, (H, W))
                        for (lo, hi), seg in zip(judged, segments)]
        for k, v in enumerate(seg_verdicts):
            if not v.strict:
                reasons.append(f"segment {k} ({segments[k]['prompt']!r}): {v.reason}")
        comps["adherence"] = float(np.mean([v.partial for v in seg_verdicts]))
        comps["segments_strict"] = float(np.mean([v.strict for v in seg_verdicts]))

        # trajectories, motion per segment
        paths = [self._trajectory(detections, cls, color) for cls, color in objects]
        units = [p / scale for p in paths]  # px at 64 px
        t_all = np.arange(T)

        def velocity(u: np.ndarray, lo: int, hi: int) -> tuple[float, float] | None:
            seen = ~np.isnan(u[lo:hi, 0])
            if seen.sum() < 2:
                return None
            return fit_velocity(t_all[lo:hi][seen].tolist(), [tuple(p) for p in u[lo:hi][seen]], outlier_px=1.5)

        velocities, direction, speed = [], [], []
        for k, ((lo, hi), seg) in enumerate(zip(judged, segments)):
            per_object, d_k, s_k = [], [], []
            for j, (motion, word) in enumerate(segment_asks(seg)):
                v = velocity(units[j], lo, hi)
                per_object.append(v)
                d_k.append(0.0 if v is None else self._direction_credit(v, motion))
                s_k.append(0.0 if v is None else self._speed_credit(v, motion, word))
                if d_k[-1] < 0.99 or s_k[-1] < 0.99:
                    seen = "unseen" if v is None else f"moves ({v[0]:+.2f}, {v[1]:+.2f}) px/frame"
                    asked = motion if word is None else f"{motion} {word}"
                    reasons.append(f"segment {k} object {j}: asked {asked}, {seen}")
            velocities.append(per_object)
            direction.append(min(d_k))
            speed.append(min(s_k))
        comps["direction"], comps["speed"] = float(np.mean(direction)), float(np.mean(speed))

        # temporal consistency: identity, teleport, smoothness
        identity, teleport, smooth, jumps, jerks = [], [], [], [], []
        turns = np.zeros(T, dtype=bool)
        for start, _ in bounds[1:]:
            turns[max(0, start - 1) : start + self.grace] = True
        for j, u in enumerate(units):
            seen = ~np.isnan(u[:, 0])
            identity.append(min(1.0, seen.sum() / (self.identity_fraction * T)))
            if identity[-1] < 1.0:
                reasons.append(f"identity: {' '.join(objects[j][::-1])} seen in {int(seen.sum())}/{T} frames")
            at = np.nonzero(seen)[0]
            if len(at) >= 2:
                jump = float((np.linalg.norm(np.diff(u[at], axis=0), axis=1) / np.diff(at)).max())
            else:
                jump = math.inf
            jumps.append(jump)
            teleport.append(_ramp(jump, self.jump_ok, self.jump_bad) if math.isfinite(jump) else 0.0)
            if teleport[-1] < 1.0:
                reasons.append(f"teleport: {' '.join(objects[j][::-1])} jumps {jump:.1f} px/frame")
            mid = np.array([t for t in range(1, T - 1) if seen[t - 1] and seen[t] and seen[t + 1] and not turns[t]])
            if len(mid):
                second = u[mid + 1] - 2 * u[mid] + u[mid - 1]
                jerk = float(np.linalg.norm(second, axis=1).mean())
                smooth.append(_ramp(jerk, self.jerk_ok, self.jerk_bad))
            else:
                jerk = math.nan
                smooth.append(0.0)
            jerks.append(jerk)
            if smooth[-1] < 1.0:
                reasons.append(f"smoothness: {' '.join(objects[j][::-1])} second differences {jerk:.2f} px/frame^2")
        for name, values in (("identity", identity), ("teleport", teleport), ("smoothness", smooth)):
            comps[name] = float(min(values))
        comps["consistency"] = float(np.mean([comps["identity"], comps["teleport"], comps["smoothness"]]))
        comps["max_jump_px"] = float(max(jumps)) if all(math.isfinite(x) for x in jumps) else math.nan
        comps["jerk_px"] = float(np.nanmean(jerks)) if not all(math.isnan(x) for x in jerks) else math.nan

        # switch recovery
        latencies: list[int | None] = []
        credits = []
        w, hold = self.recovery_window, self.recovery_hold
        for k in range(1, len(segments)):
            start, end = bounds[k]
            worst = 0
            for j, (motion, word) in enumerate(segment_asks(segments[k])):
                ok = []
                for t in range(start - 1, end - w + 1):  # the step into frame `start` is the new segment's
                    seen = ~np.isnan(units[j][t : t + w, 0])
                    v = velocity(units[j], t, t + w) if seen.sum() >= w - 1 else None
                    ok.append(v is not None and self._holds(v, motion, word))
                latency = next((i for i in range(len(ok)) if all(ok[i : i + hold])), None)
                worst = None if latency is None or worst is None else max(worst, latency)
            latencies.append(worst)
            credits.append(0.0 if worst is None else max(0.0, 1.0 - worst / self.recovery_horizon))
            if credits[-1] < 1.0:
                said = "never" if worst is None else f"after {worst} frames"
                reasons.append(f"recovery: switch to segment {k} (frame {start}) held {said}")
        comps["recovery"] = float(np.mean(credits)) if credits else 1.0
        per_segment = {"adherence": [v.partial for v in seg_verdicts], "direction": direction, "speed": speed,
                       "recovery": [math.nan, *credits]}
        for k in range(SEGMENT_COMPONENTS):
            for name, values in per_segment.items():
                comps[f"segment{k}/{name}"] = float(values[k]) if k < len(segments) else math.nan
        comps["recovery_frames"] = (float(np.mean([end - start if lat is None else lat for lat, (start, end)
                                                   in zip(latencies, bounds[1:])])) if latencies else math.nan)

        # anti-freeze: frames keep changing where motion is asked
        level = self.freeze_level
        changed = (np.abs(frames[1:].astype(np.int16) - frames[:-1].astype(np.int16)).max(axis=-1) > level)
        changed = changed.reshape(T - 1, -1).sum(axis=1) >= self.freeze_pixels * (H * W) / 4096.0
        asked = np.zeros(T, dtype=bool)
        for k, ((lo, hi), seg) in enumerate(zip(judged, segments)):
            if any(m != "still" for m, _ in segment_asks(seg)):
                asked[max(lo, 1) : hi] = True
        pairs = np.nonzero(asked)[0]
        comps["anti_freeze"] = float(changed[pairs - 1].mean()) if len(pairs) else 1.0
        if comps["anti_freeze"] < 1.0:
            reasons.append(f"anti_freeze: {int((~changed[pairs - 1]).sum())} of {len(pairs)} frames asked to move "
                           "do not change")
        return StreamVerdict(comps, seg_verdicts, velocities, latencies, paths, "; ".join(reasons))

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
        components = {name: torch.tensor([v.components[name] for v in verdicts], dtype=torch.float32)
                      for name in NAMES}
        scores = torch.tensor([self.combine(v.components) for v in verdicts], dtype=torch.float32)
        return RewardOutput(scores=scores, components=components)
