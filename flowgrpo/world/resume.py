"""Resume streams: an object moves one way, then another, pauses, and is told only to move *again*.

A resume stream is a one-object stream (:mod:`flowgrpo.world.streams`) of four segments:

1. *before*: a motion (a direction, with or without a speed word);
2. *last*: another direction -- the motion the object shows just before the pause;
3. *pause*: standing still for ``pause`` frames (8 by default: two latent frames of the video VAE);
4. *resume*: the prompt says only "moving again" ("a red circle moving again"). The right motion is *last*'s, its
   direction and speed word; the segment's metadata carries it (what the ``long_video`` reward judges) and
   ``"resume": true``.

The resume prompt names no direction, so a streaming model can only take it from the frames it has cached. With
blocks of one latent frame, a sink of one and a window of four (the embedded streaming models), the first resumed
block's window holds the pause's two latent frames and the last latent frame of *last*: the answer is in the
model's own window. Older cached frames show *before*, a different direction: a model, or a branch of KVPO's routing,
that attends them instead is led the wrong way. What the stream asks is checked by
:func:`rewards.streams.validate_stream_metadata` (a resume segment follows a pause and asks the motion shown
before it), and the reward's ``resume/direction`` and ``resume/adherence`` components score the resumed segments.

Layouts: switches start at pixel frames ``4m + 1`` (as every stream's), *before*, *last* and *resume* last at least
``min_segment`` frames (12) and the pause exactly ``pause``; with 49 frames the segments start at (0, 13, 25, 33),
(0, 13, 29, 37) or (0, 17, 29, 37). Paths fit the frame as in :func:`~flowgrpo.world.streams.sample_stream_metadata`.

:func:`split_resume_prompts` draws distinct prompt sequences into train / validation / test sets
(``assets/prompts/resume_{train,val,test}.jsonl``, written by ``scripts/make_prompts.py``);
:func:`sample_training_stream` draws pretraining's captions, a share of them resume streams, and
:func:`~flowgrpo.world.streams.corrupt_stream` gives their caption flaw (a resumed segment starts from the motion
shown before its pause).
"""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Sequence

import numpy as np

from rewards.streams import segment_asks

from .motion import motion_metadata_for, motion_prompt_for
from .render import CLASSES, PALETTE
from .streams import (
    MAX_SPAN,
    MIN_SEGMENT,
    STREAM_NUM_FRAMES,
    TEMPORAL_COMPRESSION,
    _distinct_streams,
    _min_spans,
    _sample_segment,
    sample_stream_metadata,
    sequence_key,
    stream_metadata_for,
)

__all__ = ["RESUME_PAUSE", "resume_held_out_sequences", "resume_layouts", "resume_prompt_for", "sample_resume_metadata",
           "sample_training_stream", "split_resume_prompts"]

RESUME_PAUSE = 8  # frames: two latent frames, so a window of four latent frames still holds the motion before it


def resume_prompt_for(segment: dict) -> str:
    """The resume prompt of a segment's objects: ``"a red circle moving again"`` (no direction, no speed)."""
    still = {"tag": "motion", "include": [{k: v for k, v in c.items() if k not in ("motion", "speed")}
                                          for c in segment["include"]]}
    return motion_prompt_for(still) + " moving again"


def resume_layouts(num_frames: int = STREAM_NUM_FRAMES, pause: int = RESUME_PAUSE,
                   min_segment: int = MIN_SEGMENT) -> list[tuple[int, int, int]]:
    """Every ``(last, pause, resume)`` start-frame triple at latent boundaries (module doc)."""
    if pause < 1 or pause % TEMPORAL_COMPRESSION:
        raise ValueError(f"pause={pause}: a pause is a positive multiple of {TEMPORAL_COMPRESSION} frames (whole "
                         "latent frames)")
    out = []
    for a, b in itertools.combinations(range(1, num_frames, TEMPORAL_COMPRESSION), 2):
        c = b + pause
        if a >= min_segment and b - a >= min_segment and num_frames - c >= min_segment:
            out.append((a, b, c))
    return out


def _moving_segment(rng: np.random.Generator, cls: str, color: str) -> dict:
    while True:
        seg = _sample_segment(rng, (cls,), (color,))
        if seg["tag"] != "static":
            return seg


def sample_resume_metadata(rng: np.random.Generator | int | None = None, num_frames: int = STREAM_NUM_FRAMES, *,
                           pause: int = RESUME_PAUSE, min_segment: int = MIN_SEGMENT, max_span: float = MAX_SPAN,
                           tries: int = 2000) -> dict:
    """One random resume stream's metadata (module doc), seeded by ``rng``: one object of a random class and colour,
    *before* and *last* in different directions (a ``motion`` or ``speed`` segment each, shares as the world's
    streams), paths that fit ``max_span``."""
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    layouts = resume_layouts(num_frames, pause, min_segment)
    if not layouts:
        raise ValueError(f"num_frames={num_frames}: no resume layout with segments of >= {min_segment} frames and a "
                         f"pause of {pause}")
    cls = CLASSES[int(rng.integers(len(CLASSES)))]
    color = tuple(PALETTE)[int(rng.integers(len(PALETTE)))]
    for _ in range(tries):
        starts = (0, *layouts[int(rng.integers(len(layouts)))])
        before = _moving_segment(rng, cls, color)
        last = _moving_segment(rng, cls, color)
        if segment_asks(last)[0][0] == segment_asks(before)[0][0]:
            continue  # the same direction: the older frames would not mislead
        halt = motion_metadata_for("static", cls, color, "still")
        again = copy.deepcopy(last) | {"prompt": resume_prompt_for(last), "resume": True}
        meta = stream_metadata_for([before, last, halt, again], starts, num_frames)
        if all(max(span) <= max_span for span in _min_spans(meta)):
            return meta
    raise RuntimeError(f"no resume stream of {num_frames} frames fits max_span={max_span} px in {tries} tries")


def split_resume_prompts(seed: int = 0, sizes: Sequence[int] = (300, 100, 100),
                         num_frames: int = STREAM_NUM_FRAMES) -> list[list[dict]]:
    """Disjoint sets of resume streams of distinct prompt sequences, seeded, of ``sizes`` (train, validation, test):
    one list of metadata per size, in generation order; no prompt sequence in two of them."""
    rows = _distinct_streams(np.random.default_rng(seed), sum(sizes), num_frames, set(), sample=sample_resume_metadata)
    edges = np.cumsum([0, *sizes])
    return [rows[a:b] for a, b in zip(edges, edges[1:])]


@functools.lru_cache(maxsize=1)
def resume_held_out_sequences() -> frozenset[tuple[str, ...]]:
    """The prompt sequences of the resume validation and test sets (seed 0), which pretraining never shows."""
    _, val, test = split_resume_prompts()
    return frozenset(sequence_key(m) for m in val + test)


def sample_training_stream(rng: np.random.Generator, num_frames: int = STREAM_NUM_FRAMES,
                           resume_share: float = 0.0) -> dict:
    """A pretraining caption: a resume stream with probability ``resume_share``, else a stream of
    :func:`~flowgrpo.world.streams.sample_stream_metadata`. At 0 nothing is drawn for the choice, so the draws are
    exactly those of ``sample_stream_metadata``."""
    if resume_share and float(rng.random()) < resume_share:
        return sample_resume_metadata(rng, num_frames)
    return sample_stream_metadata(rng, num_frames)
