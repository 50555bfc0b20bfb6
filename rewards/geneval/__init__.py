"""GenEval reward: the rule engine of GenEval / Flow-GRPO over pluggable detectors.

- :mod:`rewards.geneval.rules` -- the rule engine (pure python over detections);
- :mod:`rewards.geneval.shapes` -- ``shapes`` detector for the embedded world (no weights);
- :mod:`rewards.geneval.real` -- ``real`` detector, Mask2Former + CLIP (imported lazily: transformers);
- :class:`GenEval` -- the reward, ``rewards.load("geneval", detector="shapes" | "real", ...)``;
- :class:`VideoGenEval` -- the same rules per frame plus tracks (motion, speed, identity) for moving-shapes clips,
  ``rewards.load("video_geneval")`` (:mod:`rewards.geneval.video`);
- :func:`geneval_summary` -- per-tag means and GenEval's overall score of scored samples (image or video tags).
"""

from .reward import GenEval
from .rules import Detection, Verdict, judge, relative_position, select_detections, validate_metadata
from .shapes import ShapesDetector
from .summary import geneval_prefixes, geneval_summary
from .video import VIDEO_TAGS, VideoGenEval, VideoVerdict

__all__ = [
    "Detection",
    "GenEval",
    "ShapesDetector",
    "VIDEO_TAGS",
    "Verdict",
    "VideoGenEval",
    "VideoVerdict",
    "geneval_prefixes",
    "geneval_summary",
    "judge",
    "relative_position",
    "select_detections",
    "validate_metadata",
]
