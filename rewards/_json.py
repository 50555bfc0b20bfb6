"""Strict JSON for what the reward package writes (``python -m rewards`` outputs, remote requests): NaN and ±inf
become ``null``. The package never imports ``flowgrpo``; ``flowgrpo.jsonio`` is the same rule for the trainer's files.

>>> dumps({"score": float("nan"), "stats": [1.5, float("-inf")]})
'{"score": null, "stats": [1.5, null]}'
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

__all__ = ["dumps", "finite_or_none"]


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (numpy floats too), at any depth of dicts, lists and tuples, as ``None``."""
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    if isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral):
        value = float(obj)
        return value if math.isfinite(value) else None
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """``json.dumps`` with NaN / ±inf written as ``null``: always strict JSON."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)
