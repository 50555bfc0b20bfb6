"""The embedded "shapes" world: a renderer and GenEval-style prompts, for images and for videos (moving shapes).

Everything here is pure numpy/PIL so that tests, the tiny-pipeline pretraining and the evaluation
scripts can draw ground-truth scenes for any GenEval metadata dict (positives and negatives alike)::

    >>> from flowgrpo.world import metadata_for, render
    >>> meta = metadata_for("position", classes=("circle", "triangle"), relation="left of")
    >>> meta["prompt"]
    'a photo of a circle left of a triangle'
    >>> render(meta, seed=0).size
    (64, 64)
"""

from .prompts import (
    COUNT_WORDS,
    PERTURBATIONS,
    RELATIONS,
    TAGS,
    all_metadata,
    metadata_for,
    perturb,
    prompt_for,
    split_prompts,
)
from .motion import (
    DIRECTIONS,
    MOTION_PERTURBATIONS,
    MOTION_TAGS,
    NUM_FRAMES,
    SPEEDS,
    Track,
    all_motion_metadata,
    corrupt_motion,
    draw_clip,
    draw_frames,
    motion_metadata_for,
    motion_prompt_for,
    perturb_motion,
    render_clip,
    sample_tracks,
    split_motion_prompts,
)
from .render import (
    BACKGROUND,
    CLASSES,
    PALETTE,
    Shape,
    draw,
    render,
    render_array,
    sample_scene,
    shape_box,
)

__all__ = [
    "DIRECTIONS",
    "MOTION_PERTURBATIONS",
    "MOTION_TAGS",
    "NUM_FRAMES",
    "SPEEDS",
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
    "BACKGROUND",
    "CLASSES",
    "COUNT_WORDS",
    "PALETTE",
    "PERTURBATIONS",
    "RELATIONS",
    "TAGS",
    "Shape",
    "all_metadata",
    "draw",
    "metadata_for",
    "perturb",
    "prompt_for",
    "render",
    "render_array",
    "sample_scene",
    "shape_box",
    "split_prompts",
]
from . import streams as _streams
from .streams import *  # noqa: E402,F401,F403  (the streams API, listed in streams.__all__)

__all__ += _streams.__all__

from . import resume as _resume  # noqa: E402
from .resume import *  # noqa: E402,F401,F403  (resume streams, listed in resume.__all__)

__all__ += _resume.__all__
