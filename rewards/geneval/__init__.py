"""GenEval reward: the rule engine of GenEval / Flow-GRPO over pluggable detectors.

- :mod:`rewards.geneval.rules` -- the rule engine (pure python over detections);
- :mod:`rewards.geneval.shapes` -- ``shapes`` detector for the embedded world (no weights);
- :mod:`rewards.geneval.real` -- ``real`` detector, Mask2Former + CLIP (imported lazily: transformers);
- :class:`GenEval` -- the reward, ``rewards.load("geneval", detector="shapes" | "real", ...)``;
- :func:`geneval_summary` -- per-tag means and GenEval's overall score of scored samples.
"""

from .reward import GenEval
from .rules import Detection, Verdict, judge, relative_position, select_detections, validate_metadata
from .shapes import ShapesDetector
from .summary import geneval_prefixes, geneval_summary

__all__ = [
    "Detection",
    "GenEval",
    "ShapesDetector",
    "Verdict",
    "geneval_prefixes",
    "geneval_summary",
    "judge",
    "relative_position",
    "select_detections",
    "validate_metadata",
]
