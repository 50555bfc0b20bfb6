"""Strict JSON for every file the project writes: NaN and ±inf become ``null``.

Python's ``json.dumps`` writes ``NaN`` / ``Infinity``, which strict parsers (JavaScript's ``JSON.parse``, ``jq``,
most JSON libraries) refuse. A NaN is a real value in our logs: a per-tag reward component of a batch without that
tag, an undefined statistic. Written as ``null`` it stays "no value", and every file stays JSON.

>>> dumps({"reward/mean": 0.5, "reward/partial/counting": float("nan"), "eval": [float("inf"), 1]})
'{"reward/mean": 0.5, "reward/partial/counting": null, "eval": [null, 1]}'

Readers get ``None`` where the value was not finite (``loads`` turns it back into NaN where a number is wanted:
``nan_to_float``). No torch import here: light scripts use it.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

__all__ = ["dumps", "finite_or_none", "nan_to_float"]


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, ±inf; numpy floats too), at any depth of dicts, lists and tuples,
    replaced by ``None``; tuples become lists (as JSON writes them). Other values are left as they are."""
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    if isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral):
        value = float(obj)
        return value if math.isfinite(value) else None
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """``json.dumps`` with NaN / ±inf written as ``null`` (:func:`finite_or_none`); the output is strict JSON (any
    non-finite float left, e.g. one a ``default=`` hook returns, raises ``ValueError``)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


def nan_to_float(value: Any) -> float:
    """A number read from one of our JSON files as a float: ``None`` (a value that was not finite) is NaN."""
    return math.nan if value is None else float(value)
