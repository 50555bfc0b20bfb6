"""GenEval's summary of scored samples: per-tag means and the overall score, GenEval's convention.

GenEval reports, per tag, the mean verdict over that tag's images and, as its ``overall``, the plain mean of those
per-tag means over the tags present, so a tag weighs the same whatever its number of prompts or images. The same
is done here for Flow-GRPO's partial credit. The inputs are the per-sample components of a :class:`GenEval` reward
(``strict``, ``partial``, and ``strict/<tag>`` / ``partial/<tag>``, NaN outside the tag), bare or under a prefix
inside ``reward=multi`` (``geneval/strict``, ...), and optionally the GenEval metadata of the samples.

The video reward :class:`~rewards.geneval.video.VideoGenEval` (``video_geneval``) returns the same columns for its
own tags (:data:`~rewards.geneval.video.VIDEO_TAGS`: ``motion``, ``two_object_motion``, ``counting``, ``colors``,
``speed``, ``static``), so everything here works for it too: a prefix qualifies with either tag set's per-tag
columns, and without metadata the tags are those of the set found there.

>>> import torch
>>> comps = {"strict": torch.tensor([1.0, 0.0, 1.0]), "partial": torch.tensor([1.0, 0.5, 1.0])}
>>> s = geneval_summary(comps, [{"tag": "colors"}, {"tag": "colors"}, {"tag": "position"}])
>>> s["per_tag"]["colors"], s["overall"], s["overall_partial"]
({'strict': 0.5, 'partial': 0.75, 'n': 2}, 0.75, 0.875)
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from .rules import TAGS
from .video import VIDEO_TAGS

__all__ = ["geneval_prefixes", "geneval_summary"]

_KINDS = ("strict", "partial")
TAG_SETS: tuple[tuple[str, ...], ...] = (TAGS, VIDEO_TAGS)  # image GenEval, video GenEval


def geneval_prefixes(components: Mapping[str, Any]) -> list[str]:
    """Component-name prefixes under which a GenEval reward's components sit: ``""`` for a bare
    :class:`~rewards.GenEval`, ``"<prefix>/"`` for one inside ``reward=multi`` (``"geneval/"`` by default).

    A prefix qualifies when its ``strict``, ``partial`` and every per-tag ``strict/<tag>`` / ``partial/<tag>`` of
    the image tags or of the video tags are all there, as a GenEval (or ``video_geneval``) reward returns them in
    every batch; other rewards' components never match.
    """
    prefixes = [""] + [name[: -len("strict")] for name in components if name.endswith("/strict")]
    return [p for p in prefixes if all(p + kind in components for kind in _KINDS) and _tags_at(components, p)]


def _tags_at(components: Mapping[str, Any], prefix: str, kinds: Sequence[str] = _KINDS) -> tuple[str, ...]:
    """The tags whose per-tag columns ``<kind>/<tag>`` are all there under ``prefix``: those of every complete tag
    set, in order."""
    tags: dict[str, None] = {}
    for tag_set in TAG_SETS:
        if all(f"{prefix}{kind}/{tag}" in components for kind in kinds for tag in tag_set):
            tags |= dict.fromkeys(tag_set)
    return tuple(tags)


def _column(values, name: str) -> torch.Tensor:
    t = torch.as_tensor(values).detach().to("cpu", torch.float64)
    if t.ndim != 1:
        raise ValueError(f"GenEval component {name!r} must be 1-D [N], got shape {tuple(t.shape)}")
    return t


def geneval_summary(
    components: Mapping[str, Any],
    metadata: Sequence[Mapping] | None = None,
    *,
    prefix: str = "",
) -> dict[str, Any]:
    """Per-tag means and GenEval's overall score of scored samples.

    Args:
        components: per-sample components ``{name: [N]}`` of a GenEval reward (tensors or sequences).
        metadata: the samples' GenEval metadata (``N`` dicts with a ``tag``). Without it, each sample's tag is read
            from the per-tag components ``strict/<tag>`` (the sample's value there, NaN under the other tags), over
            the image tags or the video tags, whichever set of columns is there.
        prefix: where the GenEval components sit: ``""`` for a bare GenEval reward, ``"geneval/"`` for
            ``reward=multi``'s default (see :func:`geneval_prefixes`).

    Returns:
        ``{"per_tag": {tag: {"strict", "partial", "n"}}, "overall", "overall_partial"}``: per tag (first-seen order
        with ``metadata``; without, GenEval's tag order or the video tags' order) the mean verdict and partial credit
        over its ``n`` samples (NaN values skipped); ``overall`` / ``overall_partial`` the mean of the per-tag means
        over the tags that have at least one sample (GenEval's convention), NaN when none has.
    """
    strict = _column(components[f"{prefix}strict"], f"{prefix}strict")
    partial = _column(components[f"{prefix}partial"], f"{prefix}partial")
    if len(strict) != len(partial):
        raise ValueError(f"{prefix}strict has {len(strict)} samples but {prefix}partial has {len(partial)}")
    if metadata is not None:
        metadata = list(metadata)
        if len(metadata) != len(strict):
            raise ValueError(f"got {len(metadata)} metadata dicts for {len(strict)} scored samples")
        tags = [str(m["tag"]) for m in metadata]
        rows = {tag: torch.tensor([t == tag for t in tags], dtype=torch.bool) for tag in dict.fromkeys(tags)}
    else:
        tags = _tags_at(components, prefix, kinds=("strict",))
        if not tags:
            raise KeyError(f"no per-tag columns {prefix}strict/<tag> for the image tags {TAGS} or the video tags "
                           f"{VIDEO_TAGS}; pass metadata= to name the samples' tags")
        rows = {tag: ~torch.isnan(_column(components[f"{prefix}strict/{tag}"], f"{prefix}strict/{tag}")) for tag in tags}
    per_tag: dict[str, dict[str, float | int]] = {}
    for tag, mine in rows.items():
        s, p = strict[mine], partial[mine]
        kept = ~torch.isnan(s) & ~torch.isnan(p)
        if not kept.any():  # a tag without a scored sample is absent, as in GenEval's table
            continue
        per_tag[tag] = {"strict": float(s[kept].mean()), "partial": float(p[kept].mean()), "n": int(kept.sum())}
    if not per_tag:
        return {"per_tag": {}, "overall": math.nan, "overall_partial": math.nan}
    return {
        "per_tag": per_tag,
        "overall": math.fsum(v["strict"] for v in per_tag.values()) / len(per_tag),
        "overall_partial": math.fsum(v["partial"] for v in per_tag.values()) / len(per_tag),
    }
