"""The GenEval rule engine: verdicts from per-class detections and a GenEval metadata dict.

Reproduces, on any detector's output, the two rule sets that matter for Flow-GRPO:

- **GenEval's benchmark verdict** (``strict``), github djghosh13/geneval ``evaluation/evaluate_images.py``
  (``evaluate``) [code]: detections per class with score ``> threshold`` (0.3; 0.9 for the ``counting``
  tag), sorted by score, at most 16. Include clauses are AND-ed: take the top ``count`` detections of the
  class, fail if fewer; a ``color`` clause needs the required colour on at least ``count`` of them; a
  ``position`` clause ``[relation, target]`` needs the relation between every one of them and every
  object matched by clause ``target`` (fail if that clause failed). Exclude clauses are OR-ed: the image
  fails when at least ``count`` detections of the class are present.
- **Flow-GRPO's training reward** (``partial`` and ``exact``), github yifan123/reward-server
  ``reward_server/gen_eval.py`` (``evaluate_reward``) [code]: per include clause, over *all* kept
  detections of the class (n of them), a list of credits is built: the count credit ``1 - |count - n| /
  count``; if ``n != count`` also a 0 when the clause has a colour or position; else the colour credit
  ``1 - |count - k| / count`` (k = detections of the required colour) and, if the colour matched, the
  position credit. The score is the mean of the whole list. ``exact`` is its 0/1 companion (exact counts,
  every colour, every relation; exclude clauses are *not* consulted there).

``partial_credit="flowgrpo"`` (default) keeps two quirks of the reference code on purpose, so that scores
are comparable with Flow-GRPO's: the count credit is not clipped (it is negative when more than ``2 *
count`` objects are found), and a failed position appends 0 *and then* 1 (a failed relation scores 0.75,
not 2/3, on a position prompt). ``partial_credit="clipped"`` is our cleaned variant: count
credit clipped at 0 and a position credit of exactly 0 or 1.

The position rule (``relative_position``): box centres ``c``, box sizes ``d``; ``offset = c_A - c_B``;
``rev = max(|offset| - 0.1 (d_A + d_B), 0) * sign(offset)`` per axis; no relation if every ``|rev| <
1e-3``; else ``(dx, dy) = rev / |offset|``: ``dx < -0.5`` left of, ``dx > 0.5`` right of, ``dy < -0.5``
above, ``dy > 0.5`` below (image y grows downwards). Several relations can hold at once (diagonals).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

__all__ = [
    "COUNTING_THRESHOLD",
    "MAX_OBJECTS",
    "POSITION_THRESHOLD",
    "RELATIONS",
    "TAGS",
    "THRESHOLD",
    "Detection",
    "Verdict",
    "flowgrpo_reward",
    "geneval_correct",
    "judge",
    "position_direction",
    "relative_position",
    "select_detections",
    "validate_metadata",
]

THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
POSITION_THRESHOLD = 0.1
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")


@dataclass
class Detection:
    """One detected object: box ``(x1, y1, x2, y2)`` in pixels (y down), confidence, colour name, mask."""

    box: tuple[float, float, float, float]
    score: float
    color: str | None = None
    mask: np.ndarray | None = field(default=None, repr=False)

    def to_json(self) -> list:
        return [round(float(v), 2) for v in self.box] + [round(float(self.score), 4), self.color]


Detections = Mapping[str, Sequence[Detection]]


@dataclass
class Verdict:
    """The judgement of one image: GenEval's ``strict``, Flow-GRPO's ``exact`` and ``partial``, reasons."""

    strict: bool
    exact: bool
    partial: float
    reason: str
    detections: dict[str, list[Detection]]


# --------------------------------------------------------------------------------------------- metadata


def validate_metadata(
    metadata: object,
    classes: Sequence[str] | None = None,
    colors: Sequence[str] | None = None,
    where: str = "metadata",
    *,
    tags: Sequence[str] | None = None,
    include_keys: Sequence[str] | None = None,
    check_include: Callable[[Mapping, str, int], None] | None = None,
    kind: str = "GenEval",
) -> dict:
    """Check one GenEval metadata dict; raise ``ValueError`` naming the offending field.

    The one validator of GenEval-style metadata: the image world's (the defaults) and, with its own ``tags``,
    ``include_keys`` and ``check_include``, the video world's (``rewards.geneval.video.validate_video_metadata``).
    Every clause is checked for its class, count, colour and for keys outside ``include_keys`` (an exclude clause:
    ``EXCLUDE_KEYS``), which are refused naming the nearest known one.

    Args:
        classes / colors: the names the detector knows (None: anything goes).
        tags: the tags a record may have (default: GenEval's six, :data:`TAGS`).
        include_keys: the keys an include clause may have (default: :data:`INCLUDE_KEYS`).
        check_include: ``(clause, where, index)``, the world's own checks of an include clause (default: the image
            world's position rule, ``[relation, index of an earlier clause]``).
        kind: what the record is called in the message of a record that is not a dict.
    """
    tags = TAGS if tags is None else tuple(tags)
    include_keys = INCLUDE_KEYS if include_keys is None else tuple(include_keys)
    check_include = _check_position if check_include is None else check_include
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{where}: expected a {kind} metadata dict, got {type(metadata).__name__}")
    tag = metadata.get("tag")
    if tag not in tags:
        raise ValueError(f"{where}.tag: expected one of {tags}, got {tag!r}")
    include = metadata.get("include")
    if not isinstance(include, Sequence) or isinstance(include, str) or len(include) == 0:
        raise ValueError(f"{where}.include: expected a non-empty list of clauses, got {include!r}")
    for i, clause in enumerate(include):
        here = f"{where}.include[{i}]"
        _check_clause(clause, here, classes, include_keys)
        color = clause.get("color")
        if color is not None and (not isinstance(color, str) or (colors is not None and color not in colors)):
            raise ValueError(f"{here}.color: expected one of {tuple(colors or ())}, got {color!r}")
        check_include(clause, here, i)
    exclude = metadata.get("exclude", [])
    if exclude is None:
        exclude = []
    if not isinstance(exclude, Sequence) or isinstance(exclude, str):
        raise ValueError(f"{where}.exclude: expected a list of clauses, got {exclude!r}")
    for i, clause in enumerate(exclude):
        _check_clause(clause, f"{where}.exclude[{i}]", classes, EXCLUDE_KEYS)
    return dict(metadata)


def _check_position(clause: Mapping, where: str, index: int) -> None:
    """An image include clause's ``position``: ``[relation, index of an earlier include clause]``."""
    pos = clause.get("position")
    if pos is None:
        return
    if not isinstance(pos, Sequence) or isinstance(pos, str) or len(pos) != 2:
        raise ValueError(f"{where}.position: expected [relation, target clause index], got {pos!r}")
    relation, target = pos
    if relation not in RELATIONS:
        raise ValueError(f"{where}.position[0]: expected one of {RELATIONS}, got {relation!r}")
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= int(target) < index:
        raise ValueError(
            f"{where}.position[1]: expected the index of an earlier include clause "
            f"(0..{index - 1}), got {target!r}"
        )


#: the keys a clause may have: an include clause of an image prompt, an exclude clause (of any prompt)
INCLUDE_KEYS = ("class", "count", "color", "position")
EXCLUDE_KEYS = ("class", "count")


def _check_clause(clause: object, where: str, classes: Sequence[str] | None,
                  keys: Sequence[str] = INCLUDE_KEYS) -> None:
    """Check the clause's class and count, and that it has no key outside ``keys``: a misspelt key
    (``"colour"``) would otherwise be ignored and the clause judged without it."""
    if not isinstance(clause, Mapping):
        raise ValueError(f"{where}: expected a clause dict with 'class' and 'count', got {clause!r}")
    for key in clause:
        if key not in keys:
            near = difflib.get_close_matches(str(key), keys, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{where}: unknown key {key!r}{hint}; a clause here takes {', '.join(keys)}")
    cls = clause.get("class")
    if not isinstance(cls, str) or (classes is not None and cls not in classes):
        known = f"one of the detector's classes ({', '.join(classes)})" if classes is not None else "a class name"
        raise ValueError(f"{where}.class: expected {known}, got {cls!r}")
    count = clause.get("count")
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"{where}.count: expected a positive int, got {count!r}")


# ------------------------------------------------------------------------------------------- detections


def select_detections(
    detections: Detections,
    tag: str,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
) -> dict[str, list[Detection]]:
    """GenEval's filtering: score strictly above the threshold (0.9 for ``counting``), best first, <= 16."""
    cut = counting_threshold if tag == "counting" else threshold
    kept: dict[str, list[Detection]] = {}
    for cls, dets in detections.items():
        good = sorted((d for d in dets if float(d.score) > cut), key=lambda d: -float(d.score))[:max_objects]
        if good:
            kept[cls] = good
    return kept


def position_direction(box_a, box_b, threshold: float = POSITION_THRESHOLD) -> tuple[float, float] | None:
    """GenEval's normalised revised offset ``(dx, dy)`` of box A relative to box B, or None (no relation)."""
    boxes = np.asarray([box_a[:4], box_b[:4]], dtype=np.float64).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=1)
    dim_a, dim_b = np.abs(boxes[:, 1] - boxes[:, 0])
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - threshold * (dim_a + dim_b), 0.0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return None
    dx, dy = revised / np.linalg.norm(offset)
    return float(dx), float(dy)


def relative_position(box_a, box_b, threshold: float = POSITION_THRESHOLD) -> set[str]:
    """Relations of A relative to B under GenEval's rule (a set: a diagonal gives two, an overlap none)."""
    direction = position_direction(box_a, box_b, threshold)
    relations: set[str] = set()
    if direction is None:
        return relations
    dx, dy = direction
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _colors(found: Sequence[Detection], cls: str) -> list[str | None]:
    colors = [d.color for d in found]
    if any(c is None for c in colors):
        raise ValueError(f"a colour clause needs detection colours, but the detector left some {cls!r} detections without one")
    return colors


def _relation_failure(found, targets, relation, threshold) -> str | None:
    for obj in found:
        for target in targets:
            true = relative_position(obj.box, target.box, threshold)
            if relation not in true:
                return f"expected {relation} target, found {' and '.join(sorted(true)) or 'no relation to'} target"
    return None


# ------------------------------------------------------------------------------------------------ rules


def geneval_correct(kept: Detections, metadata: Mapping, position_threshold: float = POSITION_THRESHOLD) -> tuple[bool, str]:
    """GenEval's benchmark verdict on already-selected detections (see :func:`select_detections`)."""
    correct = True
    reasons: list[str] = []
    matched_groups: list[list[Detection] | None] = []
    for req in metadata["include"]:
        cls, count = req["class"], int(req["count"])
        matched = True
        found = list(kept.get(cls, []))[:count]
        if len(found) < count:
            correct = matched = False
            reasons.append(f"expected {cls}>={count}, found {len(found)}")
        else:
            if req.get("color") is not None:
                colors = _colors(found, cls)
                if colors.count(req["color"]) < count:
                    correct = matched = False
                    found_color = colors.count(req["color"])
                    reasons.append(f"expected {req['color']} {cls}>={count}, found {found_color} {req['color']}: {colors}")
            if req.get("position") is not None and matched:
                relation, target = req["position"][0], int(req["position"][1])
                if matched_groups[target] is None:
                    correct = matched = False
                    reasons.append(f"no target for {cls} to be {relation}")
                else:
                    failure = _relation_failure(found, matched_groups[target], relation, position_threshold)
                    if failure is not None:
                        correct = matched = False
                        reasons.append(f"{cls}: {failure}")
        matched_groups.append(found if matched else None)
    for req in metadata.get("exclude") or []:
        cls, count = req["class"], int(req["count"])
        if len(kept.get(cls, [])) >= count:
            correct = False
            reasons.append(f"expected {cls}<{count}, found {len(kept[cls])}")
    return correct, "; ".join(reasons)


def flowgrpo_reward(
    kept: Detections,
    metadata: Mapping,
    position_threshold: float = POSITION_THRESHOLD,
    partial_credit: str = "flowgrpo",
) -> tuple[bool, float, str]:
    """Flow-GRPO's ``(exact, partial, reason)`` on already-selected detections (module doc for the rules)."""
    if partial_credit not in ("flowgrpo", "clipped"):
        raise ValueError(f"partial_credit must be 'flowgrpo' or 'clipped', got {partial_credit!r}")
    clipped = partial_credit == "clipped"
    exact = True
    reasons: list[str] = []
    credits: list[float] = []
    matched_groups: list[list[Detection] | None] = []
    for req in metadata["include"]:
        cls, count = req["class"], int(req["count"])
        matched = True
        found = list(kept.get(cls, []))
        count_credit = 1.0 - abs(count - len(found)) / count
        credits.append(max(count_credit, 0.0) if clipped else count_credit)
        has_color, has_position = req.get("color") is not None, req.get("position") is not None
        if len(found) != count:
            exact = matched = False
            reasons.append(f"expected {cls}=={count}, found {len(found)}")
            if has_color or has_position:
                credits.append(0.0)
        else:
            if has_color:
                k = _colors(found, cls).count(req["color"])
                credits.append(1.0 - abs(count - k) / count)
                if k != count:
                    exact = matched = False
                    reasons.append(f"expected {req['color']} {cls}=={count}, found {k}")
            if has_position and matched:
                relation, target = req["position"][0], int(req["position"][1])
                if matched_groups[target] is None:
                    exact = matched = False
                    reasons.append(f"no target for {cls} to be {relation}")
                    credits.append(0.0)
                else:
                    failure = _relation_failure(found, matched_groups[target], relation, position_threshold)
                    if failure is not None:
                        exact = matched = False
                        reasons.append(f"{cls}: {failure}")
                        credits.append(0.0)
                        if not clipped:
                            credits.append(1.0)  # reference quirk: appended after the pair loop regardless
                    else:
                        credits.append(1.0)
        matched_groups.append(found if matched else None)
    partial = sum(credits) / len(credits) if credits else 0.0
    return exact, float(partial), "; ".join(reasons)


def judge(
    detections: Detections,
    metadata: Mapping,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    position_threshold: float = POSITION_THRESHOLD,
    partial_credit: str = "flowgrpo",
) -> Verdict:
    """Select the detections as GenEval does, then apply both rule sets.

    >>> dets = {"circle": [Detection((0, 0, 10, 10), 0.95, "red")], "square": [Detection((30, 0, 40, 10), 0.8, "blue")]}
    >>> meta = {"tag": "position", "include": [{"class": "square", "count": 1},
    ...                                        {"class": "circle", "count": 1, "position": ["left of", 0]}]}
    >>> v = judge(dets, meta)
    >>> v.strict, v.exact, v.partial
    (True, True, 1.0)
    """
    kept = select_detections(detections, metadata["tag"], threshold, counting_threshold, max_objects)
    strict, reason = geneval_correct(kept, metadata, position_threshold)
    exact, partial, exact_reason = flowgrpo_reward(kept, metadata, position_threshold, partial_credit)
    return Verdict(strict=strict, exact=exact, partial=partial, reason=reason or exact_reason, detections=kept)
