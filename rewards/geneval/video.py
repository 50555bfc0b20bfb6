"""The ``video_geneval`` reward: GenEval's rules per frame, plus tracks for motion, speed and identity.

Judges text-to-video clips of moving shapes against GenEval-style metadata whose clauses carry two more fields,
``motion`` (``left / right / up / down / still``) and ``speed`` (``slowly / quickly``), under the six video tags
:data:`VIDEO_TAGS` (``motion``, ``two_object_motion``, ``counting``, ``colors``, ``speed``, ``static``)::

    {"tag": "speed", "include": [{"class": "square", "count": 1, "color": "black", "motion": "right",
                                  "speed": "quickly"}], "prompt": "a black square moving quickly to the right"}

How a clip is judged (``T`` frames, each ``H x W``):

1. **Detections per frame** by the image detector (``shapes``: :class:`~rewards.geneval.shapes.ShapesDetector`,
   the classical one for the embedded world; or any GenEval detector), selected per frame as GenEval does
   (:func:`~rewards.geneval.rules.select_detections`: score above ``threshold`` = 0.3, and above
   ``counting_threshold`` for the ``counting`` tag). GenEval's images use 0.9 there; clips default to 0.6: the
   count must hold on 12 of 13 frames (below), evidence no single frame gives, while per frame the small yellow
   shapes of the world score 0.7-0.9 after JPEG compression (quality 50): at 0.9, 8 of 108 JPEG-compressed counting
   positives failed for that alone, none at 0.6. 0.6 stays above 0.5, the score of a shape the detector finds
   equally likely to be two classes, and specks stay below 0.3.
2. **Frame checks**, GenEval's own rules (:func:`~rewards.geneval.rules.geneval_correct`) on each frame:
   ``object`` (every clause finds at least ``count`` objects of its class), ``color`` (the clause's top ``count``
   objects have its colour), ``count`` (only where the metadata has ``exclude`` clauses, i.e. ``counting``:
   exactly ``count``). A frame check holds for the clip when it holds on at least ``frame_fraction`` = 0.8 of
   the frames (11 of 13): one or two frames where the detector slips (a blurred small square read as a circle)
   do not flip the verdict, while an object missing on three frames fails. ``count`` is
   stricter, ``count_fraction`` = 0.9 (12 of 13): the count must hold in every frame but at most one, so a
   count that changes mid-clip (an object vanishing or appearing anywhere between frames 2 and 11) fails.
3. **Tracks.** Objects are linked across frames per (class, colour): detections above 0.3, centroids of their
   masks (box centres without one), matched greedily to each open track's predicted position (last position plus
   the track's velocity so far) within ``match_radius`` = 8 px (at 64 px; the world's objects move at most 3
   px/frame and their centres are at least 16 px apart); a track may skip up to ``max_gap`` = 3 frames. Each
   track's velocity ``(vx, vy)`` in px/frame is the least-squares slope of its centroids over its frames, refit
   once without points more than ``max(1.5 px, 3 x median residual)`` off the line (a frame's bad mask does not
   bend it). Speeds are in px/frame at 64 px: measured velocities are divided by ``sqrt(H W) / 64``.
4. **Track checks**, on a clause's *long* tracks, those of its class and colour present on at least
   ``track_fraction`` = 0.8 of the frames:

   - ``identity``: every clause has at least ``count`` long tracks. Matching keeps class and colour, so an object
     whose colour or class changes mid-clip, two objects that swap colours, or an object that jumps farther than
     the match radius, splits into short tracks and fails -- even when every single frame looks right.
   - ``motion`` (a direction): at least ``count`` long tracks move at ``>= moving_speed`` = 0.5 px/frame within
     ``direction_tolerance`` = 45 degrees of the named direction (image ``y`` grows downwards, so ``up`` is
     ``-y``). The renderer's slowest motion is 1.0 px/frame; 0.5 leaves room for a slow generator and is still
     far above the measurement error (on rendered clips, clean, blurred or JPEG-compressed, measured velocities
     are within 0.05 px/frame of the drawn ones).
     +-45 degrees splits the plane between the four directions, so a perpendicular or opposite motion fails.
   - ``speed``: ``slowly`` is 0.5-1.8 px/frame, ``quickly`` at least 2.2 px/frame (``speed_bands``). The renderer
     draws slowly at 1.0-1.4 and quickly at 2.6-3.0; each band keeps 0.4 px/frame of margin past its range, and
     1.8-2.2 (between the ranges) is neither.
   - ``still``: at least ``count`` long tracks move at ``< still_speed`` = 0.3 px/frame (under a third of the
     slowest rendered motion, six times the measurement error).

   Clauses without ``motion`` (``colors``, ``counting``) have no motion check: their objects may move anyhow.

The clip passes (``strict`` = 1) when every check that applies holds: ``object`` and ``identity`` always, ``color``
for clauses with a colour, ``count`` with exclude clauses, ``motion`` / ``speed`` / ``still`` for clauses naming
them. ``partial`` is the mean over the applicable checks of a credit in [0, 1] that is 1 exactly when the check
holds (so ``partial == 1`` iff ``strict == 1``): for a frame check, per clause ``min(1, fraction of frames /
required fraction)``; for ``identity``, per clause the mean over its ``count`` longest tracks of ``min(1,
coverage / track_fraction)``; for a motion check, per clause the fraction of its ``count`` objects that pass;
clause credits are averaged per check.

Components of the :class:`~rewards.RewardOutput` (all ``[B]`` float32):

- ``strict``, ``partial``: the verdict and the partial credit (``score=`` picks which is ``scores``, strict by
  default);
- ``strict/<tag>``, ``partial/<tag>`` for the six video tags: the sample's value where it has that tag, NaN
  elsewhere, as :class:`~rewards.GenEval` does (:func:`~rewards.geneval_summary` reports the per-tag means and the
  overall score, the mean over tags);
- ``check/<name>`` for the seven checks (:data:`CHECKS`): 0/1, NaN where the prompt has no such clause;
- ``frozen``: a diagnostic, not part of ``partial``: 1 where the prompt asks for a direction and the clip shows the
  object(s) but holds them still -- every clause naming a direction has a long track and all its long tracks move at
  ``< still_speed`` -- 0 where it moves them (rightly or not) or shows none, NaN where no clause names a direction.
  Its held-out mean is the share of motion prompts answered by a frozen clip: the shortcut a temporal-consistency
  term rewards (a clip that does not change is perfectly consistent).

A degenerate clip -- every frame uniform (all black, all white, one flat colour) or pure noise
(:func:`rewards.images.degenerate`) -- is judged as showing no object in any frame: every applicable check fails,
``partial`` and ``strict`` are 0 (the reason says why) and the detector never sees it. Clips holding NaN or inf
raise ``ValueError`` naming the samples (a diverged model; cast to uint8 they would read as black).

A clip's speed is measured per frame, so it assumes the world's frame rate (13 frames per clip); judge generated
clips at the frame count the prompts were written for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from ..base import RewardOutput, register
from ..images import degenerate
from ..video import to_video
from .rules import (
    MAX_OBJECTS,
    THRESHOLD,
    Detection,
    geneval_correct,
    select_detections,
    validate_metadata,
)
from .shapes import ShapesDetector

__all__ = [
    "CHECKS",
    "DIRECTIONS",
    "SPEED_BANDS",
    "VIDEO_TAGS",
    "VideoGenEval",
    "VideoTrack",
    "VideoVerdict",
    "fit_velocity",
    "link_tracks",
    "validate_video_metadata",
]

VIDEO_TAGS: tuple[str, ...] = ("motion", "two_object_motion", "counting", "colors", "speed", "static")
# unit vectors of the named directions, image coordinates (y grows downwards: "up" is -y)
DIRECTIONS: dict[str, tuple[float, float]] = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0),
                                              "down": (0.0, 1.0)}
MOTIONS: tuple[str, ...] = (*DIRECTIONS, "still")
SPEED_BANDS: dict[str, tuple[float, float]] = {"slowly": (0.5, 1.8), "quickly": (2.2, math.inf)}
CHECKS: tuple[str, ...] = ("object", "color", "count", "motion", "speed", "still", "identity")
SCORES: tuple[str, ...] = ("strict", "partial")
COUNTING_THRESHOLD_VIDEO = 0.6  # per-frame cut for the counting tag (GenEval's images: 0.9); module doc, step 1


# ------------------------------------------------------------------------------------------------- metadata


#: the keys an include clause of a video prompt may have ("position" is known so that it is refused by name)
VIDEO_INCLUDE_KEYS = ("class", "count", "color", "motion", "speed", "position")


def validate_video_metadata(metadata: object, classes: Sequence[str] | None = None, colors: Sequence[str] | None = None,
                            where: str = "metadata") -> dict:
    """Check one video metadata dict; raise ``ValueError`` naming the offending field. The image world's validator
    (:func:`rewards.geneval.rules.validate_metadata`) with the video tags, the video clause keys and the motion
    words in place of positions."""
    return validate_metadata(metadata, classes, colors, where, tags=VIDEO_TAGS, include_keys=VIDEO_INCLUDE_KEYS,
                             check_include=_check_motion, kind="video GenEval")


def _check_motion(clause: Mapping, where: str, index: int) -> None:
    """A video include clause: no position; ``motion`` one of :data:`MOTIONS`; ``speed`` a band, with a direction."""
    if clause.get("position") is not None:
        raise ValueError(f"{where}.position: video_geneval judges no positions (the video tags have none)")
    motion, speed = clause.get("motion"), clause.get("speed")
    if motion is not None and motion not in MOTIONS:
        raise ValueError(f"{where}.motion: expected one of {MOTIONS}, got {motion!r}")
    if speed is not None:
        if speed not in SPEED_BANDS:
            raise ValueError(f"{where}.speed: expected one of {tuple(SPEED_BANDS)}, got {speed!r}")
        if motion not in DIRECTIONS:
            raise ValueError(f"{where}.speed: a speed needs a direction in 'motion' ({tuple(DIRECTIONS)}), "
                             f"got {motion!r}")


# --------------------------------------------------------------------------------------------------- tracks


@dataclass
class VideoTrack:
    """One object followed across frames: its class and colour, the frames it was seen in, its centroids
    (px, at the clip's resolution) and its least-squares velocity in px/frame at 64 px."""

    cls: str
    color: str | None
    frames: list[int]
    points: list[tuple[float, float]]
    velocity: tuple[float, float] = (0.0, 0.0)

    @property
    def speed(self) -> float:
        return math.hypot(*self.velocity)

    def coverage(self, num_frames: int) -> float:
        return len(self.frames) / num_frames


def _centroid(det: Detection) -> tuple[float, float]:
    if det.mask is not None and det.mask.any():
        ys, xs = np.nonzero(det.mask)
        return float(xs.mean()) + 0.5, float(ys.mean()) + 0.5
    x1, y1, x2, y2 = det.box[:4]
    return 0.5 * (x1 + x2), 0.5 * (y1 + y2)


def fit_velocity(frames: Sequence[int], points: Sequence[tuple[float, float]],
                 outlier_px: float = 1.5) -> tuple[float, float]:
    """Least-squares slope ``(vx, vy)`` of points over frames, refit once without outliers (module doc, step 3)."""
    t = np.asarray(frames, dtype=np.float64)
    p = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    if len(t) < 2 or np.ptp(t) == 0:
        return 0.0, 0.0

    def solve(keep):
        tk, pk = t[keep], p[keep]
        tc = tk - tk.mean()
        slope = (tc[:, None] * (pk - pk.mean(0))).sum(0) / (tc * tc).sum()
        return slope, pk.mean(0) - slope * tk.mean()

    keep = np.ones(len(t), dtype=bool)
    slope, icpt = solve(keep)
    resid = np.linalg.norm(p - (icpt + t[:, None] * slope), axis=1)
    keep = resid <= max(outlier_px, 3.0 * float(np.median(resid)))
    if 2 <= keep.sum() < len(t) and np.ptp(t[keep]) > 0:
        slope, _ = solve(keep)
    return float(slope[0]), float(slope[1])


def link_tracks(points_per_frame: Sequence[Sequence[tuple[float, float]]], match_radius: float, max_gap: int
                ) -> list[tuple[list[int], list[tuple[float, float]]]]:
    """Greedy nearest-centroid linking of one group's points across frames: ``[(frames, points), ...]``.

    Each open track predicts its position (last point + its velocity so far); pairs (track, point) are taken in
    order of distance while both are free and closer than ``match_radius``; a point left over opens a track, a
    track unseen for more than ``max_gap`` frames closes."""
    tracks: list[tuple[list[int], list[tuple[float, float]]]] = []
    for f, pts in enumerate(points_per_frame):
        open_ = [k for k, (fr, _) in enumerate(tracks) if f - fr[-1] <= max_gap + 1]
        pairs = []
        for k in open_:
            fr, ps = tracks[k]
            vx, vy = fit_velocity(fr[-4:], ps[-4:]) if len(fr) >= 2 else (0.0, 0.0)
            px, py = ps[-1][0] + vx * (f - fr[-1]), ps[-1][1] + vy * (f - fr[-1])
            for j, (x, y) in enumerate(pts):
                d = math.hypot(x - px, y - py)
                if d <= match_radius:
                    pairs.append((d, k, j))
        used_tracks, used_points = set(), set()
        for _, k, j in sorted(pairs):
            if k in used_tracks or j in used_points:
                continue
            used_tracks.add(k)
            used_points.add(j)
            tracks[k][0].append(f)
            tracks[k][1].append(pts[j])
        tracks += [([f], [p]) for j, p in enumerate(pts) if j not in used_points]
    return tracks


# --------------------------------------------------------------------------------------------------- verdict


@dataclass
class VideoVerdict:
    """The judgement of one clip.

    ``checks``: the applicable checks' verdicts; ``credits``: their partial credits (1.0 iff the check holds);
    ``frame_checks``: per applicable frame check, per clause, the per-frame verdicts; ``tracks``: every track
    built for the clip's clauses, keyed ``(class, colour)``."""

    strict: bool
    partial: float
    checks: dict[str, bool]
    credits: dict[str, float]
    reason: str
    frame_checks: dict[str, list[list[bool]]] = field(default_factory=dict, repr=False)
    tracks: dict[tuple[str, str | None], list[VideoTrack]] = field(default_factory=dict, repr=False)
    frozen: float = math.nan


def _clause_name(clause: Mapping) -> str:
    return " ".join(str(w) for w in (clause.get("color"), clause["class"]) if w)


@register("video_geneval")
class VideoGenEval:
    """GenEval for moving-shapes clips: ``reward(videos, prompts, metadata) -> RewardOutput`` (module doc).

    Args:
        detector: ``"shapes"`` (default), ``"real"`` or a GenEval detector object, as for :class:`~rewards.GenEval`;
            it sees every frame as an image.
        score: the training scalar, ``"strict"`` (0/1, default) or ``"partial"``; both are always components.
        threshold, counting_threshold, max_objects: GenEval's per-frame selection (``counting_threshold`` 0.6, not
            GenEval's 0.9: module doc, step 1).
        frame_fraction, count_fraction, track_fraction: fractions of frames a frame check, the count check and a
            clause's tracks must cover.
        match_radius, max_gap: track linking (px at 64 px, frames).
        direction_tolerance, moving_speed, still_speed, speed_bands: the motion checks (degrees, px/frame at 64 px).
        **detector_kwargs: passed to the named detector.

    >>> import numpy as np, rewards
    >>> clip = np.full((13, 64, 64, 3), 255, np.uint8)
    >>> for t in range(13):
    ...     clip[t, 25:35, 10 + 2 * t : 20 + 2 * t] = (220, 30, 30)          # a red square moving right
    >>> meta = {"tag": "motion", "include": [{"class": "square", "count": 1, "color": "red", "motion": "right"}]}
    >>> out = rewards.load("video_geneval")([clip], ["a red square moving right"], [meta])
    >>> out.scores.tolist(), out.components["check/motion"].tolist()
    ([1.0], [1.0])
    >>> bad = {"tag": "motion", "include": [{"class": "square", "count": 1, "color": "red", "motion": "left"}]}
    >>> rewards.load("video_geneval", score="partial")([clip], None, [bad]).scores.tolist()   # 3 of 4 checks
    [0.75]
    """

    def __init__(
        self,
        detector: str | object = "shapes",
        *,
        score: str = "strict",
        threshold: float = THRESHOLD,
        counting_threshold: float = COUNTING_THRESHOLD_VIDEO,
        max_objects: int = MAX_OBJECTS,
        frame_fraction: float = 0.8,
        count_fraction: float = 0.9,
        track_fraction: float = 0.8,
        match_radius: float = 8.0,
        max_gap: int = 3,
        direction_tolerance: float = 45.0,
        moving_speed: float = 0.5,
        still_speed: float = 0.3,
        speed_bands: Mapping[str, Sequence[float | None]] | None = None,
        **detector_kwargs,
    ):
        if score not in SCORES:
            raise ValueError(f"video_geneval score={score!r} is not one of {', '.join(SCORES)}")
        if detector == "shapes":
            self.detector = ShapesDetector(**detector_kwargs)
        elif detector == "real":
            from .real import RealDetector  # transformers is imported only for this path

            self.detector = RealDetector(**detector_kwargs)
        elif isinstance(detector, str):
            raise ValueError(f"unknown video_geneval detector {detector!r}; expected 'shapes' or 'real' "
                             "(or a detector object)")
        elif callable(detector):
            if detector_kwargs:
                raise ValueError(f"detector kwargs {sorted(detector_kwargs)} given with a ready-made detector object")
            self.detector = detector
        else:
            raise ValueError(f"detector must be 'shapes', 'real' or a callable, got {type(detector).__name__}")
        for name, value in (("frame_fraction", frame_fraction), ("count_fraction", count_fraction),
                            ("track_fraction", track_fraction)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"video_geneval {name}={value} must be in (0, 1]")
        if not 0.0 <= still_speed <= moving_speed:
            raise ValueError(f"video_geneval needs 0 <= still_speed <= moving_speed, got {still_speed}, {moving_speed}")
        if not 0.0 < direction_tolerance <= 180.0:
            raise ValueError(f"video_geneval direction_tolerance={direction_tolerance} must be in (0, 180] degrees")
        bands = dict(SPEED_BANDS)
        for word, band in (speed_bands or {}).items():
            if word not in SPEED_BANDS or len(band) != 2:
                raise ValueError(f"video_geneval speed_bands: expected {{slowly|quickly: [lo, hi]}}, "
                                 f"got {word!r}: {band!r}")
            bands[word] = (float(band[0]), math.inf if band[1] is None else float(band[1]))
        self.score = score
        self.threshold = threshold
        self.counting_threshold = counting_threshold
        self.max_objects = max_objects
        self.frame_fraction = frame_fraction
        self.count_fraction = count_fraction
        self.track_fraction = track_fraction
        self.match_radius = match_radius
        self.max_gap = int(max_gap)
        self.direction_tolerance = direction_tolerance
        self.moving_speed = moving_speed
        self.still_speed = still_speed
        self.speed_bands = bands

    # ------------------------------------------------------------------------------------------------ judging

    def check_metadata(self, metadata: dict) -> None:
        """Raise ``ValueError`` naming the field when one metadata record does not fit this reward's schema
        (tag, clauses, motion words, and the detector's classes and colours): lets a trainer check a prompt file
        up front."""
        validate_video_metadata(metadata, getattr(self.detector, "classes", None),
                                getattr(self.detector, "colors", None), where="record")

    def judge(self, videos, metadata: Sequence[dict] | None) -> list[VideoVerdict]:
        """Per-clip verdicts (checks, credits, reasons, tracks) -- what ``__call__`` condenses into tensors."""
        u8 = to_video(videos, reward="video_geneval")
        flags = degenerate(u8)
        clips = u8.permute(0, 1, 3, 4, 2).numpy()  # uint8 [B, T, H, W, 3]
        if metadata is None:
            raise ValueError("video_geneval needs one metadata dict per clip (argument 'metadata'), got None")
        if isinstance(metadata, Mapping):
            raise ValueError("metadata must be a list with one metadata dict per clip, got a single dict")
        metadata = list(metadata)
        if len(metadata) != len(clips):
            raise ValueError(f"got {len(clips)} clips but {len(metadata)} metadata dicts")
        classes = getattr(self.detector, "classes", None)
        colors = getattr(self.detector, "colors", None)
        metadata = [validate_video_metadata(m, classes, colors, where=f"metadata[{i}]") for i, m in enumerate(metadata)]
        B, T = clips.shape[:2]
        content = [b for b in range(B) if flags[b] is None]
        frames = [clips[b, t] for b in content for t in range(T)]
        found = self.detector(frames, [metadata[b] for b in content for _ in range(T)]) if content else []
        detections: list = [{} for _ in range(B * T)]  # a degenerate clip shows no object in any frame
        for k, b in enumerate(content):
            detections[b * T : (b + 1) * T] = found[k * T : (k + 1) * T]
        verdicts = []
        for b in range(B):
            verdict = self.judge_clip(detections[b * T : (b + 1) * T], metadata[b], clips.shape[2:4])
            if flags[b] is not None:
                verdict.reason = f"degenerate clip ({flags[b]} frames): no content, scored 0"
            verdicts.append(verdict)
        return verdicts

    def judge_clip(self, detections: Sequence[Mapping[str, Sequence[Detection]]], metadata: Mapping,
                   frame_size: tuple[int, int]) -> VideoVerdict:
        """The verdict of one clip from its per-frame detections (``{class: [Detection]}`` per frame)."""
        T = len(detections)
        scale = math.sqrt(frame_size[0] * frame_size[1]) / 64.0
        include = list(metadata["include"])
        exclude = list(metadata.get("exclude") or [])
        kept = [select_detections(d, metadata["tag"], self.threshold, self.counting_threshold, self.max_objects)
                for d in detections]
        reasons: list[str] = []
        checks: dict[str, bool] = {}
        credits: dict[str, float] = {}
        frame_checks: dict[str, list[list[bool]]] = {}

        def frame_check(name: str, per_clause: list[tuple[str, list[bool]]], fraction: float) -> None:
            ok, credit = True, []
            for label, hits in per_clause:
                frac = sum(hits) / T
                credit.append(min(1.0, frac / fraction))
                if frac < fraction:
                    ok = False
                    reasons.append(f"{name}: {label} holds in {sum(hits)}/{T} frames (needs {fraction:.0%})")
            checks[name], credits[name] = ok, float(np.mean(credit))
            frame_checks[name] = [hits for _, hits in per_clause]

        bare = [{"class": c["class"], "count": int(c["count"])} for c in include]
        frame_check("object", [(f"{c['class']}>={c['count']}", [geneval_correct(k, {"include": [c]})[0] for k in kept])
                               for c in bare], self.frame_fraction)
        coloured = [{**b, "color": c["color"]} for b, c in zip(bare, include) if c.get("color") is not None]
        if coloured:
            frame_check("color", [(f"{c['color']} {c['class']}>={c['count']}",
                                   [geneval_correct(k, {"include": [c]})[0] for k in kept]) for c in coloured],
                        self.frame_fraction)
        if exclude:
            rule = {"include": bare, "exclude": exclude}
            label = " and ".join(f"{c['class']}=={c['count']}" for c in bare)
            frame_check("count", [(label, [geneval_correct(k, rule)[0] for k in kept])], self.count_fraction)

        tracks = self._tracks(detections, include, scale)
        ident_ok, ident_credit = True, []
        motion: dict[str, list[tuple[bool, float]]] = {"motion": [], "speed": [], "still": []}
        held: list[bool] = []  # per clause naming a direction: shown (a long track) and every long track still
        for clause in include:
            n = int(clause["count"])
            mine = sorted(tracks[(clause["class"], clause.get("color"))], key=lambda tr: -len(tr.frames))
            long_ = [tr for tr in mine if tr.coverage(T) >= self.track_fraction]
            ident_credit.append(sum(min(1.0, tr.coverage(T) / self.track_fraction) for tr in mine[:n]) / n)
            if len(long_) < n:
                ident_ok = False
                seen = ", ".join(f"{len(tr.frames)}" for tr in mine[: n + 1]) or "none"
                reasons.append(f"identity: {_clause_name(clause)} needs {n} track(s) over {self.track_fraction:.0%} of "
                               f"{T} frames, longest cover {seen}")
            word = clause.get("motion")
            if word is None:
                continue
            kind = "still" if word == "still" else "motion"
            if word in DIRECTIONS:
                held.append(bool(long_) and all(tr.speed < self.still_speed for tr in long_))
            passing = sum(self._moves(tr, word) for tr in long_)
            motion[kind].append((passing >= n, min(passing, n) / n))
            if passing < n:
                reasons.append(f"{kind}: {_clause_name(clause)} expected {word}, tracks move "
                               f"{self._describe(long_) or 'no long track'}")
            if clause.get("speed") is not None:
                lo, hi = self.speed_bands[clause["speed"]]
                fast = sum(lo <= tr.speed <= hi for tr in long_)
                motion["speed"].append((fast >= n, min(fast, n) / n))
                if fast < n:
                    reasons.append(f"speed: {_clause_name(clause)} expected {clause['speed']} ({lo}-{hi} px/frame), "
                                   f"tracks move {self._describe(long_) or 'no long track'}")
        checks["identity"], credits["identity"] = ident_ok, float(np.mean(ident_credit))
        for kind, results in motion.items():
            if results:
                checks[kind] = all(ok for ok, _ in results)
                credits[kind] = float(np.mean([c for _, c in results]))
        strict = all(checks.values())
        partial = float(np.mean([credits[name] for name in checks]))
        checks = {name: checks[name] for name in CHECKS if name in checks}
        credits = {name: credits[name] for name in CHECKS if name in credits}
        return VideoVerdict(strict=strict, partial=partial, checks=checks, credits=credits, reason="; ".join(reasons),
                            frame_checks=frame_checks, tracks=tracks, frozen=float(all(held)) if held else math.nan)

    def _tracks(self, detections, include, scale: float) -> dict[tuple[str, str | None], list[VideoTrack]]:
        """Tracks of every (class, colour) a clause names (colour None: the class whatever its colour)."""
        out: dict[tuple[str, str | None], list[VideoTrack]] = {}
        for clause in include:
            key = (clause["class"], clause.get("color"))
            if key in out:
                continue
            per_frame = []
            for dets in detections:
                per_frame.append([_centroid(d) for d in dets.get(key[0], [])
                                  if float(d.score) > self.threshold and (key[1] is None or d.color == key[1])])
            out[key] = []
            for frames, points in link_tracks(per_frame, self.match_radius * scale, self.max_gap):
                vx, vy = fit_velocity(frames, points, outlier_px=1.5 * scale)
                out[key].append(VideoTrack(key[0], key[1], frames, points, (vx / scale, vy / scale)))
        return out

    def _moves(self, track: VideoTrack, word: str) -> bool:
        if word == "still":
            return track.speed < self.still_speed
        if track.speed < self.moving_speed:
            return False
        ux, uy = DIRECTIONS[word]
        cos = (track.velocity[0] * ux + track.velocity[1] * uy) / track.speed
        return cos >= math.cos(math.radians(self.direction_tolerance)) - 1e-12

    @staticmethod
    def _describe(tracks: Sequence[VideoTrack]) -> str:
        return ", ".join(f"({tr.velocity[0]:+.2f}, {tr.velocity[1]:+.2f}) px/frame" for tr in tracks)

    # ------------------------------------------------------------------------------------------------ reward

    def __call__(self, videos, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None) -> RewardOutput:
        metadata = list(metadata) if metadata is not None and not isinstance(metadata, Mapping) else metadata
        verdicts = self.judge(videos, metadata)
        if prompts is not None and len(prompts) != len(verdicts):
            raise ValueError(f"got {len(verdicts)} clips but {len(prompts)} prompts")
        strict = torch.tensor([float(v.strict) for v in verdicts], dtype=torch.float32)
        partial = torch.tensor([v.partial for v in verdicts], dtype=torch.float32)
        components = {"strict": strict, "partial": partial}
        tags = [m["tag"] for m in metadata]
        for tag in VIDEO_TAGS:
            mine = torch.tensor([t == tag for t in tags], dtype=torch.bool)  # bool for an empty batch too
            components[f"strict/{tag}"] = torch.where(mine, strict, torch.full_like(strict, math.nan))
            components[f"partial/{tag}"] = torch.where(mine, partial, torch.full_like(partial, math.nan))
        for name in CHECKS:
            components[f"check/{name}"] = torch.tensor([float(v.checks[name]) if name in v.checks else math.nan
                                                        for v in verdicts], dtype=torch.float32)
        components["frozen"] = torch.tensor([v.frozen for v in verdicts], dtype=torch.float32)
        return RewardOutput(scores=components[self.score].clone(), components=components)
