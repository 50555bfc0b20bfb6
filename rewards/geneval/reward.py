"""The ``geneval`` reward: a detector + the GenEval rule engine (:mod:`rewards.geneval.rules`).

Components of the returned :class:`~rewards.RewardOutput` (all ``[B]`` float32):

- ``partial`` (= ``scores``): Flow-GRPO's partial credit, the training scalar. With the default
  ``partial_credit="flowgrpo"`` it is bit-for-bit the reference reward server's (on images with content), so it
  can be negative (count credit unclipped) -- see :mod:`rewards.geneval.rules`; ``"clipped"`` keeps it in [0, 1].
- ``strict``: GenEval's benchmark verdict (0/1); the mean over tags of its per-tag means is the GenEval score
  (:func:`~rewards.geneval.summary.geneval_summary` computes it, with the same for ``partial``).
- ``exact``: Flow-GRPO's ``strict_correct`` (0/1): exact counts, no exclude clauses.
- ``strict/<tag>``, ``partial/<tag>`` for the six tags: the sample's value where the sample has that tag
  and **NaN elsewhere** (Flow-GRPO uses -10 there); average them with ``torch.nanmean``. Every key is
  present in every batch, so loggers see a fixed set of columns.

Degenerate images score 0 whatever the detector: an image that is uniform (all black, all white, one flat colour)
or pure noise (:func:`rewards.images.degenerate`) is judged as showing no object at all, so every tag's partial
credit is 0 and ``strict`` / ``exact`` fail (the reason says why); the detector never sees it. Images holding NaN
or inf raise ``ValueError`` naming the samples (a diverged model; cast to uint8 they would read as black).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..base import RewardOutput, register
from ..images import degenerate, to_uint8_images
from .rules import (
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    POSITION_THRESHOLD,
    TAGS,
    THRESHOLD,
    Verdict,
    judge,
    validate_metadata,
)
from .shapes import ShapesDetector

__all__ = ["GenEval", "SCORES"]

SCORES = ("partial", "strict", "exact")  # components that can be the training scalar (``score=``)


@register("geneval")
class GenEval:
    """GenEval reward over a detector: ``reward(images, prompts, metadata) -> RewardOutput``.

    Args:
        detector: ``"shapes"`` (the embedded world, no weights), ``"real"`` (Mask2Former + CLIP, see
            :class:`rewards.geneval.real.RealDetector`) or any callable
            ``detector(list_of_uint8_HWC_arrays, metadata_list) -> [{class: [Detection, ...]}, ...]``
            with optional ``classes`` / ``colors`` attributes used to validate the metadata.
        threshold, counting_threshold, max_objects, position_threshold: GenEval's constants.
        partial_credit: ``"flowgrpo"`` (reference-exact) or ``"clipped"``.
        score: the component returned as ``scores`` (the training scalar): ``"partial"`` (Flow-GRPO's partial
            credit, default), ``"strict"`` (GenEval's verdict) or ``"exact"``. Every component is returned
            whatever this is.
        **detector_kwargs: passed to the named detector (e.g. ``detector_path=``, ``clip_path=``, ``device=``).

    >>> import numpy as np, rewards
    >>> img = np.full((64, 64, 3), 255, np.uint8); img[20:30, 10:20] = (220, 30, 30)
    >>> reward = rewards.load("geneval", detector="shapes")
    >>> out = reward([img], ["a photo of a red square"],
    ...              [{"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}]}])
    >>> out.scores.tolist(), out.components["strict"].tolist()
    ([1.0], [1.0])
    """

    def __init__(
        self,
        detector: str | object = "shapes",
        *,
        threshold: float = THRESHOLD,
        counting_threshold: float = COUNTING_THRESHOLD,
        max_objects: int = MAX_OBJECTS,
        position_threshold: float = POSITION_THRESHOLD,
        partial_credit: str = "flowgrpo",
        score: str = "partial",
        **detector_kwargs,
    ):
        if partial_credit not in ("flowgrpo", "clipped"):
            raise ValueError(f"partial_credit must be 'flowgrpo' or 'clipped', got {partial_credit!r}")
        if score not in SCORES:
            raise ValueError(f"GenEval score={score!r} is not one of {', '.join(SCORES)}")
        if detector == "shapes":
            self.detector = ShapesDetector(**detector_kwargs)
        elif detector == "real":
            from .real import RealDetector  # transformers is imported only for this path

            self.detector = RealDetector(**detector_kwargs)
        elif isinstance(detector, str):
            raise ValueError(f"unknown GenEval detector {detector!r}; expected 'shapes' or 'real' (or a detector object)")
        elif callable(detector):
            if detector_kwargs:
                raise ValueError(f"detector kwargs {sorted(detector_kwargs)} given with a ready-made detector object")
            self.detector = detector
        else:
            raise ValueError(f"detector must be 'shapes', 'real' or a callable, got {type(detector).__name__}")
        self.threshold = threshold
        self.counting_threshold = counting_threshold
        self.max_objects = max_objects
        self.position_threshold = position_threshold
        self.partial_credit = partial_credit
        self.score = score

    def check_metadata(self, metadata: dict) -> None:
        """Raise ``ValueError`` naming the field when one metadata record does not fit this reward's schema
        (tag, clauses, and the detector's classes and colours): lets a trainer check a prompt file up front."""
        validate_metadata(metadata, getattr(self.detector, "classes", None), getattr(self.detector, "colors", None),
                          where="record")

    def judge(self, images, metadata: Sequence[dict] | None) -> list[Verdict]:
        """Per-image verdicts (detections, reasons) -- what ``__call__`` condenses into tensors."""
        arrays = to_uint8_images(images, reward="geneval")
        if metadata is None:
            raise ValueError("GenEval needs one GenEval metadata dict per image (argument 'metadata'), got None")
        if isinstance(metadata, dict):
            raise ValueError("metadata must be a list with one GenEval metadata dict per image, got a single dict")
        metadata = list(metadata)
        if len(metadata) != len(arrays):
            raise ValueError(f"got {len(arrays)} images but {len(metadata)} metadata dicts")
        classes = getattr(self.detector, "classes", None)
        colors = getattr(self.detector, "colors", None)
        metadata = [validate_metadata(m, classes, colors, where=f"metadata[{i}]") for i, m in enumerate(metadata)]
        flags = degenerate(arrays)
        content = [i for i, flag in enumerate(flags) if flag is None]
        found = self.detector([arrays[i] for i in content], [metadata[i] for i in content]) if content else []
        detections: list = [{} for _ in arrays]  # a degenerate image shows no object
        for i, dets in zip(content, found):
            detections[i] = dets
        verdicts = []
        for dets, meta, flag in zip(detections, metadata, flags):
            verdict = judge(
                dets,
                meta,
                threshold=self.threshold,
                counting_threshold=self.counting_threshold,
                max_objects=self.max_objects,
                position_threshold=self.position_threshold,
                partial_credit=self.partial_credit,
            )
            if flag is not None:
                verdict.reason = f"degenerate image ({flag}): no content, scored 0"
            verdicts.append(verdict)
        return verdicts

    def __call__(self, images, prompts: Sequence[str] | None = None, metadata: Sequence[dict] | None = None) -> RewardOutput:
        metadata = list(metadata) if metadata is not None and not isinstance(metadata, dict) else metadata
        verdicts = self.judge(images, metadata)
        if prompts is not None and len(prompts) != len(verdicts):
            raise ValueError(f"got {len(verdicts)} images but {len(prompts)} prompts")
        partial = torch.tensor([v.partial for v in verdicts], dtype=torch.float32)
        strict = torch.tensor([float(v.strict) for v in verdicts], dtype=torch.float32)
        exact = torch.tensor([float(v.exact) for v in verdicts], dtype=torch.float32)
        components = {"partial": partial, "strict": strict, "exact": exact}
        tags = [m["tag"] for m in metadata]
        for tag in TAGS:
            mine = torch.tensor([t == tag for t in tags], dtype=torch.bool)  # bool for an empty batch too
            components[f"strict/{tag}"] = torch.where(mine, strict, torch.full_like(strict, math.nan))
            components[f"partial/{tag}"] = torch.where(mine, partial, torch.full_like(partial, math.nan))
        return RewardOutput(scores=components[self.score].clone(), components=components)
